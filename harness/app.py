"""Entry points of the commands that compose the `harness run` config: `harness run` (one job, or a
multirun of jobs), `harness sweep NAME`, `harness calibrate` and `harness train`.

Each composes the config (Hydra) and hands it to one function of a room below —
:func:`harness.runner.run_job`, :func:`harness.sweep.run_sweep_job`,
:func:`harness.prepare.sequoia.ensure_tree_artifact`, a trainer of :data:`harness.prepare.TRAINERS` —
and turns the outcome into an exit code and a one-line refusal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from harness import sweep
from harness.config import CONF_DIR, compose
from harness.contracts import resolve_ref
from harness.engine.build import BuildContext, plan
from harness.gates.stages import GateError
from harness.prepare import TRAINERS
from harness.prepare.sequoia import ensure_tree_artifact
from harness.runner import load, load_models, plan_job, run_job, track


def run_main(argv: list[str] | None = None) -> int:

    argv = list(sys.argv[1:] if argv is None else argv)
    status = {"code": 0}

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _entry(cfg: DictConfig) -> dict | None:

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


# --------------------------------------------------------------------------- harness calibrate

CALIBRATE_USAGE = """usage: harness calibrate [hydra overrides, as for `harness run`]

Writes fresh Sequoia artifacts for the composed config (topology=sequoia unless another topology
is given): the positional-acceptance calibration, the hardware profile t(n), c0, c and the chosen
tree, under $HARNESS_CACHE/sequoia (a run with the same overrides then loads them)."""


def with_sequoia(overrides: list[str]) -> list[str]:
    """``overrides`` with ``topology=sequoia`` first unless a topology is given."""
    overrides = list(overrides)
    if not any(o.split("=", 1)[0].lstrip("+~") == "topology" for o in overrides):
        overrides.insert(0, "topology=sequoia")
    return overrides


def calibrate(cfg: DictConfig, *, progress: bool = True) -> dict:
    """Load the models of ``cfg``, write fresh calibration, profile and tree artifacts; return paths."""

    if cfg.topology.name != "sequoia":
        raise ValueError(
            f"harness calibrate writes Sequoia artifacts: it needs topology=sequoia; got topology={cfg.topology.name}"
        )
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    plan(cfg)  # negotiation first: refuse a combination the run would refuse, before model work
    loaded = load(cfg, plan_job(cfg, None))
    context = BuildContext(
        cfg=cfg,
        target_backend=loaded.backend,
        tokenizer=loaded.target.tokenizer,
        draft_backend=loaded.draft_backend,
        items=loaded.items,
        model_source=loaded.target.source,
    )
    return ensure_tree_artifact(cfg, context, force=True, progress=progress).summary()


def calibrate_main(argv: list[str]) -> int:
    if any(a in {"-h", "--help"} for a in argv):
        print(CALIBRATE_USAGE)
        return 0
    try:
        cfg = compose(with_sequoia(argv))
    except Exception as exc:  # hydra/omegaconf composition errors: unknown group, key or type
        print(f"harness calibrate: cannot compose the config from {argv}: {exc}", file=sys.stderr)
        return 2
    try:
        out = calibrate(cfg)
    except (GateError, ValueError) as exc:
        print(f"harness calibrate: refused: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0


# --------------------------------------------------------------------------- harness train

TRAIN_USAGE = f"""usage: harness train proposer=<{"|".join(TRAINERS)}> [hydra overrides...] [force=true]

Builds a proposer's trained or searched artifact for the configured target, e.g.
    harness train proposer=hydra [model=smollm2] [proposer.data.token_budget=20000] [force=true]
    harness train proposer=early_exit model=tiny
    harness train proposer=eagle [proposer.train.epochs=1] [proposer.data.token_budget=40000]
    harness train proposer=layer_skip proposer.search.trials=20
The same config composition as `harness run`, so the artifact's recipe is exactly the one a run
with the same overrides looks for. force=true retrains even when the artifact exists. Prints the
artifact's manifest summary as JSON."""


def train_main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help"}:
        print(TRAIN_USAGE)
        return 0 if argv else 2
    force = any(a.split("=", 1)[1].lower() in {"true", "1", "yes"} for a in argv if a.startswith("force="))
    cfg = compose([a for a in argv if not a.startswith("force=")])
    name = cfg.proposer.name
    if name not in TRAINERS:
        print(f"harness train: proposer {name!r} has no trained artifact; one of {sorted(TRAINERS)}", file=sys.stderr)
        return 2

    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    target, _ = load_models(cfg)
    try:
        summary = resolve_ref(TRAINERS[name])(cfg, target=target, force=force)
    except ValueError as exc:
        print(f"harness train: refused: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, default=str))
    return 0
