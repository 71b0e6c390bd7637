"""Entry points of the commands that compose the `harness run` config: `harness run` (one job, or a
multirun of jobs), `harness sweep NAME`, `harness calibrate` and `harness train`; and `harness
dashboard`, which needs the names of the sweeps and experiments.

Each composes the config (Hydra) and hands it to one function of a room below —
:func:`harness.runner.run_job`, :func:`harness.sweep.run_sweep_job`,
:func:`harness.prepare.sequoia.ensure_tree_artifact`, a trainer of :data:`harness.prepare.TRAINERS` —
and turns the outcome into an exit code and a one-line refusal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import hydra
import torch
from hydra._internal.utils import get_args_parser  # the parser hydra.main uses (no public accessor)
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobStatus
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness import sweep
from harness.cli import one_line, print_usage, report_failure, signals_interrupt
from harness.config import (
    CONF_DIR,
    Config,
    checked_plan,
    compose,
    compose_checked,
    config_loader,
    explain_compose_error,
    offer,
    override_key,
)
from harness.contracts import ConfigError, resolve_ref
from harness.engine.build import plan, sampling_policy, sibling_sampling
from harness.engine.checks import validate_config
from harness.gates.stages import GateError
from harness.heads.artifacts import refuse_foreign
from harness.heads.checkpoint import ArtifactError
from harness.heads.published import is_published_checkpoint
from harness.manifest import draft_model_config
from harness.prepare import TRAINERS
from harness.prepare.sequoia import ensure_tree_artifact, idle_nodes_note, slower_than_ar_note
from harness.prepare.trained import noting_outcomes
from harness.runner import (
    build_context,
    check_model_options,
    check_training_job,
    draft_model_key,
    load,
    load_models,
    plan_job,
    run_job,
    run_notes,
    user_output_dir_problem,
)
from harness.target.loading import cache_root
from harness.tracking import dashboard
from harness.tracking.job_folder import LOCK_FILENAME, JobFolderError, job_lock
from harness.verifiers.base import NegotiationError

#: what a command reports as a refusal besides ValueError and an OSError about a path: a failed gate, and a config
#: Hydra or OmegaConf could not compose (a mistyped key or group option, a wrong type)
REFUSALS = (GateError, HydraException, OmegaConfBaseException)


#: top-level options that say how a multirun is launched, not what a job runs
LAUNCH_OPTIONS = ("concurrent_jobs",)


#: the flags that make `harness run` a multirun
MULTIRUN_FLAGS = ("-m", "--multirun")


def is_multirun(argv: list[str]) -> bool:
    """Whether Hydra runs ``argv`` as a multirun: ``-m``/``--multirun``, or ``hydra.mode=MULTIRUN``
    (as Hydra reads it: quoted, ``++``, or its value ``2``) where no later override sets the mode back."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(a in MULTIRUN_FLAGS for a in argv):
        return True
    parser = OverridesParser.create()
    mode = None
    for a in argv:
        if a.startswith("-") or a.lstrip("+~").split("=", 1)[0].strip() != "hydra.mode":
            continue
        try:
            (override,) = parser.parse_overrides([a])
        except HydraException:  # the grammar cannot read it: composition refuses it
            continue
        mode = None if override.is_delete() else override.value()
    return mode in ("MULTIRUN", 2)


def is_plain_run(argv: list[str]) -> bool:
    """A single run given only overrides (no Hydra flags such as --multirun, --cfg, --help, and no
    ``hydra.mode=MULTIRUN``)."""
    return not any(a.startswith("-") for a in argv) and not is_multirun(argv)


def preflight(argv: list[str]) -> None:
    """Everything a plain `harness run` refuses from its config alone, before Hydra creates its run
    folder: composition, values, negotiation, budgets, the workload, the output folder and a
    multirun's launch options (:func:`check_one_job`)."""
    cfg, _ = checked_plan(argv)
    check_one_job(cfg)


def check_one_job(cfg: DictConfig) -> None:
    """A single run is one job: ``concurrent_jobs``, how many of a multirun's jobs its launcher runs
    at once (each job's record says it, and compare reads it as the machine's sharing), is refused
    other than 1, which a record would state while no other job ran beside it."""
    if int(cfg.concurrent_jobs) != 1:
        raise ConfigError(
            f"concurrent_jobs={cfg.concurrent_jobs} is a sweep option (how many of a multirun's jobs run at once); "
            "a single run is one job: drop it, or sweep (harness run -m ..., harness sweep NAME)"
        )


def check_alone(cfg: DictConfig, command: str) -> None:
    """`harness calibrate` and `harness train` are one job each, timed alone: ``concurrent_jobs``, which
    the artifacts they time record as the jobs that shared the machine (a run alone would measure such
    an artifact again), is refused other than 1."""
    if int(cfg.concurrent_jobs) != 1:
        raise ConfigError(
            f"concurrent_jobs={cfg.concurrent_jobs} is a sweep option (how many of a multirun's jobs run at once); "
            f"harness {command} is one job, timed alone: drop it"
        )


#: launchers that run a multirun's jobs on this machine (in this process or beside it)
LOCAL_LAUNCHERS = ("BasicLauncher", "JoblibLauncher", "LocalLauncher")


