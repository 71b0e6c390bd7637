"""Training draft-head artifacts (Medusa, Hydra, Clover) for the configured target, and their
preparer: the run's prepare stage makes sure the artifact exists (training it when absent and
``proposer.auto_train``) and hands its path to the proposer, which only loads it.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

from omegaconf import OmegaConf

from harness.heads.artifacts import HeadsArtifact, build_heads, heads_artifact_path, load_heads, refuse_foreign
from harness.heads.checkpoint import ArtifactError, save_artifact
from harness.heads.published import is_published
from harness.heads.recipes import TrainRecipe
from harness.prepare import Preparation
from harness.prepare.heads_data import trained_artifact_manifest, training_data
from harness.prepare.heads_training import evaluate, train_heads
from harness.prepare.trained import (
    Target,
    load_or_train,
    of_context,
    refuse_untrained,
    streams_trained_summary,
    why_trained,
)

log = logging.getLogger("harness.heads")


def train_artifact(
    kind: str, recipe: dict, target: Target, *, out_dir: Path, documents=None, progress: bool = True
) -> HeadsArtifact:
    """Build the streams (cached), train, evaluate held-out, save. Returns the loaded artifact."""
    streams = training_data(target, recipe, documents=documents, progress=progress)
    device = next(target.model.parameters()).device
    heads = build_heads(recipe, seed=int(recipe["train"]["seed"])).to(device)  # trained where the target runs
    embed, lm_head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    before = evaluate(heads, streams.held, embed=embed, lm_head=lm_head)
    log_ = train_heads(
        heads, streams.train, recipe=TrainRecipe(**recipe["train"]), embed=embed, lm_head=lm_head, progress=progress
    )
    after = evaluate(heads, streams.held, embed=embed, lm_head=lm_head)
    manifest = trained_artifact_manifest(
        kind,
        streams,
        recipe,
        before=before,
        after=after,
        training_log=log_,
        device=device,
        parameters=heads.num_parameters(),
    )
    save_artifact(out_dir, manifest=manifest, state={k: v.cpu() for k, v in heads.state_dict().items()})
    return load_heads(kind, recipe, model=target.model, tokenizer=target.tokenizer, path=out_dir)


def ensure_heads(
    kind: str, options: dict, target: Target, *, progress: bool = True, force: bool = False, documents=None
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
    if explicit:  # never trained into, nor locked, unless it is absent or a heads artifact of this kind
        refuse_foreign(kind, explicit)
    recipe, path = heads_artifact_path(
        kind, options, model=target.model, tokenizer=target.tokenizer, documents=documents
    )

    def train() -> HeadsArtifact:
        refuse_untrained(kind, options, path, force=force)
        log.warning("training the %s heads artifact (%s)", kind, why_trained(path))
        return train_artifact(kind, recipe, target, out_dir=path, documents=documents, progress=progress)

    load = partial(load_heads, kind, recipe, model=target.model, tokenizer=target.tokenizer, path=path)
    return load_or_train(path, load=load, train=train, purpose=f"training the {kind} heads", force=force)


def summary(artifact: HeadsArtifact) -> dict:
    return streams_trained_summary(artifact)


def train_from_config(cfg, *, target, force: bool = False, progress: bool = True) -> dict:
    """`harness train proposer=medusa|hydra|clover`: the artifact a run with ``cfg`` would load."""

    options = OmegaConf.to_container(cfg.proposer, resolve=True)
    kind = options.pop("name")
    return summary(ensure_heads(kind, options, target, progress=progress, force=force))


def prepare_heads(kind: str, options: dict, context) -> Preparation:
    """Proposer preparer: the artifact's path (trained first when absent); nothing for a published
    checkpoint, which the proposer loads as it is."""
    if is_published(options.get("artifact")):
        return Preparation()
    art = ensure_heads(kind, options, of_context(context))
    return Preparation(options={"artifact": str(art.path)})


def prepare_medusa(options: dict, context) -> Preparation:
    return prepare_heads("medusa", options, context)


def prepare_hydra(options: dict, context) -> Preparation:
    return prepare_heads("hydra", options, context)


def prepare_clover(options: dict, context) -> Preparation:
    return prepare_heads("clover", options, context)
