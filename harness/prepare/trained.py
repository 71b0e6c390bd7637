"""Artifacts the prepare stage trains (or searches) once per target and recipe and proposers only
load: draft heads, EAGLE drafts, the early-exit adapter, the layer-skip vector.

:func:`load_or_train` loads the artifact when its manifest is there, else trains it holding the
artifact's lock, so that concurrent jobs train it once and a job that waited for the lock loads
what the holder trained. :func:`refuse_untrained` is the refusal to train an artifact the
configuration names or forbids training. :class:`Target` is the frozen target an artifact is
trained for, as the ``ensure_*`` functions take it. :func:`noting_outcomes` collects which
artifacts were loaded and which trained (`harness train` says when it trained nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from harness.files import artifact_lock
from harness.heads.checkpoint import ArtifactError, cpu_budget_label

T = TypeVar("T")

_OUTCOMES: ContextVar[list[tuple[str, Path]] | None] = ContextVar("artifact_outcomes", default=None)


@contextmanager
def noting_outcomes() -> Iterator[list[tuple[str, Path]]]:
    """Within the block, every :func:`load_or_train` appends ``("loaded" | "trained", path)`` to the
    list this yields."""
    outcomes: list[tuple[str, Path]] = []
    token = _OUTCOMES.set(outcomes)
    try:
        yield outcomes
    finally:
        _OUTCOMES.reset(token)


def _note(outcome: str, path: Path) -> None:
    outcomes = _OUTCOMES.get()
    if outcomes is not None:
        outcomes.append((outcome, Path(path)))


@dataclass(frozen=True)
class Target:
    """The frozen target an artifact is trained for and checked against. `harness train`'s
    :class:`harness.target.loading.LoadedModel` has the same three fields and serves as one."""

    model: torch.nn.Module
    tokenizer: Any  # None for the tiny random model (byte ids)
    source: str  # where its weights came from, recorded in the artifact's manifest


def load_or_train(path: Path, *, load: Callable[[], T], train: Callable[[], T], purpose: str, force: bool = False) -> T:
    """``load()`` when ``path/manifest.json`` exists (and not ``force``), else ``train()`` under the
    artifact's lock (``purpose`` is what a waiting job is told the holder is doing)."""

    def present() -> bool:
        return not force and (path / "manifest.json").is_file()

    if present():
        _note("loaded", path)
        return load()
    with artifact_lock(path, purpose=purpose):  # concurrent jobs train once
        if present():  # trained by the job that held the lock
            _note("loaded", path)
            return load()
        _note("trained", path)
        return train()


def why_trained(path: Path) -> str:
    """Why an artifact is being built at ``path``, for its log line: it is absent, or (``force``) the one
    there is being replaced."""
    return f"replacing the one in {path}" if (path / "manifest.json").is_file() else f"absent from {path}"


def refuse_untrained(kind: str, options: dict, path: Path, *, force: bool) -> None:
    """Raise :class:`ArtifactError` when the absent ``kind`` artifact at ``path`` may not be trained
    here: ``proposer.artifact`` names it, or ``proposer.auto_train=false``. ``force`` (`harness
    train`) always trains."""
    if force:
        return
    explicit = options.get("artifact")
    if explicit:
        raise ArtifactError(
            f"proposer.artifact={explicit!r} does not exist; run `harness train proposer={kind}` "
            "or leave proposer.artifact unset to use the cache"
        )
    if not options.get("auto_train", True):
        raise ArtifactError(
            f"no {kind} artifact for this target and recipe at {str(path)!r} and "
            f"proposer.auto_train=false; run `harness train proposer={kind} ...` first"
        )


def of_context(context) -> Target:
    """The target of a run's :class:`harness.engine.build.BuildContext`."""
    return Target(model=context.target_backend.model, tokenizer=context.tokenizer, source=context.model_source)


def trained_summary(artifact, **quality) -> dict:
    """What `harness train` prints of an artifact it trained: where it is, what it was trained
    for, its held-out ``quality`` (as each kind names it), how long training took and whether
    results from it are labelled ``cpu_budget_artifact``."""
    m = artifact.manifest
    return {
        "path": str(artifact.path),
        "artifact_id": m["artifact_id"],
        "kind": m["kind"],
        "target_hash": m["target_hash"],
        "token_budget": m["token_budget"],
        **quality,
        "training_seconds": m["training"]["total_seconds"],
        "cpu_budget_artifact": cpu_budget_label(m),
        "recipe": m["recipe"],
    }


def streams_trained_summary(artifact, *, agreement: str = "held_out_top1_agreement") -> dict:
    """:func:`trained_summary` of an artifact trained on the target streams (heads, EAGLE drafts);
    ``agreement`` names its held-out top-1 agreement."""
    m = artifact.manifest
    return trained_summary(
        artifact,
        tokens_seen=m["tokens_seen"],
        **{agreement: m["held_out"]["top1_agreement"]},
        held_out_top1_agreement_untrained=m["held_out"]["top1_agreement_untrained"],
        parameters=m["parameters"],
    )
