"""A job's folder: outputs and record written as one unit (readable by the group), one run per folder
(a lock a second run is refused by), earlier files moved aside before a job runs again, and the
store reading complete jobs only. No model here except in the `harness run` tests (model=tiny)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import fixture_run

import harness.tracking.job_folder as job_folder
from harness.files import LockBusy, artifact_lock, file_lock, holds_lock
from harness.measure.hardware import cpu_capability, cpu_name
from harness.tracking.job_folder import (
    LOCK_FILENAME,
    PREVIOUS_DIR,
    FolderBusy,
    inspect_job,
    job_lock,
    set_aside,
    write_job,
)
from harness.tracking.store import RecordError, aggregate, load_record, outputs_problem

FIXTURE = fixture_run(3) / "record.json"  # a record the runner wrote
REPO = Path(__file__).resolve().parents[1]
OUTPUTS = [{"prompt_id": "p0", "ar_token_ids": [1, 2, 3], "spec_token_ids": [1, 2, 3]}]
ROUNDS = [{"prompt_id": "p0", "round": i, "accepted": i % 2} for i in range(3)]


def _record(run_id: str = "r1", manifest_hash: str = "a" * 16, **manifest) -> dict:
    record = json.loads(FIXTURE.read_text())
    record.pop("outputs", None)
    record.pop("round_series", None)  # written with its rounds.jsonl where a test needs one (ROUNDS)
    record["run_id"] = run_id
    record["manifest_hash"] = manifest_hash
    record["manifest"] = {"harness_code": "c0", "generation": {"max_new_tokens": 8, "temperature": 0.0}, **manifest}
    record["hardware"].update(device="cpu", device_name=cpu_name(), cpu_capability=cpu_capability())  # timed here
    return record


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------------------------------------------------
# one unit


def test_record_binds_its_outputs_and_both_are_readable_by_the_group(tmp_path, umask022):
    written = write_job(tmp_path / "job", _record(), OUTPUTS)
    job = tmp_path / "job"
    assert _mode(job / "record.json") == 0o644 and _mode(job / "outputs.jsonl") == 0o644
    stored = load_record(job)
    assert stored == written
    assert stored["outputs"]["file"] == "outputs.jsonl" and stored["outputs"]["rows"] == 1
    import hashlib

    assert stored["outputs"]["sha256"] == hashlib.sha256((job / "outputs.jsonl").read_bytes()).hexdigest()
    state = inspect_job(job, manifest_hash="a" * 16)
    assert state.record == stored and state.reason is None
    assert sorted(p.name for p in job.iterdir()) == ["outputs.jsonl", "record.json"]  # no temporary left


@pytest.mark.parametrize("failing", ["record.json", "outputs.jsonl"])
def test_a_failed_write_leaves_neither_file(tmp_path, monkeypatch, failing):
    real = job_folder.atomic_write_text

    def disk_full(path, text):
        if Path(path).name == failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(job_folder, "atomic_write_text", disk_full)
    (tmp_path / "job").mkdir()  # the runner's folder lock made it
    with pytest.raises(OSError, match="No space left"):
        write_job(tmp_path / "job", _record(), OUTPUTS)
    assert list((tmp_path / "job").iterdir()) == []
    assert aggregate(tmp_path).empty


def test_a_record_the_store_would_refuse_is_never_written(tmp_path):
    record = _record()
    del record["metrics"]["speedup"]
    with pytest.raises(RecordError, match="speedup"):
        write_job(tmp_path / "job", record, OUTPUTS)
    assert not (tmp_path / "job").exists() or list((tmp_path / "job").iterdir()) == []


def test_real_atomic_writes_leave_no_temporary_and_use_the_plain_mode(tmp_path, umask022):
    from harness.files import atomic_write_text

    for _ in range(3):
        atomic_write_text(tmp_path / "x.json", "{}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    assert _mode(tmp_path / "x.json") == 0o644
    os.umask(0o077)
    atomic_write_text(tmp_path / "y.json", "{}\n")
    assert _mode(tmp_path / "y.json") == 0o600  # a private umask is honoured, as by open()


# --------------------------------------------------------------------------------------------
# what makes a complete job


def test_inspect_job_names_why_files_are_no_complete_job(tmp_path):
    job = tmp_path / "job"
    assert inspect_job(job).files == () and inspect_job(job).reason is None

    write_job(job, _record(), OUTPUTS)
    (job / "outputs.jsonl").unlink()
    state = inspect_job(job, manifest_hash="a" * 16)
    assert state.record is None and state.reason == "its outputs.jsonl is missing"

    write_job(job, _record(), OUTPUTS)
    (job / "outputs.jsonl").write_text('{"prompt_id": "edited"}\n')
    assert "is not the one the record binds" in inspect_job(job).reason

    write_job(job, _record(), OUTPUTS)
    new_manifest = {"harness_code": "c1", "generation": {"max_new_tokens": 16, "temperature": 0.0}}
    state = inspect_job(job, manifest_hash="b" * 16, manifest=new_manifest)
    assert state.reason == (
        f"its record has manifest hash {'a' * 16}, this job {'b' * 16} "
        "(changed: generation.max_new_tokens, harness_code)"
    )
    assert inspect_job(job, manifest_hash="a" * 16).record is not None

    (job / "record.json").unlink()
    state = inspect_job(job)
    assert state.reason == "it holds outputs.jsonl but no record.json (a job that did not finish)"
    assert state.files == ("outputs.jsonl",)

    (job / "record.json").write_text("{not json")
    assert inspect_job(job).reason.startswith("its record is not valid (")

    old = _record()
    (job / "record.json").write_text(json.dumps(old))
    assert inspect_job(job).reason == "its record does not bind its outputs (written by an older harness)"


def _with_rounds(job: Path, **series) -> dict:
    """A job written as the runner writes one: its record names its round series, written beside it."""
    record = {**_record(), "round_series": {"file": "rounds.jsonl", "rows": len(ROUNDS), "arm": "spec", **series}}
    return write_job(job, record, OUTPUTS, extra={"rounds.jsonl": ROUNDS})


@pytest.mark.parametrize(
    "where, key, value, message",
    [
        ("outputs", "sha256", None, "outputs.sha256 must be a SHA-256 digest (64 lowercase hex digits); got NoneType"),
        (
            "round_series",
            "sha256",
            5,
            "round_series.sha256 must be a SHA-256 digest (64 lowercase hex digits); got int",
        ),
        ("round_series", "rows", True, "round_series.rows must be a whole number >= 0; got bool True"),
        ("round_series", "file", "../rounds.jsonl", "round_series.file must be a file name in the record's folder"),
    ],
)
def test_a_record_binding_its_files_by_no_digest_count_or_file_name_is_no_complete_job(
    tmp_path, where, key, value, message
):
    """A record whose bound digest was null (or a number, its row count a bool) was read as valid: a
    relaunch planning its jobs raised a bare TypeError before any job ran. Its record is not valid: the
    job runs again, its files moved aside, and the store refuses it naming the file and the field."""
    job = tmp_path / "job"
    _with_rounds(job)
    record = json.loads((job / "record.json").read_text())
    record[where][key] = value
    (job / "record.json").write_text(json.dumps(record))
    state = inspect_job(job, manifest_hash="a" * 16)
    assert state.record is None and state.reason.startswith(f"its record is not valid ({job / 'record.json'}: ")
    assert message in state.reason
    assert state.files == ("record.json", "outputs.jsonl", "rounds.jsonl")
    with pytest.raises(RecordError, match=re.escape(message)):
        aggregate(tmp_path)


def test_a_job_whose_round_series_is_missing_or_changed_is_no_complete_job(tmp_path):
    """The record names its round series (rounds.jsonl), which W&B logs after the fact; a job whose
    series was gone, cut short or edited was complete to a relaunch, skipped, and its record could
    never be logged (the file it names is missing)."""
    import hashlib

    job = tmp_path / "job"
    written = _with_rounds(job)
    rounds = job / "rounds.jsonl"
    assert written["round_series"]["sha256"] == hashlib.sha256(rounds.read_bytes()).hexdigest()
    assert written["round_series"]["rows"] == 3 and load_record(job) == written
    assert inspect_job(job, manifest_hash="a" * 16).record == written

    rounds.unlink()
    state = inspect_job(job, manifest_hash="a" * 16)
    assert state.record is None and state.reason == "its rounds.jsonl is missing"
    assert state.files == ("record.json", "outputs.jsonl")  # what a re-run moves aside

    _with_rounds(job)
    rounds.write_text(rounds.read_text().replace('"accepted": 1', '"accepted": 0'))  # edited, same rows
    assert inspect_job(job).reason.startswith("its rounds.jsonl is not the one the record binds (sha256 ")

    _with_rounds(job)
    rounds.write_text("".join(rounds.read_text().splitlines(keepends=True)[:2]))  # cut short at a row's end
    assert inspect_job(job).reason.startswith("its rounds.jsonl is not the one the record binds")

    # a record written before the series was bound by hash: the file, its rows, each row JSON
    _with_rounds(job)
    old = json.loads((job / "record.json").read_text())
    del old["round_series"]["sha256"]
    (job / "record.json").write_text(json.dumps(old))
    assert inspect_job(job, manifest_hash="a" * 16).record is not None
    text = rounds.read_text()
    rounds.write_text("".join(text.splitlines(keepends=True)[:2]))
    assert inspect_job(job).reason == "its rounds.jsonl holds 2 rows, its record 3"
    rounds.write_text(text[:-10])  # cut mid-row
    assert inspect_job(job).reason == "its rounds.jsonl is cut short or edited (row 3 is not JSON)"
    rounds.unlink()
    assert inspect_job(job).reason == "its rounds.jsonl is missing"

    # a record that names no round series is not asked for one
    write_job(job, _record(), OUTPUTS)
    assert inspect_job(job, manifest_hash="a" * 16).record is not None


def test_a_record_whose_cached_artifact_the_cache_no_longer_holds_is_no_complete_job(tmp_path, monkeypatch):
    """A searched layer-skip vector (chosen by timings) comes from the cache by its recipe, which the
    manifest binds, not by its content: a relaunch on another cache, or after the search ran again,
    would run another vector, yet the record of the first was taken as the job's."""
    import harness.manifest  # noqa: F401  (gives the tracking room its cache reader)
    from harness.heads.checkpoint import MANIFEST_FILE, artifact_dir

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    recipe = {"algorithm": "search", "trials": 3}
    entry = {"kind": "layer_skip", "artifact_id": "ran", "recipe": recipe, "target_hash": "t" * 64, "skip": [0, 2]}
    record = _record()
    record["artifacts"] = {"proposer_artifact": entry}
    job = tmp_path / "job"
    write_job(job, record, OUTPUTS)
    folder = artifact_dir("layer_skip", target_hash="t" * 64, recipe=recipe)

    def held(artifact_id: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST_FILE).write_text(json.dumps({"artifact_id": artifact_id}))

    state = inspect_job(job, manifest_hash="a" * 16)
    assert state.record is None and state.reason == (
        "its layer_skip artifact ran came from the cache, which now holds none for its recipe (the job would make "
        "one again): the job would run with another one"
    )
    held("searched-again")
    assert "which now holds searched-again for its recipe" in inspect_job(job, manifest_hash="a" * 16).reason
    held("ran")
    assert inspect_job(job, manifest_hash="a" * 16).record is not None
    # an artifact given by proposer.artifact is bound by the manifest itself, not looked up here
    record["config"]["proposer"]["artifact"] = "/somewhere/skip"
    (folder / MANIFEST_FILE).unlink()
    write_job(job, record, OUTPUTS)
    assert inspect_job(job, manifest_hash="a" * 16).record is not None


