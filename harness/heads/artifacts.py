"""Loading proposer artifacts (draft heads, the early-exit adapter, the layer-skip vector).

An artifact's directory is named by its recipe (:mod:`harness.heads.recipes`) and the target's
fingerprint (``proposer.artifact`` overrides the path); the manifest records the token budget,
held-out agreement and training time, and whether it is a CPU-budget artifact. A proposer loads
its artifact here and never trains one: the prepare stage (:mod:`harness.prepare`) or
`harness train` makes it first. ``proposer.artifact`` naming a published Medusa or Hydra
checkpoint (a directory without ``manifest.json``, or a hub id) is read in its published layout
(:mod:`harness.heads.published`); its manifest is its provenance (files and their hashes).

The training text of an artifact trained on the target streams (heads, EAGLE drafts, the early-exit
adapter): the ShareGPT documents :data:`~harness.heads.recipes.DOCUMENT_RULE` makes
(:func:`training_documents`; :mod:`harness.prepare.heads_data` encodes them into the cached
streams, keyed by :func:`streams_key`), read back from the cached stream or tokenised again
(:func:`training_text`), and the run's workload-leakage gate against it (:class:`TrainingLeakage`).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from harness.heads.checkpoint import (
    MANIFEST_FILE,
    ArtifactError,
    artifact_dir,
    cpu_budget_label,
    load_artifact,
    read_config_object,
    short_hash,
    target_fingerprint,
)
from harness.heads.eagle import EagleSpec, build_draft
from harness.heads.eagle_formats import config_notes, parse_published, read_weights, resolve_source
from harness.heads.early_exit import AdapterArtifact, build_adapter
from harness.heads.models import DraftHeads, HeadSpec
from harness.heads.published import PublishedHeads, inspect, is_published, load_published_heads, same_embedding
from harness.heads.recipes import (
    DataRecipe,
    SearchRecipe,
    data_sources_key,
    eagle_recipe,
    exit_recipe,
    heads_recipe,
    recipe_key,
    training_code_key,
)
from harness.target.loading import (
    cache_root,
    chat_template_hash,
    chat_template_key,
    model_names,
    pinned_hub_revision,
)
from harness.target.timing import timed_setup
from harness.workloads.corpora import (
    SPLITS,
    ChatTurn,
    byte_ids,
    prompt_key,
    sharegpt_conversations,
    sharegpt_split,
    text_encodings,
)
from harness.workloads.datastore import LEAKAGE_THRESHOLD, ExclusionIndex, LeakageError, sharegpt_heldout_exclusions
from harness.workloads.prompts import sharegpt_prompt_keys


@dataclass(frozen=True)
class HeadsArtifact:
    heads: DraftHeads | PublishedHeads
    manifest: dict
    path: Path

    @property
    def cpu_budget_artifact(self) -> bool:
        return cpu_budget_label(self.manifest)


def load_bound(path, *, kind: str, recipe: dict, model: torch.nn.Module, tokenizer):
    """:func:`~harness.heads.checkpoint.load_artifact` for the target ``model``: its fingerprint, and
    what it was loaded from (its folder or hub id, for a refusal to name)."""
    return load_artifact(
        path,
        kind=kind,
        target_hash=target_fingerprint(model, tokenizer),
        target_source=next(iter(model_names(model)), None),
        recipe=recipe,
    )


def build_heads(recipe: dict, state: dict[str, torch.Tensor] | None = None, *, seed: int = 0) -> DraftHeads:
    spec = HeadSpec(**recipe["spec"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = DraftHeads(spec)
    if state is not None:
        heads.load_state_dict(state, strict=True)  # raises on any missing or unexpected tensor
    return heads.eval()


def load_heads(kind: str, recipe: dict, *, model: torch.nn.Module, tokenizer, path: Path) -> HeadsArtifact:
    manifest, state = load_bound(path, kind=kind, recipe=recipe, model=model, tokenizer=tokenizer)
    if state is None:
        raise ArtifactError(f"artifact {str(path)!r} has no weights")
    return HeadsArtifact(heads=build_heads(recipe, state), manifest=manifest, path=Path(path))


def refuse_documents(source: str, documents) -> None:
    """Refuse (:class:`ArtifactError`) training ``documents`` given for a recipe whose ``data.source``
    is not ``inline``: what is trained on them would stand, and be recorded, as that source's."""
    if documents is not None and source != "inline":
        raise ArtifactError(
            f"training documents are given but data.source is {source!r}: set data.source=inline to train on "
            f"given documents (an artifact trained on them would be taken for the {source!r} recipe's)"
        )


def documents_hash(documents) -> str:
    """The hash of inline training documents (a ``(train, held-out)`` pair of document lists) that
    keys their streams (:func:`streams_key`) and the artifacts trained on them (:func:`_located`)."""
    return short_hash([list(map(list, d)) for d in documents])


