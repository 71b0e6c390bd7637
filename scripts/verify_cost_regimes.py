"""t(n) of the verify forward as the machine's read bandwidth swings: the cost curve of each state.

    .venv/bin/python scripts/verify_cost_regimes.py --seconds 300 --out-dir docs/measurements/pld_s17/regimes

Sets up the embedded SmolLM2 as the prompt-lookup benchmark does on this device (the linear kernel
``auto``, the preallocated cache, fused layers where they apply) and, for ``--seconds``, repeats a
sweep: one verify forward of every row count 1..``--max-rows`` + 1 over a real prefix (the first
``--prompts`` prompts of ``--workload``, joined), in an order rotated per sweep
(:func:`harness.target.timing.verify_times`), then one sample of the read bandwidth
(:func:`harness.target.timing.read_bandwidth_gbs`). On a shared machine the bandwidth moves between
states that last tens of seconds to minutes; a one-row forward streams the weights and follows it,
a forward of many rows is bound by arithmetic and does not, so the curve's shape, and what a
candidate row costs against an autoregressive step, depends on the state.

Writes ``sweeps.json`` (every sweep: seconds since the start, bandwidth, ms per row count) and, for
the sweeps at or below the bandwidth's lower quartile and at or above its upper quartile,
``low_bandwidth.json`` and ``high_bandwidth.json``: the median ms per row count made non-decreasing,
as ``t_of_n_ms`` (what ``scripts/lookup_replay.py replay --t-from`` reads), and
``cost_by_state.png``: each sweep's t(n) / t(1) against the bandwidth after it. Prints both curves. ``--sweeps
FILE`` analyses a saved ``sweeps.json`` again instead of measuring. Run it with the machine to
itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from harness.bench.prompt_lookup_vs_hf import WORKLOADS, bench_items
from harness.bench.target import default_cpu_target
from harness.target.timing import monotone_fit, read_bandwidth_gbs, verify_times


def state_curves(sweeps: list[dict], *, quantile: float = 0.25) -> dict[str, dict]:
    """``{"low_bandwidth": {...}, "high_bandwidth": {...}}``: per state, the sweeps at or below the
    bandwidth's ``quantile`` (at or above ``1 - quantile``), their bandwidth range, and the median
    ms per row count, made non-decreasing (``t_of_n_ms``) beside the raw medians."""
    if not sweeps:
        raise ValueError("no sweeps to split")
    gbs = np.array([s["read_bandwidth_gbs"] for s in sweeps])
    ms = np.array([s["ms"] for s in sweeps])  # [sweeps, rows]
    lo, hi = np.quantile(gbs, quantile), np.quantile(gbs, 1 - quantile)
    out = {}
    for name, pick in (("low_bandwidth", gbs <= lo), ("high_bandwidth", gbs >= hi)):
        med = np.median(ms[pick], axis=0)
        out[name] = {
            "sweeps": int(pick.sum()),
            "read_bandwidth_gbs": [float(gbs[pick].min()), float(gbs[pick].max())],
            "median_ms": med.tolist(),
            "t_of_n_ms": monotone_fit(med.tolist()),
        }
    return out


def plot_sweeps(sweeps: list[dict], path: Path, *, rows: tuple[int, ...] = (4, 6, 11, 17)) -> None:
    """Each sweep's t(n) / t(1), for a few row counts ``rows``, against the read bandwidth sampled
    right after it: how much more a forward of n rows costs than one row, by the machine's state.
    (Plotted against t(1) instead of the bandwidth, the ratio would fall with t(1)'s noise alone.)"""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.8), layout="constrained")
    ax = fig.subplots()
    gbs = [s["read_bandwidth_gbs"] for s in sweeps]
    for n in rows:
        if n <= len(sweeps[0]["ms"]):
            ax.scatter(gbs, [s["ms"][n - 1] / s["ms"][0] for s in sweeps], s=6, alpha=0.5, label=f"n = {n}")
    ax.set_xlabel("read bandwidth after the sweep, GB/s")
    ax.set_ylabel("t(n) / t(1), this sweep")
    ax.set_title("Verify forward cost by the machine's state")
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--max-rows", type=int, default=16, help="candidate rows (the pending row comes on top)")
    ap.add_argument("--workload", default="humaneval", choices=WORKLOADS)
    ap.add_argument("--prompts", type=int, default=2, help="prompts joined into the cached prefix")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--sweeps", type=Path, help="a sweeps.json to analyse again instead of measuring")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.max_rows < 1 or args.prompts < 1:
        ap.error("--seconds must be > 0, --max-rows >= 1 and --prompts >= 1")
    if args.sweeps is not None:
        if not args.sweeps.is_file():
            ap.error(f"no such sweeps file: {args.sweeps}")
        saved = json.loads(args.sweeps.read_text())
        meta = {k: v for k, v in saved.items() if k != "sweeps"}
        return report(saved["sweeps"], meta, args.out_dir)
    torch.set_num_threads(args.threads)
    loaded, backend = default_cpu_target(args.dtype)
    prefix = [
        t for _, ids in bench_items(args.workload, loaded.tokenizer, split="eval", limit=args.prompts) for t in ids
    ]
    ns = range(1, args.max_rows + 2)
    verify_times(backend, prefix_ids=prefix, ns=ns, warmup=0, repeats=1)  # warm-up, not kept
    sweeps = []
    t0 = time.perf_counter()
    with tqdm(total=round(args.seconds), unit="s", desc="sweeps", file=sys.stderr, mininterval=5) as bar:
        while (elapsed := time.perf_counter() - t0) < args.seconds:
            samples = verify_times(backend, prefix_ids=prefix, ns=ns, warmup=0, repeats=1, rotation=len(sweeps))
            gbs = read_bandwidth_gbs(backend.device, repeats=1)
            sweeps.append({"seconds": elapsed, "read_bandwidth_gbs": gbs, "ms": [samples[n][0] for n in ns]})
            bar.update(min(round(time.perf_counter() - t0), round(args.seconds)) - bar.n)
    meta = {"prefix_len": len(prefix), "workload": args.workload, "dtype": args.dtype, "threads": args.threads}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "sweeps.json").write_text(json.dumps({**meta, "sweeps": sweeps}, indent=1) + "\n")
    return report(sweeps, meta, args.out_dir)