def multirun_jobs(argv: list[str]) -> tuple[list[list[str]], str, set[str], bool, list[str]]:
    """The override lists of a multirun's jobs, as Hydra's basic sweeper makes them (the sweep
    parameters the composed config holds, ``hydra.sweeper.params``: a sweep file's axes, followed
    by the command line's overrides, crossed), the launcher's ``_target_``, the override keys
    a job's folder name leaves out, whether the folders are named by the overrides (the root
    config's ``hydra.sweep.subdir``), and the overrides the launcher adds to every job that does
    not set their keys (``hydra.launcher.job_overrides``, the Slurm launcher's ``model.device=cuda``).
    ``argv`` holds no flag but ``-m``/``--multirun``. A ``glob(...)`` sweep lists its group's
    options through Hydra's config loader, as the sweeper does. An axis that lists no value (no job
    at all) is a :class:`ConfigError` naming it (:func:`empty_axis`)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if a not in MULTIRUN_FLAGS]
    parser = OverridesParser.create(config_loader=config_loader())
    fixed = [o.input_line for o in parser.parse_overrides(overrides) if not o.is_sweep_override()]
    cfg = compose(fixed, return_hydra_config=True)
    params = cfg.hydra.sweeper.get("params") or {}
    from_config = [f"{k}={v}" for k, v in params.items()]
    parsed = parser.parse_overrides([*from_config, *overrides])
    jobs = [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    if not jobs:
        raise ConfigError(f"{empty_axis(parsed)}: the multirun would run no job; give the axis at least one value")
    unnamed = {str(k) for k in cfg.hydra.job.config.override_dirname.exclude_keys}
    subdir = OmegaConf.to_container(cfg.hydra.sweep, resolve=False).get("subdir")
    by_overrides = subdir == "${hydra.job.override_dirname}"
    added = cfg.hydra.launcher.get("job_overrides") or []
    added = [str(o) for o in added] if isinstance(added, list | ListConfig) else []  # a bad value: the launcher says
    return jobs, str(cfg.hydra.launcher.get("_target_", "")), unnamed, by_overrides, added


def empty_axis(parsed: list) -> str:
    """The sweep override (``seed=range(0,0)``, ``verifier=glob(zzz*)``) among Hydra's ``parsed``
    overrides of a multirun that lists no value, named as given (as a sweep file's
    ``hydra.sweeper.params`` entry, or on the command line); the last override of a key is the one
    the sweeper reads, as Hydra's basic sweeper does."""
    last = {o.get_key_element(): o for o in parsed}
    for o in last.values():
        if o.is_sweep_override() and o.is_discrete_sweep() and not list(o.sweep_string_iterator()):
            return f"{o.input_line} lists no value"
    return "no sweep axis lists a value"


#: the longest file name most file systems take, in bytes
NAME_MAX = 255


def fixed_overrides(argv: list[str]) -> list[str]:
    """The overrides of a multirun's command line that every job shares (no sweep, no flag), or none
    where Hydra's grammar cannot read them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if not a.startswith("-")]
    try:
        return [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if not o.is_sweep_override()]
    except HydraException:
        return []


def remote_job_overrides(job: list[str], added: list[str]) -> list[str]:
    """A job's overrides as a remote launcher runs it, with its ``job_overrides`` added."""
    from hydra_plugins.harness_launcher.slurm import with_job_overrides  # only a remote launch needs it

    return with_job_overrides(job, added)


