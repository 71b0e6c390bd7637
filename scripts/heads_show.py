"""The heads comparison table from a `harness sweep heads` folder: one row per record.

    .venv/bin/python scripts/heads_show.py multirun/heads [--json docs/measurements/heads_show.json]

Columns: experiment, workload, temperature, verifier, held-out top-1 agreement by depth (from the
record's proposer artifact), committed tokens per round, acceptance by depth, critical-path stages
per round, proposal ms per round, speedup vs AR, and for EAGLE's trees the verified sizes (mean
rows, largest depth, the size histogram). Reads stored records only; measures nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def row_of(record: dict) -> dict:
    m = record["metrics"]
    extras = m.get("retrieval") or {}
    art = (record.get("artifacts") or {}).get("proposer_artifact") or {}
    held = art.get("held_out") or {}
    return {
        "experiment": record.get("experiment"),
        "proposer": record["axes"]["proposer"],
        "topology": record["axes"]["topology"],
        "workload": record["axes"]["workload"],
        "temperature": record["axes"]["temperature"],
        "verifier": record["axes"]["verifier"],
        "held_out_top1_agreement": held.get("top1_agreement"),
        "mean_committed_per_round": m.get("mean_committed_per_round"),
        "acceptance_by_depth": m.get("acceptance_by_depth"),
        "critical_path_stages_per_round": extras.get("critical_path_stages_per_round"),
        "proposal_ms_per_round": (m.get("round_cost_ms") or {}).get("proposal"),
        "speedup": m.get("speedup"),
        "mean_tree_rows": extras.get("mean_tree_rows"),
        "max_tree_depth": extras.get("max_tree_depth"),
        "tree_rows_hist": extras.get("tree_rows_hist"),
        "greedy_identical": m.get("greedy_identical"),
        "cpu_budget_artifact": m.get("cpu_budget_artifact"),
        "run_id": record.get("run_id"),
    }


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, list):
        return ", ".join(fmt(x, digits) for x in v)
    return str(v)


def table(rows: list[dict]) -> str:
    head = (
        "| experiment | workload | T | verifier | held-out top-1 by depth | committed / round | acceptance by depth "
        "| stages | proposal ms / round | speedup | tree rows (mean, max depth) |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        tree = "—" if r["mean_tree_rows"] is None else f"{r['mean_tree_rows']:.1f}, {r['max_tree_depth']}"
        lines.append(
            f"| {r['experiment']} | {r['workload']} | {fmt(r['temperature'], 1)} | {r['verifier']} "
            f"| {fmt(r['held_out_top1_agreement'], 3)} | {fmt(r['mean_committed_per_round'])} "
            f"| {fmt(r['acceptance_by_depth'])} | {fmt(r['critical_path_stages_per_round'], 1)} "
            f"| {fmt(r['proposal_ms_per_round'], 1)} | {fmt(r['speedup'])} | {tree} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    paths = sorted(args.sweep_dir.rglob("record.json"))
    if not paths:
        print(f"heads_show: no record.json under {args.sweep_dir}", file=sys.stderr)
        return 2
    rows = [row_of(json.loads(p.read_text())) for p in paths]
    rows.sort(key=lambda r: (r["temperature"], r["workload"], str(r["experiment"])))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
