"""Loading proposer artifacts (draft heads, the early-exit adapter, the layer-skip vector).

An artifact's directory is named by its recipe (:mod:`harness.heads.recipes`) and the target's
fingerprint (``proposer.artifact`` overrides the path); the manifest records the token budget,
held-out agreement and training time, and whether it is a CPU-budget artifact. A proposer loads
its artifact here and never trains one: the prepare stage (:mod:`harness.prepare`) or
`harness train` makes it first. ``proposer.artifact`` naming a published Medusa or Hydra
checkpoint (a directory without ``manifest.json``, or a hub id) is read in its published layout
(:mod:`harness.heads.published`); its manifest is its provenance (files and their hashes).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.heads.checkpoint import (
    MANIFEST_FILE,
    ArtifactError,
    artifact_dir,
    cpu_budget_label,
    load_artifact,
    read_config_object,
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
from harness.target.loading import chat_template_key, model_names
from harness.target.timing import timed_setup


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


def _located(kind: str, recipe: dict, options: dict, *, model: torch.nn.Module, tokenizer) -> tuple[dict, Path]:
    """``recipe`` and its artifact's directory: ``proposer.artifact`` when given, else the one
    :func:`artifact_dir` names for ``kind``, the target's fingerprint and ``recipe``. A recipe trained
    on the target streams also holds what their text is made from and the training code's version."""
    if "data" in recipe:  # trained on streams (heads, EAGLE, early exit)
        recipe = {**recipe, **data_sources_key(DataRecipe(**recipe["data"]), tokenizer), **training_code_key(kind)}
    else:  # the chat format the search's text was put in
        recipe = {**recipe, **chat_template_key(tokenizer)}
    explicit = options.get("artifact")
    if explicit:
        return recipe, Path(str(explicit)).expanduser()
    return recipe, artifact_dir(kind, target_hash=target_fingerprint(model, tokenizer), recipe=recipe)


def heads_artifact_path(kind: str, options: dict, *, model: torch.nn.Module, tokenizer) -> tuple[dict, Path]:
    """The recipe of the configured heads and the directory of their artifact."""
    return _located(kind, heads_recipe(kind, options, model), options, model=model, tokenizer=tokenizer)


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


def load_published(kind: str, ref: str, *, model: torch.nn.Module) -> HeadsArtifact:
    """A published head bank (key for key, its published forward) with its provenance."""
    layout = inspect(ref, kind)
    heads = load_published_heads(layout, model=model)
    base = layout.config.get("base_model_name_or_path")
    targets = model_names(model)  # by path or hub id alike: the last component is compared
    if heads.embed_matches_target is False:
        warn_base(kind, ref, "their saved input embedding differs from the target's (input_embed_matches_target)")
    elif base and targets and Path(str(base)).name.lower() not in {Path(t).name.lower() for t in targets}:
        named = targets[0] if len(targets) == 1 else f"{targets[0]} (converted from {targets[1]})"
        warn_base(kind, ref, f"they name {base} as their base model; the target is {named}")
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


def warn_base(kind: str, ref: str, why: str) -> None:
    """One stderr line: a published draft that looks made for another base model (its acceptance
    will be low; the outputs stay exact, and the record keeps the evidence)."""
    print(
        f"harness: warning: the published {kind} at {ref} looks made for another base model: {why}; "
        "expect low acceptance (outputs stay exact)",
        file=sys.stderr,
    )


def load_configured_heads(kind: str, options: dict, *, model: torch.nn.Module, tokenizer) -> HeadsArtifact:
    if is_published(options.get("artifact")):
        return load_published(kind, str(options["artifact"]), model=model)
    recipe, path = heads_artifact_path(kind, options, model=model, tokenizer=tokenizer)
    if not (path / "manifest.json").is_file():
        raise missing(kind, path, bool(options.get("artifact")))
    return load_heads(kind, recipe, model=model, tokenizer=tokenizer, path=path)


def adapter_artifact_path(options: dict, *, model: torch.nn.Module, tokenizer) -> tuple[dict, Path]:
    return _located("early_exit", exit_recipe(options, model), options, model=model, tokenizer=tokenizer)


