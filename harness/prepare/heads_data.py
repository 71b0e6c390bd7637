"""Training streams of cached target hidden states (Hydra teacher rows; labels by head semantics).

Documents come from the ShareGPT ``train`` split (held-out rows from ``dev``); each document is
run through the frozen target *on its own* (no packing inside a forward), so every hidden row is
segment-causal by construction. The rows are then packed into one stream with their original
addresses, ``segment_ids`` naming the document and ``valid`` marking input availability.

A conversation's turns take the order a run's chats take (:func:`run_order`); one the chat template
still refuses is skipped, a training document sharing a window with held-out text (the texts a
REST datastore keeps out) is dropped (:data:`~harness.heads.recipes.DOCUMENT_RULE`), and so is one whose
first user turn is a held-out prompt's text, however short (the same rule); the stream's ``meta``
counts each.

Only final-norm hidden states ``[N, d]`` are cached (float16); teacher logits are recomputed from
them through the frozen LM head when needed, never stored for the full vocabulary.

With ``model=tiny`` (no tokenizer) a document's ids are its UTF-8 bytes mapped to
``3 + byte % (V - 3)``, the same synthetic ids the runner gives tiny-model prompts.

Loss positions (``data.loss_tokens``, :func:`loss_tokens_applied`): with ``assistant`` (the default) a
document rendered through the chat template carries ``loss_mask``, its assistant turns' tokens
(:func:`~harness.heads.artifacts.assistant_labels`): the trainers count a label only there, while every
token still runs through the target and feeds the drafts' context. A document without a chat template
(byte ids, ``data.chat=false``, a tokenizer without one, inline documents) has no turns in its text:
every token is a label, as with ``all``, and the stream's meta says why (so does stderr, where a
tokenizer's text had no template). The token budget counts every
token of the documents either way; a document with no assistant token is kept in the stream (the same
text as ``all``) and gives no loss row.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from harness.files import artifact_lock, plain_file_mode, temporary_sibling
from harness.heads.artifacts import (  # the documents' code, shared with the run's leakage gate
    DocumentTally,
    refuse_documents,
    sharegpt_documents,
    streams_base,
    streams_key,
    take_budget,
    tokens_sha256,
    training_documents,
)
from harness.heads.artifacts import held_out_prompts as held_out_prompts
from harness.heads.artifacts import run_order as run_order
from harness.heads.checkpoint import cpu_budget_label, target_fingerprint, weights_hash
from harness.heads.recipes import DataRecipe, data_sources_key
from harness.workloads.corpora import byte_ids as byte_ids  # re-exported: the document code read from here


@dataclass
class PackedStream:
    tokens: torch.Tensor  # [N] long
    segment_ids: torch.Tensor  # [N] long, one id per document occurrence
    valid: torch.Tensor  # [N] bool, input availability
    hidden: torch.Tensor  # [N, d] final-norm target hidden rows (float16 storage)
    meta: dict
    extra: dict[int, torch.Tensor] = field(default_factory=dict)  # layer l -> [N, d] output of layers < l
    loss_mask: torch.Tensor | None = None  # [N] bool: the tokens a loss may take as labels; None: every one

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def labels(self) -> torch.Tensor:
        """``[N]`` bool: whether each token may be a label (:attr:`loss_mask`, or every token)."""
        return self.loss_mask if self.loss_mask is not None else torch.ones(len(self), dtype=torch.bool)

    @property
    def num_documents(self) -> int:
        return int(self.segment_ids.unique().numel()) if len(self) else 0


#: the largest magnitude float16, the cached rows' storage, holds
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def _float16_rows(rows: torch.Tensor, what: str) -> torch.Tensor:
    """``rows`` on the CPU in float16 (the streams' storage), refused where a value is not finite
    (the target's own forward overflowed) or lies past float16's range: it would be cached as
    infinity and train on NaN (a large model's residual stream can reach it, with a few very large
    activations)."""
    if not bool(torch.isfinite(rows).all()):
        raise ValueError(
            f"{what} hold NaN or infinity: the target's forward overflowed; nothing can be trained on them"
        )
    big = rows.abs().amax() if rows.numel() else rows.new_zeros(())
    if float(big) > FLOAT16_MAX:
        raise ValueError(
            f"{what} reach {float(big):,.0f}, past float16's {FLOAT16_MAX:,.0f}, the training streams' "
            "storage: the rows cannot be cached for training on this target"
        )
    return rows.to("cpu", torch.float16)


@torch.no_grad()
def encode_stream(
    model: torch.nn.Module,
    documents: Sequence[Sequence[int]],
    *,
    desc: str = "target hidden states",
    progress: bool = True,
    layers: Sequence[int] = (),
) -> PackedStream:
    """Run each document through the frozen target alone and pack the final-norm rows.

    ``layers``: also keep the residual stream after the first ``l`` decoder layers (an early-exit
    boundary) for each ``l``, as ``stream.extra[l]`` ``[N, d]``. Documents that carry labels
    (:class:`~harness.heads.artifacts.LabelledDocument`) give the stream its ``loss_mask``.
    """

    device = next(model.parameters()).device
    tokens, segs, hidden = [], [], []
    extra: dict[int, list[torch.Tensor]] = {int(l): [] for l in layers}
    total = sum(len(d) for d in documents)
    labelled = [hasattr(d, "labels") for d in documents]
    if any(labelled) and not all(labelled):
        raise ValueError("some documents carry loss labels and some do not: a stream takes labels for all or none")
    # closed on every way out: a failure's one line is printed on the line the bar cleared
    with tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, disable=not progress, leave=False) as bar:
        for doc_id, doc in enumerate(documents):
            ids = torch.tensor([list(doc)], dtype=torch.long, device=device)
            out = model.base_model(input_ids=ids, use_cache=False, output_hidden_states=bool(extra))
            h = out.last_hidden_state[0]  # [L, d]
            for l, rows in extra.items():
                rows.append(_float16_rows(out.hidden_states[l][0], f"the residual stream after {l} decoder layers"))
            tokens.append(ids[0].cpu())
            segs.append(torch.full((len(doc),), doc_id, dtype=torch.long))
            hidden.append(_float16_rows(h, "the final-norm hidden rows"))
            bar.update(len(doc))
    d = int(model.config.hidden_size)
    empty = torch.zeros(0, d, dtype=torch.float16)
    mask = None
    if documents and all(labelled):
        mask = torch.tensor([bool(x) for doc in documents for x in doc.labels], dtype=torch.bool)
    return PackedStream(
        tokens=torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long),
        segment_ids=torch.cat(segs) if segs else torch.zeros(0, dtype=torch.long),
        valid=torch.ones(total, dtype=torch.bool),
        hidden=torch.cat(hidden) if hidden else empty,
        meta={"documents": len(documents), "tokens": total},
        extra={l: (torch.cat(rows) if rows else empty) for l, rows in extra.items()},
        loss_mask=mask,
    )


#: the stream's metadata field holding :func:`stream_digest` of what it was saved with
DIGEST_FIELD = "sha256"


class UnverifiedStream(ValueError):
    """A cached stream that cannot be read, or whose contents are not what was saved (edited, cut
    short, or written before streams recorded a digest): encoded again, never trained on."""


def stream_digest(tensors: dict[str, torch.Tensor], meta: str) -> str:
    """SHA-256 of a stream's ``meta`` text and its tensors (each one's name, shape, dtype and bytes,
    :func:`~harness.heads.checkpoint.weights_hash`)."""
    return hashlib.sha256(f"{meta}\n{weights_hash(tensors)}".encode()).hexdigest()


def save_stream(stream: PackedStream, path: Path) -> None:
    """Write ``stream`` to ``path`` (written beside it, then renamed into place), its metadata holding
    its ``meta`` and :func:`stream_digest`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    tensors = {
        "tokens": stream.tokens,
        "segment_ids": stream.segment_ids,
        "valid": stream.valid.to(torch.uint8),
        "hidden": stream.hidden,
        **{f"layer_{l}": t for l, t in stream.extra.items()},
        **({} if stream.loss_mask is None else {"loss_mask": stream.loss_mask.to(torch.uint8)}),
    }
    meta = json.dumps(stream.meta, sort_keys=True)
    try:
        save_file(tensors, str(tmp), metadata={"meta": meta, DIGEST_FIELD: stream_digest(tensors, meta)})
        os.chmod(tmp, plain_file_mode())  # safetensors writes 0600
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def load_stream(path: Path) -> PackedStream:
    """The stream saved at ``path``, its digest checked: :class:`UnverifiedStream` (naming the file) for
    one that cannot be read, records no digest, or holds other contents than it recorded."""
    try:
        t = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        meta = json.loads(header["meta"])
    except Exception as exc:  # a truncated or foreign file: safetensors' own error names no file
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0]}" if str(exc) else type(exc).__name__
        raise UnverifiedStream(f"{str(path)!r} is not a readable stream file ({why})") from None
    recorded = header.get(DIGEST_FIELD)
    if not recorded:
        raise UnverifiedStream(f"{str(path)!r} was saved before streams recorded a digest of their contents")
    got = stream_digest(t, header["meta"])
    if got != recorded:
        raise UnverifiedStream(
            f"{str(path)!r} changed since it was saved (recorded sha256 {recorded[:16]}..., contents {got[:16]}...)"
        )
    extra = {int(k.split("_", 1)[1]): v for k, v in t.items() if k.startswith("layer_")}
    return PackedStream(
        tokens=t["tokens"],
        segment_ids=t["segment_ids"],
        valid=t["valid"].bool(),
        hidden=t["hidden"],
        meta=meta,
        extra=extra,
        loss_mask=t["loss_mask"].bool() if "loss_mask" in t else None,
    )


