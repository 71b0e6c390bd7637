"""`harness train`: build a proposer's trained or searched artifact for the configured target.

    harness train proposer=hydra [model=smollm2] [proposer.data.token_budget=20000] [force=true]
    harness train proposer=early_exit model=tiny
    harness train proposer=layer_skip proposer.search.trials=20

The same config composition as `harness run` (conf/, Hydra overrides), so the artifact's recipe is
exactly the one a run with the same overrides will look for. ``force=true`` retrains even when the
artifact exists. Prints the artifact manifest summary as JSON.
"""

from __future__ import annotations

import json
import sys

from harness.engine.build import resolve

#: proposer name -> "module:function(cfg, *, target, force) -> manifest dict"
TRAINERS: dict[str, str] = {
    "medusa": "harness.heads.artifacts:train_from_config",
    "hydra": "harness.heads.artifacts:train_from_config",
    "clover": "harness.heads.artifacts:train_from_config",
    "early_exit": "harness.heads.early_exit:train_from_config",
    "layer_skip": "harness.heads.skip_search:train_from_config",
}

USAGE = "usage: harness train proposer=<" + "|".join(TRAINERS) + "> [hydra overrides...] [force=true]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help"}:
        print(USAGE)
        return 0 if argv else 2
    force = False
    overrides = []
    for arg in argv:
        if arg.startswith("force="):
            force = arg.split("=", 1)[1].lower() in {"true", "1", "yes"}
        else:
            overrides.append(arg)
    from harness.config import compose

    cfg = compose(overrides)
    name = cfg.proposer.name
    if name not in TRAINERS:
        print(f"harness train: proposer {name!r} has no trained artifact; one of {sorted(TRAINERS)}", file=sys.stderr)
        return 2
    import torch

    from harness.runner import load_models

    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    target, _ = load_models(cfg)
    try:
        summary = resolve(TRAINERS[name])(cfg, target=target, force=force)
    except ValueError as exc:
        print(f"harness train: refused: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, default=str))
    return 0
