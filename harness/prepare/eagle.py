"""Training EAGLE-1/2 drafts (Li et al., 2024) for the configured target from cached target
features, and the EAGLE preparer.

Data: the heads' training streams (:func:`harness.prepare.heads_data.training_streams`): ShareGPT
documents run through the frozen target one at a time, final-norm rows cached in float16 and
shared with the Medusa / Hydra / Clover heads of the same data recipe. A document of ``L`` tokens
gives ``L - 1`` pairs ``(f_j, x_{j+1})`` at positions ``j``; the draft reads them causally (its
own attention over the document's earlier pairs) and regresses ``f_{j+1}``:

    loss = feature_weight * SmoothL1(g_j, f_{j+1}) + token_weight * CE(p_T(. | f_{j+1}), q(. | g_j))

with ``p_T = softmax(lm_head(f_{j+1}))`` recomputed through the frozen LM head batch by batch.
The target (embedding, LM head) is frozen; AdamW with warm-up and a cosine schedule.

Loss positions: with a stream ``loss_mask`` (assistant tokens, :mod:`harness.prepare.heads_data`) pair
``j`` counts only where the token it drafts, ``x_{j+2}`` (the one ``lm_head(g_j)`` predicts, as
``p_T`` from ``f_{j+1}`` does), lies in the document and is a label; every pair still feeds the draft's
attention. A document with no such pair is not trained on, and held-out agreement at depth ``d`` counts
an anchor only where the token drafted at that depth is a label. Without a mask every pair counts.

Held-out quality by draft depth ``d``: the draft runs ``d`` steps from each anchor, its own
predicted feature feeding the next step and the text's tokens feeding the embeddings (teacher
forcing on tokens, as the heads are measured), and its top-1 is compared with the target's top-1
at that position (``lm_head(f)``'s argmax). Depth 1 is the teacher-forced step training optimises.

The preparer makes sure the artifact a run loads exists (training it when absent and
``proposer.auto_train``); a published checkpoint (``proposer.artifact=PATH_OR_HUB_ID``) is loaded
as it is and never trained.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn
from tqdm import tqdm

from harness.heads.artifacts import (
    EagleArtifact,
    build_eagle,
    eagle_artifact_path,
    load_eagle,
    load_published_eagle,
    refuse_foreign,
)
from harness.heads.checkpoint import ArtifactError, save_artifact
from harness.heads.eagle import causal_mask
from harness.heads.published import is_published
from harness.heads.recipes import EagleTrainRecipe
from harness.prepare import Preparation
from harness.prepare.heads_data import PackedStream, trained_artifact_manifest, training_data
from harness.prepare.heads_training import optimiser_step, warmup_cosine
from harness.prepare.trained import (
    Target,
    load_or_train,
    of_context,
    refuse_untrained,
    streams_trained_summary,
    why_trained,
)

log = logging.getLogger("harness.eagle")


def documents_of(stream: PackedStream) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(tokens ``[L]``, features ``[L, d]``, labels ``[L]`` bool or None without a ``loss_mask``) per
    document of a packed stream (contiguous segments)."""
    if len(stream) == 0:
        return []
    seg = stream.segment_ids
    cuts = torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1
    bounds = [0, *cuts.tolist(), len(stream)]
    mask = stream.loss_mask
    return [
        (stream.tokens[a:b], stream.hidden[a:b], None if mask is None else mask[a:b])
        for a, b in zip(bounds[:-1], bounds[1:])
        if b - a >= 2
    ]