def load_adapter(options: dict, *, model: torch.nn.Module, tokenizer, path: Path | None = None) -> AdapterArtifact:
    recipe, default = adapter_artifact_path(options, model=model, tokenizer=tokenizer)
    path = Path(path or default)
    if not (path / "manifest.json").is_file():
        raise missing("early_exit", path, bool(options.get("artifact")))
    manifest, state = load_bound(path, kind="early_exit", recipe=recipe, model=model, tokenizer=tokenizer)
    return AdapterArtifact(build_adapter(model, state), manifest, path)


def skip_artifact_path(options: dict, *, model: torch.nn.Module, tokenizer) -> tuple[dict, Path]:
    """The search recipe and the layer-skip artifact's directory: ``proposer.artifact``, else the
    cache's, named by the target, the recipe, the host the search times on and how the target's
    forward runs there (:func:`~harness.target.timing.timed_setup`): the vector is the fastest one
    there, so one searched on another device or thread count, or with other kernels, attention,
    cache kind, fused layers or compilation, is searched again, not reused."""
    rd = {**recipe_key(SearchRecipe(**dict(options.get("search") or {}))), **chat_template_key(tokenizer)}
    if options.get("artifact"):
        return rd, Path(str(options["artifact"])).expanduser()
    return rd, artifact_dir(
        "layer_skip", target_hash=target_fingerprint(model, tokenizer), recipe={**rd, "timed_on": timed_setup(model)}
    )


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


def eagle_artifact_path(options: dict, *, model: torch.nn.Module, tokenizer) -> tuple[dict, Path]:
    """The recipe of the configured (trained) EAGLE draft and the directory of its artifact."""
    return _located("eagle", eagle_recipe(options, model), options, model=model, tokenizer=tokenizer)


def load_published_eagle(source: str, *, model: torch.nn.Module) -> EagleArtifact:
    """A published EAGLE / EAGLE-2 / EAGLE-3 checkpoint (local directory or hub id), checked
    against the target's hidden size, vocabulary and layers."""
    path = resolve_source(source)
    cfg = read_config_object(path / "config.json")
    raw, digests = read_weights(path)
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
    manifest = {
        "kind": "eagle",
        "published": True,
        "format": fmt,
        "source": str(source),
        "path": str(path),
        "files_sha256": digests,
        "spec": spec.to_dict(),
        "config": {k: cfg[k] for k in sorted(cfg) if not isinstance(cfg[k], (dict, list)) or k == "architectures"},
        "verifier": (cfg.get("speculators_config") or {}).get("verifier"),
        "embedding": embedding,
        "notes": [*unused, *config_notes(cfg, spec)],
        "parameters": sum(p.numel() for p in draft.parameters()),
        "cpu_budget_artifact": False,
    }
    for note in manifest["notes"]:  # said as the published heads' are, not only recorded
        print(f"harness: note: the published EAGLE draft at {source}: {note}", file=sys.stderr)
    return EagleArtifact(draft=draft, manifest=manifest, path=path)


def load_eagle(recipe: dict, *, model: torch.nn.Module, tokenizer, path: Path) -> EagleArtifact:
    manifest, state = load_bound(path, kind="eagle", recipe=recipe, model=model, tokenizer=tokenizer)
    if state is None:
        raise ArtifactError(f"artifact {str(path)!r} has no weights")
    return EagleArtifact(draft=build_eagle(recipe["spec"], state), manifest=manifest, path=Path(path))


def load_configured_eagle(options: dict, *, model: torch.nn.Module, tokenizer) -> EagleArtifact:
    """``proposer.artifact``: a published checkpoint (directory or hub id) or an artifact trained
    here; unset: the trained artifact of the configured recipe in the cache."""
    artifact = options.get("artifact")
    if is_published(artifact):
        return load_published_eagle(str(artifact), model=model)
    recipe, path = eagle_artifact_path(options, model=model, tokenizer=tokenizer)
    if not (path / "manifest.json").is_file():
        raise missing("eagle", path, bool(artifact))
    return load_eagle(recipe, model=model, tokenizer=tokenizer, path=path)
