"""One W&B run per job.

The runner opens the tracker after the gates pass and logs the finished record::

    with tracker_from_config(cfg, run_dir=run_dir) as tracker:   # NullTracker for tracking=none
        record = measure(...)
        tracker.log_record(record, run_dir)

What reaches W&B: the resolved config as run config; group = the sweep, else the experiment;
tags ``axis=value`` for every axis; the record's metrics as summary values under their record
names; three tables (acceptance by depth, accepted-length histogram, round-cost ledger); the
record, the outputs and the record's artifacts as one W&B Artifact. An exception inside the
``with`` block finishes the run with ``exit_code=1`` (W&B marks it failed) and is re-raised.

Offline by default: no account and no network; ``wandb sync`` uploads later. The run lands in
``<dir>/wandb/offline-run-*``; pass the run folder as ``dir`` so every job keeps its own log.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from omegaconf import OmegaConf

from harness.tracking.store import (
    AXES,
    OUTPUTS_FILENAME,
    RECORD_FILENAME,
    ROUND_COST_STAGES,
    record_gated,
    validate_record,
)

Mode = Literal["offline", "online", "disabled"]
MODES: tuple[str, ...] = ("offline", "online", "disabled")
DEFAULT_PROJECT = "spec-harness"  # as in conf/tracking (harness/config.py TrackingConfig)


def _to_container(config: Any) -> dict[str, Any]:
    """A plain dict from a dict or an OmegaConf config (resolved)."""
    if isinstance(config, Mapping) and not hasattr(config, "_metadata"):
        return dict(config)
    try:
        pass
    except ImportError as exc:  # pragma: no cover - omegaconf is a pinned dependency
        raise TypeError(f"config must be a dict; got {type(config).__name__}") from exc
    if OmegaConf.is_config(config):
        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    raise TypeError(f"config must be a dict or an OmegaConf config; got {type(config).__name__}")


def _is_record(obj: Mapping[str, Any]) -> bool:
    return "schema_version" in obj and "metrics" in obj and "config" in obj


def _name_of(value: Any) -> str | None:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, Mapping) and isinstance(value.get("name"), str):
        return value["name"]
    return None


def axis_tags(axes: Mapping[str, Any]) -> list[str]:
    """``["proposer=rest", "temperature=0.7", ...]`` in the fixed axis order, then any extra."""
    keys = [k for k in AXES if k in axes] + sorted(k for k in axes if k not in AXES)
    return [f"{k}={axes[k]}" for k in keys]


def _artifact_name(run_id: str) -> str:
    # W&B artifact names: letters, digits, dashes, underscores and dots
    return "record-" + re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)


class NullTracker:
    """``tracking=none``: the same interface, nothing logged anywhere."""

    run = None

    def log_record(self, record: Mapping[str, Any], run_dir: str | Path) -> None:
        validate_record(dict(record))

    def finish(self, exit_code: int = 0) -> None:
        return None

    def __enter__(self) -> NullTracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        return False


class Tracker:
    """A live W&B run. Use :func:`open_run` to make one."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._finished = False

    # -- logging -------------------------------------------------------------------------------

    def log_record(self, record: Mapping[str, Any], run_dir: str | Path) -> None:
        """Summary metrics, config, tags, tables and the record artifact of one finished run."""
        import wandb  # imported on use: 1.05 s at import, and tracking is optional

        if self._finished:
            raise RuntimeError("log_record after finish: the W&B run is already closed")
        record = validate_record(dict(record))
        run_dir = Path(run_dir)
        run = self.run

        run.config.update(record["config"], allow_val_change=True)
        tags = list(run.tags or ())
        extra = [t for t in axis_tags(record["axes"]) if t not in tags]
        if not record_gated(record):
            extra.append("ungated")  # a gate was skipped: never pooled with gated runs
        run.tags = tuple(tags + extra)

        summary: dict[str, Any] = dict(record["metrics"])
        summary.update(
            run_id=record["run_id"],
            experiment=record["experiment"],
            sweep=record["sweep"],
            exact=record["exact"],
            manifest_hash=record["manifest_hash"],
            gated=record_gated(record),
        )
        run.summary.update(summary)

        metrics = record["metrics"]
        acc, reach = metrics["acceptance_by_depth"], metrics["reach_by_depth"]
        depth_rows = [
            [d + 1, acc[d] if d < len(acc) else None, reach[d] if d < len(reach) else None]
            for d in range(max(len(acc), len(reach)))
        ]
        hist = metrics["accepted_length_hist"]
        total = sum(hist) or 1
        cost = metrics["round_cost_ms"]
        stages = [s for s in ROUND_COST_STAGES if s in cost] + sorted(s for s in cost if s not in ROUND_COST_STAGES)
        round_ms = sum(float(cost[s] or 0.0) for s in stages) or 1.0
        run.log(
            {
                "acceptance_by_depth_table": wandb.Table(
                    columns=["depth", "acceptance_conditional", "reach_marginal"], data=depth_rows
                ),
                "accepted_length_hist_table": wandb.Table(
                    columns=["accepted_tokens", "rounds", "fraction"],
                    data=[[k, n, n / total] for k, n in enumerate(hist)],
                ),
                "round_cost_table": wandb.Table(
                    columns=["stage", "ms_per_round", "share"],
                    data=[[s, cost[s], float(cost[s] or 0.0) / round_ms] for s in stages],
                ),
            }
        )

        artifact = wandb.Artifact(
            _artifact_name(record["run_id"]),
            type="run-record",
            metadata={"run_id": record["run_id"], "manifest_hash": record["manifest_hash"]},
        )
        if not (run_dir / RECORD_FILENAME).is_file():
            raise FileNotFoundError(f"{run_dir / RECORD_FILENAME}: write the record before logging it")
        for name in (RECORD_FILENAME, OUTPUTS_FILENAME):
            if (run_dir / name).is_file():
                artifact.add_file(str(run_dir / name), name=name)
        for name, rel in record["artifacts"].items():
            path = Path(rel) if Path(rel).is_absolute() else run_dir / rel
            if path.is_dir():
                artifact.add_dir(str(path), name=f"artifacts/{name}")
            elif path.is_file():
                artifact.add_file(str(path), name=f"artifacts/{name}/{path.name}")
            else:
                raise FileNotFoundError(f"record artifact {name!r} points to {path}, which does not exist")
        run.log_artifact(artifact)

    # -- lifecycle -----------------------------------------------------------------------------

    def finish(self, exit_code: int = 0) -> None:
        """Close the run; a non-zero exit code marks it failed. Idempotent."""
        if self._finished:
            return
        self._finished = True
        self.run.finish(exit_code=exit_code)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        self.finish(exit_code=0 if exc_type is None else 1)
        return False


