"""Batched target backend: B requests, one shared KV cache, one verify forward per round.

Layout (ragged lengths by *right-padded holes*). The batch shares one transformers
``DynamicCache`` whose layers hold ``[B, H_kv, L, d_h]``. Batch row ``b`` (one live request) owns
physical slots ``[0, lengths[b])``: its committed tokens but the pending one, in order, so its
physical slot equals its logical position. Slots ``[lengths[b], L)`` are *holes* (stale rows of
earlier rounds, or padding), masked out of every query of that request; ``L = max_b lengths[b]``
after each commit.

A round's verify forward appends ``R = 1 + max_b N_b`` rows to every batch row at physical slots
``[L, L + R)``: row 0 is the request's pending token, rows ``1..N_b`` its compiled candidate rows,
and rows ``N_b + 1..R-1`` are *padding*. The 4D additive mask ``[B, 1, R, L + R]`` lets real row
``i`` of request ``b`` see its valid prefix ``[0, lengths[b])``, the pending slot ``L`` and its own
ancestors (the compiled tree's ancestor mask); a padded row sees only its own slot (so softmax
never meets an all-masked row) and no real row ever sees a padded slot or a hole. Position ids are
each request's logical positions (``lengths[b]`` for the pending token, the tree's position ids
for candidate rows); RoPE is applied before keys are cached, so a key's physical slot never
matters. Padded rows' logits are overwritten with NaN before anything else sees them: only the
real rows ``[0, 1 + N_b)`` of each request are returned, and any read of a padded row would turn a
probability vector into NaN and fail the contracts (tests perturb padded-row tokens and check the
outputs are unchanged).

Commit (0x0CB, per request). Request ``b`` keeps its pending row and its accepted path only: those
``1 + a_b`` rows are gathered from ``[L, L + R)`` and written to ``[lengths[b], lengths[b] + 1 +
a_b)`` (all reads happen before any write, so the copy is alias-free), then the cache is cropped
to the new ``max_b lengths[b]``. Only the new rows move: the committed prefix is never copied.
Siblings, rejected rows and padding become holes or are cropped.

Finishing early. A request that emits EOS or reaches its token budget leaves the batch with
:meth:`BatchedBackend.drop`: its batch row is removed from the cache (``index_select`` on the batch
dim) and the cache is cropped to the remaining requests' longest prefix, so later rounds neither
compute for it nor pad to its length. The others' slots, positions and masks are unchanged.

Prefill. All prompts are prefilled in one forward, right-padded to the longest prompt (padding
rows see only themselves), which yields the layout above directly. Only the last row's logits are
computed (``logits_to_keep=1``); the pending token's logits come from the first verify forward.

Hardware profile. :func:`timed_batched_verify` times one batched verify forward (then rolls it
back) on a state from :func:`prefill_copies` (``B`` copies of one prefix);
:func:`time_batched_verify_ms` is the median of repeats for ``n`` rows per request (pending row
included, Sequoia's ``t(n)`` convention); :func:`verify_cost_profile` returns ``t(1..N)`` at batch
``B`` normalised to ``t(1) = 1``.
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from harness.target.backend import cache_bytes, kv_bytes_per_token
from harness.topology.compiler import CompiledTree


@dataclass
class BatchState:
    """The authoritative state of the requests sharing one batched cache."""

    cache: object  # transformers DynamicCache, layers [B, H_kv, L, d_h]
    lengths: list[int]  # [B] valid (committed, pending excluded) KV slots per batch row
    tokens: list[list[int]]  # [B] token ids whose KV is valid, per batch row
    request_ids: list[int]  # [B] caller's request index held by each batch row
    phys_len: int = 0  # L: physical sequence length of the cache
    provisional_rows: int = 0  # R rows appended by the last verify, not yet committed
    cache_generation: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def hole_slots(self) -> int:
        """Invalid (masked) slots below ``phys_len`` summed over batch rows."""
        return sum(self.phys_len - n for n in self.lengths)


@dataclass(frozen=True)
class BatchedVerifyOutput:
    logits: list[torch.Tensor]  # per batch row b: [1 + N_b, V] real rows only (row 0 = frontier)
    rows: int  # R: rows per batch row in the forward (pending + max candidates)
    real_candidate_rows: int  # sum_b N_b
    padded_candidate_rows: int  # B * (R - 1): candidate slots incl. padding
    kv_bytes_added: int  # measured: bytes the forward appended to the cache (B * R rows)
    padded_logits: torch.Tensor = field(repr=False, default=None)  # [B, R, V] with padded rows NaN


@dataclass
class BatchedBackend:
    model: torch.nn.Module
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    forwards: int = 0  # target forwards run (prefill excluded): one per verify
    pad_token: int | None = None  # token id of padded rows (None: the request's pending token)

    def __post_init__(self) -> None:
        self.dtype = next(self.model.parameters()).dtype
        self.bytes_per_token = kv_bytes_per_token(self.model, self.dtype)
        self.vocab_size = int(self.model.config.vocab_size)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self.prefill_forwards = 0

    # ------------------------------------------------------------------ helpers
    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """bool ``[B, R, K]`` -> additive float ``[B, 1, R, K]`` (0 allowed, dtype min elsewhere)."""
        add = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        add.masked_fill_(~allowed.to(self.device), torch.finfo(self.dtype).min)
        return add.unsqueeze(1)

    def _forward(
        self, cache, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, start: int, last_only: bool = False
    ):
        r = ids.shape[1]
        kwargs = {}
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return self.model(
            input_ids=ids.to(self.device),
            position_ids=pos.to(self.device),
            attention_mask=self._additive(mask),
            use_cache=True,
            **{self._cache_kw: cache},
            cache_position=torch.arange(start, start + r, device=self.device),
            **kwargs,
        )

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _layers(self, cache):
        return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4]

    def _crop(self, state: BatchState, new_len: int) -> None:
        for layer in self._layers(state.cache):
            if layer.keys.shape[-2] > new_len:
                layer.keys = layer.keys[:, :, :new_len]
                layer.values = layer.values[:, :, :new_len]
        state.phys_len = new_len

    # ------------------------------------------------------------------ round API
    @torch.inference_mode()
    def prefill(self, prompts: Seq[Seq[int]], request_ids: Seq[int] | None = None) -> BatchState:
        """Cache every prompt token but the last (the first pending token), right-padded."""
        if not prompts:
            raise ValueError("a batch needs at least one prompt")
        for i, p in enumerate(prompts):
            if len(p) < 1:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
        b = len(prompts)
        lengths = [len(p) - 1 for p in prompts]
        length = max(lengths)
        state = BatchState(
            cache=self._new_cache(),
            lengths=lengths,
            tokens=[list(p[:-1]) for p in prompts],
            request_ids=list(request_ids) if request_ids is not None else list(range(b)),
        )
        if length == 0:
            return state
        ids = torch.zeros((b, length), dtype=torch.long)  # [B, L]
        pos = torch.arange(length).repeat(b, 1)  # [B, L]
        causal = torch.tril(torch.ones((length, length), dtype=torch.bool))  # [L, L]
        mask = torch.zeros((b, length, length), dtype=torch.bool)  # [B, L, L]
        for i, p in enumerate(prompts):
            n = lengths[i]
            if n:
                ids[i, :n] = torch.as_tensor(list(p[:n]), dtype=torch.long)
            mask[i] = causal
            mask[i, :, n:] = False
            mask[i, n:, :] = False
            mask[i].diagonal()[n:] = True  # a padding row sees itself only
        self._forward(state.cache, ids, pos, mask, 0, last_only=True)
        self.prefill_forwards += 1
        state.phys_len = length
        return state

    @torch.inference_mode()
    def verify(self, state: BatchState, pending: Seq[int], trees: Seq[CompiledTree | None]) -> BatchedVerifyOutput:
        """ONE forward over ``[pending_b] + rows_b`` for every batch row ``b``; ``trees[b]`` may be None
        (no candidates). Returns each request's real-row logits ``[1 + N_b, V]``."""
        b = state.batch_size
        if len(pending) != b or len(trees) != b:
            raise ValueError(
                f"need one pending token and one tree per batch row ({b}); got {len(pending)}, {len(trees)}"
            )
        if state.provisional_rows:
            raise ValueError("the previous verify forward was not committed")
        n_rows = [t.num_rows if t is not None else 0 for t in trees]
        for i, (t, n) in enumerate(zip(trees, n_rows)):
            if n and t.prefix_len != state.lengths[i] + 1:
                raise ValueError(
                    f"batch row {i}: tree compiled for prefix_len {t.prefix_len}, "
                    f"cache holds {state.lengths[i]} + pending"
                )
        rows = 1 + max(n_rows)
        length = state.phys_len
        ids = torch.empty((b, rows), dtype=torch.long)  # [B, R]
        pos = torch.empty((b, rows), dtype=torch.long)  # [B, R]
        allowed = torch.zeros((b, rows, length + rows), dtype=torch.bool)  # [B, R, L + R]
        eye = torch.eye(rows, dtype=torch.bool)  # [R, R]
        for i in range(b):
            n, base = n_rows[i], state.lengths[i]
            ids[i, :] = int(pending[i]) if self.pad_token is None else int(self.pad_token)  # padding: never read
            ids[i, 0] = int(pending[i])
            pos[i, :] = base
            allowed[i, :, length:] = eye  # every row (padding included) sees its own slot
            allowed[i, : 1 + n, :base] = True  # real rows: the request's valid prefix
            if n:
                t = trees[i]
                ids[i, 1 : 1 + n] = t.token_ids
                pos[i, 1 : 1 + n] = t.position_ids
                allowed[i, 1 : 1 + n, length] = True  # candidates see the pending row
                allowed[i, 1 : 1 + n, length + 1 : length + 1 + n] = t.ancestor_mask
        before = cache_bytes(state.cache)
        out = self._forward(state.cache, ids, pos, allowed, length)
        self.forwards += 1
        state.phys_len = length + rows
        state.provisional_rows = rows
        logits = out.logits  # [B, R, V]
        for i, n in enumerate(n_rows):
            if 1 + n < rows:
                logits[i, 1 + n :] = float("nan")  # padded rows: any read poisons the probabilities
        real = [logits[i, : 1 + n] for i, n in enumerate(n_rows)]
        return BatchedVerifyOutput(
            logits=real,
            rows=rows,
            real_candidate_rows=sum(n_rows),
            padded_candidate_rows=b * (rows - 1),
            kv_bytes_added=cache_bytes(state.cache) - before,
            padded_logits=logits,
        )

    @torch.inference_mode()
    def commit(
        self, state: BatchState, pending: Seq[int], trees: Seq[CompiledTree | None], accepted_rows: Seq[Seq[int]]
    ) -> None:
        """Per batch row: keep the pending row and the accepted root-to-node path (0x0CB)."""
        b = state.batch_size
        rows = state.provisional_rows
        if rows < 1:
            raise ValueError("commit without a verify forward")
        if len(accepted_rows) != b:
            raise ValueError(f"need accepted rows for each of {b} batch rows; got {len(accepted_rows)}")
        base = state.phys_len - rows  # L before the verify forward
        kept = [1 + len(a) for a in accepted_rows]
        width = max(kept)
        src = torch.empty((b, width), dtype=torch.long)  # [B, K] source slots
        dst = torch.empty((b, width), dtype=torch.long)  # [B, K] destination slots
        new_lengths = []
        for i, acc in enumerate(accepted_rows):
            n = state.lengths[i]
            s = [base] + [base + 1 + int(r) for r in acc]
            if any(x >= base + rows for x in s):
                raise ValueError(f"batch row {i}: accepted rows {list(acc)} outside the {rows - 1} candidate rows")
            d = list(range(n, n + len(s)))
            pad = n + len(s)  # no-op slot (read and rewritten unchanged); < base + rows when used
            src[i] = torch.tensor(s + [pad] * (width - len(s)))
            dst[i] = torch.tensor(d + [pad] * (width - len(s)))
            new_lengths.append(n + len(s))
            t = trees[i]
            state.tokens[i].extend([int(pending[i])] + [int(t.token_ids[int(r)]) for r in acc])
        moves = any(not torch.equal(src[i], dst[i]) for i in range(b))
        for layer in self._layers(state.cache):
            if moves:
                h, dh = layer.keys.shape[1], layer.keys.shape[3]
                gs = src.to(self.device)[:, None, :, None].expand(b, h, width, dh)  # [B, H, K, d]
                gd = dst.to(self.device)[:, None, :, None].expand(b, h, width, dh)
                k, v = layer.keys.gather(2, gs), layer.values.gather(2, gs)  # read all first
                layer.keys.scatter_(2, gd, k)
                layer.values.scatter_(2, gd, v)
        state.lengths = new_lengths
        state.provisional_rows = 0
        state.cache_generation += 1
        self._crop(state, max(new_lengths))

    def rollback(self, state: BatchState) -> None:
        """Discard the last verify forward's rows without committing anything (profiling)."""
        if not state.provisional_rows:
            return
        self._crop(state, state.phys_len - state.provisional_rows)
        state.provisional_rows = 0

    @torch.inference_mode()
    def drop(self, state: BatchState, batch_rows: Seq[int]) -> None:
        """Remove finished requests' batch rows; the others are untouched (cropped to their max)."""
        gone = set(int(r) for r in batch_rows)
        if not gone:
            return
        if state.provisional_rows:
            raise ValueError("drop between verify and commit")
        keep = [i for i in range(state.batch_size) if i not in gone]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self._layers(state.cache):
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)
        state.lengths = [state.lengths[i] for i in keep]
        state.tokens = [state.tokens[i] for i in keep]
        state.request_ids = [state.request_ids[i] for i in keep]
        self._crop(state, max(state.lengths, default=0))


