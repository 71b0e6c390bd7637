"""Sweeps: named sweep files, launchers, skip-finished, failure file, store, W&B.

Everything lands in tmp_path: the sweep folder (hydra.sweep.dir), $HARNESS_CACHE and W&B's own
folders. Sweeps run in this process through ``harness.app.sweep_main`` (the `harness sweep` command);
the basic and joblib-with-one-worker launchers run jobs in this process, submitit_local and
joblib with two workers start processes (slow tests).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from harness import sweep
from harness.app import sweep_main
from harness.sweep import (
    FAILURES_FILE,
    JOB_STATUS,
    LAUNCHERS,
    STORE_FILE,
    launcher_concurrency,
    list_sweeps,
    sweep_argv,
)
from harness.tracking.job_folder import set_aside
from harness.tracking.store import load_record

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS_DIR = REPO / "harness" / "conf" / "experiment"
WANDB_CLI = Path(sys.executable).parent / "wandb"


@pytest.fixture
def env(tmp_path, monkeypatch):
    """HARNESS_CACHE, W&B folders and the working directory inside tmp_path."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    for var, sub in (
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # jobs in other processes (submitit, joblib) import this checkout's harness, not an installed one
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def launch(sweep_dir: Path, *args: str, name: str = "smoke") -> tuple[int, dict]:
    rc = sweep_main([name, *args, f"hydra.sweep.dir={sweep_dir}"])
    return rc, dict(sweep.LAST_SUMMARY)


@pytest.fixture
def hydra_conf():
    """One Hydra initialisation (conf/) for a test's compose calls."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config import CONF_DIR

    GlobalHydra.instance().clear()  # an in-process sweep leaves Hydra initialised
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def _compose(overrides: list[str]):
    from hydra import compose

    return compose("config", overrides=overrides, return_hydra_config=True)


def _jobs_of(name: str) -> list[list[str]]:
    """The job override lists Hydra's basic sweeper makes from a sweep file's params."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = _compose([f"+sweep={name}"])
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return batch


# --------------------------------------------------------------------------------------------
# sweep files and the command line (no model)


def test_every_sweep_file_composes(hydra_conf):
    names = list_sweeps()
    assert {
        "smoke",
        "prompt_lookup_topologies",
        "temperature",
        "tree_vs_hardware",
        "heads",
        "batch_scaling",
        "source_selection",
    } <= set(names)
    assert "_common" not in names
    for name in names:
        cfg = _compose([f"+sweep={name}"])
        assert cfg.sweep == name
        assert cfg.hydra.sweep.dir == f"multirun/{name}"
        assert cfg.hydra.sweeper.max_batch_size == 1  # one job at a time by default
        assert cfg.hydra.callbacks.harness_sweep._target_ == "harness.sweep.SweepCallback"
        assert cfg.hydra.sweeper.params, name


def _experiments() -> list[str]:
    """Every named experiment: ``experiments/<group>/<name>.yaml`` -> ``"<group>/<name>"``."""
    return sorted(p.relative_to(EXPERIMENTS_DIR).with_suffix("").as_posix() for p in EXPERIMENTS_DIR.rglob("*.yaml"))


@pytest.mark.slow
def test_every_experiment_and_every_job_of_every_sweep_composes_and_plans(hydra_conf):
    """About 100 compositions, no model loaded: every experiment composes on its own and names
    itself, and no job of a default sweep is refused by planning (negotiation of proposer,
    topology, verifier and temperature)."""
    from harness.engine.build import plan

    experiments = _experiments()
    assert len(experiments) >= 26 and "default" in experiments
    for name in experiments:
        cfg = _compose([f"experiment={name}"])
        assert cfg.experiment == name, name
        plan(cfg)

    batch_sizes = set()
    crossed = set()
    for name in list_sweeps():
        for overrides in _jobs_of(name):
            cfg = _compose([f"+sweep={name}", *overrides])
            if cfg.experiment is not None:
                crossed.add(cfg.experiment)
            if name == "batch_scaling":
                batch_sizes.add(int(cfg.generation.batch_size))
            else:
                assert cfg.generation.batch_size == 1, (name, overrides)  # only batch_scaling varies the batch
            plan(cfg)
    assert batch_sizes == {1, 2, 4, 8}  # the batch_scaling sweep: batch 1, 2, 4, 8
    assert {name.split("/")[0] for name in crossed} == {"batch", "heads", "sources", "verifiers"}


def test_sweep_axes_are_what_the_files_say(hydra_conf):
    smoke = [sorted(j) for j in _jobs_of("smoke")]
    assert len(smoke) == 4
    assert sorted(["proposer=draft_model", "topology=sequence", "verifier=membership"]) in smoke
    arms = {}
    for overrides in _jobs_of("temperature"):
        cfg = _compose(["+sweep=temperature", *overrides])
        arms[overrides[0]] = (cfg.proposer.name, cfg.verifier.name, cfg.generation.temperature, cfg.model.name)
        assert f"experiment={cfg.experiment}" == overrides[0] == cfg.hydra.job.override_dirname
    assert arms == {
        "experiment=verifiers/draft_rejection": ("draft_model", "rejection", 0.7, "smollm2"),
        "experiment=verifiers/draft_specinfer": ("draft_model", "specinfer", 0.7, "smollm2"),
        "experiment=verifiers/draft_membership": ("draft_model", "membership", 0.7, "smollm2"),
        "experiment=verifiers/lookup_greedy": ("prompt_lookup", "greedy", 0.0, "smollm2"),
    }
    topo = {tuple(j) for j in _jobs_of("prompt_lookup_topologies")}
    assert topo == {("topology=sequence", "workload=humaneval"), ("topology=sequences", "workload=humaneval")}


def test_source_selection_pairs_each_workload_with_its_datastore(hydra_conf):
    """The source_selection sweep: 5 sources x 2 temperatures x 2 workloads; REST (alone or merged)
    reads the datastore of the workload's domain, and the verifier follows source and temperature."""
    jobs = _jobs_of("source_selection")
    assert len(jobs) == 20
    seen = {}
    for overrides in jobs:
        cfg = _compose(["+sweep=source_selection", *overrides])
        p = cfg.proposer
        ds = p.get("datastore") or (p.rest.datastore if "rest" in (p.get("sources") or []) else None)
        key = (cfg.workload.name, p.name, tuple(p.get("sources") or ()), cfg.generation.temperature)
        seen[key] = (cfg.verifier.name, None if ds is None else (ds.corpus, ds.exclude))
    assert seen[("humaneval", "rest", (), 0.0)] == ("greedy", ("stdlib", "humaneval"))
    assert seen[("sharegpt", "rest", (), 0.7)] == ("membership", ("sharegpt", "sharegpt_heldout"))
    assert seen[("sharegpt", "merged", ("draft_model", "rest", "prompt_lookup"), 0.0)] == (
        "greedy",
        ("sharegpt", "sharegpt_heldout"),
    )
    assert seen[("humaneval", "draft_model", (), 0.7)] == ("specinfer", None)
    assert seen[("sharegpt", "prompt_lookup", (), 0.7)] == ("membership", None)


def test_heads_sweep_runs_every_head_and_self_speculative_proposer_and_the_hydra_ablation(hydra_conf):
    """Greedy: every head kind, EAGLE as a chain and as a dynamic tree, the self-speculative drafters and
    the Hydra++ ablation; T = 0.7: the head and EAGLE chains under rejection, EAGLE's dynamic tree
    sampled (Sequoia) and deterministic (membership). The same arms on both workloads."""
    arms = {}
    for overrides in _jobs_of("heads"):
        cfg = _compose(["+sweep=heads", *overrides])
        p, t = cfg.proposer, cfg.topology
        arms.setdefault(cfg.workload.name, set()).add(
            (
                p.name,
                p.get("mlp_layers"),
                p.get("distill"),
                p.get("prefix_attention"),
                p.get("sampling"),
                (t.name, t.max_nodes, t.max_depth, t.topk),
                cfg.verifier.name,
                cfg.generation.temperature,
            )
        )
        # every job runs every gate, the chi-square one included
        assert cfg.model.name == "smollm2" and cfg.gates.skip_statistical is False and cfg.gates.statistical
    chain, dyn = ("sequence", 3, 3, 0), ("dynamic", 8, 5, 3)
    expected = {
        ("medusa", 1, False, False, "beam", chain, "greedy", 0.0),
        ("hydra", 1, False, False, "beam", chain, "greedy", 0.0),
        ("clover", 1, False, False, "beam", chain, "greedy", 0.0),
        ("eagle", None, None, None, "beam", chain, "greedy", 0.0),
        ("eagle", None, None, None, "beam", dyn, "greedy", 0.0),
        ("early_exit", None, None, None, "beam", chain, "greedy", 0.0),
        ("layer_skip", None, None, None, "beam", chain, "greedy", 0.0),
        ("hydra", 4, False, False, "beam", chain, "greedy", 0.0),
        ("hydra", 1, True, False, "beam", chain, "greedy", 0.0),
        ("hydra", 1, False, True, "beam", chain, "greedy", 0.0),
        ("medusa", 1, False, False, "iid", chain, "rejection", 0.7),
        ("hydra", 1, False, False, "iid", chain, "rejection", 0.7),
        ("clover", 1, False, False, "iid", chain, "rejection", 0.7),
        ("eagle", None, None, None, "iid", chain, "rejection", 0.7),
        ("eagle", None, None, None, "without_replacement", dyn, "sequoia", 0.7),
        ("eagle", None, None, None, "beam", dyn, "membership", 0.7),
    }
    assert arms == {"humaneval": expected, "sharegpt": expected}


def test_job_folder_is_the_override_dirname_without_launch_keys(hydra_conf):
    cfg = _compose(
        [
            "+sweep=smoke",
            "proposer=draft_model",
            "verifier=greedy",
            "concurrent_jobs=2",
            "tracking=wandb",
            "tracking.init_timeout_s=30",
            "tracking.system_metrics=false",
            "tracking.system_metrics_interval_s=1",
            "gates.cache=false",
            "workload.limit=2",
        ]
    )
    # launch-only keys (sweep name, concurrency, tracking, the gate cache) stay out: a re-launch finds the folder
    assert (
        cfg.hydra.sweep.subdir
        == cfg.hydra.job.override_dirname
        == ("proposer=draft_model,verifier=greedy,workload.limit=2")
    )


def test_sweep_argv_maps_launchers_and_keeps_user_overrides_last():
    assert sweep_argv("smoke", ["verifier=greedy"]) == ["-m", "+sweep=smoke", "hydra/launcher=basic", "verifier=greedy"]
    assert sweep_argv("smoke", ["launcher=joblib", "concurrent_jobs=2"]) == [
        "-m",
        "+sweep=smoke",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=${concurrent_jobs}",
        "concurrent_jobs=2",
    ]
    assert sweep_argv("smoke", ["launcher=submitit_slurm"])[2:] == [
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.array_parallelism=${concurrent_jobs}",
    ]
    with pytest.raises(ValueError, match=r"unknown sweep 'nope'; expected one of \["):
        sweep_argv("nope", [])
    with pytest.raises(ValueError, match=r"is no sweep file: a sweep file's name ends in \.yaml or \.yml"):
        sweep_argv(__file__, [])  # a file that exists, not a sweep file: not called an unknown sweep
    with pytest.raises(ValueError, match=r"launcher must be one of .*; got 'ray'"):
        sweep_argv("smoke", ["launcher=ray"])
    assert sweep_argv("smoke", ["launcher=slurm"])[2:] == ["hydra/launcher=slurm"]
    # Hydra's own switch given to `harness sweep` replaces the default launcher
    assert sweep_argv("smoke", ["hydra/launcher=submitit_local"]) == [
        "-m",
        "+sweep=smoke",
        "hydra/launcher=submitit_local",
    ]
    assert set(LAUNCHERS) == {"basic", "joblib", "submitit_local", "slurm", "submitit_slurm"}


@pytest.mark.parametrize(
    "launcher, extra, expected",
    [
        ("basic", ["concurrent_jobs=2"], 1),  # the basic launcher runs one job at a time whatever is asked
        ("joblib", ["concurrent_jobs=2"], 2),
        ("joblib", [], 1),
        ("submitit_local", ["concurrent_jobs=3"], 3),  # batches of 3, all started together
        ("submitit_slurm", ["concurrent_jobs=4"], 4),
    ],
)
def test_launcher_overrides_compose_and_bound_concurrency(hydra_conf, launcher, extra, expected):
    """The composed Hydra config of `harness sweep smoke launcher=X` gives the recorded width."""
    overrides = sweep_argv("smoke", [f"launcher={launcher}", *extra])[1:]  # compose has no -m
    cfg = _compose(overrides)
    assert launcher_concurrency(cfg.hydra) == expected