def pair_labels(doc: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """``[L - 1]`` bool: whether each pair ``j`` of a document counts in the loss: every pair without
    labels, else those whose drafted token ``x_{j+2}`` is in the document and a label."""
    tok, _, labels = doc
    if labels is None:
        return torch.ones(len(tok) - 1, dtype=torch.bool)
    return torch.cat([labels[2:], torch.zeros(1, dtype=torch.bool)])


def pair_batch(docs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], *, device=None):
    """Right-padded pairs of a few documents: features ``f_0..f_{L-2}`` ``[B, n, d]``, next tokens
    ``x_1..x_{L-1}`` ``[B, n]``, target features ``f_1..f_{L-1}`` ``[B, n, d]``, positions, the
    validity mask (the pairs the draft attends to) and the pairs the loss counts (:func:`pair_labels`)
    ``[B, n]`` (``n`` = longest document minus one)."""
    n = max(len(doc[0]) for doc in docs) - 1
    d = docs[0][1].shape[-1]
    b = len(docs)
    feats = torch.zeros(b, n, d)
    targets = torch.zeros(b, n, d)
    tokens = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    labelled = torch.zeros(b, n, dtype=torch.bool)
    for i, doc in enumerate(docs):
        tok, h = doc[0], doc[1]
        m = len(tok) - 1
        feats[i, :m] = h[:-1].float()
        targets[i, :m] = h[1:].float()
        tokens[i, :m] = tok[1:]
        valid[i, :m] = True
        labelled[i, :m] = pair_labels(doc)
    positions = torch.arange(n).repeat(b, 1)
    moved = (feats, tokens, targets, positions, valid, labelled)
    return tuple(t.to(device) for t in moved)


def target_logits(lm_head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The frozen target LM head on feature rows ``h`` (cast to the head's dtype)."""
    return lm_head(h.to(lm_head.weight.dtype))


def eagle_loss(draft, embed, lm_head, batch, recipe: EagleTrainRecipe, *, noise_gen=None) -> torch.Tensor:
    """The weighted feature and token losses, averaged over the pairs the loss counts (:func:`pair_batch`)."""
    feats, tokens, targets, positions, valid, labelled = batch
    if recipe.feature_noise > 0:
        u = torch.rand(feats.shape, generator=noise_gen).to(feats.device)
        feats = feats + (2 * u - 1) * recipe.feature_noise
    emb = embed(tokens).float()
    mask = causal_mask(feats.shape[0], feats.shape[1], 0, device=feats.device, valid=valid)
    g = draft(feats, emb, positions, mask=mask)  # [B, n, d]
    rows = labelled.float()
    count = rows.sum().clamp(min=1.0)
    loss = torch.zeros((), device=feats.device)
    if recipe.feature_weight > 0:
        v = nn.functional.smooth_l1_loss(g, targets, reduction="none").mean(-1)  # [B, n]
        loss = loss + recipe.feature_weight * (v * rows).sum() / count
    if recipe.token_weight > 0:
        with torch.no_grad():
            p = torch.softmax(target_logits(lm_head, targets).float(), dim=-1)  # [B, n, V]
        logq = torch.log_softmax(draft.logits(g, lm_head).float(), dim=-1)
        ce = -(p * logq).sum(-1)  # [B, n]
        loss = loss + recipe.token_weight * (ce * rows).sum() / count
    return loss


@torch.no_grad()
def evaluate_depths(draft, stream: PackedStream, *, embed, lm_head, depths: int, batch_size: int = 4) -> dict:
    """Held-out top-1 agreement with the target (and with the text) at draft depths ``1..depths``."""
    docs = documents_of(stream)
    agree = torch.zeros(depths)
    label = torch.zeros(depths)
    rows = torch.zeros(depths)
    was = draft.training
    draft.eval()
    dev = lm_head.weight.device
    for s in range(0, len(docs), batch_size):
        chunk = docs[s : s + batch_size]
        feats, tokens, targets, positions, valid, _ = pair_batch(chunk, device=dev)
        b, n, _ = feats.shape
        full = torch.zeros(b, n + 1, dtype=torch.long)  # x_0 .. x_{L-1} (+ padding)
        drafted = torch.ones(b, n + 1, dtype=torch.bool)  # whether x_p may be a counted draft (labels)
        for i, (tok, _, labels) in enumerate(chunk):
            full[i, : len(tok)] = tok
            if labels is not None:
                drafted[i] = False
                drafted[i, : len(tok)] = labels
        full, drafted = full.to(dev), drafted.to(dev)
        has_labels = torch.tensor([doc[2] is not None for doc in chunk], device=dev)
        lengths = valid.sum(1)  # pairs per document (L - 1)
        target_top = target_logits(lm_head, targets).argmax(-1)  # [B, n]: the target's top-1 after f_{j+1}
        cache = draft.new_cache()
        mask = causal_mask(b, n, 0, device=dev, valid=valid)
        g = draft(feats, embed(tokens).float(), positions, cache=cache, mask=mask)  # depth 1, [B, n, d]
        anchors = torch.arange(n, device=dev)
        for d in range(1, depths + 1):
            if d > 1:
                # depth d at anchor j: pair (g, x_{j+d}) at position j + d - 1; it sees the real pairs
                # <= j, its own chain rows of depths 2..d-1, and itself
                tok_idx = (anchors + d).clamp(max=n)
                step_tokens = full[:, tok_idx]  # [B, n]
                past = cache.length
                eye = torch.eye(n, dtype=torch.bool, device=dev)
                m = torch.zeros(b, n, past + n, dtype=torch.bool, device=dev)
                m[:, :, :n] = torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev)) & valid[:, None, :]
                for k in range(d - 2):  # earlier chain blocks
                    m[:, :, n + k * n : n + (k + 1) * n] = eye
                m[:, :, past:] = eye
                g = draft(g, embed(step_tokens).float(), positions + d - 1, cache=cache, mask=m, real=False)
            ok = (anchors[None, :] + d - 1) < lengths[:, None]  # f_{j+d} exists
            at = anchors + d + 1  # the drafted token x_{j+d+1}; past the document only without labels
            ok = ok & ((drafted[:, at.clamp(max=n)] & (at <= n)[None, :]) | ~has_labels[:, None])
            if not bool(ok.any()):
                continue
            top = draft.logits(g, lm_head).argmax(-1)  # [B, n]
            tgt_idx = (anchors + d - 1).clamp(max=n - 1)
            want = target_top[:, tgt_idx]
            text = full[:, (anchors + d + 1).clamp(max=n)]
            text_ok = ok & ((anchors[None, :] + d + 1) <= lengths[:, None])
            agree[d - 1] += ((top == want) & ok).sum().cpu()
            label[d - 1] += ((top == text) & text_ok).sum().cpu()
            rows[d - 1] += ok.sum().cpu()
    draft.train(was)
    frac = lambda x: [float(a / r) if r else None for a, r in zip(x, rows)]  # noqa: E731
    return {"rows": [int(r) for r in rows], "top1_agreement": frac(agree), "label_accuracy": frac(label)}


