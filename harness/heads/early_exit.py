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

import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from harness.heads.checkpoint import ArtifactError, artifact_dir, load_artifact, save_artifact, target_fingerprint
from harness.heads.data import DataRecipe, PackedStream, training_streams

#: KV-cache layer index of the adapter's attention inside a ProvisionalKV (never a target layer)
ADAPTER_LAYER = 1_000_000


@dataclass(frozen=True)
class AdapterRecipe:
    epochs: int = 1
    lr: float = 1e-3
    distill_temperature: float = 1.0
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


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
        import inspect

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


def _causal_additive(n: int, dtype: torch.dtype) -> torch.Tensor:
    add = torch.zeros(n, n, dtype=dtype)
    add.masked_fill_(~torch.tril(torch.ones(n, n, dtype=torch.bool)), torch.finfo(dtype).min)
    return add[None, None]  # [1, 1, n, n]


def adapter_logits(adapter: ExitAdapter, model: torch.nn.Module, shallow: torch.Tensor) -> torch.Tensor:
    """Teacher-forced adapter logits ``[L, V]`` for one document's shallow rows ``[L, d]``."""
    x = shallow[None].to(next(model.parameters()).dtype)  # [1, L, d]
    pos = torch.arange(x.shape[1])[None]
    rope = model.base_model.rotary_emb(x, position_ids=pos)
    y = adapter(x, rope=rope, mask=_causal_additive(x.shape[1], x.dtype))
    return model.get_output_embeddings()(y)[0].float()


def documents_of(stream: PackedStream) -> list[slice]:
    """Contiguous document slices of a packed stream (segment-causal rows, one forward each)."""
    seg = stream.segment_ids.tolist()
    out, start = [], 0
    for j in range(1, len(seg) + 1):
        if j == len(seg) or seg[j] != seg[start]:
            out.append(slice(start, j))
            start = j
    return out


@torch.no_grad()
def evaluate_adapter(
    adapter: ExitAdapter, model: torch.nn.Module, stream: PackedStream, *, layer: int, eta: float = 0.5
) -> dict:
    lm = model.get_output_embeddings()
    agree = conf_n = conf_agree = rows = 0
    for sl in documents_of(stream):
        s = adapter_logits(adapter, model, stream.extra[layer][sl].float())  # [L, V]
        t = lm(stream.hidden[sl].float()).float()  # [L, V]
        top_s, top_t = s.argmax(-1), t.argmax(-1)
        conf = torch.softmax(s, -1).max(-1).values
        agree += int((top_s == top_t).sum())
        sure = conf > eta
        conf_n += int(sure.sum())
        conf_agree += int(((top_s == top_t) & sure).sum())
        rows += s.shape[0]
    return {
        "rows": rows,
        "top1_agreement": agree / rows if rows else None,
        "confident_fraction": conf_n / rows if rows else None,
        "confident_top1_agreement": conf_agree / conf_n if conf_n else None,
        "eta": eta,
    }


def train_adapter(
    adapter: ExitAdapter,
    model: torch.nn.Module,
    stream: PackedStream,
    *,
    layer: int,
    recipe: AdapterRecipe,
    progress: bool = True,
) -> dict:
    from tqdm import tqdm

    for p in model.parameters():
        p.requires_grad_(False)
    docs = documents_of(stream)
    if not docs:
        raise ValueError("the training stream has no documents")
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(adapter.parameters(), lr=recipe.lr)
    lm = model.get_output_embeddings()
    tau = recipe.distill_temperature
    total = len(docs) * recipe.epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(total, 1))
    adapter.train()
    t0 = time.perf_counter()
    last = None
    bar = tqdm(
        total=total, desc="train early-exit adapter", unit="doc", file=sys.stderr, disable=not progress, leave=False
    )
    for _ in range(recipe.epochs):
        for k in torch.randperm(len(docs), generator=gen).tolist():
            sl = docs[k]
            student = adapter_logits(adapter, model, stream.extra[layer][sl].float())  # [L, V]
            with torch.no_grad():
                teacher = torch.softmax(lm(stream.hidden[sl].float()).float() / tau, -1)  # [L, V]
            loss = -(tau**2) * (teacher * torch.log_softmax(student / tau, -1)).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
            opt.step()
            sched.step()
            last = float(loss.detach())
            bar.update(1)
            bar.set_postfix(loss=f"{last:.3f}")
    bar.close()
    adapter.eval()
    return {"steps": total, "final_loss": last, "train_seconds": time.perf_counter() - t0, "stream_tokens": len(stream)}


