"""Training draft heads on cached target hidden states (hard labels or target distillation).

Rows come from :func:`harness.prepare.teacher_rows.max_head` over a packed stream: anchor ``t``
trains heads ``1 .. max_head[t]`` under teacher forcing (the ground-truth prior tokens are the
inputs; the label ``tokens[t + i]`` never is). Losses, with ``lambda_i = head_decay ** (i - 1)``:

- ``hard``:    ``sum_i lambda_i CE(q_i(. | h, x_{t:t+i-1}), x_{t+i})``
- ``distill``: ``-tau^2 sum_i lambda_i sum_v p_T^tau(v | x_{<=t+i-1}) log q_i^tau(v | ...)`` where the
  teacher logits are recomputed as ``lm_head(hidden[t + i - 1])`` (the cached target row that
  predicts the label position) through the frozen LM head, batch by batch, never stored.

Clover-2 heads: the round context of anchor ``t`` is the augmenting block's output at row ``t - 1``,
causal over every row of the anchor's run from its start (as at decode time over every committed
row), each row ``p`` with ``E(tokens[p + 1])``; then one cell step per depth, each reading the true
previous token. A clover step therefore trains consecutive anchors of one run (at most
``batch_size`` of them; short pieces of several runs share a step), its augmenting pass covering
each run's rows from the run's start to the piece's last anchor; the pieces are shuffled each epoch.

Loss positions: head ``i``'s row at anchor ``t`` counts only where its label ``tokens[t + i]`` is a
label of the stream (``loss_mask``: an assistant token, :mod:`harness.prepare.heads_data`); its inputs
and context are every token as before. An anchor none of whose heads has such a label is not trained
on (:func:`labelled_anchors`), and the held-out agreement counts the same rows.

The target (embeddings, LM head) is frozen; only head parameters receive gradients. AdamW with a
cosine schedule (the source-reported recipe; not a universal setting). Held-out quality is the
top-1 agreement of each head with the target's own top-1 at the label position.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, fields, replace

import torch
from torch import nn
from tqdm import tqdm

from harness.heads.models import DraftHeads
from harness.heads.recipes import TrainRecipe
from harness.prepare.heads_data import PackedStream
from harness.prepare.teacher_rows import max_head, run_lengths


@dataclass
class Batch:
    anchors: torch.Tensor  # [B] t
    ctx_window: torch.Tensor | None  # [B, W, d] hidden rows t-W .. t-1 (zeros where masked); clover: None
    ctx_mask: torch.Tensor | None  # [B, W] bool; clover: None
    path: torch.Tensor  # [B, K] tokens t .. t+K-1 (clamped at the stream end; masked by head_mask)
    labels: torch.Tensor  # [B, K] tokens t+1 .. t+K
    teacher_rows: torch.Tensor  # [B, K, d] hidden rows t .. t+K-1 (predict the labels)
    head_mask: torch.Tensor  # [B, K] bool: head i has a row at this anchor and its label is a loss position
    # clover: the augmenting block's input, R runs from their starts (zeros past each run's rows)
    run_rows: torch.Tensor | None = None  # [R, L, d] hidden rows h_p
    run_next: torch.Tensor | None = None  # [R, L] tokens x_{p+1}
    anchor_row: torch.Tensor | None = None  # [B] the index of row t - 1 in the flattened [R * L]

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device`` (the target's, where its embedding and LM head run)."""
        return Batch(**{f.name: _moved(getattr(self, f.name), device) for f in fields(self)})