def train_eagle(draft, train: PackedStream, *, recipe: EagleTrainRecipe, embed, lm_head, progress: bool = True) -> dict:
    """Train in place on every document pair of the stream. Returns a log: steps, final loss, seconds."""
    for p in list(embed.parameters()) + list(lm_head.parameters()):
        p.requires_grad_(False)
    docs = [doc for doc in documents_of(train) if bool(pair_labels(doc).any())]
    if not docs:
        labels = "" if train.loss_mask is None else " with a pair whose drafted token is an assistant token"
        raise ValueError(f"the training stream has no document of >= 2 tokens{labels} ({len(train)} tokens)")
    gen = torch.Generator().manual_seed(recipe.seed)
    noise_gen = torch.Generator().manual_seed(recipe.seed + 1)
    steps_per_epoch = math.ceil(len(docs) / recipe.batch_size)
    total = steps_per_epoch * recipe.epochs
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = warmup_cosine(opt, total=total, warmup_steps=recipe.warmup_steps)
    device = next(lm_head.parameters()).device
    draft.train()
    t0 = time.perf_counter()
    step, last = 0, None
    # closed on every way out: a failure's one line is printed on the line the bar cleared
    with tqdm(
        total=total, desc="train eagle draft", unit="step", file=sys.stderr, disable=not progress, leave=False
    ) as bar:
        for _ in range(recipe.epochs):
            order = torch.randperm(len(docs), generator=gen).tolist()
            for s in range(0, len(order), recipe.batch_size):
                batch = pair_batch([docs[i] for i in order[s : s + recipe.batch_size]], device=device)
                loss = eagle_loss(draft, embed, lm_head, batch, recipe, noise_gen=noise_gen)
                last = optimiser_step(loss, opt, sched, params, bar)
                step += 1
    draft.eval()
    return {
        "steps": step,
        "planned_steps": total,
        "documents": len(docs),
        "pairs_per_epoch": sum(int(pair_labels(doc).sum()) for doc in docs),
        "final_loss": last,
        "train_seconds": time.perf_counter() - t0,
    }


