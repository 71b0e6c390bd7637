"""Training draft-head artifacts (Medusa, Hydra, Clover) for the configured target, and their
preparer: the run's prepare stage makes sure the artifact exists (training it when absent and
``proposer.auto_train``) and hands its path to the proposer, which only loads it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from harness.files import artifact_lock
from harness.heads.artifacts import HeadsArtifact, build_heads, heads_artifact_path, load_heads
from harness.heads.checkpoint import ArtifactError, cpu_budget_label, save_artifact, target_fingerprint
from harness.heads.published import is_published
from harness.heads.recipes import DataRecipe, TrainRecipe
from harness.prepare import Preparation
from harness.prepare.heads_data import trained_artifact_manifest, training_streams
from harness.prepare.heads_training import evaluate, train_heads

log = logging.getLogger("harness.heads")


def train_artifact(
    kind: str,
    recipe: dict,
    *,
    model: torch.nn.Module,
    tokenizer,
    target_source: str,
    out_dir: Path,
    documents=None,
    progress: bool = True,
    cache_streams: bool = True,
) -> HeadsArtifact:
    """Build the streams (cached), train, evaluate held-out, save. Returns the loaded artifact."""
    t0 = time.perf_counter()
    target_hash = target_fingerprint(model, tokenizer)
    data = DataRecipe(**recipe["data"])
    train_stream, held = training_streams(
        model, tokenizer, data, target_hash=target_hash, documents=documents, cache=cache_streams, progress=progress
    )
    stream_seconds = time.perf_counter() - t0
    heads = build_heads(recipe, seed=int(recipe["train"]["seed"]))
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    before = evaluate(heads, held, embed=embed, lm_head=lm_head)
    log_ = train_heads(
        heads, train_stream, recipe=TrainRecipe(**recipe["train"]), embed=embed, lm_head=lm_head, progress=progress
    )
    after = evaluate(heads, held, embed=embed, lm_head=lm_head)
    manifest = trained_artifact_manifest(
        kind=kind,
        target_hash=target_hash,
        target_source=target_source,
        recipe=recipe,
        data=data,
        train_stream=train_stream,
        held=held,
        before=before,
        after=after,
        training_log=log_,
        stream_seconds=stream_seconds,
        started=t0,
        device=next(model.parameters()).device,
        parameters=heads.num_parameters(),
    )
    save_artifact(out_dir, manifest=manifest, state=heads.state_dict())
    return load_heads(kind, recipe, model=model, tokenizer=tokenizer, path=out_dir)


def ensure_heads(
    kind: str,
    options: dict,
    *,
    model: torch.nn.Module,
    tokenizer,
    target_source: str,
    progress: bool = True,
    force: bool = False,
    documents=None,
) -> HeadsArtifact:
    """Load the configured artifact; train it first when absent (and ``auto_train``) or ``force``.
    A published checkpoint (:mod:`harness.heads.published`) is never trained here."""
    explicit = options.get("artifact")
    # a path that does not exist yet is where `harness train` writes (even when it reads like a hub id)
    if is_published(explicit) and (Path(str(explicit)).expanduser().exists() or not force):
        raise ArtifactError(
            f"proposer.artifact={explicit!r} is a published {kind} checkpoint: a run loads it as it is, "
            "nothing is trained here (leave proposer.artifact unset to train heads for this target)"
        )
    recipe, path = heads_artifact_path(kind, options, model=model, tokenizer=tokenizer)
    if (path / "manifest.json").is_file() and not force:
        return load_heads(kind, recipe, model=model, tokenizer=tokenizer, path=path)
    with artifact_lock(path, purpose=f"training the {kind} heads"):  # concurrent jobs train once
        if (path / "manifest.json").is_file() and not force:  # trained by the job that held the lock
            return load_heads(kind, recipe, model=model, tokenizer=tokenizer, path=path)
        return _train_absent(
            kind,
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


def _train_absent(
    kind: str,
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
) -> HeadsArtifact:
    explicit = options.get("artifact")
    if explicit and not force:
        raise ArtifactError(
            f"proposer.artifact={explicit!r} does not exist; run `harness train proposer={kind}` "
            "or leave proposer.artifact unset to use the cache"
        )
    if not options.get("auto_train", True) and not force:
        raise ArtifactError(
            f"no {kind} artifact for this target and recipe at {str(path)!r} and "
            f"proposer.auto_train=false; run `harness train proposer={kind} ...` first"
        )
    log.warning("training the %s heads artifact (absent from %s)", kind, path)
    return train_artifact(
        kind,
        recipe,
        model=model,
        tokenizer=tokenizer,
        target_source=target_source,
        out_dir=path,
        documents=documents,
        progress=progress,
    )


def summary(artifact: HeadsArtifact) -> dict:
    m = artifact.manifest
    return {
        "path": str(artifact.path),
        "artifact_id": m["artifact_id"],
        "kind": m["kind"],
        "target_hash": m["target_hash"],
        "token_budget": m["token_budget"],
        "tokens_seen": m["tokens_seen"],
        "held_out_top1_agreement": m["held_out"]["top1_agreement"],
        "held_out_top1_agreement_untrained": m["held_out"]["top1_agreement_untrained"],
        "training_seconds": m["training"]["total_seconds"],
        "cpu_budget_artifact": cpu_budget_label(m),
        "parameters": m["parameters"],
        "recipe": m["recipe"],
    }


def train_from_config(cfg, *, target, force: bool = False, progress: bool = True) -> dict:
    """`harness train proposer=medusa|hydra|clover`: the artifact a run with ``cfg`` would load."""

    options = OmegaConf.to_container(cfg.proposer, resolve=True)
    kind = options.pop("name")
    artifact = ensure_heads(
        kind,
        options,
        model=target.model,
        tokenizer=target.tokenizer,
        target_source=target.source,
        progress=progress,
        force=force,
    )
    return summary(artifact)


def prepare_heads(kind: str, options: dict, context) -> Preparation:
    """Proposer preparer: the artifact's path (trained first when absent); nothing for a published
    checkpoint, which the proposer loads as it is."""
    if is_published(options.get("artifact")):
        return Preparation()
    art = ensure_heads(
        kind,
        options,
        model=context.target_backend.model,
        tokenizer=context.tokenizer,
        target_source=context.model_source,
    )
    return Preparation(options={"artifact": str(art.path)})


def prepare_medusa(options: dict, context) -> Preparation:
    return prepare_heads("medusa", options, context)


def prepare_hydra(options: dict, context) -> Preparation:
    return prepare_heads("hydra", options, context)


def prepare_clover(options: dict, context) -> Preparation:
    return prepare_heads("clover", options, context)
