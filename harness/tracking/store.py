"""Run records and the results store.

Every run writes ``<run_dir>/outputs.jsonl`` and then ``<run_dir>/record.json`` (each atomically;
the record last, binding the outputs by their SHA-256 under ``outputs``:
:mod:`harness.tracking.job_folder`). This module reads those records back:

* :func:`load_record` validates one record (schema version, required keys, the types of the
  fields that compare, report and export compute with, down to the elements of their lists) and
  raises :class:`RecordError` naming the file, the key, the expected and the actual value; a
  record with a failed gate is refused (a failed gate stops its run before any record is written).
* :func:`aggregate` flattens every complete job's ``record.json`` under a folder (a sweep folder)
  into one pandas row per run: a record whose bound ``outputs.jsonl`` or ``rounds.jsonl`` is missing
  or differs (:func:`job_files_problem`) is left out with a warning, and so is everything under a hidden
  folder (``.previous/``, where a re-run job's earlier files were moved); :func:`write_store`
  writes that frame to Parquet (pyarrow);
  :func:`rebuild_store` does both. The store holds nothing the records do not: delete it and
  rebuild it.
* :func:`read_results` gives reports and comparisons one entry point: a records folder or a
  ``.parquet`` store, refused as stale where its folder's jobs are no longer the ones it counts
  (:func:`stale_rows`, :func:`unstored_records`, :func:`changed_output_rows`).

Column layout of the store (one row per run):

* top-level fields: ``run_id``, ``experiment``, ``sweep``, ``created_at``, ``exact``,
  ``manifest_hash``, ``schema_version``;
* derived bookkeeping: ``record_dir`` (the run folder, relative to the records root),
  ``gated`` (every gate passed or does not apply: :mod:`harness.record_schema`), ``section``
  (``exact`` / ``ungated`` / ``heuristic`` / ``cpu_budget_artifact``, see :func:`section_of`);
* the axes as bare columns: ``proposer``, ``topology``, ``verifier``, ``temperature``,
  ``batch_size``, ``workload``, ``model``;
* the metrics under their record names (``speedup``, ``time_per_committed_token_ms``, ...);
  dict-valued metrics are flattened with dots (``round_cost_ms.target_verify``);
* ``config.*``, ``hardware.*``, ``artifacts.*``: dotted flattening of those record fields;
* list-valued fields (``acceptance_by_depth``, ``per_prompt``, ``gates``, ``t_profile``, ...)
  are JSON strings, so that Parquet round-trips them whatever their element types; decode them
  with :func:`json_column`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from harness.files import (  # noqa: F401
    OUTPUTS_FILENAME,
    RECORD_FILENAME,
    ROUNDS_FILENAME,
    file_sha256,
    plain_file_mode,
    temporary_sibling,
)
from harness.record_schema import GATES, ROUND_COST_STAGES, STATUSES, is_gated, is_gated_v1, status_of  # noqa: F401

SCHEMA_VERSION = 2
#: schema 1 records (before per-gate statuses and ``gated``) are still read: a gate recorded
#: without a status counts as passed only when it says so, so such runs are usually ungated
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
#: a sweep folder's jobs that wrote no record: one JSON line each (job, stage, refused, error)
FAILURES_FILENAME = "failures.jsonl"
#: the stage of a failures file's line for a job its launch planned and, cut short, never started
NOT_STARTED = "not started"

REQUIRED_TOP_LEVEL: tuple[str, ...] = (
    "schema_version",
    "run_id",
    "experiment",
    "sweep",
    "created_at",
    "exact",
    "gates",
    "config",
    "manifest_hash",
    "axes",
    "metrics",
    "per_prompt",
    "hardware",
    "artifacts",
)
OPTIONAL_TOP_LEVEL: tuple[str, ...] = ("t_profile", "round_series", "tracking", "outputs")

#: the keys of one row of ``rounds.jsonl`` (plus ``<stage>_ms`` per round-cost stage)
ROUND_KEYS: tuple[str, ...] = (
    "prompt_index",
    "batch_index",
    "round",
    "accepted",
    "committed",
    "candidate_rows",
    "tree_depth",
    "ms",
)
GATE_STATUSES: tuple[str, ...] = ("passed", "failed", "skipped", "not_applicable")

AXES: tuple[str, ...] = (
    "proposer",
    "topology",
    "verifier",
    "temperature",
    "batch_size",
    "workload",
    "model",
)

REQUIRED_METRICS: tuple[str, ...] = (
    "time_per_committed_token_ms",
    "ar_time_per_token_ms",
    "speedup",
    "ttft_ms",
    "ar_ttft_ms",
    "committed_tokens",
    "rounds",
    "mean_committed_per_round",
    "acceptance_by_depth",
    "reach_by_depth",
    "accepted_length_hist",
    "first_child_coverage",
    "fallback_rate",
    "round_cost_ms",
    "temp_kv_bytes_peak",
    "temp_kv_bytes_formula",
    "proposal_state_bytes",
    "peak_rss_bytes",
    "greedy_identical",
    "greedy_near_ties",
    "throughput_tokens_per_s",
    "itl_ms_p50",
    "itl_ms_p95",
    "concurrent_jobs",
    "torch_threads",
    "cpu_budget_artifact",
)

PER_PROMPT_KEYS: tuple[str, ...] = (
    "prompt_id",
    "category",
    "spec_decode_ms",
    "spec_tokens",
    "ar_decode_ms",
    "ar_tokens",
)

#: the per-prompt figures every record holds, each a finite number >= 0
_PER_PROMPT_NUMBERS: tuple[str, ...] = ("spec_decode_ms", "spec_tokens", "ar_decode_ms", "ar_tokens")
#: per-prompt figures older records lack (null or absent there), each a finite number >= 0 where present
_PER_PROMPT_OPTIONAL_NUMBERS: tuple[str, ...] = ("spec_prefill_ms", "ar_prefill_ms", "spec_rounds", "ar_rounds")

#: sections that comparisons and reports keep apart.
SECTIONS: tuple[str, ...] = ("exact", "ungated", "heuristic", "cpu_budget_artifact")

_JSON_FIELDS: tuple[str, ...] = ("per_prompt", "gates", "t_profile")


log = logging.getLogger("harness.store")


class RecordError(ValueError):
    """A run record is missing, malformed, or of an unknown schema version."""


def gate_status(evidence: Mapping[str, Any]) -> str:
    """A gate's outcome: its ``status`` when the record has one (passed, failed, skipped,
    not_applicable); a schema-1 entry's from its ``passed`` and ``skipped`` (:func:`status_of`)."""
    return status_of(evidence)


