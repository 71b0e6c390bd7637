"""Files that concurrent jobs share: atomic writes with a plain write's permissions, unique
temporary names, and an advisory lock on a file or a folder.

Jobs of a sweep run side by side (joblib workers, submitit processes, Slurm array tasks on a shared
file system) and may build the same cached artifact (a converted model, a REST datastore, trained
heads, a Sequoia calibration) or be pointed at the same job folder. Two rules keep them apart:

* every temporary file or folder gets a name no other process can pick (:func:`temporary_sibling`),
  and reaches its final name by one rename;
* whoever builds a shared artifact holds :func:`artifact_lock` (``.<artifact>.lock``) from the check
  "is it there?" to the rename, so a second job waits, then finds the artifact and loads it.

Locks are ``flock`` locks: the kernel (or the NFS server) drops them when their process dies, so a
crashed job never leaves a folder locked. The lock file stays behind (removing it would let two
processes lock two different files of the same name); it holds who took the lock last.

Every command's one-line refusal also reads here whether its traceback was asked for
(:func:`wants_traceback`), and a command with an argparse command line takes its one-line parser
from here (:class:`OneLineParser`), as every room may import this module.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

log = logging.getLogger("harness.files")

#: set to 1 (or run ``harness --traceback <command>``) to print the traceback of a failed command
#: after its one-line message
TRACEBACK_ENV = "HARNESS_TRACEBACK"


def wants_traceback() -> bool:
    """Whether the traceback of a failed or refused command was asked for (:data:`TRACEBACK_ENV`)."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in {"", "0", "false", "no"}


def print_traceback_if_asked(exc: BaseException) -> None:
    """Print ``exc``'s traceback on stderr where :func:`wants_traceback`; a command then prints its
    one-line refusal after it."""
    if wants_traceback():
        import traceback

        traceback.print_exception(exc, file=sys.stderr)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusals are one line on stderr, ``<command>: error: <message>``, and
    exit code 2, not argparse's usage block."""

    def __init__(self, *args, command: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.command = command

    def error(self, message: str):
        print(f"{self.command}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


@functools.lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes, read once per process per file version (path, size and
    modification time): a checkpoint's weights are fingerprinted by several stages of one run."""
    path = Path(path)
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


def output_folder_problem(key: str, path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a folder this process creates or writes into (None when it can). Tried,
    not inferred from permission bits (root, read-only mounts, /proc): a temporary folder is made in
    the nearest existing folder and removed at once, so nothing is left behind."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        return f"{key}={path}: a file is in the way; an output folder is needed there"
    nearest = p.absolute()
    while not nearest.exists():
        nearest = nearest.parent
    if not nearest.is_dir():
        return f"{key}={path}: cannot be created: {nearest} is a file"
    try:
        probe = tempfile.mkdtemp(prefix=".harness-write-check-", dir=nearest)
    except OSError as exc:
        return f"{key}={path}: cannot write in {nearest} ({exc.strerror or exc})"
    os.rmdir(probe)
    return None


def temporary_sibling(path: str | Path, tag: str = "tmp") -> Path:
    """A hidden name beside ``path`` that no other process or host picks: ``.<name>.<uuid>.<tag>``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:16]}.{tag}")


def plain_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the process umask (0644 under the
    usual umask 022), so records are readable by the group as any other file is."""
    return 0o666 & ~_umask()


def _umask() -> int:
    try:  # Linux reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a unique temporary file in the same folder, flushed to disk
    and renamed into place: a reader sees the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, plain_file_mode())  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_texts(files: Sequence[tuple[str | Path, str]]) -> None:
    """Write several text files as one unit: each through a unique temporary file beside it, flushed
    to disk, then all renamed into place. When a write or a rename fails (a full disk, an interrupt),
    no file is changed: one already renamed into place gets its earlier content back (or, where it
    did not exist, is removed), and the temporaries go. Each file switches from old to new by one
    rename, so a reader never sees a part of one."""
    staged: list[tuple[Path, Path]] = []
    earlier: dict[Path, Path] = {}  # a file's earlier content, under a second name until all are in place
    try:
        for path, text in files:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append((path, Path(tmp)))
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), plain_file_mode())  # mkstemp makes 0600
                f.write(text.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
        for path, tmp in staged:
            if path.exists():  # the earlier file stays at its own name until the new one replaces it
                earlier[path] = temporary_sibling(path, "earlier")
                try:
                    os.link(path, earlier[path])
                except OSError:  # a file system without hard links
                    shutil.copy2(path, earlier[path])
            os.replace(tmp, path)
    except BaseException:
        for path, tmp in reversed(staged):
            kept = earlier.get(path)
            try:
                if tmp.exists():  # not renamed into place: the file is as it was
                    tmp.unlink()
                elif kept is None:  # it was not there before
                    path.unlink(missing_ok=True)
                elif kept.exists():
                    os.replace(kept, path)
            except OSError:  # the others go back all the same
                continue
            if kept is not None:
                kept.unlink(missing_ok=True)  # (a rename onto its own hard link leaves both names)
        raise
    for kept in earlier.values():
        kept.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# locks


class LockBusy(RuntimeError):
    """Another live process holds the lock (raised by :func:`file_lock` with ``wait=False``)."""

    def __init__(self, path: Path, holder: dict) -> None:
        self.path = path
        self.holder = holder
        super().__init__(f"{path} is locked by {describe_holder(holder)}")


def describe_holder(holder: dict) -> str:
    """``pid 123 on host since 2026-01-02T03:04:05`` (what the lock file says of its holder)."""
    if not holder.get("pid"):
        return "another process"
    text = f"pid {holder['pid']} on {holder.get('host', '?')}"
    if holder.get("since"):
        text += f" since {holder['since']}"
    return text


def read_holder(path: str | Path) -> dict:
    """What the lock file at ``path`` says of the process that took it last ({} if unreadable)."""
    try:
        holder = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


# locks this process holds, per thread: (resolved path, thread id) -> [fd, depth]. A thread that
# already holds a lock takes it again for free (a job's runner inside a sweep job that locked its
# folder); another thread of the same process opens its own descriptor and waits like any process.
_HELD: dict[tuple[str, int], list[int]] = {}
_HELD_GUARD = threading.Lock()


def holds_lock(path: str | Path) -> bool:
    """Whether this thread holds :func:`file_lock` on ``path``."""
    return (str(Path(path).resolve()), threading.get_ident()) in _HELD


@contextmanager
def file_lock(path: str | Path, *, wait: bool = True, purpose: str = "") -> Iterator[Path]:
    """Hold an exclusive lock on ``path`` (created if absent) for the ``with`` block.

    ``wait=True`` blocks until the lock is free (saying once, at INFO, who holds it); ``wait=False``
    raises :class:`LockBusy` at once. Re-entrant within a thread. ``purpose`` is written into the
    lock file with the holder's pid, host and start time, for the next one's message.
    """
    path = Path(path)
    key = (str(path.resolve()), threading.get_ident())
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is not None:
            held[1] += 1
    if held is not None:
        try:
            yield path
        finally:
            with _HELD_GUARD:
                held[1] -= 1
        return

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, plain_file_mode())
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = read_holder(path)
            if not wait:
                raise LockBusy(path, holder) from None
            log.info("waiting for %s (held by %s)", path, describe_holder(holder))
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "purpose": purpose,
                    "argv": sys.argv[:8],
                }
            ).encode(),
            0,
        )
        with _HELD_GUARD:
            _HELD[key] = [fd, 1]
        try:
            yield path
        finally:
            with _HELD_GUARD:
                del _HELD[key]
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def artifact_lock(path: str | Path, purpose: str = "") -> AbstractContextManager[Path]:
    """:func:`file_lock` on ``.<name>.lock`` beside a shared artifact at ``path``: hold it from the
    check "is the artifact there?" to its rename into place; concurrent builders wait, then load."""
    path = Path(path)
    return file_lock(lock_path(path), wait=True, purpose=purpose or f"building {path.name}")


