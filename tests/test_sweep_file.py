"""`harness sweep PATH.yaml`: a sweep file kept outside the package composes and runs like a
packaged one (its defaults, `_common` included, resolve against the packaged config groups)."""

from __future__ import annotations

import json
import textwrap

import pytest

from harness import sweep
from harness.app import sweep_main
from harness.record_schema import status_of
from harness.sweep import sweep_argv
from harness.tracking.store import load_record

SWEEP_FILE = textwrap.dedent(
    """
    # @package _global_
    defaults:
      - _common
      - override /model: tiny

    sweep: mine
    workload:
      limit: 1
    generation:
      max_new_tokens: 6
      warmup_tokens: 2
    gates:
      oracle: false
    threads: 1

    hydra:
      sweeper:
        params:
          proposer: prompt_lookup
          topology: sequence,sequences
    """
)


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _compose(argv: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[a for a in argv if a != "-m"], return_hydra_config=True)


def test_a_sweep_file_anywhere_composes_through_a_stable_link(env):
    path = env / "elsewhere" / "mine.yaml"
    path.parent.mkdir()
    path.write_text(SWEEP_FILE)
    argv = sweep_argv(str(path), ["launcher=basic", "verifier=greedy"])
    assert argv[0] == "-m" and argv[1].startswith("hydra.searchpath=['file://") and "+sweep=mine" in argv
    link = next((env / "cache" / "sweep-files").glob("*/sweep/mine.yaml"))
    assert link.is_symlink() and link.resolve() == path.resolve()
    assert sweep_argv(str(path), []) == ["-m", argv[1], "+sweep=mine", "hydra/launcher=basic"]  # same link again
    cfg = _compose(argv)
    assert cfg.sweep == "mine" and cfg.model.name == "tiny" and cfg.gates.oracle is False
    assert cfg.hydra.sweeper.params.topology == "sequence,sequences"
    assert cfg.hydra.sweep.dir == "multirun/mine"  # from the packaged _common


def test_a_sweep_file_in_a_sweep_folder_uses_that_config_root(env):
    path = env / "configs" / "sweep" / "mine.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(SWEEP_FILE)
    argv = sweep_argv(str(path), [])
    assert argv[1] == f"hydra.searchpath=['file://{(env / 'configs').resolve().as_posix()}']"
    assert not (env / "cache" / "sweep-files").exists()
    assert _compose(argv).sweep == "mine"


