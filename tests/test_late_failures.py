"""A run that fails late: its record's write failing (a full disk), or a second signal while a failed
run cleans up, leaves the folder's earlier files in place, not stranded in ``.previous/`` (model=tiny)."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

import harness.runner as runner
import harness.tracking.job_folder as job_folder
from harness.config import compose
from harness.tracking.job_folder import JobWriteError
from harness.tracking.store import load_record
from harness.tracking.wandb_tracker import NullTracker

BASE = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.oracle=false"]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}


@pytest.fixture
def earlier(tmp_path, monkeypatch):
    """A folder holding a complete record, and its files as they are."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    record = runner.run_job(compose([*BASE, f"output_dir={out}"]), run_dir=out)
    return out, record, _files(out)


def _disk_full_at(name: str, monkeypatch) -> None:
    real = job_folder.atomic_write_text

    def disk_full(path, text):
        if Path(path).name == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, text)

    monkeypatch.setattr(job_folder, "atomic_write_text", disk_full)


def test_a_record_whose_write_fails_puts_the_earlier_files_back_and_is_an_error(earlier, monkeypatch, caplog):
    """The earlier record was moved aside before the job ran; the new one could not be written: the
    folder held no record at all (harness compare found none). Nothing of the job is written, so the
    earlier files go back; a full disk is the machine's error, not a refusal of the job's input."""
    out, first, files = earlier
    _disk_full_at("record.json", monkeypatch)
    with pytest.raises(Exception) as info:
        runner.run_job(compose([*BASE, f"output_dir={out}", "seed=1"]), run_dir=out)
    assert load_record(out)["run_id"] == first["run_id"] and _files(out) == files
    assert not (out / ".previous").exists()
    assert f"the job was unable to write its record: the earlier files are back in {out}" in caplog.text
    assert isinstance(info.value, JobWriteError), repr(info.value)
    assert not isinstance(info.value, (OSError, ValueError))  # the CLI reports those as refusals (exit 2)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    said = str(info.value)
    assert said.startswith(f"the job ran, but its files could not be written in {out} ([Errno 28] No space left")
    assert said.endswith("no record of it is kept; the folder's earlier files are back")


def test_a_record_path_taken_by_a_folder_keeps_the_earlier_files_together_aside(earlier, monkeypatch, caplog):
    """A folder made at record.json's path while the job ran: its record cannot be written, nor can the
    earlier record go back; its outputs do not go back without it, and the error says where they are."""
    out, first, files = earlier
    real_write = runner.write

    def blocked(record, measured, run_dir):
        (run_dir / "record.json").mkdir()
        return real_write(record, measured, run_dir)

    monkeypatch.setattr(runner, "write", blocked)
    with pytest.raises(JobWriteError) as info:
        runner.run_job(compose([*BASE, f"output_dir={out}", "seed=1"]), run_dir=out)
    (aside,) = (out / ".previous").iterdir()
    assert _files(aside) == {**files, "moved.json": (aside / "moved.json").read_bytes()}
    assert set(files) == {"record.json", "outputs.jsonl", "rounds.jsonl"} and _files(out) == {}
    assert str(info.value).endswith(f"; {aside} keeps the earlier files")
    assert f"but record.json in {out} is taken: the earlier files stay in {aside}" in caplog.text


def test_harness_run_reports_a_record_it_cannot_write_as_an_error(tmp_path, monkeypatch, capsys):
    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = [*BASE, f"output_dir={out}", f"hydra.run.dir={out}"]
    assert run_main(argv) == 0
    first = load_record(out)
    capsys.readouterr()
    _disk_full_at("outputs.jsonl", monkeypatch)
    assert run_main([*argv, "seed=1"]) == 1
    err = capsys.readouterr().err
    assert "harness run: error: JobWriteError: the job ran, but its files could not be written" in err
    assert "refused" not in err
    assert load_record(out)["run_id"] == first["run_id"] and not (out / ".previous").exists()


class _InterruptedWhileClosing(NullTracker):
    """A tracker whose closing of a failed run is met by a second Ctrl-C."""

    def fail(self, **kwargs) -> None:
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("first", ["error", "interrupt"])
@pytest.mark.parametrize("during", ["put_back", "tracker_fail"])
def test_a_second_interrupt_during_a_failed_run_s_clean_up_waits_until_the_earlier_files_are_back(
    earlier, monkeypatch, first, during
):
    """A second Ctrl-C while W&B closed the failed run or while the files went back raised there and
    left the earlier record in .previous/; it is held until they are back, then ends the run."""
    out, record, files = earlier
    put_back = []

    def failing(*args, **kwargs):
        if first == "error":
            raise RuntimeError("CUDA out of memory")
        raise KeyboardInterrupt

    def interrupted_put_back(*args, **kwargs):
        put_back.append(True)
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, as the files start to go back
        return real_restore(*args, **kwargs)

    real_restore = runner.restore_aside
    monkeypatch.setattr(runner, "measure", failing)
    if during == "put_back":
        monkeypatch.setattr(runner, "restore_aside", interrupted_put_back)
    else:
        monkeypatch.setattr(runner, "start_tracker", lambda cfg, planned: _InterruptedWhileClosing())
    with pytest.raises(KeyboardInterrupt):  # the second interrupt still ends the run
        runner.run_job(compose([*BASE, f"output_dir={out}", "seed=1"]), run_dir=out)
    assert put_back == ([True] if during == "put_back" else [])
    assert load_record(out)["run_id"] == record["run_id"] and _files(out) == files
    assert not (out / ".previous").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are back


def test_a_close_of_w_and_b_that_waits_on_the_network_can_still_be_interrupted(earlier, monkeypatch):
    """Signals were held through W&B's close of a failed run: an online ``finish`` waiting on a stalled
    network could then be stopped by nothing but SIGKILL. The close is not held: a Ctrl-C abandons it,
    the earlier files still go back, and the interrupt ends the run with the job's error as its cause."""
    out, record, files = earlier
    closes = []

    class StalledClose(NullTracker):
        def fail(self, **kwargs) -> None:
            closes.append("started")
            os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C, while the close waits
            closes.append("finished")  # a held signal would let the close run to its end

    def failing(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(runner, "measure", failing)
    monkeypatch.setattr(runner, "start_tracker", lambda cfg, planned: StalledClose())
    with pytest.raises(KeyboardInterrupt) as info:
        runner.run_job(compose([*BASE, f"output_dir={out}", "seed=1"]), run_dir=out)
    assert closes == ["started"] and isinstance(info.value.__cause__, RuntimeError)
    assert load_record(out)["run_id"] == record["run_id"] and _files(out) == files


def test_a_termination_held_beside_a_ctrl_c_is_handed_on_first():
    """Held together, a Ctrl-C's handler raised first and the termination held beside it was dropped:
    a scheduler's SIGTERM then ended nothing. The termination's handler runs first."""
    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        held = runner.HeldInterrupts()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            held.release()
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