def report(sweeps: list[dict], meta: dict, out_dir: Path) -> int:
    """Write the two states' curves and the plot under ``out_dir``, and print the curves."""
    curves = state_curves(sweeps)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, curve in curves.items():
        (out_dir / f"{name}.json").write_text(json.dumps({**meta, **curve}, indent=2) + "\n")
    plot_sweeps(sweeps, out_dir / "cost_by_state.png")
    print(
        f"{len(sweeps)} sweeps over a {meta['prefix_len']}-token prefix; read bandwidth median "
        f"{statistics.median(s['read_bandwidth_gbs'] for s in sweeps):.1f} GB/s"
    )
    low, high = curves["low_bandwidth"], curves["high_bandwidth"]
    print(
        f"rows  low ({low['read_bandwidth_gbs'][0]:.0f}-{low['read_bandwidth_gbs'][1]:.0f} GB/s)  t/t(1)   "
        f"high ({high['read_bandwidth_gbs'][0]:.0f}-{high['read_bandwidth_gbs'][1]:.0f} GB/s)  t/t(1)"
    )
    for i in range(len(low["t_of_n_ms"])):
        n = i + 1
        a, b = low["t_of_n_ms"][i], high["t_of_n_ms"][i]
        print(f"{n:>4}  {a:>17.2f}  {a / low['t_of_n_ms'][0]:>6.2f}   {b:>18.2f}  {b / high['t_of_n_ms'][0]:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
