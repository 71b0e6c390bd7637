"""Kangaroo early exit (Liu et al., 2024): ``M_s = A o M_b[:l]`` with the shared LM head.

The adapter ``A`` is one attention block of the target's own attention class plus two RMS norms, no
FFN: ``y = x + Attn(Norm_1(x))``, logits ``= lm_head(Norm_2(y))``. ``Norm_2`` starts from the
target's final norm and the attention output projection from zero, so an untrained adapter is the
plain "final norm + LM head on layer ``l``" exit. Training distils the frozen target (Kangaroo's
adapter loss): ``L_KD = -tau^2 sum_i sum_v p_t^tau log p_s^tau`` over every position of every
document, teacher logits recomputed from the cached final-norm rows through the frozen LM head. Only
adapter parameters receive gradients.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

#: KV-cache layer index of the adapter's attention inside a ProvisionalKV (never a target layer)
ADAPTER_LAYER = 1_000_000


class ExitAdapter(nn.Module):
    """Attention + two norms on the shallow residual stream of the target (no FFN)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        base = model.base_model
        cfg = model.config
        attn_cls = type(base.layers[0].self_attn)
        norm_cls = type(base.norm)
        eps = getattr(cfg, "rms_norm_eps", 1e-6)
        self.norm1 = norm_cls(cfg.hidden_size, eps=eps)
        self.attn = attn_cls(cfg, layer_idx=ADAPTER_LAYER)
        self.norm2 = norm_cls(cfg.hidden_size, eps=eps)

        params = inspect.signature(self.attn.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        with torch.no_grad():
            self.norm2.weight.copy_(base.norm.weight)
            self.attn.o_proj.weight.zero_()
            if self.attn.o_proj.bias is not None:
                self.attn.o_proj.bias.zero_()

    def forward(self, x: torch.Tensor, *, rope, mask: torch.Tensor, cache=None) -> torch.Tensor:
        """x ``[1, R, d]`` -> ``[1, R, d]`` (normalised, ready for the LM head). mask: additive
        ``[1, 1, R, C + R]``; ``cache``: a ProvisionalKV (inference) or None (training)."""
        kwargs = {self._cache_kw: cache} if cache is not None else {}
        a, _ = self.attn(self.norm1(x), position_embeddings=rope, attention_mask=mask, **kwargs)
        return self.norm2(x + a)


def _causal_additive(n: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    add = torch.zeros(n, n, dtype=dtype, device=device)
    add.masked_fill_(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)), torch.finfo(dtype).min)
    return add[None, None]  # [1, 1, n, n]


def adapter_logits(adapter: ExitAdapter, model: torch.nn.Module, shallow: torch.Tensor) -> torch.Tensor:
    """Teacher-forced adapter logits ``[L, V]`` for one document's shallow rows ``[L, d]``."""
    p = next(model.parameters())
    x = shallow[None].to(device=p.device, dtype=p.dtype)  # [1, L, d]
    pos = torch.arange(x.shape[1], device=x.device)[None]
    rope = model.base_model.rotary_emb(x, position_ids=pos)
    y = adapter(x, rope=rope, mask=_causal_additive(x.shape[1], x.dtype, x.device))
    return model.get_output_embeddings()(y)[0].float()


@dataclass(frozen=True)
class AdapterArtifact:
    adapter: ExitAdapter
    manifest: dict
    path: object


def build_adapter(model: torch.nn.Module, state: dict | None = None, *, seed: int = 0) -> ExitAdapter:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        p = next(model.parameters())
        adapter = ExitAdapter(model).to(device=p.device, dtype=p.dtype)
    if state is not None:
        adapter.load_state_dict(state, strict=True)
    return adapter.eval()
