"""Verifier and proposer code draws randomness only through an injected RandomSource.

The exactness oracle enumerates the draws made through ``RandomSource.bernoulli`` /
``categorical``; any other source of randomness (torch.rand, torch.multinomial, numpy.random,
python ``random``, a global or private generator) would be invisible to it and break the proof.
This test scans the source of ``harness/verifiers/*.py`` and ``harness/proposers/*.py`` with the
AST (aliases resolved) and fails on any such use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("harness/verifiers", "harness/proposers")

#: dotted names (after alias resolution) that are raw randomness
BANNED_CALLS = {
    "torch.rand",
    "torch.rand_like",
    "torch.randn",
    "torch.randn_like",
    "torch.randint",
    "torch.randint_like",
    "torch.randperm",
    "torch.multinomial",
    "torch.bernoulli",
    "torch.normal",
    "torch.poisson",
    "torch.manual_seed",
    "torch.seed",
    "torch.initial_seed",
    "torch.get_rng_state",
    "torch.set_rng_state",
    "torch.Generator",
    "torch.cuda.manual_seed",
    "torch.cuda.manual_seed_all",
    "torch.nn.functional.gumbel_softmax",
    "torch.nn.functional.dropout",
}
#: module prefixes: any use of these is raw randomness
BANNED_PREFIXES = (
    "random",
    "numpy.random",
    "torch.random",
    "torch.distributions",
    "secrets",
    "os.urandom",
    "torch.cuda.random",
    "scipy.stats",
)
#: in-place sampling methods on tensors (and sampler methods), whatever the receiver
BANNED_METHODS = {
    "random_",
    "uniform_",
    "normal_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "multinomial",
    "rvs",
}


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _banned(name: str) -> bool:
    return name in BANNED_CALLS or any(name == p or name.startswith(p + ".") for p in BANNED_PREFIXES)


def scan_source(source: str, filename: str = "<snippet>") -> list[str]:
    """Violations in ``source``: ``"file:line: what"`` per raw-randomness use."""
    tree = ast.parse(source, filename=filename)
    aliases: dict[str, str] = {}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if _banned(a.name):
                    found.append(f"{filename}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                if _banned(node.module) or _banned(full):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = _dotted(node, aliases)
            if name is not None and _banned(name):
                found.append(f"{filename}:{node.lineno}: {name}")
            elif node.attr in BANNED_METHODS:
                found.append(f"{filename}:{node.lineno}: .{node.attr}()")
        elif isinstance(node, ast.Name) and node.id in aliases and _banned(aliases[node.id]):
            if isinstance(node.ctx, ast.Load):
                found.append(f"{filename}:{node.lineno}: {aliases[node.id]}")
    return sorted(set(found))


def _scanned_files() -> list[Path]:
    files = []
    for d in SCANNED_DIRS:
        files.extend(sorted((ROOT / d).glob("*.py")))
    return files


def test_scanned_directories_are_not_empty():
    names = {p.name for p in _scanned_files()}
    assert {"builtin.py", "base.py", "sampling.py"} <= names


@pytest.mark.parametrize("path", _scanned_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_raw_randomness_in_verifiers_and_proposers(path):
    violations = scan_source(path.read_text(), str(path.relative_to(ROOT)))
    assert violations == [], "draw through the injected RandomSource instead:\n" + "\n".join(violations)


BAD_SNIPPETS = {
    "torch.rand": "import torch\nu = torch.rand(())\n",
    "aliased torch": "import torch as T\nu = T.rand(3)\n",
    "multinomial": "import torch\nx = torch.multinomial(p, 1)\n",
    "tensor.multinomial": "x = p.multinomial(1)\n",
    "torch.bernoulli": "import torch\nb = torch.bernoulli(p)\n",
    "from torch import randint": "from torch import randint\nx = randint(3, (1,))\n",
    "manual_seed": "import torch\ntorch.manual_seed(0)\n",
    "private generator": "import torch\ng = torch.Generator()\n",
    "numpy.random": "import numpy as np\nx = np.random.rand()\n",
    "numpy default_rng": "from numpy.random import default_rng\nr = default_rng(0)\n",
    "python random": "import random\nx = random.random()\n",
    "from random": "from random import choice\nx = choice([1, 2])\n",
    "in-place uniform": "t.uniform_()\n",
    "torch.distributions": "import torch\nx = torch.distributions.Categorical(probs=p).sample()\n",
}


@pytest.mark.parametrize("label", sorted(BAD_SNIPPETS))
def test_scanner_flags_planted_raw_randomness(label):
    assert scan_source(BAD_SNIPPETS[label]) != [], f"scanner missed: {label}"


def test_scanner_allows_the_random_source_and_deterministic_torch():
    good = (
        "import torch\n"
        "from harness.random_source import RandomSource\n"
        "def f(rng: RandomSource, p: torch.Tensor) -> int:\n"
        "    if rng.bernoulli(0.5):\n"
        "        return rng.categorical(p)\n"
        "    return int(torch.topk(p, 2).indices[0]) + int(torch.argmax(p))\n"
    )
    assert scan_source(good) == []