def preflight_multirun(argv: list[str], *, command: str = "run") -> None:
    """Every job of a multirun checked as a plain run's preflight checks it (composition, values,
    negotiation, budgets, the workload; only the values where the launcher runs the jobs on other
    machines, whose models, paths and devices may not be here), before Hydra's sweeper starts the
    first. A job refused for anything but the combination of its methods (a value out of range, an
    unknown option, a batch larger than the workload, ...) refuses the whole launch, naming the
    job: nothing runs or is written. A job whose proposer, topology, verifier and temperature do not
    go together (:class:`NegotiationError`; a cross of axes may hold such holes) is named on stderr
    and the others run; it is recorded as refused. Skipped where the command line carries Hydra
    flags other than ``-m`` (``--cfg``, ``-cd``, ...)."""
    if any(a.startswith("-") and a not in MULTIRUN_FLAGS for a in argv):
        return
    try:
        jobs, launcher, unnamed, by_overrides, added = multirun_jobs(argv)
    except (HydraException, OmegaConfBaseException) as exc:
        error = explain_compose_error(exc, argv)
        raise offer(error, [o for o in fixed_overrides(argv) if o != error.replaces]) from exc
    named = [o for o in jobs[0] if override_key(o) not in unnamed and not override_key(o).startswith("hydra")]
    if len(jobs) == 1 and not named:
        raise ConfigError(  # its folder would be the sweep folder itself, its record beside the sweep's files
            "the multirun has one job and nothing to name its folder by: a sweep crosses axes "
            "(hydra.sweeper.params in a sweep file, or a,b values on the command line); `harness run` runs one job"
        )
    here = launcher.rsplit(".", 1)[-1] in LOCAL_LAUNCHERS
    values: dict[str, set[str]] = {}
    for job in jobs:
        for o in job:
            values.setdefault(override_key(o), set()).add(o)
    swept = {k for k, v in values.items() if len(v) > 1}  # what tells the jobs apart
    seen: dict[tuple[str, ...], int] = {}
    for i, job in enumerate(jobs):  # a value listed twice makes one job twice: the second would skip the first
        if tuple(job) in seen:
            told = ",".join(o for o in job if override_key(o) in swept) or " ".join(job)
            raise ConfigError(
                f"jobs {seen[tuple(job)] + 1} and {i + 1} of {len(jobs)} are the same job ({told}): "
                "a sweep value is listed twice; list each once"
            )
        seen[tuple(job)] = i
    holes: list[tuple[str, str]] = []  # (job, why it will be refused)
    folders: dict[str, int] = {}
    runs: dict[str, int] = {}  # what a job runs and checks -> the first job that runs it
    for i, job in enumerate(jobs):
        told = ",".join(o for o in job if override_key(o) in swept)
        name = f"job {i + 1} of {len(jobs)}" + (f" ({told})" if told else "")
        # named as the job's own Hydra names it: a remote launcher's job overrides are among its task's
        launched = job if here or not added else remote_job_overrides(job, added)
        folder = sweep.job_folder_name(launched, unnamed) if by_overrides else ""
        if by_overrides and folder in folders:  # the second would skip as the first's, or find it busy
            only = sorted({override_key(o) for o in job if override_key(o) in swept and override_key(o) in unnamed})
            raise ConfigError(
                f"jobs {folders[folder] + 1} and {i + 1} of {len(jobs)} would share one folder ({folder or 'the sweep'}"
                f"'s): {', '.join(only) or 'what tells them apart'} is left out of job folder names (it changes how a "
                "job is launched or logged, not what it measures); sweep it in separate launches"
            )
        folders[folder] = i
        long = [part for part in folder.split("/") if len(part.encode()) > NAME_MAX]
        if long:  # the file system refuses the folder once the launch has written its own files
            raise ConfigError(
                f"{name}: its folder name, its overrides joined, is {len(long[0].encode())} bytes; file systems take "
                f"{NAME_MAX}: move the settings every job shares into a sweep file (harness sweep PATH.yaml), or name "
                "the folders with hydra.sweep.subdir=<pattern>; no job was run"
            )
        try:
            if here:
                cfg, _ = checked_plan(job)
            else:  # as the job runs there: with the launcher's overrides, on that machine's devices
                cfg = compose_checked(remote_job_overrides(job, added))
                validate_config(cfg, devices_here=False)
                check_model_options(cfg.model, "model", here=False)  # a CPU kernel on the jobs' GPU
                draft = draft_model_config(cfg)
                if draft is not None:
                    check_model_options(draft, draft_model_key(cfg), here=False)
            if cfg.output_dir:
                raise ConfigError(
                    f"output_dir={cfg.output_dir!r} is for single runs; a multirun writes each job to "
                    "hydra.sweep.dir/hydra.sweep.subdir"
                )
        except NegotiationError as exc:
            holes.append((name, one_line(exc)))
            continue
        except (ValueError, OSError, *REFUSALS) as exc:
            refusal = one_line(exc) or type(exc).__name__
            raise ConfigError(f"{name}: {refusal}; no job was run") from exc
        run = run_identity(cfg, job)
        if run in runs:  # both would run in one batch, or the second skip as the first's twin
            first = jobs[runs[run]]
            said = [",".join(o for o in j if override_key(o) in swept) or " ".join(j) for j in (first, job)]
            raise ConfigError(
                f"jobs {runs[run] + 1} and {i + 1} of {len(jobs)} run the same configuration ({said[0]} and "
                f"{said[1]}): their values are written differently but compose to one job; list it once"
            )
        runs[run] = i
    if holes and len(holes) == len(jobs):
        raise ConfigError(f"every job would be refused, e.g. {holes[0][1]}")
    note = launcher_width_note(argv)
    if note:
        print(f"harness {command}: note: {note}", file=sys.stderr)
    for name, why in holes:
        print(f"harness {command}: {name} will be refused: {why}; the other jobs run", file=sys.stderr)


def run_identity(cfg: DictConfig, overrides: Sequence[str] = ()) -> str:
    """What a job runs and checks, as one string: its resolved config without the launch-only keys
    (:func:`harness.sweep._ran_and_checked`, what tells a sweep job's record from another's), and its
    ``hydra.*`` overrides, which the composed config does not hold (``+hydra.job.env_set.X=...`` sets
    the job's environment)."""
    ran = sweep._ran_and_checked(OmegaConf.to_container(cfg, resolve=True))
    hydra = sorted(o for o in overrides if override_key(o).startswith("hydra."))
    return json.dumps({"config": ran, "hydra": hydra}, sort_keys=True, default=str)


def launcher_width_note(argv: list[str]) -> str | None:
    """A note when ``hydra.launcher.n_jobs`` asks for more jobs at once than ``concurrent_jobs``
    lets through (the sweeper hands the launcher batches of ``concurrent_jobs``), else None."""
    given = {a.split("=", 1)[0].lstrip("+"): a.split("=", 1)[1] for a in argv if "=" in a}
    if "hydra.sweeper.max_batch_size" in given or "hydra.launcher.sweep_batch" in given:
        return None  # the batches are set apart from concurrent_jobs
    try:
        n_jobs = int(given["hydra.launcher.n_jobs"])
        concurrent = int(given.get("concurrent_jobs", 1))
    except (KeyError, ValueError):
        return None
    if n_jobs > concurrent:
        return (
            f"hydra.launcher.n_jobs={n_jobs} runs {concurrent} job(s) at once: the sweeper hands the launcher "
            f"batches of concurrent_jobs={concurrent} (set concurrent_jobs={n_jobs} to run {n_jobs} at once, each "
            "job timed beside the others)"
        )
    return None


def check_launch_options(argv: list[str]) -> None:
    """A multirun's launch-only options (``concurrent_jobs``) checked against their declared ranges
    before Hydra's sweeper sees them (it would stop on an assertion, after writing its folder)."""
    ranges = {f.name: f.metadata["range"] for f in dataclasses.fields(Config) if f.name in LAUNCH_OPTIONS}
    for arg in argv:
        key, eq, text = arg.lstrip("+~").partition("=")
        if not eq or key not in ranges:
            continue
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(
                f"{key}={text} is not one whole number: launch options take one value for the whole sweep"
            ) from None
        ranges[key].check(key, value)


def check_flags(argv: list[str], command: str) -> None:
    """Hydra's command line parsed as `hydra.main` will parse it, its usage error raised as one
    line instead of argparse's usage text and exit."""
    if any(a in {"-h", "--help", "--hydra-help"} for a in argv):
        return
    parser = get_args_parser()

    def error(message: str):
        raise ConfigError(f"{message} (Hydra flags such as -m come before the overrides; --help lists them)")

    parser.error = error
    parser.parse_args(argv)


