"""A job's folder: its files written as one unit, one run at a time, and earlier files moved aside.

* **One unit** (:func:`write_job`): ``outputs.jsonl`` is written first, then ``record.json``,
  which binds the outputs by file name, row count and SHA-256 (``record["outputs"]``), and the
  round series (``rounds.jsonl``) the same way (``record["round_series"]``). Each file is written
  atomically; when the record cannot be written, the others are removed. A folder therefore holds
  a complete job (a valid record whose bound files are there, unchanged) or nothing the store,
  ``harness compare`` or a resumed sweep reads as one (:func:`inspect_job`).
* **One run per folder** (:func:`job_lock`): a run holds ``<folder>/.harness.lock`` for its whole
  life; a second run pointed at the same folder is refused at once, naming the holder.
* **Earlier files moved aside** (:func:`set_aside`): a job that runs again in a folder holding
  files (its code or config changed, its outputs are gone, it was timed on another machine, or
  ``harness run`` was pointed there again) first moves them to ``<folder>/.previous/<time>-<id>/``,
  with a warning giving the reason, so a job that then fails leaves no record in its folder; the
  store skips those folders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.files import LockBusy, atomic_write_text, describe_holder, file_lock
from harness.tracking.conventions import machine_label
from harness.tracking.record import json_text, jsonl_text
from harness.tracking.store import (
    OUTPUTS_FILENAME,
    PREVIOUS_DIR,
    RECORD_FILENAME,
    ROUNDS_FILENAME,
    RecordError,
    job_files_problem,
    load_record,
    validate_record,
)

log = logging.getLogger("harness.jobs")

LOCK_FILENAME = ".harness.lock"
#: where `harness report SOURCE` writes by default (``SOURCE/report/report.md``)
REPORT_DIR, REPORT_FILE = "report", "report.md"
#: what a job leaves in its folder besides Hydra's own files: moved aside together
JOB_FILES: tuple[str, ...] = (RECORD_FILENAME, OUTPUTS_FILENAME, ROUNDS_FILENAME, "wandb")
#: what else a run keeps in its folder: Hydra's files, the lock, earlier files moved aside
RUN_FOLDER_FILES: tuple[str, ...] = (".hydra", LOCK_FILENAME, PREVIOUS_DIR, ".submitit")
#: the option whose value is the folder a lock of this purpose guards (a sweep job's folder is below
#: ``hydra.sweep.dir``, named by its overrides: no option names it)
FOLDER_OPTIONS = {"harness run": "hydra.run.dir", "harness sweep": "hydra.sweep.dir"}


def is_run_file(entry: Path) -> bool:
    """Whether a folder entry is one a run writes into its folder: a job file (:data:`JOB_FILES`), Hydra's
    ``.hydra/`` and job log (``*.log``), the lock, ``.previous/``, a temporary name the harness writes
    through (``.record.json.<random>.tmp``, a write check's ``.harness-write-check-<random>``), or the
    ``report/`` that ``harness report`` writes by default into the folder it reads."""
    name = entry.name
    if name in JOB_FILES or name in RUN_FOLDER_FILES or name.startswith(".harness-write-check-"):
        return True
    if name.endswith(".log"):
        return entry.is_file()
    if name == REPORT_DIR:  # `harness report RUN_DIR` writes its report there by default
        return (entry / REPORT_FILE).is_file()
    return any(name.startswith(f".{job_file}.") for job_file in JOB_FILES)


def foreign_entries(folder: str | Path) -> list[str]:
    """The names in ``folder`` (sorted) that no run writes there (:func:`is_run_file`); none for a
    folder that is not there."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(entry.name for entry in folder.iterdir() if not is_run_file(entry))


class JobFolderError(ValueError):
    """A job folder that cannot be used: it cannot be created, or another run holds it."""


class FolderBusy(JobFolderError):
    """Another live run holds the job folder's lock."""


class JobWriteError(RuntimeError):
    """A job's files could not be written once it had run (a full disk, a folder it may no longer
    write): an error of the machine, not a refusal of the job's input."""


@contextmanager
def job_lock(
    folder: str | Path, *, purpose: str = "harness run", elsewhere: str = "output_dir=... or hydra.run.dir=..."
) -> Iterator[Path]:
    """Hold the job folder's lock (the folder is created); :class:`FolderBusy` when a live run has it.

    Re-entrant within a thread: the sweep job that locked its folder calls the runner, which takes
    the same lock for free.
    """
    folder = Path(folder)
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        if blocker is None:
            raise JobFolderError(f"cannot create the job folder {folder}: {exc.strerror or exc}") from exc
        option = FOLDER_OPTIONS.get(purpose)  # as output_dir= is refused (harness.files.output_folder_problem)
        named = f"{option}={folder}" if option else f"the job folder {folder}"
        if blocker == folder:
            why = "a file is in the way; an output folder is needed there"
        else:
            why = f"cannot be created: {blocker} is a file"
        fix = "" if option else f" (write elsewhere: {elsewhere})"
        raise JobFolderError(f"{named}: {why}{fix}") from None
    try:
        with file_lock(folder / LOCK_FILENAME, wait=False, purpose=purpose):
            try:
                yield folder
            finally:
                if created and [p.name for p in folder.iterdir()] == [LOCK_FILENAME]:
                    # a run that wrote nothing (refused before its first file) leaves no folder
                    (folder / LOCK_FILENAME).unlink(missing_ok=True)
                    folder.rmdir()
    except LockBusy as exc:
        raise FolderBusy(
            f"{folder} is in use by another run ({describe_holder(exc.holder)}): wait for it to finish, "
            f"or write elsewhere ({elsewhere})"
        ) from None


def write_job(
    folder: str | Path, record: dict, outputs: list[dict], *, extra: Mapping[str, list[dict]] | None = None
) -> dict:
    """Write the ``extra`` JSONL files (e.g. ``rounds.jsonl``) and ``outputs.jsonl``, then
    ``record.json`` binding the outputs, and the extra file its ``round_series`` names (row count and
    SHA-256); returns the record as written.

    The record is validated first (a record the store would refuse is never written). If writing
    the record fails (a full disk), the other files are removed and the error raised: the folder
    then holds none of them.
    """
    folder = Path(folder)
    text = jsonl_text(outputs)
    data = text.encode("utf-8")
    record = {
        **record,
        "outputs": {"file": OUTPUTS_FILENAME, "rows": len(outputs), "sha256": hashlib.sha256(data).hexdigest()},
    }
    extra_texts = {name: jsonl_text(rows) for name, rows in (extra or {}).items()}
    series = record.get("round_series")
    if isinstance(series, Mapping) and series.get("file") in extra_texts:  # bound as the outputs are
        series_text = extra_texts[series["file"]]
        record["round_series"] = {
            **series,
            "rows": len(extra[series["file"]]),
            "sha256": hashlib.sha256(series_text.encode("utf-8")).hexdigest(),
        }
    validate_record(record, path=folder / RECORD_FILENAME)
    out_path = folder / OUTPUTS_FILENAME
    written = [folder / name for name in extra_texts] + [out_path]
    try:
        for name, extra_text in extra_texts.items():
            atomic_write_text(folder / name, extra_text)
        atomic_write_text(out_path, text)
        atomic_write_text(folder / RECORD_FILENAME, json_text(record))
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return record


@dataclass(frozen=True)
class JobState:
    """What a job folder holds. ``record`` is set only for a complete job (valid record, bound
    outputs and round series present and unchanged, and, when asked, the expected manifest hash);
    ``reason`` says why files that are there do not make one (None when the folder holds no job files)."""

    record: dict | None
    reason: str | None
    files: tuple[str, ...]


def mapping_difference(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str:
    """`` (changed: harness_code, generation.max_new_tokens)``: the keys (two levels deep) whose values
    differ between two manifests or configs; empty when none does."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return ""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            sub = [f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            keys += sub or [key]
        else:
            keys.append(key)
    if not keys:
        return ""
    shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    return f" (changed: {shown})"


def inspect_job(
    folder: str | Path,
    *,
    manifest_hash: str | None = None,
    manifest: dict | None = None,
    concurrent_jobs: int | None = None,
) -> JobState:
    """The job files in ``folder`` and whether they make a complete job of ``manifest_hash``; with
    ``concurrent_jobs`` (how many jobs run at once now), a record timed while more jobs shared the
    machine is not complete: the job is timed again, as this launch times it. Nor is one of
    ``manifest_hash`` timed on another machine (:func:`other_machine`): the manifest names no
    machine, and this one's times are not that one's."""
    folder = Path(folder)
    files = tuple(name for name in JOB_FILES if (folder / name).exists())
    if not files:
        return JobState(None, None, files)
    if RECORD_FILENAME not in files:
        return JobState(
            None, f"it holds {', '.join(files)} but no {RECORD_FILENAME} (a job that did not finish)", files
        )
    try:
        record = load_record(folder / RECORD_FILENAME)
    except RecordError as exc:
        return JobState(None, f"its record is not valid ({exc})", files)
    if record.get("outputs") is None:
        return JobState(None, "its record does not bind its outputs (written by an older harness)", files)
    problem = job_files_problem(record, folder)
    if problem is not None:
        return JobState(None, problem, files)
    if manifest_hash is not None and record.get("manifest_hash") != manifest_hash:
        diff = mapping_difference(record.get("manifest"), manifest)
        return JobState(
            None,
            f"its record has manifest hash {record.get('manifest_hash')}, this job {manifest_hash}{diff}",
            files,
        )
    if manifest_hash is not None:
        changed = measured_artifact_change(record, folder) or cached_artifact_change(record) or other_machine(record)
        if changed is not None:
            return JobState(None, changed, files)
    then = (record.get("metrics") or {}).get("concurrent_jobs")
    if concurrent_jobs is not None and isinstance(then, int) and then > concurrent_jobs:
        return JobState(
            None,
            f"its record was timed while {then} jobs ran at once, and this launch runs {concurrent_jobs}",
            files,
        )
    return JobState(record, None, files)


#: how this machine names a device (``"cpu"``, ``"cuda:0"``) as its hardware card would, for
#: :func:`other_machine`; the application layer gives it (:func:`read_machines_with`), as the tracking
#: room reads no hardware itself. None: no record is checked against this machine.
_device_name: Callable[[str], str | None] | None = None
#: the vector instruction set this process's CPU kernels dispatch to (``harness.measure.hardware.cpu_capability``)
_cpu_capability: Callable[[], str] | None = None


def read_machines_with(
    device_name: Callable[[str], str | None] | None, cpu_capability: Callable[[], str] | None = None
) -> None:
    """Name this machine's devices with ``device_name`` (``harness.measure.hardware.device_name``),
    and its CPU kernels' instruction set with ``cpu_capability``, where :func:`inspect_job` asks
    whether a record was timed here; None turns the check off."""
    global _device_name, _cpu_capability
    _device_name, _cpu_capability = device_name, cpu_capability


#: this process's CUDA card for a device (``"cuda:0"``: ``harness.measure.hardware.cuda_card``'s keys), or
#: None where it has no such device; given by the application layer (:func:`read_cuda_cards_with`)
_cuda_card: Callable[[str], Mapping[str, Any] | None] | None = None
#: the keys of a CUDA device's hardware card a run's figures depend on beyond the device's name
CUDA_CARD_KEYS = ("cuda_driver", "cuda_runtime", "cudnn", "compute_capability", "cuda_wheels")


def read_cuda_cards_with(reader: Callable[[str], Mapping[str, Any] | None] | None) -> None:
    """Read this process's CUDA card for a device with ``reader`` where :func:`inspect_job` asks whether
    a record of a CUDA device was timed here (driver, CUDA runtime, cuDNN, compute capability, the
    ``nvidia-*`` wheels); None turns the check off."""
    global _cuda_card
    _cuda_card = reader


def cuda_card_difference(then: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """The first of :data:`CUDA_CARD_KEYS` where a record's hardware card ``then`` and this process's
    CUDA card ``now`` both say something and differ, as ``key: record's value vs this machine's`` (a
    wheel by its name, one installed on one side only as ``not installed``), or None. A key either
    card leaves unknown (None, or a record written before it was recorded) is not compared."""
    for key in CUDA_CARD_KEYS:
        was, is_now = then.get(key), now.get(key)
        if was is None or is_now is None:
            continue
        if key == "cuda_wheels" and isinstance(was, Mapping) and isinstance(is_now, Mapping):
            for name in sorted(set(was) | set(is_now)):
                if was.get(name) != is_now.get(name):
                    return f"{name} {was.get(name) or 'not installed'} vs {is_now.get(name) or 'not installed'}"
        elif str(was) != str(is_now):
            return f"{key} {was} vs {is_now}"
    return None


def other_machine(record: Mapping[str, Any]) -> str | None:
    """Why ``record`` was timed on another machine than this one, or None (timed here, or no
    :func:`read_machines_with` reader to tell). A machine is named as ``harness compare`` splits arms
    by it (:func:`~harness.tracking.conventions.machine_label`: device kind and name), from the
    record's hardware card and from this machine's name for the record's device; a CUDA device's
    record also by what its figures depend on beyond that (:func:`cuda_card_difference`: driver,
    CUDA runtime, cuDNN, compute capability, ``nvidia-*`` wheels), where :func:`read_cuda_cards_with`
    gave a reader."""
    if _device_name is None:
        return None
    card = record.get("hardware") or {}
    device = str(card.get("device") or "")
    then = machine_label(card)
    now = machine_label({"device": device, "device_name": _device_name(device) if device else None})
    if then != now:
        return f"its record was timed on another machine ({then}; this one is {now})"
    # one machine whose CPU kernels dispatch to another instruction set (ATEN_CPU_CAPABILITY, a
    # hypervisor masking AVX-512) computes and times otherwise
    was = card.get("cpu_capability")
    is_now = _cpu_capability() if _cpu_capability is not None and device.startswith("cpu") else None
    if was and is_now and was != is_now:
        return f"its record's CPU kernels ran {was} instructions, this process's run {is_now}"
    here = _cuda_card(device) if _cuda_card is not None and device.startswith("cuda") else None
    differs = cuda_card_difference(card, here) if here is not None else None
    if differs is not None:
        return f"its record was timed under another CUDA setup ({differs}, the record's vs this machine's)"
    return None


#: the id of the proposer artifact this machine's cache holds for a record's artifact entry (its kind,
#: target and recipe), or None where it holds none; the application layer gives it
#: (:func:`read_cached_artifacts_with`), as the tracking room reads no cache itself
_cached_artifact_id: Callable[[Mapping[str, Any]], str | None] | None = None


def read_cached_artifacts_with(reader: Callable[[Mapping[str, Any]], str | None] | None) -> None:
    """Find the artifact a job would load from the cache with ``reader`` where :func:`inspect_job` asks
    whether a record ran it (``harness.manifest.cached_artifact_id``); None turns the check off."""
    global _cached_artifact_id
    _cached_artifact_id = reader


def cached_artifact_change(record: Mapping[str, Any]) -> str | None:
    """Why the job a record measured would now run another proposer artifact from the cache, or None.
    A searched layer-skip vector (chosen by timings), or heads, an EAGLE draft or an adapter trained
    on first use, come from the cache by their recipe, which the manifest binds, not their content:
    a relaunch on another cache, or after the cache was cleared and the artifact searched again,
    would run another one. An artifact given by ``proposer.artifact`` is bound by the manifest itself.
    Nor does a record stand whose cached artifact was chosen by timings taken beside more jobs than the
    record's job ran with (:func:`timed_beside_more_jobs`): the job would search it again."""
    if _cached_artifact_id is None:
        return None
    entry = (record.get("artifacts") or {}).get("proposer_artifact")
    if not isinstance(entry, Mapping) or not all(entry.get(k) for k in ("artifact_id", "recipe", "target_hash")):
        return None  # no artifact, a published one, or a record from before artifacts were recorded
    if ((record.get("config") or {}).get("proposer") or {}).get("artifact"):
        return None
    if entry.get("kind") in TIMED_PROPOSER_ARTIFACTS:  # a vector chosen by timings: how many jobs it was timed beside
        contended = timed_beside_more_jobs(record, (entry.get("search") or {}).get("concurrent_jobs"))
        if contended is not None:
            return f"its {entry['kind']} artifact {entry['artifact_id']} {contended}: the job would search it again"
    now = _cached_artifact_id(entry)
    if now == entry["artifact_id"]:
        return None
    kind = entry.get("kind") or "proposer"
    holds = "none for its recipe (the job would make one again)" if now is None else f"{now} for its recipe"
    return (
        f"its {kind} artifact {entry['artifact_id']} came from the cache, which now holds {holds}: the job would "
        "run with another one"
    )


#: artifacts a run measures (not a function of its config, so no manifest hash binds them), by the
#: record's ``artifacts`` key; the record holds each one's content hash as ``<key>_hash``
MEASURED_ARTIFACTS = ("sequoia_tree", "sequoia_calibration", "sequoia_profile")
#: the measured artifacts made of timings: the file's ``provenance.concurrent_jobs`` says how many jobs
#: shared the machine while it was timed (the tree is chosen from the profile, whose hash it binds)
TIMED_MEASURED_ARTIFACTS = ("sequoia_profile",)
#: the kinds of cached proposer artifact chosen by timings: ``search.concurrent_jobs`` of the manifest
TIMED_PROPOSER_ARTIFACTS = ("layer_skip",)


def timed_beside_more_jobs(record: Mapping[str, Any], measured: Any) -> str | None:
    """Why an artifact timed while ``measured`` jobs shared the machine could not have served the job
    of ``record`` (its ``metrics.concurrent_jobs``), or None: timed beside more jobs than the job ran
    with, it is an artifact a run measures again before it uses it
    (``harness.prepare.profile.contention_problem``), so the record stands on timings its job would
    not take. An artifact that records no count was made before artifacts recorded one, as were the
    records that used it while their job ran alone (a run alone now measures such an artifact again):
    like a record from before records counted the jobs, such a record stands."""
    ran = (record.get("metrics") or {}).get("concurrent_jobs")
    if not isinstance(ran, int) or isinstance(ran, bool):
        return None
    if isinstance(measured, int) and not isinstance(measured, bool) and measured > ran:
        return f"was timed while {measured} jobs ran at once, and its job ran " + (
            "alone" if ran == 1 else f"as one of {ran}"
        )
    return None


def record_artifact_path(path: str | Path, run_dir: str | Path | None = None) -> Path:
    """The file or folder a record's artifact entry ``path`` names. A record holds absolute paths; an
    older one may hold a path relative to the working directory its run started in, read here from
    the working directory, else from the run folder ``run_dir``. Raises :class:`FileNotFoundError`
    naming every place it looked when none holds it."""
    given = Path(path)
    if given.is_absolute():
        if given.exists():
            return given
        raise FileNotFoundError(f"{given} does not exist")
    tried = [(Path.cwd() / given, "from the working directory")]
    if run_dir is not None:
        tried.append((Path(run_dir) / given, "from the run folder"))
    for candidate, _ in tried:
        if candidate.exists():
            return candidate
    where = " nor ".join(f"{c} ({how})" for c, how in tried)
    raise FileNotFoundError(f"neither {where} exists" if len(tried) > 1 else f"{where} does not exist")


def measured_artifact_change(record: dict, folder: str | Path | None = None) -> str | None:
    """Why the job a record measured would now run with other measured artifacts (a Sequoia tree
    re-calibrated in place, or gone: the job would measure a new one; a hardware profile timed beside
    more jobs than the job ran with: :func:`timed_beside_more_jobs`), or None. ``folder``: the
    record's job folder, where a relative artifact path of an older record is looked for after the
    working directory (:func:`record_artifact_path`)."""
    artifacts = record.get("artifacts") or {}
    for key in MEASURED_ARTIFACTS:
        used, path = artifacts.get(f"{key}_hash"), artifacts.get(key)
        if used is None or not path:
            continue  # a record from before the hashes, or no such artifact
        gone, held = "is gone", {}
        try:
            held = json.loads(record_artifact_path(path, folder).read_text(encoding="utf-8"))
            now = held.get("hash")
        except FileNotFoundError as exc:
            now = None
            if not Path(path).is_absolute():
                gone = f"is gone ({exc})"
        except (OSError, ValueError, AttributeError):
            now = None
        if now != used:
            return (
                f"its {key} artifact {path} "
                + (gone if now is None else f"changed since the run (hash {used} then, {now} now)")
                + ": the job would run with another one"
            )
        if key in TIMED_MEASURED_ARTIFACTS:
            contended = timed_beside_more_jobs(record, (held.get("provenance") or {}).get("concurrent_jobs"))
            if contended is not None:
                return f"its {key} artifact {path} {contended}: the job would measure it again"
    return None


def set_aside(folder: str | Path, files: tuple[str, ...] | None = None) -> Path | None:
    """Move the job files of ``folder`` to ``<folder>/.previous/<time>-<id>/``; returns that folder
    (None when there was nothing to move)."""
    folder = Path(folder)
    names = [n for n in (files if files is not None else JOB_FILES) if (folder / n).exists()]
    if not names:
        return None
    dest = folder / PREVIOUS_DIR / f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    dest.mkdir(parents=True)
    for name in names:
        shutil.move(str(folder / name), str(dest / name))
    (dest / "moved.json").write_text(
        json.dumps({"moved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": names}) + "\n"
    )
    return dest


def restore_aside(
    folder: str | Path, aside: Path | None, *, why: str = "the job was refused", quiet: bool = False
) -> None:
    """Put the files :func:`set_aside` moved to ``aside`` back into ``folder`` (a job refused
    before it measured anything leaves the folder as it was). Where the refused job wrote a
    folder of the same name itself (its W&B run's ``wandb/``), the earlier folder's entries go back
    into it beside the new ones (W&B keeps one folder per run there), unless a name is taken.
    ``quiet``: the move was never announced (a job refused before it said so), so neither is this.
    Where a name the earlier files need is taken otherwise (a folder made at ``record.json``'s path),
    none goes back, as a record goes with the files it binds: they stay in ``aside``, and a warning
    says so."""
    if aside is None or not aside.is_dir():
        return
    folder = Path(folder)
    taken = [
        name
        for name in JOB_FILES
        if (aside / name).exists()
        and ((folder / name).exists() or (folder / name).is_symlink())
        and not ((aside / name).is_dir() and (folder / name).is_dir())
    ]
    if taken:
        log.warning("%s, but %s in %s is taken: the earlier files stay in %s", why, " and ".join(taken), folder, aside)
        return
    for name in JOB_FILES:
        if not (aside / name).exists():
            continue
        if not (folder / name).exists():
            shutil.move(str(aside / name), str(folder / name))
        elif (aside / name).is_dir() and (folder / name).is_dir():
            for entry in list((aside / name).iterdir()):
                if not (folder / name / entry.name).exists() and not (folder / name / entry.name).is_symlink():
                    shutil.move(str(entry), str(folder / name / entry.name))
                elif entry.is_symlink():  # W&B's "latest-run" links: the new run's stand
                    entry.unlink()
            if not any((aside / name).iterdir()):
                (aside / name).rmdir()
    if not any(p.exists() for p in (aside / n for n in JOB_FILES)):
        shutil.rmtree(aside, ignore_errors=True)
        previous = aside.parent
        if previous.is_dir() and not any(previous.iterdir()):
            previous.rmdir()
    if not quiet:
        log.warning("%s: the earlier files are back in %s", why, folder)


def clear_for_run(folder: str | Path, state: JobState, *, what: str, action: str) -> tuple[Path | None, str | None]:
    """Move a folder's earlier job files aside before a run. Returns where they went and the
    warning that says so, naming ``what`` (the job or folder), the ``action`` (re-running,
    overwriting) and the reason; the caller logs it once the job gets past its refusals (a job
    refused while loading puts the files back, and the refusal is its one line)."""
    if not state.files:
        return None, None
    dest = set_aside(folder, state.files)
    reason = state.reason or (
        f"it holds a complete record of this manifest ({state.record['run_id']})" if state.record else "it holds files"
    )
    return dest, f"{action} {what}: {reason}; its earlier files are moved to {dest}"