def test_a_record_whose_cpu_kernels_ran_another_instruction_set_is_no_complete_job(tmp_path, monkeypatch):
    """One CPU whose kernels dispatch to another instruction set (ATEN_CPU_CAPABILITY=default, a
    hypervisor masking AVX-512) computes and times otherwise; a relaunch took its record as the job's."""
    import harness.manifest  # noqa: F401  (gives the tracking room this machine's readers)

    job = tmp_path / "job"
    write_job(job, _record(), OUTPUTS)
    assert inspect_job(job, manifest_hash="a" * 16).record is not None
    monkeypatch.setattr(job_folder, "_cpu_capability", lambda: "NOT-" + cpu_capability())
    state = inspect_job(job, manifest_hash="a" * 16)
    assert state.record is None and state.reason == (
        f"its record's CPU kernels ran {cpu_capability()} instructions, this process's run NOT-{cpu_capability()}"
    )


CUDA_CARD = {
    "cuda_runtime": "12.4",
    "cudnn": "90100",
    "cuda_driver": "550.54.15",
    "compute_capability": "9.0",
    "cuda_wheels": {"nvidia-cublas-cu12": "12.4.5.8", "nvidia-cudnn-cu12": "9.1.0.70"},
}


@pytest.mark.parametrize(
    ("changed", "why"),
    [
        ({"cuda_driver": "535.104.05"}, "cuda_driver 550.54.15 vs 535.104.05"),
        ({"cuda_runtime": "12.1"}, "cuda_runtime 12.4 vs 12.1"),
        ({"cudnn": "8902"}, "cudnn 90100 vs 8902"),
        ({"compute_capability": "8.0"}, "compute_capability 9.0 vs 8.0"),
        (
            {"cuda_wheels": {"nvidia-cublas-cu12": "12.1.3.1", "nvidia-cudnn-cu12": "9.1.0.70"}},
            "nvidia-cublas-cu12 12.4.5.8 vs 12.1.3.1",
        ),
        ({"cuda_wheels": {"nvidia-cublas-cu12": "12.4.5.8"}}, "nvidia-cudnn-cu12 9.1.0.70 vs not installed"),
    ],
)
def test_a_cuda_record_timed_under_another_driver_runtime_or_wheels_is_no_complete_job(
    tmp_path, monkeypatch, changed, why
):
    """A relaunch on a GPU of the same name took a record timed under another driver, CUDA runtime,
    cuDNN, compute capability or cuBLAS wheel as the job's, though the record's hardware card holds
    them as what its figures depend on."""
    import harness.sweep  # noqa: F401  (gives the tracking room this machine's CUDA card)

    assert job_folder._cuda_card is harness.sweep.this_cuda_card
    job = tmp_path / "job"
    record = _record()
    record["hardware"].update(device="cuda:0", device_name="NVIDIA H100 80GB HBM3", **CUDA_CARD)
    write_job(job, record, OUTPUTS)
    monkeypatch.setattr(job_folder, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(job_folder, "_cuda_card", lambda device: dict(CUDA_CARD) if device == "cuda:0" else None)
    assert inspect_job(job, manifest_hash="a" * 16).record is not None  # timed here
    monkeypatch.setattr(job_folder, "_cuda_card", lambda device: {**CUDA_CARD, **changed})
    state = inspect_job(job, manifest_hash="a" * 16)
    assert state.record is None and state.reason == (
        f"its record was timed under another CUDA setup ({why}, the record's vs this machine's)"
    )
    assert inspect_job(job).record is not None  # the record itself stands (the store reads it)
    # a key the record's card leaves unknown (nvidia-smi missing where it ran) is not compared
    record["hardware"]["cuda_driver"] = None
    write_job(job, record, OUTPUTS)
    if "cuda_driver" in changed:
        assert inspect_job(job, manifest_hash="a" * 16).record is not None


def test_this_machine_has_no_cuda_card_for_a_device_it_lacks(monkeypatch):
    import torch

    from harness.sweep import this_cuda_card

    this_cuda_card.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        assert this_cuda_card("cpu") is None and this_cuda_card("cuda:0") is None and this_cuda_card("nope") is None
    finally:
        this_cuda_card.cache_clear()


def test_set_aside_moves_the_job_files_where_the_store_does_not_look(tmp_path):
    job = tmp_path / "sweep" / "proposer=a"
    write_job(job, _record("old"), OUTPUTS)
    (job / "wandb").mkdir()
    (job / ".hydra").mkdir()
    (job / "job_status.json").write_text("{}")
    dest = set_aside(job)
    assert dest.parent == job / PREVIOUS_DIR
    assert sorted(p.name for p in dest.iterdir()) == ["moved.json", "outputs.jsonl", "record.json", "wandb"]
    assert sorted(p.name for p in job.iterdir()) == [".hydra", PREVIOUS_DIR, "job_status.json"]
    assert aggregate(tmp_path / "sweep").empty
    assert set_aside(job) is None


def test_the_store_reads_complete_jobs_only(tmp_path, caplog):
    root = tmp_path / "sweep"
    write_job(root / "complete", _record("complete"), OUTPUTS)
    write_job(root / "outputs_gone", _record("outputs_gone"), OUTPUTS)
    (root / "outputs_gone" / "outputs.jsonl").unlink()
    write_job(root / "aside", _record("aside"), OUTPUTS)
    set_aside(root / "aside")
    with caplog.at_level(logging.WARNING, logger="harness.store"):
        df = aggregate(root)
    assert list(df["run_id"]) == ["complete"]
    assert "record left out (not a complete job)" in caplog.text and "outputs_gone" in caplog.text
    # a record without an outputs binding (older records, hand-made fixtures) is still read
    (root / "legacy").mkdir()
    (root / "legacy" / "record.json").write_text(json.dumps(_record("legacy")))
    assert sorted(aggregate(root)["run_id"]) == ["complete", "legacy"]


def test_a_store_of_no_complete_job_warns_unless_its_caller_names_them(tmp_path, caplog):
    root = tmp_path / "sweep"
    write_job(root / "outputs_gone", _record("outputs_gone"), OUTPUTS)
    (root / "outputs_gone" / "outputs.jsonl").unlink()
    with caplog.at_level(logging.WARNING, logger="harness.store"):
        assert aggregate(root).empty
    assert "outputs_gone" in caplog.text  # a rebuilt store that comes out empty says why
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="harness.store"):
        assert aggregate(root, warn_if_none_left=False).empty
    assert caplog.text == ""


