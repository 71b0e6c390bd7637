"""Hydra entry points: `harness run` (one job, or a multirun of jobs) and `harness sweep NAME`.

``main`` composes the config and hands it to :func:`harness.runner.run_job` (single run) or
:func:`harness.sweep.run_sweep_job` (each job of a multirun); no logic lives here beyond turning
outcomes into exit codes and one-line refusals.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import DictConfig

from harness import sweep
from harness.config import CONF_DIR
from harness.gates.stages import GateError
from harness.runner import run_job, track


def run_main(argv: list[str] | None = None) -> int:
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    status = {"code": 0}

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _entry(cfg: DictConfig) -> dict | None:
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode.name == "MULTIRUN":  # skip finished jobs; a failing job never stops the sweep
            job = sweep.run_sweep_job(cfg, hydra_cfg=hydra_cfg)
            if job["status"] == "failed":
                status["code"] = 1  # seen here when the launcher runs jobs in this process
            return job
        run_dir = Path(cfg.output_dir or hydra_cfg.runtime.output_dir)
        try:
            record = run_job(cfg, run_dir=run_dir)
        except (GateError, ValueError) as exc:
            print(f"harness run: refused: {exc}", file=sys.stderr)
            status["code"] = 2
            return None
        track(cfg, record, run_dir)
        m = record["metrics"]
        print(
            json.dumps(
                {
                    "record": str(run_dir / "record.json"),
                    "speedup": m["speedup"],
                    "time_per_committed_token_ms": m["time_per_committed_token_ms"],
                    "ar_time_per_token_ms": m["ar_time_per_token_ms"],
                    "mean_committed_per_round": m["mean_committed_per_round"],
                    "greedy_identical": m["greedy_identical"],
                },
                indent=2,
            )
        )
        return None

    old = sys.argv
    sys.argv = ["harness run"] + argv
    try:
        _entry()
    finally:
        sys.argv = old
    return status["code"]


def sweep_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(sweep.USAGE)
        return 0 if argv else 2
    if argv[0] == "--list":
        for name in sweep.list_sweeps():
            print(name)
        return 0
    try:
        run_argv = sweep.sweep_argv(argv[0], argv[1:])
    except ValueError as exc:
        print(f"harness sweep: {exc}\n{sweep.USAGE}", file=sys.stderr)
        return 2
    sweep.LAST_SUMMARY.clear()
    try:
        code = run_main(run_argv)
    except SystemExit as exc:  # Hydra reports a composition error and exits
        code = exc.code if isinstance(exc.code, int) else 1
    if code:
        return int(code)
    if not sweep.LAST_SUMMARY:
        print("harness sweep: the sweep finished without a summary (was hydra.callbacks changed?)", file=sys.stderr)
        return 1
    return 1 if sweep.LAST_SUMMARY.get("failed") else 0