def _located(
    kind: str, recipe: dict, options: dict, *, model: torch.nn.Module, tokenizer, documents=None
) -> tuple[dict, Path]:
    """``recipe`` and its artifact's directory: ``proposer.artifact`` when given, else the one
    :func:`artifact_dir` names for ``kind``, the target's fingerprint and ``recipe``. A recipe trained
    on the target streams also holds what their text is made from and the training code's version.

    ``documents``: the inline training documents that replace ShareGPT's (``data.source=inline``
    only, :func:`refuse_documents`); their :func:`documents_hash` keys the cache's directory too, as it
    keys their streams, so other documents train an artifact of their own. The recipe returned (the
    one a manifest records and a load compares) is the configured one."""
    if "data" in recipe:  # trained on streams (heads, EAGLE, early exit)
        refuse_documents(DataRecipe(**recipe["data"]).source, documents)
        recipe = {**recipe, **data_sources_key(DataRecipe(**recipe["data"]), tokenizer), **training_code_key(kind)}
    else:  # the chat format the search's text was put in
        recipe = {**recipe, **chat_template_key(tokenizer)}
    explicit = options.get("artifact")
    if explicit:
        return recipe, Path(str(explicit)).expanduser()
    keyed = recipe if documents is None else {**recipe, "inline_documents": documents_hash(documents)}
    return recipe, artifact_dir(kind, target_hash=target_fingerprint(model, tokenizer), recipe=keyed)


def heads_artifact_path(
    kind: str, options: dict, *, model: torch.nn.Module, tokenizer, documents=None
) -> tuple[dict, Path]:
    """The recipe of the configured heads and the directory of their artifact (``documents``: the
    inline documents they train on, :func:`_located`)."""
    recipe = heads_recipe(kind, options, model)
    return _located(kind, recipe, options, model=model, tokenizer=tokenizer, documents=documents)


def missing(kind: str, path: Path, explicit: bool, *, extra: str = "") -> ArtifactError:
    """The refusal of an absent artifact: a path the config names is never trained into (train it
    there, or leave proposer.artifact unset); the cache's is trained by a run with auto_train."""
    if explicit:
        what = (
            "does not exist"
            if not path.exists()
            else "holds no manifest.json (not an artifact)"
            if path.is_dir()
            else "is a file, not an artifact folder"
        )
        return ArtifactError(
            f"proposer.artifact={str(path)!r} {what}; leave proposer.artifact unset to use the cache "
            f"(the run trains into it, or `harness train proposer={kind}` does and prints the path){extra}"
        )
    return ArtifactError(
        f"no {kind} artifact at {str(path)!r}; run `harness train proposer={kind}` "
        f"(or let the run train it: proposer.auto_train=true){extra}"
    )


def refuse_foreign(kind: str, path: str | Path, *, extra: str = "") -> None:
    """Refuse (:class:`ArtifactError`) a ``proposer.artifact`` that exists but is no ``kind`` artifact
    this harness wrote: a file, a folder without ``manifest.json``, or one whose manifest names another
    kind. Training into such a path would replace what it holds, so builders call this before they
    take the artifact's lock (nothing is written beside it either); a path that does not exist yet,
    and an artifact of ``kind`` (of any recipe or target), pass."""
    path = Path(str(path)).expanduser()
    if not path.exists():
        return
    if not path.is_dir() or not (path / MANIFEST_FILE).is_file():
        raise missing(kind, path, True, extra=extra)
    there = read_config_object(path / MANIFEST_FILE).get("kind")
    if there != kind:
        what = f"an artifact of kind {there!r}" if there else f"a {MANIFEST_FILE} naming no artifact kind"
        raise ArtifactError(
            f"proposer.artifact={str(path)!r} holds {what}, not {kind!r}; name one of kind {kind!r}, or leave "
            f"proposer.artifact unset to use the cache (the run trains into it, or `harness train proposer={kind}` "
            f"does and prints the path){extra}"
        )


def load_published(kind: str, ref: str, *, model: torch.nn.Module, revision: str | None = None) -> HeadsArtifact:
    """A published head bank (key for key, its published forward) with its provenance. A hub id is
    read at commit ``revision``; by default at the one this process's run manifest bound it to
    (:func:`~harness.target.loading.pinned_hub_revision`), else its current one."""
    layout = inspect(ref, kind, revision=revision or pinned_hub_revision(ref))
    heads = load_published_heads(layout, model=model)
    base = layout.config.get("base_model_name_or_path")
    if heads.embed_matches_target is False:
        warn_base(kind, ref, "their saved input embedding differs from the target's (input_embed_matches_target)")
    else:
        other = other_base(base, model)
        if other is not None:
            warn_base(kind, ref, f"they name {base} as their base model; the target is {other}")
    for note in layout.notes:  # how the files were read where they leave a choice: said, not only recorded
        print(f"harness: note: the published {kind} at {ref}: {note}", file=sys.stderr)
    manifest = {
        **layout.provenance(),
        "kind": kind,
        "parameters": heads.num_parameters(),
        "input_embed_matches_target": heads.embed_matches_target,
        "cpu_budget_artifact": False,  # not trained here
    }
    return HeadsArtifact(heads=heads, manifest=manifest, path=layout.directory)


