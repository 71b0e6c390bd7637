"""t(n) of the verify forward against its roofline: how near each row count is to what the machine allows.

    .venv/bin/python scripts/verify_roofline.py --dtype float32 --out docs/measurements/intel_amx/roofline/fp32
    .venv/bin/python scripts/verify_roofline.py --dtype bfloat16 --out docs/measurements/intel_amx/roofline/bf16
    .venv/bin/python scripts/verify_roofline.py --model tiny --rows 1 4 --rounds 1 --out /tmp/rl  # smoke

Sets the model up as the prompt-lookup benchmark does on CPU (the linear kernel ``auto``, the
preallocated cache, fused decoder layers where they apply) and, for ``--rounds`` rounds, samples the
read bandwidth (:func:`harness.target.timing.read_bandwidth_gbs`), the rate of torch's large matrix
product in the model's dtype (:func:`harness.target.timing.matmul_peak_gflops`), and one verify
forward of every row count, as a chain and as a binary-heap tree back to back (``--repeats`` each,
in a rotated order: :func:`harness.target.timing.verify_times_by_shape`), over a ``--prefix``-token
cached prefix. Each row count's median, per shape, is set against
the forward's roofline floor at the medians of the bandwidth and rate samples
(:func:`harness.target.timing.verify_roofline`: the larger of reading the weights once and the
forward's least arithmetic). Writes ``roofline.json``, ``roofline.md`` (the table) and
``roofline.png`` (t(n) and both floors against n). Run it with the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from harness.bench.prompt_lookup_vs_hf import at_least
from harness.bench.target import apply_default_cpu_options
from harness.measure.hardware import cpu_name
from harness.target.backend import CausalLMBackend
from harness.target.loading import load_model
from harness.target.timing import (
    TIMING_SHAPES,
    matmul_peak,
    read_bandwidth_gbs,
    synthetic_prefix,
    verify_roofline,
    verify_times_by_shape,
)

ROWS = (1, 2, 4, 8, 12, 16, 17, 24, 32, 33, 48, 64)


def table(result: dict) -> str:
    """The markdown table of a result: per row count, each shape's ms and floors taken, and the two floors."""
    roof = result["shapes"]["chain"]
    head = (
        f"# Verify forward against its roofline: {result['model']}, {result['dtype']}, prefix {result['prefix']}, "
        f"{result['threads']} threads ({result['cpu']})\n\n"
        f"Read bandwidth {roof['read_bandwidth_gbs']:.1f} GB/s (samples {result['bandwidth_range'][0]:.1f}-"
        f"{result['bandwidth_range'][1]:.1f}), matrix-product rate {roof['matmul_peak_gflops']:.0f} GFLOP/s (samples "
        f"{result['peak_range'][0]:.0f}-{result['peak_range'][1]:.0f}); weights read once: "
        f"{roof['weight_stream_floor_ms']:.2f} ms; the arithmetic exceeds it from "
        f"{roof['compute_bound_from']} rows.\n\n"
        "| n | chain ms | tree ms | arithmetic floor ms | floor ms | chain / floor | tree / floor "
        "| chain t(n) / t(1) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    tree = result["shapes"]["heap"]
    lines = [
        f"| {n} | {c:.2f} | {t:.2f} | {a:.2f} | {f:.2f} | {cr:.2f} | {tr:.2f} | {c / roof['t_ms'][0]:.2f} |"
        for n, c, t, a, f, cr, tr in zip(
            roof["rows"],
            roof["t_ms"],
            tree["t_ms"],
            roof["compute_floor_ms"],
            roof["floor_ms"],
            roof["t_vs_floor"],
            tree["t_vs_floor"],
            strict=True,
        )
    ]
    return head + "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """t(n) of both shapes, the weights' reading floor and the arithmetic floor against n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof = result["shapes"]["chain"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(roof["rows"], roof["t_ms"], "o-", label="chain t(n)")
    ax.plot(roof["rows"], result["shapes"]["heap"]["t_ms"], "s--", label="tree t(n)")
    ax.plot(roof["rows"], [roof["weight_stream_floor_ms"]] * len(roof["rows"]), ":", label="weights read once")
    ax.plot(roof["rows"], roof["compute_floor_ms"], "-.", label="least arithmetic at the product rate")
    ax.set_xlabel("rows n (pending row included)")
    ax.set_ylabel("ms per forward")
    ax.set_title(f"{result['model']} {result['dtype']}, prefix {result['prefix']}, {result['threads']} threads")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", nargs="+", type=at_least(1), default=list(ROWS))
    ap.add_argument("--prefix", type=at_least(1), default=256, help="cached tokens before the rows")
    ap.add_argument("--rounds", type=at_least(1), default=7, help="rounds over every row count and shape")
    ap.add_argument("--repeats", type=at_least(1), default=1, help="forwards per row count, shape and round")
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument("--out", required=True, help="folder for roofline.json, roofline.md and roofline.png")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(name=args.model, dtype=args.dtype, attn_implementation="harness_sdpa")
    backend = CausalLMBackend(apply_default_cpu_options(loaded.model))
    prefix = synthetic_prefix(args.prefix + 1, backend.vocab_size)
    ns = sorted(set(args.rows))
    samples = {shape: {n: [] for n in ns} for shape in TIMING_SHAPES}
    bandwidths, peaks = [], []
    for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        bandwidths.append(read_bandwidth_gbs())
        peak = matmul_peak("cpu", dtype)
        peaks.append(peak["gflops"])
        got = verify_times_by_shape(  # chain and tree of each size back to back
            backend, prefix_ids=prefix, ns=ns, shapes=TIMING_SHAPES, warmup=1 if r == 0 else 0, repeats=args.repeats
        )
        for shape, by_n in got.items():
            for n, v in by_n.items():
                samples[shape][n].extend(v)
    bandwidth = statistics.median(bandwidths)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "prefix": args.prefix,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "rounds": args.rounds,
        "bandwidth_samples_gbs": bandwidths,
        "peak_samples_gflops": peaks,
        "bandwidth_range": [min(bandwidths), max(bandwidths)],
        "peak_range": [min(peaks), max(peaks)],
        "samples_ms": {shape: {str(n): v for n, v in s.items()} for shape, s in samples.items()},
        "shapes": {
            shape: verify_roofline(
                backend.model,
                {n: statistics.median(v) for n, v in s.items()},
                prefix_len=args.prefix,
                bandwidth_gbs=bandwidth,
                peak_gflops=statistics.median(peaks),
                peak_size=peak["size"],
            )
            for shape, s in samples.items()
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline.json").write_text(json.dumps(result, indent=2))
    text = table(result)
    (out / "roofline.md").write_text(text)
    plot(result, out / "roofline.png")
    print(text)
    print(f"wrote {out / 'roofline.md'}, {out / 'roofline.json'} and {out / 'roofline.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
