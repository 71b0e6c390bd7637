"""How a prompt-lookup benchmark's ratio depends on the read bandwidth its prompts ran at.

    .venv/bin/python scripts/ratio_vs_bandwidth.py \\
        docs/measurements/pld_s1{0,1,2,4,5,6}/pld_float32_*.json \\
        --plot docs/measurements/pld_s17/ratio_vs_bandwidth.png --out docs/measurements/pld_s17/ratio_vs_bandwidth.json

Reads ``harness.bench.prompt_lookup_vs_hf`` result files. Each prompt's bandwidth is the one the
benchmark stored with it, or for files from before it stored one, the geometric mean of the
samples taken before and after the prompt. Per file: the rank correlation (Spearman, ties at
their mean rank) between a prompt's ratio (``--ratio``: the base's time per token over the arm's,
on that prompt) and its bandwidth, and the ratio over the prompts of the lower and of the upper
half of the bandwidth (:func:`harness.bench.prompt_lookup_vs_hf.ratio_by_bandwidth`, with their
intervals). Prints a table, writes it as JSON (``--out``) and plots every prompt's ratio against
its bandwidth, one panel per workload (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from harness.bench.prompt_lookup_vs_hf import prompt_bandwidths, ratio_by_bandwidth, ratio_estimates


def prompt_ratios(per_prompt: list[dict], arm: str, base: str) -> list[float]:
    """Each prompt's ratio: the base's decode ms per token over the arm's."""
    out = []
    for p in per_prompt:
        a, b = p["arms"][arm], p["arms"][base]
        out.append((b["decode_ms"] / max(b["tokens"], 1)) / (a["decode_ms"] / max(a["tokens"], 1)))
    return out


def ranks(v: list[float]) -> np.ndarray:
    """Ranks from 0, tied values sharing the mean of their ranks."""
    a = np.asarray(v, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(len(a))
    for value in np.unique(a):
        tied = a == value
        r[tied] = r[tied].mean()
    return r


def spearman(x: list[float], y: list[float]) -> float | None:
    """Rank correlation of ``x`` and ``y`` (ties at their mean rank); None where either is constant."""
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def summarise(path: Path, ratio: str) -> tuple[dict | None, str]:
    """One file's row of the table, or None and why the file has none."""
    result = json.loads(path.read_text())
    per_prompt = result.get("per_prompt") or []
    arm, base = ratio.split("_vs_")
    if not per_prompt or any(a not in per_prompt[0]["arms"] for a in (arm, base)):
        return None, f"not the arms of {ratio}"
    if all("read_bandwidth_gbs" in p for p in per_prompt):
        gbs = [p["read_bandwidth_gbs"] for p in per_prompt]
    elif len(result.get("read_bandwidth_gbs_samples") or []) == len(per_prompt) + 1:
        gbs = prompt_bandwidths(result["read_bandwidth_gbs_samples"], len(per_prompt))
    else:
        return None, "no per-prompt bandwidths"
    halves = ratio_by_bandwidth(per_prompt, gbs, pairs=[(arm, base)])
    if halves is None:
        return None, f"{len(per_prompt)} prompts, too few for two halves"
    ratios = prompt_ratios(per_prompt, arm, base)
    whole = ratio_estimates(per_prompt, pairs=[(arm, base)])[ratio]
    return {
        "file": str(path),
        "workload": result.get("workload"),
        "prompts": len(per_prompt),
        "ratio": whole["value"],
        "spearman": spearman(gbs, ratios),
        "split_gbs": halves["split_gbs"],
        **{h: {"gbs": halves[h]["gbs"], **halves[h]["ratios"][ratio]} for h in ("low", "high")},
        "per_prompt": [{"read_bandwidth_gbs": g, "ratio": r} for g, r in zip(gbs, ratios, strict=True)],
    }, ""


def run_name(file: str) -> str:
    """A result file's folder and name, the name without the ``.json``."""
    path = Path(file)
    return f"{path.parent.name}/{path.stem}"


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def plot(rows: list[dict], ratio: str, path: Path) -> None:
    from matplotlib.figure import Figure

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig = Figure(figsize=(4.2 * len(workloads), 3.6), layout="constrained")
    axes = fig.subplots(1, len(workloads), squeeze=False)[0]
    for ax, workload in zip(axes, workloads, strict=True):
        for r in (r for r in rows if r["workload"] == workload):
            x = [p["read_bandwidth_gbs"] for p in r["per_prompt"]]
            y = [p["ratio"] for p in r["per_prompt"]]
            rho = "n/a" if r["spearman"] is None else f"{r['spearman']:+.2f}"
            ax.scatter(x, y, s=10, alpha=0.7, label=f"{run_name(r['file'])} ({rho})")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")  # a prompt the lookup copies whole runs several times faster
        ax.set_title(workload)
        ax.set_xlabel("read bandwidth around the prompt (GB/s)")
        ax.set_ylabel(f"{ratio} on the prompt")
        ax.legend(fontsize=6, title="run (Spearman)", title_fontsize=6)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="prompt_lookup_vs_hf result files")
    ap.add_argument("--ratio", default="ours_adaptive_vs_hf_pld", help="<arm>_vs_<base>")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if "_vs_" not in args.ratio:
        ap.error(f"--ratio must read <arm>_vs_<base>; got {args.ratio!r}")
    missing = [str(p) for p in args.results if not p.is_file()]
    if missing:
        ap.error(f"no such result file: {', '.join(missing)}")
    rows, skipped = [], []
    for path in args.results:
        row, why = summarise(path, args.ratio)
        if row is None:
            skipped.append((path, why))
        else:
            rows.append(row)
    for path, why in skipped:
        print(f"skipped {path}: {why}", file=sys.stderr)
    if not rows:
        print(f"ratio_vs_bandwidth: no file has {args.ratio}'s arms and per-prompt bandwidths", file=sys.stderr)
        return 2
    print(f"| run | workload | prompts | {args.ratio} | Spearman | lower half | upper half |")
    print("|---|---|---:|---:|---:|---|---|")
    for r in rows:
        cells = [
            f"{fmt(r[h]['value'])}x ({fmt(r[h]['ci_low'])}-{fmt(r[h]['ci_high'])}) at "
            f"{r[h]['gbs'][0]:.0f}-{r[h]['gbs'][1]:.0f} GB/s"
            for h in ("low", "high")
        ]
        print(
            f"| {run_name(r['file'])} | {r['workload']} | {r['prompts']} | {fmt(r['ratio'])}x | "
            f"{fmt(r['spearman'], '+.2f')} | {cells[0]} | {cells[1]} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"ratio": args.ratio, "runs": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, args.ratio, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
