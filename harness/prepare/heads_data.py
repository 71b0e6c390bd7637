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
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from harness.files import artifact_lock, plain_file_mode, temporary_sibling
from harness.heads.checkpoint import cpu_budget_label, short_hash, target_fingerprint
from harness.heads.recipes import DataRecipe, data_sources_key
from harness.target.loading import cache_root
from harness.workloads.corpora import SPLITS, ChatTurn, sharegpt_conversations, sharegpt_split
from harness.workloads.datastore import LEAKAGE_THRESHOLD, ExclusionIndex, sharegpt_heldout_exclusions
from harness.workloads.prompts import sharegpt_prompt_texts


@dataclass
class PackedStream:
    tokens: torch.Tensor  # [N] long
    segment_ids: torch.Tensor  # [N] long, one id per document occurrence
    valid: torch.Tensor  # [N] bool, input availability
    hidden: torch.Tensor  # [N, d] final-norm target hidden rows (float16 storage)
    meta: dict
    extra: dict[int, torch.Tensor] = field(default_factory=dict)  # layer l -> [N, d] output of layers < l

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_documents(self) -> int:
        return int(self.segment_ids.unique().numel()) if len(self) else 0


def byte_ids(text: str, *, vocab_size: int, max_len: int) -> list[int]:
    return [3 + (b % (vocab_size - 3)) for b in text.encode()[:max_len]]


def run_order(turns: Iterable[ChatTurn]) -> list[ChatTurn]:
    """A conversation's turns in the order a run's chats take: the user and assistant turns with text,
    from the first user turn on (a later part of a split conversation opens with the assistant's),
    cut before the first turn whose role repeats its predecessor's (an empty turn between them
    dropped). Cutting, not merging, keeps every turn one somebody wrote; strict chat templates
    refuse roles that do not alternate."""
    kept = [t for t in turns if t.text.strip() and t.role in ("user", "assistant")]
    first = next((i for i, t in enumerate(kept) if t.role == "user"), len(kept))
    out: list[ChatTurn] = []
    for t in kept[first:]:
        if out and t.role == out[-1].role:
            break
        out.append(t)
    return out


@dataclass
class DocumentTally:
    """What :func:`sharegpt_documents` made of the conversations it read (kept in the stream's meta)."""

    conversations_read: int = 0
    conversations_reordered: int = 0  # turns dropped or cut by :func:`run_order`
    template_refused: int = 0  # skipped: the chat template raised on them
    held_out_overlap: int = 0  # dropped: the document holds a window of held-out text
    held_out_prompt: int = 0  # dropped: its first user turn is a held-out prompt's text (no window of one)
    template_refusal: str | None = None  # the template's message for the first one it refused

    def to_meta(self) -> dict:
        return asdict(self)


def held_out_index(split: str, *, tokenizer, vocab_size: int) -> ExclusionIndex:
    """The held-out ShareGPT texts a training document of ``split`` may not hold, as windows of
    :data:`~harness.workloads.datastore.LEAKAGE_THRESHOLD` token ids (byte ids without a tokenizer):
    the texts a REST datastore keeps out (:func:`~harness.workloads.datastore.sharegpt_heldout_exclusions`),
    less those of ``split`` itself. A shorter text ("continue", "hi") matches no window, as in a datastore."""
    items = [
        it
        for it in sharegpt_heldout_exclusions()  # ids "sharegpt/<conversation id>/<role>"
        if sharegpt_split(it.item_id.removeprefix("sharegpt/").rsplit("/", 1)[0]) != split
    ]
    texts = [it.text for it in items]
    if tokenizer is None:
        ids = [byte_ids(t, vocab_size=vocab_size, max_len=len(t.encode())) for t in texts]
    else:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return ExclusionIndex([np.asarray(i, dtype=np.int64) for i in ids], LEAKAGE_THRESHOLD)


def held_out_prompts(split: str) -> frozenset[str]:
    """The ShareGPT prompt texts (stripped) of every split but ``split``
    (:func:`~harness.workloads.prompts.load_sharegpt`): a training conversation of ``split`` opening
    with one is dropped, however short (a "hi" matches no window of :func:`held_out_index`)."""
    return frozenset(t.strip() for t in sharegpt_prompt_texts([s for s in SPLITS if s != split]))