class LossTokens(NamedTuple):
    """The loss positions a stream is encoded with: ``mode`` ``assistant`` (its ``loss_mask`` marks the
    assistant tokens) or ``all`` (no mask), and ``note``: why ``data.loss_tokens=assistant`` labels
    every token (the documents have no turns), or None."""

    mode: str
    note: str | None = None


def loss_tokens_applied(recipe: DataRecipe, tokenizer, documents=None) -> LossTokens:
    """What ``recipe.loss_tokens`` comes to for these documents: ``assistant`` needs conversations
    rendered through a chat template (the turns the mask is found from); documents without one have
    no turns in their text, a run's prompts for such a target are plain text too, and every token is
    a label, with a note saying why."""
    if recipe.loss_tokens == "all":
        return LossTokens("all")
    if documents is not None:
        why = "inline documents carry no roles"
    elif tokenizer is None:
        why = "the tiny model's documents are byte ids of the turns' plain text"
    elif not recipe.chat:
        why = "data.chat=false joins the turns as plain text"
    elif not getattr(tokenizer, "chat_template", None):
        why = "the tokenizer has no chat template, so the turns are joined as plain text"
    else:
        return LossTokens("assistant")
    return LossTokens("all", f"data.loss_tokens=assistant: {why}; every token is a label")