# --------------------------------------------------------------------------------------------
# locks

HOLD = """
import sys, time
from harness.tracking.job_folder import job_lock
with job_lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def _hold(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_folder_held_by_a_live_process_is_refused_and_freed_when_it_dies(tmp_path):
    folder = tmp_path / "job"
    proc = _hold(folder)
    try:
        with pytest.raises(FolderBusy, match=rf"{folder} is in use by another run \(pid {proc.pid} on .+ since "):
            with job_lock(folder):
                pass
    finally:
        proc.kill()  # no clean exit: the kernel drops the lock with the process
        proc.wait()
    with job_lock(folder):
        assert holds_lock(folder / LOCK_FILENAME)
        with job_lock(folder):  # re-entrant in the same thread
            pass
        assert holds_lock(folder / LOCK_FILENAME)
    assert not holds_lock(folder / LOCK_FILENAME)


def test_file_lock_makes_another_thread_wait_and_refuses_without_waiting(tmp_path):
    lock = tmp_path / "a.lock"
    order, refusals = [], []

    def try_now():
        try:
            with file_lock(lock, wait=False):
                refusals.append(None)
        except LockBusy as exc:
            refusals.append(exc)

    def waiter():
        with file_lock(lock):
            order.append("waiter")

    with file_lock(lock, purpose="test"):
        t = threading.Thread(target=try_now)
        t.start()
        t.join()
        assert isinstance(refusals[0], LockBusy) and f"pid {os.getpid()} on " in str(refusals[0])
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)
        order.append("holder")
    t.join(10)
    assert order == ["holder", "waiter"]


def test_artifact_builders_wait_then_load_what_the_first_built(tmp_path):
    """Two processes build the same artifact through artifact_lock: one builds, the other loads."""
    script = """
