"""Draft-head networks: Medusa (Cai et al., 2024), Hydra (Ankner et al., 2024) and Clover (Xiao et
al., 2024).

Every head bank maps the *round context* and the embeddings of the path drafted so far to one hidden
vector per depth; the frozen target LM head turns it into logits (shared by every depth, never
copied, never trained). The round context is ``h_{t-1}``, the target's final-norm hidden state after
the token before the pending token ``x_t`` (Hydra's input), optionally refined once per round by the
Hydra++ prefix-attention layer. ``path_emb[:, j]`` is ``E(x_{t+j})``: ``j = 0`` is the pending token
(already committed), ``j >= 1`` drafted tokens.

- ``medusa``: head ``i`` sees ``(h_{t-1}, E(x_t))`` only — the committed prefix — whatever was
  drafted at depths ``< i`` (independent heads). All depths run in one stage.
- ``hydra``: head ``i`` sees ``concat(h_{t-1}, E(x_t), E(x̂_{t+1}), ..., E(x̂_{t+i-1}))``
  (input width ``(i + 1) d``), so depth ``i`` waits for depth ``i - 1`` (dependent heads).
- ``clover``: a fixed-width recurrent draft state ``s_0 = h_{t-1}``;
  ``s_i = s_{i-1} + W_O Attn(W_Q Norm(s_{i-1}), W_K E(path_{<i}), W_V E(path_{<i}))`` over the
  embeddings of the drafted path (the previous token last), then a per-depth predictor.
  The paper leaves the exact gate implementation-specific; this is a plain multi-head attention.

Adaptation to the pending-token engine: our target computes the pending token's row in the next
verify forward, so ``h_t`` is not available when proposing; Medusa's "hidden state at the prefix"
is therefore ``(h_{t-1}, E(x_t))`` here, the same prefix representation Hydra's first head uses.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

HEAD_KINDS = ("medusa", "hydra", "clover")


@dataclass(frozen=True)
class HeadSpec:
    """Architecture of a head bank (part of the artifact's recipe)."""

    kind: str  # medusa | hydra | clover
    num_heads: int  # K: deepest drafted position
    hidden_size: int  # d: target final hidden width
    embed_size: int  # d_e: target input-embedding width
    mlp_layers: int = 1  # residual SiLU blocks per head (Hydra++: 4)
    prefix_attention: bool = False  # Hydra++: one prefix-attention decoder layer per round
    prefix_window: int = 16  # committed positions the prefix layer attends to (h_{t-1} included)
    attn_heads: int = 4  # heads of the prefix / Clover attention

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"head kind must be one of {list(HEAD_KINDS)}; got {self.kind!r}")
        if self.num_heads < 1 or self.mlp_layers < 1 or self.prefix_window < 1:
            raise ValueError(f"num_heads, mlp_layers and prefix_window must be >= 1; got {self}")
        if self.hidden_size % self.attn_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by attn_heads {self.attn_heads}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def dependent(self) -> bool:
        return self.kind != "medusa"


