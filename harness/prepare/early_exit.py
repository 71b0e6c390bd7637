"""Distilling the Kangaroo early-exit adapter (Liu et al., 2024) for the configured target, and its
preparer. Kangaroo's adapter loss: ``L_KD = -tau^2 sum_i sum_v p_t^tau log p_s^tau`` over every
position of every document, teacher logits recomputed from the cached final-norm rows through the
frozen LM head; only adapter parameters receive gradients.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from harness.files import artifact_lock
from harness.heads.artifacts import adapter_artifact_path, load_adapter
from harness.heads.checkpoint import ArtifactError, cpu_budget_label, save_artifact, target_fingerprint
from harness.heads.early_exit import AdapterArtifact, ExitAdapter, adapter_logits, build_adapter
from harness.heads.recipes import AdapterRecipe, DataRecipe
from harness.prepare import Preparation
from harness.prepare.heads_data import PackedStream, training_streams


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
    recipe, path = adapter_artifact_path(options, model=model, tokenizer=tokenizer)
    if not force and (path / "manifest.json").is_file():
        return load_adapter(options, model=model, tokenizer=tokenizer, path=path)
    with artifact_lock(path, purpose="training the early-exit adapter"):  # concurrent jobs train once
        if not force and (path / "manifest.json").is_file():  # trained by the job that held the lock
            return load_adapter(options, model=model, tokenizer=tokenizer, path=path)
        return _train_adapter_artifact(
            options,
            recipe,
            path,
            model=model,
            tokenizer=tokenizer,
            target_source=target_source,
            progress=progress,
            force=force,
            documents=documents,
        )


def _train_adapter_artifact(
    options: dict,
    recipe: dict,
    path: Path,
    *,
    model: torch.nn.Module,
    tokenizer,
    target_source: str,
    progress: bool,
    force: bool,
    documents,
) -> AdapterArtifact:
    target_hash = target_fingerprint(model, tokenizer)
    explicit = options.get("artifact")
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
        "parameters": sum(p.numel() for p in adapter.parameters()),
    }
    manifest["cpu_budget_artifact"] = cpu_budget_label(manifest)  # from the tokens it saw, not the device
    save_artifact(path, manifest=manifest, state=adapter.state_dict())
    return load_adapter(options, model=model, tokenizer=tokenizer, path=path)


def train_from_config(cfg, *, target, force: bool = False, progress: bool = True) -> dict:
    """`harness train proposer=early_exit`."""

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
        "cpu_budget_artifact": cpu_budget_label(m),
        "recipe": m["recipe"],
    }


def prepare_early_exit(options: dict, context) -> Preparation:
    """Proposer preparer: the adapter artifact's path (distilled first when absent)."""
    art = ensure_adapter(
        options,
        model=context.target_backend.model,
        tokenizer=context.tokenizer,
        target_source=context.model_source,
    )
    return Preparation(options={"artifact": str(art.path)})