def sharegpt_documents(
    split: str,
    *,
    tokenizer,
    vocab_size: int,
    max_len: int,
    chat: bool,
    exclude: ExclusionIndex | None = None,
    exclude_prompts: frozenset[str] = frozenset(),
    tally: DocumentTally | None = None,
) -> Iterator[list[int]]:
    """Token ids of ShareGPT conversations of one split, in file order (each truncated), their turns
    in a run's order (:func:`run_order`). A conversation the chat template refuses is skipped, a
    document holding a window of ``exclude`` (:func:`held_out_index`) dropped, and so is one whose
    first user turn, stripped, is in ``exclude_prompts`` (:func:`held_out_prompts`); ``tally`` counts
    them. Raises ValueError when the template refuses every conversation."""

    char_cap = max_len * 12  # a token is rarely longer than 12 characters; avoids tokenizing megabytes
    tally = DocumentTally() if tally is None else tally
    templated = tokenizer is not None and chat and bool(getattr(tokenizer, "chat_template", None))
    if templated:
        from jinja2.exceptions import TemplateError  # what a template's raise_exception raises

    given = 0  # documents yielded
    for conv in sharegpt_conversations(split):
        tally.conversations_read += 1
        turns = run_order(conv.turns)
        if len(turns) != sum(1 for t in conv.turns if t.text.strip() and t.role in ("user", "assistant")):
            tally.conversations_reordered += 1
        if not turns:
            continue
        if tokenizer is None:
            text = "\n".join(t.text for t in turns)
            ids = byte_ids(text, vocab_size=vocab_size, max_len=max_len)
        elif templated:
            msgs, used = [], 0
            for t in turns:
                msgs.append({"role": t.role, "content": t.text[: max(char_cap - used, 1)]})
                used += len(t.text)
                if used >= char_cap:
                    break
            try:
                ids = tokenizer.apply_chat_template(msgs, tokenize=True)
            except TemplateError as exc:
                tally.template_refused += 1
                tally.template_refusal = tally.template_refusal or " ".join(str(exc).split())
                continue
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            ids = [int(i) for i in ids][:max_len]
        else:
            text = "\n".join(t.text for t in turns)[:char_cap]
            ids = [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]][:max_len]
        if len(ids) < 3:
            continue
        if exclude is not None and exclude.first_hit(np.asarray(ids, dtype=np.int64)) is not None:
            tally.held_out_overlap += 1
            continue
        if turns[0].text.strip() in exclude_prompts:  # run_order opens at the first user turn with text
            tally.held_out_prompt += 1
            continue
        given += 1
        yield ids
    if not given and tally.template_refused:
        raise ValueError(
            f"the tokenizer's chat template refused all {tally.template_refused} ShareGPT {split!r} "
            f"conversation(s) given to it ({tally.template_refusal}): give workload.chat_template a template "
            "for user/assistant turns, or train on plain text (proposer.data.chat=false)"
        )


#: the fewest tokens a document keeps (an anchor, its token and a label: one training row)
MIN_DOCUMENT_TOKENS = 3