def vocab_projection(lm_head: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``lm_head(h)`` for a few rows ``h`` ``[n, d]`` -> ``[n, V]``, computed as ``(W @ h.T).T``.

    Same values up to float rounding; on CPU the vocabulary projection is a memory-bound GEMM whose
    default layout is pathological for small ``n``: measured on this 2-core machine for SmolLM2
    (49,152 x 576), ``lm_head`` on 3 rows took 32 ms and on 1 row 8.8 ms, while ``W @ h.T`` on 3
    rows took 9.8 ms (docs/measurements.md). Proposal-side only: the target's logits are untouched.
    """
    if not isinstance(lm_head, torch.nn.Linear):
        return lm_head(h)
    out = torch.matmul(lm_head.weight, h.T).T  # [n, V]
    if lm_head.bias is not None:
        out = out + lm_head.bias
    return out


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``; zero-initialised so a fresh block is the identity."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., d]
        return x + nn.functional.silu(self.linear(x))


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Attention(nn.Module):
    """Multi-head attention of ``[B, Q, d]`` queries over ``[B, S, d_kv]`` keys/values with a
    ``[B, Q, S]`` bool mask (True = may attend)."""

    def __init__(self, width: int, kv_width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(kv_width, width, bias=False)
        self.v = nn.Linear(kv_width, width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        nn.init.zeros_(self.o.weight)  # a fresh layer adds nothing

    def forward(self, x: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, nq, d = x.shape
        s = kv.shape[1]
        hd = d // self.heads
        q = self.q(x).view(b, nq, self.heads, hd).transpose(1, 2)  # [B, H, Q, hd]
        k = self.k(kv).view(b, s, self.heads, hd).transpose(1, 2)  # [B, H, S, hd]
        v = self.v(kv).view(b, s, self.heads, hd).transpose(1, 2)  # [B, H, S, hd]
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)  # [B, H, Q, S]
        att = att.masked_fill(~mask.unsqueeze(1), float("-inf")).softmax(-1)
        out = (att @ v).transpose(1, 2).reshape(b, nq, d)  # [B, Q, d]
        return self.o(out)


class PrefixLayer(nn.Module):
    """Hydra++ prefix-attention decoder layer: ``h_{t-1}`` attends over the last ``W`` committed
    final-norm hidden states (itself included), then a residual MLP block. Runs once per round."""

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        d = spec.hidden_size
        self.norm_q = RMSNorm(d)
        self.norm_kv = RMSNorm(d)
        self.offset = nn.Parameter(torch.zeros(spec.prefix_window, d))  # learned offset embedding
        self.attn = Attention(d, d, spec.attn_heads)
        self.mlp = ResBlock(d)

    def forward(self, window: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """window: ``[B, W, d]`` with ``window[:, -1] = h_{t-1}``; mask: ``[B, W]`` bool. -> ``[B, d]``."""
        h = window[:, -1]  # [B, d]
        kv = self.norm_kv(window) + self.offset[: window.shape[1]].flip(0)  # [B, W, d]; offset row 0 = newest
        q = self.norm_q(h).unsqueeze(1)  # [B, 1, d]
        h = h + self.attn(q, kv, mask.unsqueeze(1)).squeeze(1)
        return self.mlp(h)


class DraftHeads(nn.Module):
    """A bank of ``K`` draft heads of one kind. Outputs are pre-LM-head hidden vectors ``[.., d]``."""

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        self.spec = spec
        d, de, k = spec.hidden_size, spec.embed_size, spec.num_heads
        self.prefix = PrefixLayer(spec) if spec.prefix_attention else None
        if spec.kind == "clover":
            self.state_norm = RMSNorm(d)
            self.regress = Attention(d, de, spec.attn_heads)
            self.in_proj = nn.ModuleList()
        else:
            widths = [d + de * (i if spec.kind == "hydra" else 1) for i in range(1, k + 1)]
            self.in_proj = nn.ModuleList(nn.Linear(w, d) for w in widths)
            for proj in self.in_proj:  # start near "the context alone" (identity on h_{t-1})
                with torch.no_grad():
                    proj.weight.mul_(0.1)
                    proj.weight[:, :d] += torch.eye(d)
                    proj.bias.zero_()
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(d) for _ in range(spec.mlp_layers))) for _ in range(k))

    # ------------------------------------------------------------------ round context
    def context(self, window: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, W, d]`` committed hidden rows (``[:, -1] = h_{t-1}``) -> round context ``[B, d]``.

        Without the prefix layer only ``h_{t-1}`` is used.
        """
        if self.prefix is None:
            return window[:, -1]
        if mask is None:
            mask = torch.ones(window.shape[:2], dtype=torch.bool, device=window.device)
        return self.prefix(window, mask)

    # ------------------------------------------------------------------ one depth
    def depth(self, i: int, ctx: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """Head ``i`` (1-based). ctx ``[B, d]``; path_emb ``[B, >= i, d_e]`` (only ``[:, :i]`` used:
        ``E(x_t), E(x̂_{t+1}), ..., E(x̂_{t+i-1})``). -> ``[B, d]``."""
        k = self.spec.num_heads
        if not 1 <= i <= k:
            raise ValueError(f"head index must be in [1, {k}]; got {i}")
        kind = self.spec.kind
        need = 1 if kind == "medusa" else i
        if path_emb.shape[1] < need:
            raise ValueError(f"{kind} head {i} needs {need} path embeddings; got {path_emb.shape[1]}")
        if kind == "clover":
            s = ctx
            for j in range(1, i + 1):
                s = self._clover_step(s, path_emb[:, :j])
            return self.blocks[i - 1](s)
        used = path_emb[:, :1] if kind == "medusa" else path_emb[:, :i]  # [B, 1 or i, d_e]
        x = torch.cat([ctx, used.reshape(used.shape[0], -1)], dim=-1)  # [B, d + (1 or i) d_e]
        return self.blocks[i - 1](self.in_proj[i - 1](x))

    def _clover_step(self, s: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """s ``[B, d]``; keys ``[B, j, d_e]`` (previous token last) -> ``[B, d]``."""
        mask = torch.ones(keys.shape[0], 1, keys.shape[1], dtype=torch.bool, device=keys.device)
        return s + self.regress(self.state_norm(s).unsqueeze(1), keys, mask).squeeze(1)

    def all_depths(self, ctx: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """Teacher-forced outputs of every head: ctx ``[B, d]``, path_emb ``[B, K, d_e]`` -> ``[B, K, d]``."""
        k = self.spec.num_heads
        if self.spec.kind == "clover":  # one recurrence serves every depth
            outs, s = [], ctx
            for i in range(1, k + 1):
                s = self._clover_step(s, path_emb[:, :i])
                outs.append(self.blocks[i - 1](s))
            return torch.stack(outs, dim=1)
        return torch.stack([self.depth(i, ctx, path_emb) for i in range(1, k + 1)], dim=1)

    def vocab_logits(self, depths: list[int], hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Rows of ``hidden`` ``[n, d]`` (row ``r`` from head ``depths[r]``) -> logits ``[n, V]``
        through the target's frozen LM head, shared by every depth (one product)."""
        w = lm_head.weight
        return vocab_projection(lm_head, hidden.to(device=w.device, dtype=w.dtype))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
