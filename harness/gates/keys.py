"""Cache keys of the gates: a gate's result is reused only when everything it depends on is the same.

A key hashes the source of every harness module the gate's code can run — the import closure of
its entry modules, found by reading their imports (so a helper added later is covered without a
list to keep up to date) — the library versions, and the gate's own inputs as canonical JSON
(sorted keys, sorted sets: a key never depends on Python's hash seed).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterable
from pathlib import Path

from harness.measure.hardware import library_versions


@functools.cache
def module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


#: a ``"module:attr"`` reference a registry resolves on use (the proposers', the preparers')
_REF = re.compile(r"^(harness(?:\.\w+)+):\w+$")


@functools.cache
def _imports(name: str) -> tuple[str, ...]:
    """The harness modules ``name`` imports (anywhere in the file), and those its registries name:
    a ``"harness.x:Class"`` string is imported when resolved (the merged proposer reaches its
    sources so), and a gate that may run it must be keyed by its source too."""
    path = module_file(name)
    if path is None:
        return ()
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("harness"):
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]  # `from harness.x import submodule`
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("harness")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (ref := _REF.match(node.value)):
            out.append(ref.group(1))
    return tuple(m for m in out if module_file(m) is not None)


def import_closure(entries: Iterable[str]) -> list[str]:
    """Every harness module reachable by imports from ``entries`` (sorted)."""
    seen: set[str] = set()
    todo = [e for e in entries if module_file(e) is not None]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages' __init__ run too
        todo += list(_imports(m))
    return sorted(seen)


def canonical(obj) -> str:
    def norm(x):
        if isinstance(x, (set, frozenset)):
            return sorted(norm(v) for v in x)
        if isinstance(x, dict):
            return {str(k): norm(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [norm(v) for v in x]
        return x

    return json.dumps(norm(obj), sort_keys=True, default=str, separators=(",", ":"))


#: the modules that compile native sources of their own (C++ built on first use): the sources'
#: folder beside the module, relative to the module's file
NATIVE_SOURCES = {"harness.target.native": "kernels"}


def code_hash(entries: Iterable[str], *, own: Iterable[str] = ()) -> str:
    """SHA-256 (hex) of the source of every harness module reachable by imports from ``entries``
    (with the native sources such a module compiles), and of the modules ``own`` names without
    following their imports (a stage's own module, whose package imports much it never runs)."""
    h = hashlib.sha256()
    for name in sorted(set(import_closure(entries)) | {m for m in own if module_file(m) is not None}):
        h.update(name.encode() + b"\0" + module_file(name).read_bytes() + b"\0")
        if name in NATIVE_SOURCES:
            folder = module_file(name).with_name(NATIVE_SOURCES[name])
            for src in sorted(f for f in folder.iterdir() if f.is_file()):
                h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return h.hexdigest()


def gate_key(gate: str, *, entries: Iterable[str], inputs: dict) -> str:
    """The key of ``gate``'s cached result: the gate, the source of every harness module it may
    run (:func:`code_hash` of ``entries``), the library versions and ``inputs``."""
    h = hashlib.sha256(gate.encode())
    h.update(code_hash(entries).encode())
    h.update(canonical(library_versions()).encode())
    h.update(canonical(inputs).encode())
    return h.hexdigest()[:24]