def test_cli_usage_and_list(capsys):
    assert sweep_main(["--list"]) == 0
    assert "smoke" in capsys.readouterr().out.split()
    assert sweep_main(["--list", "extra"]) == 2  # not dropped silently
    assert capsys.readouterr().err.strip() == "harness sweep: refused: --list takes no arguments; got ['extra']"
    assert sweep_main(["nope"]) == 2
    assert "unknown sweep 'nope'" in capsys.readouterr().err
    assert sweep_main(["smoke", "launcher=ray"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "harness sweep: refused: launcher must be one of ['basic', 'joblib', 'slurm', 'submitit_local', "
        "'submitit_slurm']; got 'ray' (harness sweep --help shows the usage)\n"
    )


def test_slurm_refusals_name_what_to_set():
    from hydra_plugins.harness_launcher.slurm import slurm_refusal

    # resources sbatch would refuse (the sweep failed at submission, leaving an empty store behind)
    assert slurm_refusal({"partition": "gpu", "timeout_min": -5}) == (
        "hydra.launcher.timeout_min=-5: must be a whole number of at least 1 (sbatch would refuse it)"
    )
    assert slurm_refusal({"partition": "gpu", "mem_gb": "abc"}).startswith(
        "hydra.launcher.mem_gb='abc': must be a number of at least 0"
    )
    assert slurm_refusal({"partition": "gpu", "cpus_per_task": 2.5}).startswith("hydra.launcher.cpus_per_task=2.5")
    for bad in (float("nan"), float("inf")):  # Hydra reads nan and inf as floats; int() of them raised
        assert slurm_refusal({"partition": "gpu", "timeout_min": bad}).startswith("hydra.launcher.timeout_min=")
        assert slurm_refusal({"partition": "gpu", "mem_gb": bad}).startswith("hydra.launcher.mem_gb=")
    assert slurm_refusal({"partition": "gpu", "mem_gb": 7.5, "timeout_min": 240, "gpus_per_task": 0}) is None
    # no GPU per task while the jobs are sent to cuda: each task would fail on its node after queueing
    assert slurm_refusal({"partition": "cpu", "gpus_per_task": 0, "job_overrides": ["model.device=cuda"]}) == (
        "hydra.launcher.gpus_per_task=0 gives the jobs no GPU, but hydra.launcher.job_overrides adds "
        "model.device=cuda: for a CPU partition set hydra.launcher.job_overrides=[] too, else ask for one "
        "(hydra.launcher.gpus_per_task=1)"
    )
    assert slurm_refusal({"partition": "cpu", "gpus_per_task": 0, "job_overrides": []}) is None

    assert slurm_refusal({"partition": "gpu", "gpus_per_task": 1, "job_overrides": ["model.device=cuda"]}) is None
    # no form of GPU asked for at all (gpus_per_task=null): the same, every task failing on its node
    assert slurm_refusal({"partition": "gpu", "gpus_per_task": None, "job_overrides": ["model.device=cuda"]}) == (
        "hydra.launcher asks Slurm for no GPU (gpus_per_task, gpus_per_node and gres are unset), but "
        "hydra.launcher.job_overrides adds model.device=cuda: for a CPU partition set hydra.launcher.job_overrides=[] "
        "too, else ask for one (hydra.launcher.gpus_per_task=1)"
    )
    for asked in ({"gpus_per_node": 4}, {"gres": "gpu:a100:1"}, {"additional_parameters": {"gpus": 1}}):
        assert slurm_refusal({"partition": "gpu", "job_overrides": ["model.device=cuda"], **asked}) is None, asked
    # a harness job is one process: srun started each job once per task, the copies in one folder
    for key in ("nodes", "tasks_per_node"):
        assert slurm_refusal({"partition": "gpu", "gpus_per_task": 1, key: 2}) == (
            f"hydra.launcher.{key}=2: a harness job is one process on one node (srun would start 2 copies of each "
            f"job, measuring at once into one folder); set hydra.launcher.{key}=1"
        )
    assert slurm_refusal(OmegaConf.create({"partition": "???"})).startswith("hydra.launcher.partition is not set")
    assert slurm_refusal({"partition": None}).startswith("hydra.launcher.partition is not set")
    assert slurm_refusal({"partition": "gpu", "job_overrides": ["cuda"]}) == (
        "hydra.launcher.job_overrides must be key=value overrides; got ['cuda']"
    )
    # a single string where a list is taken: setup crashed the launch after its folder was written, and
    # job_overrides was read one character at a time
    assert slurm_refusal({"partition": "gpu", "setup": "source /x/activate"}) == (
        "hydra.launcher.setup='source /x/activate': must be a list of strings, e.g. "
        "hydra.launcher.setup='[source ~/venv/bin/activate]' (a single string is not one)"
    )
    assert slurm_refusal({"partition": "gpu", "job_overrides": "model.device=cuda"}).startswith(
        "hydra.launcher.job_overrides='model.device=cuda': must be a list of strings"
    )
    assert slurm_refusal(OmegaConf.create({"partition": "gpu", "setup": ["module load cuda"]})) is None


def test_output_dir_in_a_sweep_is_refused_before_any_job(env, capsys):
    sweep_dir = env / "multirun" / "smoke"
    rc, summary = launch(
        sweep_dir,
        "launcher=basic",
        "proposer=prompt_lookup",
        "verifier=greedy",
        "output_dir=elsewhere",
        "hydra.callbacks.harness_sweep.report=false",
    )
    assert rc == 2 and not summary
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        "harness sweep: refused: job 1 of 1: output_dir='elsewhere' is for single runs; a multirun writes each "
        "job to hydra.sweep.dir/hydra.sweep.subdir; no job was run"
    ]
    assert not sweep_dir.exists() and not (env / "elsewhere").exists()


def test_a_sweep_into_a_run_folder_or_another_sweeps_folder_is_refused_before_anything_is_written(env, capsys):
    """A sweep launched into a single run's folder took the run's record into its store and report; a
    multirun launched into a named sweep's folder overwrote its launch file and summary. Both refused,
    the folders as they were; the same sweep launched again resumes there."""
    from harness.app import run_main

    run_dir = env / "single"
    run_dir.mkdir()
    (run_dir / "record.json").write_text("{}")
    rc, summary = launch(run_dir, "launcher=basic", "proposer=prompt_lookup", "verifier=greedy")
    assert rc == 2 and not summary
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        f"harness sweep: refused: hydra.sweep.dir={run_dir} is a single run's folder (it holds record.json): the "
        "sweep's store and report would count that run with its jobs; give the sweep a folder of its own"
    ]
    assert sorted(p.name for p in run_dir.iterdir()) == ["record.json"]

    sweep_dir = env / "multirun" / "smoke"
    rc, summary = launch(sweep_dir, "launcher=basic", "proposer=prompt_lookup", "verifier=greedy")
    assert rc == 0 and len(summary["ran"]) == 1
    before = {p.name: p.read_bytes() for p in sweep_dir.iterdir() if p.is_file()}
    capsys.readouterr()
    assert run_main([*TINY_MULTIRUN[:6], "seed=1,2", f"hydra.sweep.dir={sweep_dir}"]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        f"harness run: refused: hydra.sweep.dir={sweep_dir} holds sweep 'smoke''s launch (launch.json): a multirun "
        "without a sweep name there would overwrite its summary and mix its jobs with these; give it a folder of "
        "its own"
    ]
    assert {p.name: p.read_bytes() for p in sweep_dir.iterdir() if p.is_file()} == before
    rc, summary = launch(sweep_dir, "launcher=basic", "proposer=prompt_lookup", "verifier=greedy")  # resumes
    assert rc == 0 and len(summary["skipped"]) == 1


def test_an_unnamed_multirun_of_other_jobs_into_another_s_folder_is_refused_and_the_same_jobs_resume(env, capsys):
    """Two multiruns without a sweep name into one hydra.sweep.dir: the second, planning other jobs,
    overwrote the first's launch file and summary and mixed its jobs into the store. Refused, the
    folder as it was; the same jobs launched again (their values in another order, a launch-only key
    added) resume there."""
    from harness.app import run_main

    sweep_dir = env / "multirun" / "mine"
    base = [*TINY_MULTIRUN[:6], "hydra.callbacks.harness_sweep.report=false", f"hydra.sweep.dir={sweep_dir}"]
    assert run_main([*base, "seed=1,2"]) == 0
    assert len(sweep.LAST_SUMMARY["ran"]) == 2
    before = {p.name: p.read_bytes() for p in sweep_dir.iterdir() if p.is_file()}
    capsys.readouterr()
    assert run_main([*base, "seed=3,4"]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert len(err) == 1 and err[0].startswith(
        f"harness run: refused: hydra.sweep.dir={sweep_dir} holds the launch of another multirun without a sweep "
        "name (launch.json: "
    ), err
    assert "seed=1,2): this one plans other jobs" in err[0] and "give it a folder of its own" in err[0]
    assert {p.name: p.read_bytes() for p in sweep_dir.iterdir() if p.is_file()} == before
    assert not [p.name for p in sweep_dir.iterdir() if "seed=3" in p.name or "seed=4" in p.name]
    assert run_main([*base, "seed=2,1", "tracking=none"]) == 0  # the same jobs: resumed
    assert len(sweep.LAST_SUMMARY["skipped"]) == 2 and not sweep.LAST_SUMMARY["ran"]


def test_a_sweep_inside_another_sweep_s_folder_is_refused_before_anything_is_written(env, capsys):
    """A sweep launched into a folder below another sweep's was accepted: the outer sweep's store and
    report then counted the inner sweep's records with its own. Refused, naming the outer folder, at
    any depth and whichever of the outer sweep's files marks it; nothing written."""
    outer = env / "multirun" / "smoke"
    outer.mkdir(parents=True)
    (outer / "launch.json").write_text(json.dumps({"launch_id": "L1", "sweep": "smoke"}))
    inner = outer / "inner"
    rc, summary = launch(inner, "launcher=basic", "proposer=prompt_lookup", "verifier=greedy")
    assert rc == 2 and not summary
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        f"harness sweep: refused: hydra.sweep.dir={inner} is inside the sweep folder {outer} (it holds launch.json): "
        "that sweep's store and report would count this sweep's jobs with its own; give the sweep a folder outside it"
    ]
    assert not inner.exists() and sorted(p.name for p in outer.iterdir()) == ["launch.json"]
    (outer / "launch.json").unlink()
    for marker in ("multirun.yaml", "summary.json", "store.parquet"):
        (outer / marker).write_text("{}")
        problem = sweep.sweep_folder_problem(outer / "proposer=a" / "deeper", "glob")
        assert problem is not None and problem.startswith(
            f"hydra.sweep.dir={outer / 'proposer=a' / 'deeper'} is inside the sweep folder {outer} (it holds {marker})"
        )
        (outer / marker).unlink()
    assert sweep.sweep_folder_problem(inner, "glob") is None  # no sweep above it now
    (outer / "summary.json").write_text("{}")
    assert sweep.sweep_folder_problem(outer, "smoke") is None  # the outer sweep itself still resumes


def test_a_multirun_axis_that_lists_no_value_is_refused_naming_it(env, capsys):
    """``seed=range(0,0)`` (or a ``glob(...)`` no option matches, or a sweep file's axis of no value)
    planned no job, and the check of the jobs failed with ``error: IndexError: list index out of range``."""
    from harness.app import run_main

    base = ["-m", "model=tiny", "workload.limit=1", "proposer=prompt_lookup"]
    for axis in ("seed=range(0,0)", "verifier=glob(zzz*)"):
        sweep_dir = env / "never"
        assert run_main([*base, "verifier=greedy,membership", axis, f"hydra.sweep.dir={sweep_dir}"]) == 2
        err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
        assert err == [
            f"harness run: refused: {axis} lists no value: the multirun would run no job; give the axis at least "
            "one value"
        ]
        assert not sweep_dir.exists()
    mine = env / "empty_axis.yaml"
    mine.write_text(
        "# @package _global_\ndefaults:\n  - _common\n  - override /model: tiny\nsweep: empty_axis\n"
        "hydra:\n  sweeper:\n    params:\n      verifier: greedy,membership\n      seed: range(0,0)\n"
    )
    assert sweep_main([str(mine), f"hydra.sweep.dir={env / 'never'}"]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        "harness sweep: refused: seed=range(0,0) lists no value: the multirun would run no job; give the axis at "
        "least one value"
    ]
    assert not (env / "never").exists()
    # the command line's value of a key replaces the sweep file's, as Hydra's sweeper reads them
    from harness.app import multirun_jobs

    jobs = multirun_jobs(sweep_argv(str(mine), ["seed=1,2"]))[0]
    assert sorted(o for job in jobs for o in job if o.startswith("seed=")) == ["seed=1", "seed=1", "seed=2", "seed=2"]


def test_a_sweep_file_whose_name_hydra_reads_as_its_syntax_is_refused(env, capsys):
    """``harness sweep a,b.yaml`` became ``+sweep=a,b``, which Hydra reads as a sweep over the sweep
    group (a refusal naming neither the file nor its name)."""
    text = (REPO / "harness" / "conf" / "sweep" / "smoke.yaml").read_text().replace("sweep: smoke", "sweep: ab")
    for stem in ("a,b", "a b", "a=b", "(ab)"):
        path = env / f"{stem}.yaml"
        path.write_text(text)
        assert sweep_main([str(path), f"hydra.sweep.dir={env / 'never'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"harness sweep: refused: sweep file {path}: its name {stem!r} is passed to Hydra as +sweep={stem}, "
            "which reads other characters than letters, digits, '_', '-' and '.' as its own syntax"
        ), err
        assert "rename the file" in err[0] and not (env / "never").exists()
    fine = env / "a-b.2.yaml"
    fine.write_text(text)
    assert sweep_argv(str(fine), [])[2] == "+sweep=a-b.2"


def test_a_sweep_folder_that_is_a_file_is_refused_naming_the_option(env, capsys):
    """It said "cannot create the job folder <path>: File exists", naming neither the option nor the file."""
    afile = env / "afile"
    afile.write_text("mine\n")
    rc, summary = launch(afile, "launcher=basic", "proposer=prompt_lookup", "verifier=greedy")
    assert rc == 2 and not summary
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        f"harness sweep: refused: the sweep folder hydra.sweep.dir={afile}: a file is in the way; an output folder "
        "is needed there"
    ]
    assert afile.read_text() == "mine\n"


def test_a_sweep_into_a_folder_of_records_or_a_report_it_did_not_write_is_refused(env, capsys):
    """An empty hydra.sweep.dir put the sweep's files in the working directory and removed its report/; a
    folder laid out as `make demo` leaves it (a run's folder below, a report/ beside) had its report
    replaced and the run counted with the sweep's jobs. Each refused, nothing written or removed."""
    common = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy"]
    notes = env / "report" / "notes.md"
    notes.parent.mkdir()
    notes.write_text("mine")
    rc = sweep_main(["smoke", *common, "hydra.sweep.dir="])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "harness sweep: refused: hydra.sweep.dir is empty: a sweep writes its job folders, store, summary and "
        "report into it; give it a folder of its own"
    )
    assert not [n for n in ("launch.json", "summary.json", "store.parquet", "failures.jsonl") if (env / n).exists()]
    assert sorted(p.name for p in (env / "report").iterdir()) == ["notes.md"]

    demo = env / "demo"
    (demo / "default").mkdir(parents=True)
    (demo / "default" / "record.json").write_text("{}")
    rc, _ = launch(demo, *common)
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"harness sweep: refused: hydra.sweep.dir={demo} holds records no sweep launched there "
        "(default/record.json): the sweep's store and report would count them with its jobs; give the sweep a "
        "folder of its own"
    )
    (demo / "report").mkdir()
    rc, _ = launch(demo, *common)
    assert rc == 2 and "holds a report/ folder no sweep wrote there" in capsys.readouterr().err
    assert sorted(str(p.relative_to(demo)) for p in demo.rglob("*")) == ["default", "default/record.json", "report"]
    assert notes.read_text() == "mine"
    # a sweep's own folder whose launch file went missing (its summary or store is there) still resumes
    (demo / "summary.json").write_text("{}")
    assert sweep.sweep_folder_problem(demo, "smoke") is None


def test_jobs_told_apart_only_by_a_launch_only_key_are_refused_before_anything_is_written(env, capsys):
    """Sweeping a key job folder names leave out (tracking) gave both jobs one folder: the second was
    skipped as the first's, or found it busy."""
    sweep_dir = env / "multirun" / "smoke"
    rc, summary = launch(
        sweep_dir, "launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "tracking=none,wandb"
    )
    assert rc == 2 and not summary and not sweep_dir.exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "harness sweep: refused: jobs 1 and 2 of 2 would share one folder "
        "(proposer=prompt_lookup,topology=sequence,verifier=greedy's): tracking is left out of job folder names (it "
        "changes how a job is launched or logged, not what it measures); sweep it in separate launches"
    )


def test_a_job_folder_name_too_long_for_the_file_system_is_refused_before_anything_is_written(env, capsys):
    """A job's folder is named by its overrides; past 255 bytes the file system refused it after the launch
    had written its launch file, summary and store."""
    sweep_dir = env / "multirun" / "smoke"
    long_name = "p" * 250 + ".jsonl"
    rc, summary = launch(
        sweep_dir,
        "launcher=basic",
        "proposer=prompt_lookup",
        "verifier=greedy,membership",
        f"workload.path={long_name}",
    )
    assert rc == 2 and not summary and not sweep_dir.exists()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(
        "harness sweep: refused: job 1 of 2 (verifier=greedy): its folder name, its overrides joined, is"
    )
    assert "file systems take 255" in line and line.endswith("no job was run")