class _JobLogTee:
    """``sys.stderr`` during a Hydra job: everything passes through, and each whole line the harness
    prints (its notes, warnings and refusals: lines starting ``harness``) is also written to the
    job's log file (Hydra's ``<job>.log`` beside the record), which otherwise held Python logging's
    lines alone. Progress bars (lines redrawn with ``\\r``) stay on the console."""

    def __init__(self, stream, files) -> None:
        self._stream, self._files, self._line = stream, files, ""

    def write(self, text: str) -> int:
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            if line.startswith("harness") and "\r" not in line:
                for f in self._files:
                    try:
                        f.write(line + "\n")
                        f.flush()
                    except (OSError, ValueError):  # a closed or moved log: the console still has it
                        pass
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def job_log_tee():
    """The harness's stderr lines also in the log file(s) Hydra's job logging opened (none: as is)."""
    files = [h.stream for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler) and h.stream]
    if not files:
        yield
        return
    stderr = sys.stderr
    sys.stderr = _JobLogTee(stderr, files)
    try:
        yield
    finally:
        sys.stderr = stderr


def run_main(argv: list[str] | None = None, *, command: str = "run") -> int:

    argv = list(sys.argv[1:] if argv is None else argv)
    status = {"code": 0}
    try:
        check_flags(argv, command)
        cache_root()  # a cache variable that cannot serve is refused before anything is written
        if is_plain_run(argv):
            preflight(argv)
        else:
            check_launch_options(argv)
            if is_multirun(argv):
                preflight_multirun(argv, command=command)
    except Exception as exc:  # reported in one line; nothing has been written yet
        return report_failure(command, exc, refusals=REFUSALS)

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _entry(cfg: DictConfig) -> dict | None:
        # every file a job writes goes to its folder by an absolute path, so ``hydra.job.chdir=true``
        # changes nothing there; the paths it reads (prompts, checkpoints, corpora) are the ones given
        # on the command line, relative to where the command ran
        hydra_cfg = HydraConfig.get()
        back = contextlib.chdir(hydra_cfg.runtime.cwd) if hydra_cfg.job.chdir else contextlib.nullcontext()
        with back, job_log_tee():
            return _job(cfg)

    def _job(cfg: DictConfig) -> dict | None:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode.name == "MULTIRUN":  # skip finished jobs; a failing job never stops the sweep
            job = sweep.run_sweep_job(cfg, hydra_cfg=hydra_cfg)
            if job["status"] == "failed":
                status["code"] = 1  # seen here when the launcher runs jobs in this process
            return job
        run_dir = Path(cfg.output_dir or hydra_cfg.runtime.output_dir)
        try:
            check_one_job(cfg)  # where the preflight did not run (a command line with Hydra flags)
            record = run_job(cfg, run_dir=run_dir)  # logs to W&B itself with tracking=wandb
        except (Exception, KeyboardInterrupt) as exc:  # interrupted too: Hydra's end then cleans the folder up
            status["code"] = report_failure(command, exc, refusals=REFUSALS)
            return None
        m = record["metrics"]
        print(
            json.dumps(
                {
                    "record": str(run_dir / "record.json"),
                    "exact": record["exact"],  # false: a heuristic verifier, its outputs not the target's law
                    "gated": record["gated"],  # false: a gate was switched off or skipped
                    # end to end: prefill (a draft's prompt forward included) + decode, per token
                    "speedup": m["speedup"],
                    "speedup_ci95": m.get("speedup_ci95"),  # over prompts: how far another draw could move it
                    "end_to_end_time_per_token_ms": m.get("end_to_end_time_per_token_ms"),
                    "ar_end_to_end_time_per_token_ms": m.get("ar_end_to_end_time_per_token_ms"),
                    # the round loop alone
                    "decode_speedup": m.get("decode_speedup"),
                    "decode_speedup_ci95": m.get("decode_speedup_ci95"),
                    "time_per_committed_token_ms": m["time_per_committed_token_ms"],
                    "ar_time_per_token_ms": m["ar_time_per_token_ms"],
                    "mean_committed_per_round": m["mean_committed_per_round"],
                    "greedy_identical": m["greedy_identical"],
                    "timing_outliers": len(m.get("timing_outliers") or []),
                },
                indent=2,
            )
        )
        for note in run_notes(record):
            print(f"harness {command}: note: {note}", file=sys.stderr)
        return {"record": str(run_dir / "record.json")}  # a finished run (its Hydra folder is kept)

    multirun = is_multirun(argv)
    sweep.LAST_SUMMARY.clear()
    old_argv, old_full_error = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = [f"harness {command}"] + argv
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing a traceback; reported below
    try:
        with signals_interrupt():  # SIGTERM, SIGHUP: the put-back and clean-up of Ctrl-C, then 128 + the signal
            _entry()
    except KeyboardInterrupt as exc:  # a sweep cut short: its store and summary say what the folder holds now
        sweep.close_unfinished_launches(exc)
        raise
    except SystemExit as exc:  # a refusal before any job (a busy folder, a Slurm launcher without a partition)
        sweep.close_unfinished_launches(exc)
        return exc.code if isinstance(exc.code, int) else 1
    except (HydraException, OmegaConfBaseException) as exc:  # a multirun's composition error
        sweep.close_unfinished_launches(exc)
        return report_failure(command, explain_compose_error(exc, argv), refusals=REFUSALS)
    except Exception as exc:  # e.g. a run folder Hydra cannot create, a launcher's worker that died
        sweep.close_unfinished_launches(exc)
        return report_failure(command, exc, refusals=REFUSALS)
    finally:
        sys.argv = old_argv
        if old_full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = old_full_error
    if multirun:
        return multirun_exit_code(status["code"], command=command)
    return status["code"]