def test_bad_sweep_files_are_refused(env, capsys):
    with pytest.raises(ValueError, match="does not exist"):
        sweep_argv(str(env / "missing.yaml"), [])
    clash = env / "smoke.yaml"
    clash.write_text(SWEEP_FILE)
    with pytest.raises(ValueError, match="'smoke' is taken by a packaged sweep"):
        sweep_argv(str(clash), [])
    assert sweep_main([str(env / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    for name, text, fragment in (
        ("broken", "defaults: [\n  - bad", "is not valid YAML at line 2, column 3: expected the node content"),
        ("empty", "", "is empty: a sweep sets hydra.sweeper.params"),
        ("listed", "[1, 2]\n", "holds a YAML list, not a mapping of settings"),
        ("nameless", SWEEP_FILE.replace("sweep: mine\n", ""), "sets no sweep name: add `sweep: nameless`"),
        (
            "escape",
            SWEEP_FILE.replace("sweep: mine", "sweep: ../../escaped"),
            "names sweep='../../escaped': it must be a plain",
        ),
        (  # its jobs went into multirun/smoke and the packaged sweep's W&B group
            "samename",
            SWEEP_FILE.replace("sweep: mine", "sweep: smoke"),
            "names sweep='smoke', a packaged sweep's name: its jobs would land in multirun/smoke/",
        ),
        (  # Hydra's error was "Could not override 'model@sweep.model'"
            "headless",
            SWEEP_FILE.replace("# @package _global_\n", ""),
            "does not start with `# @package _global_`",
        ),
        (  # after a plain comment Hydra no longer reads the directive
            "late",
            SWEEP_FILE.replace("# @package _global_\n", "# my sweep\n# @package _global_\n"),
            "does not start with `# @package _global_`",
        ),
    ):
        path = env / f"{name}.yaml"
        path.write_text(text)
        assert sweep_main([str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"harness sweep: refused: sweep file {path} {fragment}"), err


def test_a_sweep_with_one_unnamed_job_is_refused(env, capsys):
    """A sweep file with no axes ran one job named "." whose record and outputs landed in the sweep
    folder itself, beside the sweep's own files."""
    path = env / "noaxes.yaml"
    path.write_text(SWEEP_FILE.replace("sweep: mine", "sweep: noaxes").split("hydra:")[0])
    assert sweep_main([str(path), "launcher=basic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "harness sweep: refused: the multirun has one job and nothing to name its folder by: a sweep crosses axes "
        "(hydra.sweeper.params in a sweep file, or a,b values on the command line); `harness run` runs one job"
    ]
    assert not (env / "multirun").exists()
    assert sweep_main([str(path), "launcher=basic", "verifier=greedy", "proposer=prompt_lookup"]) == 0  # named


def test_harness_sweep_runs_a_sweep_file_from_outside_the_repository(env):
    path = env / "elsewhere" / "mine.yaml"
    path.parent.mkdir()
    path.write_text(SWEEP_FILE)
    rc = sweep_main([str(path), "hydra.callbacks.harness_sweep.report=false"])
    summary = dict(sweep.LAST_SUMMARY)
    assert rc == 0, summary
    assert sorted(summary["ran"]) == [
        "proposer=prompt_lookup,topology=sequence",
        "proposer=prompt_lookup,topology=sequences",
    ]
    record = load_record(env / "multirun" / "mine" / summary["ran"][0])
    assert record["sweep"] == "mine" and record["axes"]["model"] == "tiny"
    status = json.loads((env / "multirun" / "mine" / summary["ran"][0] / "job_status.json").read_text())
    assert status["status"] == "ran"


def test_a_sweep_file_whose_gates_changed_reruns_its_jobs_on_relaunch(env, capsys, monkeypatch):
    """The job folders are named by the sweep's axes, and the manifest leaves the gates out: a relaunch
    after the file turned its gates on skipped the ungated records as complete, so every record still
    said `gated: false`. Their files are set aside, naming the changed key, and the jobs run again."""
    path = env / "mine.yaml"
    ungated = SWEEP_FILE.replace("gates:\n  oracle: false", "gates:\n  enabled: false")
    assert ungated != SWEEP_FILE
    path.write_text(ungated)
    argv = [str(path), "hydra.callbacks.harness_sweep.report=false", "hydra.sweeper.params.topology=sequence"]
    assert sweep_main(argv) == 0
    (job,) = sweep.LAST_SUMMARY["ran"]
    folder = env / "multirun" / "mine" / job
    assert load_record(folder)["gated"] is False
    assert sweep_main(argv) == 0 and sweep.LAST_SUMMARY["skipped"] == [job]  # unchanged: skipped

    path.write_text(SWEEP_FILE)  # gates on (the oracle aside, to keep the test short)
    capsys.readouterr()
    assert sweep_main(argv) == 0
    assert sweep.LAST_SUMMARY["ran"] == [job] and sweep.LAST_SUMMARY["skipped"] == []
    record = load_record(folder)
    assert record["config"]["gates"]["enabled"] is True and status_of(record["gates"]["equivalence"]) == "passed"
    assert "ran under other checks (changed: gates.enabled, gates.oracle)" in capsys.readouterr().err
    assert (folder / ".previous").is_dir()
    # the gates changed again and the re-run fails before measuring: the record of the other gates stays
    # aside (it went back, and the store counted it as the job's)
    import harness.runner as runner

    def refused(*args, **kwargs):
        raise ValueError("prompt 'p0' needs 900 positions (test)")

    monkeypatch.setattr(runner, "load", refused)
    path.write_text(ungated)
    assert sweep_main(argv) == 1 and sweep.LAST_SUMMARY["failed"] == [job]
    assert not (folder / "record.json").exists() and len(list((folder / ".previous").iterdir())) == 2