def test_a_sweep_value_listed_twice_is_refused_before_any_job(env, capsys):
    """``seed=0,0`` made one job twice; the second skipped the first's folder and the summary said
    ``0 ran, 1 skipped`` although the first ran."""
    sweep_dir = env / "multirun" / "dup"
    rc, summary = launch(sweep_dir, "launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "seed=0,1,0")
    assert rc == 2 and not summary and not sweep_dir.exists()
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        "harness sweep: refused: jobs 1 and 3 of 3 are the same job (seed=0): a sweep value is listed twice; "
        "list each once"
    ]


def test_jobs_that_compose_to_one_configuration_are_refused_before_any_job(env, capsys):
    """``generation.temperature=0,0.0`` are two values by their text and one job by their config: run
    in one batch both were measured, and the store kept both records."""
    sweep_dir = env / "multirun" / "twin"
    rc, summary = launch(
        sweep_dir, "launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "generation.temperature=0,0.0"
    )
    assert rc == 2 and not summary and not sweep_dir.exists()
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        "harness sweep: refused: jobs 1 and 2 of 2 run the same configuration (generation.temperature=0 and "
        "generation.temperature=0.0): their values are written differently but compose to one job; list it once"
    ]
    # a Hydra setting is no part of the composed config, yet it changes the job (its environment)
    from harness.app import preflight_multirun

    argv = sweep.sweep_argv(
        "smoke",
        [
            "launcher=basic",
            "proposer=prompt_lookup",
            "verifier=greedy",
            "hydra.sweep.subdir=${hydra.job.num}",
            "+hydra.job.env_set.OMP_NUM_THREADS=1,2",
            f"hydra.sweep.dir={sweep_dir}",
        ],
    )
    preflight_multirun(argv, command="sweep")


def _hydra(launcher: dict, max_batch_size=None):
    return OmegaConf.create({"launcher": launcher, "sweeper": {"max_batch_size": max_batch_size}})


@pytest.mark.parametrize(
    "batch, planned, expected",
    [
        (None, 2, [2, 2]),  # one batch (a Slurm array) of 2, whatever the launcher's width
        (4, 2, [2, 2]),  # batches of concurrent_jobs=4 of a 2-job sweep
        (2, 3, [2, 2, 1]),  # the last batch holds the rest
        (1, 3, [1, 1, 1]),
    ],
)
def test_jobs_in_batch_counts_the_jobs_handed_over_with_each_job(batch, planned, expected):
    joblib = {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 4}
    hydra = _hydra(joblib, batch)
    assert [sweep.jobs_in_batch(hydra, num, planned) for num in range(planned)] == expected
    assert sweep.jobs_in_batch(hydra, planned, planned) is None  # not a job of the plan
    assert sweep.jobs_in_batch(hydra, 0, None) is None  # no plan (another sweeper)


@pytest.mark.parametrize(
    "launcher, batch, expected",
    [
        ({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}, None, 1),
        ({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}, 4, 1),
        ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 2}, 1, 1),
        ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 2}, 4, 2),
        ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 3}, 3, 3),
        ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": -1}, 2, 2),
        ({"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"}, 1, 1),
        ({"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"}, None, None),
        (
            {
                "_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
                "array_parallelism": 4,
            },
            8,
            4,
        ),
    ],
)
def test_launcher_concurrency(launcher, batch, expected):
    assert launcher_concurrency(_hydra(launcher, batch)) == expected