def _loss_meta(stream: PackedStream, applied: LossTokens) -> dict:
    """What a stream's meta keeps of its loss positions (:func:`loss_tokens_applied`)."""
    labels = int(stream.labels().sum())
    return {
        "loss_tokens": applied.mode,
        "loss_positions": labels,
        **({"loss_note": applied.note} if applied.note else {}),
    }


def _cached_streams(paths: tuple[Path, Path]) -> tuple[tuple[PackedStream, PackedStream] | None, str | None]:
    """The (train, held-out) streams at ``paths``, each verified (:func:`load_stream`), or None; and
    why not where one is there but unverified (None where one is absent)."""
    if not all(p.is_file() for p in paths):
        return None, None
    try:
        return (load_stream(paths[0]), load_stream(paths[1])), None
    except UnverifiedStream as exc:
        return None, str(exc)


def training_streams(
    model: torch.nn.Module,
    tokenizer,
    recipe: DataRecipe,
    *,
    target_hash: str,
    documents: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]] | None = None,
    cache: bool = True,
    progress: bool = True,
    layers: Sequence[int] = (),
    key: str | None = None,
) -> tuple[PackedStream, PackedStream]:
    """(train, held-out) streams, cached under ``$HARNESS_CACHE/heads/streams`` by target + recipe.

    ``documents`` (tests, ``source=inline``) replaces the ShareGPT documents; ``layers`` adds
    early-exit boundaries (:func:`encode_stream`); ``key``: :func:`streams_key` of these, where the
    caller has it. A cached stream is read only where its digest verifies (:func:`load_stream`); one
    that does not (edited, cut short, unreadable, or saved without a digest) is encoded again under
    the lock the encoding takes, with a warning naming it. ``documents`` need ``recipe.source``
    ``inline`` (:func:`~harness.heads.artifacts.refuse_documents`).
    """

    refuse_documents(recipe.source, documents)
    key = key or streams_key(tokenizer, recipe, target_hash=target_hash, documents=documents, layers=layers)
    base = streams_base(target_hash, key)
    paths = (base.with_name(base.name + "-train.safetensors"), base.with_name(base.name + "-heldout.safetensors"))
    applied = loss_tokens_applied(recipe, tokenizer, documents)
    encode = partial(
        _encode_streams,
        model,
        tokenizer,
        recipe,
        target_hash=target_hash,
        documents=documents,
        progress=progress,
        layers=layers,
        applied=applied,
    )
    if not cache:
        return encode()
    found, _ = _cached_streams(paths)
    if found is not None:
        return found
    with artifact_lock(base, purpose="encoding head-training streams"):  # concurrent jobs encode once
        found, unverified = _cached_streams(paths)  # encoded (or encoded again) by the job that held the lock
        if found is not None:
            return found
        if unverified:  # never trained on: encoded again in its place
            print(f"harness: warning: the cached training stream {unverified}; encoding it again", file=sys.stderr)
        train, held = encode()
        save_stream(train, paths[0])
        save_stream(held, paths[1])
    return train, held