def train_eagle_artifact(
    recipe: dict, target: Target, *, out_dir: Path, documents=None, progress: bool = True
) -> EagleArtifact:
    """Streams (cached, shared with the heads), train, held-out agreement by depth, save."""
    streams = training_data(target, recipe, documents=documents, progress=progress)
    train = EagleTrainRecipe(**recipe["train"])
    model = target.model
    device = next(model.parameters()).device
    draft = build_eagle(recipe["spec"], seed=train.seed).to(device)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    before = evaluate_depths(draft, streams.held, embed=embed, lm_head=lm_head, depths=train.eval_depths)
    log_ = train_eagle(draft, streams.train, recipe=train, embed=embed, lm_head=lm_head, progress=progress)
    after = evaluate_depths(draft, streams.held, embed=embed, lm_head=lm_head, depths=train.eval_depths)
    manifest = trained_artifact_manifest(
        "eagle",
        streams,
        recipe,
        published=False,
        format="eagle",
        before=before,
        after=after,
        training_log=log_,
        device=device,
        parameters=draft.num_parameters(),
    )
    save_artifact(out_dir, manifest=manifest, state={k: v.float() for k, v in draft.state_dict().items()})
    return load_eagle(recipe, model=model, tokenizer=target.tokenizer, path=out_dir)


def ensure_eagle(
    options: dict, target: Target, *, progress: bool = True, force: bool = False, documents=None
) -> EagleArtifact:
    """The configured draft: a published checkpoint as it is, else the trained artifact (trained
    first when absent and ``auto_train``, or when ``force``)."""
    explicit = options.get("artifact")
    if is_published(explicit):
        if force:
            raise ArtifactError(
                f"proposer.artifact={explicit!r} is a published checkpoint: it is loaded, never trained "
                "(unset proposer.artifact to train a draft here)"
            )
        return load_published_eagle(str(explicit), model=target.model)
    if explicit:  # never trained into, nor locked, unless it is absent or an EAGLE artifact
        refuse_foreign("eagle", explicit)
    recipe, path = eagle_artifact_path(options, model=target.model, tokenizer=target.tokenizer, documents=documents)

    def train() -> EagleArtifact:
        refuse_untrained("eagle", options, path, force=force)
        log.warning("training the EAGLE draft artifact (%s)", why_trained(path))
        return train_eagle_artifact(recipe, target, out_dir=path, documents=documents, progress=progress)

    load = partial(load_eagle, recipe, model=target.model, tokenizer=target.tokenizer, path=path)
    return load_or_train(path, load=load, train=train, purpose="training the EAGLE draft", force=force)


def summary(artifact: EagleArtifact) -> dict:
    m = artifact.manifest
    if m.get("published"):
        return {k: m[k] for k in ("kind", "format", "source", "path", "spec", "parameters", "embedding")}
    return streams_trained_summary(artifact, agreement="held_out_top1_agreement_by_depth")


def train_from_config(cfg, *, target, force: bool = False, progress: bool = True) -> dict:
    """`harness train proposer=eagle`: the artifact a run with ``cfg`` would load."""
    options = OmegaConf.to_container(cfg.proposer, resolve=True)
    options.pop("name")
    return summary(ensure_eagle(options, target, progress=progress, force=force))


def prepare_eagle(options: dict, context) -> Preparation:
    """Proposer preparer: the artifact's path (a trained one is trained first when absent). A
    published checkpoint is left to the proposer, which reads and checks it once."""
    if is_published(options.get("artifact")):
        return Preparation()
    art = ensure_eagle(options, of_context(context))
    return Preparation(options={"artifact": str(art.path)})
