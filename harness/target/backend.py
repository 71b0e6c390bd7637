"""The causal-LM backend: one HF transformers model and one KV cache holding B >= 1 requests.

Batch 1 is a batch of one. Every forward of the round loop, of the gates, of the oracles and of the
timing profiles goes through :class:`CausalLMBackend` and a :class:`CacheState`; the single-request
helpers (``prefill_one``, ``verify_one``, ``commit_one``, ``forward_rows``, ``keep_rows``) are the
same code at ``B = 1``.

Layout (ragged lengths by right-padded holes). The cache's layers hold ``[B, H_kv, L, d_h]``.
Batch row ``b`` owns physical slots ``[0, lengths[b])``: its committed tokens but the pending one,
in order, so a request's physical slot equals its logical position. Slots ``[lengths[b], L)`` are
holes (stale rows of earlier rounds, or padding), masked out of every query of that request;
``L = max_b lengths[b]`` after each commit. At ``B = 1`` there are never holes.

Verify. A round's verify forward appends ``R = 1 + max_b N_b`` rows to every batch row at slots
``[L, L + R)``: row 0 is the request's pending token (the bonus or correction token of the last
round, whose KV the cache does not hold yet), rows ``1..N_b`` its compiled candidate rows, rows
``N_b + 1..R-1`` padding. Candidate row ``r`` sits at position ``lengths[b] + depth[r]`` and sees
the request's prefix, the pending row and its own ancestors (the tree's ancestor mask); a padded
row sees only itself, so softmax never meets an all-masked row, and no real row ever sees a padded
slot or a hole. Padded rows' logits are overwritten with NaN before anything sees them, so any
read of one poisons a probability vector and fails the contracts. Fast path: when there are no
holes, no padding and every request's rows form one chain, the ancestor mask is the causal mask
and the forward runs without an explicit mask (transformers' causal path).

Commit (the pending-token commit). Request ``b`` keeps its pending row and its accepted root-to-node
path only: those ``1 + a_b`` rows are gathered from ``[L, L + R)`` and written to
``[lengths[b], lengths[b] + 1 + a_b)`` (all reads before any write, so the copy is alias-free),
then the cache is cropped to the new ``max_b lengths[b]``. Only the moved rows are copied; a
contiguous accepted path (rows ``0..a-1`` of a batch of one) moves nothing and is a crop.
Siblings, rejected rows and padding become holes or are cropped.

Finishing early. :meth:`CausalLMBackend.drop` removes finished requests' batch rows and crops the
cache to the remaining requests' longest prefix; the others' slots, positions and masks are
unchanged.

Prefill. All prompts in one forward, right-padded to the longest (padding rows see only
themselves; no mask when every prompt has the same length). Only the last row's logits are
computed (``logits_to_keep=1``): the pending token's logits come from the first verify forward.

The same backend serves a draft model (its own cache of one request, rolled back to the committed
path each round through :meth:`~CausalLMBackend.keep_rows`) and the autoregressive baseline (a
verify forward with no candidate rows).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# transformers is imported where a model, cache or tokenizer is built (it takes about 1.7 s to import
# on a 2-core machine), so commands that never build one (`harness tree`, `compare`, `report`,
# `oracles` listing) do not pay for it.
from harness.contracts import ContractError
from harness.target.attention import uses_boolean_masks
from harness.target.fused_layers import stack_logits
from harness.target.kv_cache import PreallocatedLayer, cache_window, kv_head_count
from harness.target.native import native_kernels_loaded
from harness.target.options import static_cache_of
from harness.topology.compiler import CompiledTree


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """L * 2 * H_kv * d_h * b: bytes one token adds to a dense full K/V cache."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    kv_heads = kv_head_count(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = torch.tensor([], dtype=dtype or next(model.parameters()).dtype).element_size()
    return layers * 2 * kv_heads * head_dim * itemsize


