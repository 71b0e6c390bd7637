"""Where the native decoder stack's time goes, step by step, at each row count: the profile
``torch.profiler`` cannot give (the stack is one operator to it).

The kernel source is built a second time with ``-DHARNESS_PHASE_TIMES`` under its own op namespace
(``harness_phases``; the harness never loads that build): every thread then adds the wall time of
each step of a layer (up to the barrier that ends it, so a step's time includes waiting for the
slower thread) and, for bf16 attention on AMX tiles, of each part of a block of up to 16 (row, head)
pairs. SmolLM2's 30 layers run as a verify forward runs them, one ``llama_stack`` call over ``n``
causal rows after a cached prefix (a chain; a tree costs the same, see docs/measurements.md), the
row counts interleaved within each round so the machine's drift falls on all of them alike. Writes
``layer_phases.md`` (per step: µs per layer, thread 0; attention parts: µs per block, every
thread's blocks) and ``layer_phases.json`` into ``--out``.

    .venv/bin/python scripts/layer_phases.py --dtype bfloat16 --out results/layer_phases    # ~1 min
    .venv/bin/python scripts/layer_phases.py --dtype float32 --rows 1 8 --prefix 1024 --out /tmp/lp
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from harness.measure.hardware import cpu_name
from harness.target import native
from harness.target.loading import load_model
from harness.target.options import resolve_linear_kernel, weight_panels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native_ab import stack_inputs  # noqa: E402  (a sibling script)

STEPS = (
    "input norm",
    "q, k, v products",
    "rotary, cache append",
    "attention",
    "o product",
    "residual, post norm",
    "gate, up products",
    "silu(gate) * up",
    "down product",
    "residual",
)
PARTS = ("scores", "softmax", "value sums on tiles", "value sums in float32", "output")
NAMESPACE = "harness_phases"

REPO_ROOT = Path(__file__).resolve().parents[1]  # git reads this checkout, wherever the script runs from


def stack_call(layers: list[list]) -> list:
    """``llama_stack``'s arguments for the layers of :func:`stack_inputs` (the first layer's input)."""
    first = layers[0]
    return [
        first[0],
        first[1],
        first[2],
        first[3],
        [a[4] for a in layers],
        [a[5] for a in layers],
        first[6],
        [w for a in layers for w in a[7]],
        [b for a in layers for b in a[8]],
        [a[9] for a in layers],
        [a[10] for a in layers],
        first[11],
    ]


def read_counters(ops) -> dict:
    """The build's counters since the last read: layers and blocks, seconds per step (thread 0) and
    per attention part (summed over threads)."""
    t = ops.layer_phase_times()
    k = len(STEPS)
    return {
        "layers": float(t[0, 0]),
        "blocks": float(t[:, 1].sum()),
        "step_s": [float(x) for x in t[0, 2 : 2 + k]],
        "part_s": [float(x) for x in t[:, 2 + k :].sum(0)],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--prefix", type=int, default=256, help="cached tokens before the rows")
    ap.add_argument("--rounds", type=int, default=8, help="rounds over every row count")
    ap.add_argument("--repeats", type=int, default=3, help="forwards per row count and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--panels",
        choices=["auto", "true", "false"],
        default="auto",
        help="weights packed as streaming_panels packs them (auto: where model.linear_kernel=auto packs them)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1 or min(args.rows) < 1 or args.prefix < 1:
        ap.error("--rounds, --repeats, --rows and --prefix must be >= 1")
    torch.set_num_threads(args.threads)
    native.load_native_kernels()
    dtype = getattr(torch, args.dtype)
    panels = args.panels == "true" or (
        args.panels == "auto" and resolve_linear_kernel("auto", dtype, "cpu") == "streaming_panels"
    )
    with tempfile.TemporaryDirectory() as tmp:
        library = native.build(namespace=NAMESPACE, extra_flags=("-DHARNESS_PHASE_TIMES",), out_dir=Path(tmp))
        torch.ops.load_library(str(library))
    ops = getattr(torch.ops, NAMESPACE)
    model = load_model(name="smollm2", dtype=args.dtype).model
    head = model.lm_head.weight.detach()
    head = weight_panels(head) if panels else head
    calls = {n: stack_call(stack_inputs(model, n, args.prefix, dtype, seed=n, panels=panels)) for n in args.rows}
    totals = {
        n: {"layers": 0.0, "blocks": 0.0, "step_s": [0.0] * len(STEPS), "part_s": [0.0] * len(PARTS)} for n in args.rows
    }
    wall = {n: [] for n in args.rows}
    for n in args.rows:  # one untimed forward each: the build's first calls and the caches
        ops.llama_stack(*calls[n])
    read_counters(ops)
    for r in tqdm(range(args.rounds), desc="layer phases", file=sys.stderr):
        order = args.rows if r % 2 == 0 else args.rows[::-1]
        for n in order:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                hidden = ops.llama_stack(*calls[n])
                ops.streaming_linear(hidden[0], head, None)
                wall[n].append((time.perf_counter() - t0) * 1e3)
            got = read_counters(ops)
            acc = totals[n]
            acc["layers"] += got["layers"]
            acc["blocks"] += got["blocks"]
            acc["step_s"] = [a + b for a, b in zip(acc["step_s"], got["step_s"])]
            acc["part_s"] = [a + b for a, b in zip(acc["part_s"], got["part_s"])]
    results = []
    for n in args.rows:
        acc = totals[n]
        steps_us = [s / acc["layers"] * 1e6 for s in acc["step_s"]]
        parts_us = [s / acc["blocks"] * 1e6 for s in acc["part_s"]] if acc["blocks"] else None
        results.append(
            {
                "rows": n,
                "forward_ms": statistics.median(wall[n]),
                "step_us_per_layer": dict(zip(STEPS, steps_us)),
                "layers_ms": sum(steps_us) * len(calls[n][4]) / 1e3,
                "attention_blocks_per_layer": acc["blocks"] / acc["layers"] if acc["blocks"] else 0.0,
                "attention_part_us_per_block": dict(zip(PARTS, parts_us)) if parts_us else None,
            }
        )
    meta = {
        "head": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT
        ).stdout.strip(),
        "dtype": args.dtype,
        "panels": panels,
        "prefix": args.prefix,
        "cpu": cpu_name(),
        "threads": args.threads,
        "rounds": args.rounds,
        "repeats": args.repeats,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer_phases.json").write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    one = next((r for r in results if r["rows"] == 1), None)
    head_cells = " | ".join(f"n = {r['rows']}" for r in results)
    lines = [
        f"# SmolLM2's native stack, {args.dtype}{', weights packed' if panels else ''}, prefix {args.prefix}: "
        f"µs per layer by step (thread 0, its barrier included) at {meta['head']} ({meta['cpu']}, "
        f"{args.threads} threads, {args.rounds} interleaved rounds x {args.repeats})",
        "",
        f"| step | {head_cells} |" + (" n = max minus n = 1 |" if one else ""),
        "|---|" + "---:|" * (len(results) + (1 if one else 0)),
    ]
    for s in STEPS:
        cells = " | ".join(f"{r['step_us_per_layer'][s]:.1f}" for r in results)
        extra = f" {results[-1]['step_us_per_layer'][s] - one['step_us_per_layer'][s]:+.1f} |" if one else ""
        lines.append(f"| {s} | {cells} |{extra}")
    cells = " | ".join(f"{r['layers_ms']:.2f}" for r in results)
    lines.append(
        f"| **30 layers, ms** | {cells} |" + (f" {results[-1]['layers_ms'] - one['layers_ms']:+.2f} |" if one else "")
    )
    cells = " | ".join(f"{r['forward_ms']:.2f}" for r in results)
    lines.append(f"| forward with the LM head, wall ms (median) | {cells} |" + (" |" if one else ""))
    if any(r["attention_part_us_per_block"] for r in results):
        lines += [
            "",
            "Attention on tiles, µs per block of up to 16 (row, head) pairs (every thread's blocks):",
            "",
            f"| part | {head_cells} |",
            "|---|" + "---:|" * len(results),
        ]
        for p in PARTS:
            cells = " | ".join(
                f"{r['attention_part_us_per_block'][p]:.2f}" if r["attention_part_us_per_block"] else "-"
                for r in results
            )
            lines.append(f"| {p} | {cells} |")
        cells = " | ".join(f"{r['attention_blocks_per_layer']:.0f}" for r in results)
        lines.append(f"| blocks per layer | {cells} |")
    (out / "layer_phases.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {out / 'layer_phases.md'} and {out / 'layer_phases.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
