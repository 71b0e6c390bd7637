"""Target options that change how a model computes, never what: the linear-layer kernel, the KV
cache's layout and ``torch.compile``. Both arms of a run share one loaded target, so an option
applied here applies to both alike; the options are config keys (``model.linear_kernel``,
``model.static_cache``, ``model.compile``), so the run manifest records them.

Linear kernels (``model.linear_kernel``), each computing ``x @ W.T + b`` for every ``nn.Linear``
of the model (the weights stay where they are: tied matrices stay tied, state dicts unchanged):

- ``default``: ``F.linear`` (MKL sgemm for float32 on x86 CPUs);
- ``onednn``: oneDNN's inner product on dense tensors (``torch.ops.mkldnn._linear_pointwise``);
  needs a CPU oneDNN supports in that dtype (bfloat16 needs AVX-512);
- ``mkl_packed``: MKL's packed sgemm with each weight packed once at load
  (``torch.ops.mkl._mkl_linear``, what the inductor uses for float32 linear layers on CPU); float32
  on CPU only, and it holds a packed copy of every weight next to the original;
- ``weight_major``: the same product computed as ``(W @ x.T).T``, i.e. a GEMM whose long side is the
  weight's N rows and whose short side is the m input rows. For the few rows of a decode or verify
  step, BLAS libraries pick different kernels for the two orientations: on an AMD EPYC, where MKL
  takes its code path for non-Intel CPUs, ``F.linear`` of SmolLM2's 49,152-row LM head takes 14 ms
  for one row and 31 ms for two, where ``W @ x.T`` takes 14 and 10 ms (2 threads, float32); on an
  Intel Xeon the same orientation is the slow one (SmolLM2's verify forward of 2 rows: 91 ms
  against 55 ms with ``F.linear``);
- ``streaming``: the harness's own kernel (:mod:`harness.target.native`, compiled for this CPU on
  first use): each weight row is read from memory once and multiplied into every input row (64
  rows per pass), in float32 or bfloat16 (accumulated in float32, rounded once), with each output
  element reduced in an order that does not depend on how many rows share the forward. A one-row
  step then streams the weights at close to the machine's read bandwidth, and a few rows cost little
  more than one: on an AMD EPYC (Zen 4, AVX-512, 2 threads) SmolLM2's linear products on one row
  take 18.7 ms against 52.5 ms for ``weight_major`` and 53.4 ms for ``F.linear`` (a 17.1 ms
  weight-streaming floor), and its verify forward costs 1.07x a one-row step at 2 rows, 1.09x at 4.
  In bfloat16 the same products read half the bytes: 16 ms on one row against 36 ms for
  ``F.linear`` (oneDNN) on the same CPU;
- ``streaming_panels``: the same kernel over a copy of each weight packed once (made on first use
  and again whenever the weight is replaced or changed in place by a tensor operation; a write
  through ``.data`` is invisible to it, as to autograd; it holds a second copy of the weights). A
  float32 weight goes in panels of 16 output features (``[N / 16, K, 16]``), reduced in the other
  order: each output element one chain of multiply-adds over k, a broadcast input element times a
  panel's vectors, no horizontal sums. It keeps rows invariant the same way and differs from
  ``streaming`` by float32 rounding. On an AMD EPYC without AVX-512 (Zen 3, 2 threads) SmolLM2's
  verify forwards took 0.83-0.89 of ``streaming``'s time at one row, 0.93-0.99 at four and 0.78-0.80
  at 16-32; on an Intel Xeon with AMX, in 512-bit vectors, 0.98-1.06 from one row to four, 0.95 at
  8, 0.82-0.88 at 16 and 0.69-0.77 at 32. A bfloat16 weight goes in pairs (``[N / 16, K / 2, 16, 2]``, K a
  multiple of 32), the layout of AMX's tile multiply, and is multiplied with the tile unit (a CPU
  without AMX is refused): a product costs about the read of its weights from one row to 32. On an Intel Xeon
  with AMX (2 threads) SmolLM2's bfloat16 products took 12.0 ms at one row and 13.0 at 32, against
  14.1 and 62 in the dot order; the AR step came to 1.16-1.17 weight-streaming floors against a
  256 MB read buffer, and to 0.76-1.02 of the floor read from memory (the 300 MB L3 holds part of
  the weights). A layer whose output features are not a multiple of 16 (or, in bfloat16, whose K is
  not one of 32) stays on ``streaming``;
- ``auto`` (the configured default), on an x86 CPU with a C++ compiler to build the native kernels:
  bfloat16 gets ``streaming_panels`` where the kernels multiply with AMX tiles
  (:func:`harness.target.native.pairs_on_amx`), else ``streaming``; float32 gets
  ``streaming_panels`` on an Intel CPU with AVX-512 (a panel is one 512-bit vector: on a Xeon with
  AMX, 2 threads, SmolLM2's verify forward took within a few percent of the dot order's time from
  one row to four and 0.7-0.85 of it at 16-32 rows) and on a non-Intel CPU without AVX-512, ``streaming`` on AMD's
  AVX-512 parts (not measured in panels). An Intel CPU without AVX-512 (not measured) gets
  ``default``. With no compiler: ``weight_major`` in float32 on a non-Intel CPU (measured on AMD
  EPYC: as fast as ``F.linear`` at one row, 15-40% faster at 2 to 32 rows on an AVX2 part) and
  ``default`` otherwise. ``default`` everywhere else (ARM, CUDA, float16). A compiled forward never
  gets ``streaming_panels`` (the panels' staleness check runs outside the graph).

They differ from ``default`` by rounding (summation order) only; greedy equality between the arms
does not depend on it (both arms use the same kernel), and a test checks that greedy output with
each kernel equals greedy output without it on a tiny model. With ``streaming`` and fused layers
(the default wherever ``streaming`` runs) a row's logits are bit-identical however the forwards
were split, a verify row's to a one-row step's and a prefill's to a step's (tests in both dtypes);
in bfloat16 that is what keeps greedy speculation on greedy decoding's tokens, where ``F.linear``'s
row-count-dependent rounding makes them part ways at near-ties (which the greedy gate records).

``model.static_cache``: ``true`` makes every cache the backend builds for this model keep each
layer's keys and values in preallocated buffers written in place (:mod:`harness.target.kv_cache`);
``false`` uses transformers' ``DynamicLayer``, which concatenates the whole cache of every layer in
every forward (a per-forward cost that grows with the context, and that runtimes built for serving
do not pay). The values a forward reads are the same either way. The default (``null``) is
preallocated, except with ``model.compile=true``: the preallocated append runs outside the compiled
graph, one graph break per layer, and that costs a compiled SmolLM2 step more than concatenating
(measured: 54 against 37 ms at a 256-token prefix on an Intel Xeon).

``model.fused_layers``: ``true`` runs each Llama decoder layer as one native call
(:mod:`harness.target.fused_layers`: the layer's products with the streaming kernel, its attention
and element-wise steps in the same library), ``false`` runs transformers' layer forward. The default
(``null``) fuses where the streaming kernel is the linear kernel (float32 or bfloat16 on CPU), the
cache is preallocated and the forward is not compiled; with ``true`` and another linear kernel, that
kernel still computes the LM head and every forward the fused layer hands back to transformers. The
logits equal the unfused forward's to float32 rounding (tests: chains, trees, batches with holes,
successive rounds); in bfloat16 the layer rounds where transformers' bfloat16 operators round and
its logits follow theirs to bfloat16 rounding. Both arms share them. Measured on the AMD EPYC above:
a SmolLM2 step of 21-23 ms against 34-36 ms with transformers' layers on the same kernel. Where every
layer is fused, a forward that asks for nothing only the layer-by-layer loop provides (hidden states,
attentions, layer hooks, a padding mask) runs the whole decoder as one native call, bit for bit what
the layers compute one call each (on an AMD EPYC without AVX-512, medians of interleaved runs: a
step of 48.2 against 50.6 ms in fp32, 29.1 against 34.7 ms in bf16).

``model.compile``: ``torch.compile(dynamic=True)`` of the model's forward (its ``__call__``: the
backend's forward signature checks still see the original ``forward``), so varying verify row
counts and cache lengths do not recompile each round. On CPU the inductor needs a C++ compiler.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.measure.hardware import cpu_vendor
from harness.target.native import (
    auto_kernels_problem,
    cpp_compiler,
    cpu_has_avx512,
    load_native_kernels,
    native_kernels_problem,
    pairs_on_amx,
)

#: the dtypes the streaming kernel computes (others would go to F.linear)
STREAMING_DTYPES = (torch.float32, torch.bfloat16)
LINEAR_KERNELS = ("auto", "default", "onednn", "mkl_packed", "weight_major", "streaming", "streaming_panels")
#: the kernels of the native library, whose layers can run fused
STREAMING_KERNELS = ("streaming", "streaming_panels")
#: output features per panel of ``streaming_panels``
PANEL = 16
#: the k of one step of ``streaming_panels``' bfloat16 products (an AMX tile of 16 pairs)
PAIR_K = 32
#: where a fused decoder layer keeps the panels of its products' weights (harness.target.fused_layers)
LAYER_PANELS_KEY = "_harness_panel_weights"


#: x86 vendor ids for which MKL's single-precision GEMM takes its own code path
INTEL_VENDORS = ("GenuineIntel",)


def resolve_linear_kernel(
    kernel: str,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    vendor: str | None = None,
    avx512: bool | None = None,
    amx: bool | None = None,
    compiled: bool = False,
) -> str:
    """The kernel ``kernel`` names for linear layers of ``dtype`` on ``device``: ``auto`` becomes, for
    float32 and bfloat16 on an x86 CPU where a C++ compiler can build the native kernels,
    ``streaming_panels`` for bfloat16 where the native kernels multiply with AMX tiles (``amx``,
    default: :func:`harness.target.native.pairs_on_amx`), else ``streaming``: on an Intel CPU (vendor
    ``vendor``, default: this machine's) where it has AVX-512 (``avx512``, default: this machine's
    flags), ``streaming_panels`` for float32 there and ``streaming`` for bfloat16 without AMX;
    elsewhere ``streaming_panels`` for float32 without AVX-512; never ``streaming_panels``
    where the forward is ``compiled`` (the panels' staleness check runs outside the graph). Without a
    compiler, or where it cannot build or load the native kernels (said once on stderr),
    ``weight_major`` for float32 on a non-Intel CPU (MKL's single-precision GEMM takes its own path
    on Intel's); ``default`` elsewhere. Any other name is itself."""
    if kernel != "auto":
        return kernel
    on_cpu = str(device).split(":")[0] == "cpu"  # a string, so a bad device is refused by its own check
    if not on_cpu or dtype not in STREAMING_DTYPES:
        return "default"
    vendor = cpu_vendor() if vendor is None else vendor
    if not vendor:
        return "default"
    intel = vendor in INTEL_VENDORS
    if cpp_compiler() is not None and auto_kernels_problem() is None:
        has_avx512 = cpu_has_avx512() if avx512 is None else avx512
        if intel and not has_avx512:
            return "default"
        if dtype == torch.bfloat16 and not compiled and (pairs_on_amx() if amx is None else amx):
            return "streaming_panels"  # measured on a Xeon with AMX: flat in the rows to 32 (see above)
        if intel:  # measured on a Xeon with AVX-512 and AMX: MKL and oneDNN's one-row products trail it 2x
            # float32 panels in 512-bit vectors: one row within a few percent of the dot order, 16-32 rows 0.7-0.85
            return "streaming_panels" if dtype == torch.float32 and not compiled else "streaming"
        if dtype == torch.float32 and not compiled and not has_avx512:
            return "streaming_panels"
        return "streaming"
    return "weight_major" if dtype == torch.float32 and not intel else "default"


def linear_kernel_problem(kernel: str, dtype: torch.dtype, device: str) -> str | None:
    """Why ``kernel`` cannot run linear layers of ``dtype`` on ``device`` here (one line), or None.
    Probes the kernel on a tiny product, so a build or CPU that lacks it is refused before any model
    work."""
    if kernel not in LINEAR_KERNELS:
        return f"model.linear_kernel must be one of {list(LINEAR_KERNELS)}; got {kernel!r}"
    kernel = resolve_linear_kernel(kernel, dtype, device)
    if kernel == "default":
        return None
    if kernel == "weight_major":
        return None  # torch.mm: every device and dtype
    if torch.device(device).type != "cpu":
        return f"model.linear_kernel={kernel} is a CPU kernel; model.device={device} (use model.linear_kernel=default)"
    if kernel == "mkl_packed" and dtype != torch.float32:
        return f"model.linear_kernel={kernel} is float32 only; model.dtype is {str(dtype).removeprefix('torch.')}"
    if kernel in STREAMING_KERNELS and dtype not in STREAMING_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return f"model.linear_kernel={kernel} computes float32 and bfloat16; model.dtype is {name}"
    if kernel in STREAMING_KERNELS and (problem := native_kernels_problem()) is not None:
        return f"model.linear_kernel={kernel} cannot run here: {problem} (use model.linear_kernel=weight_major)"
    if kernel == "streaming_panels" and dtype == torch.bfloat16 and not pairs_on_amx():
        return (
            "model.linear_kernel=streaming_panels multiplies bfloat16 with AMX tiles, which this CPU, compiler or OS"
            " does not provide (use model.linear_kernel=streaming)"
        )
    w = torch.ones(PANEL, PAIR_K, dtype=dtype)  # a shape every kernel packs (bfloat16 pairs take K in 32s)
    x = torch.ones(2, PAIR_K, dtype=dtype)
    try:
        with torch.inference_mode():
            y = _kernel_fn(kernel, w, None)(x)
        if not torch.equal(y.float(), torch.full((2, PANEL), float(PAIR_K))):
            return f"model.linear_kernel={kernel} computed a wrong product on this CPU"
    except Exception as exc:  # the op is missing from this build, or the CPU lacks the instructions
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        return f"model.linear_kernel={kernel} cannot run {str(dtype).removeprefix('torch.')} here ({first})"
    return None


def _kernel_fn(kernel: str, weight: torch.Tensor, bias: torch.Tensor | None):
    """``x [..., K] -> [..., N]`` computing ``x @ weight.T + bias`` with ``kernel``."""
    if kernel == "onednn":

        def onednn_linear(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

        return onednn_linear
    if kernel == "mkl_packed":
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)  # the layout does not depend on M

        def mkl_packed_linear(x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])  # [M, K]; M must be passed, or MKL falls back to F.linear
            y = torch.ops.mkl._mkl_linear(flat, packed, weight, bias, flat.shape[0])
            return y.reshape(*x.shape[:-1], weight.shape[0])

        return mkl_packed_linear
    if kernel == "weight_major":

        def weight_major_linear(x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])  # [M, K]
            y = torch.mm(weight, flat.t()).t()  # [N, K] @ [K, M], read back as [M, N]
            if bias is not None:
                y = y + bias
            return y.reshape(*x.shape[:-1], weight.shape[0])

        return weight_major_linear
    if kernel == "streaming":
        load_native_kernels()
        op = torch.ops.harness.streaming_linear

        def streaming_linear(x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                return F.linear(x, weight, bias)  # the op has no backward: autograd's own linear
            return op(x, weight, bias)

        return streaming_linear
    if kernel == "streaming_panels":
        if not packable(weight):
            return _kernel_fn("streaming", weight, bias)
        load_native_kernels()
        op = torch.ops.harness.streaming_linear

        def streaming_panels_linear(x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                return F.linear(x, weight, bias)
            panels = _weight_panels_eagerly(weight) if torch.compiler.is_compiling() else weight_panels(weight)
            return op(x, panels, bias)

        return streaming_panels_linear
    if kernel == "default":
        return lambda x: F.linear(x, weight, bias)
    raise ValueError(f"unknown linear kernel {kernel!r}")


def packable(weight: torch.Tensor) -> bool:
    """Whether ``streaming_panels`` packs ``weight``: [N, K] with N a multiple of 16, float32, or
    bfloat16 with K a multiple of 32 (the k of one tile step); any other stays on ``streaming``."""
    if weight.dim() != 2 or weight.shape[0] % PANEL:
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % PAIR_K == 0)


def weight_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (:func:`packable`) packed for ``streaming_panels``: float32 in panels
    ``[N / 16, K, 16]`` (panel p: rows 16p .. 16p + 15 transposed), bfloat16 in pairs ``[N / 16,
    K / 2, 16, 2]`` (panel p's element [k / 2, n, k % 2] is ``weight[16p + n, k]``, the layout of
    AMX's tile multiply). Made on first use and kept on the weight; made again when the weight's
    version changes (an in-place tensor operation, ``load_state_dict``) or its storage moves
    (``weight.data = other``). An in-place write through ``weight.data`` changes neither, and an
    inference tensor has no version: such writes are not seen. A forward being compiled calls it
    outside the graph (:func:`_weight_panels_eagerly`)."""
    cached = weight.__dict__.get("_harness_panels")
    version, ptr = (-1 if weight.is_inference() else weight._version), weight.data_ptr()
    if cached is not None and cached[0] == version and cached[1] == ptr:
        return cached[2]
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.bfloat16:
        panels = w.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    else:
        panels = w.reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()
    weight.__dict__["_harness_panels"] = (version, ptr, panels)
    return panels


def packed_linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The distinct weights of ``model``'s ``nn.Linear`` layers that ``streaming_panels`` packs
    (:func:`packable`; a weight tied to another layer's counted once)."""
    seen, out = set(), []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and packable(module.weight) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out.append(module.weight)
    return out


def available_memory_bytes() -> int | None:
    """The memory the kernel reports available for new allocations without swapping (Linux's
    ``MemAvailable``), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class PackingRefused(ValueError):
    """``streaming_panels``' packed copies of a model's weights would not fit in the memory available."""


#: the share of the available memory ``streaming_panels``' copies may take (the rest is the
#: caches', the activations' and everything else a run allocates)
PANELS_MEMORY_SHARE = 0.8


def pack_weights(model: torch.nn.Module, *, key: str = "model", kernel: str = "auto") -> int:
    """Make the packed copies :func:`weight_panels` keeps for every weight of ``model`` that
    ``streaming_panels`` packs, now rather than on each weight's first use, so the memory they take
    is taken at load and seen by what loads next; returns their bytes. Refused in one line
    (:class:`PackingRefused`) when the copies not made yet would take more than
    :data:`PANELS_MEMORY_SHARE` of the memory available (``key``, ``kernel``: the config key and
    value that chose the kernel, for the message)."""
    weights = packed_linear_weights(model)
    need = sum(w.nelement() * w.element_size() for w in weights if "_harness_panels" not in w.__dict__)
    free = available_memory_bytes()
    if free is not None and need > PANELS_MEMORY_SHARE * free:
        chose = "" if kernel == "streaming_panels" else f" (what {key}.linear_kernel={kernel} chose here)"
        raise PackingRefused(
            f"{key}.linear_kernel=streaming_panels{chose} keeps a packed copy of the linear weights, "
            f"{need / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB of memory is available: set "
            f"{key}.linear_kernel=streaming (the streaming kernel over the weights as they are, no copy)"
        )
    return sum(weight_panels(w).nbytes for w in weights)


#: :func:`weight_panels` for a forward ``torch.compile`` traces: a graph break around it, since the
#: tracer cannot follow the copy kept in the weight's ``__dict__`` (eager calls skip the wrapper)
_weight_panels_eagerly = torch.compiler.disable(weight_panels)


def _linear_forward(module: torch.nn.Linear, kernel: str, x: torch.Tensor) -> torch.Tensor:
    cached = getattr(module, "_harness_kernel_fn", None)  # (weight, bias, fn): a tuple, not a parameter
    if cached is None or cached[0] is not module.weight or cached[1] is not module.bias:  # weights replaced
        cached = (module.weight, module.bias, _kernel_fn(kernel, module.weight, module.bias))
        module._harness_kernel_fn = cached
    return cached[2](x)


def apply_linear_kernel(model: torch.nn.Module, kernel: str, *, compiled: bool = False) -> int:
    """Route every ``nn.Linear`` of ``model`` through ``kernel`` (an instance-level forward; the
    module, its parameters and hooks are unchanged; ``auto`` resolved for the model's dtype and
    device, and whether its forward will be ``compiled``; ``default`` puts back ``nn.Linear``'s own
    forward). Returns how many layers now use a kernel other than ``default``. A kernel other than
    ``streaming_panels`` drops the panels that one kept on the weights."""
    first = next(model.parameters(), None)
    if first is not None:
        kernel = resolve_linear_kernel(kernel, first.dtype, first.device, compiled=compiled)
    elif kernel == "auto":
        kernel = "default"
    if kernel != "streaming_panels":  # the copies kept on the weights and on fused decoder layers
        for module in model.modules():
            module.__dict__.pop(LAYER_PANELS_KEY, None)
            if isinstance(module, torch.nn.Linear):
                module.weight.__dict__.pop("_harness_panels", None)
    if kernel == "default":
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                for name in ("forward", "_harness_linear_kernel", "_harness_kernel_fn"):
                    module.__dict__.pop(name, None)
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            # built here, not on the first call: a compiled forward would trace the build (the native
            # library's file checks break the graph, and each layer's call becomes a frame of its own)
            module._harness_kernel_fn = (module.weight, module.bias, _kernel_fn(kernel, module.weight, module.bias))
            module.forward = functools.partial(_linear_forward, module, kernel)
            module._harness_linear_kernel = kernel
            count += 1
    return count


def linear_kernel_of(model: torch.nn.Module) -> set[str]:
    """The kernels the model's ``nn.Linear`` layers use (``{"default"}`` when none was applied)."""
    return {getattr(m, "_harness_linear_kernel", "default") for m in model.modules() if isinstance(m, torch.nn.Linear)}


#: attention implementations the fused layers' native attention stands in for (boolean masks,
#: exact softmax); with any other (eager's additive masks, flash kernels) no layer runs fused
FUSED_ATTENTION = ("sdpa", "harness_sdpa")


def resolve_fused_layers(
    fused_layers: bool | None,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    linear_kernel: str,
    compiled: bool,
    static_cache: bool,
    attn_implementation: str = "sdpa",
) -> bool:
    """``model.fused_layers`` as it applies: an explicit value is itself; ``None`` fuses float32 and
    bfloat16 layers on CPU whose linear kernel resolved to ``streaming`` or ``streaming_panels``, on a
    preallocated cache, uncompiled, with SDPA attention (:data:`FUSED_ATTENTION`)."""
    if fused_layers is not None:
        return bool(fused_layers)
    on_cpu = str(device).split(":")[0] == "cpu"
    return (
        on_cpu
        and dtype in STREAMING_DTYPES
        and linear_kernel in STREAMING_KERNELS
        and static_cache
        and not compiled
        and attn_implementation in FUSED_ATTENTION
    )


def resolved_fused_layers(m) -> bool:
    """Whether a model config's (``model.*``, a mapping) decoder layers run fused: ``fused_layers``
    resolved for its dtype, device, linear kernel, cache layout and compilation, and unset, for
    its architecture too (read from its config: a Qwen2 or GPT-2 checkpoint's layers never fuse,
    so the manifest does not claim they do)."""
    from harness.target.loading import resolve_dtype, unfusable_architecture

    dtype = resolve_dtype(m["dtype"])
    compiled = bool(m.get("compile"))
    fused = resolve_fused_layers(
        m.get("fused_layers"),
        dtype,
        m["device"],
        linear_kernel=resolve_linear_kernel(m.get("linear_kernel", "auto"), dtype, m["device"], compiled=compiled),
        compiled=compiled,
        static_cache=resolve_static_cache(m.get("static_cache"), compiled),
        attn_implementation=str(m.get("attn_implementation", "sdpa")),
    )
    # the config is read only where the rest would fuse
    return fused and not (m.get("fused_layers") is None and unfusable_architecture(m) is not None)


def fused_layers_problem(
    dtype: torch.dtype, device: str, *, compiled: bool, static_cache: bool, attn_implementation: str = "sdpa"
) -> str | None:
    """Why ``model.fused_layers=true`` cannot run here (one line), or None."""
    if attn_implementation not in FUSED_ATTENTION:
        return (
            f"model.fused_layers=true computes SDPA attention natively ({' or '.join(FUSED_ATTENTION)}); "
            f"model.attn_implementation={attn_implementation} would run every layer unfused"
        )
    if torch.device(device).type != "cpu":
        return f"model.fused_layers=true is a CPU kernel; model.device={device}"
    if dtype not in STREAMING_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return f"model.fused_layers=true computes float32 and bfloat16; model.dtype is {name}"
    if compiled:
        return "model.fused_layers=true and model.compile=true: the fused layers are already one call each"
    if not static_cache:
        return "model.fused_layers=true appends to preallocated caches; model.static_cache is false"
    if (problem := native_kernels_problem()) is not None:
        return f"model.fused_layers=true cannot run here: {problem}"
    return None


def resolve_static_cache(static_cache: bool | None, compiled: bool) -> bool:
    """``model.static_cache`` as it applies: an explicit value is itself; ``None`` is preallocated
    unless the forward is compiled."""
    return (not compiled) if static_cache is None else bool(static_cache)


def apply_static_cache(model: torch.nn.Module, enabled: bool) -> None:
    """Whether every cache a backend builds for ``model`` preallocates its layers (``model.static_cache``)."""
    model._harness_static_cache = bool(enabled)


def static_cache_of(model: torch.nn.Module) -> bool:
    """Whether backends of ``model`` build preallocated caches (true unless switched off)."""
    return bool(getattr(model, "_harness_static_cache", True))


def resolve_cudnn_attention(value: bool | None, device: str) -> bool | None:
    """``model.cudnn_attention`` as it applies: None off CUDA (there is no such kernel there), else the
    value, false when unset.

    PyTorch's scaled-dot-product attention prefers cuDNN's kernel for bf16 and fp16 on Hopper GPUs,
    and cuDNN builds an execution plan for each new shape. A decode step's keys are one longer than
    the last step's, so every step of a run is a new shape: on an H200 (torch 2.11) a SmolLM2-shaped
    bf16 step took 57 ms over sequence lengths not seen before against 21 ms over the same lengths
    again, while fp32 (no cuDNN attention) took 23 ms either way. Flash and memory-efficient
    attention, which serve when cuDNN's is off, have no per-shape plan."""
    if torch.device(device).type != "cuda":
        return None
    return bool(value) if value is not None else False


def cudnn_attention_problem(value: bool | None, device: str) -> str | None:
    """Why ``model.cudnn_attention`` cannot apply here (one line), or None."""
    if value and torch.device(device).type != "cuda":
        return f"model.cudnn_attention=true applies to a CUDA device only; model.device={device}"
    return None


def apply_cudnn_attention(enabled: bool | None) -> None:
    """Allow or forbid cuDNN's attention kernel for every scaled-dot-product attention in this process
    (a process-wide switch in PyTorch: both arms and any draft on the device share it); None leaves it."""
    if enabled is not None:
        torch.backends.cuda.enable_cudnn_sdp(bool(enabled))


def compile_problem(device: str) -> str | None:
    """Why ``model.compile=true`` cannot work here (one line), or None."""
    if torch.device(device).type == "cpu" and cpp_compiler() is None:
        return (
            "model.compile=true needs a C++ compiler on CPU (torch.compile's inductor builds C++ kernels): "
            "install g++ or set $CXX, or use model.compile=false"
        )
    return None


#: dynamo's recompile limit per code object once a target is compiled (its default is 8). A round
#: calls the forward with several guard sets (a prefill, a one-row step, a verify forward of n rows,
#: a cache whose keys are views after a rollback), and transformers' decorators share one code object
#: between the model's forward and its layers' forwards, so 8 is reached during the warm-up; past the
#: limit a frame runs eagerly for the rest of the process, which :class:`CompileWatch` reports.
COMPILE_RECOMPILE_LIMIT = 64


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` the model's ``__call__`` in place with dynamic shapes (the process's recompile
    limit raised to :data:`COMPILE_RECOMPILE_LIMIT`); returns the model."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(int(torch._dynamo.config.recompile_limit), COMPILE_RECOMPILE_LIMIT)
    model.compile(dynamic=True)
    model._harness_compiled = True
    return model


class CompileWatch(logging.Handler):
    """What ``torch.compile`` did from :meth:`start` on, process-wide (every compiled forward, a
    compiled draft's included): graphs compiled, graph breaks, and the functions that reached a
    recompile limit (dynamo runs those eagerly from then on, so a forward claimed compiled is not,
    for some of its calls). Dynamo counts the first two; the last is only logged, so the watch
    listens to that log line."""

    LOGGER = "torch._dynamo.convert_frame"

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.limit_hits: list[str] = []
        self._start: tuple[int, int] = (0, 0)

    @staticmethod
    def _counts() -> tuple[int, int]:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))

    def start(self) -> CompileWatch:
        self._start = self._counts()
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("torch._dynamo hit config.") and len(record.args or ()) >= 3:
            limit, value, function = record.args[:3]
            self.limit_hits.append(f"{function}: {limit}={value}")

    def stop(self) -> dict:
        """Stops listening; returns ``{"graphs", "graph_breaks", "recompile_limit_hits"}``, the last
        the functions (name and source line) that ran eagerly past a limit."""
        logging.getLogger(self.LOGGER).removeHandler(self)
        graphs, breaks = self._counts()
        return {
            "graphs": graphs - self._start[0],
            "graph_breaks": breaks - self._start[1],
            "recompile_limit_hits": list(self.limit_hits),
        }