def cache_layers(cache) -> list:
    """The populated layers of a DynamicCache (each with ``keys``/``values`` ``[B, H_kv, S, d_h]``)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4]


def _preallocated_buffers(cache) -> list[torch.Tensor] | None:
    """Every layer's key and value buffers where every layer is a preallocated one holding them,
    else None."""
    buffers = []
    for layer in cache.layers:
        if not isinstance(layer, PreallocatedLayer) or layer._key_buffer is None:
            return None
        buffers += (layer._key_buffer, layer._value_buffer)
    return buffers or None


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:  # the layers cache_layers selects, in one pass
        if isinstance(layer, PreallocatedLayer):
            total += layer.cached_bytes()
            continue
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4:
            values = layer.values
            total += keys.numel() * keys.element_size() + values.numel() * values.element_size()
    return total


@dataclass
class CacheState:
    """The authoritative state of the requests sharing one cache."""

    cache: object  # transformers DynamicCache, layers [B, H_kv, L, d_h]
    lengths: list[int]  # [B] valid (committed, pending excluded) KV slots per batch row
    tokens: list[list[int]]  # [B] token ids whose KV is valid, per batch row
    request_ids: list[int]  # [B] the caller's request index held by each batch row
    phys_len: int = 0  # L: physical sequence length of the cache
    provisional_rows: int = 0  # R rows appended by the last verify forward, not yet committed or rolled back
    provisional_ids: list[list[int]] = field(default_factory=list)  # [B] the real ids of those rows
    cache_generation: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def hole_slots(self) -> int:
        """Invalid (masked) slots below ``phys_len`` summed over batch rows."""
        return sum(self.phys_len - n for n in self.lengths)

    # batch-of-one views (draft models, gates, profiles)
    @property
    def cache_len(self) -> int:
        return self.lengths[self._one()]

    @property
    def cached_tokens(self) -> list[int]:
        return self.tokens[self._one()]

    def _one(self) -> int:
        if self.batch_size != 1:
            raise ValueError(f"a batch-of-one view of a state holding {self.batch_size} requests")
        return 0


@dataclass(frozen=True)
class ForwardOutput:
    """One request's rows of a forward."""

    logits: torch.Tensor  # [R, V] for the R input rows (row 0 = frontier in a verify)
    kv_bytes_added: int  # bytes the forward appended to the cache
    hidden: torch.Tensor | None = None  # [R, d] last hidden states when requested


@dataclass(frozen=True)
class VerifyOutput:
    logits: list[torch.Tensor]  # per batch row b: [1 + N_b, V] real rows only (row 0 = frontier)
    rows: int  # R: rows per batch row in the forward (pending + max candidates)
    real_candidate_rows: int  # sum_b N_b
    padded_candidate_rows: int  # B * (R - 1): candidate slots incl. padding
    kv_bytes_added: int  # measured: bytes the forward appended to the cache (B * R rows)
    padded_logits: torch.Tensor = field(repr=False, default=None)  # [B, R, V] with padded rows NaN


@dataclass
class _Logits:
    """What the backend reads of a model output, where :func:`stack_logits` computed the logits."""

    logits: torch.Tensor  # [B, R, V]
    hidden_states: None = None


