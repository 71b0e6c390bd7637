"""Target backend over HF transformers causal LMs (reference 0x09, 0x09B, 0x0CB).

One request's state is a :class:`Sequence`: a ``DynamicCache`` holding every committed token but
the pending one, plus the committed token ids. A round's verify forward processes
``[pending] + candidate rows`` over the cached prefix in one call, with explicit position ids and
an ancestor mask, so the prefix is never recomputed and the correction/bonus token costs no extra
forward. :meth:`CausalLMBackend.commit` keeps the pending token's KV and the accepted root-to-node
path only (non-contiguous rows included) and discards siblings and rejected rows.

The same backend serves a draft model (its own cache, rolled back to the committed path each
round) and the autoregressive baseline (a verify forward with no candidate rows).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from harness.topology.compiler import CompiledTree


@dataclass
class Sequence:
    """One request's authoritative state in a backend."""

    cache: object  # transformers DynamicCache
    tokens: list[int]  # tokens whose KV is in the cache, in order
    cache_generation: int = 0
    provisional_rows: int = 0  # rows appended by the last forward, not yet committed or dropped

    @property
    def cache_len(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [R, V] for the R input rows
    kv_bytes_added: int  # bytes the forward appended to the cache
    hidden: torch.Tensor | None = None  # [R, d] last hidden states when requested


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """L * 2 * H_kv * d_h * b: bytes one token adds to a dense full K/V cache (0x09B)."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = torch.tensor([], dtype=dtype or next(model.parameters()).dtype).element_size()
    return layers * 2 * kv_heads * head_dim * itemsize


def cache_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) ``[B, H_kv, S, d_h]`` of a DynamicCache (transformers >= 4.56
    keeps them on ``cache.layers``; older releases, which the GPU check may meet, on lists)."""
    if hasattr(cache, "layers"):
        return [
            (layer.keys, layer.values)
            for layer in cache.layers
            if getattr(layer, "keys", None) is not None and layer.keys.numel()
        ]
    return list(zip(cache.key_cache, cache.value_cache))


def set_cache_kv(cache, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    if hasattr(cache, "layers"):
        cache.layers[index].keys, cache.layers[index].values = keys, values
    else:
        cache.key_cache[index], cache.value_cache[index] = keys, values


def cache_bytes(cache) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in cache_kv(cache))


@dataclass
class CausalLMBackend:
    model: torch.nn.Module
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        self.dtype = next(self.model.parameters()).dtype
        self.bytes_per_token = kv_bytes_per_token(self.model, self.dtype)
        self.vocab_size = int(self.model.config.vocab_size)
        self.num_layers = int(self.model.config.num_hidden_layers)
        # transformers 5.24 renamed `past_key_values=` to `cache=`; older releases (the GPU check
        # may run on one) only know the former.
        import inspect

        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ low level
    def new_sequence(self) -> Sequence:
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            cache = DynamicCache()
        return Sequence(cache=cache, tokens=[])

    @torch.inference_mode()
    def forward_rows(
        self,
        seq: Sequence,
        input_ids: Seq[int],
        position_ids: Seq[int] | torch.Tensor,
        mask: torch.Tensor | None,
        *,
        output_hidden: bool = False,
    ) -> ForwardOutput:
        """Append ``R`` rows to ``seq``'s cache. ``mask``: bool ``[R, cache_len + R]`` or None for
        plain causal attention. Returns the rows' logits ``[R, V]`` (float32 or the model dtype)."""
        r = len(input_ids)
        cache_len = seq.cache_len
        before = cache_bytes(seq.cache)
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device).unsqueeze(0)
        pos = torch.as_tensor(position_ids, dtype=torch.long, device=self.device).reshape(1, r)
        kwargs = {}
        if mask is not None:
            if mask.shape != (r, cache_len + r):
                raise ValueError(f"mask must be [{r}, {cache_len + r}]; got {tuple(mask.shape)}")
            additive = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
            additive.masked_fill_(~mask.to(self.device), torch.finfo(self.dtype).min)
            kwargs["attention_mask"] = additive.view(1, 1, r, cache_len + r)
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            use_cache=True,
            **{self._cache_kw: seq.cache},
            cache_position=torch.arange(cache_len, cache_len + r, device=self.device),
            output_hidden_states=output_hidden,
            **kwargs,
        )
        seq.tokens.extend(int(t) for t in input_ids)
        seq.provisional_rows = r
        hidden = out.hidden_states[-1][0] if output_hidden else None
        return ForwardOutput(logits=out.logits[0], kv_bytes_added=cache_bytes(seq.cache) - before, hidden=hidden)

    def keep_rows(self, seq: Sequence, keep_upto: int, extra_rows: Seq[int] = ()) -> None:
        """Keep cache rows ``[0, keep_upto)`` plus ``extra_rows`` (absolute indices, ascending);
        drop every other row. Contiguous cases crop; others gather."""
        extra = list(extra_rows)
        total = seq.cache_len
        if extra == list(range(keep_upto, keep_upto + len(extra))):
            new_len = keep_upto + len(extra)
            if new_len < total:
                seq.cache.crop(-(total - new_len))  # transformers 5.x: negative = tokens to remove
            seq.tokens = seq.tokens[:new_len]
        else:
            idx = torch.tensor(list(range(keep_upto)) + extra, dtype=torch.long, device=self.device)
            for i, (k, v) in enumerate(cache_kv(seq.cache)):
                set_cache_kv(seq.cache, i, k.index_select(-2, idx), v.index_select(-2, idx))
            seq.tokens = seq.tokens[:keep_upto] + [seq.tokens[i] for i in extra]
        seq.provisional_rows = 0
        seq.cache_generation += 1

    def truncate(self, seq: Sequence, length: int) -> None:
        if length < seq.cache_len:
            self.keep_rows(seq, length)

    # ------------------------------------------------------------------ round API
    def prefill(self, prompt_ids: Seq[int]) -> Sequence:
        """Cache every prompt token but the last, which becomes the first pending token."""
        if len(prompt_ids) < 1:
            raise ValueError("a prompt needs at least one token")
        seq = self.new_sequence()
        if len(prompt_ids) > 1:
            self.forward_rows(seq, prompt_ids[:-1], range(len(prompt_ids) - 1), None)
            seq.provisional_rows = 0
        return seq

    def verify(self, seq: Sequence, pending: int, tree: CompiledTree) -> ForwardOutput:
        """One forward over ``[pending] + rows``. Logits ``[1 + N, V]``: row 0 is the frontier."""
        cache_len = seq.cache_len
        n = tree.num_rows
        if n and tree.prefix_len != cache_len + 1:
            raise ValueError(f"tree compiled for prefix_len {tree.prefix_len}, cache holds {cache_len} + pending")
        ids = [pending] + tree.token_ids.tolist()
        pos = torch.cat([torch.tensor([cache_len]), tree.position_ids])
        mask = None
        if n and tree.topology != "sequence":  # a chain's ancestor mask is the causal mask
            mask = torch.zeros((1 + n, cache_len + 1 + n), dtype=torch.bool)
            mask[:, : cache_len + 1] = True
            mask[1:, cache_len + 1 :] = tree.ancestor_mask
        return self.forward_rows(seq, ids, pos, mask)

    def commit(self, seq: Sequence, accepted_rows: Seq[int]) -> None:
        """Keep the pending token's KV and the accepted path's rows only (0x0CB)."""
        base = seq.cache_len - seq.provisional_rows  # cache length before the verify forward
        self.keep_rows(seq, base + 1, [base + 1 + r for r in accepted_rows])