def multirun_exit_code(in_process_code: int, *, command: str = "run") -> int:
    """A multirun's exit code from the sweep summary the launching process wrote (whatever the
    launcher, jobs in this process or not): non-zero, naming the failed jobs, when any failed."""
    summary = sweep.LAST_SUMMARY
    if not summary:
        print(
            f"harness {command}: the multirun finished without a sweep summary (was hydra.callbacks changed?)",
            file=sys.stderr,
        )
        return in_process_code or 1
    print(  # the command's result on stdout, as a single run prints its record's
        json.dumps(
            {
                "sweep_dir": summary["sweep_dir"],
                "summary": str(Path(summary["sweep_dir"]) / sweep.SUMMARY_FILE),
                "store": summary.get("store"),
                "report": summary.get("report"),
                **{k: len(summary.get(k) or []) for k in ("ran", "skipped", "failed", "unfinished")},
            }
        )
    )
    if summary.get("failed"):
        print(
            f"harness {command}: {len(summary['failed'])} job(s) failed: {', '.join(summary['failed'])} "
            f"(errors in {Path(summary['sweep_dir']) / sweep.FAILURES_FILE})",
            file=sys.stderr,
        )
    if summary.get("unfinished"):
        print(
            f"harness {command}: {len(summary['unfinished'])} job(s) did not finish: "
            f"{', '.join(summary['unfinished'])} (killed, or a scheduler still runs them; a relaunch runs them again)",
            file=sys.stderr,
        )
    if summary.get("failed") or summary.get("unfinished"):
        return 1
    if summary.get("store_error"):
        print(f"harness {command}: the sweep's store was not written: {summary['store_error']}", file=sys.stderr)
        return 1
    return in_process_code


class RunFolderLock(Callback):
    """Hydra callback (root config): a single run takes its folder's lock before Hydra writes its
    ``.hydra/`` files and log there, and holds it to the end; a second run pointed at a folder a
    live run holds is refused with one line and exit code 2, leaving that folder untouched, and so
    is a run folder that ``output_dir`` would not be given (inside another run's or a sweep's, above
    other runs' records, holding user files)."""

    def __init__(self) -> None:
        self._lock = None
        self._folder: Path | None = None  # a folder this run created: removed if it writes nothing
        self._subdir: Path | None = None  # Hydra's files of this run in a folder that was there
        self._logs: tuple[Path, dict[Path, int]] | None = None  # a folder that was there, its logs' sizes
        self._parents: list[Path] = []  # folders above a created run folder that were not there, deepest first

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # as Hydra does next, to resolve hydra.run.dir
        folder = Path(str(config.hydra.run.dir))
        if not config.get("output_dir"):  # Hydra's run folder (hydra.run.dir=... or its default) is checked
            problem = user_output_dir_problem(folder, key="hydra.run.dir")  # as output_dir is, before Hydra writes
            if problem is not None:
                print(f"harness run: refused: {problem}", file=sys.stderr)
                raise SystemExit(2) from None
        created = not folder.exists()
        parents = _absent_parents(folder) if created else []
        lock = job_lock(folder)
        try:
            lock.__enter__()
        except JobFolderError as exc:
            print(f"harness run: refused: {exc}", file=sys.stderr)
            raise SystemExit(2) from None  # Hydra turns a callback's exceptions into warnings
        self._lock, self._folder, self._parents = lock, folder if created else None, parents
        subdir = folder / str(config.hydra.output_subdir)
        self._subdir = subdir if not created and not subdir.exists() else None
        self._logs = None if created else (folder, {p: p.stat().st_size for p in folder.glob("*.log") if p.is_file()})

    def on_job_end(self, config: DictConfig, job_return=None, **kwargs) -> None:
        if job_return is not None and job_return.status == JobStatus.COMPLETED and job_return.return_value:
            self._folder = self._subdir = self._logs = None  # the run finished: its Hydra files and log lines stay
            self._parents = []

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        if self._folder is not None:
            remove_hydra_files_of_a_run_that_wrote_nothing(self._folder)
        if self._subdir is not None and self._subdir.is_dir():  # a refused run into an existing folder
            shutil.rmtree(self._subdir, ignore_errors=True)
            if self._subdir.parent.name == ".hydra" and not any(self._subdir.parent.iterdir()):
                self._subdir.parent.rmdir()
            self._subdir = None
        if self._logs is not None:  # a refused run into an existing folder: its log lines go too
            restore_logs(*self._logs)
            self._logs = None
        if self._lock is not None:
            self._lock.__exit__(None, None, None)  # removes the folder when only its lock is left
            self._lock = None
        for parent in self._parents:  # the folders above it the run created, while they stay empty
            try:
                parent.rmdir()
            except OSError:
                break
        self._parents = []


def _absent_parents(folder: Path) -> list[Path]:
    """The folders above ``folder`` that do not exist yet, deepest first (those a run into
    ``folder`` creates)."""
    out = []
    for parent in folder.absolute().parents:
        if parent.exists():
            break
        out.append(parent)
    return out


def restore_logs(folder: Path, sizes: dict[Path, int]) -> None:
    """Cut each log file of ``folder`` back to its size in ``sizes`` (the folder's logs before a refused
    run appended to them) and remove the log files that run created."""
    for path in folder.glob("*.log"):
        try:
            if path not in sizes:
                path.unlink()
            elif path.stat().st_size > sizes[path]:
                os.truncate(path, sizes[path])
        except OSError:
            pass  # a log that cannot be restored is left as it is; the refusal was reported