# --------------------------------------------------------------------------------------------
# one record


def _require_keys(path: Path, where: str, obj: Mapping[str, Any], keys: Iterable[str]) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise RecordError(f"{path}: {where} is missing required keys {missing}; has {sorted(obj)}")


def _require_type(path: Path, where: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise RecordError(f"{path}: {where} must be {names}; got {type(value).__name__} {value!r}")


def _is_count(value: Any) -> bool:
    """A whole number >= 0 (a bool is none)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_measure(value: Any) -> bool:
    """A finite number >= 0 (a bool is none)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


def _require_items(path: Path, where: str, items: list, check: Any, expected: str, *, none: bool = False) -> None:
    """Every element of the list ``items`` passes ``check`` (or is None, where ``none``)."""
    for i, value in enumerate(items):
        if not (check(value) or (none and value is None)):
            raise RecordError(
                f"{path}: {where}[{i}] must be {expected}{' or null' if none else ''}; "
                f"got {type(value).__name__} {value!r}"
            )


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _require_bound_file(path: Path, where: str, bound: Mapping[str, Any], *, hashed: bool) -> None:
    """A file a record binds (``outputs``, ``round_series``): ``file`` a plain file name in the record's
    folder (no path separator, not hidden), ``rows`` a whole number >= 0 and, where ``hashed``,
    ``sha256`` 64 lowercase hex digits."""
    name = bound["file"]
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise RecordError(
            f"{path}: {where}.file must be a file name in the record's folder; got {type(name).__name__} {name!r}"
        )
    if not _is_count(bound["rows"]):
        raise RecordError(
            f"{path}: {where}.rows must be a whole number >= 0; got {type(bound['rows']).__name__} {bound['rows']!r}"
        )
    digest = bound.get("sha256")
    if hashed and not (isinstance(digest, str) and _SHA256_HEX.fullmatch(digest)):
        raise RecordError(
            f"{path}: {where}.sha256 must be a SHA-256 digest (64 lowercase hex digits); "
            f"got {type(digest).__name__} {digest!r}"
        )


def validate_record(record: Any, *, path: Path | str = "<record>") -> dict[str, Any]:
    """Check a record dict in memory; returns it unchanged or raises :class:`RecordError`."""
    path = Path(path)
    _require_type(path, "the record", record, dict)
    if "schema_version" not in record:
        raise RecordError(f"{path}: no schema_version; expected schema_version {SCHEMA_VERSION}")
    if record["schema_version"] not in SUPPORTED_SCHEMA_VERSIONS:
        raise RecordError(
            f"{path}: unsupported schema_version; expected one of {list(SUPPORTED_SCHEMA_VERSIONS)}, "
            f"got {record['schema_version']!r}"
        )
    _require_keys(path, "the record", record, REQUIRED_TOP_LEVEL)
    _require_type(path, "run_id", record["run_id"], str)
    _require_type(path, "exact", record["exact"], bool)
    for name in ("gates", "config", "axes", "metrics", "hardware", "artifacts"):
        _require_type(path, name, record[name], dict)
    _require_keys(path, "axes", record["axes"], AXES)
    batch, temperature = record["axes"]["batch_size"], record["axes"]["temperature"]
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise RecordError(f"{path}: axes.batch_size must be a whole number >= 1; got {batch!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise RecordError(f"{path}: axes.temperature must be a finite number >= 0; got {temperature!r}")
    _require_keys(path, "metrics", record["metrics"], REQUIRED_METRICS)
    metrics = record["metrics"]
    _require_type(path, "metrics.cpu_budget_artifact", metrics["cpu_budget_artifact"], bool)
    for name in ("acceptance_by_depth", "reach_by_depth", "accepted_length_hist"):
        _require_type(path, f"metrics.{name}", metrics[name], list)
    for name in ("acceptance_by_depth", "reach_by_depth"):  # null: a depth no round reached
        _require_items(path, f"metrics.{name}", metrics[name], _is_measure, "a finite number >= 0", none=True)
    _require_items(
        path, "metrics.accepted_length_hist", metrics["accepted_length_hist"], _is_count, "a whole number >= 0"
    )
    _require_type(path, "metrics.round_cost_ms", metrics["round_cost_ms"], dict)
    _require_keys(path, "metrics.round_cost_ms", metrics["round_cost_ms"], ROUND_COST_STAGES)
    for gate, evidence in record["gates"].items():
        _require_type(path, f"gates.{gate}", evidence, dict)
        if record["schema_version"] == 1:
            _require_keys(path, f"gates.{gate}", evidence, ("passed",))
        elif evidence.get("status") not in STATUSES:
            raise RecordError(
                f"{path}: gates.{gate}.status must be one of {list(STATUSES)}; got {evidence.get('status')!r}"
            )
        if status_of(evidence) == "failed":
            raise RecordError(
                f"{path}: gates.{gate} failed: a failed gate stops its run before a record is written, so this is "
                "no record of a measured run; re-run it"
            )
    if record["schema_version"] >= 2:
        _require_keys(path, "gates", record["gates"], GATES)
        _require_type(path, "gated", record.get("gated"), bool)
        if record["gated"] != is_gated(record["gates"]):
            raise RecordError(f"{path}: gated={record['gated']} disagrees with its gate statuses")
    _require_type(path, "per_prompt", record["per_prompt"], list)
    if not record["per_prompt"]:
        raise RecordError(f"{path}: per_prompt is empty: a run records every prompt it measured, at least one")
    for i, row in enumerate(record["per_prompt"]):
        _require_type(path, f"per_prompt[{i}]", row, dict)
        _require_keys(path, f"per_prompt[{i}]", row, PER_PROMPT_KEYS)
        for key in ("prompt_id", "category"):  # a prompt's id and its category (the loader's "default")
            if not isinstance(row[key], str) or not row[key].strip():
                raise RecordError(f"{path}: per_prompt[{i}].{key} must be a non-empty string; got {row[key]!r}")
        for key in ("spec_tokens", "ar_tokens"):  # every round commits a token: a measured prompt has one at least
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RecordError(
                    f"{path}: per_prompt[{i}].{key} must be a whole number >= 1 (each arm generates a token at "
                    f"least; prompt {row['prompt_id']!r}); got {value!r}"
                )
        for key in (*_PER_PROMPT_NUMBERS, *_PER_PROMPT_OPTIONAL_NUMBERS):
            value = row.get(key)
            if key in _PER_PROMPT_OPTIONAL_NUMBERS and value is None:  # older records have none
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise RecordError(
                    f"{path}: per_prompt[{i}].{key} must be a finite number >= 0 (prompt {row.get('prompt_id')!r}); "
                    f"got {value!r}"
                )
    series = record.get("round_series")
    if series is not None:
        _require_type(path, "round_series", series, dict)
        _require_keys(path, "round_series", series, ("file", "rows"))
        _require_bound_file(path, "round_series", series, hashed="sha256" in series)  # older records hash none
    tracking = record.get("tracking")
    if tracking is not None:
        _require_type(path, "tracking", tracking, dict)
        _require_keys(path, "tracking", tracking, ("backend",))
    for name in ("rounds_tried_by_depth", "rounds_accepted_by_depth"):
        if metrics.get(name) is not None:
            _require_type(path, f"metrics.{name}", metrics[name], list)
            _require_items(path, f"metrics.{name}", metrics[name], _is_count, "a whole number >= 0")
    outliers = metrics.get("timing_outliers")
    if outliers is not None:  # older records have none
        _require_type(path, "metrics.timing_outliers", outliers, list)
        for i, entry in enumerate(outliers):
            where = f"metrics.timing_outliers[{i}]"
            _require_type(path, where, entry, dict)
            _require_keys(path, where, entry, ("prompt_id", "arm", "ratio"))
            if not _is_measure(entry["ratio"]):
                raise RecordError(f"{path}: {where}.ratio must be a finite number >= 0; got {entry['ratio']!r}")
    t_profile = record.get("t_profile")
    if t_profile is not None:
        _require_type(path, "t_profile", t_profile, dict)
        _require_keys(path, "t_profile", t_profile, ("n", "t"))
        for name in ("n", "t"):
            _require_type(path, f"t_profile.{name}", t_profile[name], list)
            _require_items(path, f"t_profile.{name}", t_profile[name], _is_measure, "a finite number >= 0")
        if len(t_profile["n"]) != len(t_profile["t"]):
            raise RecordError(
                f"{path}: t_profile n and t must have the same length; "
                f"got {len(t_profile['n'])} and {len(t_profile['t'])}"
            )
    outputs = record.get("outputs")
    if outputs is not None:
        _require_type(path, "outputs", outputs, dict)
        _require_keys(path, "outputs", outputs, ("file", "sha256", "rows"))
        _require_bound_file(path, "outputs", outputs, hashed=True)
    return record


def outputs_problem(record: Mapping[str, Any], folder: str | Path) -> str | None:
    """Why the outputs a record binds (``record["outputs"]``: file name and SHA-256) are not the
    ones in ``folder``; None when they are, or when the record binds none (written before records
    bound their outputs)."""
    bound = record.get("outputs")
    if bound is None:
        return None
    path = Path(folder) / bound["file"]
    if not path.is_file():
        return f"its {bound['file']} is missing"
    digest = file_sha256(path)
    if digest != bound["sha256"]:
        return (
            f"its {bound['file']} is not the one the record binds "
            f"(sha256 {digest[:12]}..., record {bound['sha256'][:12]}...)"
        )
    return None


def round_series_problem(record: Mapping[str, Any], folder: str | Path) -> str | None:
    """Why the round series a validated record names (``record["round_series"]``: file name, row count
    and SHA-256) is not the one in ``folder``; None when it is, or when the record names none. A record
    written before the series was bound by hash is checked for the file, its row count and that each
    row is JSON (a file cut short mid-row)."""
    series = record.get("round_series")
    if series is None:
        return None
    name = series["file"]
    path = Path(folder) / name
    if not path.is_file():
        return f"its {name} is missing"
    try:
        data = path.read_bytes()
        lines = [line for line in data.decode("utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        return f"its {name} cannot be read ({getattr(exc, 'strerror', None) or exc})"
    bound = series.get("sha256")
    if bound is not None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != bound:
            return f"its {name} is not the one the record binds (sha256 {digest[:12]}..., record {bound[:12]}...)"
    else:
        for number, line in enumerate(lines, 1):
            try:
                json.loads(line)
            except ValueError:
                return f"its {name} is cut short or edited (row {number} is not JSON)"
    if len(lines) != series["rows"]:
        return f"its {name} holds {len(lines)} rows, its record {series['rows']}"
    return None


def job_files_problem(record: Mapping[str, Any], folder: str | Path) -> str | None:
    """Why the files a validated record binds (its outputs, :func:`outputs_problem`, and its round
    series, :func:`round_series_problem`) are not the ones in ``folder``: a record with such a problem
    is no complete job. None when they are."""
    return outputs_problem(record, folder) or round_series_problem(record, folder)


def load_record(path: str | Path) -> dict[str, Any]:
    """Read and validate one ``record.json`` (a file, or the run folder holding it)."""
    path = Path(path)
    if path.is_dir() and path.name == RECORD_FILENAME:
        raise RecordError(f"{path}: a folder, where a run's record file belongs")
    if path.is_dir():
        path = path / RECORD_FILENAME
    if not path.is_file():
        raise RecordError(f"{path}: no such record file")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path}: not valid JSON ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise RecordError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise RecordError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    return validate_record(record, path=path)


def section_of(*, exact: bool, cpu_budget_artifact: bool, gated: bool = True) -> str:
    """Which section a run belongs to: ungated runs first, then inexact heuristics (whatever artifact
    they ran), then CPU-budget artifacts; only gated, exact runs with no CPU-budget artifact are
    ``exact``. A heuristic run is never pooled with exact ones, CPU-budget artifacts' included."""
    if not gated:
        return "ungated"
    if not exact:
        return "heuristic"
    if cpu_budget_artifact:
        return "cpu_budget_artifact"
    return "exact"


def record_gated(record: Mapping[str, Any]) -> bool:
    """A record's ``gated`` (recomputed from its gates for records written before it existed)."""
    if record.get("schema_version", SCHEMA_VERSION) == 1:
        return is_gated_v1(record["gates"], record.get("config"))
    return bool(record["gated"])


#: a re-run job's earlier files (``<job>/.previous/``): no current record lies there
PREVIOUS_DIR = ".previous"
#: folders no current record lies in: a job's earlier files, Hydra's and submitit's own
NOT_RECORD_FOLDERS = (PREVIOUS_DIR, ".hydra", ".submitit")


def _current(parts: tuple[str, ...]) -> bool:
    """Whether a record at ``parts`` (its path below the records root) is a current one: in none of
    :data:`NOT_RECORD_FOLDERS`, and in no hidden folder (a user's ``.bak/``) but one within a job
    folder's name: a sweep names a job's folder by its overrides, and a path value
    (``workload.path=/data/.prompts/p.jsonl``) spans folders below the part holding ``=``."""
    named = False
    for part in parts[:-1]:
        if part in NOT_RECORD_FOLDERS or (part.startswith(".") and not named):
            return False
        named = named or "=" in part
    return True


def iter_record_paths(records_root: str | Path) -> Iterator[Path]:
    """Every current ``record.json`` under ``records_root`` (:func:`_current`), in sorted path order."""
    root = Path(records_root)
    if not root.is_dir():
        raise RecordError(f"{root}: records root is not a folder")
    for path in sorted(root.rglob(RECORD_FILENAME)):
        if _current(path.relative_to(root).parts):
            yield path


def any_record_path(records_root: str | Path) -> Path | None:
    """A current ``record.json`` under ``records_root`` (the first the walk meets, the walk stopped
    there), or None."""
    root = Path(records_root)
    return next((p for p in root.rglob(RECORD_FILENAME) if _current(p.relative_to(root).parts)), None)


def record_below(folder: str | Path, *, max_folders: int = 2000) -> Path | None:
    """A current ``record.json`` in a folder below ``folder`` (its own ``record.json`` is not below
    it), looked for in at most ``max_folders`` folders (a walk of a large tree is cut short: None),
    or None."""
    root = Path(folder)
    for seen, (here, dirs, files) in enumerate(os.walk(root)):
        if seen >= max_folders:
            return None
        parts = Path(here).relative_to(root).parts
        if parts and RECORD_FILENAME in files and _current((*parts, RECORD_FILENAME)):
            return Path(here) / RECORD_FILENAME
        dirs[:] = sorted(d for d in dirs if d not in NOT_RECORD_FOLDERS)
    return None


# --------------------------------------------------------------------------------------------
# flattening


def _flatten(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    """Dicts are flattened with dots; lists are stored as JSON strings; scalars as they are."""
    if isinstance(obj, Mapping):
        if not obj and prefix:
            out[prefix] = json.dumps({})
        for key, value in obj.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), value, out)
    elif isinstance(obj, (list, tuple)):
        out[prefix] = json.dumps(list(obj))
    else:
        if isinstance(obj, float) and not math.isfinite(obj):
            obj = None  # "not measured" is None, never inf or NaN
        out[prefix] = obj


def flatten_record(record: Mapping[str, Any], *, record_dir: str = "") -> dict[str, Any]:
    """One store row from one validated record."""
    row: dict[str, Any] = {
        "run_id": record["run_id"],
        "experiment": record["experiment"],
        "sweep": record["sweep"],
        "created_at": record["created_at"],
        "exact": record["exact"],
        "manifest_hash": record["manifest_hash"],
        "harness_code": (record.get("manifest") or {}).get("harness_code"),
        "schema_version": record["schema_version"],
        "record_dir": record_dir,
        "gated": record_gated(record),
        "section": section_of(
            exact=record["exact"],
            cpu_budget_artifact=record["metrics"]["cpu_budget_artifact"],
            gated=record_gated(record),
        ),
    }
    for name in AXES:
        row[name] = record["axes"][name]
    metrics: dict[str, Any] = {}
    _flatten("", record["metrics"], metrics)
    clash = sorted(set(metrics) & set(row))
    if clash:
        raise RecordError(f"run {record['run_id']}: metric names clash with store columns {clash}")
    row.update(metrics)
    for name in ("config", "hardware", "artifacts"):
        _flatten(name, record[name], row)
    for name in _JSON_FIELDS:
        row[name] = json.dumps(record.get(name)) if record.get(name) is not None else None
    return row


#: the columns of an empty store
STORE_COLUMNS: tuple[str, ...] = (
    "run_id",
    "experiment",
    "sweep",
    "created_at",
    "exact",
    "record_dir",
    "section",
    "per_prompt",
    *AXES,
    *REQUIRED_METRICS,
)


def aggregate(records_root: str | Path, *, warn_if_none_left: bool = True) -> pd.DataFrame:
    """Flatten every complete job's ``record.json`` under ``records_root`` into one row per run.

    Raises :class:`RecordError` on an invalid record (naming its file) or on two records with
    the same ``run_id``; an empty folder gives an empty frame with the fixed columns. A record
    whose bound outputs or round series are missing or changed (:func:`job_files_problem`) is no
    complete job: it is left out, with a warning
    (unless every record is left out and ``warn_if_none_left`` is false: a caller that refuses an
    empty frame with :func:`no_records_message` names them in its one line).
    """
    root = Path(records_root)
    rows: list[dict[str, Any]] = []
    seen: dict[str, Path] = {}
    left_out: list[tuple[Path, str]] = []
    for path in iter_record_paths(root):
        record = load_record(path)
        problem = job_files_problem(record, path.parent)
        if problem is not None:
            left_out.append((path, problem))
            continue
        if record["run_id"] in seen:
            raise RecordError(f"duplicate run_id {record['run_id']!r}: {seen[record['run_id']]} and {path}")
        seen[record["run_id"]] = path
        rows.append(flatten_record(record, record_dir=path.parent.relative_to(root).as_posix()))
    if rows or warn_if_none_left:
        for path, problem in left_out:
            log.warning("record left out (not a complete job): %s: %s", path, problem)
    if not rows:
        return pd.DataFrame(columns=list(STORE_COLUMNS))
    df = pd.DataFrame(rows)
    return df.sort_values("run_id", kind="stable").reset_index(drop=True)


def _parquet_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Object columns mixing value types (a config key that is a string in one run and a
    number in another) cannot become one Arrow type: store those columns as JSON strings. A run
    lacking the key (None, or NaN in the frame) stays null there, as reading the folder gives it."""
    out = df.copy()
    for name in out.columns:
        if out[name].dtype != object:
            continue
        kinds = {type(v) for v in out[name] if v is not None and not (isinstance(v, float) and v != v)}
        if {int, float} >= kinds or len(kinds) <= 1:
            continue
        out[name] = out[name].map(lambda v: None if v is None or (isinstance(v, float) and v != v) else json.dumps(v))
    return out


def write_store(df: pd.DataFrame, path: str | Path) -> Path:
    """Write the store to Parquet (pyarrow), atomically (temporary file, then rename)."""
    path = Path(path)
    if path.suffix != ".parquet":
        raise ValueError(f"store path must end in .parquet; got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        _parquet_safe(df).to_parquet(tmp, engine="pyarrow", index=False)
        os.chmod(tmp, plain_file_mode())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def left_out_records(records_root: str | Path) -> list[tuple[str, str]]:
    """The records under ``records_root`` that :func:`aggregate` leaves out (their bound outputs or
    round series are missing or changed): ``(folder relative to the root, why)``."""
    root = Path(records_root)
    out = []
    for path in iter_record_paths(root):
        try:
            problem = job_files_problem(load_record(path), path.parent)
        except RecordError:
            continue  # aggregate refuses it outright, naming it
        if problem is not None:
            out.append((path.parent.relative_to(root).as_posix() or ".", problem))
    return out


def no_records_message(source: str | Path, root: Path | None) -> str:
    """Why a records folder gave no run: none there, or each one left out (and why)."""
    left = left_out_records(root) if root is not None and Path(root).is_dir() else []
    if not left:
        return f"no run records under {source} (a record.json in a run folder, hidden ones aside)"
    named = "; ".join(f"{folder}: {why}" for folder, why in left[:3]) + ("; ..." if len(left) > 3 else "")
    return (
        f"no complete run records under {source}: {len(left)} record(s) left out because their outputs or round "
        f"series are not the ones they bind ({named})"
    )


def rebuild_store(records_root: str | Path, path: str | Path | None = None) -> pd.DataFrame:
    """Aggregate the records and write them to ``path`` (default ``<root>/store.parquet``)."""
    df = aggregate(records_root)
    write_store(df, Path(records_root) / "store.parquet" if path is None else path)
    return df


def read_results(source: str | Path) -> tuple[pd.DataFrame, Path | None]:
    """A records folder (aggregated now) or a ``.parquet`` store.

    Returns ``(frame, records_root)``; ``records_root`` is the folder that ``record_dir`` is
    relative to (for a store: the store's folder, where :func:`rebuild_store` puts it). A folder whose
    every record is left out gives an empty frame without the warnings: the caller refuses it with
    :func:`no_records_message`, which names them.
    """
    source = Path(source)
    if source.is_dir():
        return aggregate(source, warn_if_none_left=False), source
    if source.suffix == ".parquet" and source.is_file():
        try:
            df = pd.read_parquet(source, engine="pyarrow")
        except Exception as exc:  # pyarrow's errors for a file that is no Parquet (ArrowInvalid, OSError)
            raise RecordError(f"{source}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
        missing = [c for c in ("run_id", "section", "record_dir", "per_prompt", *AXES) if c not in df.columns]
        if missing:
            raise RecordError(
                f"{source}: not a store this harness wrote (it has no {', '.join(missing[:4])}"
                + (f" or {len(missing) - 4} more" if len(missing) > 4 else "")
                + " columns); give a records folder, or the store.parquet a sweep wrote"
            )
        stale = stale_rows(df, source.parent)
        unstored = [] if stale else unstored_records(df, source.parent)
        if stale or unstored:
            if stale:
                record_dir, now, then = stale[0]
                what, count = f"{record_dir} {now}, the store's row is run {then}", len(stale)
            else:
                record_dir, run_id = unstored[0]
                lacks = "a complete job the store lacks (written after the store was built)"
                what = f"{record_dir} holds run {run_id}, {lacks}"
                count = len(unstored)
            more = f" (and {count - 1} more)" if count > 1 else ""
            raise RecordError(
                f"{source} is stale: {what}{more}; give the folder instead (`{source.parent}`: its records are read "
                "now, without the store), or launch the sweep again to rebuild the store"
            )
        changed = changed_output_rows(df, source.parent)
        if changed:
            record_dir, problem = changed[0]
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            raise RecordError(
                f"{source} counts a run that is no complete job now: {record_dir}: {problem}{more}; give the folder "
                f"instead (`{source.parent}`: its complete records are read now, the others left out and named)"
            )
        return df, source.parent
    raise RecordError(f"{source}: expected a records folder or a .parquet store")


_RUN_ID = re.compile(r'"run_id"\s*:\s*"([^"]+)"')


def _row_folder_there(folder: Path, root: Path) -> bool:
    """Whether a store row's job ``folder`` (below the store's folder ``root``) is there: a folder,
    or, for the store's own folder (a run's store), only while it holds that run's files."""
    if folder.resolve() == root.resolve():
        return (folder / RECORD_FILENAME).is_file() or (folder / PREVIOUS_DIR).is_dir()
    return folder.is_dir()


def unstored_records(df: pd.DataFrame, root: Path) -> list[tuple[str, str]]:
    """The complete jobs under ``root`` (the store's folder) in folders no row of the store names:
    ``(record_dir, run id)``, jobs that finished after the store was built. Only those folders'
    records are read; a store copied away from its records (none of its rows' folders there), or
    an empty one, has none, and a record that is no complete job (invalid, or its outputs or round
    series not the ones it binds) is left to reading the folder, which names it."""
    root = Path(root)
    stored = {str(record_dir) for record_dir in df["record_dir"]}
    if not any(_row_folder_there(root / record_dir, root) for record_dir in stored):
        return []  # copied away, or empty: no folder of the store's is known
    out = []
    for path in iter_record_paths(root):
        record_dir = path.parent.relative_to(root).as_posix()
        if record_dir in stored:
            continue
        try:
            record = load_record(path)
        except RecordError:
            continue
        if job_files_problem(record, path.parent) is None:
            out.append((record_dir, str(record["run_id"])))
    return out


def stale_rows(df: pd.DataFrame, root: Path) -> list[tuple[str, str, str]]:
    """The rows of a store whose job folder (``root / record_dir``) no longer holds their run's record:
    ``(record_dir, what it holds now, run id in the store)``. A folder may hold another run's record (a
    job re-ran), or none: its record set aside to ``.previous/`` (a re-run whose gate failed) or
    removed, or the folder itself gone while other rows' folders are there. A store whose every row's
    folder is gone (a store copied away from its records) is no sign of staleness."""
    root = Path(root)
    rows = list(zip(df["record_dir"], df["run_id"], strict=True))
    folders = [root / str(record_dir) for record_dir, _ in rows]

    def there(folder: Path) -> bool:
        return _row_folder_there(folder, root)

    copied_away = not any(there(folder) for folder in folders)
    out = []
    for (record_dir, run_id), folder in zip(rows, folders, strict=True):
        path = folder / RECORD_FILENAME
        if not path.is_file():
            if copied_away:
                continue
            if not there(folder):
                now = "is gone"
            elif (folder / PREVIOUS_DIR).is_dir():
                aside = f"{record_dir}/{PREVIOUS_DIR}/"
                now = f"holds no record now (it was set aside to {aside} by a re-run that wrote none)"
            else:
                now = "holds no record now (it was removed)"
            out.append((str(record_dir), now, str(run_id)))
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                head = fh.read(4096)  # the record's run_id is among its first keys
        except (OSError, ValueError):  # unreadable, or not UTF-8: reading the folder refuses it, naming it
            continue
        found = _RUN_ID.search(head)
        if found is None:
            try:
                found_id = json.loads(path.read_text(encoding="utf-8")).get("run_id")
            except (OSError, ValueError, AttributeError):
                continue
        else:
            found_id = found.group(1)
        if found_id is not None and str(found_id) != str(run_id):
            out.append(
                (str(record_dir), f"now holds run {found_id} (a job re-ran after the store was built)", str(run_id))
            )
    return out


def changed_output_rows(df: pd.DataFrame, root: Path) -> list[tuple[str, str]]:
    """The rows of a store whose job folder still holds their run's record but not the outputs or
    round series it binds (changed or gone since the store was built), or whose record is no valid
    record now: ``(record_dir, why)``. A folder that is gone, or holds another run
    (:func:`stale_rows`), is passed over."""
    out = []
    for record_dir, run_id in zip(df["record_dir"], df["run_id"], strict=True):
        folder = Path(root) / str(record_dir)
        try:
            record = json.loads((folder / RECORD_FILENAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or str(record.get("run_id")) != str(run_id):
            continue
        try:
            problem = job_files_problem(validate_record(record, path=folder / RECORD_FILENAME), folder)
        except RecordError as exc:  # reading the folder refuses it, naming it
            problem = f"its record is no valid record now ({exc})"
        if problem is not None:
            out.append((str(record_dir), problem))
    return out


def failed_jobs(root: Path | None, *, below: bool = True) -> list[dict[str, Any]]:
    """The jobs that wrote no record, as the sweep folders under ``root`` (``root`` itself included;
    ``below=False``: ``root`` only, the sweep whose store is read) list them in their failures
    files; a job of a sweep folder below the root is named by its path from the root."""
    if root is None or not root.is_dir():
        return []
    rows = []
    for path in sorted(root.rglob(FAILURES_FILENAME) if below else [root / FAILURES_FILENAME]):
        if not path.is_file():
            continue
        where = path.parent.relative_to(root)
        if any(part.startswith(".") for part in where.parts):
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                if where.parts:
                    row = {**row, "job": f"{where.as_posix()}/{row.get('job', '?')}"}
                rows.append(row)
    return rows


def json_column(df: pd.DataFrame, name: str) -> pd.Series:
    """Decode a JSON-string column (``acceptance_by_depth``, ``per_prompt``, ...)."""
    if name not in df.columns:
        raise KeyError(f"store has no column {name!r}; columns: {sorted(df.columns)}")
    return df[name].map(lambda s: None if s is None or (isinstance(s, float) and s != s) else json.loads(s))