def take_budget(documents: Iterable[list[int]], budget: int) -> list[list[int]]:
    """Whole documents in order until ``budget`` tokens (the last one cut to fit); no document is
    read past the one that fills the budget, nor once fewer than :data:`MIN_DOCUMENT_TOKENS` tokens
    of it remain (every later document would be cut below that and dropped)."""
    out, total = [], 0
    docs = iter(documents)
    while budget - total >= MIN_DOCUMENT_TOKENS:
        doc = next(docs, None)
        if doc is None:
            break
        doc = doc[: budget - total]
        if len(doc) >= MIN_DOCUMENT_TOKENS:
            out.append(doc)
            total += len(doc)
    return out


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
    boundary) for each ``l``, as ``stream.extra[l]`` ``[N, d]``.
    """

    device = next(model.parameters()).device
    tokens, segs, hidden = [], [], []
    extra: dict[int, list[torch.Tensor]] = {int(l): [] for l in layers}
    total = sum(len(d) for d in documents)
    bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, disable=not progress, leave=False)
    for doc_id, doc in enumerate(documents):
        ids = torch.tensor([list(doc)], dtype=torch.long, device=device)
        out = model.base_model(input_ids=ids, use_cache=False, output_hidden_states=bool(extra))
        h = out.last_hidden_state[0]  # [L, d]
        for l, rows in extra.items():
            rows.append(out.hidden_states[l][0].to("cpu", torch.float16))  # [L, d] after layers 0..l-1
        tokens.append(ids[0].cpu())
        segs.append(torch.full((len(doc),), doc_id, dtype=torch.long))
        hidden.append(h.to("cpu", torch.float16))
        bar.update(len(doc))
    bar.close()
    d = int(model.config.hidden_size)
    empty = torch.zeros(0, d, dtype=torch.float16)
    return PackedStream(
        tokens=torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long),
        segment_ids=torch.cat(segs) if segs else torch.zeros(0, dtype=torch.long),
        valid=torch.ones(total, dtype=torch.bool),
        hidden=torch.cat(hidden) if hidden else empty,
        meta={"documents": len(documents), "tokens": total},
        extra={l: (torch.cat(rows) if rows else empty) for l, rows in extra.items()},
    )


def save_stream(stream: PackedStream, path: Path) -> None:

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    tensors = {
        "tokens": stream.tokens,
        "segment_ids": stream.segment_ids,
        "valid": stream.valid.to(torch.uint8),
        "hidden": stream.hidden,
        **{f"layer_{l}": t for l, t in stream.extra.items()},
    }
    try:
        save_file(tensors, str(tmp), metadata={"meta": json.dumps(stream.meta, sort_keys=True)})
        os.chmod(tmp, plain_file_mode())  # safetensors writes 0600
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def load_stream(path: Path) -> PackedStream:

    t = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["meta"])
    extra = {int(k.split("_", 1)[1]): v for k, v in t.items() if k.startswith("layer_")}
    return PackedStream(
        tokens=t["tokens"],
        segment_ids=t["segment_ids"],
        valid=t["valid"].bool(),
        hidden=t["hidden"],
        meta=meta,
        extra=extra,
    )


def streams_key(tokenizer, recipe: DataRecipe, *, target_hash: str, documents=None, layers: Sequence[int] = ()) -> str:
    """The cache key of the encoded streams: the target, the data recipe, the early-exit boundaries,
    and inline documents, or else what the documents are made from (:func:`~harness.heads.recipes.data_sources_key`)."""
    return short_hash(
        {
            "target": target_hash,
            "recipe": recipe.to_dict(),
            "layers": sorted(int(l) for l in layers),
            "inline": None if documents is None else short_hash([list(map(list, d)) for d in documents]),
            **(data_sources_key(recipe, tokenizer) if documents is None else {}),
        }
    )


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
) -> tuple[PackedStream, PackedStream]:
    """(train, held-out) streams, cached under ``$HARNESS_CACHE/heads/streams`` by target + recipe.

    ``documents`` (tests, ``source=inline``) replaces the ShareGPT documents; ``layers`` adds
    early-exit boundaries (:func:`encode_stream`).
    """

    key = streams_key(tokenizer, recipe, target_hash=target_hash, documents=documents, layers=layers)
    base = cache_root() / "heads" / "streams" / f"{target_hash[:12]}-{key}"
    paths = (base.with_name(base.name + "-train.safetensors"), base.with_name(base.name + "-heldout.safetensors"))
    if cache and all(p.is_file() for p in paths):
        return load_stream(paths[0]), load_stream(paths[1])
    if not cache:
        return _encode_streams(
            model, tokenizer, recipe, target_hash=target_hash, documents=documents, progress=progress, layers=layers
        )
    with artifact_lock(base, purpose="encoding head-training streams"):  # concurrent jobs encode once
        if all(p.is_file() for p in paths):  # encoded by the job that held the lock
            return load_stream(paths[0]), load_stream(paths[1])
        train, held = _encode_streams(
            model, tokenizer, recipe, target_hash=target_hash, documents=documents, progress=progress, layers=layers
        )
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
) -> tuple[PackedStream, PackedStream]:
    vocab = int(model.config.vocab_size)
    made: dict = {}  # what the ShareGPT documents were made from
    tallies = (DocumentTally(), DocumentTally())  # (train, held-out)
    if documents is None:
        if recipe.source != "sharegpt":
            raise ValueError(f"data.source must be 'sharegpt' unless documents are given; got {recipe.source!r}")
        options = dict(tokenizer=tokenizer, vocab_size=vocab, max_len=recipe.max_len, chat=recipe.chat)
        exclude = held_out_index(recipe.split, tokenizer=tokenizer, vocab_size=vocab)
        train_docs = take_budget(
            sharegpt_documents(
                recipe.split,
                **options,
                exclude=exclude,
                exclude_prompts=held_out_prompts(recipe.split),
                tally=tallies[0],
            ),
            recipe.token_budget,
        )
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


def training_data(
    target, recipe: dict, *, documents=None, progress: bool = True, layers: Sequence[int] = ()
) -> TrainingData:
    """The (cached) streams of ``recipe["data"]`` for ``target`` (a :class:`harness.prepare.trained.Target`):
    :func:`training_streams`, timed."""
    started = time.perf_counter()
    target_hash = target_fingerprint(target.model, target.tokenizer)
    data = DataRecipe(**recipe["data"])
    train, held = training_streams(
        target.model,
        target.tokenizer,
        data,
        target_hash=target_hash,
        documents=documents,
        progress=progress,
        layers=layers,
    )
    return TrainingData(target_hash, target.source, data, train, held, started, time.perf_counter() - started)


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
    what it was trained for and on (:func:`streams_record`), held-out agreement before and after, the
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
