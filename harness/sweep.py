"""`harness sweep`: launch a named sweep (``harness/conf/sweep/``, linked as ``sweeps/``) through a Hydra launcher.

    harness sweep NAME [launcher=basic|joblib|submitit_local|slurm|submitit_slurm] [concurrent_jobs=N]
                       [overrides...]
    harness sweep --list

is ``harness run -m +sweep=NAME hydra/launcher=LAUNCHER ...``: Hydra's sweeper expands
``hydra.sweeper.params`` of ``sweeps/NAME.yaml`` (the ``sweep`` config group) and the launcher runs
the jobs. Any ``harness run -m`` gets the same treatment (the root config registers the callback
and the folder naming). Everything here is wiring around Hydra's own mechanisms:

* **Job folders are deterministic**: ``<sweep folder>/<the job's override_dirname>`` (the root
  config), so a re-launch finds each job's folder whatever the order of the axis lists.
  :func:`run_sweep_job` (called by the runner's Hydra entry in multirun mode) holds the folder's
  lock, skips a job whose folder holds a complete job (``record.json`` and the ``outputs.jsonl``
  it binds, :func:`harness.tracking.job_folder.inspect_job`) with the manifest hash this job would
  freeze (:func:`harness.manifest.job_manifest`), and otherwise moves the folder's earlier files to
  ``<job>/.previous/`` with a warning giving the reason before running it: a job that then fails
  leaves no record in its folder (one refused before measuring, or interrupted before writing,
  puts the earlier files back). A record of this manifest whose measured Sequoia artifacts changed
  since (re-calibrated in place, or gone) is run again: jobs that share the cached artifacts and
  re-measure them (``topology.reuse=false``) therefore re-run one another on every relaunch.
  The same job reached by other overrides (a default restated,
  ``seed=0``: another folder name, the same manifest hash) is skipped too, naming the folder that
  holds it (:func:`twin_job`), so the sweep folder never holds one job's measurement twice.
* **A failing job does not stop the others**: the job's exception (refusals included: negotiation
  errors, gate failures, a folder another live run holds) is caught, written to the job's
  ``job_status.json`` and the job returns normally, so Hydra's sweeper moves on to the next batch.
  The job writes that file (``status: running``) as it starts, so a job whose process was killed
  (a scheduler's time or memory limit, a launcher's worker killed, Ctrl-C) is named ``unfinished``
  by the summary and ``failures.jsonl``; the Slurm launcher waits for the array's other tasks
  after one is killed and writes the killed task's end status (:func:`record_lost_task`).
* **Honest timing**: the sweeper hands the launcher batches of ``concurrent_jobs`` jobs (default
  1), and each job records, as ``concurrent_jobs``, how many jobs its launcher really runs at once
  (:func:`launcher_concurrency`), whatever was asked, and no more than its batch holds (a sweep's
  last batch, an array of fewer tasks than its parallelism: :func:`jobs_in_batch`). The Slurm
  launcher (``hydra/launcher=slurm``) takes the whole sweep as one array of which ``concurrent_jobs``
  tasks run at once, which may share a node; a job of an array whose tasks get whole nodes
  (``--exclusive``) records 1 (:func:`machine_sharers`). A relaunch times again a record timed
  beside more jobs than it runs.
* **After the sweep** (:class:`SweepCallback`, a Hydra callback, in the launching process):
  ``failures.jsonl`` (this launch's failed and unfinished jobs, their overrides and errors, and the
  jobs a launch cut short never started, at stage ``not started``), ``summary.json`` (ran / skipped /
  failed / unfinished / not started), ``store.parquet``
  (:func:`harness.tracking.store.rebuild_store` over the sweep folder: complete jobs only) and
  ``report/`` (``harness report``, regenerated or removed), all in the sweep folder; the command
  exits non-zero naming the failed and unfinished jobs
  (:func:`harness.app.multirun_exit_code`). Before the first job it refuses a launcher that cannot
  submit (a Slurm launcher without a partition).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import shutil
import sys
import time
import traceback
import uuid
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from hydra.experimental.callback import Callback as _Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.cli import is_refusal
from harness.config import config_loader, override_key
from harness.gates.status import GateError
from harness.manifest import job_manifest, manifest_hash
from harness.runner import HeldInterrupts, run_job, run_notes, track
from harness.target.loading import cache_root
from harness.tracking import report as report_mod
from harness.tracking.conventions import name_of
from harness.tracking.job_folder import (
    JobFolderError,
    JobState,
    clear_for_run,
    inspect_job,
    job_lock,
    mapping_difference,
    read_cuda_cards_with,
    set_aside,
)
from harness.tracking.record import write_json_atomic, write_jsonl_atomic
from harness.tracking.store import (
    FAILURES_FILENAME,
    NOT_STARTED,
    RECORD_FILENAME,
    RecordError,
    any_record_path,
    iter_record_paths,
    rebuild_store,
)
from hydra_plugins.harness_launcher.slurm import exclusive_nodes, one_task_refusal, slurm_missing, slurm_refusal

log = logging.getLogger("harness.sweep")


@functools.cache
def this_cuda_card(device: str) -> dict[str, Any] | None:
    """This process's CUDA card (:func:`harness.measure.hardware.cuda_card`) for ``device`` (``"cuda:0"``),
    read once per device; None where ``device`` is no CUDA device this machine has."""
    import torch

    from harness.measure.hardware import cuda_card

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return None
    if dev.type != "cuda" or not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
        return None
    return cuda_card(dev)


# a record of a CUDA device stands for a relaunch (of a sweep's job, or of a run in its own folder) only
# where it was timed under this machine's driver, CUDA runtime, cuDNN and nvidia-* wheels
read_cuda_cards_with(this_cuda_card)

SWEEPS_DIR = Path(__file__).resolve().parent / "conf" / "sweep"
JOB_STATUS = "job_status.json"
LAUNCH_FILE = "launch.json"
FAILURES_FILE = FAILURES_FILENAME
SUMMARY_FILE = "summary.json"
STORE_FILE = "store.parquet"
REPORT_DIR = "report"
#: the ``harness`` package this process imported; a launch records it and its jobs must import the same
HARNESS_PACKAGE = Path(__file__).resolve().parent
#: the variables :func:`import_launching_harness` sets for the job processes a launcher starts
JOB_IMPORT_VARS = ("PYTHONPATH", "PYTHONSAFEPATH")

#: ``launcher=NAME`` -> Hydra overrides; ``harness run -m ... hydra/launcher=X`` (Hydra's own switch)
#: gives the same jobs. The sweeper hands any launcher batches of ``concurrent_jobs`` jobs (the
#: root config's ``hydra.sweeper.max_batch_size``; default 1, so timed jobs run one at a time), and
#: each launcher's own bound follows it; ``slurm`` submits the whole sweep as one array whose
#: ``array_parallelism`` is ``concurrent_jobs`` (``harness/conf/hydra/launcher/slurm.yaml``).
LAUNCHERS: dict[str, tuple[str, ...]] = {
    "basic": ("hydra/launcher=basic",),
    "joblib": ("hydra/launcher=joblib", "hydra.launcher.n_jobs=${concurrent_jobs}"),
    "submitit_local": ("hydra/launcher=submitit_local",),
    "slurm": ("hydra/launcher=slurm",),
    "submitit_slurm": ("hydra/launcher=submitit_slurm", "hydra.launcher.array_parallelism=${concurrent_jobs}"),
}

USAGE = (
    "usage: harness sweep NAME|PATH.yaml [launcher=basic|joblib|submitit_local|slurm|submitit_slurm] "
    "[concurrent_jobs=N] [hydra overrides...]\n       harness sweep --list\n"
    "       (launcher=slurm needs hydra.launcher.partition=<partition>; see harness/conf/hydra/launcher/slurm.yaml)"
)

#: what the last multirun launched from this process did (read by ``harness run -m`` for its exit code).
LAST_SUMMARY: dict[str, Any] = {}
#: the launches this process has started and not finished (an interrupt or a launcher's error finishes them)
ACTIVE_LAUNCHES: list[SweepCallback] = []
#: what ``stopped_by`` says of a launch Ctrl-C (or a scheduler's SIGINT) cut short
INTERRUPTED = "interrupted"
#: a job status's ``status`` from the job's start until it ends; one left so names a job whose process
#: was killed (or that a scheduler still runs): the summary's ``unfinished``
RUNNING = "running"
#: why a job left ``running`` did not end, as ``failures.jsonl`` says it
UNFINISHED_WHY = (
    "the job started and wrote no end status: its process was killed (a scheduler's time or memory limit, "
    "a launcher's worker killed, an interrupt) or a scheduler still runs it"
)
#: why a job the launch planned has no record, as ``failures.jsonl`` says it
NOT_STARTED_WHY = "the launch stopped before this job started; a relaunch runs it"


# --------------------------------------------------------------------------------------------
# sweep definitions and the command line


def list_sweeps(sweeps_dir: Path = SWEEPS_DIR) -> list[str]:
    """Names of the sweep definitions (``sweeps/*.yaml``; files starting with ``_`` are shared parts)."""
    return sorted(p.stem for p in sweeps_dir.glob("*.yaml") if not p.stem.startswith("_"))


def check_sweep_file(path: Path) -> None:
    """A sweep file must be YAML holding a mapping (its ``defaults`` and ``hydra.sweeper.params``):
    a parse error is refused naming the file and line, an empty file or another kind of document
    naming what it holds."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"sweep file {path} is not UTF-8 text ({exc.reason})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"sweep file {path} is not valid YAML{where}: {problem}") from None
    if doc is None:
        raise ValueError(
            f"sweep file {path} is empty: a sweep sets hydra.sweeper.params (the axes) and its defaults; "
            f"see the packaged ones in {SWEEPS_DIR}"
        )
    if not isinstance(doc, dict):
        raise ValueError(f"sweep file {path} holds a YAML {type(doc).__name__}, not a mapping of settings")
    name = doc.get("sweep")
    if name is None:
        raise ValueError(
            f"sweep file {path} sets no sweep name: add `sweep: {path.stem}` (its jobs go to multirun/<sweep>/)"
        )
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ValueError(
            f"sweep file {path} names sweep={name!r}: it must be a plain name (letters, digits, '_', '-', '.'), "
            "not a path: it names the folder multirun/<sweep>/"
        )
    if name in list_sweeps(SWEEPS_DIR) and path.resolve() != (SWEEPS_DIR / f"{name}.yaml").resolve():
        raise ValueError(
            f"sweep file {path} names sweep={name!r}, a packaged sweep's name: its jobs would land in "
            f"multirun/{name}/ and its W&B group among that sweep's; name it otherwise (sweep: {path.stem})"
        )
    header = []  # Hydra reads directives from the first lines only: blank lines skipped, up to any other line
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if not re.match(r"\s*#\s*@", line):
            break
        header.append(line.strip())
    if not any(re.fullmatch(r"#\s*@package\s+_global_", line) for line in header):
        raise ValueError(
            f"sweep file {path} does not start with `# @package _global_` (Hydra reads it only before any other "
            "line, a comment included): without it Hydra places its settings under sweep.* instead of the run's "
            "own keys; make it the first line"
        )


def sweep_file_search_path(path: Path, *, sweeps_dir: Path = SWEEPS_DIR) -> tuple[str, Path]:
    """``(sweep group option, config root)`` that lets Hydra compose a sweep file kept anywhere.

    Hydra finds a sweep as ``<config root>/sweep/<name>.yaml``. A file already in a folder named
    ``sweep`` has its root; any other file is linked as ``sweep/<stem>.yaml`` under
    ``$HARNESS_CACHE/sweep-files/<hash of its path>/`` (a stable place, so jobs that compose again
    in other processes, as submitit's do, find it). Its defaults resolve as those of a packaged
    sweep (``_common`` is the packaged one). A stem that names a packaged sweep is refused: the
    packaged file would win; so is one holding other characters than a sweep name's (letters,
    digits, ``_``, ``-``, ``.``): Hydra reads the option ``+sweep=<stem>`` by its override grammar."""
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"sweep file {path} does not exist")
    check_sweep_file(path)
    if path.stem in list_sweeps(sweeps_dir) or path.stem.startswith("_"):
        raise ValueError(
            f"sweep file {path}: its name {path.stem!r} is taken by a packaged sweep or a shared part; rename it"
        )
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", path.stem):
        raise ValueError(
            f"sweep file {path}: its name {path.stem!r} is passed to Hydra as +sweep={path.stem}, which reads other "
            "characters than letters, digits, '_', '-' and '.' as its own syntax (a ',' as a sweep over the sweep "
            "group); rename the file"
        )
    if path.parent.name == "sweep":
        return path.stem, path.parent.parent
    cache = cache_root()
    root = cache / "sweep-files" / hashlib.sha256(str(path).encode()).hexdigest()[:16]
    link = root / "sweep" / f"{path.stem}.yaml"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() and link.resolve() == path):
        tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path)
        os.replace(tmp, link)
    return path.stem, root


def sweep_argv(name: str, args: list[str], *, sweeps_dir: Path = SWEEPS_DIR) -> list[str]:
    """The ``harness run`` arguments for ``harness sweep NAME args...``.

    ``NAME`` is a packaged sweep (``harness sweep --list``) or the path of a sweep file anywhere
    (``*.yaml``; see :func:`sweep_file_search_path`). ``launcher=X`` is taken out of ``args`` and
    mapped through :data:`LAUNCHERS`; every other argument is a Hydra override passed on after the
    launcher's (so the user's win).
    """
    known = list_sweeps(sweeps_dir)
    search: list[str] = []
    if name not in known and Path(name).suffix in {".yaml", ".yml"}:
        name, root = sweep_file_search_path(Path(name), sweeps_dir=sweeps_dir)
        search = [f"hydra.searchpath=['file://{root.as_posix()}']"]
    elif name not in known and Path(name).is_file():
        raise ValueError(f"{name} is no sweep file: a sweep file's name ends in .yaml or .yml")
    elif name not in known:
        raise ValueError(
            f"unknown sweep {name!r}; expected one of {known} (files in {sweeps_dir}) or the path of a sweep file"
        )
    launcher, rest = "basic", []
    for arg in args:
        if arg.startswith("launcher="):
            launcher = arg.split("=", 1)[1]
        elif arg in {"-m", "--multirun"}:
            continue
        else:
            if arg.startswith("hydra/launcher="):  # Hydra's own switch, given to `harness sweep`
                launcher = None
            rest.append(arg)
    if launcher is not None and launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {sorted(LAUNCHERS)}; got {launcher!r}")
    return ["-m", *search, f"+sweep={name}", *(LAUNCHERS[launcher] if launcher else ()), *rest]


# --------------------------------------------------------------------------------------------
# launchers


def import_launching_harness(environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """Make the job processes a launcher starts from here import this process's harness: submitit
    starts each job as ``python -u -m submitit.core._submit`` (locally or through sbatch, which
    passes the environment on), and ``-m`` puts the working directory first on ``sys.path``, so a
    launch from a folder holding another ``harness/`` package (another checkout) ran that code.
    ``PYTHONSAFEPATH=1`` leaves the working directory off the path and ``PYTHONPATH`` starts with the
    folder that holds :data:`HARNESS_PACKAGE`. Sets both in ``environ`` (``os.environ``) and returns
    their earlier values, for :func:`restore_environ`."""
    environ = os.environ if environ is None else environ
    earlier = {key: environ.get(key) for key in JOB_IMPORT_VARS}
    root = str(HARNESS_PACKAGE.parent)
    paths = (earlier["PYTHONPATH"] or "").split(os.pathsep) if earlier["PYTHONPATH"] else []
    environ["PYTHONPATH"] = os.pathsep.join(paths if paths[:1] == [root] else [root, *paths])
    environ["PYTHONSAFEPATH"] = "1"
    return earlier


def restore_environ(earlier: dict[str, str | None], environ: dict[str, str] | None = None) -> None:
    """Put back the variables :func:`import_launching_harness` set (unset where they were)."""
    environ = os.environ if environ is None else environ
    for key, value in earlier.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value


def _joblib_workers(n_jobs: int | None) -> int:
    """joblib's reading of n_jobs: None -> 1, negative -> cpu_count + 1 + n_jobs."""
    if n_jobs is None:
        return 1
    n = int(n_jobs)
    if n == 0:
        raise ValueError("hydra.launcher.n_jobs must not be 0")
    return max(1, (os.cpu_count() or 1) + 1 + n) if n < 0 else n


def launcher_concurrency(hydra_cfg: DictConfig) -> int | None:
    """How many jobs the configured Hydra launcher runs at once; None when nothing bounds it.

    The sweeper hands the launcher batches of ``hydra.sweeper.max_batch_size`` jobs (all jobs
    when unset); within a batch the basic launcher runs one job at a time, joblib ``n_jobs``,
    submitit's local executor all of them and Slurm ``array_parallelism``.
    """
    target = str(hydra_cfg.launcher.get("_target_", ""))
    launcher = hydra_cfg.launcher
    if target.endswith("BasicLauncher"):
        width: int | None = 1
    elif target.endswith("JoblibLauncher"):
        width = _joblib_workers(launcher.get("n_jobs"))
    elif target.endswith("submitit_launcher.LocalLauncher"):
        width = None
    elif target.endswith("SlurmLauncher"):  # submitit's, or the harness's (hydra/launcher=slurm)
        width = _whole_number("hydra.launcher.array_parallelism", launcher.get("array_parallelism"))
    else:
        raise ValueError(
            f"unknown Hydra launcher {target!r}: cannot tell how many jobs run at once; use one of {sorted(LAUNCHERS)}"
        )
    batch = hydra_cfg.sweeper.get("max_batch_size")
    if batch is not None:  # Hydra's sweeper asserts it is positive, after the launch has written its files
        batch = _whole_number("hydra.sweeper.max_batch_size (hydra.launcher.sweep_batch for Slurm)", batch)
    bounds = [b for b in (width, batch) if b is not None]
    return min(bounds) if bounds else None


def jobs_in_batch(hydra_cfg: DictConfig, num: int, planned: int | None) -> int | None:
    """How many jobs the launcher was handed with job ``num`` (0-based, across the launch) of a launch
    that plans ``planned`` jobs: the sweeper hands them over in batches of ``hydra.sweeper.max_batch_size``
    (all at once when unset: the Slurm launcher's one array), the last batch holding the rest. None
    when the plan is unknown (another sweeper) or does not hold job ``num``."""
    if planned is None or not 0 <= num < planned:
        return None
    batch = hydra_cfg.sweeper.get("max_batch_size")
    size = planned if batch is None else _whole_number("hydra.sweeper.max_batch_size", batch)
    return min(size, planned - num // size * size)


def machine_sharers(hydra_cfg: DictConfig, width: int) -> int:
    """How many of the sweep's jobs share a job's machine, as the job records it (``concurrent_jobs``):
    the ``width`` its launcher runs at once, its batch's jobs at most (a Slurm array's tasks too: sbatch
    puts several on one node unless asked not to), or 1 for a Slurm array whose tasks get whole nodes (``--exclusive``:
    :func:`~hydra_plugins.harness_launcher.slurm.exclusive_nodes`)."""
    slurm = str(hydra_cfg.launcher.get("_target_", "")).endswith("SlurmLauncher")
    return 1 if slurm and exclusive_nodes(hydra_cfg.launcher) else width


def _whole_number(key: str, value) -> int:
    """``value`` as a whole number >= 1, else ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 1:
        raise ValueError(f"{key}={value!r}: must be a whole number of at least 1")
    return int(value)


# --------------------------------------------------------------------------------------------
# Slurm


def launcher_refusal(hydra_cfg: DictConfig) -> str | None:
    """Why the configured launcher cannot submit this multirun (checked before anything is
    submitted or written); None when it can. Every job records how many jobs ran at once, so a
    launcher whose concurrency nothing bounds is refused (every job would fail while it is set up).
    A Slurm launcher (submitit's or the harness's ``hydra/launcher=slurm``) needs a partition,
    resources sbatch takes, and sbatch on this machine; submitit's local launcher, one task per job
    (its ``tasks_per_node`` starts that many copies of each job)."""
    try:
        width = launcher_concurrency(hydra_cfg)
    except (ValueError, TypeError) as exc:
        return " ".join(str(exc).split())
    if width is None:
        return CONCURRENCY_UNKNOWN
    target = str(hydra_cfg.launcher.get("_target_", ""))
    if target.endswith("submitit_launcher.LocalLauncher"):
        nodes = hydra_cfg.launcher.get("nodes")
        if nodes is not None and nodes != 1:  # submitit's local executor refuses it once the sweep folder is written
            return (
                f"hydra.launcher.nodes={nodes!r}: submitit's local launcher runs on this one node; "
                "set hydra.launcher.nodes=1"
            )
        return one_task_refusal(hydra_cfg.launcher, starter="submitit's local controller", keys=("tasks_per_node",))
    if not target.endswith("SlurmLauncher"):
        return None
    return slurm_refusal(hydra_cfg.launcher, sweep_dir=str(hydra_cfg.sweep.dir)) or slurm_missing()


CONCURRENCY_UNKNOWN = (
    "cannot tell how many jobs run at once: the launcher runs a whole batch together "
    "and hydra.sweeper.max_batch_size is unset (it defaults to concurrent_jobs)"
)


# --------------------------------------------------------------------------------------------
# inside one job


def sweep_folder_problem(
    sweep_dir: Path | str,
    sweep: Any,
    *,
    jobs: list[list[str]] | None = None,
    unnamed: Collection[str] = (),
) -> str | None:
    """Why ``sweep_dir`` cannot take this launch of ``sweep`` (None when it can): no folder named, a
    folder inside another sweep's folder (:func:`enclosing_sweep_folder`: that sweep's store and
    report would count this one's jobs), a single run's folder (its record would join the sweep's
    store and report), a datastore's or an artifact's, a folder holding records or a ``report/`` that
    no sweep launched there (the sweep's store would count those records, and its report replaces
    ``report/``), or the folder of another sweep's launch (its summary and launch file would be
    overwritten, its jobs counted with these). The same sweep launched again resumes in its folder: a
    sweep of the same name, or a multirun without a name that plans the same jobs (``jobs``, as
    :func:`planned_jobs` gives them), in any order and whatever their keys in ``unnamed`` (launch-only
    keys, left out of job folder names)."""
    if not str(sweep_dir).strip():
        return (
            "hydra.sweep.dir is empty: a sweep writes its job folders, store, summary and report into it; "
            "give it a folder of its own"
        )
    sweep_dir = Path(sweep_dir)
    where = f"hydra.sweep.dir={sweep_dir}"
    outer = enclosing_sweep_folder(sweep_dir)
    if outer is not None:
        return (
            f"{where} is inside the sweep folder {outer} (it holds {', '.join(sweep_folder_markers(outer))}): that "
            "sweep's store and report would count this sweep's jobs with its own; give the sweep a folder outside it"
        )
    if (sweep_dir / RECORD_FILENAME).is_file():
        return (
            f"{where} is a single run's folder (it holds {RECORD_FILENAME}): the sweep's store and report would "
            "count that run with its jobs; give the sweep a folder of its own"
        )
    if (sweep_dir / "manifest.json").is_file():
        return (
            f"{where} holds manifest.json, a datastore's or a trained artifact's: the sweep's jobs would sit among "
            "its files; give the sweep a folder of its own"
        )
    launched = (sweep_dir / LAUNCH_FILE).is_file() or any(  # a launch whose launch file went missing left these
        (sweep_dir / name).is_file() for name in (SUMMARY_FILE, STORE_FILE)
    )
    if not launched:  # no sweep was launched here: what is there is someone else's
        if (sweep_dir / REPORT_DIR).is_dir():
            return (
                f"{where} holds a {REPORT_DIR}/ folder no sweep wrote there: the sweep's report would replace it; "
                "give the sweep a folder of its own"
            )
        found = any_record_path(sweep_dir) if sweep_dir.is_dir() else None
        if found is not None:
            return (
                f"{where} holds records no sweep launched there ({found.relative_to(sweep_dir)}): the sweep's store "
                "and report would count them with its jobs; give the sweep a folder of its own"
            )
        return None
    try:
        earlier = json.loads((sweep_dir / LAUNCH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(earlier, dict):
        return None
    before, now = name_of(earlier.get("sweep")), name_of(sweep)
    if before != now:
        named = lambda name: f"sweep {name!r}" if name else "a multirun without a sweep name"  # noqa: E731
        return (
            f"{where} holds {named(before)}'s launch ({LAUNCH_FILE}): {named(now)} there would overwrite its "
            "summary and mix its jobs with these; give it a folder of its own"
        )
    if now is None and jobs is not None:
        ran, asked = _job_set(earlier.get("planned_jobs"), unnamed), _job_set(jobs, unnamed)
        if ran is not None and asked is not None and ran != asked:
            overrides = earlier.get("overrides")
            task = overrides.get("task") if isinstance(overrides, dict) else None
            given = " ".join(str(o) for o in task or [] if override_key(str(o)) not in unnamed)
            return (
                f"{where} holds the launch of another multirun without a sweep name ({LAUNCH_FILE}: "
                f"{given or 'other jobs'}): this one plans other jobs, and would overwrite its summary and mix its "
                "jobs with these; give it a folder of its own (the same overrides launched again resume that one)"
            )
    return None


#: the files a sweep's launch leaves in its folder (Hydra's ``multirun.yaml``, the harness's launch file,
#: summary and store): a folder holding any of them is a sweep's
SWEEP_FOLDER_MARKERS = ("multirun.yaml", LAUNCH_FILE, SUMMARY_FILE, STORE_FILE)


def sweep_folder_markers(folder: Path) -> list[str]:
    """The files of :data:`SWEEP_FOLDER_MARKERS` that ``folder`` holds."""
    return [name for name in SWEEP_FOLDER_MARKERS if (folder / name).is_file()]


def enclosing_sweep_folder(sweep_dir: Path) -> Path | None:
    """The nearest folder above ``sweep_dir`` (its absolute path) that is a sweep's
    (:func:`sweep_folder_markers`), or None: the records a sweep writes there would be under that
    sweep's folder, which its store and report read whole."""
    for above in Path(sweep_dir).resolve().parents:
        if sweep_folder_markers(above):
            return above
    return None


def job_folder_name(job: list[str], unnamed: Collection[str]) -> str:
    """A job's folder below the sweep folder as the root config names it (``hydra.sweep.subdir``:
    Hydra's ``override_dirname``, its task overrides sorted and comma-joined, the launch-only keys
    ``unnamed`` left out); a value holding ``/`` makes folders below."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser

    task = [o for o in OverridesParser.create().parse_overrides(job) if not o.key_or_group.startswith("hydra")]
    return get_overrides_dirname(task, sorted(unnamed), ",", "=")


def _job_set(jobs: Any, unnamed: Collection[str]) -> frozenset[frozenset[str]] | None:
    """Jobs as a set of override sets, their launch-only keys (``unnamed``) left out: the same for a
    launch that lists its axes' values in another order. None for no list of lists (a sweeper that
    plans no jobs ahead, a launch file that lists none): nothing to compare."""
    if not isinstance(jobs, list) or not all(isinstance(job, list) for job in jobs):
        return None
    return frozenset(frozenset(str(o) for o in job if override_key(str(o)) not in unnamed) for job in jobs)


def _launch_id(sweep_dir: Path) -> str | None:
    return _launch_file(sweep_dir).get("launch_id")


def _launch_file(sweep_dir: Path) -> dict[str, Any]:
    """The sweep folder's launch file (``{}`` where there is none, or it cannot be read)."""
    try:
        launch = json.loads((sweep_dir / LAUNCH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return launch if isinstance(launch, dict) else {}


def launching_harness_refusal(launch: dict[str, Any]) -> str | None:
    """Why this job process may not run the launch's job (None when it may): it imported another
    ``harness`` package than the launching process recorded in the launch file (a job process finds
    the package first on its own path: its working directory, ``PYTHONPATH``), so it would run other
    code than the launch's. A launch file that records none is not checked."""
    launched = launch.get("harness")
    if not isinstance(launched, str):
        return None
    here = HARNESS_PACKAGE
    if Path(launched) == here:
        return None
    with contextlib.suppress(OSError):  # the same folder mounted under another path on a cluster's node
        if os.path.samefile(launched, here):
            return None
    return (
        f"this job's process imported the harness package {here}, not the launching process's {launched}: it "
        "would run other code than the launch; launch from a folder that holds no other harness/ package, with "
        "the launching checkout first on PYTHONPATH"
    )


def planned_jobs(hydra_cfg: DictConfig) -> list[list[str]] | None:
    """Every job's overrides as Hydra's basic sweeper expands the launch (its ``params`` and the
    command line's overrides, one job per combination), or None for another sweeper (an optimiser
    decides its jobs as it goes) or overrides this cannot expand."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not str(hydra_cfg.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    params = [f"{k}={v}" for k, v in (hydra_cfg.sweeper.get("params") or {}).items()]
    try:
        loader = config_loader()  # a glob() sweep lists its group's options through it
        overrides = OverridesParser.create(config_loader=loader).parse_overrides([*params, *hydra_cfg.overrides.task])
        (jobs,) = BasicSweeper.split_arguments(overrides, None)
    except Exception:  # noqa: BLE001 - a count the summary can go without
        return None
    return [list(job) for job in jobs]


def _launch_plan(sweep_dir: Path, launch_id: str | None) -> list[list[str]] | None:
    try:
        launch = json.loads((sweep_dir / LAUNCH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(launch, dict) or launch.get("launch_id") != launch_id:
        return None
    jobs = launch.get("planned_jobs")
    return jobs if isinstance(jobs, list) else None


def _is_refusal(exc: BaseException) -> bool:
    """A job refused rather than failed, by the rule `harness run` reports with (a config, workload,
    datastore, checkpoint or folder refusal is a ValueError or an OSError about a path; a gate's is a
    GateError; a full disk or an I/O error is a failure)."""
    return is_refusal(exc, (GateError, HydraException, OmegaConfBaseException))


def run_sweep_job(cfg: DictConfig, *, hydra_cfg: DictConfig) -> dict[str, Any]:
    """One multirun job: skip it if its folder holds a complete job of this manifest, else move
    the folder's earlier files aside (a warning gives the reason), run and track it.

    Never raises for a failing job: the error goes to ``<job>/job_status.json`` (and from there
    to the sweep's ``failures.jsonl``) and the other jobs go on. The job holds its folder's lock
    throughout; a folder another live run holds fails this job at once (its status then goes to
    ``<job>/job_status.busy-<launch id>.json``, leaving the other run's files alone). Returns the
    job status.
    """

    t0 = time.perf_counter()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweep_dir = Path(str(hydra_cfg.sweep.dir))
    try:
        job = run_dir.resolve().relative_to(sweep_dir.resolve()).as_posix()
    except ValueError:
        job = run_dir.as_posix()
    launch = _launch_file(sweep_dir)
    status: dict[str, Any] = {
        "job": job,
        "num": int(hydra_cfg.job.num),
        "overrides": list(hydra_cfg.overrides.task),
        "launch_id": launch.get("launch_id"),
        "sweep": cfg.get("sweep"),
    }
    status_file = run_dir / JOB_STATUS
    try:
        with job_lock(run_dir, purpose=f"sweep job {job}", elsewhere="hydra.sweep.dir=... for the whole sweep"):
            status["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            # until the job ends: a job whose process is killed is named unfinished, not left out
            write_json_atomic(status_file, {**status, "status": RUNNING})
            try:  # another harness than the launch's leaves the folder as it is
                refusal = launching_harness_refusal(launch)
                if refusal is not None:
                    raise ValueError(refusal)
            except ValueError as exc:
                _failed(status, job, "setup", exc)
            else:
                _run_locked(cfg, hydra_cfg, run_dir=run_dir, job=job, status=status, launch=launch)
            _finish_status(status, t0, status_file)
    except JobFolderError as exc:
        _failed(status, job, "setup", exc)
        status_file = run_dir / f"job_status.busy-{status['launch_id']}.json"
        if not run_dir.is_dir():
            status_file = sweep_dir / f"job_status.unwritable-{status['launch_id']}-{status['num']}.json"
        _finish_status(status, t0, status_file)
    return status


def _finish_status(status: dict[str, Any], t0: float, path: Path) -> None:
    status["seconds"] = time.perf_counter() - t0
    status["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json_atomic(path, status)


def _failed(status: dict[str, Any], job: str, stage: str, exc: BaseException) -> None:
    log.error("job %s failed during %s: %s: %s", job, stage, type(exc).__name__, exc)
    print(f"harness sweep: job {job} failed during {stage}: {type(exc).__name__}: {exc}", file=sys.stderr)
    status.update(
        status="failed",
        stage=stage,
        refused=_is_refusal(exc),
        error={"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc(limit=-8)},
    )


def _run_locked(
    cfg: DictConfig,
    hydra_cfg: DictConfig,
    *,
    run_dir: Path,
    job: str,
    status: dict[str, Any],
    launch: dict[str, Any] | None = None,
) -> None:
    """The job, its folder locked: skip, or set the earlier files aside and run (``launch``: the
    sweep folder's launch file, whose planned jobs bound how many ran beside this one)."""
    stage = "setup"
    try:
        if cfg.get("output_dir"):
            raise ValueError(
                f"output_dir={cfg.output_dir!r} is for single runs; a sweep writes each job to "
                "hydra.sweep.dir/hydra.sweep.subdir"
            )
        width = launcher_concurrency(hydra_cfg)
        if width is None:
            raise ValueError(CONCURRENCY_UNKNOWN)
        planned = (launch or {}).get("planned_jobs")
        held = jobs_in_batch(hydra_cfg, int(hydra_cfg.job.num), len(planned) if isinstance(planned, list) else None)
        if held is not None:  # a batch (a Slurm array) of fewer jobs than the launcher's width runs them all
            width = min(width, held)
        shared = machine_sharers(hydra_cfg, width)
        if shared != int(cfg.concurrent_jobs):
            log.info(
                "concurrent_jobs=%s asked, the launcher runs %s of this job's batch at once%s: recording %s",
                cfg.concurrent_jobs,
                width,
                ", each Slurm task on a whole node" if shared != width else "",
                shared,
            )
        cfg.concurrent_jobs = shared
        manifest = job_manifest(cfg)
        mhash = manifest_hash(manifest)
        status["manifest_hash"] = mhash
        state = inspect_job(run_dir, manifest_hash=mhash, manifest=manifest, concurrent_jobs=shared)
        other_checks = state.record is not None and not _same_job_config(state.record, cfg)
        if other_checks:
            # the manifest leaves out the gates (and what they check): a record of this manifest that
            # ran other gate settings is not this job's, as it is no twin of it
            changed = mapping_difference(
                _ran_and_checked(state.record.get("config") or {}),
                _ran_and_checked(OmegaConf.to_container(cfg, resolve=True)),
            )
            state = JobState(
                record=None,
                reason=f"its record of this manifest ran under other checks{changed}",
                files=state.files,
            )
        record_dir, twin = run_dir, None
        if state.record is None:  # the same job under other overrides (a default restated: seed=0)
            twin = twin_job(
                Path(str(hydra_cfg.sweep.dir)),
                run_dir,
                manifest_hash=mhash,
                config=OmegaConf.to_container(cfg, resolve=True),
                concurrent_jobs=shared,
            )
        if state.record is not None or twin is not None:
            record = state.record
            if twin is not None:
                record_dir, record = twin
                other = record_dir.resolve().relative_to(Path(str(hydra_cfg.sweep.dir)).resolve()).as_posix()
                status["same_as"] = other
                # this folder's own files are not this job's (another manifest, or timed with more jobs
                # at once): aside, or the store would count a stale record beside the twin's
                _, moved = clear_for_run(run_dir, state, what=f"sweep job {job}", action=f"skipping (see {other})")
                if moved:
                    log.warning("%s", moved)
                log.info("skipped %s: the same job (manifest hash %s) is complete in %s", job, mhash, other)
                print(
                    f"harness sweep: skipped {job}: the same job (manifest hash {mhash}) is complete in {other}",
                    file=sys.stderr,
                )
            else:
                log.info("skipped %s: complete record with manifest hash %s", job, mhash)
                print(f"harness sweep: skipped {job} (complete record, manifest hash {mhash})", file=sys.stderr)
            status.update(status="skipped", record=str(record_dir / RECORD_FILENAME))
            stage = "tracking"
            if track(cfg, record, record_dir):  # it ran untracked: its W&B run is logged now, once
                print(f"harness sweep: logged {job}'s record to W&B after the fact (it ran untracked)", file=sys.stderr)
                status["tracked_after_the_run"] = True
            return
        # an interrupt while the files move waits until all are aside, and until the job can put them back
        held = HeldInterrupts()
        try:
            aside, moved = clear_for_run(run_dir, state, what=f"sweep job {job}", action="re-running")
            if moved:
                log.warning("%s", moved)
            stage = "run"
            # logs to W&B itself with tracking=wandb; a failure puts back only a record of this manifest
            record = run_job(
                cfg,
                run_dir=run_dir,
                aside=aside,
                restore_other_manifest=False,
                restore_earlier=not other_checks,
                held=held,
            )
        finally:
            held.release()  # released by the job; here when the move itself failed
        status["manifest_hash"] = record["manifest_hash"]
        status.update(status="ran", record=str(run_dir / RECORD_FILENAME), speedup=record["metrics"].get("speedup"))
        for note in run_notes(record):  # as a single run says them, naming the job
            print(f"{launching_command()}: note: job {job}: {note}", file=sys.stderr)
    except Exception as exc:  # a failing job must not stop the sweep; it is reported, not hidden
        if stage == "setup":  # no manifest to check earlier files against
            state = inspect_job(run_dir)
            if state.files and not _same_job_config(state.record, cfg):
                dest = set_aside(run_dir, state.files)
                log.warning(
                    "sweep job %s failed before its manifest could be checked; its earlier files are moved to %s",
                    job,
                    dest,
                )
            # a complete record of this job's own config stays: the launch failed (a launcher setting,
            # an artifact it could not open), and the next launch checks the record's manifest
        _failed(status, job, stage, exc)


def _same_job_config(record: dict | None, cfg: DictConfig) -> bool:
    """Whether ``record`` (a complete job's, or None) ran what ``cfg`` asks, its launch-only keys aside."""
    if record is None or not isinstance(record.get("config"), dict):
        return False
    try:
        asked = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # a config that does not resolve asks nothing a record can be said to hold
        return False
    return _ran_and_checked(record["config"]) == _ran_and_checked(asked)


#: config keys that say how a job was launched or logged, not what it ran and checked
LAUNCH_ONLY_KEYS = ("sweep", "concurrent_jobs", "tracking", "output_dir")


def _ran_and_checked(config: dict) -> dict:
    """A resolved config without its launch-only keys (:data:`LAUNCH_ONLY_KEYS`, ``gates.cache``)."""
    out = {k: v for k, v in config.items() if k not in LAUNCH_ONLY_KEYS}
    if isinstance(out.get("gates"), dict):
        out["gates"] = {k: v for k, v in out["gates"].items() if k != "cache"}
    return out


def twin_job(
    sweep_dir: Path, run_dir: Path, *, manifest_hash: str, config: dict, concurrent_jobs: int | None = None
) -> tuple[Path, dict] | None:
    """Another job folder of the sweep holding a complete job of ``manifest_hash`` whose resolved
    config (``config``, launch-only keys aside) is this job's: ``(folder, record)``, else None. Job
    folders are named by their overrides, so one job reached by other overrides (a default
    restated, ``seed=0``) has a folder of its own; it is not measured twice. The manifest leaves
    out the gates, so the config decides: an ungated run is no twin of a gated job."""
    own = run_dir.resolve()
    wanted = _ran_and_checked(config)
    for path in iter_record_paths(
        sweep_dir
    ):  # not in .previous/ (nor Hydra's or submitit's folders), which the store leaves out
        folder = path.parent
        if folder.resolve() == own:
            continue
        try:  # a cheap look first: most records are other jobs'
            if json.loads(path.read_text(encoding="utf-8")).get("manifest_hash") != manifest_hash:
                continue
        except (OSError, ValueError):
            continue
        state = inspect_job(folder, manifest_hash=manifest_hash, concurrent_jobs=concurrent_jobs)
        if state.record is not None and _ran_and_checked(state.record.get("config") or {}) == wanted:
            return folder, state.record
    return None


# --------------------------------------------------------------------------------------------
# after the sweep


@dataclass
class SweepSummary:
    sweep_dir: str
    launch_id: str | None
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    #: jobs that started and wrote no end status (killed, or a scheduler still runs them)
    unfinished: list[str] = field(default_factory=list)
    #: jobs the launch planned (Hydra's basic sweeper) that never started: it stopped first (named as
    #: their folders would be: :func:`job_folder_name`)
    not_started: list[str] = field(default_factory=list)
    #: a skipped job -> the other job folder that holds the same job (same manifest hash)
    same_as: dict[str, str] = field(default_factory=dict)
    records: int = 0
    store: str | None = None
    report: str | None = None
    report_error: str | None = None
    #: why no store could be built from the folder's records (one of them is not a record this harness
    #: reads): no store and no report then, and the launch exits non-zero
    store_error: str | None = None
    #: the launch was cut short (``interrupted``: by Ctrl-C or a scheduler's SIGINT; ``stopped_by``: that,
    #: or the launcher's error): the store holds the records the folder had then, and no report was written
    interrupted: bool = False
    stopped_by: str | None = None


def _status_files(sweep_dir: Path, *, launch_id: str | None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """``(file, status)`` of every job status under ``sweep_dir`` written by launch ``launch_id``
    (all when None), in path order; an unreadable one is logged and left out."""
    for path in sorted(Path(sweep_dir).rglob("job_status*.json")):
        try:
            status = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("unreadable job status %s: %s", path, exc)
            continue
        if launch_id is None or status.get("launch_id") == launch_id:
            yield path, status


def collect_statuses(sweep_dir: Path, *, launch_id: str | None) -> list[dict[str, Any]]:
    """The job statuses under ``sweep_dir`` written by launch ``launch_id`` (all when None)."""
    out = [status for _, status in _status_files(sweep_dir, launch_id=launch_id)]
    return sorted(out, key=lambda s: (s.get("num", 0), s.get("job", "")))


def record_lost_task(sweep_dir: Path, *, num: int, overrides: list[str], stage: str, error: dict[str, str]) -> str:
    """A launcher's task that ended without returning (Slurm's time or memory limit, a failed node):
    its job's ``running`` status of this launch becomes ``failed`` at ``stage`` with ``error``
    (a job that wrote its end status first keeps it); a task that never started writes a status of
    its own into the sweep folder. Returns the job's name."""
    sweep_dir = Path(sweep_dir)
    launch_id = _launch_id(sweep_dir)
    for path, status in _status_files(sweep_dir, launch_id=launch_id):
        if status.get("num") != num:
            continue
        if status.get("status") == RUNNING:
            status.update(status="failed", stage=stage, refused=False, error=error)
            status["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            write_json_atomic(path, status)
        return str(status.get("job"))
    job = f"job {num} ({' '.join(overrides)})"
    status = {
        "job": job,
        "num": num,
        "overrides": list(overrides),
        "launch_id": launch_id,
        "status": "failed",
        "stage": f"{stage} (before the job started)",
        "refused": False,
        "error": error,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json_atomic(sweep_dir / f"job_status.lost-{launch_id}-{num}.json", status)
    return job


def finish_sweep(
    sweep_dir: str | Path,
    *,
    launch_id: str | None = None,
    report: bool = True,
    stopped_by: str | None = None,
    unnamed: Collection[str] = (),
) -> SweepSummary:
    """Failure file, summary, Parquet store and report for a sweep folder (no report for a launch
    ``stopped_by`` an interrupt or an error: its store and summary say what the folder holds then).
    A planned job the launch never started is named as its folder would be (:func:`job_folder_name`,
    its keys in ``unnamed`` left out), as the jobs that started are."""

    sweep_dir = Path(sweep_dir)
    statuses = collect_statuses(sweep_dir, launch_id=launch_id)
    summary = SweepSummary(
        sweep_dir=str(sweep_dir), launch_id=launch_id, interrupted=stopped_by == INTERRUPTED, stopped_by=stopped_by
    )
    report = report and stopped_by is None
    plan = _launch_plan(sweep_dir, launch_id) if launch_id is not None else None
    started = [set(map(str, s.get("overrides") or [])) for s in statuses]
    # a Slurm task's overrides carry the launcher's additions: a superset of its job's
    never = [job for job in plan or [] if not any(set(job) <= seen for seen in started)]
    summary.not_started = [_planned_job_name(job, unnamed) for job in never]
    for s in statuses:
        kind = s.get("status")
        getattr(summary, "unfinished" if kind == RUNNING else kind if kind in ("ran", "skipped") else "failed").append(
            s["job"]
        )
        if s.get("same_as"):
            summary.same_as[s["job"]] = s["same_as"]
    write_jsonl_atomic(
        sweep_dir / FAILURES_FILE,
        [
            {
                "job": s["job"],
                "overrides": s["overrides"],
                "stage": "unfinished" if s.get("status") == RUNNING else s.get("stage"),
                "refused": s.get("refused"),
                "error": {"type": "Unfinished", "message": UNFINISHED_WHY}
                if s.get("status") == RUNNING
                else s.get("error"),
                "launch_id": s.get("launch_id"),
                "started_at": s.get("started_at"),
                "finished_at": s.get("finished_at"),
            }
            for s in statuses
            if s.get("status") not in ("ran", "skipped")
        ]
        + [  # the jobs a launch cut short never started: no record either, and compare and report say so
            {
                "job": name,
                "overrides": list(job),
                "stage": NOT_STARTED,
                "refused": False,
                "error": {"type": "NotStarted", "message": NOT_STARTED_WHY},
                "launch_id": launch_id,
                "started_at": None,
                "finished_at": None,
            }
            for job, name in zip(never, summary.not_started, strict=True)
        ],
    )
    store_path = sweep_dir / STORE_FILE
    try:
        df = rebuild_store(sweep_dir, store_path)
    except RecordError as exc:  # never the store of an earlier launch beside this launch's summary
        store_path.unlink(missing_ok=True)
        df, summary.store_error = None, str(exc)
    else:
        summary.records, summary.store = len(df), str(store_path)
    out = sweep_dir / REPORT_DIR
    if out.is_dir():  # regenerated from this store, or gone: never a report of records the store left out
        shutil.rmtree(out)
    if report and df is not None and len(df):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its "wrote ..." line: the summary names the report
                code = report_mod.main([str(store_path), f"out={out}"])
        except Exception as exc:  # the records and the store stand; say why the report did not
            code, summary.report_error = 1, f"{type(exc).__name__}: {exc}"
        if code == 0:
            summary.report = str(out)
        elif summary.report_error is None:
            summary.report_error = f"harness report exited with {code}"
    write_json_atomic(sweep_dir / SUMMARY_FILE, {**asdict(summary), "jobs": statuses})
    return summary


def _planned_job_name(job: Any, unnamed: Collection[str]) -> str:
    """A planned job's name as its folder would be named (:func:`job_folder_name`); its overrides
    comma-joined where Hydra's grammar cannot read them (a launch file edited by hand)."""
    try:
        return job_folder_name([str(o) for o in job], unnamed)
    except Exception:  # noqa: BLE001 - a name for the summary, never a reason to leave it unwritten
        return ",".join(map(str, job))


def format_summary(summary: SweepSummary) -> str:
    lines = [
        f"sweep folder {summary.sweep_dir}: "
        + ("interrupted after " if summary.interrupted else "")
        + (f"stopped by {summary.stopped_by} after " if summary.stopped_by and not summary.interrupted else "")
        + f"{len(summary.ran)} ran, {len(summary.skipped)} skipped, {len(summary.failed)} failed"
        + (f", {len(summary.unfinished)} unfinished" if summary.unfinished else "")
        + (f", {len(summary.not_started)} not started" if summary.not_started else "")
    ]
    if summary.skipped:
        lines.append(
            "skipped (complete record with the same manifest hash): "
            + ", ".join(
                f"{j} (same job as {summary.same_as[j]})" if j in summary.same_as else j for j in summary.skipped
            )
        )
    if summary.failed:
        lines.append(f"failed (see {Path(summary.sweep_dir) / FAILURES_FILE}): " + ", ".join(summary.failed))
    if summary.unfinished:
        lines.append(
            "unfinished (started, no end status: killed, or a scheduler still runs it; a relaunch runs it again): "
            + ", ".join(summary.unfinished)
        )
    if summary.not_started:
        lines.append("not started (the launch stopped first; a relaunch runs them): " + "; ".join(summary.not_started))
    if summary.store_error:
        lines.append(f"store and report not written: {summary.store_error}")
        return "\n".join(lines)
    lines.append(f"store: {summary.store} ({summary.records} records)")
    if summary.report:
        lines.append(f"report: {summary.report}")
    elif summary.report_error:
        lines.append(f"report not written: {summary.report_error}")
    elif summary.stopped_by:
        lines.append(
            f"report not written ({'interrupted' if summary.interrupted else 'stopped'}); launch the sweep again to "
            f"finish it (a job a scheduler still runs holds its folder), or `harness report {summary.store}`"
        )
    return "\n".join(lines)


def launching_command() -> str:
    """The command that launched this process's Hydra job, as its refusal lines name it: ``harness
    sweep`` or ``harness run`` (the entry point sets ``sys.argv[0]`` to it; ``harness run`` otherwise)."""
    name = sys.argv[0] if sys.argv else ""
    return name if name in ("harness run", "harness sweep") else "harness run"


class SweepCallback(_Callback):
    """Hydra callback (``hydra.callbacks`` in the root config); runs in the launching process."""

    def __init__(self, report: bool = True) -> None:
        self.report = report
        self.launch_id: str | None = None
        self._lock = None  # the sweep folder's, held from the launch to the summary
        self._sweep_dir: Path | None = None
        #: the override keys job folder names leave out (``hydra.job.config.override_dirname.exclude_keys``)
        self._unnamed: frozenset[str] = frozenset()
        #: the job import variables as they were before the launch set them (None: not set by this launch)
        self._environ: dict[str, str | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """A launcher that runs jobs in other processes (submitit, joblib) pickles the Hydra
        context, this callback included: the copy leaves the launching process's lock behind (a
        held lock is a live generator, and only the launching process releases it)."""
        return {**self.__dict__, "_lock": None, "_environ": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refusal = launcher_refusal(config.hydra)
        if refusal is not None:  # before anything is submitted or written
            print(f"{launching_command()}: refused: {refusal}", file=sys.stderr)
            raise SystemExit(2)  # Hydra turns a callback's exceptions into warnings; this one stops the launch
        jobs = planned_jobs(config.hydra)
        self._unnamed = frozenset(str(k) for k in config.hydra.job.config.override_dirname.exclude_keys)
        problem = sweep_folder_problem(
            str(config.hydra.sweep.dir), config.get("sweep"), jobs=jobs, unnamed=self._unnamed
        )
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if problem is not None:  # before anything is written into it
            print(f"{launching_command()}: refused: {problem}", file=sys.stderr)
            raise SystemExit(2)
        lock = job_lock(sweep_dir, purpose="harness sweep", elsewhere="hydra.sweep.dir=...")
        try:  # one launch at a time per sweep folder: two would take each other's jobs and miscount
            lock.__enter__()
        except JobFolderError as exc:
            print(f"{launching_command()}: refused: the sweep folder {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        self._lock, self._sweep_dir = lock, sweep_dir
        ACTIVE_LAUNCHES.append(self)  # from here a launch cut short is finished (close_unfinished_launches)
        self.launch_id = uuid.uuid4().hex[:12]
        write_json_atomic(
            sweep_dir / LAUNCH_FILE,
            {
                "launch_id": self.launch_id,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "sweep": config.get("sweep"),
                "overrides": OmegaConf.to_container(config.hydra.overrides, resolve=True),
                "sweeper_params": OmegaConf.to_container(config.hydra.sweeper.params, resolve=True)
                if config.hydra.sweeper.get("params")
                else {},
                "planned_jobs": jobs,
                "harness": str(HARNESS_PACKAGE),
            },
        )
        # from here the launcher starts the jobs: their processes import this harness (until _release)
        self._environ = import_launching_harness()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._sweep_dir = Path(str(config.hydra.sweep.dir))
        self._finish(report=self.report)

    def cut_short(self, stopped_by: str) -> None:
        """The launch ended before Hydra's end of the multirun (``stopped_by``: :data:`INTERRUPTED`,
        or the launcher's error): the store, failures file and summary are rebuilt from the records
        the folder holds now, so none of them describes the launch before, and the earlier report is
        removed."""
        self._finish(report=False, stopped_by=stopped_by)

    def _finish(self, *, report: bool, stopped_by: str | None = None) -> None:
        try:
            summary = finish_sweep(
                self._sweep_dir, launch_id=self.launch_id, report=report, stopped_by=stopped_by, unnamed=self._unnamed
            )
        except KeyboardInterrupt:  # during the report, say: close_unfinished_launches finishes the launch again
            if stopped_by is not None:  # that was the second try: the folder stays as it is, unlocked
                self._release()
            raise
        except BaseException:
            self._release()
            raise
        self._release()
        LAST_SUMMARY.clear()
        LAST_SUMMARY.update(asdict(summary))
        print(format_summary(summary), file=sys.stderr)

    def _release(self) -> None:
        if self in ACTIVE_LAUNCHES:
            ACTIVE_LAUNCHES.remove(self)
        if self._environ is not None:
            restore_environ(self._environ)
            self._environ = None
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None


def close_unfinished_launches(exc: BaseException) -> None:
    """Finish every launch of this process that ``exc`` (an interrupt, a launcher's error) cut short
    (:meth:`SweepCallback.cut_short`); a failure while doing so is one line on stderr, and ``exc``
    stays the one the command reports."""
    stopped_by = INTERRUPTED if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"[:300]
    while ACTIVE_LAUNCHES:
        launch = ACTIVE_LAUNCHES[-1]
        try:
            launch.cut_short(stopped_by)
        except BaseException as failure:  # noqa: BLE001 - the launch's own error is what the command reports
            launch._release()
            print(
                f"{launching_command()}: the store and summary of {launch._sweep_dir} were not rebuilt "
                f"({type(failure).__name__}: {failure}); `harness compare {launch._sweep_dir}` reads its records",
                file=sys.stderr,
            )
