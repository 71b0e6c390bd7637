"""Atomic record writing: a crashed job leaves no partial record (a re-launched sweep re-runs it)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _atomic_write(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    _atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_jsonl_atomic(path: Path, rows: Iterable[Any]) -> None:
    _atomic_write(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))
