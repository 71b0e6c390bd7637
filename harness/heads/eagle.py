"""EAGLE draft networks: feature-level autoregressive drafting (EAGLE, Li et al., 2024; EAGLE-2's
dynamic trees use the same network; EAGLE-3, Li et al., 2025, drafts from fused low/mid/high
target features with its own draft-vocabulary head).

EAGLE-1/2 (:class:`EagleDraft`). A *pair* ``j`` is the target's feature ``f_j`` (its last-layer
hidden state after the final norm, the row the LM head reads) at position ``j`` together with the
next token ``x_{j+1}``. The network fuses them, ``z = fc(concat(E(x_{j+1}), f_j))`` (embedding
first), runs ``num_layers`` Llama decoder layers over every pair so far (its own KV cache; RoPE at
position ``j``; layer 0 has no input norm) and returns ``g_j``, its prediction of ``f_{j+1}``. The
target's frozen LM head turns ``g_j`` into the law of ``x_{j+2}``. Drafting deeper feeds the
network its own prediction: depth ``d``'s pair is ``(g, x̂)`` of depth ``d - 1``. Parameter names
are the published EAGLE-1/2 layout (``fc.*``, ``layers.{l}.*``), so a published checkpoint loads
key for key and an artifact trained here is written in that layout too.

EAGLE-3 (:class:`Eagle3Draft`). The first pair of a round reads ``concat(h_low, h_mid, h_high)``,
the residual stream entering three target layers (by default ``2, N // 2, N - 3`` of ``N``), fused
by ``fc`` to width ``H``; deeper pairs read the draft's own output ``g``. One decoder layer whose
attention sees ``concat(input_layernorm(E(x)), hidden_norm(z))`` (width ``2H``), then a final norm
and the draft's own head over a draft vocabulary of ``Vd`` tokens, mapped to target ids by
``d2t`` (``target = draft + d2t[draft]``); target tokens outside it get no mass.

The rotary embedding is transformers' ``LlamaRotaryEmbedding`` built from the draft's config
(default, linear, dynamic and llama3 scaling alike); norms, attention (softmax in float32) and the
SwiGLU MLP follow transformers' Llama layer operation for operation (a test compares them).

:class:`DraftKV` is the network's cache: ``[B, H_kv, S, d_h]`` per layer, cropped or gathered by the
proposer to hold only pairs on the committed path between rounds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

EAGLE_VERSIONS = ("eagle", "eagle3")


@dataclass(frozen=True)
class EagleSpec:
    """Architecture of an EAGLE draft (part of a trained artifact's recipe; read from a published
    checkpoint's config otherwise). ``vocab_size`` is the target's vocabulary."""

    version: str  # eagle (EAGLE-1/2 layout) | eagle3
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    fc_bias: bool = True  # EAGLE-1/2: fc.bias unless the config says "bias": false
    qkv_bias: bool = False
    mlp_bias: bool = False
    # EAGLE-3 only
    draft_vocab_size: int = 0  # 0: the target vocabulary
    target_hidden_size: int = 0  # 0: hidden_size
    aux_layers: tuple[int, ...] = ()  # target layers whose input residual stream is fused
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if self.version not in EAGLE_VERSIONS:
            raise ValueError(f"EAGLE version must be one of {list(EAGLE_VERSIONS)}; got {self.version!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"EAGLE drafts here use the SwiGLU MLP (hidden_act 'silu'); got {self.hidden_act!r}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1; got {self.num_layers}")
        if self.version == "eagle3" and (self.num_layers != 1 or len(self.aux_layers) != 3):
            raise ValueError(
                f"an EAGLE-3 draft has one decoder layer and three fused target layers; got num_layers="
                f"{self.num_layers}, aux_layers={list(self.aux_layers)}"
            )
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        return d

    @property
    def feature_width(self) -> int:
        """Width of one committed pair's target feature: ``H`` (EAGLE-1/2) or ``3 H_t`` (EAGLE-3)."""
        if self.version == "eagle3":
            return 3 * (self.target_hidden_size or self.hidden_size)
        return self.hidden_size

    def llama_config(self):
        """The transformers ``LlamaConfig`` of the draft's decoder layer (used for the rotary table)."""
        # transformers takes ~1.7 s to import on 2 cores; it is loaded already whenever a target is
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            attention_bias=self.qkv_bias,
            mlp_bias=self.mlp_bias,
            tie_word_embeddings=False,
        )