def _moved(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def gather_batch(
    stream: PackedStream, anchors: torch.Tensor, *, heads: torch.Tensor, run: torch.Tensor, num_heads: int, window: int
) -> Batch:
    """Index a packed stream at anchors ``[B]`` (``heads``: ``max_head`` ``[N]``; ``run``: run lengths ``[N]``).
    A head's row is masked out where its label is not one of the stream's labels (``loss_mask``)."""
    n = len(stream)
    k_idx = torch.arange(num_heads)  # [K]
    pos = (anchors[:, None] + k_idx[None, :]).clamp(max=n - 1)  # [B, K] t + j
    lab = (anchors[:, None] + k_idx[None, :] + 1).clamp(max=n - 1)  # [B, K] t + j + 1
    offs = torch.arange(window - 1, -1, -1)  # [W] distance from t-1, oldest first
    prev = anchors - 1  # [B]
    win = prev[:, None] - offs[None, :]  # [B, W]
    win_mask = offs[None, :] < run[prev][:, None]  # [B, W] inside the run ending at t-1
    hidden = stream.hidden
    ctx = hidden[win.clamp(min=0)].float() * win_mask[..., None]  # [B, W, d]
    return Batch(
        anchors=anchors,
        ctx_window=ctx,
        ctx_mask=win_mask,
        path=stream.tokens[pos],
        labels=stream.tokens[lab],
        teacher_rows=hidden[pos].float(),
        head_mask=(k_idx[None, :] < heads[anchors][:, None]) & stream.labels()[lab],
    )


def labelled_anchors(stream: PackedStream, heads: torch.Tensor, *, num_heads: int) -> torch.Tensor:
    """``[A]`` ascending: the anchors ``t`` with a row of some head ``i <= heads[t]`` (``max_head``)
    whose label ``tokens[t + i]`` is one of the stream's labels (every anchor with a row, without a
    ``loss_mask``)."""
    if stream.loss_mask is None:
        return torch.nonzero(heads >= 1).flatten()
    n = heads.numel()
    ok = torch.zeros(n, dtype=torch.bool)
    for i in range(1, min(num_heads, n - 1) + 1):
        t = torch.arange(n - i)
        ok[t] |= (heads[t] >= i) & stream.loss_mask[t + i]
    return torch.nonzero(ok).flatten()


def clover_pieces(anchors: torch.Tensor, run: torch.Tensor, size: int) -> list[tuple[int, torch.Tensor]]:
    """Clover: ``(start, anchors)`` pieces: the ascending ``anchors`` ``[A]`` grouped by the run they
    lie in (``start``: the run's first position, ``t - run[t - 1]``), each run's cut into consecutive
    pieces of at most ``size``."""
    if anchors.numel() == 0:
        return []
    starts = anchors - run[anchors - 1]  # [A], non-decreasing
    keys, counts = torch.unique_consecutive(starts, return_counts=True)
    out = []
    for start, mine in zip(keys.tolist(), torch.split(anchors, counts.tolist())):
        out.extend((int(start), mine[i : i + size]) for i in range(0, mine.numel(), size))
    return out


def pack_pieces(pieces: list[tuple[int, torch.Tensor]], size: int) -> list[list[tuple[int, torch.Tensor]]]:
    """Consecutive pieces grouped into steps of at most ``size`` anchors (a piece never split)."""
    steps: list[list[tuple[int, torch.Tensor]]] = []
    held = 0
    for piece in pieces:
        n = piece[1].numel()
        if steps and held + n <= size:
            steps[-1].append(piece)
            held += n
        else:
            steps.append([piece])
            held = n
    return steps


def gather_clover_batch(
    stream: PackedStream,
    pieces: list[tuple[int, torch.Tensor]],
    *,
    heads: torch.Tensor,
    run: torch.Tensor,
    num_heads: int,
) -> Batch:
    """Clover: the anchors of ``pieces`` (as :func:`gather_batch` gives them) and the augmenting
    block's input: for each piece, its run's rows ``start .. t_last - 1`` and the token after each."""
    anchors = torch.cat([a for _, a in pieces])
    batch = gather_batch(stream, anchors, heads=heads, run=run, num_heads=num_heads, window=1)
    lengths = [int(a[-1]) - start for start, a in pieces]  # rows start .. t_last - 1
    width = max(lengths)
    rows = torch.zeros(len(pieces), width, stream.hidden.shape[1])
    nxt = torch.zeros(len(pieces), width, dtype=stream.tokens.dtype)
    index = []
    for r, ((start, a), n) in enumerate(zip(pieces, lengths)):
        rows[r, :n] = stream.hidden[start : start + n].float()
        nxt[r, :n] = stream.tokens[start + 1 : start + n + 1]
        index.append(r * width + (a - 1 - start))
    return replace(batch, ctx_window=None, ctx_mask=None, run_rows=rows, run_next=nxt, anchor_row=torch.cat(index))


def clover_context(heads: DraftHeads, batch: Batch, *, embed: nn.Module) -> torch.Tensor:
    """Clover: ``s0`` at each anchor ``[B, d]``: the augmenting block over the batch's runs (row
    ``j`` of a run at position ``j``), read at row ``t - 1``."""
    r, width = batch.run_next.shape
    positions = torch.arange(width, device=batch.run_next.device).expand(r, width)
    s0 = heads.augment_rows(batch.run_rows, embed(batch.run_next).float(), positions)  # [R, L, d]
    return s0.reshape(r * width, -1)[batch.anchor_row]


def on_head(lm_head: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """The target's LM head on hidden rows ``[..., d]`` (of any dtype and device), computed on the
    head's device and in its dtype: float32 logits ``[..., V]``."""
    w = lm_head.weight
    return lm_head(rows.to(device=w.device, dtype=w.dtype)).float()


def head_logits(heads: DraftHeads, batch: Batch, *, embed: nn.Module, lm_head: nn.Module) -> torch.Tensor:
    """Teacher-forced logits of every head ``[B, K, V]``."""
    if heads.spec.kind == "clover":
        ctx = clover_context(heads, batch, embed=embed)  # [B, d]
    else:
        ctx = heads.context(batch.ctx_window, batch.ctx_mask)  # [B, d]
    path_emb = embed(batch.path).float()  # [B, K, d_e]
    out = heads.all_depths(ctx, path_emb)  # [B, K, d]
    return on_head(lm_head, out)


def head_loss(logits: torch.Tensor, batch: Batch, *, recipe: TrainRecipe, lm_head: nn.Module) -> torch.Tensor:
    """Weighted per-head loss (scalar). logits ``[B, K, V]``."""
    k = logits.shape[1]
    weights = torch.tensor([recipe.head_decay**i for i in range(k)], device=logits.device)  # [K]
    mask = batch.head_mask.float()  # [B, K]
    if recipe.loss == "hard":
        ce = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), reduction="none"
        ).view_as(mask)  # [B, K]
        per = ce
    else:
        tau = recipe.distill_temperature
        with torch.no_grad():
            teacher = torch.softmax(on_head(lm_head, batch.teacher_rows) / tau, dim=-1)  # [B, K, V]
        per = -(tau**2) * (teacher * torch.log_softmax(logits / tau, dim=-1)).sum(-1)  # [B, K]
    per_head = (per * mask).sum(0) / mask.sum(0).clamp(min=1.0)  # [K]
    return (weights * per_head).sum()