def other_base(base, model: torch.nn.Module) -> str | None:
    """The target's name where a published draft names another base model ``base`` (its folder or hub
    id: the last components are compared, so a local copy of the same model matches); None where it
    names the target, names none, or the target has no name to compare."""
    targets = model_names(model)  # by path or hub id alike: the last component is compared
    if not base or not isinstance(base, str) or not targets:
        return None
    if Path(base).name.lower() in {Path(t).name.lower() for t in targets}:
        return None
    return targets[0] if len(targets) == 1 else f"{targets[0]} (converted from {targets[1]})"


def warn_base(kind: str, ref: str, why: str) -> None:
    """One stderr line: a published draft that looks made for another base model (its acceptance
    will be low; the outputs stay exact, and the record keeps the evidence)."""
    print(
        f"harness: warning: the published {kind} at {ref} looks made for another base model: {why}; "
        "expect low acceptance (outputs stay exact)",
        file=sys.stderr,
    )


def load_configured_heads(
    kind: str, options: dict, *, model: torch.nn.Module, tokenizer, revision: str | None = None
) -> HeadsArtifact:
    """``proposer.artifact``: a published bank (a hub id at ``revision``, see :func:`load_published`) or
    an artifact trained here; unset: the trained artifact of the configured recipe in the cache."""
    if is_published(options.get("artifact")):
        return load_published(kind, str(options["artifact"]), model=model, revision=revision)
    recipe, path = heads_artifact_path(kind, options, model=model, tokenizer=tokenizer)
    if not (path / "manifest.json").is_file():
        raise missing(kind, path, bool(options.get("artifact")))
    return load_heads(kind, recipe, model=model, tokenizer=tokenizer, path=path)


def adapter_artifact_path(options: dict, *, model: torch.nn.Module, tokenizer, documents=None) -> tuple[dict, Path]:
    """The recipe of the configured early-exit adapter and the directory of its artifact
    (``documents``: the inline documents it is distilled on, :func:`_located`)."""
    recipe = exit_recipe(options, model)
    return _located("early_exit", recipe, options, model=model, tokenizer=tokenizer, documents=documents)


def load_adapter(options: dict, *, model: torch.nn.Module, tokenizer, path: Path | None = None) -> AdapterArtifact:
    recipe, default = adapter_artifact_path(options, model=model, tokenizer=tokenizer)
    path = Path(path or default)
    if not (path / "manifest.json").is_file():
        raise missing("early_exit", path, bool(options.get("artifact")))
    manifest, state = load_bound(path, kind="early_exit", recipe=recipe, model=model, tokenizer=tokenizer)
    return AdapterArtifact(build_adapter(model, state), manifest, path)


def skip_artifact_path(
    options: dict, *, model: torch.nn.Module, tokenizer, prompts: Sequence[Sequence[int]] | None = None
) -> tuple[dict, Path]:
    """The search recipe and the layer-skip artifact's directory: ``proposer.artifact``, else the
    cache's, named by the target, the recipe, the host the search times on and how the target's
    forward runs there (:func:`~harness.target.timing.timed_setup`): the vector is the fastest one
    there, so one searched on another device or thread count, or with other kernels, attention,
    cache kind, fused layers or compilation, is searched again, not reused.

    The recipe holds the hash of the chat template the tokenizer applies where the search puts its
    prompts through it (``search.chat``, the default): the tokenizer's fingerprint leaves the template
    out, and a new one gives other prompts to time. ``prompts``: the token ids searched on in place of
    the recipe's workload; their hash keys the cache's directory too (the recipe returned, the one the
    manifest records and a load compares, is the configured one)."""
    search = SearchRecipe(**dict(options.get("search") or {}))
    template = chat_template_hash(tokenizer) if search.chat else None
    rd = {**recipe_key(search), **({"chat_template": template} if template else {})}
    if options.get("artifact"):
        return rd, Path(str(options["artifact"])).expanduser()
    keyed = {**rd, "timed_on": timed_setup(model)}
    if prompts is not None:
        keyed["inline_prompts"] = short_hash([[int(i) for i in p] for p in prompts])
    return rd, artifact_dir("layer_skip", target_hash=target_fingerprint(model, tokenizer), recipe=keyed)


def load_skip(options: dict, *, model: torch.nn.Module, tokenizer) -> tuple[list[int], dict]:
    """The skip vector to draft with: ``proposer.skip`` when given, else the search artifact's
    (one given by ``proposer.artifact`` and timed on another host or forward setup is used, with a
    note)."""
    if options.get("skip") is not None:
        return [int(i) for i in options["skip"]], {"source": "proposer.skip", "cpu_budget_artifact": False}
    rd, path = skip_artifact_path(options, model=model, tokenizer=tokenizer)
    if not (path / "manifest.json").is_file():
        raise missing("layer_skip", path, bool(options.get("artifact")))
    manifest, _ = load_bound(path, kind="layer_skip", recipe=rd, model=model, tokenizer=tokenizer)
    here = timed_setup(model)
    there = {k: (manifest.get("search") or {}).get(k) for k in here}
    if there["device"] is not None:
        there["device"] = str(there["device"]).split(":")[0]
    differs = [k for k in here if there[k] is not None and there[k] != here[k]]
    if differs:
        print(
            f"harness: note: the layer-skip vector in {str(path)!r} was searched on "
            + ", ".join(f"{k} {there[k]!r}" for k in differs)
            + "; this run has "
            + ", ".join(f"{k} {here[k]!r}" for k in differs)
            + ": the fastest vector there may not be here (leave proposer.artifact unset to search on this host)",
            file=sys.stderr,
        )
    return list(manifest["skip"]), manifest


