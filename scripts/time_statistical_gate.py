"""Seconds the statistical (chi-square) gate takes for each proposer x exact verifier the runner
admits at temperature > 0, on the configured target (default: the embedded SmolLM2).

    .venv/bin/python scripts/time_statistical_gate.py --out docs/measurements/statistical_gate.json

Each combination goes through the runner's own stages (plan, load, prepare, build the proposer)
and then :func:`harness.gates.stages.run_gates` with only the statistical gate switched on and its
cache off, so the figure is the gate's own ``seconds`` (the prefix scan, proposals through the
draft's law tables or memo, the target's rows by path, selection and the test). Each row also says
where the time went and what was shared: the chosen prefix (length, probes the scan made), distinct
trees, target rows and forwards, proposal and verify passes, law rows computed and served, draft
calls computed and memo hits. Artifacts a proposer needs (heads, an
EAGLE draft, the early-exit adapter) are trained on first use with a small token budget
(``--token-budget``): the gate's time depends on how many distinct paths and trees the proposer
draws, not on how good its drafts are. Layer skip gets an explicit skip vector instead of its
search. Run it with the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from harness.config import compose
from harness.gates.stages import run_gates
from harness.runner import load, plan_job, prepare_job

#: (label, overrides, verifier): sampled relations under the verifiers that need q; deterministic
#: proposals (lookup, REST, beam) under membership
COMBOS = [
    ("prompt_lookup", ["proposer=prompt_lookup", "topology=sequences"], "membership"),
    ("rest", ["proposer=rest", "topology=sequences"], "membership"),
    ("merged rest+lookup", ["proposer=merged", "topology=merged"], "membership"),
    (
        "merged draft+rest+lookup",
        ["proposer=merged", "topology=merged", "proposer.sources=[draft_model,rest,prompt_lookup]"],
        "membership",
    ),
    ("draft_model iid chain", ["proposer=draft_model", "proposer.sampling=iid", "topology=sequence"], "rejection"),
    ("draft_model iid chain", ["proposer=draft_model", "proposer.sampling=iid", "topology=sequence"], "specinfer"),
    (
        "draft_model wor [2,2]",
        [
            "proposer=draft_model",
            "proposer.sampling=without_replacement",
            "topology=expansion",
            "topology.widths=[2,2]",
        ],
        "sequoia",
    ),
    (
        "draft_model iid [2,2]",
        ["proposer=draft_model", "proposer.sampling=iid", "topology=expansion", "topology.widths=[2,2]"],
        "specinfer",
    ),
    ("draft_model beam chain", ["proposer=draft_model", "proposer.sampling=beam", "topology=sequence"], "membership"),
    ("medusa iid chain", ["proposer=medusa", "proposer.sampling=iid", "topology=sequence"], "rejection"),
    (
        "medusa wor [2,2]",
        ["proposer=medusa", "proposer.sampling=without_replacement", "topology=expansion", "topology.widths=[2,2]"],
        "sequoia",
    ),
    ("hydra iid chain", ["proposer=hydra", "proposer.sampling=iid", "topology=sequence"], "specinfer"),
    ("clover iid chain", ["proposer=clover", "proposer.sampling=iid", "topology=sequence"], "rejection"),
    ("clover beam chain", ["proposer=clover", "proposer.sampling=beam", "topology=sequence"], "membership"),
    ("eagle iid chain", ["proposer=eagle", "proposer.sampling=iid", "topology=sequence"], "rejection"),
    ("eagle iid chain", ["proposer=eagle", "proposer.sampling=iid", "topology=sequence"], "specinfer"),
    (
        "eagle wor dynamic",
        ["proposer=eagle", "proposer.sampling=without_replacement", "topology=dynamic"],
        "sequoia",
    ),
    ("eagle beam dynamic", ["proposer=eagle", "proposer.sampling=beam", "topology=dynamic"], "membership"),
    ("early_exit iid", ["proposer=early_exit", "proposer.sampling=iid", "topology=sequence"], "rejection"),
    (
        "layer_skip iid",
        ["proposer=layer_skip", "proposer.sampling=iid", "proposer.skip=[24,25,26,27]", "topology=sequence"],
        "rejection",
    ),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--token-budget", type=int, default=3000, help="training tokens of an artifact made on first use")
    ap.add_argument("--only", nargs="*", help="labels to run (default: all)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only or ()) - {label for label, _, _ in COMBOS})
    if unknown:
        ap.error(f"--only {' '.join(unknown)}: no such label; the labels: {', '.join(label for label, _, _ in COMBOS)}")
    torch.set_num_threads(2)
    rows = []
    for label, overrides, verifier in COMBOS:
        if args.only and label not in args.only:
            continue
        ov = [
            f"model={args.model}",
            *overrides,
            f"verifier={verifier}",
            f"generation.temperature={args.temperature}",
            "workload=humaneval",
            "workload.limit=1",
            "gates.oracle=false",
            "gates.equivalence=false",
            "gates.cache=false",
            "tracking=none",
        ]
        if any(o.startswith(f"proposer={k}") for k in ("medusa", "hydra", "clover", "eagle", "early_exit") for o in ov):
            ov.append(f"proposer.data.token_budget={args.token_budget}")
        t0 = time.perf_counter()
        try:
            cfg = compose(ov)
            planned = plan_job(cfg, Path("results/statistical_gate_timing"))
            loaded = load(cfg, planned)
            prepared = prepare_job(cfg, planned, loaded)
            t_setup = time.perf_counter() - t0
            gates = run_gates(
                cfg,
                plan_=prepared.plan,
                backend=loaded.backend,
                proposer=prepared.proposers[0],
                items=loaded.items,
                model_source=loaded.target.source,
            )
        except Exception as exc:  # a combination that does not run is reported, the others still run
            row = {
                "combo": label,
                "verifier": verifier,
                "overrides": overrides,
                "error": f"{type(exc).__name__}: {exc}",
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        entry = gates["statistical"]
        row = {
            "combo": label,
            "verifier": verifier,
            "overrides": overrides,
            "status": entry["status"],
            "seconds": round(float(entry.get("seconds", float("nan"))), 2),
            "prefix_seconds": (entry.get("prefix") or {}).get("seconds"),
            "proposal_seconds": round(float(entry.get("proposal_seconds", float("nan"))), 2),
            "verify_select_seconds": round(float(entry.get("verify_select_seconds", float("nan"))), 2),
            "samples": entry.get("samples"),
            "prefix_len": entry.get("prefix_len"),
            "prefix_probes": (entry.get("prefix") or {}).get("probes"),
            "distinct_trees": entry.get("distinct_trees"),
            "target_rows": entry.get("target_rows"),
            "target_forwards": entry.get("target_forwards"),
            "verify_passes": entry.get("verify_passes"),
            "proposal_passes": entry.get("proposal_passes"),
            "law_rows": entry.get("law_rows"),
            "law_forwards": entry.get("law_forwards"),
            "law_hits": entry.get("law_hits"),
            "law_mb": entry.get("law_mb"),
            "draft_calls": entry.get("draft_calls"),
            "memo_hits": entry.get("memo_hits"),
            "memo_mb": entry.get("memo_mb"),
            "p_value": entry.get("p_value"),
            "why": entry.get("why"),
            "setup_seconds": round(t_setup, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"temperature": args.temperature, "rows": rows}, indent=2) + "\n")
    timed = [r for r in rows if "seconds" in r]
    slow = [r for r in timed if not r["seconds"] < 30]
    slowest = max((r["seconds"] for r in timed), default=0)
    print(f"{len(timed)} of {len(rows)} combinations timed; slowest {slowest:.1f} s", file=sys.stderr)
    return 1 if slow or len(timed) < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