@torch.no_grad()
def evaluate(
    heads: DraftHeads, stream: PackedStream, *, embed: nn.Module, lm_head: nn.Module, batch_size: int = 64
) -> dict:
    """Held-out top-1 agreement with the target (and with the text label), per head."""
    k = heads.spec.num_heads
    if len(stream) == 0:
        return {"rows": [0] * k, "top1_agreement": [None] * k, "label_accuracy": [None] * k}
    heads_max = max_head(stream.segment_ids, stream.valid, max_future=k)
    run = run_lengths(stream.segment_ids, stream.valid)
    anchors = labelled_anchors(stream, heads_max, num_heads=k)
    agree = torch.zeros(k)
    label = torch.zeros(k)
    rows = torch.zeros(k)
    was = heads.training
    heads.eval()
    if heads.spec.kind == "clover":
        batches = (
            gather_clover_batch(stream, step, heads=heads_max, run=run, num_heads=k)
            for step in pack_pieces(clover_pieces(anchors, run, batch_size), batch_size)
        )
    else:
        batches = (
            gather_batch(
                stream,
                anchors[s : s + batch_size],
                heads=heads_max,
                run=run,
                num_heads=k,
                window=heads.spec.prefix_window,
            )
            for s in range(0, anchors.numel(), batch_size)
        )
    for b in batches:
        b = b.to(lm_head.weight.device)
        top = head_logits(heads, b, embed=embed, lm_head=lm_head).argmax(-1)  # [B, K]
        target_top = on_head(lm_head, b.teacher_rows).argmax(-1)  # [B, K]
        m = b.head_mask
        agree += ((top == target_top) & m).sum(0).cpu()
        label += ((top == b.labels) & m).sum(0).cpu()
        rows += m.sum(0).cpu()
    heads.train(was)
    frac = lambda x: [float(a / r) if r else None for a, r in zip(x, rows)]  # noqa: E731
    return {"rows": [int(r) for r in rows], "top1_agreement": frac(agree), "label_accuracy": frac(label)}