def spec_from_target(config, *, version: str = "eagle", **overrides) -> EagleSpec:
    """An EAGLE-1/2 draft shaped like one decoder layer of the target (EAGLE's own recipe: the
    draft's config is the target's with one layer)."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rope = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    base = dict(
        version=version,
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=int(config.vocab_size),
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        hidden_act=str(getattr(config, "hidden_act", "silu")),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
        rope_parameters=rope,
    )
    base.update(overrides)
    return EagleSpec(**base)


# --------------------------------------------------------------------------- pieces


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed in float32 as transformers does."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DraftKV:
    """The draft network's KV cache: per layer ``[B, H_kv, S, d_h]`` keys and values."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else int(k.shape[2])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Keep the first ``length`` rows."""
        for i, k in enumerate(self.keys):
            if k is not None and k.shape[2] > length:
                self.keys[i] = k[:, :, :length]
                self.values[i] = self.values[i][:, :, :length]

    def keep(self, rows: list[int]) -> None:
        """Keep exactly ``rows`` (ascending cache indices), in that order."""
        if rows == list(range(len(rows))):
            self.crop(len(rows))
            return
        for i, k in enumerate(self.keys):
            if k is not None:
                idx = torch.tensor(rows, dtype=torch.long, device=k.device)
                self.keys[i] = k.index_select(2, idx)
                self.values[i] = self.values[i].index_select(2, idx)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