def remove_hydra_files_of_a_run_that_wrote_nothing(folder: Path) -> None:
    """Remove ``.hydra/`` and the log from a folder this run created when nothing else is there (the
    job was refused or failed before writing): a refused run leaves no run folder behind."""
    entries = list(folder.iterdir())
    if not all(p.name in {".hydra", LOCK_FILENAME} or (p.is_file() and p.suffix == ".log") for p in entries):
        return
    for p in entries:
        if p.name == ".hydra":
            shutil.rmtree(p, ignore_errors=True)
        elif p.name != LOCK_FILENAME:
            p.unlink(missing_ok=True)


def sweep_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep.LAST_SUMMARY.clear()  # a launch refused before it starts leaves no summary of an earlier one
    if not argv or argv[0] in {"-h", "--help"}:
        return print_usage(sweep.USAGE, bool(argv))
    if argv[0] == "--list":
        if argv[1:]:
            return report_failure("sweep", ConfigError(f"--list takes no arguments; got {argv[1:]}"))
        for name in sweep.list_sweeps():
            print(name)
        return 0
    try:
        run_argv = sweep.sweep_argv(argv[0], argv[1:])
    except ValueError as exc:
        return report_failure("sweep", ValueError(f"{exc} (harness sweep --help shows the usage)"))
    try:
        code = run_main(run_argv, command="sweep")  # a multirun: non-zero, naming them, when jobs failed
    except SystemExit as exc:  # Hydra exits after --help / --info
        code = exc.code if isinstance(exc.code, int) else 1
    return int(code)


# --------------------------------------------------------------------------- harness calibrate

CALIBRATE_USAGE = """usage: harness calibrate [hydra overrides, as for `harness run`]

Writes fresh Sequoia artifacts for the composed config (topology=sequoia is implied; another
topology is refused, since only Sequoia's trees are calibrated): the positional-acceptance
calibration, measured again, and the chosen tree, under $HARNESS_CACHE/sequoia (a run with the
same overrides and topology=sequoia then loads them). The hardware profile t(n), c0, c is measured
where none matches this target, draft, batch size and machine; a matching one is reused (other
configurations' trees bind it), unless topology.reuse=false measures it again. A calibration or
profile measured again replaces the cached file; the one it replaces is kept beside it, named by its
content hash, for the trees that bind it (topology.tree_artifact=...)."""


def with_sequoia(overrides: list[str]) -> list[str]:
    """``overrides`` with ``topology=sequoia`` first unless a topology is given."""
    overrides = list(overrides)
    if not any(o.split("=", 1)[0].lstrip("+~") == "topology" for o in overrides):
        overrides.insert(0, "topology=sequoia")
    return overrides


def require_sequoia(cfg: DictConfig) -> None:
    if cfg.topology.name != "sequoia":
        raise ConfigError(
            f"harness calibrate writes Sequoia artifacts: it needs topology=sequoia; got topology={cfg.topology.name}",
            suggestions=[("topology=sequoia",)],
        )