def test_launcher_concurrency_joblib_all_cpus_and_unknown_launcher():
    joblib_all = {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": -1}
    assert launcher_concurrency(_hydra(joblib_all)) == os.cpu_count()
    with pytest.raises(ValueError, match="unknown Hydra launcher 'x.RayLauncher'"):
        launcher_concurrency(_hydra({"_target_": "x.RayLauncher"}))


# --------------------------------------------------------------------------------------------
# sweeps that run (model=tiny, one prompt, 8 tokens)

GREEDY = "proposer=prompt_lookup,topology=sequence,verifier=greedy"


def _statuses(sweep_dir: Path) -> dict[str, dict]:
    return {json.loads(p.read_text())["job"]: json.loads(p.read_text()) for p in sweep_dir.rglob(JOB_STATUS)}


def test_relaunch_skips_finished_reruns_removed_and_lists_failures(env):
    """joblib with one worker (in this process): one arm runs, one is refused by negotiation
    (rejection needs temperature > 0). The oracle gate is off here only to keep this test fast;
    the slow tests run every gate."""
    sweep_dir = env / "multirun" / "smoke"
    common = [
        "launcher=joblib",
        "proposer=prompt_lookup",
        "gates.oracle=false",
        "hydra.callbacks.harness_sweep.report=false",
    ]
    args = [*common, "verifier=greedy,rejection"]
    job = f"gates.oracle=False,{GREEDY}"
    refused = f"gates.oracle=False,{GREEDY.replace('greedy', 'rejection')}"

    rc, summary = launch(sweep_dir, *args)
    assert rc == 1  # a job failed; the other completed
    assert (summary["ran"], summary["skipped"], summary["failed"]) == ([job], [], [refused])
    record = load_record(sweep_dir / job / "record.json")
    assert record["sweep"] == "smoke"
    assert record["axes"]["verifier"] == "greedy"
    assert record["metrics"]["concurrent_jobs"] == 1
    assert record["metrics"]["torch_threads"] == 1
    assert not (sweep_dir / refused / "record.json").exists()
    failures = [json.loads(line) for line in (sweep_dir / FAILURES_FILE).read_text().splitlines()]
    assert len(failures) == 1
    assert failures[0]["job"] == refused
    assert "verifier=rejection" in failures[0]["overrides"]
    assert failures[0]["error"]["type"] == "NegotiationError"
    assert "needs temperature > 0" in failures[0]["error"]["message"]
    assert failures[0]["refused"] is True
    store = pd.read_parquet(sweep_dir / STORE_FILE)
    assert list(store["verifier"]) == ["greedy"]
    assert list(store["run_id"]) == [record["run_id"]]
    first_mtime = (sweep_dir / job / "record.json").stat().st_mtime_ns

    # re-launch: the finished job is skipped (record untouched), the refused one is tried again
    rc, summary = launch(sweep_dir, *args)
    assert rc == 1
    assert (summary["ran"], summary["skipped"], summary["failed"]) == ([], [job], [refused])
    assert (sweep_dir / job / "record.json").stat().st_mtime_ns == first_mtime
    assert _statuses(sweep_dir)[job]["manifest_hash"] == record["manifest_hash"]

    # a removed record (what a crashed job leaves) is re-run
    (sweep_dir / job / "record.json").unlink()
    rc, summary = launch(sweep_dir, *common, "verifier=greedy")
    assert rc == 0
    assert (summary["ran"], summary["skipped"], summary["failed"]) == ([job], [], [])
    assert load_record(sweep_dir / job / "record.json")["manifest_hash"] == record["manifest_hash"]
    assert (sweep_dir / FAILURES_FILE).read_text() == ""  # this launch had no failure
    assert len(pd.read_parquet(sweep_dir / STORE_FILE)) == 1


def test_a_changed_manifest_reruns_the_job(env, tmp_path):
    """Same folder, different manifest (a record from another configuration): not skipped."""
    from harness.manifest import job_manifest_hash

    sweep_dir = env / "multirun" / "smoke"
    args = [
        "launcher=basic",
        "proposer=prompt_lookup",
        "verifier=greedy",
        "gates.enabled=false",
        "hydra.callbacks.harness_sweep.report=false",
    ]
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0 and len(summary["ran"]) == 1
    path = sweep_dir / summary["ran"][0] / "record.json"
    record = json.loads(path.read_text())
    from harness.config import compose

    cfg = compose(["+sweep=smoke", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"])
    cfg.concurrent_jobs = 1
    assert job_manifest_hash(cfg) == record["manifest_hash"]
    record["manifest_hash"] = "0" * 16
    path.write_text(json.dumps(record))
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0 and len(summary["ran"]) == 1 and summary["skipped"] == []
    assert json.loads(path.read_text())["manifest_hash"] == job_manifest_hash(cfg)


def test_a_job_whose_round_series_is_gone_is_run_again(env, capsys):
    """The record names its rounds.jsonl, which a relaunch with tracking=wandb logs after the fact: a
    job whose series was removed was skipped as complete, and its record never logged."""
    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    args.append("hydra.callbacks.harness_sweep.report=false")
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0 and len(summary["ran"]) == 1
    job = sweep_dir / summary["ran"][0]
    series = load_record(job / "record.json")["round_series"]
    assert series["rows"] == len((job / "rounds.jsonl").read_text().splitlines()) > 0 and series["sha256"]
    (job / "rounds.jsonl").unlink()
    capsys.readouterr()
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0 and summary["ran"] == [job.name] and summary["skipped"] == []
    assert "its rounds.jsonl is missing" in capsys.readouterr().err  # the reason its files went aside
    again = load_record(job / "record.json")["round_series"]
    assert again["sha256"] == hashlib.sha256((job / "rounds.jsonl").read_bytes()).hexdigest()
    assert again["rows"] == series["rows"]  # the same rounds again (their timings are the run's own)


def test_a_job_whose_record_binds_its_outputs_by_no_digest_is_run_again(env, capsys):
    """A record whose outputs.sha256 was null read as valid: the relaunch planning its jobs ended with
    "error: TypeError" naming no file, before any job ran. Its record is not valid: the job runs again
    (its files moved aside, saying why) and the store is built."""
    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    args.append("hydra.callbacks.harness_sweep.report=false")
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0 and len(summary["ran"]) == 1
    job = sweep_dir / summary["ran"][0]
    record = json.loads((job / "record.json").read_text())
    record["outputs"]["sha256"] = None
    (job / "record.json").write_text(json.dumps(record))
    capsys.readouterr()
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0 and summary["ran"] == [job.name] and summary["skipped"] == []
    assert "outputs.sha256 must be a SHA-256 digest" in capsys.readouterr().err  # the reason its files went aside
    assert (
        load_record(job / "record.json")["outputs"]["sha256"]
        == hashlib.sha256((job / "outputs.jsonl").read_bytes()).hexdigest()
    )
    written = json.loads((sweep_dir / "summary.json").read_text())
    assert written["store_error"] is None and written["records"] == 1


def test_a_job_that_fails_before_its_manifest_keeps_a_record_of_its_own_config(env, monkeypatch):
    """A job that fails while it is set up (a launcher setting, an artifact it cannot open) moved its
    folder's complete record aside: one bad relaunch emptied the store of every finished job. A record
    of this job's config now stays (the next launch checks its manifest); other files still go aside."""
    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    args.append("hydra.callbacks.harness_sweep.report=false")
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0 and len(summary["ran"]) == 1
    job = sweep_dir / summary["ran"][0]
    first = load_record(job / "record.json")

    def unopenable(cfg):
        raise OSError("cannot open the proposer's artifact (test)")

    monkeypatch.setattr(sweep, "job_manifest", unopenable)
    rc, summary = launch(sweep_dir, *args)
    assert rc == 1 and summary["failed"] == [job.name] and summary["ran"] == []
    assert load_record(job / "record.json")["run_id"] == first["run_id"] and not (job / ".previous").exists()
    assert list(pd.read_parquet(sweep_dir / STORE_FILE)["run_id"]) == [first["run_id"]]
    # a folder without a complete record of this config: its files are set aside, as before
    (job / "record.json").unlink()
    rc, summary = launch(sweep_dir, *args)
    assert rc == 1 and not (job / "outputs.jsonl").exists() and (job / ".previous").is_dir()


def _wandb_summary(job_dir: Path) -> dict:
    (run_file,) = job_dir.glob("wandb/offline-run-*/run-*.wandb")
    res = subprocess.run(
        [str(WANDB_CLI), "leet", "inspect", "--summary", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(res.stdout)


def _check_sweep(sweep_dir: Path, summary: dict, *, concurrent: int) -> None:
    """Every job ran, wrote a valid record with the launch width, one offline W&B run, the store."""
    assert summary["skipped"] == [] and summary["failed"] == []
    assert len(summary["ran"]) == 2
    store = pd.read_parquet(sweep_dir / STORE_FILE)
    assert sorted(store["proposer"]) == ["draft_model", "prompt_lookup"]
    assert (sweep_dir / "report" / "report.md").is_file()
    for job in summary["ran"]:
        record = load_record(sweep_dir / job / "record.json")
        assert record["metrics"]["concurrent_jobs"] == concurrent
        assert record["metrics"]["torch_threads"] == 1
        assert all(g["status"] != "failed" for g in record["gates"].values())
        assert "oracle" in record["gates"] and "equivalence" in record["gates"]
        assert len(list((sweep_dir / job).glob("wandb/offline-run-*/run-*.wandb"))) == 1
    job = summary["ran"][0]
    record = load_record(sweep_dir / job / "record.json")
    logged = json.dumps(_wandb_summary(sweep_dir / job))
    assert record["run_id"] in logged
    assert record["manifest_hash"] in logged


@pytest.mark.slow
def test_submitit_local_sweep_writes_records_wandb_runs_and_store(env):
    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=submitit_local", "verifier=greedy", "tracking=wandb"]
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0, summary
    _check_sweep(sweep_dir, summary, concurrent=1)
    assert (sweep_dir / ".submitit").is_dir()

    # the other spelling, `harness run -m +sweep=smoke ...` (any launcher), finds the same folders
    # and skips both jobs
    from harness.app import run_main

    rc = run_main(["-m", "+sweep=smoke", "hydra/launcher=basic", "verifier=greedy", f"hydra.sweep.dir={sweep_dir}"])
    assert rc == 0
    assert sorted(sweep.LAST_SUMMARY["skipped"]) == sorted(summary["ran"])


@pytest.mark.slow
def test_joblib_two_at_once_records_concurrent_jobs(env):
    sweep_dir = env / "multirun" / "smoke"
    rc, summary = launch(sweep_dir, "launcher=joblib", "concurrent_jobs=2", "verifier=greedy", "tracking=wandb")
    try:
        assert rc == 0, summary
        _check_sweep(sweep_dir, summary, concurrent=2)
    finally:
        from joblib.externals.loky import get_reusable_executor

        get_reusable_executor().shutdown(wait=True)


def test_a_code_change_changes_the_job_manifest_hash(hydra_conf, tmp_path, monkeypatch):
    """The run manifest carries a fingerprint of the harness sources, so a finished sweep job is
    re-run (not skipped) after the code that produced its record changed."""
    from omegaconf import OmegaConf

    import harness.manifest as manifest

    full = _compose(["+sweep=smoke"])
    cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])  # what a job's runner sees
    versions = {"torch": "x"}
    real = manifest.job_manifest_hash(cfg, versions=versions)
    assert manifest.freeze_manifest(cfg, versions=versions)["harness_code"] == manifest.code_fingerprint()
    pkg = tmp_path / "harness"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(manifest, "PACKAGE_DIR", pkg)
    manifest.code_fingerprint.cache_clear()
    try:
        first = manifest.job_manifest_hash(cfg, versions=versions)
        manifest.code_fingerprint.cache_clear()
        assert manifest.job_manifest_hash(cfg, versions=versions) == first  # same code, same hash
        (pkg / "sub" / "b.py").write_text("y = 3\n")
        manifest.code_fingerprint.cache_clear()
        assert manifest.job_manifest_hash(cfg, versions=versions) != first
    finally:
        manifest.code_fingerprint.cache_clear()
    assert first != real


# --------------------------------------------------------------------------------------------
# job folders: resume by what ran, earlier files moved aside, nothing stale in the store


def test_jobs_resume_by_what_ran_not_by_job_number(env, capsys):
    """Folders are named by overrides: reordering an axis list skips every finished job; a job
    whose outputs were deleted is re-run, with a warning giving the reason."""
    sweep_dir = env / "multirun" / "smoke"
    common = [
        "launcher=basic",
        "proposer=prompt_lookup",
        "gates.enabled=false",
        "hydra.callbacks.harness_sweep.report=false",
    ]
    rc, first = launch(sweep_dir, *common, "verifier=greedy,membership")
    assert rc == 0 and len(first["ran"]) == 2 and first["failed"] == []
    rc, again = launch(sweep_dir, *common, "verifier=membership,greedy")
    assert rc == 0 and again["ran"] == [] and sorted(again["skipped"]) == sorted(first["ran"])

    job = next(j for j in first["ran"] if "verifier=greedy" in j)
    record = load_record(sweep_dir / job)
    (sweep_dir / job / "outputs.jsonl").unlink()
    capsys.readouterr()
    rc, third = launch(sweep_dir, *common, "verifier=greedy,membership")
    assert rc == 0 and third["ran"] == [job] and len(third["skipped"]) == 1
    (aside,) = (sweep_dir / job / ".previous").iterdir()
    out = capsys.readouterr().err
    assert (
        f"[WARNING] - re-running sweep job {job}: its outputs.jsonl is missing; its earlier files are moved to {aside}"
    ) in out
    assert load_record(aside / "record.json")["run_id"] == record["run_id"]
    store = pd.read_parquet(sweep_dir / STORE_FILE)
    assert len(store) == 2 and record["run_id"] not in set(store["run_id"])


def test_a_record_timed_beside_other_jobs_is_timed_again_by_a_launch_that_runs_fewer(env, capsys):
    """A job timed while another shared the two cores (joblib, concurrent_jobs=2) was skipped by a
    relaunch at concurrent_jobs=1: the contended figures stood beside jobs timed alone, and compare
    said nothing. The relaunch times it again, saying why, and compare notes such runs."""
    from harness.tracking.compare import compare, format_table

    sweep_dir = env / "multirun" / "smoke"
    common = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false", "seed=0"]
    rc, first = launch(sweep_dir, *common)
    assert rc == 0 and len(first["ran"]) == 1
    assert json.loads(capsys.readouterr().out) == {  # the launch's result on stdout, as a run prints its record's
        "sweep_dir": str(sweep_dir),
        "summary": str(sweep_dir / "summary.json"),
        "store": str(sweep_dir / STORE_FILE),
        "report": str(sweep_dir / "report"),
        "ran": 1,
        "skipped": 0,
        "failed": 0,
        "unfinished": 0,
    }
    (job,) = first["ran"]
    path = sweep_dir / job / "record.json"
    record = json.loads(path.read_text())
    record["metrics"]["concurrent_jobs"] = 2  # as a joblib launch of two at once records it
    path.write_text(json.dumps(record))
    store = pd.read_parquet(sweep_dir / STORE_FILE)  # the store of the first launch, relabelled likewise
    store["concurrent_jobs"] = 2
    table = format_table(compare(store, n_resamples=50), by="proposer", baseline=None, level=0.95)
    assert "note: runs launched with other jobs at once (prompt_lookup: 2 at once)" in table
    capsys.readouterr()
    rc, again = launch(sweep_dir, *common)
    assert rc == 0 and again["ran"] == [job] and again["skipped"] == []
    assert "its record was timed while 2 jobs ran at once, and this launch runs 1; its earlier files are moved" in (
        capsys.readouterr().err
    )
    assert load_record(path)["metrics"]["concurrent_jobs"] == 1
    rc, third = launch(sweep_dir, *common)  # timed alone now: skipped as before
    assert rc == 0 and third["skipped"] == [job]


def test_a_record_the_store_cannot_read_leaves_no_store_or_report_of_an_earlier_launch(env, capsys):
    """A record.json the store refuses (one written by hand) made the end of the launch raise inside
    a Hydra callback: a warning with the error, "finished without a sweep summary", and the earlier
    launch's summary, store and report left standing. The summary is this launch's now, says why no
    store was written, and the launch exits non-zero naming the record."""
    sweep_dir = env / "multirun" / "smoke"
    common = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false", "seed=0"]
    rc, first = launch(sweep_dir, *common)
    assert rc == 0 and (sweep_dir / STORE_FILE).is_file() and (sweep_dir / "report" / "report.md").is_file()
    (sweep_dir / "junk").mkdir()
    (sweep_dir / "junk" / "record.json").write_text("{}")
    capsys.readouterr()
    rc, summary = launch(sweep_dir, *common)
    err = capsys.readouterr().err
    assert rc == 1 and len(summary["skipped"]) == 1
    written = json.loads((sweep_dir / "summary.json").read_text())
    assert written["launch_id"] == json.loads((sweep_dir / "launch.json").read_text())["launch_id"]
    assert written["launch_id"] != first["launch_id"] and written["store"] is None
    assert (
        written["store_error"] == f"{sweep_dir / 'junk' / 'record.json'}: no schema_version; expected schema_version 2"
    )
    assert not (sweep_dir / STORE_FILE).exists() and not (sweep_dir / "report").exists()
    assert f"store and report not written: {written['store_error']}" in err
    assert f"harness sweep: the sweep's store was not written: {written['store_error']}" in err
    assert "without a sweep summary" not in err and "UserWarning" not in err


def test_an_interrupted_launch_leaves_a_store_and_summary_of_what_the_folder_holds_and_no_report(
    env, capsys, monkeypatch
):
    """Hydra's end of the multirun never comes after an interrupt: the store, summary and report
    would describe the launch before. The store and summary are rebuilt from the records as they
    stand (the finished job's new record beside the earlier launch's), the summary
    says interrupted, and the earlier report is gone."""
    import harness.runner as runner

    sweep_dir = env / "multirun" / "smoke"
    common = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false", "seed=0,1"]
    rc, first = launch(sweep_dir, *common)
    assert rc == 0 and len(first["ran"]) == 2 and (sweep_dir / "report" / "report.md").is_file()
    before = set(pd.read_parquet(sweep_dir / STORE_FILE)["run_id"])

    real, calls = runner.measure, []

    def measure_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "measure", measure_then_interrupt)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        launch(sweep_dir, *common, "generation.max_new_tokens=6")
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and len(summary["ran"]) == 1
    assert summary["launch_id"] == json.loads((sweep_dir / "launch.json").read_text())["launch_id"]
    store = pd.read_parquet(sweep_dir / STORE_FILE)
    # the earlier jobs (folders named by the earlier overrides) and the one new record
    assert len(store) == 3 and set(store["run_id"]) > before
    assert sorted(store["config.generation.max_new_tokens"]) == [6, 8, 8]
    assert not (sweep_dir / "report").exists()
    err = capsys.readouterr().err
    assert f"sweep folder {sweep_dir}: interrupted after 1 ran, 0 skipped, 0 failed, 1 unfinished" in err
    # the job the interrupt cut short is named, in the summary and in failures.jsonl
    (cut,) = summary["unfinished"]
    assert (
        f"unfinished (started, no end status: killed, or a scheduler still runs it; a relaunch runs it again): {cut}"
        in err
    )
    (line,) = [json.loads(x) for x in (sweep_dir / FAILURES_FILE).read_text().splitlines()]
    assert line["job"] == cut and line["stage"] == "unfinished" and line["error"]["type"] == "Unfinished"
    assert line["started_at"] and line["finished_at"] is None
    assert "report not written (interrupted); launch the sweep again to finish it" in err
    assert sweep.ACTIVE_LAUNCHES == []
    monkeypatch.setattr(runner, "measure", real)
    rc, again = launch(sweep_dir, *common, "generation.max_new_tokens=6")  # the folder's lock was let go
    assert rc == 0 and len(again["ran"]) == 1 and len(again["skipped"]) == 1 and again["interrupted"] is False
    assert (sweep_dir / "report" / "report.md").is_file()

    # an interrupt while the end of the launch writes the report: the same, and the folder is let go
    import harness.tracking.report as report_mod

    def interrupted_report(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(report_mod, "main", interrupted_report)
        with pytest.raises(KeyboardInterrupt):
            launch(sweep_dir, *common, "generation.max_new_tokens=6")
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["stopped_by"] == "interrupted" and len(summary["skipped"]) == 2
    assert not (sweep_dir / "report").exists() and sweep.ACTIVE_LAUNCHES == []

    # a launcher that dies (a worker killed for memory): the store and summary are rebuilt all the same
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    def died(*args, **kwargs):
        raise RuntimeError("A worker process managed by the executor was unexpectedly terminated")

    with monkeypatch.context() as patch:
        patch.setattr(BasicLauncher, "launch", died)
        rc, stopped = launch(sweep_dir, *common, "generation.max_new_tokens=5")
    assert rc == 1 and stopped["interrupted"] is False
    assert stopped["stopped_by"] == "RuntimeError: A worker process managed by the executor was unexpectedly terminated"
    # the jobs the launch planned and never started are named by their overrides
    assert len(stopped["not_started"]) == 2 and all("generation.max_new_tokens=5" in j for j in stopped["not_started"])
    assert [j for j in stopped["not_started"] if "seed=1" in j.split(",")]
    err = capsys.readouterr().err
    assert "stopped by RuntimeError: A worker process" in err and ", 0 failed, 2 not started" in err
    assert "not started (the launch stopped first; a relaunch runs them): " in err
    assert sweep.ACTIVE_LAUNCHES == []
    rc, last = launch(sweep_dir, *common, "generation.max_new_tokens=6")  # the folder was let go
    assert rc == 0 and len(last["skipped"]) == 2 and (sweep_dir / "report" / "report.md").is_file()


def test_jobs_a_launch_never_started_are_named_as_their_folders_would_be(env, capsys, monkeypatch):
    """A launch cut short named the jobs it never started by their planned overrides, launch-only keys
    (+sweep, tracking, concurrent_jobs) and Hydra's order included, where the jobs that ran are named by
    their folders: one job had two names. Both are the folder's name now."""
    from hydra.core.plugins import Plugins

    Plugins.instance()  # Hydra's plugin scan runs the launcher's module again: the class patched is the one after
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    def died(*args, **kwargs):
        raise RuntimeError("A worker process managed by the executor was unexpectedly terminated")

    sweep_dir = env / "multirun" / "smoke"
    common = ["launcher=basic", "verifier=greedy", "seed=1,0", "tracking=none", "proposer=prompt_lookup"]
    common.append("hydra.callbacks.harness_sweep.report=false")
    with monkeypatch.context() as patch:
        patch.setattr(BasicLauncher, "launch", died)
        rc, stopped = launch(sweep_dir, *common)
    assert rc == 1 and stopped["stopped_by"].startswith("RuntimeError: A worker process")
    planned = json.loads((sweep_dir / "launch.json").read_text())["planned_jobs"]
    assert all("+sweep=smoke" in job and "tracking=none" in job for job in planned)  # keys the folders leave out
    named = [
        "proposer=prompt_lookup,seed=1,topology=sequence,verifier=greedy",
        "proposer=prompt_lookup,seed=0,topology=sequence,verifier=greedy",
    ]
    assert stopped["not_started"] == named
    failures = [json.loads(line) for line in (sweep_dir / FAILURES_FILE).read_text().splitlines()]
    assert [(f["job"], f["stage"]) for f in failures] == [(name, "not started") for name in named]
    assert [f["overrides"] for f in failures] == planned  # the overrides a relaunch runs them by, as planned
    capsys.readouterr()
    rc, again = launch(sweep_dir, *common)  # the jobs that run are named by the same folders
    assert rc == 0 and sorted(again["ran"]) == sorted(named)
    assert sorted(p.parent.name for p in sweep_dir.glob("*/record.json")) == sorted(named)


def test_the_same_job_under_restated_overrides_is_skipped_naming_the_folder_that_holds_it(env, capsys):
    """A default restated on the command line (seed=0) names other folders for the same jobs: they
    are skipped, naming the folder with the record, and the store holds each measurement once. A
    record set aside in .previous/ does not count, and a changed job is not another's twin."""
    sweep_dir = env / "multirun" / "smoke"
    common = [
        "launcher=basic",
        "proposer=prompt_lookup",
        "verifier=greedy",
        "gates.enabled=false",
        "hydra.callbacks.harness_sweep.report=false",
    ]
    rc, first = launch(sweep_dir, *common)
    assert rc == 0 and len(first["ran"]) == 1
    (job,) = first["ran"]
    record = load_record(sweep_dir / job / "record.json")

    capsys.readouterr()
    rc, again = launch(sweep_dir, *common, "seed=0")
    assert rc == 0 and again["ran"] == [] and again["failed"] == []
    (restated,) = again["skipped"]
    assert restated != job and "seed=0" in restated
    assert again["same_as"] == {restated: job}
    err = capsys.readouterr().err
    assert f"skipped {restated}: the same job (manifest hash {record['manifest_hash']}) is complete in {job}" in err
    status = _statuses(sweep_dir)[restated]
    assert status["record"] == str(sweep_dir / job / "record.json")
    assert not (sweep_dir / restated / "record.json").exists()
    store = pd.read_parquet(sweep_dir / STORE_FILE)
    assert list(store["run_id"]) == [record["run_id"]]
    summary_text = sweep.format_summary(
        sweep.SweepSummary(**{k: again[k] for k in ("sweep_dir", "launch_id", "skipped", "same_as")})
    )
    assert f"{restated} (same job as {job})" in summary_text

    # another seed is another job; a run with other gates is no twin (the manifest leaves the gates
    # out: an ungated record must not stand for a gated job); a twin set aside in .previous/ is none
    rc, other = launch(sweep_dir, *common, "seed=1")
    assert rc == 0 and len(other["ran"]) == 1 and other["same_as"] == {}
    rc, gated = launch(sweep_dir, *[c for c in common if c != "gates.enabled=false"], "gates.oracle=false")
    assert rc == 0 and len(gated["ran"]) == 1 and gated["same_as"] == {}
    assert load_record(sweep_dir / gated["ran"][0] / "record.json")["manifest_hash"] == record["manifest_hash"]
    set_aside(sweep_dir / job)
    rc, moved = launch(sweep_dir, *common, "seed=0")
    assert rc == 0 and moved["ran"] == [restated] and moved["same_as"] == {}
    assert load_record(sweep_dir / restated / "record.json")["manifest_hash"] == record["manifest_hash"]
    # a record kept in a hidden folder (a user's .bak/) is none either: the store leaves it out too
    (sweep_dir / ".bak").mkdir()
    (sweep_dir / restated).rename(sweep_dir / ".bak" / restated)
    rc, hidden = launch(sweep_dir, *common)
    assert rc == 0 and hidden["ran"] == [job] and hidden["same_as"] == {}
    assert record["manifest_hash"] in set(pd.read_parquet(sweep_dir / STORE_FILE)["manifest_hash"])


def test_a_job_skipped_as_another_folder_s_twin_sets_its_own_stale_record_aside(env):
    """A job skipped because another folder holds the same job kept its own folder's record of
    another manifest, which the store and compare then pooled beside the twin's."""
    sweep_dir = env / "multirun" / "smoke"
    common = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    common.append("hydra.callbacks.harness_sweep.report=false")
    rc, first = launch(sweep_dir, *common, "seed=0")
    assert rc == 0 and len(first["ran"]) == 1
    (restated,) = first["ran"]
    path = sweep_dir / restated / "record.json"
    stale = json.loads(path.read_text())
    stale["manifest_hash"] = "0" * 16  # as a record written by other code
    path.write_text(json.dumps(stale))
    rc, plain = launch(sweep_dir, *common)
    assert rc == 0 and len(plain["ran"]) == 1
    (job,) = plain["ran"]
    rc, again = launch(sweep_dir, *common, "seed=0")
    assert rc == 0 and again["skipped"] == [restated] and again["same_as"] == {restated: job}
    assert not path.exists() and (sweep_dir / restated / ".previous").is_dir()
    assert list(pd.read_parquet(sweep_dir / STORE_FILE)["run_id"]) == [load_record(sweep_dir / job)["run_id"]]


@pytest.mark.parametrize("where", ["load", "check_job"])
def test_a_rerun_refused_after_a_change_leaves_the_record_of_the_other_manifest_aside(env, monkeypatch, where):
    """A job re-run for a changed manifest and then refused (a prompt grown past the context, an
    artifact it cannot open) put the earlier record back: the sweep's store and report then showed a
    record of another manifest than its job's. It stays in .previous/ now."""
    import harness.runner as runner

    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    args.append("hydra.callbacks.harness_sweep.report=false")
    rc, first = launch(sweep_dir, *args)
    assert rc == 0
    (job,) = first["ran"]
    path = sweep_dir / job / "record.json"
    other = json.loads(path.read_text())
    other["manifest_hash"] = "0" * 16  # measured by other code
    path.write_text(json.dumps(other))

    def refused(*a, **k):
        raise ValueError("prompt 'p0' needs 900 positions (test)")

    monkeypatch.setattr(runner, where, refused)
    rc, again = launch(sweep_dir, *args)
    assert rc == 1 and again["failed"] == [job]
    assert not path.exists() and len(list((sweep_dir / job / ".previous").iterdir())) == 1
    assert pd.read_parquet(sweep_dir / STORE_FILE).empty


def test_a_job_rerun_after_a_code_change_that_fails_its_gate_leaves_no_record_in_folder_store_or_report(
    env, capsys, monkeypatch
):
    """A job passes; the code hash changes and the gate fails: the re-run moved the old record
    aside first, so the folder has no record, and the store and report hold none."""
    import harness.manifest as manifest
    import harness.runner as runner
    from harness.gates.status import GateError

    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0
    (job,) = summary["ran"]
    folder = sweep_dir / job
    old = load_record(folder)
    assert list(pd.read_parquet(sweep_dir / STORE_FILE)["run_id"]) == [old["run_id"]]
    assert old["run_id"] in (sweep_dir / "report" / "report.md").read_text()

    def failing_gate(*a, **k):
        raise GateError("statistical gate failed: p = 0.001 < alpha (test)")

    monkeypatch.setattr(manifest, "code_fingerprint", lambda: "0123456789abcdef")
    monkeypatch.setattr(runner, "gate", failing_gate)
    capsys.readouterr()
    rc, summary = launch(sweep_dir, *args)
    assert rc == 1
    assert (summary["ran"], summary["skipped"], summary["failed"]) == ([], [], [job])

    # the folder: no record, no outputs; the earlier files lie in .previous/
    assert not (folder / "record.json").exists() and not (folder / "outputs.jsonl").exists()
    (aside,) = (folder / ".previous").iterdir()
    assert load_record(aside / "record.json")["run_id"] == old["run_id"]
    status = json.loads((folder / JOB_STATUS).read_text())
    assert (status["status"], status["stage"], status["refused"]) == ("failed", "run", True)
    assert status["manifest_hash"] != old["manifest_hash"]
    out = capsys.readouterr().err
    assert (
        f"[WARNING] - re-running sweep job {job}: its record has manifest hash {old['manifest_hash']}, "
        f"this job {status['manifest_hash']} (changed: harness_code); its earlier files are moved to {aside}"
    ) in out

    # the store and the report hold no record of another manifest
    assert pd.read_parquet(sweep_dir / STORE_FILE).empty
    assert not (sweep_dir / "report").exists()
    failures = [json.loads(line) for line in (sweep_dir / FAILURES_FILE).read_text().splitlines()]
    assert [(f["job"], f["error"]["type"]) for f in failures] == [(job, "GateError")]


def test_a_sweep_job_whose_folder_a_live_run_holds_fails_without_touching_it(env, capsys):
    from test_job_folder import _hold

    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    rc, summary = launch(sweep_dir, *args, "hydra.callbacks.harness_sweep.report=false")
    (job,) = summary["ran"]
    before = (sweep_dir / job / "record.json").read_bytes()
    proc = _hold(sweep_dir / job)
    try:
        rc, summary = launch(sweep_dir, *args, "hydra.callbacks.harness_sweep.report=false")
    finally:
        proc.kill()
        proc.wait()
    assert rc == 1 and summary["failed"] == [job]
    assert f"harness sweep: 1 job(s) failed: {job}" in capsys.readouterr().err  # the command the user ran
    assert (sweep_dir / job / "record.json").read_bytes() == before  # the other run's files untouched
    failures = [json.loads(line) for line in (sweep_dir / FAILURES_FILE).read_text().splitlines()]
    assert failures[0]["error"]["type"] == "FolderBusy" and failures[0]["refused"] is True
    assert f"pid {proc.pid}" in failures[0]["error"]["message"]
    # a sweep refuses output_dir=: the advice names the sweep's own folder
    assert failures[0]["error"]["message"].endswith("or write elsewhere (hydra.sweep.dir=... for the whole sweep)")
    assert len(pd.read_parquet(sweep_dir / STORE_FILE)) == 1


def test_a_second_launch_into_a_sweep_folder_a_live_launch_holds_is_refused(env, capsys):
    """One launch at a time per sweep folder: a second one is refused in one line before any job
    (two would take each other's jobs and count them failed); the folder is free again after."""
    from test_job_folder import _hold

    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    proc = _hold(sweep_dir)
    try:
        rc, summary = launch(sweep_dir, *args, "hydra.callbacks.harness_sweep.report=false")
    finally:
        proc.kill()
        proc.wait()
    assert rc == 2 and not summary
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert len(err) == 1 and err[0].startswith(f"harness sweep: refused: the sweep folder {sweep_dir} is in use")
    assert err[0].endswith("or write elsewhere (hydra.sweep.dir=...)")
    assert not any(p.is_dir() for p in sweep_dir.iterdir())  # no job ran
    rc, summary = launch(sweep_dir, *args, "hydra.callbacks.harness_sweep.report=false")
    assert rc == 0 and len(summary["ran"]) == 1


def test_the_sweep_callback_holding_its_folder_pickles_for_launchers_in_other_processes(tmp_path):
    """submitit and joblib pickle the Hydra context, the callback with it, to start each job: the
    copy travels without the launching process's held lock, which stays held where it was taken."""
    import cloudpickle

    from harness.tracking.job_folder import LOCK_FILENAME, job_lock

    cb = sweep.SweepCallback()
    cb._lock = job_lock(tmp_path, purpose="harness sweep")
    cb._lock.__enter__()
    try:
        copy = cloudpickle.loads(cloudpickle.dumps(cb))
        assert copy._lock is None and copy.report is True
        assert cb._lock is not None and (tmp_path / LOCK_FILENAME).exists()  # still held here
    finally:
        cb._lock.__exit__(None, None, None)


# --------------------------------------------------------------------------------------------
# Hydra's own launcher switch, failures in any launcher, Slurm

TINY_MULTIRUN = [
    "-m",
    "model=tiny",
    "workload.limit=1",
    "generation.max_new_tokens=8",
    "threads=1",
    "gates.enabled=false",
    "proposer=prompt_lookup",
    "verifier=greedy,rejection",  # rejection needs temperature > 0: named before the launch, then refused
    "hydra.callbacks.harness_sweep.report=false",
]


def _multirun_with_a_failure(sweep_dir: Path, launcher: str, capsys) -> None:
    from harness.app import run_main

    rc = run_main([*TINY_MULTIRUN, f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep_dir}"])
    err = capsys.readouterr().err
    summary = sweep.LAST_SUMMARY
    assert rc == 1 and summary, err
    (ran,) = summary["ran"]
    (failed,) = summary["failed"]
    assert "verifier=rejection" in failed and "verifier=greedy" in ran
    assert f"harness run: 1 job(s) failed: {failed} (errors in {sweep_dir / FAILURES_FILE})" in err
    assert "harness run: job 2 of 2 (verifier=rejection) will be refused: " in err and "the other jobs run" in err
    record = load_record(sweep_dir / ran)
    assert record["metrics"]["concurrent_jobs"] == 1  # one timed job at a time unless raised
    assert json.loads((sweep_dir / FAILURES_FILE).read_text())["error"]["type"] == "NegotiationError"


def test_a_proposer_and_topology_that_do_not_go_together_are_a_hole_in_the_cross(env, capsys):
    """Crossing proposers with topologies where one proposer cannot build one topology refused the
    whole launch ("no job was run"), while a verifier that does not take a proposal was a hole the
    other jobs ran around. Both are the combination of methods: named, and the other jobs run."""
    from harness.app import preflight_multirun

    argv = [
        "-m",
        "model=tiny",
        "workload.limit=1",
        "proposer=prompt_lookup,draft_model",
        "topology=sequence,sequences",
    ]
    preflight_multirun(argv)  # no refusal of the launch
    err = capsys.readouterr().err
    assert (
        "harness run: job 4 of 4 (proposer=draft_model,topology=sequences) will be refused: proposer=draft_model "
        "cannot build topology=sequences (shape 'sequences')"
    ) in err and err.rstrip().endswith("the other jobs run")
    assert "job 1 of 4" not in err and "job 2 of 4" not in err and "job 3 of 4" not in err


def test_harness_run_multirun_with_hydras_own_basic_launcher_names_failed_jobs(env, capsys):
    _multirun_with_a_failure(env / "mr-basic", "basic", capsys)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["submitit_local", "joblib"])
def test_harness_run_multirun_with_hydras_own_launcher_switch_works_and_names_failed_jobs(env, capsys, launcher):
    """`harness run -m ... hydra/launcher=submitit_local` (jobs in other processes): every job runs
    (no 'cannot tell how many jobs run at once'), and the failed one makes the command fail. The
    launch's folder holds another harness/ package (as another checkout does): the job processes,
    started with ``python -m``, import the launching process's harness all the same."""
    (env / "harness").mkdir()
    (env / "harness" / "__init__.py").write_text("raise ImportError('the harness of the working directory')\n")
    try:
        _multirun_with_a_failure(env / f"mr-{launcher}", launcher, capsys)
    finally:
        if launcher == "joblib":
            from joblib.externals.loky import get_reusable_executor

            get_reusable_executor().shutdown(wait=True)


def test_a_multirun_with_a_value_one_job_refuses_runs_no_job_and_writes_nothing(env, capsys):
    """Every job is checked before the first runs: a bad value in a later job (an unknown option,
    a value out of range, output_dir) refuses the launch in one line naming the job; a cross whose
    every job is a refused combination is refused too."""
    from harness.app import run_main

    base = ["-m", "model=tiny", "workload.limit=1", "generation.max_new_tokens=8", "gates.enabled=false"]
    cases = [
        (["proposer=prompt_lookup,nosuch"], "job 2 of 2 (proposer=nosuch): proposer=nosuch is no option of proposer"),
        (
            ["seed=1,2", "generation.max_new_tokens=0"],
            "job 1 of 2 (seed=1): generation.max_new_tokens=0 is out of range",
        ),
        (["seed=1,2", f"output_dir={env / 'one'}"], "job 1 of 2 (seed=1): output_dir="),
        (["verifier=rejection,specinfer"], "every job would be refused, e.g. "),
        # a launcher that runs the jobs elsewhere: their values are checked here, not their models or paths
        (["seed=1,2", "generation.top_p=0", "hydra/launcher=submitit_slurm"], "job 1 of 2 (seed=1): generation.top_p"),
    ]
    for extra, expected in cases:
        sweep_dir = env / "never"
        assert run_main([*base, *extra, f"hydra.sweep.dir={sweep_dir}"]) == 2
        err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
        assert len(err) == 1 and err[0].startswith(f"harness run: refused: {expected}"), err
        assert not sweep_dir.exists() and not (env / "one").exists()


def test_slurm_launcher_config_composes_gpu_jobs_in_one_array(hydra_conf):
    from hydra_plugins.harness_launcher.slurm import with_job_overrides

    cfg = _compose(sweep_argv("smoke", ["launcher=slurm", "hydra.launcher.partition=gpu", "concurrent_jobs=3"])[1:])
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.harness_launcher.slurm.SlurmLauncher"
    assert (launcher.partition, launcher.gpus_per_task, launcher.cpus_per_task, launcher.mem_gb) == (
        "gpu",
        1,
        None,
        None,
    )
    # 8 CPUs and 64 GB where no form of either is set (the launcher fills them in when it submits)
    from hydra_plugins.harness_launcher.slurm import with_resource_defaults

    filled = with_resource_defaults(OmegaConf.to_container(launcher, resolve=True))
    assert (filled["cpus_per_task"], filled["mem_gb"]) == (8, 64)
    assert (launcher.timeout_min, launcher.array_parallelism, list(launcher.setup)) == (240, 3, [])
    assert list(launcher.job_overrides) == ["model.device=cuda"]  # bfloat16 follows from the device
    assert cfg.hydra.sweeper.max_batch_size is None  # the whole sweep is one array...
    assert launcher_concurrency(cfg.hydra) == 3  # ...of which concurrent_jobs run at once

    # Hydra's own switch gives the same launcher; other launchers get batches of concurrent_jobs
    cfg = _compose(["model=tiny", "hydra/launcher=slurm", "hydra.launcher.partition=gpu"])
    assert (cfg.hydra.launcher.array_parallelism, cfg.hydra.sweeper.max_batch_size) == (1, None)
    assert launcher_concurrency(cfg.hydra) == 1
    cfg = _compose(["model=tiny", "hydra/launcher=submitit_local", "concurrent_jobs=2"])
    assert cfg.hydra.sweeper.max_batch_size == 2 and launcher_concurrency(cfg.hydra) == 2
    cfg = _compose(["model=tiny", "hydra/launcher=joblib"])
    assert cfg.hydra.sweeper.max_batch_size == 1 and launcher_concurrency(cfg.hydra) == 1

    gpu = ["model.device=cuda", "model.dtype=bfloat16"]
    assert with_job_overrides(["proposer=rest"], gpu) == ["proposer=rest", *gpu]
    assert with_job_overrides(["model.device=cpu", "++model.dtype=float32"], gpu) == [
        "model.device=cpu",
        "++model.dtype=float32",
    ]


class _FakeExecutor:
    """Stands in for submitit's AutoExecutor: records what would be submitted; ``run`` runs each
    array task in this process (the launcher's own __call__, as a Slurm task would)."""

    made: list = []
    run = True
    interrupt = False

    def __init__(self, cluster, folder, **kwargs):
        self.cluster, self.folder, self.kwargs = cluster, folder, kwargs
        self.params: dict = {}
        self.arrays: list = []
        _FakeExecutor.made.append(self)

    def update_parameters(self, **params):
        self.params.update(params)

    def map_array(self, fn, *args):
        tasks = list(zip(*args))
        self.arrays.append([list(t[0]) for t in tasks])
        # what sbatch would pass on to the tasks (its default --export=ALL)
        self.environ = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONSAFEPATH")}
        return [_FakeJob(fn, t, self.run, f"4242_{i}", self.interrupt) for i, t in enumerate(tasks)]


class _Killed(BaseException):
    """What a task's process meets when Slurm kills it (a time or memory limit): nothing of the job's
    code runs after it."""


class _FakeJob:
    #: task index -> "before" (Slurm ends it before the job starts) or "during" (it is killed while measuring)
    kill: dict[int, str] = {}

    def __init__(self, fn, args, run, job_id, interrupt):
        self.fn, self.args, self.run, self.job_id, self.interrupt = fn, args, run, job_id, interrupt

    def results(self):
        from hydra.core.utils import JobReturn, JobStatus
        from submitit.core.utils import UncompletedJobError

        if self.interrupt:  # Ctrl-C while the sweep waits on the array
            raise KeyboardInterrupt
        when = self.kill.get(int(self.job_id.split("_")[1]))
        lost = UncompletedJobError(
            f"Job {self.job_id} (task: 0) with path /x/{self.job_id}_result.pkl\n"
            "has not produced any output (state: TIMEOUT)\nError stream produced:\n"
            "slurmstepd: CANCELLED DUE TO TIME LIMIT"
        )
        if when == "before":
            raise lost
        if when == "during":
            import harness.runner as runner

            def killed(*args, **kwargs):
                raise _Killed

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(runner, "measure", killed)
                try:
                    self.fn(*self.args)
                except _Killed:
                    raise lost from None
            raise AssertionError("the task was to be killed while measuring")
        if self.run:
            return [self.fn(*self.args)]
        ret = JobReturn(overrides=list(self.args[0]), status=JobStatus.COMPLETED)
        ret.return_value = None
        return [ret]


@pytest.fixture
def fake_slurm(monkeypatch):
    import submitit

    class _Env:
        job_id = "4242_0"

    _FakeExecutor.made = []
    monkeypatch.setattr(submitit, "AutoExecutor", _FakeExecutor)
    monkeypatch.setattr(submitit, "JobEnvironment", _Env)
    monkeypatch.setattr(sweep, "slurm_missing", lambda: None)  # as on a login node, where sbatch is
    return _FakeExecutor


def test_a_slurm_sweep_without_a_partition_is_refused_before_anything_is_submitted(env, capsys, fake_slurm):
    from harness.app import run_main

    sweep_dir = env / "multirun" / "smoke"
    assert sweep_main(["smoke", "launcher=slurm", f"hydra.sweep.dir={sweep_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [ln for ln in err if not ln.startswith("harness: compiling")]  # once per cache, as a job plans
    assert err == [  # named as the user ran it
        "harness sweep: refused: hydra.launcher.partition is not set: a Slurm sweep needs the partition its "
        "jobs run in (hydra.launcher.partition=<name>; `sinfo -s` lists them)"
    ]
    # Hydra's own switch, with submitit's Slurm launcher: the same refusal
    rc = run_main([*TINY_MULTIRUN, "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={sweep_dir}"])
    assert rc == 2
    assert capsys.readouterr().err.strip().startswith("harness run: refused: hydra.launcher.partition is not set")
    assert fake_slurm.made == [] and not sweep_dir.exists()  # nothing submitted, nothing written
    # a machine with no sbatch (this one): refused before anything, where submitit failed on "srun" after
    # the sweep folder and an empty store were written
    from hydra_plugins.harness_launcher.slurm import slurm_missing

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep, "slurm_missing", slurm_missing)
        patch.setattr("shutil.which", lambda name: None)
        assert (
            sweep_main(["smoke", "launcher=slurm", "hydra.launcher.partition=gpu", f"hydra.sweep.dir={sweep_dir}"]) == 2
        )
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        "harness sweep: refused: sbatch is not on this machine's PATH: a Slurm sweep is launched from a node of "
        "the cluster (a login node), where the launching process waits for the array"
    ]
    assert fake_slurm.made == [] and not sweep_dir.exists()


def test_slurm_launch_settings_a_launch_cannot_use_are_refused_before_anything_is_written(env, capsys, fake_slurm):
    """array_parallelism=null raised a TypeError Hydra turned into a warning: the array went out at
    full width with no lock, no launch file, and every task failed; sweep_batch=0 wrote the folder and
    then failed on Hydra's bare assertion; tasks_per_node=2 ran every job twice at once in one folder;
    no GPU asked for while the jobs are sent to cuda failed every task on its node."""
    sweep_dir = env / "multirun" / "smoke"
    base = ["smoke", "launcher=slurm", "hydra.launcher.partition=gpu", f"hydra.sweep.dir={sweep_dir}"]
    for setting, said in (
        ("hydra.launcher.array_parallelism=null", "hydra.launcher.array_parallelism=None: must be a whole number"),
        (
            "hydra.launcher.sweep_batch=0",
            "hydra.launcher.sweep_batch for Slurm)=0: must be a whole number of at least 1",
        ),
        ("hydra.launcher.sweep_batch=-1", "=-1: must be a whole number of at least 1"),
        ("hydra.launcher.tasks_per_node=2", "hydra.launcher.tasks_per_node=2: a harness job is one process"),
        ("hydra.launcher.nodes=2", "hydra.launcher.nodes=2: a harness job is one process on one node"),
        ("hydra.launcher.gpus_per_task=null", "hydra.launcher asks Slurm for no GPU"),
        ("hydra.launcher.additional_parameters=abc", "hydra.launcher.additional_parameters='abc': must be a mapping"),
    ):
        assert sweep_main([*base, setting]) == 2, setting
        err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
        assert len(err) == 1 and err[0].startswith("harness sweep: refused: ") and said in err[0], (setting, err)
        assert fake_slurm.made == [] and not sweep_dir.exists(), setting


def test_submitit_local_tasks_per_node_is_refused_before_anything_is_written(env, capsys):
    """submitit's local controller starts ``tasks_per_node`` copies of each job, all measuring at once
    into the job's folder on the same cores."""
    sweep_dir = env / "multirun" / "local"
    base = ["smoke", "launcher=submitit_local", f"hydra.sweep.dir={sweep_dir}"]
    assert sweep_main([*base, "hydra.launcher.tasks_per_node=2"]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        "harness sweep: refused: hydra.launcher.tasks_per_node=2: a harness job is one process on one node "
        "(submitit's local controller would start 2 copies of each job, measuring at once into one folder); "
        "set hydra.launcher.tasks_per_node=1"
    ]
    assert not sweep_dir.exists()
    # submitit's local executor refused nodes=2 itself, once the sweep folder was written
    assert sweep_main([*base, "hydra.launcher.nodes=2"]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        "harness sweep: refused: hydra.launcher.nodes=2: submitit's local launcher runs on this one node; "
        "set hydra.launcher.nodes=1"
    ]
    assert not sweep_dir.exists()


def test_slurm_additional_parameters_that_are_no_mapping_are_refused_naming_the_option():
    """``additional_parameters=abc`` passed the preflight and failed once the sweep folder was written,
    with submitit's "dictionary update sequence element #0 has length 1"; a key that is no string
    failed the same way (sbatch options are named by strings)."""
    from hydra_plugins.harness_launcher.slurm import gpu_requested, slurm_refusal

    cuda = {"partition": "gpu", "job_overrides": ["model.device=cuda"]}
    assert slurm_refusal({**cuda, "additional_parameters": "abc"}) == (
        "hydra.launcher.additional_parameters='abc': must be a mapping of sbatch option names to values, e.g. "
        "hydra.launcher.additional_parameters='{mail-type: END}'"
    )
    assert slurm_refusal({**cuda, "additional_parameters": ["gpus=1"]}).startswith(
        "hydra.launcher.additional_parameters=['gpus=1']: must be a mapping"
    )
    assert slurm_refusal(OmegaConf.create({**cuda, "additional_parameters": {1: "x"}})).startswith(
        "hydra.launcher.additional_parameters={1: 'x'}: must be a mapping of sbatch option names"
    )
    assert not gpu_requested({"additional_parameters": "gres"})  # a string is no request of anything
    assert slurm_refusal(OmegaConf.create({**cuda, "additional_parameters": {"gres": "gpu:1"}})) is None
    assert slurm_refusal({"partition": "gpu", "gpus_per_task": 1, "additional_parameters": None}) is None
    # whole nodes: sbatch --exclusive, from either key (additional_parameters is written last); "user" lets
    # the same user's jobs, the array's own tasks, share a node
    from hydra_plugins.harness_launcher.slurm import exclusive_nodes

    assert exclusive_nodes({"exclusive": True}) and exclusive_nodes({"additional_parameters": {"exclusive": True}})
    assert not exclusive_nodes({"exclusive": True, "additional_parameters": {"exclusive": "user"}})
    assert not exclusive_nodes({"additional_parameters": "exclusive"}) and not exclusive_nodes({})


def test_a_slurm_sweep_folder_with_a_percent_sign_is_refused_before_anything_is_written(env, capsys, fake_slurm):
    """Slurm expands %x, %u, ... in the tasks' log paths (#SBATCH --output under the sweep folder), which
    submitit reads unexpanded: a sweep folder with % lost every task's log and error."""
    from hydra_plugins.harness_launcher.slurm import slurm_refusal

    sweep_dir = env / "multirun" / "smoke%x"
    argv = ["smoke", "launcher=slurm", "hydra.launcher.partition=gpu", f"hydra.sweep.dir={sweep_dir}"]
    assert sweep_main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert err == [
        f"harness sweep: refused: hydra.sweep.dir={sweep_dir}: Slurm reads '%' as a pattern (%x, %u, ...) in the "
        "tasks' log paths (#SBATCH --output under hydra.launcher.submitit_folder), which submitit then cannot "
        "find; use a sweep folder without '%'"
    ]
    assert fake_slurm.made == [] and not sweep_dir.exists()
    folder = {"partition": "gpu", "gpus_per_task": 1}
    assert slurm_refusal({**folder, "submitit_folder": "/scratch/sweep/.submitit/%j"}) is None
    assert slurm_refusal({**folder, "submitit_folder": "/scratch/%u/.submitit/%j"}) == (
        "hydra.launcher.submitit_folder=/scratch/%u/.submitit/%j: Slurm reads '%' as a pattern (%x, %u, ...) in the "
        "tasks' log paths (#SBATCH --output under hydra.launcher.submitit_folder), which submitit then cannot "
        "find; use a folder without '%' but its last part's %j"
    )


def test_a_slurm_sweep_s_jobs_are_checked_as_they_run_on_the_cluster(env, capsys, fake_slurm):
    """The preflight checked each job without the launcher's model.device=cuda and against this
    machine's devices: model.device=cuda, what the jobs run on, was refused on a login node without
    a GPU, and a CPU-only kernel was accepted, the array submitted, and every task refused there."""
    from harness.app import preflight_multirun
    from harness.contracts import ConfigError

    launch = ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "model=tiny", "proposer=prompt_lookup"]
    launch += ["verifier=greedy,membership"]
    preflight_multirun([*launch, "model.device=cuda"])  # not refused: the jobs' devices are the cluster's
    with pytest.raises(ConfigError, match=r"job 1 of 2 \(verifier=greedy\): model.linear_kernel=streaming is a CPU"):
        preflight_multirun([*launch, "model.linear_kernel=streaming"])
    with pytest.raises(ConfigError, match=r"model.device=cuda: this torch .* has no CUDA device"):
        preflight_multirun([a for a in launch if not a.startswith("hydra")] + ["model.device=cuda"])  # run here
    assert fake_slurm.made == []


def test_a_slurm_job_folder_is_measured_with_the_launchers_job_overrides(env, fake_slurm):
    """A Slurm job's folder is named by its task's overrides, ``model.device=cuda`` included: the
    length check counted the job's own overrides only, so a name 18 bytes short of the limit passed
    and each task failed on the cluster."""
    from harness.app import preflight_multirun
    from harness.contracts import ConfigError

    launch = ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "model=tiny", "proposer=prompt_lookup"]
    launch += ["verifier=greedy,membership", f"workload.path={'p' * 176}.jsonl"]  # 250 bytes without the GPU's
    with pytest.raises(ConfigError, match=r"job 1 of 2 \(verifier=greedy\): its folder name, .* is 264 bytes; "):
        preflight_multirun(launch)
    preflight_multirun([*launch, "hydra.launcher.job_overrides=[]", "hydra.launcher.gpus_per_task=null"])  # no cuda
    preflight_multirun([a for a in launch if not a.startswith("hydra")])  # run here: the job's overrides only
    assert fake_slurm.made == []


def test_a_slurm_sweep_is_one_array_with_the_resources_and_gpu_overrides_of_the_config(env, fake_slurm):
    sweep_dir = env / "multirun" / "smoke"
    fake_slurm.run = False  # submit only: there is no cluster here
    try:
        rc = sweep_main(
            [
                "smoke",
                "launcher=slurm",
                "hydra.launcher.partition=gpu",
                "hydra.launcher.setup=['module load cuda/12.4']",
                "concurrent_jobs=2",
                "verifier=greedy",
                "model.dtype=float32",
                f"hydra.sweep.dir={sweep_dir}",
            ]
        )
    finally:
        fake_slurm.run = True
    assert rc == 0
    (executor,) = fake_slurm.made
    assert executor.cluster == "slurm" and executor.folder == f"{sweep_dir}/.submitit/%j"
    p = executor.params
    assert (p["slurm_partition"], p["slurm_gpus_per_task"], p["cpus_per_task"], p["mem_gb"]) == ("gpu", 1, 8, 64)
    assert (p["timeout_min"], p["slurm_array_parallelism"], p["slurm_setup"]) == (240, 2, ["module load cuda/12.4"])
    assert not {k for k in p if "job_overrides" in k or "sweep_batch" in k}  # harness keys are no sbatch options
    (array,) = executor.arrays  # every job of the sweep in one array
    assert len(array) == 2
    for overrides in array:
        assert "model.device=cuda" in overrides  # added: the jobs run on the GPU...
        assert "model.dtype=float32" in overrides and "model.dtype=bfloat16" not in overrides  # ...in the user's dtype


CPU_SWEEP_FILE = """# @package _global_
defaults:
  - _common
  - override /model: tiny

sweep: on_cpu
model:
  device: cpu
workload:
  limit: 1
threads: 1

hydra:
  sweeper:
    params:
      proposer: prompt_lookup
      verifier: greedy,membership
"""


def test_a_slurm_launch_keeps_the_device_a_sweep_file_sets(env, capsys, fake_slurm):
    """The launcher's model.device=cuda, a command-line override, was added to every job that did not
    name model.device on its command line: it replaced the device a sweep file (or an experiment, a
    model option) sets, with no word. It is now added only where no config of the job sets the key."""
    from hydra_plugins.harness_launcher.slurm import with_job_overrides

    path = env / "on_cpu.yaml"
    path.write_text(CPU_SWEEP_FILE)
    sweep_dir = env / "multirun" / "on_cpu"
    argv = [str(path), "launcher=slurm", "hydra.launcher.partition=gpu", f"hydra.sweep.dir={sweep_dir}"]
    fake_slurm.run = False  # submit only: there is no cluster here
    try:
        assert sweep_main(argv) == 0
    finally:
        fake_slurm.run = True
    (executor,) = fake_slurm.made
    (array,) = executor.arrays
    assert len(array) == 2
    for overrides in array:
        assert not any(o.startswith("model.device=") for o in overrides), overrides
    err = capsys.readouterr().err
    assert (
        "harness: note: hydra.launcher.job_overrides: model.device=cuda is not added to 2 of 2 jobs, whose configs "
        "set model.device (a sweep file, an experiment, a config group's option)"
    ) in err

    # a job's own command line, its configs, or neither (the packaged smoke sweep sets no device)
    search = sweep_argv(str(path), [])[1]  # hydra.searchpath=[...] that finds the sweep file
    gpu = ["model.device=cuda"]
    assert with_job_overrides([search, "+sweep=on_cpu", "proposer=rest"], gpu) == [
        search,
        "+sweep=on_cpu",
        "proposer=rest",
    ]
    assert with_job_overrides(["+sweep=smoke", "proposer=rest"], gpu) == ["+sweep=smoke", "proposer=rest", *gpu]
    assert with_job_overrides(["+sweep=smoke", "model.device=cpu"], gpu) == ["+sweep=smoke", "model.device=cpu"]
    assert with_job_overrides(["model=tiny"], [*gpu, "workload.limit=3"]) == ["model=tiny", *gpu, "workload.limit=3"]
    assert with_job_overrides(["+sweep=smoke"], [*gpu, "workload.limit=3"]) == ["+sweep=smoke", *gpu]  # it sets 1
    # a key a config leaves null (model=hf's name_or_path, required) is the launcher's to give
    assert with_job_overrides(["model=hf"], ["model.name_or_path=/ckpt"]) == ["model=hf", "model.name_or_path=/ckpt"]
    # jobs that select the same configs are answered once a launch (a value never changes the configs)
    cache: dict = {}
    for n in (4, 5):
        job = [search, "+sweep=on_cpu", f"generation.max_new_tokens={n}"]
        assert with_job_overrides(job, gpu, cache=cache) == job
    assert len(cache) == 1


def test_slurm_memory_and_cpus_per_gpu_replace_the_defaults_in_the_sbatch_script(tmp_path, monkeypatch):
    """The launcher's 64 GB and 8 CPUs per task were always set, so asking memory or CPUs per GPU (as the
    config invites) wrote --mem beside --mem-per-gpu and --cpus-per-task beside --cpus-per-gpu, which
    sbatch refuses for the whole array once the sweep folder is written. The defaults now apply where
    no form of their kind is set, two forms set are refused up front, and the script submitit writes
    holds one of each."""
    import submitit
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from harness.config import CONF_DIR
    from hydra_plugins.harness_launcher.slurm import executor_settings, slurm_refusal

    srun = tmp_path / "bin" / "srun"  # submitit's Slurm executor looks for it on the PATH
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}:{os.environ['PATH']}")

    def sbatch_lines(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(
                "config",
                overrides=[
                    "hydra/launcher=slurm",
                    "hydra.launcher.partition=gpu",
                    f"hydra.sweep.dir={tmp_path}",
                    *overrides,
                ],
                return_hydra_config=True,
            )
        launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
        refusal = slurm_refusal(launcher)
        if refusal is not None:
            return refusal
        settings = {k: v for k, v in launcher.items() if k not in ("_target_", "job_overrides", "sweep_batch")}
        options, parameters = executor_settings(settings)
        executor = submitit.AutoExecutor(cluster="slurm", **options)
        executor.update_parameters(**parameters)
        text = executor._executor._make_submission_file_text("python -c 1", "uid")
        return sorted(
            ln.split("=")[0] for ln in text.splitlines() if ln.startswith(("#SBATCH --mem", "#SBATCH --cpus"))
        )

    assert sbatch_lines() == ["#SBATCH --cpus-per-task", "#SBATCH --mem"]
    assert sbatch_lines("hydra.launcher.mem_per_gpu=80G", "hydra.launcher.cpus_per_gpu=8") == [
        "#SBATCH --cpus-per-gpu",
        "#SBATCH --mem-per-gpu",
    ]
    assert sbatch_lines("hydra.launcher.mem_per_cpu=4G") == ["#SBATCH --cpus-per-task", "#SBATCH --mem-per-cpu"]
    assert sbatch_lines("hydra.launcher.mem_gb=32", "hydra.launcher.mem_per_gpu=80G") == (
        "hydra.launcher.mem_gb=32 and hydra.launcher.mem_per_gpu='80G': sbatch takes one of --mem, "
        "--mem-per-gpu, --mem-per-cpu (it would refuse the array); set the other to null"
    )
    assert sbatch_lines("hydra.launcher.cpus_per_task=4", "hydra.launcher.cpus_per_gpu=8").startswith(
        "hydra.launcher.cpus_per_task=4 and hydra.launcher.cpus_per_gpu=8: sbatch takes one of --cpus-per-task, "
        "--cpus-per-gpu"
    )


def test_an_interrupted_slurm_sweep_cancels_its_array(env, fake_slurm, monkeypatch, capsys):
    """Ctrl-C stopped the sweep while its Slurm tasks went on measuring and writing records into the
    folder the summary called interrupted. The launcher now cancels the array before the interrupt
    goes on; a scancel that fails says so and names the array to cancel by hand."""
    import subprocess

    import hydra_plugins.harness_launcher.slurm as slurm

    sweep_dir = env / "multirun" / "smoke"
    calls = []

    def scancel(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(slurm.subprocess, "run", scancel)
    fake_slurm.interrupt = True
    try:
        with pytest.raises(KeyboardInterrupt):
            sweep_main(["smoke", "launcher=slurm", "hydra.launcher.partition=gpu", f"hydra.sweep.dir={sweep_dir}"])
    finally:
        fake_slurm.interrupt = False
    assert calls == [["scancel", "4242"]]  # the array, once
    err = capsys.readouterr().err
    assert "harness: cancelled Slurm array 4242 (4 tasks; the finished ones keep their records)" in err
    assert json.loads((sweep_dir / "summary.json").read_text())["interrupted"] is True

    def missing(argv, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "scancel")

    monkeypatch.setattr(slurm.subprocess, "run", missing)
    slurm.cancel_arrays([type("Job", (), {"job_id": "77_3"})()])
    assert "could not cancel Slurm array 77 ([Errno 2] No such file or directory: 'scancel'); run `scancel 77` or " in (
        capsys.readouterr().err
    )


def test_slurm_array_tasks_run_jobs_that_record_the_array_parallelism(env, fake_slurm):
    """The Slurm launcher's array tasks, run here in this process (on the CPU, as the user says)."""
    sweep_dir = env / "multirun" / "smoke"
    argv_of_last = [
        "smoke",
        "launcher=slurm",
        "hydra.launcher.partition=gpu",
        "concurrent_jobs=2",
        "proposer=prompt_lookup",
        "verifier=greedy,membership",
        "model.device=cpu",
        "model.dtype=float32",
        "gates.enabled=false",
        "hydra.callbacks.harness_sweep.report=false",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    rc = sweep_main(argv_of_last)
    assert rc == 0
    summary = sweep.LAST_SUMMARY
    assert len(summary["ran"]) == 2 and summary["failed"] == []
    for job in summary["ran"]:
        record = load_record(sweep_dir / job)
        assert record["metrics"]["concurrent_jobs"] == 2
        assert record["config"]["model"]["device"] == "cpu"
    jobs = list(summary["ran"])
    # sbatch lets an array's tasks share a node (they were taken to run on nodes of their own, and a
    # relaunch one at a time skipped them): timed again, as on one machine
    argv = [a for a in argv_of_last if a != "concurrent_jobs=2"]
    assert sweep_main(argv) == 0 and len(sweep.LAST_SUMMARY["ran"]) == 2
    # tasks on whole nodes (sbatch --exclusive) share theirs with no other job: they record 1, and a
    # record timed beside another job is timed again
    exclusive = [*argv_of_last, "+hydra.launcher.additional_parameters.exclusive=true"]
    assert sweep_main(exclusive) == 0 and len(sweep.LAST_SUMMARY["skipped"]) == 2
    path = sweep_dir / jobs[0] / "record.json"
    record = json.loads(path.read_text())
    record["metrics"]["concurrent_jobs"] = 2  # as a launch of two at once without --exclusive records it
    path.write_text(json.dumps(record))
    assert sweep_main(exclusive) == 0 and sweep.LAST_SUMMARY["ran"] == jobs[:1]
    assert load_record(path)["metrics"]["concurrent_jobs"] == 1
    assert sweep_main(argv) == 0 and len(sweep.LAST_SUMMARY["skipped"]) == 2


def test_a_job_records_no_more_jobs_at_once_than_its_array_or_batch_holds(env, fake_slurm, capsys):
    """A 2-task array with array_parallelism=4 recorded concurrent_jobs=4 (as the last, smaller batch
    of a sweep recorded the batch size), so a relaunch at concurrent_jobs=2, running the same two
    at once, timed both complete jobs again."""
    sweep_dir = env / "multirun" / "smoke"
    base = ["smoke", "launcher=slurm", "hydra.launcher.partition=gpu", "proposer=prompt_lookup", "verifier=greedy"]
    base += ["model.device=cpu", "model.dtype=float32", "gates.enabled=false", "generation.max_new_tokens=4"]
    base += ["hydra.callbacks.harness_sweep.report=false", f"hydra.sweep.dir={sweep_dir}"]
    assert sweep_main([*base, "seed=0,1", "concurrent_jobs=4"]) == 0
    assert [len(a) for a in fake_slurm.made[0].arrays] == [2]
    jobs = list(sweep.LAST_SUMMARY["ran"])
    assert len(jobs) == 2
    assert [load_record(sweep_dir / j)["metrics"]["concurrent_jobs"] for j in jobs] == [2, 2]
    assert sweep_main([*base, "seed=0,1", "concurrent_jobs=2"]) == 0
    assert sweep.LAST_SUMMARY["ran"] == [] and sorted(sweep.LAST_SUMMARY["skipped"]) == sorted(jobs)
    # arrays of 2 (sweep_batch): the third job is alone in its array, and records 1
    assert sweep_main([*base, "seed=0,1,2", "concurrent_jobs=2", "hydra.launcher.sweep_batch=2"]) == 0
    assert [len(a) for a in fake_slurm.made[-1].arrays] == [1]
    assert [len(a) for e in fake_slurm.made[-2:] for a in e.arrays] == [2, 1]
    (third,) = sweep.LAST_SUMMARY["ran"]
    assert "seed=2" in third.split(",") and len(sweep.LAST_SUMMARY["skipped"]) == 2
    assert load_record(sweep_dir / third)["metrics"]["concurrent_jobs"] == 1


def test_a_slurm_sweep_s_jobs_import_the_launching_harness_not_one_in_the_working_directory(
    env, fake_slurm, monkeypatch
):
    """submitit starts each job as ``python -u -m submitit.core._submit`` (locally, or in sbatch's
    script), and ``-m`` puts the working directory first on sys.path: launched from a folder holding
    another checkout's harness/ package, the jobs ran that code."""
    decoy = env / "other-checkout"
    (decoy / "harness").mkdir(parents=True)
    (decoy / "harness" / "__init__.py").write_text("raise ImportError('the harness of the working directory')\n")
    monkeypatch.chdir(decoy)
    before = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONSAFEPATH")}
    sweep_dir = env / "multirun" / "smoke"
    fake_slurm.run = False  # submit only
    try:
        rc = sweep_main(
            [
                "smoke",
                "launcher=slurm",
                "hydra.launcher.partition=gpu",
                "verifier=greedy",
                f"hydra.sweep.dir={sweep_dir}",
            ]
        )
    finally:
        fake_slurm.run = True
    assert rc == 0
    (executor,) = fake_slurm.made
    assert executor.environ["PYTHONSAFEPATH"] == "1"
    assert executor.environ["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert {k: os.environ.get(k) for k in before} == before  # the launching process's own, put back
    assert json.loads((sweep_dir / "launch.json").read_text())["harness"] == str(REPO / "harness")
    # a job's process, as submitit starts it from the launch's folder with the environment sbatch passes on
    job_env = {**os.environ, **executor.environ}
    done = subprocess.run(
        [sys.executable, "-c", "import harness; print(harness.__file__)"],
        cwd=decoy,
        env=job_env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == str(REPO / "harness" / "__init__.py")


def test_a_job_that_imported_another_harness_than_the_launch_is_refused(env, capsys, monkeypatch):
    """A job process that finds another harness package than the launching process's (a launch file
    naming another checkout) runs nothing: one line names both packages, and its folder is untouched."""
    sweep_dir = env / "multirun" / "smoke"
    other = env / "other-checkout" / "harness"
    real_start = sweep.SweepCallback.on_multirun_start

    def launched_from_other(self, config, **kwargs):
        real_start(self, config, **kwargs)
        path = sweep_dir / sweep.LAUNCH_FILE
        path.write_text(json.dumps({**json.loads(path.read_text()), "harness": str(other)}))

    monkeypatch.setattr(sweep.SweepCallback, "on_multirun_start", launched_from_other)
    rc, summary = launch(sweep_dir, "launcher=basic", "proposer=prompt_lookup", "verifier=greedy,membership")
    assert rc == 1 and summary["ran"] == [] and len(summary["failed"]) == 2
    err = capsys.readouterr().err
    why = (
        f"ValueError: this job's process imported the harness package {REPO / 'harness'}, not the launching "
        f"process's {other}: it would run other code than the launch; launch from a folder that holds no other "
        "harness/ package, with the launching checkout first on PYTHONPATH"
    )
    for job in summary["failed"]:
        assert f"harness sweep: job {job} failed during setup: {why}" in err
        assert not (sweep_dir / job / "record.json").exists()
    lines = [json.loads(x) for x in (sweep_dir / FAILURES_FILE).read_text().splitlines()]
    assert {(x["stage"], x["refused"]) for x in lines} == {("setup", True)}


def test_a_slurm_task_killed_by_its_limit_is_a_failed_job_and_the_array_is_waited_for(env, fake_slurm, capsys):
    """One task of the array hit Slurm's time limit while measuring, another never started: the
    sweep stopped at the first one's error, named neither job and left the other tasks' records out
    of the store. The wait now goes on; the killed jobs are failed jobs of the sweep (stage killed,
    Slurm's reason), named on stderr, in the summary and in failures.jsonl; the others' records
    are in the store, and a relaunch runs only the killed ones."""
    sweep_dir = env / "multirun" / "smoke"
    argv = [
        "smoke",
        "launcher=slurm",
        "hydra.launcher.partition=gpu",
        "proposer=prompt_lookup",
        "verifier=greedy",
        "seed=0,1,2,3",
        "model.device=cpu",
        "model.dtype=float32",
        "gates.enabled=false",
        "hydra.callbacks.harness_sweep.report=false",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    _FakeJob.kill = {1: "during", 2: "before"}
    try:
        rc = sweep_main(argv)
    finally:
        _FakeJob.kill = {}
    err = capsys.readouterr().err
    summary = dict(sweep.LAST_SUMMARY)
    assert rc == 1 and len(summary["ran"]) == 2 and len(summary["failed"]) == 2 and summary["unfinished"] == []
    assert summary["not_started"] == []  # the task Slurm ended before it started is a failed job, named
    during, before = summary["failed"]
    assert "seed=1" in during.split(",") and not (sweep_dir / during / "record.json").exists()
    assert before.startswith("job 2 (") and "seed=2" in before
    lines = {x["job"]: x for x in map(json.loads, (sweep_dir / FAILURES_FILE).read_text().splitlines())}
    assert lines[during]["stage"] == "killed" and lines[before]["stage"] == "killed (before the job started)"
    for job in (during, before):
        assert (
            lines[job]["error"]["type"] == "UncompletedJobError"
            and "(state: TIMEOUT)" in lines[job]["error"]["message"]
        )
    assert lines[during]["started_at"] and "seed=1" in lines[during]["overrides"]
    assert (
        f"harness sweep: job {during} was killed: Job 4242_1 (task: 0) with path /x/4242_1_result.pkl has not "
        "produced any output (state: TIMEOUT)"
    ) in err
    assert f"harness sweep: 2 job(s) failed: {during}, {before}" in err
    assert len(pd.read_parquet(sweep_dir / STORE_FILE)) == 2  # the tasks after the killed ones ran and count
    rc = sweep_main(argv)
    assert rc == 0 and sweep.LAST_SUMMARY["ran"] == [during, during.replace("seed=1", "seed=2")]
    assert len(sweep.LAST_SUMMARY["skipped"]) == 2


def test_a_relaunch_with_tracking_logs_the_jobs_it_skips_that_ran_untracked_once(env, capsys):
    """A sweep launched without tracking, then again with tracking=wandb: the finished jobs are
    skipped (their records kept) and their records logged to W&B after the fact, once; the record
    says where, so a third launch logs nothing again."""
    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.oracle=false"]
    args.append("hydra.callbacks.harness_sweep.report=false")
    rc, summary = launch(sweep_dir, *args)
    assert rc == 0 and len(summary["ran"]) == 1
    (job,) = summary["ran"]
    record_file = sweep_dir / job / "record.json"
    before = load_record(record_file)
    assert "tracking" not in before
    capsys.readouterr()
    rc, summary = launch(sweep_dir, *args, "tracking=wandb")
    assert rc == 0 and summary["skipped"] == [job] and not summary["ran"]
    err = capsys.readouterr().err
    assert f"harness sweep: logged {job}'s record to W&B after the fact (it ran untracked)" in err
    after = load_record(record_file)
    assert after["tracking"]["logged_after_the_run"] is True and (sweep_dir / job / "wandb").is_dir()
    assert {k: v for k, v in after.items() if k != "tracking"} == before  # the measurement untouched
    assert _statuses(sweep_dir)[job]["tracked_after_the_run"] is True
    rc, summary = launch(sweep_dir, *args, "tracking=wandb")
    assert rc == 0 and summary["skipped"] == [job]
    assert "after the fact" not in capsys.readouterr().err
    assert load_record(record_file)["tracking"] == after["tracking"]
    # another project asked: the record is not logged twice, and the launch says where it went
    rc, summary = launch(sweep_dir, *args, "tracking=wandb", "tracking.project=elsewhere")
    assert rc == 0 and summary["skipped"] == [job]
    err = capsys.readouterr().err
    assert (
        f"harness: note: {sweep_dir / job}: its record was logged to W&B project {after['tracking']['project']} "
        f"(run {after['tracking']['run_id']}) when it ran; a record is logged once, so project elsewhere does not "
        "get it"
    ) in err
    assert load_record(record_file)["tracking"] == after["tracking"]


def test_a_joblib_width_above_concurrent_jobs_is_noted():
    """``hydra.launcher.n_jobs=2`` alone ran one job at a time (the sweeper's batches are
    concurrent_jobs wide) while joblib's own line said n_jobs=2; the launch now says so."""
    from harness.app import launcher_width_note

    note = launcher_width_note(["-m", "launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1"])
    assert note.startswith("hydra.launcher.n_jobs=2 runs 1 job(s) at once: the sweeper hands the launcher batches")
    assert "set concurrent_jobs=2" in note
    assert launcher_width_note(["-m", "hydra.launcher.n_jobs=2", "concurrent_jobs=2"]) is None
    assert launcher_width_note(["-m", "hydra.launcher.n_jobs=2", "hydra.sweeper.max_batch_size=2"]) is None
    assert launcher_width_note(["-m", "seed=0,1"]) is None


def test_a_sweep_job_says_what_a_single_run_says_of_its_figures(env, capsys):
    """A multirun printed none of the notes a single run prints (prompts cut to fit, timing
    outliers): they are said per job, naming it."""
    sweep_dir = env / "multirun" / "smoke"
    common = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    cut = [
        "model.tiny.max_position_embeddings=64",
        "workload.truncate=left",
        "hydra.callbacks.harness_sweep.report=false",
    ]
    rc, summary = launch(sweep_dir, *common, *cut)
    assert rc == 0
    (job,) = summary["ran"]
    err = capsys.readouterr().err
    assert f"harness sweep: note: job {job}: 1 of 1 prompts had their oldest text cut to fit " in err


def test_a_record_logged_offline_is_named_with_its_upload_command_when_online_is_asked():
    from harness.runner import logged_elsewhere_note

    logged = {"project": "p", "entity": None, "mode": "offline", "run_id": "r1", "sync": "wandb sync wandb/offline-1"}
    assert logged_elsewhere_note(logged, project="p", entity=None, mode="offline") is None
    assert logged_elsewhere_note(logged, project="p", entity=None, mode="online") == (
        "its record was logged offline to W&B project p when it ran; `wandb sync wandb/offline-1` in the job's "
        "folder uploads it"
    )
    assert "project team/p does not get it" in logged_elsewhere_note(logged, project="p", entity="team", mode="offline")


@pytest.mark.parametrize("mode", ["hydra.mode=MULTIRUN", "hydra.mode='MULTIRUN'", "++hydra.mode=MULTIRUN"])
def test_hydra_mode_multirun_is_checked_as_a_multirun_and_refused_writing_nothing(env, capsys, mode):
    """``hydra.mode=MULTIRUN`` ran as a multirun but was checked as a single run: a launch that
    ``-m`` refuses wrote a sweep folder (multirun.yaml, failures.jsonl) and exited 1."""
    from harness.app import run_main

    sweep_dir = env / "hm"
    common = [mode, f"hydra.sweep.dir={sweep_dir}"]
    expected = [
        f"job 1 of 1: output_dir='{env / 'o'}' is for single runs",
        "the multirun has one job and nothing to name its folder by",
    ]
    named = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", f"output_dir={env / 'o'}"]
    for argv, why in zip(([*common, *named], common), expected, strict=True):
        refusals = []
        for given in (argv, ["-m", *argv]):  # refused as -m refuses it
            assert run_main(given) == 2
            err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("harness: compiling")]
            assert len(err) == 1 and err[0].startswith("harness run: refused: "), err
            refusals.append(err[0])
            assert not sweep_dir.exists() and not (env / "o").exists()
        assert refusals[0] == refusals[1] and why in refusals[0], refusals


def test_hydra_mode_run_or_a_later_run_mode_is_a_plain_run():
    from harness.app import is_multirun, is_plain_run

    for mode in ("hydra.mode=MULTIRUN", "hydra.mode='MULTIRUN'", "++hydra.mode=MULTIRUN", "hydra.mode=2"):
        assert is_multirun(["seed=1", mode]) and not is_plain_run(["seed=1", mode]), mode
    assert is_plain_run(["seed=1", "hydra.mode=RUN"]) and not is_multirun(["seed=1", "hydra.mode=RUN"])
    assert is_plain_run(["hydra.mode=MULTIRUN", "hydra.mode=RUN"])  # the last override wins, as in Hydra
    assert is_multirun(["hydra.mode=RUN", "hydra.mode=MULTIRUN"]) and is_multirun(["-m", "seed=1,2"])
    assert not is_multirun(["hydra.mode=MULTIRUN", "~hydra.mode"]) and not is_multirun(["hydra.mode = MULTIRUN"])


def test_a_glob_sweep_runs_one_job_per_option_of_the_group(env):
    """``topology=glob(sequence*)`` was refused with Hydra's "ConfigLoader is not set": the launch's own
    check expanded the sweep without the config loader that lists a group's options."""
    from harness.app import multirun_jobs, run_main

    args = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.enabled=false"]
    jobs = multirun_jobs(["-m", *args, "topology=glob(sequence*)"])[0]
    assert [job[-1] for job in jobs] == ["topology=sequence", "topology=sequences"]
    assert [job[-1] for job in multirun_jobs(["-m", "topology=glob([set,sequence])"])[0]] == [
        "topology=sequence",
        "topology=set",
    ]
    sweep_dir = env / "glob"
    assert run_main(["-m", *args, "topology=glob(sequence*)", f"hydra.sweep.dir={sweep_dir}"]) == 0
    summary = dict(sweep.LAST_SUMMARY)
    assert sorted(summary["ran"]) == [
        f"gates.enabled=False,generation.max_new_tokens=4,model=tiny,topology={t},workload.limit=1"
        for t in ("sequence", "sequences")
    ]
    for job in summary["ran"]:
        assert load_record(sweep_dir / job / "record.json")["config"]["topology"]["name"] in ("sequence", "sequences")
    planned = json.loads((sweep_dir / "launch.json").read_text())["planned_jobs"]  # the launch lists both
    assert sorted(job[-1] for job in planned) == ["topology=sequence", "topology=sequences"]


def test_a_record_timed_on_another_machine_is_timed_again_by_a_relaunch_here(env, capsys):
    """A relaunch skipped every job whose folder held a record of its manifest timed on another
    machine (the manifest names none): that machine's figures stood in this machine's sweep. The job
    runs again here, saying why, and the other machine's record is set aside; a twin folder's record
    from another machine stands in for no job either."""
    from harness.measure.hardware import cpu_name
    from harness.tracking.job_folder import inspect_job

    sweep_dir = env / "multirun" / "smoke"
    common = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false", "seed=0"]
    rc, first = launch(sweep_dir, *common)
    assert rc == 0 and len(first["ran"]) == 1
    (job,) = first["ran"]
    path = sweep_dir / job / "record.json"
    record = json.loads(path.read_text())
    assert inspect_job(sweep_dir / job, manifest_hash=record["manifest_hash"]).record is not None
    record["hardware"].update(device_name="Other CPU", cpu="Other CPU")
    path.write_text(json.dumps(record))
    state = inspect_job(sweep_dir / job, manifest_hash=record["manifest_hash"])
    why = f"its record was timed on another machine (cpu: Other CPU; this one is cpu: {cpu_name()})"
    assert state.record is None and state.reason == why
    assert inspect_job(sweep_dir / job).record is not None  # the record itself stands (the store reads it)
    capsys.readouterr()
    rc, again = launch(sweep_dir, *common)
    assert rc == 0 and again["ran"] == [job] and again["skipped"] == []
    assert f"re-running sweep job {job}: {why}; its earlier files are moved to" in capsys.readouterr().err
    (aside,) = (sweep_dir / job / ".previous").glob("*/record.json")
    assert json.loads(aside.read_text())["hardware"]["device_name"] == "Other CPU"
    assert load_record(path)["hardware"]["device_name"] == cpu_name()
    assert len(pd.read_parquet(sweep_dir / STORE_FILE)) == 1
    rc, third = launch(sweep_dir, *common)  # timed here now: skipped as before
    assert rc == 0 and third["skipped"] == [job]
    # the same job under another folder (seed=0 left out) finds no twin in a record of another machine
    record = json.loads(path.read_text())
    record["hardware"]["device_name"] = "Other CPU"
    path.write_text(json.dumps(record))
    twin = sweep.twin_job(
        sweep_dir,
        sweep_dir / "elsewhere",
        manifest_hash=record["manifest_hash"],
        config=record["config"],
    )
    assert twin is None
    record["hardware"]["device_name"] = cpu_name()
    path.write_text(json.dumps(record))
    assert sweep.twin_job(
        sweep_dir, sweep_dir / "elsewhere", manifest_hash=record["manifest_hash"], config=record["config"]
    ) == (path.parent, load_record(path))


def _job_timed_on_another_machine(env):
    """A one-job sweep whose record then says it was timed on another CPU (a relaunch re-runs it,
    its manifest unchanged): the sweep folder, the launch's arguments, the job, its record's path
    and the record."""
    sweep_dir = env / "multirun" / "smoke"
    args = ["launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    args.append("hydra.callbacks.harness_sweep.report=false")
    rc, first = launch(sweep_dir, *args)
    assert rc == 0
    (job,) = first["ran"]
    path = sweep_dir / job / "record.json"
    record = json.loads(path.read_text())
    record["hardware"].update(device_name="Other CPU", cpu="Other CPU")
    path.write_text(json.dumps(record))
    return sweep_dir, args, job, path, record


@pytest.mark.parametrize("stop", ["refused", "interrupted"])
def test_a_rerun_stopped_while_planning_puts_back_the_record_of_its_own_manifest(env, capsys, monkeypatch, stop):
    """A job re-run for a reason its manifest does not hold (timed on another machine) and then
    refused by a check that needs no model (a prompt past the context), or interrupted while
    planning (a datastore building on first use): the earlier record of the same manifest went back
    only when the job stopped later, in loading; here it stayed in .previous/ and the folder held
    no record."""
    import harness.runner as runner

    sweep_dir, args, job, path, record = _job_timed_on_another_machine(env)

    def stopped(*a, **k):
        if stop == "interrupted":
            raise KeyboardInterrupt
        raise ValueError("prompt 'p0' needs 900 positions (test)")

    monkeypatch.setattr(runner, "check_job", stopped)
    capsys.readouterr()
    if stop == "interrupted":
        with pytest.raises(KeyboardInterrupt):
            launch(sweep_dir, *args)
    else:
        rc, again = launch(sweep_dir, *args)
        assert rc == 1 and again["failed"] == [job]
    assert json.loads(path.read_text())["run_id"] == record["run_id"]
    assert not (sweep_dir / job / ".previous").exists()
    assert len(pd.read_parquet(sweep_dir / STORE_FILE)) == 1


def test_an_interrupt_while_a_sweep_job_sets_its_files_aside_puts_them_back(env, monkeypatch):
    """Ctrl-C (or SIGTERM) landing while a re-run job's earlier files move aside waits for the move
    to finish, then the files go back: they stayed in .previous/ with no record in the folder."""
    import signal

    sweep_dir, args, job, path, record = _job_timed_on_another_machine(env)
    real = sweep.clear_for_run

    def moved_then_interrupted(*a, **k):
        out = real(*a, **k)
        signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(sweep, "clear_for_run", moved_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch(sweep_dir, *args)
    assert json.loads(path.read_text())["run_id"] == record["run_id"]
    assert not (sweep_dir / job / ".previous").exists()


def test_a_job_failing_on_a_full_disk_is_a_failure_not_a_refusal():
    from harness.gates.status import GateError

    assert sweep._is_refusal(FileNotFoundError(errno.ENOENT, "No such file or directory", "data/prompts.jsonl"))
    assert sweep._is_refusal(GateError("statistical gate failed"))
    assert not sweep._is_refusal(OSError(errno.ENOSPC, "No space left on device"))
    assert not sweep._is_refusal(OSError(errno.EIO, "Input/output error"))
    assert not sweep._is_refusal(RuntimeError("a kernel failed"))
