"""Timing a verify forward of ``n`` rows: the one function behind every t(n) the harness measures
(prompt lookup's adaptive budget, the Sequoia hardware profile, the benchmark, the GPU check).

``t(n)`` follows Sequoia's convention: ``n`` counts the pending row, so ``t(1)`` is one
autoregressive step and ``t(1 + k)`` verifies ``k`` candidate rows. Every request of the batch
verifies the same tree over the same cached prefix, so there is no padding. The device is
synchronised before each clock read (:class:`~harness.measure.ledger.StageClock`), the rows are
rolled back outside the timed region, and the backend's forward counter is left unchanged.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence

import numpy as np
import torch

from harness.contracts import NO_STATE, ProposalNode, ProposalResult
from harness.measure.hardware import cpu_name, last_level_cache_bytes, total_last_level_cache_bytes
from harness.measure.ledger import StageClock
from harness.target.backend import CacheState, CausalLMBackend
from harness.target.fused_layers import fused_layers_of
from harness.target.options import linear_kernel_of, static_cache_of
from harness.topology.compiler import CompiledTree, compile_tree

#: tree shapes a timing can use: a binary heap (a branching tree with a real ancestor mask) or a chain
TIMING_SHAPES = ("heap", "chain")


def heap_parents(rows: int) -> list[int]:
    """Candidate-row parents of a binary-heap tree with ``rows`` rows (``-1`` = frontier):
    root-inclusive node ``k`` hangs under ``(k - 1) // 2``. ``heap_parents(4) == [-1, -1, 0, 0]``."""
    return [-1 if (k - 1) // 2 == 0 else (k - 1) // 2 - 1 for k in range(1, rows + 1)]


def timing_tree(rows: int, *, prefix_len: int, vocab: int, shape: str = "heap") -> CompiledTree | None:
    """A compiled tree of ``rows`` candidate rows (None for none) with distinct sibling tokens. Token
    values do not change the timing of a dense forward; the shape decides the attention path."""
    if shape not in TIMING_SHAPES:
        raise ValueError(f"timing shape must be one of {TIMING_SHAPES}; got {shape!r}")
    if rows == 0:
        return None
    parents = heap_parents(rows) if shape == "heap" else [k - 1 for k in range(rows)]
    nodes = tuple(
        ProposalNode(token_id=3 + (k % max(vocab - 3, 1)), parent=p, score=1.0, source="profile")
        for k, p in enumerate(parents)
    )
    proposal = ProposalResult(
        nodes=nodes,
        probability_semantics="score_only",
        sampling_relation="deterministic_lookup",
        topology="sequence" if shape == "chain" or rows == 1 else "tree",
        state_handle=NO_STATE,
        manifest_hash="profile",
    )
    tree = compile_tree([proposal], prefix_len=prefix_len)
    if tree.num_rows != rows:
        raise AssertionError(f"timing tree has {tree.num_rows} rows, wanted {rows}")
    return tree


def timed_verify_ms(
    backend: CausalLMBackend, state: CacheState, *, pending: int, tree: CompiledTree | None, clock: StageClock
) -> float:
    """Wall ms of ONE verify forward of ``tree`` for every request of ``state`` (then rolled back)."""
    forwards = backend.forwards
    t0 = clock.now()
    backend.verify(state, [pending] * state.batch_size, [tree] * state.batch_size)
    dt = (clock.now() - t0) * 1e3
    backend.rollback(state)
    backend.forwards = forwards  # profiling forwards are not decode forwards
    return dt


def synthetic_prefix(length: int, vocab: int) -> list[int]:
    """``length`` deterministic token ids (a prefix whose content does not matter to a timing)."""
    return [3 + ((7 * i) % (vocab - 3)) for i in range(length)]


@torch.inference_mode()
def verify_times(
    backend: CausalLMBackend,
    *,
    prefix_ids: Sequence[int],
    ns: Sequence[int],
    batch_size: int = 1,
    shape: str = "heap",
    warmup: int = 1,
    repeats: int = 5,
    rotation: int = 0,
) -> dict[int, list[float]]:
    """Timed samples (ms) of one verify forward of ``n`` rows (pending row included) for each ``n``
    in ``ns``, ``batch_size`` requests over the cached ``prefix_ids`` (its last token pending).
    Each round times every size once, in an order rotated per round so that no size always runs
    first (round ``r`` starts at the ``(r + rotation)``-th size: a caller repeating one-round calls
    passes its count); the first ``warmup`` rounds are excluded."""
    return verify_times_by_shape(
        backend,
        prefix_ids=prefix_ids,
        ns=ns,
        shapes=(shape,),
        batch_size=batch_size,
        warmup=warmup,
        repeats=repeats,
        rotation=rotation,
    )[shape]


@torch.inference_mode()
def verify_times_by_shape(
    backend: CausalLMBackend,
    *,
    prefix_ids: Sequence[int],
    ns: Sequence[int],
    shapes: Sequence[str],
    batch_size: int = 1,
    warmup: int = 1,
    repeats: int = 5,
    rotation: int = 0,
) -> dict[str, dict[int, list[float]]]:
    """:func:`verify_times` for several tree shapes at once, interleaved: each round times every
    size, and every shape of it back to back (the shapes' order reversed every other round), over
    one prefilled cache. Shapes compared this way meet the same machine state: timed one shape after
    the other, each over its own prefill, the one-row forward (the same forward for every shape) came
    out 4.5-8% apart on a CPU whose last-level cache holds most of a small model's weights."""
    if batch_size < 1 or repeats < 1 or warmup < 0 or not ns or min(ns) < 1 or not shapes:
        raise ValueError(
            f"need batch_size >= 1, repeats >= 1, warmup >= 0, sizes >= 1 and a shape; got "
            f"{batch_size}, {repeats}, {warmup}, {list(ns)}, {list(shapes)}"
        )
    prefix = [int(t) for t in prefix_ids]
    if len(prefix) < 2:
        raise ValueError(f"a timing prefix needs >= 2 tokens; got {len(prefix)}")
    clock = StageClock(backend.device)
    sizes = sorted({int(n) for n in ns})
    kinds = list(dict.fromkeys(shapes))
    trees = {
        (sh, n): timing_tree(n - 1, prefix_len=len(prefix), vocab=backend.vocab_size, shape=sh)
        for sh in kinds
        for n in sizes
    }
    state = backend.prefill([prefix] * batch_size)
    samples: dict[str, dict[int, list[float]]] = {sh: {n: [] for n in sizes} for sh in kinds}
    for r in range(warmup + repeats):
        k = (r + rotation) % len(sizes)
        order = kinds if r % 2 == 0 else kinds[::-1]
        for n in sizes[k:] + sizes[:k]:
            for sh in order:
                dt = timed_verify_ms(backend, state, pending=prefix[-1], tree=trees[sh, n], clock=clock)
                if r >= warmup:
                    samples[sh][n].append(dt)
    return samples


def median_verify_ms(backend: CausalLMBackend, **kwargs) -> dict[int, float]:
    """Median of :func:`verify_times` per size."""
    return {n: statistics.median(v) for n, v in verify_times(backend, **kwargs).items()}


def monotone_fit(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators):
    a dip is averaged with the points before it, where a running maximum would carry one slow
    sample's excess over every larger row count."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]
    return [m for m, c in blocks for _ in range(int(c))]


def verify_cost_curve(
    backend: CausalLMBackend,
    prompt_ids: Sequence[int],
    *,
    max_rows: int,
    reps: int = 5,
    points: Sequence[int] = (*range(17), 24, 32, 48, 64),
    batch_size: int = 1,
) -> dict:
    """Median verify time over a real prefix at ``1 + rows`` for the given row counts (every count up
    to 16 by default: register tiles make the curve step, not grow smoothly), interpolated to every
    ``rows <= max_rows`` and made monotone by :func:`monotone_fit` (cost never decreases with more
    rows; the raw medians are kept), each forward of ``batch_size`` requests of that many rows (a
    batched run's verify). Returns ``{"t_ms": [t(1), ..., t(max_rows + 1)], "normalised": [...],
    ...}``: what prompt lookup's adaptive budget needs."""
    pts = sorted({p for p in points if p <= max_rows} | {0, max_rows})
    med = median_verify_ms(
        backend, prefix_ids=prompt_ids, ns=[1 + p for p in pts], batch_size=batch_size, warmup=1, repeats=reps
    )
    raw = [med[1 + p] for p in pts]
    t_ms = np.interp(np.arange(0, max_rows + 1), pts, monotone_fit(raw))
    return {
        "t_ms": t_ms.tolist(),
        "normalised": (t_ms / t_ms[0]).tolist(),
        "measured_rows": pts,
        "measured_ms": raw,
        "prefix_len": len(prompt_ids),
        "reps": reps,
        "batch_size": batch_size,
        "t_profile": {"n": [1 + r for r in pts], "t": raw, "batch_size": batch_size, "prefix_len": len(prompt_ids)},
    }


#: the least bytes of the buffer :func:`read_bandwidth_gbs` reads
BANDWIDTH_BUFFER_BYTES = 256 * 2**20


#: the smallest buffer a GPU's bandwidth is read with (and four times its L2 cache; a quarter of its free
#: memory at most)
MIN_BANDWIDTH_BUFFER_BYTES = 16 << 20


def bandwidth_buffer_bytes(device: str | torch.device = "cpu") -> int:
    """The buffer :func:`read_bandwidth_gbs` reads by default: :data:`BANDWIDTH_BUFFER_BYTES` (on a GPU
    no more than a quarter of its free memory, the allocator's unused pool counted; refused,
    ``ValueError``, where that is under :data:`MIN_BANDWIDTH_BUFFER_BYTES` or four times its L2), or
    on a CPU twice its last-level caches together where that is more (every L3 slice of a
    multi-chiplet part, every socket's: the threads of a sum each read their own part, which their
    own slice can hold). A buffer the cache holds in part is read partly from the cache: on an Intel
    Xeon with a 300 MB L3, 256 MB read at 26-47 GB/s from one sitting to the next, 512 MB to 1 GB at
    26-31 GB/s, and 32-128 MB at 57-63 GB/s."""
    device = torch.device(device)
    if device.type == "cuda":  # its memory may be nearly full (the model's, the allocator's pool)
        # free to the device, and what the allocator holds unused (the buffer is served from its pool)
        free = torch.cuda.mem_get_info(device)[0]
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
        least = max(MIN_BANDWIDTH_BUFFER_BYTES, 4 * l2)  # a buffer the L2 holds in part reads fast
        size = min(BANDWIDTH_BUFFER_BYTES, free // 4)
        if size < least:
            raise ValueError(
                f"{free / 2**20:.0f} MiB free: too little for a read-bandwidth buffer of {least / 2**20:.0f} MiB "
                "(four times the L2 cache)"
            )
        return size
    llc = None
    if device.type == "cpu":
        llc = max((n for n in (last_level_cache_bytes(), total_last_level_cache_bytes()) if n), default=None)
    return max(BANDWIDTH_BUFFER_BYTES, 2 * llc) if llc else BANDWIDTH_BUFFER_BYTES


def read_bandwidth_gbs(
    device: str | torch.device = "cpu",
    *,
    nbytes: int | None = None,
    repeats: int = 7,
    sums_per_sample: int | None = None,
) -> float:
    """Measured read bandwidth (GB/s, 1e9 bytes) of this process from memory: the median of
    ``repeats`` samples, each ``sums_per_sample`` sums of one ``nbytes`` float32 buffer (default:
    :func:`bandwidth_buffer_bytes`, beyond the caches; after one untimed sum that faults its pages
    in). A sum reads each byte once and writes nothing, as a memory-bound matrix-vector product
    streams its weights. On a GPU one sum of the buffer takes tens of microseconds, about what a
    launch and a synchronisation cost, so a sample there is 16 sums between two synchronisations
    (one on CPU, where a sum takes milliseconds)."""
    device = torch.device(device)
    nbytes = bandwidth_buffer_bytes(device) if nbytes is None else nbytes
    inner = max(1, sums_per_sample if sums_per_sample is not None else (1 if device.type == "cpu" else 16))
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    clock = StageClock(device)
    buf.sum()
    times = []
    for _ in range(max(repeats, 1)):
        t0 = clock.now()
        for _ in range(inner):
            buf.sum()
        times.append((clock.now() - t0) / inner)
    return buf.numel() * 4 / statistics.median(times) / 1e9


#: a routed expert's parameters (Mixtral's ``experts.``, DeepSeek's routed ``experts.``; not a shared expert)
_ROUTED_EXPERT = re.compile(r"(?<!shared_)experts\.")


def _active_share(model: torch.nn.Module):
    """Each parameter's share that one row of a forward uses: 1, and for a mixture of experts' routed
    experts the ``num_experts_per_tok`` of their number a row is routed to (a step reads only those)."""
    cfg = getattr(model, "config", None)
    experts = next(
        (
            getattr(cfg, k, None)
            for k in ("num_local_experts", "num_experts", "n_routed_experts")
            if getattr(cfg, k, None)
        ),
        None,
    )
    top_k = getattr(cfg, "num_experts_per_tok", None)
    share = min(float(top_k) / float(experts), 1.0) if experts and top_k else 1.0
    for name, p in model.named_parameters():
        yield p, share if share < 1.0 and _ROUTED_EXPERT.search(name) else 1.0


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied matrices once), a mixture
    of experts' routed experts only for the experts a row is routed to, less the input embedding
    table when it is not also the LM head (a step gathers one of its rows). For a mixture of experts
    this is one row's: a forward of several rows (a batch, a verify) reads at least as much, where
    its rows share their experts, and up to every expert where they do not."""
    total = sum(p.numel() * p.element_size() * share for p, share in _active_share(model))
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        tied = head is not None and getattr(head, "weight", None) is emb.weight
        if not tied:
            total -= emb.weight.numel() * emb.weight.element_size()
    return int(total)


def weight_stream_floor_ms(model: torch.nn.Module, bandwidth_gbs: float) -> float:
    """The autoregressive step's floor: streamed weight bytes / read bandwidth, in ms (a one-row
    forward cannot run faster than it can read its weights once from memory; where the caches hold
    part of the weights between steps, as a 300 MB L3 can hold a 135M-parameter model's, a step can
    take less)."""
    return streamed_weight_bytes(model) / (bandwidth_gbs * 1e9) * 1e3


#: the side of the square product :func:`matmul_peak_gflops` times by default, per device type: large
#: enough that the product runs at the library's full rate (on a GPU a smaller one is launch-bound)
PEAK_MATMUL_SIZE = {"cpu": 2048, "cuda": 8192}


def peak_matmul_size(device_type: str, element_size: int, free_bytes: int | None = None) -> int:
    """The side :func:`matmul_peak_gflops` uses by default: :data:`PEAK_MATMUL_SIZE` for the device
    type, and where ``free_bytes`` is known (a GPU's free memory) no larger than its three matrices
    fit in a quarter of it, a multiple of 256; refused (``ValueError``) below 256."""
    n = PEAK_MATMUL_SIZE.get(device_type, PEAK_MATMUL_SIZE["cpu"])
    if free_bytes is not None:
        n = min(n, int((free_bytes / 4 / (3 * element_size)) ** 0.5) // 256 * 256)
        if n < 256:
            raise ValueError(f"{free_bytes / 2**20:.0f} MiB free: too little for a 256-square product")
    return n


def matmul_peak_gflops(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *, size: int | None = None, repeats: int = 5
) -> float:
    """Measured arithmetic rate (GFLOP/s, two per multiply-add) of this process in ``dtype``: the
    median of ``repeats`` products of two square ``size`` matrices (:data:`PEAK_MATMUL_SIZE` by
    default, on a GPU no larger than the three matrices fit in a quarter of its free memory) by
    torch's own matrix product, after one untimed product. The library's large product
    is as close to the machine's peak as this process gets, so ``flops / matmul_peak_gflops`` is a
    forward's arithmetic floor in the same sense as :func:`weight_stream_floor_ms` is its reading
    floor (on a CPU with AMX torch's bf16 product runs on its tiles)."""
    return matmul_peak(device, dtype, size=size, repeats=repeats)["gflops"]


def matmul_peak(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *, size: int | None = None, repeats: int = 5
) -> dict:
    """:func:`matmul_peak_gflops` with the side of the product that gave it: ``{"gflops", "size"}``.
    A smaller product (a GPU with little free memory) runs further from the peak, so its floors
    are looser; records keep the size beside the rate."""
    device = torch.device(device)
    if size is not None:
        n = size
    else:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        n = peak_matmul_size(device.type, torch.empty(0, dtype=dtype).element_size(), free)
    if n < 1 or repeats < 1:
        raise ValueError(f"need size >= 1 and repeats >= 1; got {n}, {repeats}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    clock = StageClock(device)
    with torch.inference_mode():
        torch.matmul(a, b)
        times = []
        for _ in range(repeats):
            t0 = clock.now()
            torch.matmul(a, b)
            times.append(clock.now() - t0)
    return {"gflops": 2 * n**3 / statistics.median(times) / 1e9, "size": n}


def multiplied_weight_elements(model: torch.nn.Module) -> int:
    """Weights one row of a forward multiplies: the elements of every matrix parameter (tied matrices
    once), less the input embedding table when it is not also the LM head (a row gathers one of its
    rows and multiplies nothing); a mixture of experts' routed experts only for the experts a row is
    routed to."""
    total = sum(p.numel() * share for p, share in _active_share(model) if p.dim() >= 2)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(emb, "weight", None) if emb is not None else None
    if weight is not None and weight.dim() >= 2 and not (head is not None and getattr(head, "weight", None) is weight):
        total -= weight.numel()
    return int(total)


def verify_flops(model: torch.nn.Module, rows: int, *, prefix_len: int) -> float:
    """The least arithmetic of one verify forward of ``rows`` rows over ``prefix_len`` cached tokens:
    two operations per multiplied weight per row (:func:`multiplied_weight_elements`), and attention's
    scores and value sums, ``4 * layers * query heads * head dim`` per key a row reads, counting the
    ``prefix_len + 1`` keys every row reads at least (the prefix and itself; a tree row's ancestors and
    a chain row's predecessors add more). Norms, activations and the softmax are left out."""
    cfg = model.config
    layers, heads = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    per_row = 2 * multiplied_weight_elements(model) + 4 * layers * heads * head_dim * (prefix_len + 1)
    return float(rows * per_row)


def verify_roofline(
    model: torch.nn.Module,
    t_ms: dict[int, float],
    *,
    prefix_len: int,
    bandwidth_gbs: float,
    peak_gflops: float,
    batch_size: int = 1,
    peak_size: int | None = None,
) -> dict:
    """Each measured verify time ``t_ms[n]`` (``n`` rows per request, the pending one included, for
    ``batch_size`` requests in one forward) against the roofline floor of its forward: the larger of
    reading the weights once at ``bandwidth_gbs`` (:func:`weight_stream_floor_ms`) and its least
    arithmetic, ``batch_size * n`` rows' (:func:`verify_flops`), at ``peak_gflops``
    (:func:`matmul_peak_gflops`). ``t_vs_floor`` is how many floors each forward takes;
    ``compute_bound_from`` the fewest rows per request whose arithmetic floor exceeds the reading
    floor, computed from the two rates whether or not a forward that large was measured.
    ``peak_size``, the side of the product that measured ``peak_gflops`` (:func:`matmul_peak`), is
    kept beside it (None where not given)."""
    if bandwidth_gbs <= 0 or peak_gflops <= 0 or batch_size < 1:
        raise ValueError(
            f"need a positive bandwidth, peak and batch size; got {bandwidth_gbs}, {peak_gflops}, {batch_size}"
        )
    ns = sorted(int(n) for n in t_ms)
    stream = weight_stream_floor_ms(model, bandwidth_gbs)
    per_row = verify_flops(model, batch_size, prefix_len=prefix_len) / (peak_gflops * 1e9) * 1e3
    compute = {n: n * per_row for n in ns}
    floor = {n: max(stream, compute[n]) for n in ns}
    crossing = int(stream // per_row) + 1  # rows * per_row > stream from here on
    return {
        "prefix_len": prefix_len,
        "batch_size": batch_size,
        "read_bandwidth_gbs": bandwidth_gbs,
        "matmul_peak_gflops": peak_gflops,
        "matmul_peak_size": peak_size,
        "weight_stream_floor_ms": stream,
        "rows": ns,
        "t_ms": [float(t_ms[n]) for n in ns],
        "compute_floor_ms": [compute[n] for n in ns],
        "floor_ms": [floor[n] for n in ns],
        "t_vs_floor": [float(t_ms[n]) / floor[n] for n in ns],
        "compute_bound_from": crossing,
    }


def profile_roofline(
    model: torch.nn.Module, t_profile: dict, *, bandwidth_gbs: float, peak_gflops: float, peak_size: int | None = None
) -> dict:
    """A run's t(n) profile (``{"n": [...], "t": [...]}``, with its ``batch_size`` and ``prefix_len``
    where it knows them: 1 and 0 where not) with each point's roofline floor added: ``floor_ms``,
    ``t_vs_floor`` and the floors' inputs under ``roofline`` (:func:`verify_roofline`)."""
    roof = verify_roofline(
        model,
        {int(n): float(t) for n, t in zip(t_profile["n"], t_profile["t"], strict=True)},
        prefix_len=int(t_profile.get("prefix_len") or 0),
        bandwidth_gbs=bandwidth_gbs,
        peak_gflops=peak_gflops,
        batch_size=int(t_profile.get("batch_size") or 1),
        peak_size=peak_size,
    )
    floor_of = dict(zip(roof["rows"], roof["floor_ms"], strict=True))
    floors = [floor_of[int(n)] for n in t_profile["n"]]
    keys = (
        "prefix_len",
        "batch_size",
        "read_bandwidth_gbs",
        "matmul_peak_gflops",
        "matmul_peak_size",
        "weight_stream_floor_ms",
    )
    return {
        **t_profile,
        "floor_ms": floors,
        "t_vs_floor": [float(t) / f for t, f in zip(t_profile["t"], floors, strict=True)],
        "roofline": {**{k: roof[k] for k in keys}, "compute_bound_from": roof["compute_bound_from"]},
    }


def timing_host(device: torch.device | str) -> dict:
    """What a timed choice depends on beyond the model: the device's type and name (the CPU's
    model, or the GPU's) and this process's torch threads. An artifact chosen by timing (a
    layer-skip vector) is keyed by it, so one searched elsewhere is never taken for this host's."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return {"device": dev.type, "device_name": name, "threads": torch.get_num_threads()}


def forward_setup(model: torch.nn.Module) -> dict:
    """How ``model``'s forward runs beyond its weights and host: its linear kernels, attention
    implementation, cache kind, fused decoder layers and compilation, and on CUDA whether SDPA may
    take cuDNN's attention kernel (a process-wide switch, ``model.cudnn_attention``, that can change
    a decode step's time several times over). Each changes which of two timed choices is faster."""
    setup = {
        "linear_kernel": sorted(linear_kernel_of(model)),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "static_cache": static_cache_of(model),
        "fused_layers": fused_layers_of(model),
        "compiled": bool(getattr(model, "_harness_compiled", False)),
    }
    if next(model.parameters()).device.type == "cuda":
        setup["cudnn_attention"] = bool(torch.backends.cuda.cudnn_sdp_enabled())
    return setup


def timed_setup(model: torch.nn.Module) -> dict:
    """:func:`timing_host` of the model's device and its :func:`forward_setup`: what an artifact
    chosen by timing the model (a layer-skip vector) is keyed by and records."""
    return {**timing_host(next(model.parameters()).device), **forward_setup(model)}