# --------------------------------------------------------------------------- hardware profile


def _chain_tree(prefix_len: int, n: int) -> CompiledTree:
    """A chain of ``n`` candidate rows with dummy tokens (cost does not depend on the tokens)."""
    from harness.contracts import NO_STATE, ProposalNode, ProposalResult
    from harness.topology.compiler import compile_tree

    nodes = tuple(ProposalNode(token_id=1 + (i % 7), parent=i - 1, score=1.0, source="profile") for i in range(n))
    prop = ProposalResult(
        nodes=nodes,
        probability_semantics="score_only",
        sampling_relation="deterministic_lookup",
        topology="sequence",
        state_handle=NO_STATE,
        manifest_hash="profile",
        source="profile",
    )
    return compile_tree([prop], prefix_len=prefix_len, max_nodes=n, max_depth=n)


def prefill_copies(backend: BatchedBackend, *, prefix_ids: Seq[int], batch_size: int) -> BatchState:
    """``batch_size`` requests with the same prompt ``prefix_ids`` (last token pending): the state a
    batched timing starts from."""
    if batch_size < 1 or len(prefix_ids) < 2:
        raise ValueError(f"need batch_size >= 1 and a prefix of >= 2 tokens; got {batch_size}, {len(prefix_ids)}")
    return backend.prefill([list(prefix_ids)] * batch_size)


