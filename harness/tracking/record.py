"""Atomic record writing: a crashed job leaves no partial record (a re-launched sweep re-runs it).

Files are written through a unique temporary name and renamed into place
(:func:`harness.files.atomic_write_text`), with the permissions a plain write gives (0644 under
the usual umask), so a record is readable by the group.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from harness.files import atomic_write_text


def json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"


def jsonl_text(rows: Iterable[Any]) -> str:
    return "".join(json.dumps(r, default=str) + "\n" for r in rows)


def write_json_atomic(path: Path, obj: Any) -> None:
    atomic_write_text(path, json_text(obj))


def write_jsonl_atomic(path: Path, rows: Iterable[Any]) -> None:
    atomic_write_text(path, jsonl_text(rows))
