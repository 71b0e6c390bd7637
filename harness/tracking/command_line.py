"""What the commands that read stored runs (compare, report, dashboard, export) share on their
command lines: arguments split into paths and ``key=value`` options, and where an output file may go.

Job folders of a multirun are named by their overrides (``proposer=prompt_lookup,seed=1``), so an
argument with ``=`` in it may be a path: it is one when its key part holds a path separator or the
argument names something that exists. Output files never replace what they did not write: a
run's record or outputs, or any other file that is not what the command writes, is refused unless
``overwrite=true``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.files import (  # noqa: F401  (where the commands of this room read them)
    RECORD_FILENAME,
    RUN_FILES,
    json_object_with,
    output_file_problem,
    output_folder_problem,
    print_traceback_if_asked,
    run_folder_of,
)


def is_path_argument(arg: str) -> bool:
    """Whether ``arg`` names a path rather than a ``key=value`` option."""
    key = arg.lstrip("-").partition("=")[0]
    return "/" in key or os.sep in key or Path(arg).expanduser().exists()


def split_arguments(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``["root", "by=proposer"]`` -> (positionals, {key: value}); ``--k=v`` is accepted too, and an
    argument that names a path (:func:`is_path_argument`) is positional whatever it holds. An empty
    value (``out=``) is refused: as a path it named the current folder."""
    positionals: list[str] = []
    kv: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.lstrip("-").partition("=")
        if sep and key and not is_path_argument(arg):
            if key in kv:
                raise ValueError(f"{key}= given twice: {kv[key]!r} and {value!r}")
            if not value.strip():
                raise ValueError(f"{key}= is empty; give a value or leave the option out")
            kv[key] = value
        else:
            positionals.append(arg)
    return positionals, kv


def boolean_option(key: str, value: str | None, default: bool = False) -> bool:
    """``true``/``false`` (any case) as a bool; anything else raises ValueError naming ``key``."""
    if value is None:
        return default
    v = value.strip().lower()
    if v not in {"true", "false"}:
        raise ValueError(f"{key}={value!r}: must be true or false")
    return v == "true"


def whole_number_option(key: str, value: str | None, default: int, *, minimum: int = 1) -> int:
    """A whole number ``>= minimum`` (``default`` when absent); anything else raises ValueError naming ``key``."""
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{key}={value!r}: expected a whole number >= {minimum}") from None
    if number < minimum:
        raise ValueError(f"{key}={number} is out of range: it must be >= {minimum}")
    return number


def _one_line(exc: BaseException) -> str:
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # a KeyError's str() is its repr
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def refuse(command: str, exc: BaseException) -> int:
    """Say on one stderr line why ``harness <command>`` refused; returns the exit status, 2. A
    broken pipe (stdout's reader left) is no refusal: it goes on to the command line's handler."""
    if isinstance(exc, BrokenPipeError):
        raise exc
    print_traceback_if_asked(exc)
    print(f"harness {command}: refused: {_one_line(exc)} (harness {command} --help shows the usage)", file=sys.stderr)
    return 2


def usage_status(usage: str, argv: Sequence[str]) -> int | None:
    """For ``-h``/``--help`` (``usage`` on stdout, status 0) or no arguments at all (``usage`` on
    stderr, status 2): the exit status, having printed it; None otherwise."""
    if argv and argv[0] not in {"-h", "--help"}:
        return None
    print(usage, file=sys.stdout if argv else sys.stderr)  # asked for: stdout, status 0
    return 0 if argv else 2


def parse_command(command: str, usage: str, argv: list[str] | None) -> tuple[list[str], dict[str, str]] | int:
    """``harness <command>``'s arguments (``sys.argv[1:]`` when None) as (positionals,
    ``key=value`` options); or, having printed ``usage`` (:func:`usage_status`) or a refusal (2),
    the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    status = usage_status(usage, argv)
    if status is not None:
        return status
    try:
        return split_arguments(argv)
    except ValueError as exc:
        return refuse(command, exc)
