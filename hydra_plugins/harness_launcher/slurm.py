"""``hydra/launcher=slurm`` (``harness/conf/hydra/launcher/slurm.yaml``): submitit's Slurm launcher
with two additions, for the harness's sweeps on a GPU cluster.

* It refuses, before submitting anything, a configuration without a partition (the same check
  :class:`harness.sweep.SweepCallback` runs before Hydra builds any launcher, for submitit's own
  ``submitit_slurm`` too).
* ``job_overrides`` (default ``model.device=cuda``: its default dtype is bfloat16) are added to every
  job that does not set those keys itself, so the jobs run on the GPU Slurm gives them. A job sets a
  key on its command line or in a config it composes (its sweep file, an experiment, a model option:
  ``model: {device: cpu}`` stays, with a note on stderr).

* Ctrl-C while the sweep waits on its array cancels the array (``scancel``), so no task goes on
  measuring and writing records after the sweep has stopped.
* A task Slurm ends without a return (its time or memory limit, a failed node) does not stop the
  wait: the sweep waits for the array's other tasks, and the killed task's job is a failed job of
  the sweep (stage ``killed``, submitit's error), named in its summary and ``failures.jsonl``.

``sweep_batch`` is read by the root config's ``hydra.sweeper.max_batch_size`` (null: the whole
sweep is handed over at once and submitted as one array, ``array_parallelism`` of its tasks at a
time); like ``job_overrides`` it is no sbatch option and is not passed to submitit.

Hydra loads this module while scanning its plugins, for every command it runs, so it imports
nothing of the harness and nothing heavy.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SubmititSlurmLauncher
from omegaconf import OmegaConf


def slurm_refusal(launcher: Mapping[str, Any], *, sweep_dir: str | None = None) -> str | None:
    """Why a Slurm launcher configuration cannot submit (None when it can): it needs a partition, its
    job overrides must be ``key=value``, its ``additional_parameters`` a mapping of sbatch option
    names, it may set one form of CPUs and of memory (sbatch refuses ``--mem`` beside
    ``--mem-per-gpu``, ``--cpus-per-task`` beside ``--cpus-per-gpu``), its numbers must be ones
    sbatch takes, and the folder of its tasks' logs (``submitit_folder``, under ``sweep_dir`` by
    default) may hold no ``%`` but the ``%j`` submitit fills in (:func:`log_folder_refusal`)."""
    partition = None
    if not (OmegaConf.is_config(launcher) and OmegaConf.is_missing(launcher, "partition")):
        partition = launcher.get("partition")
    if not partition:
        return (
            "hydra.launcher.partition is not set: a Slurm sweep needs the partition its jobs run in "
            "(hydra.launcher.partition=<name>; `sinfo -s` lists them)"
        )
    for key in _LISTS:
        value = launcher.get(key)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        if value is not None and (not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value)):
            return (
                f"hydra.launcher.{key}={value!r}: must be a list of strings, e.g. "
                f"hydra.launcher.{key}='[{_LISTS[key]}]' (a single string is not one)"
            )
    extra = launcher.get("additional_parameters")
    if OmegaConf.is_config(extra):
        extra = OmegaConf.to_container(extra, resolve=True)
    if extra is not None and (not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra)):
        return (
            f"hydra.launcher.additional_parameters={extra!r}: must be a mapping of sbatch option names to values, "
            "e.g. hydra.launcher.additional_parameters='{mail-type: END}'"
        )
    overrides = launcher.get("job_overrides") or []
    bad = [str(o) for o in overrides if "=" not in str(o) or str(o).startswith("=")]
    if bad:
        return f"hydra.launcher.job_overrides must be key=value overrides; got {bad}"
    cuda = [str(o) for o in overrides if str(o).lstrip("+~").startswith("model.device=cuda")]
    if cuda and not gpu_requested(launcher):  # every task would fail on its node after queueing
        what = (
            "hydra.launcher.gpus_per_task=0 gives the jobs no GPU"
            if launcher.get("gpus_per_task") == 0
            else "hydra.launcher asks Slurm for no GPU (gpus_per_task, gpus_per_node and gres are unset)"
        )
        return (
            f"{what}, but hydra.launcher.job_overrides adds {cuda[0]}: for a CPU partition set "
            "hydra.launcher.job_overrides=[] too, else ask for one (hydra.launcher.gpus_per_task=1)"
        )
    copies = one_task_refusal(launcher, starter="srun")
    if copies:
        return copies
    for kind in _ONE_OF:
        given = [k for k in kind if launcher.get(k) is not None]
        if len(given) > 1:
            both = " and ".join(f"hydra.launcher.{k}={launcher.get(k)!r}" for k in given)
            return (
                f"{both}: sbatch takes one of --{', --'.join(k.replace('_gb', '').replace('_', '-') for k in kind)} "
                f"(it would refuse the array); set the other{'s' if len(given) > 2 else ''} to null"
            )
    for key, floor in _RESOURCES.items():
        value = launcher.get(key)
        if value is None:
            continue
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        if number is None or not math.isfinite(number) or number < floor or (key != "mem_gb" and number != int(number)):
            kind = "a number" if key == "mem_gb" else "a whole number"
            return f"hydra.launcher.{key}={value!r}: must be {kind} of at least {floor} (sbatch would refuse it)"
    return log_folder_refusal(launcher.get("submitit_folder"), sweep_dir=sweep_dir)


#: the patterns in a log path that submitit fills in itself, as Slurm does (the job, array and task ids)
_SUBMITIT_PATTERNS = ("%j", "%A", "%a", "%t")


def one_task_refusal(
    launcher: Mapping[str, Any], *, starter: str, keys: tuple[str, ...] = ("nodes", "tasks_per_node")
) -> str | None:
    """Why ``launcher`` would start each job more than once (one of ``keys`` other than 1:
    ``starter``, srun or submitit's local controller, starts one copy per task, all measuring at
    once into the job's one folder), or None."""
    for key in keys:
        value = launcher.get(key)
        if value is not None and value != 1:
            return (
                f"hydra.launcher.{key}={value!r}: a harness job is one process on one node ({starter} would start "
                f"{value} copies of each job, measuring at once into one folder); set hydra.launcher.{key}=1"
            )
    return None


def log_folder_refusal(folder: Any, *, sweep_dir: str | None = None) -> str | None:
    """Why the tasks' log folder ``folder`` (``submitit_folder``) cannot be used, or None: Slurm reads
    every ``%`` in the log paths the sbatch script names (``#SBATCH --output``) as a pattern (``%x``
    the job name, ``%u`` the user, ...), while submitit looks for the logs at the path as written, but
    for the ids it fills in itself in the folder's last part (``.submitit/%j``). Named by
    ``hydra.sweep.dir`` where the folder lies in ``sweep_dir`` (its default) and that holds the ``%``."""
    if folder is None:
        return None
    text = str(folder)
    head, _, last = text.rpartition("/")
    for pattern in _SUBMITIT_PATTERNS:
        last = last.replace(pattern, "")
    if "%" not in head and "%" not in last:
        return None
    said = (
        "Slurm reads '%' as a pattern (%x, %u, ...) in the tasks' log paths (#SBATCH --output under "
        "hydra.launcher.submitit_folder), which submitit then cannot find"
    )
    if sweep_dir is not None and "%" in str(sweep_dir) and text.startswith(str(sweep_dir)):
        return f"hydra.sweep.dir={sweep_dir}: {said}; use a sweep folder without '%'"
    return f"hydra.launcher.submitit_folder={text}: {said}; use a folder without '%' but its last part's %j"


def exclusive_nodes(launcher: Mapping[str, Any]) -> bool:
    """Whether the launcher asks Slurm for whole nodes (``--exclusive``, set as
    ``+hydra.launcher.additional_parameters.exclusive=true`` or ``+hydra.launcher.exclusive=true``):
    then no other job shares a task's node. ``exclusive=user`` (or ``mcs``) lets the same user's jobs,
    the array's other tasks among them, share it."""
    extra = launcher.get("additional_parameters")
    value = launcher.get("exclusive")
    if isinstance(extra, Mapping) and "exclusive" in extra:  # sbatch's last word: submitit writes it after
        value = extra["exclusive"]
    return value is True


def gpu_requested(launcher: Mapping[str, Any]) -> bool:
    """Whether the launcher's sbatch options ask for a GPU: ``gpus_per_task`` or ``gpus_per_node``
    above 0, a ``gres`` naming one, or an ``additional_parameters`` entry of the kind."""
    for key in ("gpus_per_task", "gpus_per_node"):
        value = launcher.get(key)
        if value not in (None, 0, "0", ""):
            return True
    if "gpu" in str(launcher.get("gres") or "").lower():
        return True
    extra = launcher.get("additional_parameters")
    keys = list(extra) if isinstance(extra, Mapping) else []  # anything else is refused (slurm_refusal)
    return any("gpu" in str(k).lower() or "gres" in str(k).lower() for k in keys)


#: the launcher's keys that take a list of strings, with an example item
_LISTS = {"job_overrides": "model.device=cuda", "setup": "source ~/venv/bin/activate"}
#: the launcher's keys of which sbatch takes one: CPUs, memory
_ONE_OF = (("cpus_per_task", "cpus_per_gpu"), ("mem_gb", "mem_per_gpu", "mem_per_cpu"))
#: what a job gets where none of a kind is set
RESOURCE_DEFAULTS = {"cpus_per_task": 8, "mem_gb": 64}


def with_resource_defaults(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with :data:`RESOURCE_DEFAULTS` filled in for a kind of :data:`_ONE_OF` none of whose
    keys is set (8 CPUs per task unless CPUs per GPU are asked; 64 GB unless memory per GPU or CPU is)."""
    out = dict(params)
    for kind in _ONE_OF:
        if all(out.get(k) is None for k in kind):
            default = next(k for k in kind if k in RESOURCE_DEFAULTS)
            out[default] = RESOURCE_DEFAULTS[default]
    return out


#: the Slurm resources checked before a sweep submits: key -> the smallest value sbatch takes
_RESOURCES = {
    "timeout_min": 1,
    "nodes": 1,
    "tasks_per_node": 1,
    "gpus_per_task": 0,
    "cpus_per_task": 1,
    "mem_gb": 0,
    "array_parallelism": 1,
    "max_num_timeout": 0,
}


def slurm_missing() -> str | None:
    """Why this machine cannot submit to Slurm (no ``sbatch`` on the PATH), or None."""
    if shutil.which("sbatch") is None:
        return (
            "sbatch is not on this machine's PATH: a Slurm sweep is launched from a node of the cluster "
            "(a login node), where the launching process waits for the array"
        )
    return None


def _override_key(override: str) -> str:
    return str(override).split("=", 1)[0].lstrip("+~")


def with_job_overrides(
    overrides: Sequence[str],
    defaults: Sequence[str],
    *,
    hydra_overrides: Sequence[str] = (),
    config_loader: Any = None,
    config_name: str = "config",
    cache: dict | None = None,
) -> list[str]:
    """A job's overrides followed by each of ``defaults`` whose key the job does not set itself, on
    its command line or in a config it composes (:func:`keys_set_by_configs`): ``model.device=cuda``
    is added unless the job says ``model.device=...`` or its sweep file, experiment or model option
    sets ``model.device``. ``hydra_overrides`` are the launch's overrides of Hydra's own keys
    (``hydra.searchpath``, which finds a sweep file) where ``overrides`` holds the job's only;
    ``cache`` keeps the configs' answers for the jobs of one launch."""
    given = {_override_key(o) for o in overrides}
    left = [str(d) for d in defaults if _override_key(d) not in given]
    if left:
        configured = keys_set_by_configs(
            [*hydra_overrides, *overrides],
            [_override_key(d) for d in left],
            config_loader=config_loader,
            config_name=config_name,
            cache=cache,
        )
        left = [d for d in left if _override_key(d) not in configured]
    return [*overrides, *left]


def _is_baseline(default: Any, config_name: str) -> bool:
    """Whether a config of a job's defaults list is one every job starts from, whose values a launcher's
    job override may replace: a schema (``base_config``, ``schema/...``), the root config, Hydra's own."""
    path = str(default.config_path or "")
    return default.primary or path in (config_name, "base_config") or path.startswith(("schema/", "hydra/"))


def keys_set_by_configs(
    overrides: Sequence[str],
    keys: Sequence[str],
    *,
    config_loader: Any = None,
    config_name: str = "config",
    cache: dict | None = None,
) -> set[str]:
    """Which of ``keys`` (dotted, ``model.device``) a config composed by a job of ``overrides`` sets to a
    value (not null, not ``???``): its sweep file, an experiment, a config group's option (none but
    the baseline, :func:`_is_baseline`). ``config_loader`` is Hydra's (the harness's own where None). A job whose
    configs cannot be listed sets none of them (its composition is refused where it runs). With
    ``cache``, jobs that select the same configs are answered once: the configs a job composes follow
    from its selections and Hydra's keys, never from a value it sets (``a.b=c``)."""
    selections = tuple(o for o in overrides if "." not in _override_key(o).split("@")[0] or o.startswith("hydra."))
    memo = (config_name, selections, tuple(keys))
    if cache is not None and memo in cache:
        return set(cache[memo])
    found = _keys_set_by_configs(overrides, keys, config_loader=config_loader, config_name=config_name)
    if cache is not None:
        cache[memo] = frozenset(found)
    return found


def _keys_set_by_configs(
    overrides: Sequence[str], keys: Sequence[str], *, config_loader: Any, config_name: str
) -> set[str]:
    from hydra._internal.defaults_list import create_defaults_list

    if config_loader is None:
        from harness.config import config_loader as harness_config_loader  # a launch needs the harness anyway

        config_loader = harness_config_loader()
    found: set[str] = set()
    try:
        parsed, repo = config_loader._parse_overrides_and_create_caching_repo(config_name, list(overrides))
        defaults = create_defaults_list(
            repo=repo, config_name=config_name, overrides_list=parsed, prepend_hydra=True, skip_missing=True
        ).defaults
        for default in defaults:
            if default.config_path is None or _is_baseline(default, config_name):
                continue
            loaded = repo.load_config(config_path=default.config_path)
            if loaded is None or not OmegaConf.is_dict(loaded.config):
                continue
            package = default.package if default.package is not None else loaded.header.get("package") or ""
            body = OmegaConf.to_container(loaded.config, resolve=False)  # its values as written
            for key in keys:
                if package and not key.startswith(f"{package}."):
                    continue
                node: Any = body
                for part in (key[len(package) + 1 :] if package else key).split("."):
                    node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
                if node is not _ABSENT and node is not None and node != "???":  # null, ???: left for the job to set
                    found.add(key)
    except Exception:  # a job that does not compose is refused by its own composition
        return set()
    return found


#: a key :func:`keys_set_by_configs` finds in no config
_ABSENT = object()


def executor_settings(params: Mapping[str, Any], *, cluster: str = "slurm") -> tuple[dict, dict]:
    """(submitit ``AutoExecutor`` options, its ``update_parameters``) from the launcher's settings:
    the resource defaults filled in, submitit's shared keys as they are, the others prefixed with the
    cluster's name."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = with_resource_defaults(params)
    options = {"folder": params.pop("submitit_folder")}
    if "max_num_timeout" in params:
        options[f"{cluster}_max_num_timeout"] = params.pop("max_num_timeout")
    queue_keys = set(OmegaConf.structured(BaseQueueConf).keys())
    return options, {k if k in queue_keys else f"{cluster}_{k}": v for k, v in params.items()}


class SlurmLauncher(_SubmititSlurmLauncher):
    def __init__(self, job_overrides: Any = (), sweep_batch: Any = None, **params: Any) -> None:
        if OmegaConf.is_config(job_overrides):
            job_overrides = OmegaConf.to_container(job_overrides, resolve=True)
        self.job_overrides = [str(o) for o in (job_overrides or ())]
        #: a job override -> how many jobs it was not added to, as their configs set its key (said once a launch)
        self._kept: dict[str, int] = {}
        #: the keys the jobs' configs set, by the configs they select (:func:`keys_set_by_configs`), for one launch
        self._configured: dict = {}
        super().__init__(**params)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Submit the jobs as one Slurm array and wait for their returns; an interrupt while waiting
        cancels the array before it propagates."""
        assert self.config is not None
        sweep_dir = str(self.config.hydra.sweep.dir)
        refusal = slurm_refusal({**self.params, "job_overrides": self.job_overrides}, sweep_dir=sweep_dir)
        if refusal is not None:
            raise ValueError(refusal)
        import submitit
        from hydra.core.singleton import Singleton

        executor_options, parameters = executor_settings(self.params, cluster=self._EXECUTOR)
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **executor_options)
        executor.update_parameters(**parameters)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        launched = [self._with_job_overrides(list(overrides)) for overrides in job_overrides]
        self._say_kept(len(launched))
        tasks = [
            (
                overrides,
                "hydra.sweep.dir",
                initial_job_idx + i,
                f"job_id_for_{initial_job_idx + i}",
                Singleton.get_state(),
            )
            for i, overrides in enumerate(launched)
        ]
        jobs = executor.map_array(self, *zip(*tasks, strict=True))
        try:
            return [self._result(job, task[0], task[2], sweep_dir) for job, task in zip(jobs, tasks, strict=True)]
        except KeyboardInterrupt:
            cancel_arrays(jobs)
            raise

    def _with_job_overrides(self, overrides: list[str]) -> list[str]:
        """A job's overrides with the launcher's ``job_overrides`` (:func:`with_job_overrides`), its configs
        composed as the task composes them (this launch's overrides of Hydra's keys first); a job override
        left out as the job's configs set its key is said on stderr, once a launch."""
        assert self.config is not None and self.hydra_context is not None
        hydra_overrides = OmegaConf.to_container(self.config.hydra.overrides.hydra, resolve=False) or []
        out = with_job_overrides(
            overrides,
            self.job_overrides,
            hydra_overrides=[str(o) for o in hydra_overrides],
            config_loader=self.hydra_context.config_loader,
            config_name=str(self.config.hydra.job.config_name or "config"),
            cache=self._configured,
        )
        given = {_override_key(o) for o in overrides}
        for default in self.job_overrides:
            if _override_key(default) not in given and default not in out:
                self._kept[default] = self._kept.get(default, 0) + 1
        return out

    def _say_kept(self, jobs: int) -> None:
        for default, kept in self._kept.items():
            print(
                f"harness: note: hydra.launcher.job_overrides: {default} is not added to {kept} of {jobs} jobs, "
                f"whose configs set {_override_key(default)} (a sweep file, an experiment, a config group's option)",
                file=sys.stderr,
            )
        self._kept.clear()
        self._configured.clear()

    @staticmethod
    def _result(job: Any, overrides: list[str], num: int, sweep_dir: Path) -> JobReturn:
        """The task's return; a task that ended without one (a time or memory limit, a failed
        node) is recorded as a failed job of the sweep, and the wait goes on to the next task."""
        try:
            return job.results()[0]
        except Exception as exc:  # submitit's UncompletedJobError (no result: killed), FailedJobError, ...
            from hydra.core.utils import JobStatus
            from submitit.core.utils import UncompletedJobError

            from harness.sweep import record_lost_task  # here: the plugin scan imports nothing of the harness

            killed = isinstance(exc, UncompletedJobError)
            head = " ".join(str(exc).splitlines()[:2])  # "Job 12_3 (task: 0) ... (state: TIMEOUT)"
            error = {"type": type(exc).__name__, "message": f"Slurm task {job.job_id}: {exc}"[:4000]}
            stage = "killed" if killed else "task error"
            name = record_lost_task(sweep_dir, num=num, overrides=overrides, stage=stage, error=error)
            print(
                f"harness sweep: job {name} {'was killed' if killed else 'failed in its task'}: {head[:300]}",
                file=sys.stderr,
            )
            ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
            ret.return_value = {"job": name, "status": "failed", "stage": stage}
            return ret


def cancel_arrays(jobs: Sequence[Any]) -> None:
    """``scancel`` the Slurm arrays ``jobs`` (submitit jobs, ``<array>_<task>`` ids) belong to, and
    say so on stderr; a task that already finished keeps its record."""
    arrays = sorted({str(job.job_id).split("_", 1)[0] for job in jobs})
    if not arrays:
        return
    try:
        done = subprocess.run(["scancel", *arrays], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        print(
            f"harness: could not cancel Slurm array {' '.join(arrays)} ({exc}); run `scancel "
            f"{' '.join(arrays)}` or its tasks go on",
            file=sys.stderr,
        )
        return
    if done.returncode != 0:
        print(
            f"harness: scancel {' '.join(arrays)} failed ({(done.stderr or done.stdout).strip()[:200]}); "
            "check `squeue --me`",
            file=sys.stderr,
        )
        return
    print(
        f"harness: cancelled Slurm array {' '.join(arrays)} ({len(jobs)} tasks; the finished ones keep their records)",
        file=sys.stderr,
    )