def calibrate(cfg: DictConfig, *, progress: bool = True, unread: Sequence[str] = ()) -> dict:
    """Load the models of ``cfg``, write fresh calibration, profile and tree artifacts; return paths
    (the summary, with ``notes``: what the choice says that its figures do not show). ``unread``,
    the options given that calibrate does not read, are said once the models load (nothing refused)."""

    require_sequoia(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    loaded = load(cfg, plan_job(cfg, None))  # every refusal the run would make comes first, before model work
    note_unread("calibrate", unread)
    arts = ensure_tree_artifact(cfg, build_context(cfg, loaded), force=True, progress=progress)
    out = arts.summary()
    out["notes"] = [n for n in (slower_than_ar_note(out["chosen"]), idle_nodes_note(arts.tree)) if n]
    return out


#: options of a run that `harness calibrate` does not read (it measures, writes its artifacts to
#: the cache and runs no decode): (override prefix, why)
CALIBRATE_UNREAD = (
    ("output_dir", "calibrate writes its artifacts to $HARNESS_CACHE/sequoia"),
    ("gates", "calibrate runs no gate"),
    ("allow_leakage", "calibrate runs no gate"),
    ("tracking", "calibrate logs nothing to W&B"),
    ("generation.max_new_tokens", "calibrate decodes topology.calibration.max_new_tokens per calibration prompt"),
    ("generation.warmup_tokens", "calibrate runs no timed arms to warm up"),
    ("generation.temp_kv_budget_bytes", "calibrate verifies topology.calibration.branches rows a round"),
    ("workload.limit", "calibrate reads the calibration split, topology.calibration.prompts of it"),
    ("hydra", "calibrate is no Hydra job: its artifacts go to $HARNESS_CACHE/sequoia"),
)


#: options of a run that `harness train` does not read (it writes one artifact to the cache)
TRAIN_UNREAD = (
    ("output_dir", "train writes its artifact to $HARNESS_CACHE/artifacts, by target and recipe (printed as path)"),
    ("gates", "train runs no gate"),
    ("tracking", "train logs nothing to W&B"),
    ("hydra", "train is no Hydra job: its artifact goes to the cache"),
    ("generation", "train decodes nothing: it trains on proposer.data (a skip search on proposer.search)"),
    ("verifier", "train verifies nothing"),
    ("topology", "train drafts no tree"),
    ("workload.limit", "train reads no evaluation prompts"),
    ("workload.per_category", "train reads no evaluation prompts"),
    ("workload.categories", "train reads no evaluation prompts"),
    ("workload.path", "train reads no evaluation prompts"),
    ("workload.chat", "train formats its documents by proposer.data.chat"),
    ("workload.truncate", "train reads no evaluation prompts"),
    ("allow_leakage", "train evaluates no prompts"),
    ("seed", "train seeds from the recipe (proposer.train.seed, proposer.search.seed)"),
)


def note_unread(command: str, unread: Sequence[str]) -> None:
    """Say on stderr the options given to ``harness <command>`` that it does not read (from
    :func:`unread_options`); called once the command proceeds, so a refusal stays its only line."""
    if unread:
        print(f"harness {command}: note: option(s) with no effect here: {'; '.join(unread)}", file=sys.stderr)


def unread_options(argv: list[str], unread=CALIBRATE_UNREAD) -> list[str]:
    """The overrides given to `harness calibrate` (or, with ``unread=TRAIN_UNREAD``, `harness train`)
    that it does not read, each as ``key=value: why``."""
    out = []
    for arg in argv:
        key = arg.lstrip("+~").split("=", 1)[0]
        for prefix, why in unread:
            if "=" in arg and (key == prefix or key.startswith(f"{prefix}.")):
                out.append(f"{arg.lstrip('+~')}: {why}")
    return out


def check_calibrate_options(cfg: DictConfig) -> None:
    """Refuse the run options that would make `harness calibrate` measure less than it says: a tree or
    a calibration to load (it measures and writes them), and ``concurrent_jobs`` (:func:`check_alone`)."""
    if cfg.topology.get("tree_artifact"):
        raise ConfigError(
            f"topology.tree_artifact={cfg.topology.tree_artifact} names a tree to load: harness calibrate "
            "measures and writes one (a run loads a given tree: harness run topology.tree_artifact=...)"
        )
    if cfg.topology.get("calibration_artifact"):
        raise ConfigError(
            f"topology.calibration_artifact={cfg.topology.calibration_artifact} names a calibration to load: "
            "harness calibrate measures one again (a run loads a given calibration: harness run "
            "topology.calibration_artifact=...)"
        )
    check_alone(cfg, "calibrate")


def calibrate_main(argv: list[str]) -> int:
    if any(a in {"-h", "--help"} for a in argv):
        print(CALIBRATE_USAGE)
        return 0
    flags = [a for a in argv if a.startswith("-")]
    if flags:  # Hydra's lexer stopped at them: "LexerNoViableAltException: -m ^"
        return report_failure(
            "calibrate",
            ConfigError(f"harness calibrate takes key=value overrides, not flags; got {flags} (one job, no -m)"),
        )
    overrides = with_sequoia(argv)
    try:
        try:
            check_calibrate_options(compose_checked(overrides))  # before the run's checks read a named file
            cfg, _ = checked_plan(overrides)
            out = calibrate(cfg, unread=unread_options(argv))
        except ConfigError as exc:  # offer only fixes calibrate accepts (a Sequoia tree, a sampling draft)
            if "cannot build topology=sequoia" in exc.reason:
                sampling = sibling_sampling(sampling_policy(compose_checked(overrides)))
                exc = type(exc)(
                    exc.reason,
                    suggestions=[*exc.suggestions, ("proposer=draft_model", f"proposer.sampling={sampling}")],
                    replaces=exc.replaces,
                )
            raise offer(exc, overrides, accept=lambda c: (plan(c), require_sequoia(c))) from exc
    except Exception as exc:
        return report_failure("calibrate", exc, refusals=REFUSALS)
    for note in out["notes"]:
        print(f"harness calibrate: note: {note}", file=sys.stderr)
    print(json.dumps(out, indent=2))
    return 0


# --------------------------------------------------------------------------- harness train

TRAIN_USAGE = f"""usage: harness train proposer=<{"|".join(TRAINERS)}> [hydra overrides...] [force=true]

Builds a proposer's trained or searched artifact for the configured target, e.g.
    harness train proposer=hydra [model=smollm2] [proposer.data.token_budget=20000] [force=true]
    harness train proposer=early_exit model=tiny proposer.exit_layer=1
    harness train proposer=eagle [proposer.train.epochs=1] [proposer.data.token_budget=40000]
    harness train proposer=layer_skip proposer.search.trials=20
The same config composition as `harness run`, so the artifact's recipe is exactly the one a run
with the same overrides looks for. Prints the artifact's manifest summary as JSON; an artifact
that exists is printed as it is ("reused": true), force=true retrains it."""


def train_main(argv: list[str]) -> int:
    if not argv or any(a in {"-h", "--help"} for a in argv):
        return print_usage(TRAIN_USAGE, bool(argv))
    flags = [a for a in argv if a.startswith("-")]
    if flags:
        return report_failure(
            "train",
            ConfigError(f"harness train takes key=value overrides, not flags; got {flags} (force=true retrains)"),
        )
    try:
        summary = train(argv)
    except Exception as exc:
        return report_failure("train", exc, refusals=REFUSALS)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def training_accepts(cfg: DictConfig) -> None:
    """What `harness train` refuses from the config alone (a fix it offers passes these)."""
    validate_config(cfg)
    check_training_job(cfg)


def train(argv: list[str]) -> dict:
    """The artifact ``harness train argv`` builds (its manifest summary); refusals raise."""
    forced = [a.split("=", 1)[1].lower() for a in argv if a.startswith("force=")]
    if len(forced) > 1:
        raise ConfigError(
            f"force= given {len(forced)} times ({', '.join('force=' + f for f in forced)}): give it once",
            suggestions=[("force=true",), ("force=false",)],
        )
    if any(f not in {"true", "false", "1", "0", "yes", "no"} for f in forced):
        raise ConfigError(f"force={forced[-1]} is no boolean", suggestions=[("force=true",), ("force=false",)])
    force = any(f in {"true", "1", "yes"} for f in forced)
    overrides = [a for a in argv if not a.startswith("force=")]
    cfg = compose_checked(overrides)
    name = cfg.proposer.name
    try:
        if name not in TRAINERS:
            raise ConfigError(
                f"proposer={name} has no trained artifact",
                suggestions=[(f"proposer={t}",) for t in sorted(TRAINERS)],
            )
        validate_config(cfg)
    except ConfigError as exc:
        raise offer(exc, overrides) from exc
    check_alone(cfg, "train")
    if "auto_train" in cfg.proposer:  # whether a run may train an absent artifact: train trains it (no recipe key)
        cfg.proposer.auto_train = True
    if name == "layer_skip" and cfg.proposer.get("skip") is not None:  # before any model work
        raise ConfigError(
            f"proposer.skip={list(cfg.proposer.skip)} is given: harness train searches a skip vector, there is "
            "nothing to search; drop proposer.skip to search one, or use it in harness run"
        )
    artifact = cfg.proposer.get("artifact")
    if name in ("medusa", "hydra", "eagle") and is_published_checkpoint(artifact, name):  # before any model work
        raise ConfigError(
            f"proposer.artifact={artifact!r} is a published {name} checkpoint: a run loads it as it is, "
            "nothing is trained here; drop proposer.artifact to train one for this target"
        )
    if artifact and not Path(str(artifact)).expanduser().exists():  # before any model work
        raise ConfigError(
            f"proposer.artifact={artifact!r} does not exist: harness train writes its artifact to the cache (by "
            "target and recipe) and prints the path; proposer.artifact names an existing artifact for harness run: "
            "drop proposer.artifact"
        )
    if artifact:  # before any model work: training replaces what the path holds, so only an artifact of this kind
        refuse_foreign(name, artifact)
    try:  # what this machine cannot run, and the training against the target's shape, as harness run refuses them
        check_training_job(cfg)
    except ConfigError as exc:
        raise offer(exc, overrides, accept=training_accepts) from exc
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    target, _ = load_models(cfg)
    note_unread("train", unread_options(overrides, TRAIN_UNREAD))  # said once nothing was refused
    with noting_outcomes() as outcomes:
        try:
            summary = resolve_ref(TRAINERS[name])(cfg, target=target, force=force)
        except ArtifactError as exc:  # the artifact there was refused as it loaded: train can replace it
            if force or not outcomes or outcomes[-1][0] != "loaded":
                raise
            raise ArtifactError(f"{exc}; or force=true retrains it there for the configured target and recipe") from exc
    if outcomes:  # a published artifact goes through no training at all
        (outcome, path) = outcomes[-1]
        summary = {"reused": outcome == "loaded", **summary}
        if summary["reused"]:
            print(
                f"harness train: {path} already holds this recipe's {name} artifact: printed as it is, "
                "nothing trained (force=true retrains)",
                file=sys.stderr,
            )
    return summary


# --------------------------------------------------------------------------- harness dashboard


def dashboard_groups() -> dict[str, Path]:
    """Every W&B group this installation names: each sweep (its records in ``multirun/<sweep>``),
    each experiment (its single runs in ``outputs/<experiment>``), ``adhoc`` (single runs outside
    any experiment, ``outputs/adhoc``) and ``adhoc/<time>`` (each launch of a multirun without a
    sweep name, ``multirun/adhoc/<time>``), relative to the working directory, as the default
    ``hydra.sweep.dir`` and ``hydra.run.dir`` put them."""
    groups = {name: Path("multirun") / name for name in sweep.list_sweeps()}
    experiments = CONF_DIR / "experiment"
    for path in sorted(experiments.rglob("*.yaml")):
        name = path.relative_to(experiments).with_suffix("").as_posix()
        groups.setdefault(name, Path("outputs") / name)
    # single runs outside any experiment (outputs/adhoc) are W&B group adhoc; each launch of a multirun
    # without a sweep name (multirun/adhoc/<time>) is a group of its own, adhoc/<time>
    groups.setdefault("adhoc", Path("outputs") / "adhoc")
    launches = Path("multirun") / "adhoc"
    if launches.is_dir():
        for folder in sorted(p for p in launches.iterdir() if p.is_dir()):
            groups.setdefault(f"adhoc/{folder.name}", folder)
    sweeps = Path("multirun")  # sweeps launched from a sweep file kept anywhere land here too
    if sweeps.is_dir():
        for folder in sorted(p for p in sweeps.iterdir() if p.is_dir()):
            groups.setdefault(folder.name, folder)
    return groups


#: sweep parameters that are record axes, and the seed (a repeat): a sweep's other parameters make
#: arms that share a name (``experiment`` among them: experiments may set the same axes)
AXIS_PARAMETERS = (
    "proposer",
    "topology",
    "verifier",
    "workload",
    "model",
    "generation.temperature",
    "generation.batch_size",
    "seed",
)


def swept_options() -> dict[str, list[str]]:
    """Per sweep of ``sweeps/``, the parameters it crosses that are no axis (``topology.max_nodes``,
    ``experiment``): what a dashboard splits its bars by and names runs by in its legends (the options
    where no records are found to read them from; the experiment always)."""
    out = {}
    for name in sweep.list_sweeps():
        try:
            params = OmegaConf.select(OmegaConf.load(sweep.SWEEPS_DIR / f"{name}.yaml"), "hydra.sweeper.params")
        except (OSError, OmegaConfBaseException):
            continue  # the sweep command names what is wrong with the file
        keys = [str(k).lstrip("+~") for k in (params or {})]
        out[name] = [k for k in keys if k not in AXIS_PARAMETERS and not k.startswith("hydra")]
    return out


def dashboard_main(argv: list[str]) -> int:
    return dashboard.main(argv, known=dashboard_groups(), swept=swept_options())