def exit_recipe(options: dict, model: torch.nn.Module) -> dict:
    layers = int(model.config.num_hidden_layers)
    exit_layer = int(options.get("exit_layer", 2))
    if not 1 <= exit_layer < layers:
        raise ArtifactError(
            f"proposer.exit_layer must be in [1, {layers - 1}] for this {layers}-layer target; got {exit_layer}"
        )
    return {
        "exit_layer": exit_layer,
        "data": DataRecipe(**dict(options.get("data") or {})).to_dict(),
        "train": AdapterRecipe(**dict(options.get("train") or {})).to_dict(),
    }


@dataclass(frozen=True)
class AdapterArtifact:
    adapter: ExitAdapter
    manifest: dict
    path: object


def build_adapter(model: torch.nn.Module, state: dict | None = None, *, seed: int = 0) -> ExitAdapter:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        adapter = ExitAdapter(model).to(next(model.parameters()).dtype)
    if state is not None:
        adapter.load_state_dict(state, strict=True)
    return adapter.eval()


def ensure_adapter(
    options: dict,
    *,
    model: torch.nn.Module,
    tokenizer,
    target_source: str,
    progress: bool = True,
    force: bool = False,
    documents=None,
) -> AdapterArtifact:
    from pathlib import Path

    recipe = exit_recipe(options, model)
    target_hash = target_fingerprint(model, tokenizer)
    explicit = options.get("artifact")
    path = Path(explicit) if explicit else artifact_dir("early_exit", target_hash=target_hash, recipe=recipe)
    if not force and (path / "manifest.json").is_file():
        manifest, state = load_artifact(path, kind="early_exit", target_hash=target_hash, recipe=recipe)
        return AdapterArtifact(build_adapter(model, state), manifest, path)
    if not force and (explicit or not options.get("auto_train", True)):
        raise ArtifactError(
            f"no early_exit artifact at {str(path)!r}; run `harness train proposer=early_exit` "
            "(or set proposer.auto_train=true)"
        )
    t0 = time.perf_counter()
    layer = recipe["exit_layer"]
    data = DataRecipe(**recipe["data"])
    train, held = training_streams(
        model, tokenizer, data, target_hash=target_hash, documents=documents, progress=progress, layers=(layer,)
    )
    adapter = build_adapter(model, seed=int(recipe["train"]["seed"]))
    eta = float(options.get("eta", 0.5))
    before = evaluate_adapter(adapter, model, held, layer=layer, eta=eta)
    log = train_adapter(adapter, model, train, layer=layer, recipe=AdapterRecipe(**recipe["train"]), progress=progress)
    after = evaluate_adapter(adapter, model, held, layer=layer, eta=eta)
    device = str(next(model.parameters()).device)
    manifest = {
        "kind": "early_exit",
        "target_hash": target_hash,
        "target_source": target_source,
        "recipe": recipe,
        "token_budget": data.token_budget,
        "tokens_seen": len(train),
        "held_out": {**after, "untrained": before, "split": data.held_out_split},
        "training": {
            **log,
            "total_seconds": time.perf_counter() - t0,
            "device": device,
            "threads": torch.get_num_threads(),
        },
        "cpu_budget_artifact": device == "cpu",
        "parameters": sum(p.numel() for p in adapter.parameters()),
    }
    save_artifact(path, manifest=manifest, state=adapter.state_dict())
    manifest, state = load_artifact(path, kind="early_exit", target_hash=target_hash, recipe=recipe)
    return AdapterArtifact(build_adapter(model, state), manifest, path)


def train_from_config(cfg, *, target, force: bool = False, progress: bool = True) -> dict:
    """`harness train proposer=early_exit`."""
    from omegaconf import OmegaConf

    options = OmegaConf.to_container(cfg.proposer, resolve=True)
    art = ensure_adapter(
        options,
        model=target.model,
        tokenizer=target.tokenizer,
        target_source=target.source,
        progress=progress,
        force=force,
    )
    m = art.manifest
    return {
        "path": str(art.path),
        "artifact_id": m["artifact_id"],
        "kind": m["kind"],
        "target_hash": m["target_hash"],
        "token_budget": m["token_budget"],
        "held_out": m["held_out"],
        "training_seconds": m["training"]["total_seconds"],
        "cpu_budget_artifact": m["cpu_budget_artifact"],
        "recipe": m["recipe"],
    }
