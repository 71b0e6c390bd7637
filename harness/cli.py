"""`harness` command: one entry point, subcommands routed to thin per-room mains.

Each subcommand's main takes ``argv`` (the arguments after the subcommand) and returns an exit
code. Modules are imported lazily so `harness tree` does not pay for torch model code.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("harness.app:run_main", "Hydra-composed run: gates, AR baseline + speculative arm, record"),
    "oracles": ("harness.gates.oracle_cli", "run the exactness oracle suite and print a table"),
    "tree": ("harness.topology.sequoia_cli", "Sequoia tree DP / hardware-aware selection (JSON)"),
    "calibrate": ("harness.app:calibrate_main", "write Sequoia calibration + hardware profile artifacts"),
    "datastore": ("harness.workloads.datastore", "build / inspect REST datastores"),
    "sweep": ("harness.app:sweep_main", "launch a named sweep from sweeps/"),
    "compare": ("harness.tracking.compare", "compare arms with paired bootstrap CIs"),
    "report": ("harness.tracking.report", "regenerate a report from stored records"),
    "export": ("harness.tracking.spec_bench", "export a run's answers in Spec-Bench's format (spec-bench)"),
    "dashboard": ("harness.app:dashboard_main", "W&B report of a sweep or experiment (offline: its specification)"),
    "train": ("harness.app:train_main", "train / search a proposer artifact (heads, early-exit adapter, skip vector)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help"}:
        print("usage: harness <command> [args...]\n\ncommands:")
        for name, (_, doc) in SUBCOMMANDS.items():
            print(f"  {name:<10} {doc}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"harness: unknown command {name!r}; one of {sorted(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module, _, func = SUBCOMMANDS[name][0].partition(":")
    return int(getattr(importlib.import_module(module), func or "main")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
