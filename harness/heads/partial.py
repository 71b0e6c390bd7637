"""Running a subset of the target's decoder layers with a proposal-side KV cache (self-speculation).

Self-speculation reuses the target's *weights* (shared modules, frozen, never copied) but never its
authoritative state: a :class:`ProvisionalKV` belongs to one proposer, holds only rows the
shallow/skipped path computed, and is rolled back and extended by the proposer itself. The target
backend's cache is never read or written here (the self-draft state contract: skipped-path or
shallow-adapter rows are never relabelled as target KV).

:class:`ProvisionalKV` implements the one method Hugging Face attention modules call on a cache
(``update(key, value, layer_idx, ...)``) so the target's own ``LlamaDecoderLayer`` / attention
modules run unchanged with explicit position ids and an explicit ancestor mask.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from harness.heads.state import PrefixHashes, StateTag, may_reuse


class ProvisionalKV:
    """Per-layer K/V rows ``[1, H_kv, S, d_h]`` keyed by layer index, plus one state tag per row."""

    def __init__(self, *, checkpoint: str, boundary: str, dtype: str) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.tags: list[StateTag] = []  # one per cached row (position order)
        self.checkpoint = checkpoint
        self.boundary = boundary
        self.dtype = dtype
        self.generation = 0

    # the Hugging Face cache protocol used by attention modules
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx in self.keys:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key_states], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value_states], dim=-2)
        else:
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return self.keys[layer_idx], self.values[layer_idx]

    def __len__(self) -> int:
        return len(self.tags)

    def tag_rows(self, tokens: Sequence[int], positions: Sequence[int], ancestry: Sequence[int]) -> None:
        for tok, pos, anc in zip(tokens, positions, ancestry):
            self.tags.append(
                StateTag(self.checkpoint, self.boundary, int(tok), int(pos), int(anc), self.dtype, self.generation)
            )

    def keep(self, rows: Sequence[int]) -> None:
        """Keep the listed rows (ascending), drop the rest."""
        rows = list(rows)
        if rows == list(range(len(rows))):
            n = len(rows)
            for i in self.keys:
                self.keys[i] = self.keys[i][..., :n, :]
                self.values[i] = self.values[i][..., :n, :]
            self.tags = self.tags[:n]
        else:
            for i in self.keys:
                idx = torch.tensor(rows, dtype=torch.long, device=self.keys[i].device)
                self.keys[i] = self.keys[i].index_select(-2, idx)
                self.values[i] = self.values[i].index_select(-2, idx)
            self.tags = [self.tags[r] for r in rows]
        self.generation += 1

    def reusable_prefix(self, committed: Sequence[int], hashes: PrefixHashes, *, limit: int) -> int:
        """Rows ``[0, n)`` whose tags match the committed path (``may_reuse``), ``n <= limit``: the
        checkpoint, layer boundary, token, position, ancestry hash and dtype. A row's generation
        says which :meth:`keep` wrote it, not whether it stands (a kept row stays valid while later
        ``keep`` calls move the cache's generation on), so each row is asked for its own."""
        n = 0
        upto = min(len(self.tags), limit)
        while n < upto:
            tag = self.tags[n]
            need = StateTag(
                self.checkpoint, self.boundary, int(committed[n]), n, hashes.at(n), self.dtype, tag.cache_generation
            )
            if not may_reuse(tag, need):
                break
            n += 1
        return n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())


class PartialPath:
    """The target's embedding + a chosen list of its decoder layers (shared modules)."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int]) -> None:
        base = model.base_model
        n = len(base.layers)
        layers = [int(i) for i in layers]
        if any(not 0 <= i < n for i in layers) or layers != sorted(set(layers)):
            raise ValueError(f"layers must be distinct ascending indices in [0, {n}); got {layers}")
        self.model = model
        self.base = base
        self.layer_ids = tuple(layers)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        params = inspect.signature(base.layers[0].forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        return self.base.embed_tokens(torch.as_tensor(list(ids), dtype=torch.long, device=self.device)[None])

    def additive_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """bool ``[R, C + R]`` -> additive ``[1, 1, R, C + R]`` in the model dtype."""
        add = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        add.masked_fill_(~mask.to(self.device), torch.finfo(self.dtype).min)
        return add[None, None]

    def run(
        self,
        hidden: torch.Tensor,
        positions: Sequence[int],
        mask: torch.Tensor,
        cache: ProvisionalKV,
        *,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """hidden ``[1, R, d]`` through ``layers`` (default: all of this path). mask: bool
        ``[R, C + R]`` over the cached rows and the new ones. Appends ``R`` rows per layer."""
        pos = torch.as_tensor(list(positions), dtype=torch.long, device=self.device)[None]  # [1, R]
        rope = self.base.rotary_emb(hidden, position_ids=pos)
        add = self.additive_mask(mask)
        for i in self.layer_ids if layers is None else layers:
            out = self.base.layers[i](
                hidden,
                attention_mask=add,
                position_ids=pos,
                use_cache=True,
                position_embeddings=rope,
                **{self._cache_kw: cache},
            )
            hidden = out[0] if isinstance(out, tuple) else out  # older releases return a tuple
        return hidden


def causal_rows_mask(cache_len: int, rows: int) -> torch.Tensor:
    """bool ``[R, C + R]``: every cached row plus a causal block over the new rows."""
    mask = torch.ones(rows, cache_len + rows, dtype=torch.bool)
    mask[:, cache_len:] = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    return mask