def timed_batched_verify(
    backend: BatchedBackend, state: BatchState, *, pending: int, tree: CompiledTree | None
) -> float:
    """Wall ms of ONE batched verify forward with ``tree`` (compiled at ``prefix_len = len(prefix)``,
    or None for ``t(1)``) for every request of ``state``; the rows are rolled back afterwards
    (outside the timed region) and ``backend.forwards`` is left unchanged."""
    cuda = torch.device(backend.device).type == "cuda"
    forwards = backend.forwards
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    backend.verify(state, [pending] * state.batch_size, [tree] * state.batch_size)
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) * 1e3
    backend.rollback(state)
    backend.forwards = forwards  # profiling forwards are not decode forwards
    return dt


def time_batched_verify_ms(
    backend: BatchedBackend,
    *,
    batch_size: int,
    nodes: int,
    prefix_len: int | None = None,
    prefix_ids: Seq[int] | None = None,
    tree: CompiledTree | None = None,
    repeats: int = 5,
    warmup: int = 1,
) -> float:
    """Median wall ms of ONE batched verify forward with ``nodes`` rows per request (the pending row
    included, Sequoia's ``t(n)``) for ``batch_size`` requests over the same cached prefix
    (``prefix_ids``, or ``prefix_len`` synthetic ids). ``tree`` (``nodes - 1`` rows, compiled at
    ``prefix_len = len(prefix)``) defaults to a chain; every request verifies the same shape, so
    there is no padding."""
    if batch_size < 1 or nodes < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need batch_size, nodes, repeats >= 1 and warmup >= 0; got {batch_size}, {nodes}, {repeats}, {warmup}"
        )
    if prefix_ids is None:
        if prefix_len is None or prefix_len < 1:
            raise ValueError(f"give prefix_ids or prefix_len >= 1; got prefix_len={prefix_len}")
        vocab = backend.vocab_size
        prefix_ids = [3 + ((7 * i) % (vocab - 3)) for i in range(prefix_len + 1)]
    prefix = list(prefix_ids)
    if tree is None and nodes > 1:
        tree = _chain_tree(len(prefix), nodes - 1)
    if (tree.num_rows if tree is not None else 0) != nodes - 1:
        raise ValueError(f"tree has {tree.num_rows if tree is not None else 0} rows; nodes={nodes} needs {nodes - 1}")
    state = prefill_copies(backend, prefix_ids=prefix, batch_size=batch_size)
    times = [timed_batched_verify(backend, state, pending=prefix[-1], tree=tree) for _ in range(warmup + repeats)]
    return statistics.median(times[warmup:])


def verify_cost_profile(
    backend: BatchedBackend, *, batch_size: int, max_nodes: int, prefix_len: int, repeats: int = 5, warmup: int = 1
) -> dict:
    """``t(1..max_nodes)`` at batch ``batch_size``: raw ms and normalised so ``t(1) = 1`` (the form
    :func:`harness.topology.sequoia.select_hardware_aware` takes as ``verify_cost``)."""
    ms = [
        time_batched_verify_ms(
            backend, batch_size=batch_size, nodes=n, prefix_len=prefix_len, repeats=repeats, warmup=warmup
        )
        for n in range(1, max_nodes + 1)
    ]
    return {"batch_size": batch_size, "prefix_len": prefix_len, "verify_ms": ms, "verify_cost": [m / ms[0] for m in ms]}