def warmup_cosine(opt: torch.optim.Optimizer, *, total: int, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``min(warmup_steps, total // 10)`` steps (at least one), then cosine
    decay to zero at step ``total``."""
    warm = min(warmup_steps, max(total // 10, 1))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(total - warm, 1)))
    )


def optimiser_step(loss: torch.Tensor, opt: torch.optim.Optimizer, sched, params, bar) -> float:
    """One step on ``loss``: gradients of ``params`` clipped to norm 1, the optimiser and its
    schedule stepped, the progress bar advanced with the loss shown. Returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    value = float(loss.detach())
    bar.update(1)
    bar.set_postfix(loss=f"{value:.3f}")
    return value


def train_heads(
    heads: DraftHeads,
    train: PackedStream,
    *,
    recipe: TrainRecipe,
    embed: nn.Module,
    lm_head: nn.Module,
    progress: bool = True,
    max_seconds: float | None = None,
) -> dict:
    """Train in place. Returns a log: steps, tokens seen, final loss, seconds."""

    for p in list(embed.parameters()) + list(lm_head.parameters()):
        p.requires_grad_(False)
    k = heads.spec.num_heads
    heads_max = max_head(train.segment_ids, train.valid, max_future=k)  # [N]
    run = run_lengths(train.segment_ids, train.valid)  # [N]
    anchors = labelled_anchors(train, heads_max, num_heads=k)  # [A]
    if anchors.numel() == 0:
        labels = (
            "" if train.loss_mask is None else " with an assistant-token label (proposer.data.loss_tokens=all: any)"
        )
        raise ValueError(
            f"the training stream has no teacher rows{labels} ({len(train)} tokens, {train.num_documents} documents)"
        )
    gen = torch.Generator().manual_seed(recipe.seed)
    if heads.spec.kind == "clover":  # every epoch's steps, planned now: their count sets the schedule
        pieces = clover_pieces(anchors, run, recipe.batch_size)
        plan = [
            pack_pieces([pieces[i] for i in torch.randperm(len(pieces), generator=gen).tolist()], recipe.batch_size)
            for _ in range(recipe.epochs)
        ]
        total = sum(len(steps) for steps in plan)
    else:
        steps_per_epoch = math.ceil(anchors.numel() / recipe.batch_size)
        total = steps_per_epoch * recipe.epochs

    def epoch_batches(epoch: int):
        """The epoch's batches, in order (Medusa and Hydra: a fresh permutation of the anchors)."""
        if heads.spec.kind == "clover":
            for step in plan[epoch]:
                yield gather_clover_batch(train, step, heads=heads_max, run=run, num_heads=k)
            return
        order = anchors[torch.randperm(anchors.numel(), generator=gen)]
        for s in range(0, order.numel(), recipe.batch_size):
            yield gather_batch(
                train,
                order[s : s + recipe.batch_size],
                heads=heads_max,
                run=run,
                num_heads=k,
                window=heads.spec.prefix_window,
            )

    opt = torch.optim.AdamW(
        [p for p in heads.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=recipe.weight_decay
    )
    sched = warmup_cosine(opt, total=total, warmup_steps=recipe.warmup_steps)
    heads.train()
    t0 = time.perf_counter()
    step, last_loss, stopped = 0, None, False
    # closed on every way out: a failure's one line is printed on the line the bar cleared
    with tqdm(
        total=total,
        desc=f"train {heads.spec.kind} heads",
        unit="step",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    ) as bar:
        for epoch in range(recipe.epochs):
            for batch in epoch_batches(epoch):
                batch = batch.to(lm_head.weight.device)
                logits = head_logits(heads, batch, embed=embed, lm_head=lm_head)
                loss = head_loss(logits, batch, recipe=recipe, lm_head=lm_head)
                last_loss = optimiser_step(loss, opt, sched, heads.parameters(), bar)
                step += 1
                if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                    stopped = True
                    break
            if stopped:
                break
    heads.eval()
    return {
        "steps": step,
        "planned_steps": total,
        "rows_per_epoch": int(anchors.numel()),
        "stream_tokens": len(train),
        "final_loss": last_loss,
        "train_seconds": time.perf_counter() - t0,
        "stopped_by_time_cap": stopped,
    }
