"""Draft-head networks: Medusa (Cai et al., 2024), Hydra (Ankner et al., 2024) and Clover-2 (Xiao et
al., 2024, "Clover-2: Accurate Inference for Regressive Lightweight Speculative Decoding").

Every head bank maps the *round context* and the embeddings of the path drafted so far to one hidden
vector per depth; the frozen target LM head turns it into logits (shared by every depth, never
copied, never trained). For Medusa and Hydra the round context is ``h_{t-1}``, the target's
final-norm hidden state after the token before the pending token ``x_t`` (Hydra's input), optionally
refined once per round by the Hydra++ prefix-attention layer. ``path_emb[:, j]`` is ``E(x_{t+j})``:
``j = 0`` is the pending token (already committed), ``j >= 1`` drafted tokens.

- ``medusa``: head ``i`` sees ``(h_{t-1}, E(x_t))`` only — the committed prefix — whatever was
  drafted at depths ``< i`` (independent heads). All depths run in one stage.
- ``hydra``: head ``i`` sees ``concat(h_{t-1}, E(x_t), E(x̂_{t+1}), ..., E(x̂_{t+i-1}))``
  (input width ``(i + 1) d``), so depth ``i`` waits for depth ``i - 1`` (dependent heads).
- ``clover`` (Clover-2, as the authors' published code builds it):

  * the regressive cell :class:`CosineGateCell`, ``cell(x, y) = x + V(y) ⊙ cos_h(Q(RMSNorm(x)), K(y))``:
    the query from the normalised state ``x``, key and value from one token embedding ``y``, and per
    attention head ``h`` the cosine similarity of the query's and the key's ``h``-th slices as a gate
    in ``[-1, 1]`` on the value's ``h``-th slice (no softmax, no output projection);
  * the augmenting block :class:`AugmentingBlock`, over the committed rows: row ``p`` is
    ``a_p = cell_a(h_p, E(x_{p+1}))`` (its own cell), then ``CLOVER_AUGMENT_LAYERS`` Llama decoder
    layers with causal self-attention over the rows so far (RoPE at position ``p``, a KV cache, so
    each committed row is fed once), then an RMSNorm: ``s0_p``. The round context is
    ``s0 = s0_{t-1}``; it has read the pending token ``x_t`` through ``a_{t-1}``;
  * the recurrence, one cell step per depth with the state carried from depth to depth:
    depth 1 outputs ``o_1 = Norm(W_1 s0)``; depth ``i >= 2`` steps ``s_{i-1} = cell(s_{i-2}, e)``
    with ``e = E(x̂_{t+i-1})``, the token drafted at depth ``i - 1``, and outputs
    ``o_i = Norm(W_2 [s_{i-1}; e])`` (``W_1``: ``d -> d``; ``W_2``: ``d + d_e -> d``, shared by
    every depth ``>= 2``; one ``Norm`` shared by every depth).

  Differences from the published code: the heads read the target's final-norm rows (the published
  block reads unnormalised rows, by its data scripts' names, and its norm starts as the target's
  final norm), embed tokens with the target's input embedding (the published code embeds with a
  frozen copy of the LM head), their decoder layers are shaped by the spec (``attn_heads`` heads,
  SwiGLU width :func:`augment_intermediate`) and start as the identity instead of as a copy of the
  target's last decoder layer, and they train with this harness's hard-label or distillation loss
  (the published training adds a regression loss on the target's hidden states). ``CLOVER_VERSION``
  names this architecture in the artifact recipe.

Adaptation to the pending-token engine: our target computes the pending token's row in the next
verify forward, so ``h_t`` is not available when proposing; Medusa's "hidden state at the prefix"
is therefore ``(h_{t-1}, E(x_t))`` here, the same prefix representation Hydra's first head uses
(and Clover-2's augmenting block reads the same pair as its newest row).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from harness.heads.eagle import DecoderLayer, DraftKV, EagleSpec, causal_mask

HEAD_KINDS = ("medusa", "hydra", "clover")
#: the clover network's architecture revision, in its recipe's spec (clover only): an artifact trained
#: under another revision has another recipe, so it is refused (or retrained), never loaded into this one
CLOVER_VERSION = "clover-2"
#: Llama decoder layers in Clover-2's augmenting block (the authors' training configuration)
CLOVER_AUGMENT_LAYERS = 2


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
    attn_heads: int = 4  # heads of the prefix attention / of Clover-2's cells and augmenting layers
    version: str = ""  # clover: the architecture revision (CLOVER_VERSION); empty for the other kinds

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"head kind must be one of {list(HEAD_KINDS)}; got {self.kind!r}")
        if self.num_heads < 1 or self.mlp_layers < 1 or self.prefix_window < 1:
            raise ValueError(f"num_heads, mlp_layers and prefix_window must be >= 1; got {self}")
        attends = self.prefix_attention or self.kind == "clover"  # Medusa and plain Hydra have no attention
        if attends and self.hidden_size % self.attn_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by attn_heads {self.attn_heads}")
        if self.kind != "clover":
            if self.version:
                raise ValueError(f"version names a clover architecture revision; a {self.kind} spec has none")
            return
        if not self.version:
            object.__setattr__(self, "version", CLOVER_VERSION)
        if self.version != CLOVER_VERSION:
            raise ValueError(
                f"this harness builds the clover architecture {CLOVER_VERSION!r}; got {self.version!r}: "
                "retrain the heads"
            )
        if self.mlp_layers != 1 or self.prefix_attention:
            raise ValueError(
                "clover heads have no per-depth MLP blocks and no Hydra++ prefix layer (their augmenting block reads "
                f"every committed row): leave mlp_layers=1 and prefix_attention=false; got {self.mlp_layers}, "
                f"{self.prefix_attention}"
            )
        if (self.hidden_size // self.attn_heads) % 2:
            raise ValueError(
                "clover's augmenting layers rotate head slices of width hidden_size / attn_heads = "
                f"{self.hidden_size // self.attn_heads}: it must be even"
            )

    def to_dict(self) -> dict:
        """The spec as the recipe records it; ``version`` only for clover (the other kinds' recipe
        keys are what they were before clover had one)."""
        out = asdict(self)
        if self.kind != "clover":
            del out["version"]
        return out

    @property
    def dependent(self) -> bool:
        return self.kind != "medusa"


def vocab_projection(lm_head: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``lm_head(h)`` for a few rows ``h`` ``[n, d]`` -> ``[n, V]``, computed as ``(W @ h.T).T``.

    Same values up to float rounding; on CPU the vocabulary projection is a memory-bound GEMM whose
    default layout is pathological for small ``n``: measured on this 2-core machine for SmolLM2
    (49,152 x 576), ``lm_head`` on 3 rows took 32 ms and on 1 row 8.8 ms, while ``W @ h.T`` on 3
    rows took 9.8 ms (docs/measurements.md). Where the target's linear layers run a kernel of the
    harness (``model.linear_kernel``: the streaming kernel, which reads each weight row once for a few
    rows), the LM head's own forward is that kernel, and it is called. Proposal-side only: the
    target's logits are untouched.
    """
    if not isinstance(lm_head, torch.nn.Linear):
        return lm_head(h)
    if getattr(lm_head, "_harness_linear_kernel", "default") != "default":
        return lm_head(h)  # the target's own linear kernel (the streaming kernel reads each row once)
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


