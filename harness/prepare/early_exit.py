"""Distilling the Kangaroo early-exit adapter (Liu et al., 2024) for the configured target, and its
preparer. Kangaroo's adapter loss: ``L_KD = -tau^2 sum_i sum_v p_t^tau log p_s^tau`` over the
positions of each document whose next token is a label of the stream (:func:`row_labels`: an
assistant token where the stream has a ``loss_mask``, every position without one), teacher logits
recomputed from the cached final-norm rows through the frozen LM head; only adapter parameters
receive gradients. Every position still runs through the adapter's attention; a document with no
such position is not trained on, and held-out agreement counts the same positions.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from harness.heads.artifacts import adapter_artifact_path, load_adapter, missing, refuse_foreign
from harness.heads.checkpoint import cpu_budget_label, save_artifact
from harness.heads.early_exit import AdapterArtifact, ExitAdapter, adapter_logits, build_adapter
from harness.heads.recipes import AdapterRecipe
from harness.prepare import Preparation
from harness.prepare.heads_data import PackedStream, streams_record, training_data, training_text_record
from harness.prepare.heads_training import on_head, optimiser_step
from harness.prepare.trained import Target, load_or_train, of_context, trained_summary


def documents_of(stream: PackedStream) -> list[slice]:
    """Contiguous document slices of a packed stream (segment-causal rows, one forward each)."""
    seg = stream.segment_ids.tolist()
    out, start = [], 0
    for j in range(1, len(seg) + 1):
        if j == len(seg) or seg[j] != seg[start]:
            out.append(slice(start, j))
            start = j
    return out


def row_labels(stream: PackedStream, sl: slice) -> torch.Tensor:
    """``[L]`` bool: the rows of document ``sl`` the loss counts: row ``j`` predicts token ``j + 1``, a
    label of the stream inside the document (every row without a ``loss_mask``)."""
    n = sl.stop - sl.start
    if stream.loss_mask is None:
        return torch.ones(n, dtype=torch.bool)
    return torch.cat([stream.loss_mask[sl][1:], torch.zeros(1, dtype=torch.bool)])


@torch.no_grad()
def evaluate_adapter(
    adapter: ExitAdapter, model: torch.nn.Module, stream: PackedStream, *, layer: int, eta: float = 0.5
) -> dict:
    lm = model.get_output_embeddings()
    agree = conf_n = conf_agree = rows = 0
    for sl in documents_of(stream):
        counted = row_labels(stream, sl)
        if not bool(counted.any()):
            continue
        s = adapter_logits(adapter, model, stream.extra[layer][sl].float())  # [L, V]
        t = on_head(lm, stream.hidden[sl])  # [L, V]
        s, t = s[counted.to(s.device)], t[counted.to(t.device)]  # [L', V]
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
    docs = [sl for sl in documents_of(stream) if bool(row_labels(stream, sl).any())]
    if not docs:
        labels = "" if stream.loss_mask is None else " with a position before an assistant token"
        raise ValueError(f"the training stream has no documents{labels}")
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(adapter.parameters(), lr=recipe.lr)
    lm = model.get_output_embeddings()
    tau = recipe.distill_temperature
    total = len(docs) * recipe.epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(total, 1))
    adapter.train()
    t0 = time.perf_counter()
    last = None
    # closed on every way out: a failure's one line is printed on the line the bar cleared
    with tqdm(
        total=total, desc="train early-exit adapter", unit="doc", file=sys.stderr, disable=not progress, leave=False
    ) as bar:
        for _ in range(recipe.epochs):
            for k in torch.randperm(len(docs), generator=gen).tolist():
                sl = docs[k]
                student = adapter_logits(adapter, model, stream.extra[layer][sl].float())  # [L, V]
                counted = row_labels(stream, sl).to(student.device)
                student = student[counted]  # [L', V]
                with torch.no_grad():
                    teacher = torch.softmax(on_head(lm, stream.hidden[sl])[counted] / tau, -1)  # [L', V]
                loss = -(tau**2) * (teacher * torch.log_softmax(student / tau, -1)).sum(-1).mean()
                last = optimiser_step(loss, opt, sched, adapter.parameters(), bar)
    adapter.eval()
    return {"steps": total, "final_loss": last, "train_seconds": time.perf_counter() - t0, "stream_tokens": len(stream)}


def ensure_adapter(
    options: dict, target: Target, *, progress: bool = True, force: bool = False, documents=None
) -> AdapterArtifact:
    """The configured adapter artifact, distilled first when absent (and ``auto_train``) or ``force``.
    ``proposer.artifact`` naming anything but an absent path or an early-exit artifact is refused
    before anything is trained or written."""
    if options.get("artifact"):
        refuse_foreign("early_exit", options["artifact"])
    recipe, path = adapter_artifact_path(options, model=target.model, tokenizer=target.tokenizer, documents=documents)

    def train() -> AdapterArtifact:
        if not force and (options.get("artifact") or not options.get("auto_train", True)):
            raise missing("early_exit", path, bool(options.get("artifact")))
        return distill_adapter_artifact(options, recipe, target, out_dir=path, documents=documents, progress=progress)

    load = partial(load_adapter, options, model=target.model, tokenizer=target.tokenizer, path=path)
    return load_or_train(path, load=load, train=train, purpose="training the early-exit adapter", force=force)


def distill_adapter_artifact(
    options: dict, recipe: dict, target: Target, *, out_dir: Path, documents=None, progress: bool = True
) -> AdapterArtifact:
    """Streams (cached, with the exit layer's rows), distil, evaluate held-out, save. Returns the
    loaded artifact."""
    layer = recipe["exit_layer"]
    streams = training_data(target, recipe, documents=documents, progress=progress, layers=(layer,))
    model = target.model
    adapter = build_adapter(model, seed=int(recipe["train"]["seed"]))
    eta = float(options.get("eta", 0.5))
    before = evaluate_adapter(adapter, model, streams.held, layer=layer, eta=eta)
    log = train_adapter(
        adapter, model, streams.train, layer=layer, recipe=AdapterRecipe(**recipe["train"]), progress=progress
    )
    after = evaluate_adapter(adapter, model, streams.held, layer=layer, eta=eta)
    device = str(next(model.parameters()).device)
    manifest = {
        "kind": "early_exit",
        "target_hash": streams.target_hash,
        "target_source": streams.target_source,
        "recipe": recipe,
        "token_budget": streams.data.token_budget,
        "tokens_seen": len(streams.train),
        "streams": streams_record(streams),
        "training_text": training_text_record(streams),
        "held_out": {**after, "untrained": before, "split": streams.data.held_out_split},
        "training": {
            **log,
            "total_seconds": time.perf_counter() - streams.started,
            "device": device,
            "threads": torch.get_num_threads(),
        },
        "parameters": sum(p.numel() for p in adapter.parameters()),
    }
    manifest["cpu_budget_artifact"] = cpu_budget_label(manifest)  # from the tokens it saw, not the device
    save_artifact(out_dir, manifest=manifest, state=adapter.state_dict())
    return load_adapter(options, model=model, tokenizer=target.tokenizer, path=out_dir)


def train_from_config(cfg, *, target, force: bool = False, progress: bool = True) -> dict:
    """`harness train proposer=early_exit`."""

    options = OmegaConf.to_container(cfg.proposer, resolve=True)
    art = ensure_adapter(options, target, progress=progress, force=force)
    return trained_summary(art, held_out=art.manifest["held_out"])


def prepare_early_exit(options: dict, context) -> Preparation:
    """Proposer preparer: the adapter artifact's path (distilled first when absent)."""
    art = ensure_adapter(options, of_context(context))
    return Preparation(options={"artifact": str(art.path)})