def _encode_streams(
    model: torch.nn.Module,
    tokenizer,
    recipe: DataRecipe,
    *,
    target_hash: str,
    documents,
    progress: bool,
    layers: Sequence[int],
    applied: LossTokens,
) -> tuple[PackedStream, PackedStream]:
    if applied.note and tokenizer is not None and documents is None:  # text that a template could have had
        print(f"harness: note: {applied.note}", file=sys.stderr)
    labels = applied.mode == "assistant"
    vocab = int(model.config.vocab_size)
    made: dict = {}  # what the ShareGPT documents were made from
    tallies = (DocumentTally(), DocumentTally())  # (train, held-out)
    if documents is None:
        if recipe.source != "sharegpt":
            raise ValueError(f"data.source must be 'sharegpt' unless documents are given; got {recipe.source!r}")
        options = dict(tokenizer=tokenizer, vocab_size=vocab, max_len=recipe.max_len, chat=recipe.chat, labels=labels)
        train_docs = training_documents(recipe, tokenizer=tokenizer, vocab_size=vocab, tally=tallies[0], labels=labels)
        held_docs = take_budget(
            sharegpt_documents(recipe.held_out_split, **options, tally=tallies[1]),
            recipe.held_out_tokens,
        )
        made = data_sources_key(recipe, tokenizer)
    else:
        train_docs = take_budget(documents[0], recipe.token_budget)
        held_docs = take_budget(documents[1], recipe.held_out_tokens)
    train = encode_stream(model, train_docs, desc="target hidden states (train)", progress=progress, layers=layers)
    held = encode_stream(model, held_docs, desc="target hidden states (held-out)", progress=progress, layers=layers)
    for s, split, tally in ((train, recipe.split, tallies[0]), (held, recipe.held_out_split, tallies[1])):
        s.meta.update(
            {"split": split, "source": recipe.source if documents is None else "inline", "target_hash": target_hash}
        )
        s.meta.update(_loss_meta(s, applied))
        if documents is None:
            s.meta.update({**made, **tally.to_meta()})
    return train, held