def _near_identity(weight: torch.Tensor, *, noise: float = 0.01) -> None:
    """``weight`` ``[out, in]`` := the identity on its leading square block plus ``U(-noise, noise)``."""
    nn.init.uniform_(weight, -noise, noise)
    n = min(weight.shape)
    weight[:n, :n] += torch.eye(n, dtype=weight.dtype, device=weight.device)


class CosineGateCell(nn.Module):
    """Clover-2's regressive cell ``x + V(y) ⊙ cos_h(Q(RMSNorm(x)), K(y))``.

    ``x`` ``[..., d]`` is the state, ``y`` ``[..., d_e]`` one token embedding. The query comes from the
    normalised state, key and value from the one token; for each of the ``heads`` slices of width
    ``d / heads``, the cosine similarity of the query's and the key's slices (each norm clamped at
    ``eps``) gates the value's slice. One key per query, so no softmax; no output projection. Query
    and key start near the identity and the value near zero, so a fresh cell nearly passes ``x``
    through.
    """

    def __init__(self, width: int, in_width: int, heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.heads = heads
        self.eps = eps
        self.norm = RMSNorm(width, eps)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(in_width, width)
        self.v = nn.Linear(in_width, width)
        with torch.no_grad():
            _near_identity(self.q.weight)
            _near_identity(self.k.weight)
            nn.init.uniform_(self.v.weight, -0.01, 0.01)
            for lin in (self.q, self.k, self.v):
                lin.bias.zero_()

    def gate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The per-head cosine gates ``[..., heads]`` of state ``x`` and token embedding ``y``."""
        q = self.q(self.norm(x))
        k = self.k(y)
        q = q.view(*q.shape[:-1], self.heads, -1)  # [..., H, d / H]
        k = k.view(*k.shape[:-1], self.heads, -1)
        q = nn.functional.normalize(q, dim=-1, eps=self.eps)
        k = nn.functional.normalize(k, dim=-1, eps=self.eps)
        return (q * k).sum(-1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        v = self.v(y)
        v = v.view(*v.shape[:-1], self.heads, -1) * self.gate(x, y).unsqueeze(-1)  # [..., H, d / H]
        return x + v.reshape(x.shape)


def augment_intermediate(width: int) -> int:
    """SwiGLU width of Clover-2's augmenting layers: Llama's ``8 d / 3``, rounded up to a multiple of 32
    (SmolLM2's 1,536 for ``d = 576``)."""
    return -(-8 * width // (3 * 32)) * 32


def rotary_tables(positions: torch.Tensor, head_dim: int, *, theta: float = 10000.0, dtype=torch.float32):
    """Llama's default rotary ``cos, sin`` ``[..., head_dim]`` at integer ``positions`` ``[...]``
    (angles computed in float32)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    ang = positions.to(torch.float32).unsqueeze(-1) * inv  # [..., head_dim / 2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


class AugmentingBlock(nn.Module):
    """Clover-2's augmenting block over the committed rows.

    Row ``p`` enters as ``a_p = cell(h_p, E(x_{p+1}))`` (its own :class:`CosineGateCell`), then
    passes :data:`CLOVER_AUGMENT_LAYERS` Llama decoder layers (:class:`harness.heads.eagle.DecoderLayer`,
    each with its input norm; causal self-attention over the rows fed so far, RoPE at position ``p``,
    a :class:`~harness.heads.eagle.DraftKV` cache) and an RMSNorm: ``s0_p``. Each layer's output
    projections start at zero, so a fresh layer is the identity.
    """

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        d, heads = spec.hidden_size, spec.attn_heads
        self.merge = CosineGateCell(d, spec.embed_size, heads)
        self.layer_spec = EagleSpec(
            version="eagle",
            hidden_size=d,
            intermediate_size=augment_intermediate(d),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=d // heads,
            vocab_size=1,  # unused: the layers have no vocabulary
            num_layers=CLOVER_AUGMENT_LAYERS,
        )
        self.layers = nn.ModuleList(DecoderLayer(self.layer_spec, i) for i in range(CLOVER_AUGMENT_LAYERS))
        for layer in self.layers:
            if not hasattr(layer, "input_layernorm"):  # EAGLE's layer 0 has none; every Clover-2 layer has one
                layer.input_layernorm = RMSNorm(d)
            nn.init.zeros_(layer.self_attn.o_proj.weight)
            nn.init.zeros_(layer.mlp.down_proj.weight)
        self.norm = RMSNorm(d)

    def new_cache(self) -> DraftKV:
        return DraftKV(CLOVER_AUGMENT_LAYERS)

    def forward(
        self,
        rows: torch.Tensor,
        next_emb: torch.Tensor,
        positions: torch.Tensor,
        *,
        cache: DraftKV | None = None,
    ) -> torch.Tensor:
        """rows ``[B, R, d]`` (``h_p``), next_emb ``[B, R, d_e]`` (``E(x_{p+1})``), positions ``[B, R]``
        -> ``s0`` ``[B, R, d]``. Each row sees the ``cache``'s rows and the new rows up to itself; the
        new rows' keys and values are appended to ``cache``."""
        b, r, _ = rows.shape
        a = self.merge(rows, next_emb)
        past = cache.length if cache is not None else 0
        mask = causal_mask(b, r, past, device=rows.device)
        cos, sin = rotary_tables(positions, self.layer_spec.head_dim, dtype=a.dtype)
        for layer in self.layers:
            a = layer(a, cos, sin, cache, mask)
        return self.norm(a)


class DraftHeads(nn.Module):
    """A bank of ``K`` draft heads of one kind. Outputs are pre-LM-head hidden vectors ``[.., d]``."""

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        self.spec = spec
        d, de, k = spec.hidden_size, spec.embed_size, spec.num_heads
        self.prefix = PrefixLayer(spec) if spec.prefix_attention else None
        if spec.kind == "clover":
            self.augment = AugmentingBlock(spec)
            self.regress = CosineGateCell(d, de, spec.attn_heads)  # one step per depth >= 2
            self.first = nn.Linear(d, d)  # W_1: depth 1 from s0
            self.deeper = nn.Linear(d + de, d)  # W_2: depth i >= 2 from [s_{i-1}; E(x̂_{t+i-1})]
            self.out_norm = RMSNorm(d)
            with torch.no_grad():  # start near "the state alone"
                _near_identity(self.first.weight)
                _near_identity(self.deeper.weight)
                self.first.bias.zero_()
                self.deeper.bias.zero_()
            self.in_proj = nn.ModuleList()
            self.blocks = nn.ModuleList()
            return
        self.augment = None
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

        Without the prefix layer only ``h_{t-1}`` is used. A clover bank's round context is its
        augmenting block's output over every committed row (:meth:`augment_rows`, :meth:`prefix_step`).
        """
        if self.augment is not None:
            raise ValueError(
                "a clover bank's round context is its augmenting block's output over every committed row "
                "(augment_rows / prefix_step), not a window of rows"
            )
        if self.prefix is None:
            return window[:, -1]
        if mask is None:
            mask = torch.ones(window.shape[:2], dtype=torch.bool, device=window.device)
        return self.prefix(window, mask)

    # ------------------------------------------------------------------ Clover-2's augmenting block
    def augment_rows(
        self, rows: torch.Tensor, next_emb: torch.Tensor, positions: torch.Tensor, *, cache: DraftKV | None = None
    ) -> torch.Tensor:
        """Clover: ``s0`` ``[B, R, d]`` of committed rows ``[B, R, d]`` with the embeddings of the
        tokens after them ``[B, R, d_e]`` at ``positions`` ``[B, R]`` (causal; see :class:`AugmentingBlock`)."""
        return self.augment(rows, next_emb, positions, cache=cache)

    def new_prefix_cache(self) -> DraftKV:
        """Clover: an empty KV cache of the augmenting block."""
        return self.augment.new_cache()

    def prefix_step(
        self, rows: torch.Tensor, positions: torch.Tensor, cache: DraftKV, next_emb: torch.Tensor
    ) -> torch.Tensor:
        """Clover: feed committed rows ``[n, d]`` at ``positions`` ``[n]``, with the embeddings of the
        tokens after them ``[n, d_e]``, through the augmenting block (its ``cache`` grows by ``n``)
        -> ``s0`` ``[n, d]`` of each."""
        w = self.first.weight
        out = self.augment(
            rows[None].to(w.dtype), next_emb[None].to(w.dtype), positions[None].to(rows.device), cache=cache
        )
        return out[0]

    # ------------------------------------------------------------------ Clover-2's recurrence
    def first_output(self, s0: torch.Tensor) -> torch.Tensor:
        """Clover depth 1: ``Norm(W_1 s0)`` ``[n, d]``."""
        return self.out_norm(self.first(s0))

    def step(self, state: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Clover: one cell step ``cell(s, e)`` ``[n, d]`` of the carried state ``[n, d]`` with the
        embedding ``[n, d_e]`` of the token just drafted from it."""
        return self.regress(state, emb)

    def deeper_output(self, state: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Clover depth ``i >= 2``: ``Norm(W_2 [s_{i-1}; e])`` ``[n, d]``."""
        return self.out_norm(self.deeper(torch.cat([state, emb], dim=-1)))

    # ------------------------------------------------------------------ one depth
    def depth(self, i: int, ctx: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """Head ``i`` (1-based). ctx ``[B, d]``; path_emb ``[B, >= i, d_e]`` (only ``[:, :i]`` used:
        ``E(x_t), E(x̂_{t+1}), ..., E(x̂_{t+i-1})``). -> ``[B, d]``.

        Clover: ``ctx`` is ``s0`` (which has read ``E(x_t)`` already); the state is stepped once per
        drafted token ``x̂_{t+1} .. x̂_{t+i-1}`` (``i - 1`` cell steps). A proposer carries the state
        from depth to depth instead of calling this per depth."""
        k = self.spec.num_heads
        if not 1 <= i <= k:
            raise ValueError(f"head index must be in [1, {k}]; got {i}")
        kind = self.spec.kind
        need = 1 if kind == "medusa" else i
        if path_emb.shape[1] < need:
            raise ValueError(f"{kind} head {i} needs {need} path embeddings; got {path_emb.shape[1]}")
        if kind == "clover":
            if i == 1:
                return self.first_output(ctx)
            s = ctx
            for j in range(1, i):
                s = self.step(s, path_emb[:, j])
            return self.deeper_output(s, path_emb[:, i - 1])
        used = path_emb[:, :1] if kind == "medusa" else path_emb[:, :i]  # [B, 1 or i, d_e]
        x = torch.cat([ctx, used.reshape(used.shape[0], -1)], dim=-1)  # [B, d + (1 or i) d_e]
        return self.blocks[i - 1](self.in_proj[i - 1](x))

    def all_depths(self, ctx: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """Teacher-forced outputs of every head: ctx ``[B, d]``, path_emb ``[B, K, d_e]`` -> ``[B, K, d]``.

        Clover: one cell step per depth ``>= 2``, the state carried, each step reading the true
        previous token ``path_emb[:, i - 1]``."""
        k = self.spec.num_heads
        if self.spec.kind == "clover":
            outs, s = [self.first_output(ctx)], ctx
            for i in range(2, k + 1):
                e = path_emb[:, i - 1]
                s = self.step(s, e)
                outs.append(self.deeper_output(s, e))
            return torch.stack(outs, dim=1)
        return torch.stack([self.depth(i, ctx, path_emb) for i in range(1, k + 1)], dim=1)

    def vocab_logits(self, depths: list[int], hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Rows of ``hidden`` ``[n, d]`` (row ``r`` from head ``depths[r]``) -> logits ``[n, V]``
        through the target's frozen LM head, shared by every depth (one product)."""
        w = lm_head.weight
        return vocab_projection(lm_head, hidden.to(device=w.device, dtype=w.dtype))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