@dataclass
class CausalLMBackend:
    model: torch.nn.Module
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    forwards: int = 0  # verify forwards run (prefill and low-level forwards excluded)
    pad_token: int | None = None  # token id of padded rows (None: the request's pending token)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.bytes_per_token = kv_bytes_per_token(self.model, self.dtype)
        self.vocab_size = int(self.model.config.vocab_size)
        embedding = self.model.get_input_embeddings()
        #: ids the target can read (its embedding's rows; a candidate past them is refused)
        self.embedding_rows = int(embedding.weight.shape[0]) if embedding is not None else self.vocab_size
        self.num_layers = int(self.model.config.num_hidden_layers)
        params = inspect.signature(self.model.forward).parameters
        # transformers 5.24 renamed `past_key_values=` to `cache=`; older releases only know the former
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._bool_masks = uses_boolean_masks(self.model)  # SDPA takes them as they are; eager adds a float mask

    # ------------------------------------------------------------------ low level
    def new_state(self, batch_size: int = 1, *, reserve: int | None = None) -> CacheState:
        """An empty cache for ``batch_size`` requests; a preallocated cache (``model.static_cache``)
        reserves ``reserve`` slots beyond its first forward's rows (default: its own reserve)."""
        from harness.target.kv_cache import new_cache

        return CacheState(
            cache=new_cache(self.model.config, preallocated=static_cache_of(self.model), reserve=reserve),
            lengths=[0] * batch_size,
            tokens=[[] for _ in range(batch_size)],
            request_ids=list(range(batch_size)),
        )

    def _forward(
        self,
        cache,
        ids: torch.Tensor,
        pos: torch.Tensor,
        allowed: torch.Tensor | None,
        start: int,
        *,
        last_only: bool = False,
        output_hidden: bool = False,
    ):
        """``ids``/``pos`` ``[B, R]``; ``allowed`` bool ``[B, R, start + R]`` or None (causal)."""
        r = ids.shape[1]
        window = cache_window(cache)
        if window is not None and r and int(pos.max()) + 1 > window:
            raise ValueError(
                f"a forward reaching position {int(pos.max())} passes the model's sliding attention window of "
                f"{window} positions: the cache attends over the whole context, which equals the window's attention "
                "only inside it"
            )
        ids, pos = ids.to(self.device), pos.to(self.device)
        kwargs = {}
        if allowed is not None and self._bool_masks:
            kwargs["attention_mask"] = allowed.to(self.device).unsqueeze(1)  # [B, 1, R, K], True = attend
        elif allowed is not None:
            additive = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)  # [B, R, K]
            additive.masked_fill_(~allowed.to(self.device), torch.finfo(self.dtype).min)
            kwargs["attention_mask"] = additive.unsqueeze(1)  # [B, 1, R, K]
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if not output_hidden and (allowed is None or self._bool_masks):
            logits = stack_logits(
                self.model, ids, pos, kwargs.get("attention_mask"), cache, last_only="logits_to_keep" in kwargs
            )
            if logits is not None:
                return _Logits(logits)
        return self.model(
            input_ids=ids,
            position_ids=pos,
            use_cache=True,
            **{self.cache_kw: cache},
            cache_position=torch.arange(start, start + r, device=self.device),
            output_hidden_states=output_hidden,
            **kwargs,
        )

    def _crop(self, state: CacheState, new_len: int) -> None:
        for layer in state.cache.layers:
            if isinstance(layer, PreallocatedLayer):
                if layer.get_seq_length() > new_len:
                    layer.keep_first(new_len)
            elif getattr(layer, "keys", None) is not None and layer.keys.dim() == 4 and layer.keys.shape[-2] > new_len:
                layer.keys = layer.keys[:, :, :new_len]
                layer.values = layer.values[:, :, :new_len]
        state.phys_len = new_len

    @torch.inference_mode()
    def forward_rows(
        self,
        state: CacheState,
        input_ids: Sequence[int],
        position_ids: Sequence[int] | torch.Tensor,
        mask: torch.Tensor | None,
        *,
        output_hidden: bool = False,
    ) -> ForwardOutput:
        """Batch of one: append ``R`` rows to the cache (they count as cached at once; roll back with
        :meth:`keep_rows` or :meth:`truncate`). ``mask``: bool ``[R, cache_len + R]`` or None for plain
        causal attention."""
        self._no_pending_verify(state)
        length = state.cache_len
        r = len(input_ids)
        if mask is not None and tuple(mask.shape) != (r, length + r):
            raise ValueError(f"mask must be [{r}, {length + r}]; got {tuple(mask.shape)}")
        before = cache_bytes(state.cache)
        ids = torch.as_tensor(list(input_ids), dtype=torch.long).unsqueeze(0)  # [1, R]
        pos = torch.as_tensor(position_ids, dtype=torch.long).reshape(1, r)  # [1, R]
        out = self._forward(
            state.cache, ids, pos, None if mask is None else mask.unsqueeze(0), length, output_hidden=output_hidden
        )
        state.tokens[0].extend(int(t) for t in input_ids)
        state.lengths[0] += r
        state.phys_len = state.lengths[0]
        hidden = out.hidden_states[-1][0] if output_hidden else None
        return ForwardOutput(logits=out.logits[0], kv_bytes_added=cache_bytes(state.cache) - before, hidden=hidden)

    @torch.inference_mode()
    def keep_rows(self, state: CacheState, keep_upto: int, extra_rows: Sequence[int] = ()) -> None:
        """Batch of one: keep cache rows ``[0, keep_upto)`` plus ``extra_rows`` (absolute indices,
        ascending) and drop every other row. A contiguous set crops; otherwise the extra rows are
        copied down into place (the prefix is never copied)."""
        self._no_pending_verify(state)
        extra = [int(i) for i in extra_rows]
        total = state.cache_len
        new_len = keep_upto + len(extra)
        if extra != list(range(keep_upto, new_len)):
            src = torch.tensor(extra, dtype=torch.long, device=self.device)
            for layer in cache_layers(state.cache):
                layer.keys[:, :, keep_upto:new_len] = layer.keys.index_select(2, src)
                layer.values[:, :, keep_upto:new_len] = layer.values.index_select(2, src)
            state.tokens[0] = state.tokens[0][:keep_upto] + [state.tokens[0][i] for i in extra]
        if new_len < total:
            self._crop(state, new_len)
        state.tokens[0] = state.tokens[0][:new_len]
        state.lengths[0] = new_len
        state.phys_len = new_len
        state.cache_generation += 1

    def truncate(self, state: CacheState, length: int) -> None:
        """Batch of one: drop an uncommitted verify forward, then keep the first ``length`` cached tokens."""
        self.rollback(state)
        if length < state.cache_len:
            self.keep_rows(state, length)

    @staticmethod
    def _no_pending_verify(state: CacheState) -> None:
        if state.provisional_rows:
            raise ValueError("a verify forward is neither committed nor rolled back")

    # ------------------------------------------------------------------ round API
    @torch.inference_mode()
    def prefill(
        self, prompts: Sequence[Sequence[int]], request_ids: Sequence[int] | None = None, *, reserve: int | None = None
    ) -> CacheState:
        """Cache every prompt token but the last (each request's first pending token), right-padded.
        ``reserve``: the slots the caller expects to append after the prompts (a preallocated cache
        holds them from the start; see :meth:`new_state`)."""
        if not prompts:
            raise ValueError("a batch needs at least one prompt")
        for i, p in enumerate(prompts):
            if len(p) < 1:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
        b = len(prompts)
        state = self.new_state(b, reserve=reserve)
        state.lengths = [len(p) - 1 for p in prompts]
        state.tokens = [[int(t) for t in p[:-1]] for p in prompts]
        if request_ids is not None:
            state.request_ids = list(request_ids)
        length = max(state.lengths)
        if length == 0:
            return state
        ids = torch.zeros((b, length), dtype=torch.long)  # [B, L]
        pos = torch.arange(length).repeat(b, 1)  # [B, L]
        for i, p in enumerate(prompts):
            ids[i, : state.lengths[i]] = torch.as_tensor([int(t) for t in p[: state.lengths[i]]], dtype=torch.long)
        allowed = None
        if any(n != length for n in state.lengths):
            causal = torch.tril(torch.ones((length, length), dtype=torch.bool))  # [L, L]
            allowed = torch.zeros((b, length, length), dtype=torch.bool)  # [B, L, L]
            for i, n in enumerate(state.lengths):
                allowed[i] = causal
                allowed[i, :, n:] = False
                allowed[i, n:, :] = False
                allowed[i].diagonal()[n:] = True  # a padding row sees itself only
        self._forward(state.cache, ids, pos, allowed, 0, last_only=True)
        state.phys_len = length
        return state

    @torch.inference_mode()
    def verify(self, state: CacheState, pending: Sequence[int], trees: Sequence[CompiledTree | None]) -> VerifyOutput:
        """ONE forward over ``[pending_b] + rows_b`` for every batch row ``b``; ``trees[b]`` may be
        None (no candidates). Returns each request's real-row logits ``[1 + N_b, V]``."""
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
                    f"batch row {i}: tree compiled for prefix_len {t.prefix_len}, cache holds {state.lengths[i]} "
                    "+ pending"
                )
        rows = 1 + max(n_rows)
        length = state.phys_len
        ids = torch.empty((b, rows), dtype=torch.long)  # [B, R]
        pos = torch.empty((b, rows), dtype=torch.long)  # [B, R]
        provisional = []
        for i in range(b):
            n, base = n_rows[i], state.lengths[i]
            ids[i, :] = int(pending[i]) if self.pad_token is None else int(self.pad_token)  # padding: never read
            ids[i, 0] = int(pending[i])
            pos[i, :] = base
            if n:
                ids[i, 1 : 1 + n] = trees[i].token_ids
                pos[i, 1 : 1 + n] = trees[i].position_ids
            provisional.append(ids[i, : 1 + n].tolist())
            if n and max(provisional[-1]) >= self.embedding_rows:
                row = next(r for r, t in enumerate(provisional[-1][1:]) if t >= self.embedding_rows)
                raise ContractError(
                    f"batch row {i}: candidate row {row} holds token id {provisional[-1][1 + row]}, past the "
                    f"target's {self.embedding_rows}-row embedding (proposed by "
                    f"{', '.join(trees[i].sources[row]) or 'an unnamed source'}): a proposer drafted an id the "
                    "target has no token for"
                )
        chains = all(t is None or t.num_rows == 0 or t.topology == "sequence" for t in trees)
        allowed = None
        if not (chains and state.hole_slots() == 0 and all(n == rows - 1 for n in n_rows)):
            allowed = self._verify_mask(state, trees, n_rows, rows)
        before = cache_bytes(state.cache)
        out = self._forward(state.cache, ids, pos, allowed, length)
        self.forwards += 1
        state.phys_len = length + rows
        state.provisional_rows = rows
        state.provisional_ids = provisional
        logits = out.logits  # [B, R, V]
        for i, n in enumerate(n_rows):
            if 1 + n < rows:
                logits[i, 1 + n :] = float("nan")  # padded rows: any read poisons the probabilities
        return VerifyOutput(
            logits=[logits[i, : 1 + n] for i, n in enumerate(n_rows)],
            rows=rows,
            real_candidate_rows=sum(n_rows),
            padded_candidate_rows=b * (rows - 1),
            kv_bytes_added=cache_bytes(state.cache) - before,
            padded_logits=logits,
        )

    @staticmethod
    def _verify_mask(state: CacheState, trees, n_rows: list[int], rows: int) -> torch.Tensor:
        """bool ``[B, R, L + R]``: each real row sees its request's prefix, the pending row and its
        ancestors; a padded row sees only itself."""
        b, length = state.batch_size, state.phys_len
        allowed = torch.zeros((b, rows, length + rows), dtype=torch.bool)  # [B, R, L + R]
        eye = torch.eye(rows, dtype=torch.bool)  # [R, R]
        for i in range(b):
            n, base = n_rows[i], state.lengths[i]
            allowed[i, :, length:] = eye  # every row (padding included) sees its own slot
            allowed[i, : 1 + n, :base] = True  # real rows: the request's valid prefix
            if n:
                allowed[i, 1 : 1 + n, length] = True  # candidates see the pending row
                allowed[i, 1 : 1 + n, length + 1 : length + 1 + n] = trees[i].ancestor_mask
        return allowed

    @torch.inference_mode()
    def commit(self, state: CacheState, accepted_rows: Sequence[Sequence[int]]) -> None:
        """Per batch row: keep the pending row and the accepted root-to-node path."""
        b = state.batch_size
        rows = state.provisional_rows
        if rows < 1:
            raise ValueError("commit without a verify forward")
        if len(accepted_rows) != b:
            raise ValueError(f"need accepted rows for each of {b} batch rows; got {len(accepted_rows)}")
        base = state.phys_len - rows  # L before the verify forward
        width = 1 + max(len(a) for a in accepted_rows)
        src = torch.empty((b, width), dtype=torch.long)  # [B, K] source slots
        dst = torch.empty((b, width), dtype=torch.long)  # [B, K] destination slots
        new_lengths = []
        for i, acc in enumerate(accepted_rows):
            n = state.lengths[i]
            provisional = state.provisional_ids[i]
            if any(not 0 <= int(r) < len(provisional) - 1 for r in acc):
                raise ValueError(
                    f"batch row {i}: accepted rows {list(acc)} outside its {len(provisional) - 1} candidate rows"
                )
            s = [base] + [base + 1 + int(r) for r in acc]
            pad = n + len(s)  # no-op slot (read and rewritten unchanged); < base + rows when used
            src[i] = torch.tensor(s + [pad] * (width - len(s)))
            dst[i] = torch.tensor(list(range(n, pad)) + [pad] * (width - len(s)))
            new_lengths.append(pad)
            state.tokens[i].extend([provisional[0]] + [provisional[1 + int(r)] for r in acc])
        moved = not torch.equal(src, dst)
        buffers = _preallocated_buffers(state.cache) if moved and native_kernels_loaded() else None
        if buffers is not None and buffers[0].device.type == "cpu":
            torch.ops.harness.move_slots(buffers, src, dst)  # every layer in one call
        elif moved:
            gs = src.to(self.device)
            gd = dst.to(self.device)
            for layer in cache_layers(state.cache):
                h, dh = layer.keys.shape[1], layer.keys.shape[3]
                s4 = gs[:, None, :, None].expand(b, h, width, dh)  # [B, H, K, d]
                d4 = gd[:, None, :, None].expand(b, h, width, dh)
                k, v = layer.keys.gather(2, s4), layer.values.gather(2, s4)  # read all first
                layer.keys.scatter_(2, d4, k)
                layer.values.scatter_(2, d4, v)
        state.lengths = new_lengths
        state.provisional_rows = 0
        state.provisional_ids = []
        state.cache_generation += 1
        self._crop(state, max(new_lengths))

    def rollback(self, state: CacheState) -> None:
        """Discard the last verify forward's rows without committing anything (profiling)."""
        if state.provisional_rows:
            self._crop(state, state.phys_len - state.provisional_rows)
        state.provisional_rows = 0
        state.provisional_ids = []

    @torch.inference_mode()
    def drop(self, state: CacheState, batch_rows: Sequence[int]) -> None:
        """Remove finished requests' batch rows; the others are untouched (cropped to their max). A
        preallocated layer's kept rows move into buffers of the new batch size and the same capacity,
        so the next forward appends in place."""
        gone = {int(r) for r in batch_rows}
        if not gone:
            return
        if state.provisional_rows:
            raise ValueError("drop between verify and commit")
        keep = [i for i in range(state.batch_size) if i not in gone]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        state.lengths = [state.lengths[i] for i in keep]
        end = max(state.lengths, default=0)
        for layer in cache_layers(state.cache):
            if isinstance(layer, PreallocatedLayer):  # compacted into buffers of the kept batch: no reallocation
                layer.keep_batch_rows(idx, end)
            else:
                layer.keys = layer.keys.index_select(0, idx)
                layer.values = layer.values.index_select(0, idx)
        state.tokens = [state.tokens[i] for i in keep]
        state.request_ids = [state.request_ids[i] for i in keep]
        self._crop(state, end)

    # ------------------------------------------------------------------ batch of one
    def prefill_one(self, prompt_ids: Sequence[int]) -> CacheState:
        return self.prefill([prompt_ids])

    def verify_one(self, state: CacheState, pending: int, tree: CompiledTree | None) -> ForwardOutput:
        """One request's verify forward over ``[pending] + rows``: logits ``[1 + N, V]``."""
        out = self.verify(state, [pending], [tree])
        return ForwardOutput(logits=out.logits[0], kv_bytes_added=out.kv_bytes_added)

    def commit_one(self, state: CacheState, accepted_rows: Sequence[int]) -> None:
        self.commit(state, [accepted_rows])