import sys, time
from pathlib import Path
from harness.files import artifact_lock, atomic_write_text
path = Path(sys.argv[1])
with artifact_lock(path):
    if path.exists():
        print("loaded", flush=True)
    else:
        time.sleep(1.0)
        atomic_write_text(path, "built\\n")
        print("built", flush=True)
"""
    path = tmp_path / "cache" / "artifact.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    outs = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert outs == ["built", "loaded"]
    assert path.read_text() == "built\n"
    assert sorted(p.name for p in path.parent.iterdir()) == [".artifact.json.lock", "artifact.json"]
    with artifact_lock(path):  # free again
        pass


# --------------------------------------------------------------------------------------------
# `harness run` into a folder: one at a time, earlier files moved aside

TINY = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.enabled=false"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_second_harness_run_into_a_busy_folder_is_refused_before_hydra_writes(cache, capsys):
    from harness.app import run_main

    folder = cache / "run"
    proc = _hold(folder)
    try:
        assert run_main([*TINY, f"hydra.run.dir={folder}"]) == 2
        # (a first run in this process may say once that it compiles the native kernels)
        err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("harness: compiling")]
        assert err == [
            f"harness run: refused: {folder} is in use by another run (pid {proc.pid} on "
            + err[0].split(f"(pid {proc.pid} on ", 1)[1]
        ]
        assert "wait for it to finish, or write elsewhere" in err[0]
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILENAME]  # no .hydra/, no log, no record
        # output_dir (the record's folder) is locked too, after planning and before any model work
        assert run_main([*TINY, f"output_dir={folder}", f"hydra.run.dir={cache / 'other'}"]) == 2
        assert capsys.readouterr().err.strip().startswith(f"harness run: refused: {folder} is in use by another run")
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILENAME]
    finally:
        proc.kill()
        proc.wait()


def test_harness_run_into_a_folder_with_a_record_moves_it_aside_and_a_failed_gate_leaves_none(
    cache, capsys, monkeypatch
):
    """Hydra's job logging prints warnings to the console on stderr (stdout carries the result)."""
    import harness.runner as runner
    from harness.app import run_main
    from harness.gates.status import GateError

    folder = cache / "run"
    args = [*TINY, f"output_dir={folder}"]
    assert run_main(args) == 0
    first = load_record(folder)
    assert first["outputs"]["rows"] == 1
    assert "WARNING" not in capsys.readouterr().err

    assert run_main(args) == 0
    second = load_record(folder)
    assert second["run_id"] != first["run_id"] and second["manifest_hash"] == first["manifest_hash"]
    (aside,) = (folder / PREVIOUS_DIR).iterdir()
    assert load_record(aside)["run_id"] == first["run_id"]
    captured = capsys.readouterr()
    assert "WARNING" not in captured.out and json.loads(captured.out)["record"] == str(folder / "record.json")
    out = captured.err
    assert (
        f"[WARNING] - harness run: overwriting {folder}: it holds a complete record of this manifest "
        f"({first['run_id']}); its earlier files are moved to {aside}"
    ) in out

    # a run refused while loading (its prompt is over the context limit) leaves the folder as it was,
    # its log included, and says only why it was refused (it said it moved the files, then that they were back)
    log = (folder / "app.log").read_bytes()
    assert b"harness run: overwriting" in log
    overlong = [*args, "model.tiny.max_position_embeddings=40", "workload.truncate=false"]
    assert run_main(overlong) == 2
    assert (folder / "app.log").read_bytes() == log
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.strip().splitlines() if not ln.startswith("harness: compiling")]
    assert len(lines) == 1 and lines[0].startswith("harness run: refused: prompt "), lines
    assert "> 40 positions of the target" in lines[0]
    assert load_record(folder)["run_id"] == second["run_id"]
    assert outputs_problem(load_record(folder), folder) is None
    assert len(list((folder / PREVIOUS_DIR).iterdir())) == 1

    def failing_gate(*a, **k):
        raise GateError("statistical gate failed (test)")

    monkeypatch.setattr(runner, "gate", failing_gate)
    assert run_main(args) == 2
    captured = capsys.readouterr()
    assert "harness run: refused: statistical gate failed (test)" in captured.err
    assert f"[WARNING] - harness run: overwriting {folder}" in captured.err
    assert not (folder / "record.json").exists() and not (folder / "outputs.jsonl").exists()
    assert len(list((folder / PREVIOUS_DIR).iterdir())) == 2
    assert aggregate(folder).empty

    # the greedy-equality gate, which runs over the measured outputs, refutes an earlier record as
    # the gates before measuring do: it stays aside, and the folder holds no record saying it passed
    monkeypatch.undo()
    greedy_only = [*args[:-2], "gates.oracle=false", "gates.equivalence=false", "gates.statistical=false", args[-1]]
    assert run_main(greedy_only) == 0
    third = load_record(folder)
    assert third["gates"]["greedy_equality"]["status"] == "passed"

    def diverging(*a, **k):
        raise GateError("greedy equality failed (test)")

    monkeypatch.setattr(runner, "greedy_equality", diverging)
    assert run_main(greedy_only) == 2
    assert "harness run: refused: greedy equality failed (test)" in capsys.readouterr().err
    assert not (folder / "record.json").exists() and not (folder / "outputs.jsonl").exists()
    assert third["run_id"] in {load_record(p)["run_id"] for p in (folder / PREVIOUS_DIR).iterdir()}
    assert aggregate(folder).empty


