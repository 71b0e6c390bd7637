"""`harness` command: one entry point, subcommands routed to thin per-room mains.

Each subcommand's main takes ``argv`` (the arguments after the subcommand) and returns an exit
code. Modules are imported lazily so `harness tree` does not pay for torch model code.

A command that fails says so in one line on stderr and exits non-zero: 2 for a refusal (bad
input: a value, a path, a combination; the line names what to change), 1 for anything else, 130
on Ctrl-C, 128 + the signal's number when a run is ended by SIGTERM or SIGHUP (143, 129: a
``kill``, a timeout, a scheduler's time limit, which `harness run` handles as it does Ctrl-C).
The traceback is shown only when asked: ``HARNESS_TRACEBACK=1`` or ``harness --traceback <command> ...``.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator

from harness.files import TRACEBACK_ENV, wants_traceback

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("harness.app:run_main", "Hydra-composed run: gates, AR baseline + speculative arm, record"),
    "oracles": ("harness.gates.oracle_cli", "run the exactness oracle suite and print a table"),
    "tree": ("harness.topology.sequoia_cli", "Sequoia tree DP / hardware-aware selection (JSON)"),
    "calibrate": ("harness.app:calibrate_main", "write Sequoia calibration + hardware profile artifacts"),
    "datastore": ("harness.workloads.datastore", "build / inspect REST datastores"),
    "sweep": ("harness.app:sweep_main", "launch a named sweep from sweeps/"),
    "compare": ("harness.tracking.compare", "compare arms with paired bootstrap CIs"),
    "report": ("harness.tracking.report", "regenerate a report from stored records"),
    "export": ("harness.tracking.spec_bench", "export a run's answers in Spec-Bench's format (spec-bench)"),
    "dashboard": ("harness.app:dashboard_main", "W&B report of a sweep or experiment (offline: its specification)"),
    "train": ("harness.app:train_main", "train / search a proposer artifact (heads, early-exit adapter, skip vector)"),
}

#: exit codes
REFUSED, FAILED, INTERRUPTED = 2, 1, 130
#: the status of a command whose stdout reader left (as a SIGPIPE ends a process: 128 + 13)
BROKEN_PIPE = 141
#: the signals that end a run as Ctrl-C does (:func:`signals_interrupt`)
TERMINATING = ("SIGTERM", "SIGHUP")


class Terminated(KeyboardInterrupt):
    """A run ended by SIGTERM or SIGHUP: handled as Ctrl-C is (the earlier files put back, the
    folder cleaned up), its exit status 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise :class:`Terminated` where the process is,
    as SIGINT raises KeyboardInterrupt; a second such signal while the first is handled ends the
    process as the handler before would have. The earlier handlers are back after the block. A
    signal the process ignores (``nohup``'s SIGHUP) stays ignored.
    Outside the main thread (where Python takes no handler), or inside another such block (every
    command runs in one, :func:`main`), the block runs as it is."""
    if threading.current_thread() is not threading.main_thread() or _SIGNALS_HANDLED:
        yield
        return
    previous: dict[int, object] = {}
    received: list[int] = []

    def handler(signum: int, frame) -> None:
        if received:  # a second signal: no second clean-up, the process ends now
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
            return
        received.append(signum)
        raise Terminated(signum)

    for name in TERMINATING:
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) != signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            before = signal.signal(signum, handler)
            previous[signum] = signal.SIG_DFL if before is None else before
    _SIGNALS_HANDLED.append(True)
    try:
        yield
    finally:
        _SIGNALS_HANDLED.pop()
        for signum, before in previous.items():
            signal.signal(signum, before)


#: non-empty while a :func:`signals_interrupt` block holds the handlers
_SIGNALS_HANDLED: list[bool] = []


#: OSError numbers that say the machine failed, not that a given path was wrong: reported as errors
MACHINE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EIO", "EROFS", "ENOMEM", "EMFILE", "ENFILE", "ESTALE")
    if hasattr(errno, name)
)


def one_line(text: object) -> str:
    """``text`` on one line: blank lines and the context lines Hydra and OmegaConf add (full_key,
    object_type, the config search path, a link to the override grammar) dropped, the rest joined."""
    keep = []
    for line in str(text).splitlines():
        s = line.strip()
        if not s or s.startswith(("full_key:", "object_type=", "reference_type=", "provider=", "See https://")):
            continue
        if s.startswith("Config search path"):
            continue
        keep.append(s)
    return " ".join(keep)


def is_refusal(exc: BaseException, refusals: tuple[type, ...] = ()) -> bool:
    """Whether ``exc`` refuses an input: a ValueError, one of ``refusals``, or an OSError other than
    one of the machine's (:data:`MACHINE_ERRNOS`)."""
    if isinstance(exc, OSError) and not isinstance(exc, refusals):
        return exc.errno not in MACHINE_ERRNOS
    return isinstance(exc, (ValueError, *refusals))


def report_failure(command: str, exc: BaseException, *, refusals: tuple[type, ...] = ()) -> int:
    """Print ``exc`` as one line (its traceback too when asked); return the exit code.

    A refusal is a ValueError (config, negotiation, contract, workload, checkpoint errors), an
    OSError about a path the user gave (missing, the wrong kind, not permitted) or one of
    ``refusals``; anything else is an error, reported with its type, including an OSError of the
    machine (a full disk, a read-only file system, an I/O error), which no other input would avoid.
    """
    if isinstance(exc, Terminated):
        print(f"harness {command}: terminated ({signal.Signals(exc.signum).name})", file=sys.stderr)
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        print(f"harness {command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    refused = is_refusal(exc, refusals)
    message = one_line(exc) or type(exc).__name__
    if refused:
        line, code = f"harness {command}: refused: {message}", REFUSED
    else:
        line, code = f"harness {command}: error: {type(exc).__name__}: {message}", FAILED
    show = wants_traceback()
    if show:
        traceback.print_exception(exc, file=sys.stderr)
    elif not refused:
        line += f" ({TRACEBACK_ENV}=1 shows the traceback)"
    print(line, file=sys.stderr)
    return code


def print_usage(usage: str, asked: bool) -> int:
    """Print a command's usage: on stdout with status 0 when asked for (``-h``/``--help``), on
    stderr with status 2 when the arguments were missing."""
    print(usage, file=sys.stdout if asked else sys.stderr)
    return 0 if asked else REFUSED


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--traceback":
        os.environ[TRACEBACK_ENV] = "1"
        argv = argv[1:]
    if not argv or argv[0] in {"-h", "--help"}:
        lines = ["usage: harness [--traceback] <command> [args...]", "", "commands:"]
        lines += [f"  {name:<10} {doc}" for name, (_, doc) in SUBCOMMANDS.items()]
        lines += ["", f"--traceback (or {TRACEBACK_ENV}=1): print the traceback of a failure, not just its one line"]
        return print_usage("\n".join(lines), bool(argv))
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"harness: unknown command {name!r}; one of {sorted(SUBCOMMANDS)}", file=sys.stderr)
        return REFUSED
    module, _, func = SUBCOMMANDS[name][0].partition(":")
    try:  # a temporary folder (a datastore or artifact half built) is removed on SIGTERM as on Ctrl-C
        with signals_interrupt():
            return int(getattr(importlib.import_module(module), func or "main")(rest) or 0)
    except BrokenPipeError:  # the reader of stdout left (``| head``): no refusal, the status a SIGPIPE gives
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return BROKEN_PIPE
    except (Exception, KeyboardInterrupt) as exc:  # every command ends in one line, whatever escaped it
        return report_failure(name, exc)


if __name__ == "__main__":
    sys.exit(main())
