"""One W&B run per job, named and grouped so that a dashboard can compare arms.

The runner opens the run once the plan is accepted (a refused configuration logs nothing), so
W&B's system monitor samples the whole job (CPU, memory; GPU utilisation and memory on a GPU),
and logs the finished record at the end::

    tracker = open_run(config, axes=axes, run_id=run_id, dir=run_dir, group=sweep_or_experiment)
    try:
        record = ...                      # load, prepare, gate, measure, summarise, write
    except Exception as exc:
        tracker.fail(stage="gate", error=exc, refused=True)   # state failed, tag "refused"
        raise
    tracker.log_record(record, run_dir)   # and finish

What a run carries:

* **names**: ``name`` = the arm and its workload
  (``<proposer>-<topology>-<verifier>-T<temperature>-B<batch>-<workload>``), ``id`` = the record's
  run id (manifest hash and time), ``group`` = the sweep, else the experiment, else ``adhoc``
  (a multirun without a sweep name: ``adhoc/<its sweep folder's name>``, one group per launch:
  :func:`wandb_group`), ``job_type`` = the arm without the workload
  (:mod:`harness.tracking.conventions`);
* **config**: the axes (``proposer``, ``topology``, ``verifier``, ``temperature``, ``batch_size``,
  ``workload``, ``model``), ``arm``, ``experiment`` and ``sweep`` as top-level keys (group-by and
  parallel-coordinates panels read them), the resolved run config under ``resolved``;
* **tags**: ``axis=value`` per axis (one longer than W&B takes cut, with a hash: :func:`fit_tag`),
  and what sets the run apart: ``ungated`` (the record says
  ``gated: false``), ``gate-skipped:<gate>`` / ``gate-failed:<gate>``, ``heuristic``
  (``exact: false``), ``cpu-budget-artifact``; a job that raised is finished with exit code 1
  (W&B state *failed*) and tagged ``refused`` (a gate or contract said no) or ``failed``;
* **summary**: every record metric under its record name, plus ``outcome``, ``gated``,
  ``gates_passed`` and ``gates_skipped`` (the gates' names), ``run_id``, ``manifest_hash`` and the
  content hashes among the record's artifacts (``sequoia_tree_hash``, ...: :func:`artifact_entries`);
* **history** (series a chart draws): one step per verify forward (``round/committed_tokens``,
  ``round/accepted_length``, ``round/candidate_rows``, ``round/ms`` and ``round/<stage>_ms``
  against ``round``; at B > 1 a batch round, its requests' figures summed (the accepted length
  their mean) and ``round/live_requests`` beside them: :func:`round_steps`), acceptance and reach
  by depth with their round counts and 95% Wilson
  bounds (``depth/*`` against ``depth``; a depth tried by too few rounds goes to
  ``depth/acceptance_few_rounds`` instead of ``depth/acceptance``), the t(n) profile and each
  point's roofline floor (``t_profile/t_ms`` and ``t_profile/floor_ms`` against ``verify_rows``);
* **tables**: acceptance by depth (with counts and intervals), the accepted-length histogram, the
  round-cost ledger, and one row per prompt (both arms' tokens and times, its decode speedup);
* **artifact** ``record-<run id>`` (type ``run-record``): record.json, outputs.jsonl,
  rounds.jsonl and the files and folders the record's artifacts name.

Offline by default: no account and no network; ``wandb sync <run dir>/wandb/offline-run-*``
uploads later. ``mode=online`` against a server that cannot be reached (or without credentials)
falls back to offline with one warning on stderr; the record on disk never depends on W&B.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlparse

from omegaconf import OmegaConf

from harness.files import output_folder_problem
from harness.record_schema import ROUND_COST_STAGES, SHARED_ROUND_STAGES
from harness.tracking.conventions import MIN_DEPTH_ROUNDS, arm_name, depth_rows, machine_label, name_of, run_name
from harness.tracking.job_folder import record_artifact_path
from harness.tracking.store import (
    AXES,
    OUTPUTS_FILENAME,
    RECORD_FILENAME,
    ROUNDS_FILENAME,
    gate_status,
    record_gated,
    validate_record,
)

#: a W&B run that logs nothing (W&B's "disabled") is no tracker here: a record names where its log is
Mode = Literal["offline", "online"]
MODES: tuple[str, ...] = ("offline", "online")
DEFAULT_PROJECT = "spec-harness"  # as in conf/tracking (harness/config.py TrackingConfig)
DEFAULT_BASE_URL = "https://api.wandb.ai"
#: W&B run ids: letters, digits, dashes and underscores
_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def _to_container(config: Any) -> dict[str, Any]:
    """A plain dict from a dict or an OmegaConf config (resolved)."""
    if OmegaConf.is_config(config):
        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"config must be a dict or an OmegaConf config; got {type(config).__name__}")


def _is_record(obj: Mapping[str, Any]) -> bool:
    return "schema_version" in obj and "metrics" in obj and "config" in obj


#: the group of a job that names no sweep and no experiment, outside any multirun
ADHOC_GROUP = "adhoc"
#: the file a multirun launch writes into its sweep folder (``harness.sweep.LAUNCH_FILE``)
LAUNCH_FILE = "launch.json"


def launch_folder(run_dir: str | Path) -> Path | None:
    """The sweep folder a job folder is in (its nearest folder above holding a multirun's
    :data:`LAUNCH_FILE`), or None."""
    for folder in Path(os.path.abspath(run_dir)).parents:
        if (folder / LAUNCH_FILE).is_file():
            return folder
    return None


def wandb_group(sweep: Any, experiment: Any, run_dir: str | Path | None = None) -> str:
    """The W&B group of a job: its sweep, else its experiment; else, for a job of a multirun without a
    sweep name (``run_dir`` below a sweep folder: :func:`launch_folder`), ``adhoc/<that folder's
    name>`` (``harness run -m`` writes ``multirun/adhoc/<time>/``: one group per launch); else
    ``adhoc``."""
    named = name_of(sweep) or name_of(experiment)
    if named:
        return named
    folder = launch_folder(run_dir) if run_dir is not None else None
    return f"{ADHOC_GROUP}/{folder.name}" if folder is not None else ADHOC_GROUP


#: W&B refuses a run whose tags are longer than this (its settings' validation, at start)
MAX_TAG_CHARS = 64


def fit_tag(tag: str) -> str:
    """``tag`` as W&B takes it: up to :data:`MAX_TAG_CHARS` characters as it is; a longer one (a hub
    id and dtype as the model's label) cut, with ``~`` and 8 hex digits of its whole text's SHA-256 so
    that two long tags with a common start stay apart (the whole value is in the run's config)."""
    if len(tag) <= MAX_TAG_CHARS:
        return tag
    digest = hashlib.sha256(tag.encode()).hexdigest()[:8]
    return f"{tag[: MAX_TAG_CHARS - 9]}~{digest}"


def axis_tags(axes: Mapping[str, Any]) -> list[str]:
    """``["proposer=rest", "temperature=0.7", ...]`` in the fixed axis order, then any extra (each fit
    to W&B's tag length by :func:`fit_tag`)."""
    keys = [k for k in AXES if k in axes] + sorted(k for k in axes if k not in AXES)
    return [fit_tag(f"{k}={axes[k]}") for k in keys]


def status_tags(record: Mapping[str, Any]) -> list[str]:
    """Tags that set a run apart from gated exact runs: ``ungated``, ``gate-skipped:<gate>``,
    ``gate-failed:<gate>``, ``heuristic`` and ``cpu-budget-artifact``."""
    tags = [] if record_gated(record) else ["ungated"]
    for name, evidence in record.get("gates", {}).items():
        status = gate_status(evidence)
        if status in ("skipped", "failed"):
            tags.append(f"gate-{status}:{name}")
    if record.get("exact") is False:
        tags.append("heuristic")
    if record.get("metrics", {}).get("cpu_budget_artifact"):
        tags.append("cpu-budget-artifact")
    return [fit_tag(t) for t in tags]


def run_config(
    config: Mapping[str, Any],
    axes: Mapping[str, Any] | None,
    *,
    experiment: Any = None,
    sweep: Any = None,
    hardware: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The W&B run config: the axes, ``arm``, ``experiment`` and ``sweep`` as top-level keys, with
    ``machine`` (:func:`~harness.tracking.conventions.machine_label` of the record's ``hardware``
    card, where given: runs of one group timed on several machines are told apart); the resolved
    run config under ``resolved``."""
    out: dict[str, Any] = {}
    if axes:
        out.update({k: axes[k] for k in AXES if k in axes})
        if all(k in axes for k in ("proposer", "topology", "verifier", "temperature", "batch_size")):
            out["arm"] = arm_name(axes)
    if hardware:
        out["machine"] = machine_label(hardware)
    out["experiment"] = experiment if experiment is not None else config.get("experiment")
    out["sweep"] = sweep if sweep is not None else config.get("sweep")
    out["resolved"] = dict(config)
    return out


def _artifact_name(run_id: str) -> str:
    # W&B artifact names: letters, digits, dashes, underscores and dots
    return "record-" + re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)


#: the suffix of a record artifact entry that holds the content hash of the file ``<key>`` names
#: (:meth:`harness.prepare.sequoia.SequoiaArtifacts.paths`: ``sequoia_tree`` and ``sequoia_tree_hash``)
HASH_SUFFIX = "_hash"


def artifact_entries(artifacts: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """``(files, values)`` of a record's ``artifacts``: the entries that name a file or folder (an
    absolute path; a relative one, as older records hold, is read by :func:`record_artifact_path`),
    and those that name none: a content hash
    (``<key>_hash``, beside the ``<key>`` whose file it hashes; None where the artifact had none) or
    any other value that is no path string. An artifact's manifest (a mapping: trained heads) is
    neither: record.json holds it."""
    files, values = {}, {}
    for name, value in artifacts.items():
        if isinstance(value, Mapping):
            continue
        if isinstance(value, str) and not str(name).endswith(HASH_SUFFIX):
            files[str(name)] = value
        else:
            values[str(name)] = value
    return files, values


def round_steps(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The round series' history steps: one per verify forward. At batch 1 a step is a request's round
    (``round/prompt`` its prompt). At B > 1 the requests decoded together share each round's forward
    (the round series holds one row per request, the shared stages in full in each), so a step is the
    batch round: ``round/batch`` and ``round/turn`` say which, ``round/live_requests`` how many
    requests it served; committed tokens and candidate rows are summed over them, the accepted length
    is their mean, and each ``round/<stage>_ms`` (the stages every row times) sums the requests' own
    stage and counts a shared one once. ``round/ms`` is the round's wall time from the rows' ``ms``
    whatever stages they time: a request's row's at batch 1 (or a batch round left one live request),
    at B > 1 the rows' summed with the shared stages each row holds in full counted once (absent
    where the rows lack those shared stages' times)."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for row in rows:
        key = (row.get("batch_index", row["prompt_index"]), row.get("turn", 1), row["round"])
        groups.setdefault(key, []).append(row)
    batched = any(len(g) > 1 for g in groups.values()) or len({r["prompt_index"] for r in rows}) > len(
        {k[0] for k in groups}
    )
    steps = []
    for k, ((batch, turn, _), group) in enumerate(sorted(groups.items(), key=lambda kv: kv[0])):
        stages = {
            stage: (group[0][f"{stage}_ms"] if stage in SHARED_ROUND_STAGES else sum(r[f"{stage}_ms"] for r in group))
            for stage in ROUND_COST_STAGES
            if all(f"{stage}_ms" in r for r in group)
        }
        step = {"round": k}
        if batched:
            step.update({"round/batch": batch, "round/turn": turn, "round/live_requests": len(group)})
        else:
            step["round/prompt"] = group[0]["prompt_index"]
        step.update(
            {
                "round/committed_tokens": sum(r["committed"] for r in group),
                "round/accepted_length": sum(r["accepted"] for r in group) / len(group),
                "round/candidate_rows": sum(r["candidate_rows"] for r in group),
            }
        )
        wall = _round_wall_ms(group)
        if wall is not None:
            step["round/ms"] = wall
        step.update({f"round/{stage}_ms": ms for stage, ms in stages.items()})
        steps.append(step)
    return steps


def _round_wall_ms(group: Sequence[Mapping[str, Any]]) -> float | None:
    """One round's wall time from its rows' ``ms``: the one row's, or the rows' summed less the
    shared stages (:data:`SHARED_ROUND_STAGES`, held in full in every row) counted once; None where
    the rows of a batch round lack a shared stage's time."""
    if len(group) == 1:
        return group[0]["ms"]
    if not all(f"{stage}_ms" in r for r in group for stage in SHARED_ROUND_STAGES):
        return None
    shared = sum(group[0][f"{stage}_ms"] for stage in SHARED_ROUND_STAGES)
    return sum(r["ms"] for r in group) - (len(group) - 1) * shared


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


#: the per-prompt table's columns: each prompt's figures summed over its turns, both arms
PER_PROMPT_COLUMNS = (
    "prompt_id",
    "category",
    "turns",
    "spec_tokens",
    "spec_decode_ms",
    "ar_tokens",
    "ar_decode_ms",
    "decode_speedup",
    "spec_prefill_ms",
    "ar_prefill_ms",
    "spec_rounds",
    "cut_tokens",
)


def per_prompt_rows(record: Mapping[str, Any]) -> list[list[Any]]:
    """One row per prompt of the record (:data:`PER_PROMPT_COLUMNS`); ``decode_speedup`` is the
    prompt's AR decode ms per token over its speculative one (None where either arm made no token)."""
    rows = []
    for p in record["per_prompt"]:
        spec_tok, ar_tok = p.get("spec_tokens") or 0, p.get("ar_tokens") or 0
        spec_ms, ar_ms = p.get("spec_decode_ms"), p.get("ar_decode_ms")
        speedup = (ar_ms / ar_tok) / (spec_ms / spec_tok) if spec_tok and ar_tok and spec_ms and ar_ms else None
        rows.append(
            [
                str(p["prompt_id"]),
                str(p.get("category")),
                len(p.get("turns") or []) or 1,
                spec_tok,
                spec_ms,
                ar_tok,
                ar_ms,
                speedup,
                p.get("spec_prefill_ms"),
                p.get("ar_prefill_ms"),
                p.get("spec_rounds"),
                p.get("cut_tokens"),
            ]
        )
    return rows


class NullTracker:
    """``tracking=none``: the same interface, nothing logged anywhere."""

    run = None

    def log_record(self, record: Mapping[str, Any], run_dir: str | Path) -> None:
        validate_record(dict(record))

    def describe(self) -> dict[str, Any] | None:
        return None

    def fail(self, *, stage: str, error: BaseException, refused: bool, earlier_set_aside: bool = False) -> None:
        return None

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

    def __init__(self, run: Any, *, run_dir: Path, requested_mode: str, fallback: str | None = None) -> None:
        self.run = run
        self.run_dir = run_dir
        self.requested_mode = requested_mode
        self.fallback = fallback  # why an online run logs offline, or None
        self._finished = False

    # -- what the record says about its W&B run ---------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The ``tracking`` entry of the record: where this run's W&B log is and how to upload it."""
        run = self.run
        sync_dir = Path(run.settings.sync_dir)
        try:
            rel = sync_dir.resolve().relative_to(self.run_dir.resolve()).as_posix()
        except ValueError:
            rel = str(sync_dir)
        mode = "offline" if run.settings._offline else "online"
        out = {
            "backend": "wandb",
            "mode": mode,
            "requested_mode": self.requested_mode,
            "project": run.project,
            "entity": run.entity or None,
            "run_id": run.id,
            "name": run.name,
            "group": run.group or None,
            "job_type": run.job_type or None,
            "dir": rel,
        }
        if mode == "offline":
            out["sync"] = sync_command(rel)
        if self.fallback:
            out["fallback"] = self.fallback
        return out

    # -- logging -------------------------------------------------------------------------------

    def log_record(self, record: Mapping[str, Any], run_dir: str | Path) -> None:
        """Config, tags, summary, history series, tables and the record artifact; then finish."""
        if self._finished:
            raise RuntimeError("log_record after finish: the W&B run is already closed")
        record = validate_record(dict(record))
        run_dir = Path(run_dir)
        run = self.run

        run.config.update(
            run_config(
                record["config"],
                record["axes"],
                experiment=record["experiment"],
                sweep=record["sweep"],
                hardware=record.get("hardware"),
            ),
            allow_val_change=True,
        )
        tags = list(run.tags or ())
        run.tags = tuple(tags + [t for t in axis_tags(record["axes"]) + status_tags(record) if t not in tags])

        gates = record["gates"]
        summary: dict[str, Any] = dict(record["metrics"])
        summary.update(
            run_id=record["run_id"],
            experiment=record["experiment"],
            sweep=record["sweep"],
            exact=record["exact"],
            manifest_hash=record["manifest_hash"],
            gated=record_gated(record),
            gates_passed=sorted(n for n, g in gates.items() if gate_status(g) == "passed"),
            gates_skipped=sorted(n for n, g in gates.items() if gate_status(g) == "skipped"),
            outcome="finished",
        )
        files, values = artifact_entries(record["artifacts"])
        # the content hashes of the artifact files the run used (a record value of that name wins)
        summary.update({k: v for k, v in values.items() if k not in summary})

        self._log_series(record, run_dir)
        self._log_tables(record)
        run.summary.update(summary)  # after the history: a series never stands in for a record value
        self._log_artifact(record, run_dir, files)
        self.finish(exit_code=0)

    def _log_series(self, record: Mapping[str, Any], run_dir: Path) -> None:
        run = self.run
        # three x axes (round, depth, verify rows), each with its series; none of them is a summary value
        for step, series in (("round", "round/*"), ("depth", "depth/*"), ("verify_rows", "t_profile/*")):
            run.define_metric(step, hidden=True, summary="none")
            run.define_metric(series, step_metric=step, summary="none")

        series = record.get("round_series") or {}
        rounds_path = run_dir / series.get("file", ROUNDS_FILENAME)
        if series and not rounds_path.is_file():
            raise FileNotFoundError(f"{rounds_path}: the record's round series file is missing")
        if rounds_path.is_file():
            for step in round_steps(_read_jsonl(rounds_path)):
                run.log(step)

        for row in depth_rows(record["metrics"], min_rounds=MIN_DEPTH_ROUNDS):
            step = {"depth": row["depth"]}
            if row["acceptance"] is not None:
                key = "depth/acceptance" if row["enough"] is not False else "depth/acceptance_few_rounds"
                step[key] = row["acceptance"]
            for name in ("reach", "tried", "accepted", "acceptance_low", "acceptance_high", "reach_low", "reach_high"):
                if row[name] is not None and not (name == "tried" and row[name] == 0):  # a log axis has no zero:
                    step[f"depth/{'rounds_' + name if name in ('tried', 'accepted') else name}"] = row[
                        name
                    ]  # line ends
            run.log(step)

        profile = record.get("t_profile")
        if profile:
            floors = profile.get("floor_ms") or [None] * len(profile["n"])
            for n, t, floor in zip(profile["n"], profile["t"], floors, strict=True):
                run.log({"verify_rows": n, "t_profile/t_ms": t, **({"t_profile/floor_ms": floor} if floor else {})})

    def _log_tables(self, record: Mapping[str, Any]) -> None:
        import wandb  # imported on use (see log_record)

        metrics = record["metrics"]
        columns = ["depth", "acceptance_conditional", "reach_marginal", "rounds_tried", "rounds_accepted"]
        columns += ["acceptance_low", "acceptance_high", "enough_rounds"]
        depth_table = [
            [
                r["depth"],
                r["acceptance"],
                r["reach"],
                r["tried"],
                r["accepted"],
                r["acceptance_low"],
                r["acceptance_high"],
                r["enough"],
            ]
            for r in depth_rows(metrics, min_rounds=MIN_DEPTH_ROUNDS)
        ]
        hist = metrics["accepted_length_hist"]
        total = sum(hist) or 1
        cost = metrics["round_cost_ms"]
        stages = [s for s in ROUND_COST_STAGES if s in cost] + sorted(s for s in cost if s not in ROUND_COST_STAGES)
        round_ms = sum(float(cost[s] or 0.0) for s in stages) or 1.0
        self.run.log(
            {
                "acceptance_by_depth_table": wandb.Table(columns=columns, data=depth_table),
                "accepted_length_hist_table": wandb.Table(
                    columns=["accepted_tokens", "rounds", "fraction"],
                    data=[[k, n, n / total] for k, n in enumerate(hist)],
                ),
                "round_cost_table": wandb.Table(
                    columns=["stage", "ms_per_round", "share"],
                    data=[[s, cost[s], float(cost[s] or 0.0) / round_ms] for s in stages],
                ),
                "per_prompt_table": wandb.Table(columns=list(PER_PROMPT_COLUMNS), data=per_prompt_rows(record)),
            }
        )

    def _log_artifact(self, record: Mapping[str, Any], run_dir: Path, files: Mapping[str, str]) -> None:
        """The record artifact: the job's files and ``files`` (:func:`artifact_entries`)."""
        import wandb  # imported on use (see log_record)

        artifact = wandb.Artifact(
            _artifact_name(record["run_id"]),
            type="run-record",
            metadata={"run_id": record["run_id"], "manifest_hash": record["manifest_hash"]},
        )
        if not (run_dir / RECORD_FILENAME).is_file():
            raise FileNotFoundError(f"{run_dir / RECORD_FILENAME}: write the record before logging it")
        for name in (RECORD_FILENAME, OUTPUTS_FILENAME, ROUNDS_FILENAME):
            if (run_dir / name).is_file():
                artifact.add_file(str(run_dir / name), name=name)
        for name, given in files.items():
            try:
                path = record_artifact_path(given, run_dir)
            except FileNotFoundError as exc:
                where = "" if Path(given).is_absolute() else f": {exc}"  # a relative path: where it was looked for
                raise FileNotFoundError(
                    f"record artifact {name!r} points to {given}, which does not exist{where}"
                ) from None
            if path.is_dir():
                artifact.add_dir(str(path), name=f"artifacts/{name}")
            else:
                artifact.add_file(str(path), name=f"artifacts/{name}/{path.name}")
        self.run.log_artifact(artifact)

    # -- lifecycle -----------------------------------------------------------------------------

    def fail(self, *, stage: str, error: BaseException, refused: bool, earlier_set_aside: bool = False) -> None:
        """Finish a job that raised: exit code 1 (state *failed*), tagged ``interrupted`` (Ctrl-C, a
        scheduler's SIGINT), ``refused`` or ``failed``, with the stage and the error in the summary;
        ``earlier_set_aside`` (a failed gate, whose evidence refutes the folder's earlier record, or a
        record of another manifest a sweep job leaves aside) says so as ``earlier_record: set_aside``,
        so the runs this one ``replaces`` are superseded all the same. Idempotent."""
        if self._finished:
            return
        outcome = "interrupted" if isinstance(error, KeyboardInterrupt) else "refused" if refused else "failed"
        tags = list(self.run.tags or ())
        self.run.tags = tuple(tags + [outcome] if outcome not in tags else tags)
        message = f"{type(error).__name__}: {error}"
        summary = {"outcome": outcome, "failure_stage": stage, "error": message[:1000]}
        if earlier_set_aside:
            summary["earlier_record"] = "set_aside"
        self.run.summary.update(summary)
        self.finish(exit_code=1)

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
        if exc is not None and not self._finished:
            self.fail(stage="unknown", error=exc, refused=False)
        self.finish(exit_code=0 if exc_type is None else 1)
        return False


#: characters W&B refuses in a project or entity name, and its longest project name
_BAD_NAME_CHARS = set("/\\#?%:")
MAX_PROJECT_CHARS = 128
#: the values W&B reads from ``WANDB_MODE``
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")


#: the environment variables naming folders W&B writes into (not ``WANDB_DIR``: a run's ``wandb/``
#: goes into its own folder, given to W&B as ``dir``, whatever the environment says)
WANDB_FOLDERS = ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR")


class TrackingError(ValueError):
    """W&B could not start a run (a refusal: its message is one line naming what to change)."""


def tracking_problem(project: Any, entity: Any = None, environ: Mapping[str, str] | None = None) -> str | None:
    """Why a W&B run with this project and entity cannot start here (one line naming the option or
    the environment variable), or None: names W&B refuses, a ``WANDB_MODE`` it does not know, a
    ``WANDB_BASE_URL`` that is no http(s) address. Checked before any model work."""
    environ = os.environ if environ is None else environ
    for key, value in (("tracking.project", project), ("tracking.entity", entity)):
        if value is None and key == "tracking.entity":
            continue
        text = str(value if value is not None else "")
        bad = sorted(set(text) & _BAD_NAME_CHARS)
        if not text.strip():
            default = (
                f"the default project is {DEFAULT_PROJECT!r}" if key == "tracking.project" else "or null: your default"
            )
            return f"{key} is empty: W&B needs a name ({default})"
        if bad:
            return f"{key}={text}: W&B names cannot hold {' '.join(bad)}"
        if len(text) > MAX_PROJECT_CHARS:
            return f"{key} has {len(text)} characters: W&B allows at most {MAX_PROJECT_CHARS}"
    mode = environ.get("WANDB_MODE")
    if mode and mode not in WANDB_MODES:
        return f"WANDB_MODE={mode} in the environment is no W&B mode ({', '.join(WANDB_MODES)}); unset it"
    for var in WANDB_FOLDERS:  # W&B writes there while it logs: a folder it cannot write fails after the run
        folder = environ.get(var)
        if folder and (problem := output_folder_problem(var, folder)):
            return f"{problem} (in the environment; W&B writes there)"
    url = environ.get("WANDB_BASE_URL")
    if url:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            return f"WANDB_BASE_URL={url} in the environment is no http(s) address; unset it or fix it"
    return None


def environment_notes(mode: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """What W&B's environment asks that ``tracking.mode`` overrides (the harness passes its mode
    explicitly), as lines for the run's start."""
    environ = os.environ if environ is None else environ
    notes = []
    if environ.get("WANDB_MODE") and environ["WANDB_MODE"] != mode:
        notes.append(f"WANDB_MODE={environ['WANDB_MODE']} is set, but tracking.mode={mode} decides: it logs {mode}")
    if str(environ.get("WANDB_DISABLED", "")).lower() in ("true", "1", "yes"):
        notes.append(f"WANDB_DISABLED is set, but tracking=wandb asks for a run: it logs {mode}")
    return notes


#: the links W&B keeps in a ``wandb/`` folder to its newest run's folder and that run's logs
WANDB_LINKS = ("latest-run", "debug.log", "debug-internal.log")


def drop_dangling_links(wandb_dir: str | Path) -> None:
    """Remove W&B's links in ``wandb_dir`` (:data:`WANDB_LINKS`) whose run folder is gone, and the
    folder itself once nothing is left in it."""
    wandb_dir = Path(wandb_dir)
    for name in WANDB_LINKS:
        link = wandb_dir / name
        if link.is_symlink() and not link.exists():
            link.unlink(missing_ok=True)
    try:
        if wandb_dir.is_dir() and not wandb_dir.is_symlink() and not any(wandb_dir.iterdir()):
            wandb_dir.rmdir()
    except OSError:  # filled meanwhile, or not ours to remove
        pass


def discard_offline_run(tracker: Tracker) -> None:
    """Remove an offline run's folder after its logging failed, so a later log of the same record
    (same run id) is the only one a ``wandb sync`` uploads."""
    try:
        if tracker.run.settings._offline:
            sync_dir = Path(tracker.run.settings.sync_dir)
            shutil.rmtree(sync_dir, ignore_errors=True)
            drop_dangling_links(sync_dir.parent)  # W&B's links to its newest run folder, now gone
    except Exception:  # the run may be half made; nothing to remove then
        pass


def sync_command(sync_dir: str | Path) -> str:
    """The shell command that uploads the offline run in ``sync_dir`` (quoted: a job folder is named
    by its overrides, quotes, spaces and commas included)."""
    return f"wandb sync {shlex.quote(str(sync_dir))}"


def discard_offline_runs(run_dir: str | Path, run_id: str, *, keep: str | Path | None = None) -> list[Path]:
    """Remove the offline runs of ``run_id`` in ``run_dir/wandb/`` but ``keep`` (the run that now holds
    the record: a log a job killed while W&B logged it left, or one its record was never written again
    to name, goes), so that one run of the id is what a ``wandb sync`` uploads; returns the folders
    removed."""
    wandb_dir = Path(run_dir) / "wandb"
    wanted = _ID_CHARS.sub("_", str(run_id))
    kept = Path(keep).resolve() if keep is not None else None
    removed = []
    for folder in sorted(wandb_dir.glob("offline-run-*")):
        if folder.is_symlink() or not folder.is_dir() or folder.resolve() == kept:
            continue
        if folder.name.split("-", 3)[3:] == [wanted]:  # offline-run-<YYYYMMDD_HHMMSS>-<run id>
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        drop_dangling_links(wandb_dir)
    return removed


def base_url() -> str:
    """The W&B server this process talks to (``WANDB_BASE_URL``, else W&B's public server)."""
    return os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL


def unreachable(url: str, *, timeout_s: float = 5.0) -> str | None:
    """Why the server at ``url`` cannot be reached (DNS, refused, timed out), or None.

    A TCP connection to the server's host and port; behind an HTTP proxy nothing is probed
    (W&B's own timeout then decides)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return None
    parsed = urlparse(url)
    host = parsed.hostname
    if not host:
        return f"not a server address: {url!r}"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


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
    job_type: str | None = None,
    run_id: str | None = None,
    axes: Mapping[str, Any] | None = None,
    system_metrics: bool = True,
    system_metrics_interval_s: float = 5.0,
    init_timeout_s: float = 90.0,
    replaces: Sequence[str] = (),
) -> Tracker:
    """Start one W&B run for a job.

    ``replaces``: the W&B run ids of the earlier records this job's record replaces in its folder
    (config ``replaces``): publishing the dashboard tags those runs ``superseded`` once this run has
    finished (:func:`~harness.tracking.dashboard.mark_superseded`), so no panel counts an arm twice.

    ``record_or_config``: a finished record (its axes, run id, sweep and experiment are used) or
    the resolved run config (dict or OmegaConf) with ``axes`` and ``run_id`` given. ``group``
    defaults to the sweep, else the experiment; ``adhoc`` for a job that names neither becomes its
    launch's group when ``dir`` is below a multirun's sweep folder (:func:`wandb_group`); ``name``
    and ``job_type`` default to the run name and the arm of the axes; ``tags`` default to
    ``axis=value`` per axis; ``dir`` is where ``wandb/`` is written (the run folder; default: the
    working directory).

    ``mode="online"`` first checks that the server can be reached; when it cannot, or when
    ``wandb.init`` fails online (no credentials, a timeout), the run is opened offline and one
    line on stderr says why and how to upload it later.
    """
    import wandb  # imported on use: 1.05 s at import, and tracking is optional

    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}; got {mode!r}")
    obj = _to_container(record_or_config)
    if _is_record(obj):
        config = _to_container(obj["config"])
        axes = axes or obj["axes"]
        run_id = run_id or obj.get("run_id")
        experiment, sweep = obj.get("experiment"), obj.get("sweep")
    else:
        config = obj
        experiment, sweep = config.get("experiment"), config.get("sweep")
    group = group or name_of(sweep) or name_of(experiment)
    run_dir = Path(dir) if dir is not None else Path.cwd()
    if group == ADHOC_GROUP and not (name_of(sweep) or name_of(experiment)):  # an unnamed multirun's job:
        group = wandb_group(sweep, experiment, run_dir)  # its launch's own group
    if axes:
        name = name or run_name(axes)
        job_type = job_type or arm_name(axes)
        tags = list(tags) if tags is not None else axis_tags(axes)
    tags = [fit_tag(str(t)) for t in tags or []]
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")

    def init(run_mode: str) -> Any:
        return wandb.init(
            project=project,
            entity=entity,
            group=group,
            job_type=job_type,
            tags=tags,
            name=name,
            id=_ID_CHARS.sub("_", run_id) if run_id else None,
            config={
                **run_config(config, axes, experiment=experiment, sweep=sweep),
                **({"replaces": [_ID_CHARS.sub("_", r) for r in replaces]} if replaces else {}),
            },
            dir=str(run_dir),
            mode=run_mode,
            reinit="create_new",
            settings=wandb.Settings(
                silent=True,
                console="off",
                x_disable_stats=not system_metrics,
                x_stats_sampling_interval=float(system_metrics_interval_s),
                x_stats_pid=os.getpid(),
                save_code=False,
                disable_git=True,
                init_timeout=float(init_timeout_s),
            ),
        )

    wandb_dir = run_dir / "wandb"
    offline_before = set(wandb_dir.glob("offline-run-*"))

    def opened(run_mode: str, fallback: str | None = None) -> Tracker:
        """The run, opened; where opening it stopped part way (Ctrl-C while W&B starts, an error), no
        offline run of it is left: W&B would end it "finished" at exit, with the arm's name and tags
        and none of its data, and a ``wandb sync`` of the folder would upload it."""
        try:
            run = init(run_mode)
            if fallback:
                rel = Path(run.settings.sync_dir)
                print(
                    f"harness: {fallback}; this run logs offline to {rel}; upload it later with `{sync_command(rel)}`",
                    file=sys.stderr,
                )
            return Tracker(run, run_dir=run_dir, requested_mode=mode, fallback=fallback)
        except BaseException:
            for folder in set(wandb_dir.glob("offline-run-*")) - offline_before:
                shutil.rmtree(folder, ignore_errors=True)
            drop_dangling_links(wandb_dir)
            raise

    if mode == "online":
        url = base_url()
        problem = unreachable(url)
        if problem is None:
            try:
                return opened("online")
            except Exception as exc:  # no credentials, a refused key, a timeout: keep the run offline
                problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        return opened("offline", fallback=f"W&B server {url} not usable ({problem})")
    return opened(mode)


def tracker_from_config(
    config: Any,
    *,
    run_dir: str | Path,
    group: str | None = None,
    axes: Mapping[str, Any] | None = None,
    run_id: str | None = None,
) -> Tracker | NullTracker:
    """The tracker a run config asks for.

    ``tracking`` may be ``None`` / ``"none"`` / ``{name: none}`` (no tracker), ``"wandb"`` or
    ``{name: wandb, mode: offline|online, project, entity, system_metrics,
    system_metrics_interval_s, init_timeout_s}``. ``group`` (the sweep name, which the runner knows
    before the record exists) wins over the config's ``sweep``, then its ``experiment``.
    """
    cfg = _to_container(config)
    tracking = cfg.get("tracking")
    kind = name_of(tracking) if tracking is not None else "none"
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
        axes=axes,
        run_id=run_id,
        system_metrics=bool(opts.get("system_metrics", True)),
        system_metrics_interval_s=float(opts.get("system_metrics_interval_s", 5.0)),
        init_timeout_s=float(opts.get("init_timeout_s", 90.0)),
    )