@dataclass(frozen=True)
class TrainingData:
    """The cached target streams an artifact trains on, with what its manifest records of them."""

    target_hash: str
    target_source: str
    data: DataRecipe
    train: PackedStream
    held: PackedStream
    started: float  # perf_counter() when the preparation began (the manifest's total_seconds)
    stream_seconds: float  # fingerprinting the target and encoding (or loading) the streams
    stream: str | None = None  # the training stream's file name under $HARNESS_CACHE/heads/streams


def training_data(
    target, recipe: dict, *, documents=None, progress: bool = True, layers: Sequence[int] = ()
) -> TrainingData:
    """The (cached) streams of ``recipe["data"]`` for ``target`` (a :class:`harness.prepare.trained.Target`):
    :func:`training_streams`, timed."""
    started = time.perf_counter()
    target_hash = target_fingerprint(target.model, target.tokenizer)
    data = DataRecipe(**recipe["data"])
    key = streams_key(target.tokenizer, data, target_hash=target_hash, documents=documents, layers=layers)
    train, held = training_streams(
        target.model,
        target.tokenizer,
        data,
        target_hash=target_hash,
        documents=documents,
        progress=progress,
        layers=layers,
        key=key,
    )
    seconds = time.perf_counter() - started
    stream = streams_base(target_hash, key).name + "-train.safetensors"
    return TrainingData(target_hash, target.source, data, train, held, started, seconds, stream)


def training_text_record(streams: TrainingData) -> dict:
    """What an artifact's manifest keeps to find its training text again (the run's leakage gate,
    :class:`~harness.heads.artifacts.TrainingLeakage`): the training stream's file name in the cache
    and the SHA-256 of its token ids, which a stream read back or documents tokenised again must match."""
    return {"stream": streams.stream, "tokens_sha256": tokens_sha256(streams.train.tokens.numpy())}


def streams_record(streams: TrainingData) -> dict:
    """What an artifact's manifest keeps of how its streams were made: each stream's meta (split,
    source, the ShareGPT file's and the chat template's hashes, :data:`DOCUMENT_RULE`, and the
    conversations refused by the template or dropped for held-out text), less what the manifest
    holds elsewhere."""
    elsewhere = ("target_hash", "tokens", "documents")
    return {
        name: {k: v for k, v in s.meta.items() if k not in elsewhere}
        for name, s in (("train", streams.train), ("held_out", streams.held))
    }


def trained_artifact_manifest(
    kind: str,
    streams: TrainingData,
    recipe: dict,
    *,
    before: dict,
    after: dict,
    training_log: dict,
    device,
    parameters: int,
    **extra,
) -> dict:
    """The manifest of an artifact trained on the cached target streams (heads, EAGLE drafts):
    what it was trained for and on (:func:`streams_record`, :func:`training_text_record`), held-out
    agreement before and after, the
    training log, and ``cpu_budget_artifact`` from the tokens it saw (not from the device it ran on)."""
    data, train_stream = streams.data, streams.train
    manifest = {
        "kind": kind,
        **extra,
        "target_hash": streams.target_hash,
        "target_source": streams.target_source,
        "recipe": recipe,
        "token_budget": int(data.token_budget),
        "tokens_seen": int(len(train_stream)),
        "documents": int(train_stream.num_documents),
        "streams": streams_record(streams),
        "training_text": training_text_record(streams),
        "held_out": {
            "split": data.held_out_split,
            "tokens": len(streams.held),
            **after,
            "top1_agreement_untrained": before["top1_agreement"],
        },
        "training": {
            **training_log,
            "stream_seconds": streams.stream_seconds,
            "total_seconds": time.perf_counter() - streams.started,
            "device": str(device),
            "threads": torch.get_num_threads(),
        },
        "parameters": int(parameters),
    }
    manifest["cpu_budget_artifact"] = cpu_budget_label(manifest)
    return manifest