def lock_path(path: str | Path) -> Path:
    """The lock file of the artifact at ``path``: ``.<name>.lock`` in the same folder."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


# --------------------------------------------------------------------------- a run folder's files

#: a run's record, the outputs it binds, and the speculative arm's per-round series beside them
RECORD_FILENAME = "record.json"
OUTPUTS_FILENAME = "outputs.jsonl"
ROUNDS_FILENAME = "rounds.jsonl"
#: the files a run folder's record binds or describes: never an output of another command
RUN_FILES = (RECORD_FILENAME, OUTPUTS_FILENAME, ROUNDS_FILENAME)


def run_folder_of(path: str | os.PathLike) -> Path | None:
    """The run folder (one holding a ``record.json``) that ``path`` is or would be written into."""
    p = Path(path).expanduser().resolve()
    for folder in (p, *p.parents):
        if (folder / RECORD_FILENAME).is_file():
            return folder
    return None


def json_object_with(*keys: str, **values: object) -> Callable[[Path], bool]:
    """A test of whether a file is a JSON object holding every one of ``keys``, and ``values`` as
    given (what a command recognises as a file it wrote before)."""

    def test(path: Path) -> bool:
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return (
            isinstance(value, dict)
            and all(k in value for k in keys)
            and all(value.get(k) == v for k, v in values.items())
        )

    return test


def output_file_problem(
    key: str,
    path: Path,
    *,
    what: str,
    ours: Callable[[Path], bool],
    example: str,
    overwrite: bool = False,
    overwrite_option: str = "overwrite=true",
) -> str | None:
    """Why ``path`` may not receive the file a command writes (``what``, e.g. "a compare JSON"), or
    None: a folder; a run folder's record, outputs or rounds, or any other path inside a run folder;
    any other existing file that ``ours`` does not recognise, unless ``overwrite`` (the command's
    ``overwrite_option`` says so); a folder that cannot be written."""
    if path.is_dir():
        return f"{key}={path} is a folder; give a file path, e.g. {key}={path / example}"
    if path.name in RUN_FILES and (path.parent / RECORD_FILENAME).is_file():
        return f"{key}={path} is a file of the run folder {path.parent}: write {what} elsewhere"
    if path.name == RECORD_FILENAME:  # compare, report and sweeps read every record.json under a folder
        return f"{key}={path}: {RECORD_FILENAME} is the name of a run's record; give {what} another name"
    run = run_folder_of(path.parent)
    if run is not None:  # beside the files a record binds: nothing is written inside a run folder
        return f"{key}={path} is inside the run folder {run}: write {what} outside any run folder"
    if path.exists() and not overwrite and not ours(path):
        return f"{key}={path} already exists and is not {what}; give another path or {overwrite_option}"
    return output_folder_problem(key, path.parent)
