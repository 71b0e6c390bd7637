"""Tree attention through transformers' attention interface, without copying the cache per forward.

``harness_sdpa`` is registered with transformers' ``AttentionInterface`` (and its mask interface, so
transformers builds the same masks it builds for ``sdpa``). It is PyTorch's
``scaled_dot_product_attention`` with two differences from transformers' ``sdpa`` function:

- grouped-query attention never repeats the cached keys and values: the ``n_rep`` query heads that
  share a key/value head are folded into the query-row axis (``[B, H_q, R, d] -> [B, H_kv, n_rep R,
  d]``) and the boolean mask is repeated along the same axis, so a verify forward of R rows reads the
  cache as a one-row step does, instead of copying ``[B, H_kv, L, d]`` to ``[B, H_q, L, d]`` in
  every layer (transformers folds heads this way only for a single query row);
- the mask is boolean (``True`` = attend), never an additive float mask, so SDPA keeps its fused
  kernels for tree masks as for causal ones.

Without a mask (a prefill with no padding: plain causal attention) it defers to transformers' own
``sdpa`` function. Both arms of a run use the same target, so both use it.
"""

from __future__ import annotations

import torch

NAME = "harness_sdpa"


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query ``[B, H_q, R, d]``; key, value ``[B, H_kv, K, d]``; attention_mask bool ``[B, 1, R, K]``
    (or ``[B, H_q, R, K]``) or None. Returns ``[B, R, H_q, d]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or attention_mask.dtype != torch.bool or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    b, h_q, r, d = query.shape
    h_kv = key.shape[1]
    n_rep = h_q // h_kv
    k = key.shape[2]
    q = query.reshape(b, h_kv, n_rep * r, d)  # head h_kv * n_rep + j, row i -> group h_kv, row j * r + i
    if attention_mask.shape[1] == 1:
        mask = attention_mask.expand(b, 1, r, k).repeat(1, 1, n_rep, 1)  # [B, 1, n_rep R, K]
    else:  # a per-head mask: fold it as the queries
        mask = attention_mask.expand(b, h_q, r, k).reshape(b, h_kv, n_rep * r, k)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # [B, H_kv, n_rep R, d]
    return out.reshape(b, h_q, r, d).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``harness_sdpa`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, grouped_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def uses_boolean_masks(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes boolean masks (SDPA-based) rather than additive float masks."""
    return getattr(model.config, "_attn_implementation", "sdpa") in ("sdpa", NAME)