class Attention(nn.Module):
    """Llama attention (GQA, RoPE, optional q/k/v biases as in Qwen2; ``o_proj`` has none) over a
    :class:`DraftKV` with an explicit bool mask ``[B, R, S + R]`` (True = may attend)."""

    def __init__(self, spec: EagleSpec, layer: int, in_width: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(in_width, self.heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, spec.hidden_size, bias=False)  # Llama and Qwen2 alike

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: DraftKV | None, mask: torch.Tensor
    ) -> torch.Tensor:
        b, r, _ = x.shape
        q = self.q_proj(x).view(b, r, self.heads, self.head_dim).transpose(1, 2)  # [B, nH, R, hd]
        k = self.k_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, nKV, R, hd]
        v = self.v_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, R, hd]
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # [B, nKV, S + R, hd]
        groups = self.heads // self.kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        att = torch.matmul(q, k.transpose(2, 3)) * self.scaling  # [B, nH, R, S + R]
        if mask is not None:
            att = att.masked_fill(~mask.unsqueeze(1), float("-inf"))
        att = torch.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(att, v).transpose(1, 2).reshape(b, r, self.heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        h, i, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer; EAGLE-1/2's layer 0 has no input norm (its input is the fused pair)."""

    def __init__(self, spec: EagleSpec, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer, spec.hidden_size)
        self.mlp = MLP(spec)
        if layer > 0:
            self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, cache, mask):
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(h, cos, sin, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Rotary(nn.Module):
    """cos/sin ``[B, R, d_h]`` for position ids ``[B, R]`` (transformers' Llama rotary embedding).

    The inverse frequencies stay float32 when the draft is cast to a half-precision dtype (as a
    transformers model loaded in bfloat16 keeps them), so RoPE angles at long positions are not
    rounded to 8 bits of mantissa."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.inner = LlamaRotaryEmbedding(spec.llama_config())
        self._inv_freq32 = self.inner.inv_freq.detach().float().clone()

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        device = self.inner.inv_freq.device
        self.inner.inv_freq = self._inv_freq32.to(device)
        self.inner.original_inv_freq = self._inv_freq32.to(device)
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(x, positions)


def causal_mask(batch: int, rows: int, past: int, *, device=None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """bool ``[B, R, past + R]``: every row sees the ``past`` cached rows and the new rows up to
    itself; ``valid`` ``[B, R]`` (optional) hides padded rows from every other row."""
    new = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=device))
    mask = torch.cat([torch.ones(rows, past, dtype=torch.bool, device=device), new], dim=1)
    mask = mask.unsqueeze(0).expand(batch, rows, past + rows).clone()
    if valid is not None:
        mask[:, :, past:] &= valid[:, None, :]
        mask[:, :, past:] |= torch.eye(rows, dtype=torch.bool, device=device)  # a padded row sees itself
    return mask


# --------------------------------------------------------------------------- networks


class EagleDraft(nn.Module):
    """EAGLE-1/2: ``fc`` over ``concat(E(x), f)`` then ``num_layers`` decoder layers; the target's LM
    head reads the output."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        if spec.version != "eagle":
            raise ValueError(f"EagleDraft is the EAGLE-1/2 network; got version {spec.version!r}")
        self.spec = spec
        h = spec.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=spec.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.rotary = Rotary(spec)

    def new_cache(self) -> DraftKV:
        return DraftKV(self.spec.num_layers)

    def forward(
        self,
        feature: torch.Tensor,
        emb: torch.Tensor,
        positions: torch.Tensor,
        *,
        cache: DraftKV | None = None,
        mask: torch.Tensor | None = None,
        real: bool = True,
    ) -> torch.Tensor:
        """feature ``[B, R, H]`` (``f`` or a drafted ``g``), emb ``[B, R, H]``, positions ``[B, R]``;
        mask bool ``[B, R, S + R]``. -> ``g`` ``[B, R, H]``. ``real`` is unused (the same fusion
        serves target features and drafted ones)."""
        z = self.fc(torch.cat([emb, feature], dim=-1))
        cos, sin = self.rotary(z, positions)
        for layer in self.layers:
            z = layer(z, cos, sin, cache, mask)
        return z

    def logits(self, g: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Target-vocabulary logits ``[..., V]`` of features (drafted or the target's own) through the
        target's LM head, in the head's dtype."""
        weight = getattr(lm_head, "weight", None)
        return lm_head(g if weight is None else g.to(weight.dtype))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over ``concat(input_layernorm(E(x)), hidden_norm(z))``."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        h = spec.hidden_size
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.self_attn = Attention(spec, 0, 2 * h)
        self.mlp = MLP(spec)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.norm_before_residual = spec.norm_before_residual

    def forward(self, z, emb, cos, sin, cache, mask):
        zn = self.hidden_norm(z)
        residual = zn if self.norm_before_residual else z
        x = residual + self.self_attn(torch.cat([self.input_layernorm(emb), zn], dim=-1), cos, sin, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    """EAGLE-3: fused low/mid/high target features, one layer, its own norm and draft-vocabulary head."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        if spec.version != "eagle3":
            raise ValueError(f"Eagle3Draft is the EAGLE-3 network; got version {spec.version!r}")
        self.spec = spec
        h = spec.hidden_size
        vd = spec.draft_vocab_size or spec.vocab_size
        self.fc = nn.Linear(spec.feature_width, h, bias=False)
        self.midlayer = Eagle3Layer(spec)
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.rotary = Rotary(spec)

    def new_cache(self) -> DraftKV:
        return DraftKV(1)

    def forward(self, feature, emb, positions, *, cache=None, mask=None, real: bool = True) -> torch.Tensor:
        """``real``: ``feature`` is ``concat(h_low, h_mid, h_high)`` ``[B, R, 3 H_t]`` of committed
        pairs (fused by ``fc``); otherwise it is a drafted ``g`` ``[B, R, H]``."""
        z = self.fc(feature) if real else feature
        cos, sin = self.rotary(z, positions)
        return self.midlayer(z, emb, cos, sin, cache, mask)

    def logits(self, g: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Target-vocabulary logits ``[..., V]``: the draft head's ``Vd`` logits at their target ids,
        ``-inf`` elsewhere (no mass outside the draft vocabulary)."""
        draft = self.lm_head(self.norm(g))  # [..., Vd]
        v = self.spec.vocab_size
        if draft.shape[-1] == v and not bool(self.d2t.any()):
            return draft
        out = torch.full((*draft.shape[:-1], v), float("-inf"), dtype=draft.dtype, device=draft.device)
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t
        out[..., ids] = draft
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_draft(spec: EagleSpec) -> EagleDraft | Eagle3Draft:
    return EagleDraft(spec) if spec.version == "eagle" else Eagle3Draft(spec)