# --------------------------------------------------------------------------- EAGLE drafts


@dataclass(frozen=True)
class EagleArtifact:
    """An EAGLE draft network ready to propose: trained here (a versioned artifact bound to the
    target's fingerprint) or read from a published checkpoint (checked against the target's shapes)."""

    draft: torch.nn.Module
    manifest: dict
    path: Path

    @property
    def cpu_budget_artifact(self) -> bool:
        return bool(self.manifest.get("cpu_budget_artifact", False))

    @property
    def published(self) -> bool:
        return bool(self.manifest.get("published", False))


def build_eagle(spec: dict | EagleSpec, state: dict[str, torch.Tensor] | None = None, *, seed: int = 0):
    spec = spec if isinstance(spec, EagleSpec) else EagleSpec(**spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = build_draft(spec)
    if state is not None:
        if "embed_tokens.weight" in state:
            draft.embed_tokens = torch.nn.Embedding(*state["embed_tokens.weight"].shape)
        draft.load_state_dict(state, strict=True)  # raises on any missing or unexpected tensor
    return draft.eval()


def eagle_artifact_path(options: dict, *, model: torch.nn.Module, tokenizer, documents=None) -> tuple[dict, Path]:
    """The recipe of the configured (trained) EAGLE draft and the directory of its artifact
    (``documents``: the inline documents it trains on, :func:`_located`)."""
    recipe = eagle_recipe(options, model)
    return _located("eagle", recipe, options, model=model, tokenizer=tokenizer, documents=documents)


def load_published_eagle(source: str, *, model: torch.nn.Module, revision: str | None = None) -> EagleArtifact:
    """A published EAGLE / EAGLE-2 / EAGLE-3 checkpoint (local directory or hub id), checked
    against the target's hidden size, vocabulary and layers. A hub id is read at commit ``revision``;
    by default at the one this process's run manifest bound it to
    (:func:`~harness.target.loading.pinned_hub_revision`), else its current one."""
    path = resolve_source(source, revision=revision or pinned_hub_revision(source))
    cfg = read_config_object(path / "config.json")
    raw, digests, unread = read_weights(path)
    try:
        fmt, spec, state, unused = parse_published(cfg, raw, target_config=model.config)
    except ArtifactError as exc:
        raise ArtifactError(f"proposer.artifact={source!r}: {exc}") from None
    try:
        draft = build_eagle(spec, {k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    except (KeyError, RuntimeError, ArithmeticError, TypeError, ValueError) as exc:
        # a config transformers' layers refuse (rope settings, head counts) or weights they do not take
        first = " ".join(str(exc).split())[:300]  # the whole message on one line
        raise ArtifactError(
            f"proposer.artifact={source!r}: its config.json and weights do not build an EAGLE draft "
            f"({type(exc).__name__}: {first})"
        ) from None
    embedding = {"in_checkpoint": "embed_tokens.weight" in state}
    if embedding["in_checkpoint"]:
        saved, target_embedding = state["embed_tokens.weight"], model.get_input_embeddings().weight
        if tuple(saved.shape) == tuple(target_embedding.shape):
            # up to the rounding of the draft's dtype and the target's: bf16 drafts of an fp32 target match
            same, embedding["max_abs_diff_vs_target"] = same_embedding(saved, target_embedding)
            embedding["saved_dtype"] = str(saved.dtype).removeprefix("torch.")
            if not same:
                warn_base(
                    "EAGLE draft",
                    str(source),
                    f"its embedding is {embedding['max_abs_diff_vs_target']:.3g} away from the target's "
                    "(embedding.max_abs_diff_vs_target)",
                )
    speculators = cfg.get("speculators_config")
    verifier = speculators.get("verifier") if isinstance(speculators, dict) else None
    said = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    other = other_base(said, model)
    if other is not None:
        warn_base("EAGLE draft", str(source), f"it names {said} as its verifier; the target is {other}")
    manifest = {
        "kind": "eagle",
        "published": True,
        "format": fmt,
        "source": str(source),
        "path": str(path),
        "files_sha256": digests,
        "spec": spec.to_dict(),
        "config": {k: cfg[k] for k in sorted(cfg) if not isinstance(cfg[k], (dict, list)) or k == "architectures"},
        "verifier": verifier,
        "embedding": embedding,
        "saved_dtypes": saved_dtypes(state),  # the draft runs in the target's dtype
        "notes": [*unread, *unused, *config_notes(cfg, spec)],
        "parameters": sum(p.numel() for p in draft.parameters()),
        "cpu_budget_artifact": False,
    }
    for note in manifest["notes"]:  # said as the published heads' are, not only recorded
        print(f"harness: note: the published EAGLE draft at {source}: {note}", file=sys.stderr)
    return EagleArtifact(draft=draft, manifest=manifest, path=path)


def saved_dtypes(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """How many of a checkpoint's tensors each dtype stores (``{"bfloat16": 12, "int64": 1}``)."""
    out: dict[str, int] = {}
    for tensor in state.values():
        name = str(tensor.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def load_eagle(recipe: dict, *, model: torch.nn.Module, tokenizer, path: Path) -> EagleArtifact:
    manifest, state = load_bound(path, kind="eagle", recipe=recipe, model=model, tokenizer=tokenizer)
    if state is None:
        raise ArtifactError(f"artifact {str(path)!r} has no weights")
    return EagleArtifact(draft=build_eagle(recipe["spec"], state), manifest=manifest, path=Path(path))


def load_configured_eagle(
    options: dict, *, model: torch.nn.Module, tokenizer, revision: str | None = None
) -> EagleArtifact:
    """``proposer.artifact``: a published checkpoint (directory, or hub id at ``revision``: see
    :func:`load_published_eagle`) or an artifact trained here; unset: the trained artifact of the
    configured recipe in the cache."""
    artifact = options.get("artifact")
    if is_published(artifact):
        return load_published_eagle(str(artifact), model=model, revision=revision)
    recipe, path = eagle_artifact_path(options, model=model, tokenizer=tokenizer)
    if not (path / "manifest.json").is_file():
        raise missing("eagle", path, bool(artifact))
    return load_eagle(recipe, model=model, tokenizer=tokenizer, path=path)


# --------------------------------------------------------------------------- training text
# What an artifact trained on the target streams (heads, EAGLE drafts, the early-exit adapter) read:
# ShareGPT conversations made into documents by DOCUMENT_RULE, encoded once into cached streams
# (harness.prepare.heads_data), and the workload-leakage check of a run against that text.


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
    held_out_prompt: int = 0  # dropped: its first user turn is a held-out prompt (prompt_key; no window of one)
    template_refusal: str | None = None  # the template's message for the first one it refused

    def to_meta(self) -> dict:
        return asdict(self)


class LabelledDocument(list):
    """A document's token ids (a list, as every other document) with ``labels``: for each token, whether
    it is a loss position (a token of an assistant turn, :func:`assistant_labels`). A slice keeps the
    labels of its tokens."""

    def __init__(self, ids: Iterable[int], labels: Iterable[bool]) -> None:
        super().__init__(ids)
        self.labels = [bool(x) for x in labels]
        if len(self.labels) != len(self):
            raise ValueError(f"a document of {len(self)} tokens given {len(self.labels)} labels")

    def __getitem__(self, index):
        if isinstance(index, slice):
            return LabelledDocument(list.__getitem__(self, index), self.labels[index])
        return list.__getitem__(self, index)


def _template_ids(tokenizer, messages: list[dict], **options) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **options)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def assistant_labels(tokenizer, messages: list[dict], ids: Sequence[int]) -> list[bool]:
    """Which of ``ids`` (``messages`` rendered through the tokenizer's chat template) are the tokens of
    an assistant turn, by :data:`~harness.heads.recipes.ASSISTANT_SPAN_RULE`: the turn's span runs from
    the end of the rendering of the turns before it with the generation prompt added (what a run's
    prompt ends with) to the end of the rendering through the turn, cut after the first EOS token
    (SmolLM2: ``content<|im_end|>`` marked, the newline the template writes after it not). A turn
    whose prefix renderings are not prefixes of ``ids`` (a template that renders earlier turns
    otherwise once later ones follow), or which the template refuses to render alone, marks nothing."""
    from jinja2.exceptions import TemplateError  # what a template's raise_exception raises

    ids = list(ids)
    labels = [False] * len(ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = _template_ids(tokenizer, messages[:i], add_generation_prompt=True)
            through = _template_ids(tokenizer, messages[: i + 1])
        except TemplateError:
            continue
        if through[: len(before)] != before or ids[: len(through)] != through:
            continue
        for j in range(len(before), len(through)):
            labels[j] = True
            if ids[j] == eos:
                break
    return labels


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
    """The ShareGPT prompts of every split but ``split`` (:func:`~harness.workloads.prompts.load_sharegpt`),
    each as its :func:`~harness.workloads.corpora.prompt_key` (whitespace runs one space, the ends stripped,
    casefolded): a training conversation of ``split`` whose first user turn has the key of one is dropped,
    however short (a "hi" matches no window of :func:`held_out_index`), and however spelled ("Hi", "HI")."""
    return sharegpt_prompt_keys([s for s in SPLITS if s != split])


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
    labels: bool = False,
) -> Iterator[list[int]]:
    """Token ids of ShareGPT conversations of one split, in file order (each truncated), their turns
    in a run's order (:func:`run_order`). A conversation the chat template refuses is skipped, a
    document holding a window of ``exclude`` (:func:`held_out_index`) dropped, and so is one whose
    first user turn's :func:`~harness.workloads.corpora.prompt_key` is in ``exclude_prompts``
    (:func:`held_out_prompts`); ``tally`` counts
    them. Raises ValueError when the template refuses every conversation.

    ``labels``: a document rendered through the chat template is a :class:`LabelledDocument`, its
    assistant tokens marked (:func:`assistant_labels`); a plain-text one stays a list."""

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
            ids = [int(i) for i in ids]
            if labels:
                ids = LabelledDocument(ids, assistant_labels(tokenizer, msgs, ids))
            ids = ids[:max_len]
        else:
            text = "\n".join(t.text for t in turns)[:char_cap]
            ids = [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]][:max_len]
        if len(ids) < 3:
            continue
        if exclude is not None and exclude.first_hit(np.asarray(ids, dtype=np.int64)) is not None:
            tally.held_out_overlap += 1
            continue
        if prompt_key(turns[0].text) in exclude_prompts:  # run_order opens at the first user turn with text
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


def training_documents(
    data: DataRecipe, *, tokenizer, vocab_size: int, tally: DocumentTally | None = None, labels: bool = False
):
    """The training documents of ``data`` (``source=sharegpt``): the ``data.split`` conversations as
    :func:`sharegpt_documents` makes them (``labels``: templated ones with their assistant tokens
    marked), held-out text kept out (:func:`held_out_index`, :func:`held_out_prompts`), whole
    documents up to ``data.token_budget`` tokens, every token counted (:func:`take_budget`).
    Tokenisation only: no model runs."""
    documents = sharegpt_documents(
        data.split,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        max_len=data.max_len,
        chat=data.chat,
        exclude=held_out_index(data.split, tokenizer=tokenizer, vocab_size=vocab_size),
        exclude_prompts=held_out_prompts(data.split),
        tally=tally,
        labels=labels,
    )
    return take_budget(documents, data.token_budget)


def streams_key(tokenizer, recipe: DataRecipe, *, target_hash: str, documents=None, layers: Sequence[int] = ()) -> str:
    """The cache key of the encoded streams: the target, the data recipe, the early-exit boundaries,
    and inline documents, or else what the documents are made from (:func:`~harness.heads.recipes.data_sources_key`)."""
    return short_hash(
        {
            "target": target_hash,
            "recipe": recipe.to_dict(),
            "layers": sorted(int(l) for l in layers),
            "inline": None if documents is None else documents_hash(documents),
            **(data_sources_key(recipe, tokenizer) if documents is None else {}),
        }
    )


def streams_base(target_hash: str, key: str) -> Path:
    """Where the streams of :func:`streams_key` ``key`` are cached (``<base>-train.safetensors``,
    ``<base>-heldout.safetensors``)."""
    return cache_root() / "heads" / "streams" / f"{target_hash[:12]}-{key}"


def tokens_sha256(tokens) -> str:
    """SHA-256 of token ids as little-endian int64 (a stream's tokens, or its documents one after another)."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(tokens), dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class TrainingText:
    """The documents of a trained artifact's training stream, every
    :data:`~harness.workloads.datastore.LEAKAGE_THRESHOLD`-token window of each in a sorted hash
    index (a window never spans two documents: each ran through the target alone)."""

    index: ExclusionIndex
    origin: str  # "cache" (its encoded stream read back) or "rebuilt" (its documents tokenised again)
    split: str
    documents: int
    tokens: int
    seconds: float  # reading or rebuilding the text, and indexing it


#: (cache root, artifact id) -> the artifact's training text, or why there is none to check against
_TRAINING_TEXTS: dict[tuple[str, str], TrainingText | str] = {}


def training_text(manifest: dict, *, tokenizer, vocab_size: int) -> TrainingText | str:
    """The text the artifact of ``manifest`` trained on, indexed once per process (:class:`TrainingText`),
    or why the harness cannot have it (a published checkpoint's data, inline documents whose stream
    is not cached, a rebuild that does not give what the artifact recorded)."""
    key = (str(cache_root()), str(manifest.get("artifact_id")))
    if key not in _TRAINING_TEXTS:
        _TRAINING_TEXTS[key] = _read_training_text(manifest, tokenizer=tokenizer, vocab_size=vocab_size)
    return _TRAINING_TEXTS[key]


def _stream_documents(path: Path) -> list[np.ndarray] | None:
    """The documents of a cached training stream (its ``tokens`` cut where ``segment_ids`` change;
    its hidden rows are not read), or None when there is no readable stream at ``path``."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="np") as f:
            tokens, segments = f.get_tensor("tokens").astype(np.int64), f.get_tensor("segment_ids")
    except Exception:  # a truncated or foreign file: the text is rebuilt instead, where it can be
        return None
    cuts = np.flatnonzero(segments[1:] != segments[:-1]) + 1
    return np.split(tokens, cuts) if len(tokens) else []


def _read_training_text(manifest: dict, *, tokenizer, vocab_size: int) -> TrainingText | str:
    t0 = time.perf_counter()
    kind = manifest.get("kind", "proposal")
    if manifest.get("published") or manifest.get("source") == "published":
        return (
            f"a published {kind} checkpoint: trained on data the harness cannot see, so no workload is checked "
            "against it"
        )
    recipe = manifest.get("recipe") or {}
    if "data" not in recipe or "target_hash" not in manifest:
        return f"the {kind} artifact's manifest names no training data"
    data = DataRecipe(**recipe["data"])
    source = ((manifest.get("streams") or {}).get("train") or {}).get("source", data.source)
    recorded = manifest.get("training_text") or {}

    def trained_on(documents: list) -> bool:
        """Whether ``documents`` are the text the artifact trained on: its recorded digest, or for an
        artifact that recorded none, its token and document counts."""
        tokens = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int64)
        if recorded.get("tokens_sha256"):
            return tokens_sha256(tokens) == recorded["tokens_sha256"]
        return len(tokens) == manifest.get("tokens_seen") and len(documents) == manifest.get(
            "documents", len(documents)
        )

    def indexed(documents: list, origin: str) -> TrainingText:
        arrays = [np.asarray(d, dtype=np.int64) for d in documents]
        return TrainingText(
            index=ExclusionIndex(arrays, LEAKAGE_THRESHOLD),
            origin=origin,
            split=data.split if source == "sharegpt" else source,
            documents=len(arrays),
            tokens=sum(len(a) for a in arrays),
            seconds=time.perf_counter() - t0,
        )

    streams = cache_root() / "heads" / "streams"

    def candidates() -> Iterator[Path]:
        """The recorded stream, then (only where that is not it: the key hashes the ShareGPT file) the
        stream the recipe's key names."""
        if recorded.get("stream"):
            yield streams / recorded["stream"]
        if source == "sharegpt":
            layers = (int(recipe["exit_layer"]),) if kind == "early_exit" else ()
            key = streams_key(tokenizer, data, target_hash=manifest["target_hash"], layers=layers)
            base = streams_base(manifest["target_hash"], key)
            yield base.with_name(base.name + "-train.safetensors")

    for path in candidates():
        documents = _stream_documents(path)
        if documents is not None and trained_on(documents):
            return indexed(documents, "cache")
    if source != "sharegpt":
        return (
            f"the {kind} artifact trained on documents of source {source!r}, whose stream is not in this cache "
            f"({streams}): there is no training text to check the workload against"
        )
    documents = training_documents(data, tokenizer=tokenizer, vocab_size=vocab_size)
    if not trained_on(documents):
        return (
            f"its training stream is not in this cache ({streams}), and the ShareGPT {data.split!r} documents "
            f"tokenised again for its recipe ({sum(map(len, documents))} tokens) are not the text the {kind} "
            f"artifact recorded ({manifest.get('tokens_seen')} tokens): there is no training text to check the "
            "workload against"
        )
    return indexed(documents, "rebuilt")


def written_texts(prompt) -> list[str] | None:
    """The first turn's texts as written: a plain prompt's text, or each message's content (blank
    ones left out), or a conversation's first turn; None for a prompt of token ids alone (no text)."""
    messages = getattr(prompt, "messages", None)
    if messages:
        return [str(m.get("content") or "") for m in messages if str(m.get("content") or "").strip()]
    plain = getattr(prompt, "text", None) or next(iter(getattr(prompt, "turns", None) or ()), None)
    return [plain] if plain else None


class TrainingLeakage:
    """The workload-governance gate of a proposer running an artifact trained here: every text of
    the evaluation workload the model sees (each prompt's ids, each later user turn, the reference
    answer where there is one) is looked up in the artifact's training text (:func:`training_text`),
    in each of its encodings (:func:`text_encodings`: alone, after a space, after a newline).
    A text leaks when it shares a :data:`~harness.workloads.datastore.LEAKAGE_THRESHOLD`-token window
    with one training document (a hash hit confirmed token by token); a shorter text cannot, as in a
    REST datastore's gate (the training recipe itself drops a conversation opening with any held-out
    ShareGPT prompt, however short). A leak refuses the run
    (:class:`~harness.workloads.datastore.LeakageError`) unless ``allow_leakage``, which the entry
    then states (``skipped``: the run is not gated). A published checkpoint, or an artifact whose
    training text cannot be had, is ``not_applicable`` with why."""

    def __init__(self, manifest: dict, *, tokenizer, vocab_size: int) -> None:
        self.manifest, self.tokenizer, self.vocab_size = manifest, tokenizer, int(vocab_size)

    def encode(self, text: str) -> list[list[int]]:
        """``text``'s encodings as a training document may hold it (:func:`text_encodings`)."""
        return text_encodings(text, tokenizer=self.tokenizer, vocab_size=self.vocab_size)

    def written(self, prompt, ids) -> list[list[list[int]]]:
        """The first turn's texts as written (:func:`written_texts`), each as its encodings
        (:meth:`encode`); not the ids the chat template made of them, whose fixed wording (a system
        line, role markers: the training documents hold the same) would count towards a shared window
        and flag any prompt opening as a training conversation does. A prompt of token ids alone (no
        text) is looked up as its ids."""
        texts = written_texts(prompt)
        return [[list(ids)]] if texts is None else [self.encode(t) for t in texts]

    def check(self, items: list, *, allow_leakage: bool = False) -> dict:
        """``items``: ``[(Prompt, prompt_ids)]``. Returns the gate entry; raises
        :class:`~harness.workloads.datastore.LeakageError` on a leak unless ``allow_leakage``."""
        t0 = time.perf_counter()
        kind = self.manifest.get("kind", "proposal")
        text = training_text(self.manifest, tokenizer=self.tokenizer, vocab_size=self.vocab_size)
        if isinstance(text, str):
            return {
                "status": "not_applicable",
                "why": text,
                "kind": "training_leakage",
                "seconds": time.perf_counter() - t0,
            }
        window = text.index.window
        records = []
        for prompt, ids in items:
            prompt_id = getattr(prompt, "prompt_id", str(len(records)))
            ref = getattr(prompt, "reference", None)
            texts = [(prompt_id, self.written(prompt, ids), self.encode(ref) if ref else None)]
            # a conversation's later user turns reach the model too (after its own answers): each is checked
            for k, turn in enumerate((getattr(prompt, "turns", None) or ())[1:], start=2):
                texts.append((f"{prompt_id} turn {k}", [self.encode(turn)], None))
            for name, pieces, ref_ids in texts:
                # each piece: one text's encodings (alone, after a space, after a newline); any may hit
                hits = (text.index.first_hit(np.asarray(e, dtype=np.int64)) for piece in pieces for e in piece)
                hit = next((h for h in hits if h is not None), None)
                ref_hits = (
                    () if ref_ids is None else (text.index.first_hit(np.asarray(e, dtype=np.int64)) for e in ref_ids)
                )
                ref_hit = next((h for h in ref_hits if h is not None), None)
                leaked = hit is not None or ref_hit is not None
                records.append(
                    {
                        "prompt_id": str(name),
                        "prompt_tokens": sum(len(piece[0]) for piece in pieces),
                        # a window fits in one written text or in none: the longest decides
                        "longest_text_tokens": max((len(e) for piece in pieces for e in piece), default=0),
                        "reference_tokens": None if ref_ids is None else max(map(len, ref_ids)),
                        "prompt_leaked": hit is not None,
                        "reference_leaked": None if ref_ids is None else ref_hit is not None,
                        # the training document (its place in the stream) holding a shared window
                        "training_document": hit if hit is not None else ref_hit,
                        "leaked": leaked,
                        "allowed": bool(allow_leakage and leaked),
                    }
                )
        leaked = [r for r in records if r["leaked"]]
        artifact = f"the {kind} artifact {str(self.manifest.get('artifact_id'))[:12]}"
        if leaked and not allow_leakage:
            more = f" and {len(leaked) - 10} more" if len(leaked) > 10 else ""
            named = ", ".join(
                f"{r['prompt_id']} ({' and '.join(w for w in ('prompt', 'reference') if r[f'{w}_leaked'])})"
                for r in leaked[:10]
            )
            raise LeakageError(
                f"evaluation leakage: {len(leaked)} of {len(records)} workload text(s) share a {window}-token "
                f"window with the text {artifact} trained on (ShareGPT {text.split!r} split, {text.tokens} tokens): "
                f"{named}{more}; evaluate on prompts outside its training text, or set allow_leakage=true (the "
                "record then states it)."
            )
        short = sum(
            (r["longest_text_tokens"] < window) + (r["reference_tokens"] is not None and r["reference_tokens"] < window)
            for r in records
        )
        return {
            # leaked prompts let through by the allow_leakage override leave the run ungated
            "status": "skipped" if leaked else "passed",
            **({"override": "allow_leakage=true"} if leaked else {}),
            "kind": "training_leakage",
            "artifact_id": self.manifest.get("artifact_id"),
            "artifact_kind": kind,
            "training_text": {
                "origin": text.origin,
                "split": text.split,
                "documents": text.documents,
                "tokens": text.tokens,
                "seconds": text.seconds,
            },
            "threshold": window,
            "prompts": len(items),
            "texts_checked": len(records),  # every prompt's turns, one row each (a reference beside its prompt)
            "shorter_than_window": int(short),  # texts that cannot share a window (as in a datastore's gate)
            "leaked": [r["prompt_id"] for r in leaked],
            "allow_leakage": bool(allow_leakage),
            "evidence": (
                f"{len(leaked)} leaked prompt(s) let through by allow_leakage=true"
                if leaked
                else f"no prompt, turn or reference shares a {window}-token window with {artifact}'s training text"
            ),
            "seconds": time.perf_counter() - t0,
            "items": records,
        }


class ChecksTrainingLeakage:
    """A proposer running an artifact trained here: its workload-governance gate
    (:meth:`check_workload`) is :class:`TrainingLeakage`'s check, where it was given one."""

    training_leakage: TrainingLeakage | None = None

    def check_workload(self, items: list, *, allow_leakage: bool = False) -> dict | None:
        """The evaluation-leakage gate against the text the artifact trained on; None for a proposer
        built without one."""
        if self.training_leakage is None:
            return None
        return self.training_leakage.check(items, allow_leakage=allow_leakage)