def test_a_run_folder_that_cannot_be_created_is_refused_in_one_line(cache, capsys):
    from harness.app import run_main

    (cache / "afile").write_text("not a folder\n")
    assert run_main([*TINY, f"output_dir={cache / 'afile' / 'run'}", f"hydra.run.dir={cache / 'hydra'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # refused by the preflight, before Hydra or the job's folder lock is reached
    assert err == [
        f"harness run: refused: output_dir={cache / 'afile' / 'run'}: cannot be created: {cache / 'afile'} is a file"
    ]
    # hydra.run.dir is named as output_dir is: the option, and that a file is there (it was "cannot create
    # the job folder ...: File exists", naming no option)
    assert run_main([*TINY, f"hydra.run.dir={cache / 'afile' / 'hydra'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"harness run: refused: hydra.run.dir={cache / 'afile' / 'hydra'}: cannot be created: {cache / 'afile'} "
        "is a file"
    ]
    assert run_main([*TINY, f"hydra.run.dir={cache / 'afile'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"harness run: refused: hydra.run.dir={cache / 'afile'}: a file is in the way; an output folder is needed there"
    ]
    assert (cache / "afile").read_text() == "not a folder\n"


def test_a_file_where_a_lock_s_folder_goes_is_named_by_its_option(tmp_path):
    """The folder a lock guards names the option that set it (a sweep's, hydra.sweep.dir); a sweep
    job's folder, named by its overrides below the sweep folder, says where to write instead."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(job_folder.JobFolderError) as caught:
        with job_lock(afile, purpose="harness sweep", elsewhere="hydra.sweep.dir=..."):
            pass
    assert str(caught.value) == f"hydra.sweep.dir={afile}: a file is in the way; an output folder is needed there"
    with pytest.raises(job_folder.JobFolderError) as caught:
        with job_lock(
            afile / "seed=1", purpose="sweep job seed=1", elsewhere="hydra.sweep.dir=... for the whole sweep"
        ):
            pass
    assert str(caught.value) == (
        f"the job folder {afile / 'seed=1'}: cannot be created: {afile} is a file (write elsewhere: "
        "hydra.sweep.dir=... for the whole sweep)"
    )
    assert afile.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_run_folders_are_named_by_experiment_else_adhoc_and_a_refused_run_leaves_none(cache, capsys):
    from harness.app import run_main

    assert run_main(TINY) == 0  # no experiment: outputs/adhoc/<time>
    (run,) = (cache / "outputs" / "adhoc").iterdir()
    assert load_record(run)["outputs"]["rows"] == 1 and (run / ".hydra" / "config.yaml").is_file()
    # output_dir alone: Hydra's files beside the record, no second folder
    assert run_main([*TINY, f"output_dir={cache / 'mine'}"]) == 0
    assert (cache / "mine" / ".hydra").is_dir() and load_record(cache / "mine")
    assert len(list((cache / "outputs" / "adhoc").iterdir())) == 1
    capsys.readouterr()
    # refused while loading (a prompt over the context limit) or by a range: no folder of either kind
    for extra in (["model.tiny.max_position_embeddings=40", "workload.truncate=false"], ["seed=-3"]):
        assert run_main([*TINY, *extra]) == 2
        assert run_main([*TINY, *extra, f"output_dir={cache / 'refused'}"]) == 2
        assert len(list((cache / "outputs" / "adhoc").iterdir())) == 1
        assert not (cache / "refused").exists()
    assert not (cache / "outputs" / "None").exists()
    # a run refused in a folder that holds a run keeps that run's Hydra files and log and adds none
    (kept,) = (cache / "mine" / ".hydra").iterdir()
    logs = {p.name: p.read_bytes() for p in (cache / "mine").glob("*.log")}
    assert list(logs) == ["app.log"]  # the finished run's log (empty: it warned of nothing)
    assert (
        run_main(
            [*TINY, "model.tiny.max_position_embeddings=40", "workload.truncate=false", f"output_dir={cache / 'mine'}"]
        )
        == 2
    )
    assert list((cache / "mine" / ".hydra").iterdir()) == [kept] and (kept / "config.yaml").is_file()
    assert {p.name: p.read_bytes() for p in (cache / "mine").glob("*.log")} == logs
    # a finished run keeps the Hydra folder it was given, even when its record went elsewhere
    assert run_main([*TINY, f"output_dir={cache / 'rec'}", f"hydra.run.dir={cache / 'hyd'}"]) == 0
    assert len(list((cache / "hyd" / ".hydra").rglob("config.yaml"))) == 1 and load_record(cache / "rec")
    # a multirun outside any sweep: multirun/adhoc/<time>
    assert run_main(["-m", *TINY, "seed=1,2"]) == 0
    (sweep,) = (cache / "multirun" / "adhoc").iterdir()
    assert len(list(sweep.glob("*/record.json"))) == 2


def test_a_job_whose_measured_sequoia_tree_changed_since_its_record_is_no_complete_job(tmp_path):
    """Two records of one manifest held different trees after `harness calibrate` re-measured the
    cached artifacts in place, and a relaunch skipped the job as done; the record now holds each
    measured artifact's hash, and a job whose artifact changed (or went) is run again."""
    tree = tmp_path / "tree-x.json"
    tree.write_text(json.dumps({"kind": "sequoia_tree", "hash": "h1"}))
    job = tmp_path / "job"
    record = _record()
    record["artifacts"] = {**record.get("artifacts", {}), "sequoia_tree": str(tree), "sequoia_tree_hash": "h1"}
    write_job(job, record, OUTPUTS)
    assert inspect_job(job, manifest_hash="a" * 16).record is not None
    tree.write_text(json.dumps({"kind": "sequoia_tree", "hash": "h2"}))
    state = inspect_job(job, manifest_hash="a" * 16)
    assert state.record is None and state.reason == (
        f"its sequoia_tree artifact {tree} changed since the run (hash h1 then, h2 now): the job would run with "
        "another one"
    )
    tree.unlink()
    assert inspect_job(job, manifest_hash="a" * 16).reason.startswith(f"its sequoia_tree artifact {tree} is gone")
    assert inspect_job(job).record is not None  # the record itself stands (the store reads it)


def test_a_relative_measured_artifact_path_is_read_from_the_working_directory_else_the_job_folder(
    tmp_path, monkeypatch
):
    """An older record holds its Sequoia tree's path as given, relative to the working directory its
    run started in; a relaunch from another folder read it from there, called the tree gone and ran
    the complete job again. The path is read from the working directory, then from the job folder,
    and a tree in neither is gone, naming both places."""
    sweep = tmp_path / "sweep"
    (sweep / "trees").mkdir(parents=True)
    (sweep / "trees" / "tree-x.json").write_text(json.dumps({"kind": "sequoia_tree", "hash": "h1"}))
    job = sweep / "job"
    record = _record()
    record["artifacts"] = {"sequoia_tree": "trees/tree-x.json", "sequoia_tree_hash": "h1"}
    write_job(job, record, OUTPUTS)
    monkeypatch.chdir(sweep)  # where the run started: relative to the working directory
    assert inspect_job(job, manifest_hash="a" * 16).record is not None
    record["artifacts"]["sequoia_tree"] = "../trees/tree-x.json"  # relative to the job folder
    write_job(job, record, OUTPUTS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert inspect_job(job, manifest_hash="a" * 16).record is not None
    (sweep / "trees" / "tree-x.json").unlink()
    assert inspect_job(job, manifest_hash="a" * 16).reason == (
        f"its sequoia_tree artifact ../trees/tree-x.json is gone (neither {elsewhere / '../trees/tree-x.json'} (from "
        f"the working directory) nor {job / '../trees/tree-x.json'} (from the run folder) exists): the job would run "
        "with another one"
    )