def open_run(
    record_or_config: Any,
    *,
    mode: Mode = "offline",
    project: str = DEFAULT_PROJECT,
    group: str | None = None,
    tags: list[str] | tuple[str, ...] | None = None,
    dir: str | Path | None = None,
    name: str | None = None,
    entity: str | None = None,
) -> Tracker:
    """Start one W&B run for a job.

    ``record_or_config``: a finished record (its config, axes, sweep and experiment are used) or
    the resolved run config (dict or OmegaConf). ``group`` defaults to the sweep, else the
    experiment; ``tags`` default to the record's axes (``axis=value``); ``dir`` is where
    ``wandb/`` is written (the run folder; default: the working directory).
    """
    import wandb  # imported on use: 1.05 s at import, and tracking is optional

    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}; got {mode!r}")
    obj = _to_container(record_or_config)
    if _is_record(obj):
        config = _to_container(obj["config"])
        group = group or _name_of(obj.get("sweep")) or _name_of(obj.get("experiment"))
        tags = list(tags) if tags is not None else axis_tags(obj["axes"])
        name = name or obj.get("run_id")
    else:
        config = obj
        group = group or _name_of(config.get("sweep")) or _name_of(config.get("experiment"))
        tags = list(tags or [])
    run_dir = Path(dir) if dir is not None else Path.cwd()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=project,
        entity=entity,
        group=group,
        tags=tags,
        name=name,
        config=config,
        dir=str(run_dir),
        mode=mode,
        reinit="create_new",
        settings=wandb.Settings(
            silent=True,
            console="off",
            x_disable_stats=True,
            save_code=False,
            disable_git=True,
        ),
    )
    return Tracker(run)


def tracker_from_config(config: Any, *, run_dir: str | Path, group: str | None = None) -> Tracker | NullTracker:
    """The tracker a run config asks for.

    ``tracking`` may be ``None`` / ``"none"`` / ``{name: none}`` (no tracker), ``"wandb"`` or
    ``{name: wandb, mode: offline|online|disabled, project: ..., group: ..., tags: [...]}``.
    ``group`` (the sweep name, which the runner knows before the record exists) wins over the
    config's ``tracking.group``, then the config's ``sweep``, then its ``experiment``.
    """
    cfg = _to_container(config)
    tracking = cfg.get("tracking")
    kind = _name_of(tracking) if tracking is not None else "none"
    if kind is None and isinstance(tracking, Mapping):
        kind = tracking.get("backend")
    if kind in (None, "none"):
        return NullTracker()
    if kind != "wandb":
        raise ValueError(f"tracking must be 'none' or 'wandb'; got {kind!r}")
    opts = dict(tracking) if isinstance(tracking, Mapping) else {}
    return open_run(
        cfg,
        mode=opts.get("mode", "offline"),
        project=opts.get("project", DEFAULT_PROJECT),
        group=group or opts.get("group"),
        tags=opts.get("tags"),
        dir=run_dir,
        entity=opts.get("entity"),
    )
