"""t(n) of one verify forward, chain vs branching tree, per attention implementation and prefix.

    .venv/bin/python scripts/verify_cost_table.py --out docs/measurements/verify_cost_table.json

For each attention implementation (transformers' stock ``sdpa`` with the harness's dense additive
mask, and ``harness_sdpa``, the harness's tree attention) the embedded SmolLM2 is loaded once; for
each prefix length the chain (the causal path, no mask) and the binary-heap tree of n rows (pending
row included) are timed by :func:`harness.target.timing.verify_times_by_shape` (chain and tree of
each size back to back, rotated order, warm-up excluded, median of ``--repeats``). Prints one
table per implementation: ms and tree/chain.
Run it with the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from harness.target.backend import CausalLMBackend
from harness.target.loading import load_model
from harness.target.timing import synthetic_prefix, verify_times_by_shape


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attn", nargs="+", default=["sdpa", "harness_sdpa"], choices=["sdpa", "harness_sdpa", "eager"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prefixes", nargs="+", type=int, default=[128, 256, 512, 1024])
    ap.add_argument("--ns", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for attn in args.attn:
        backend = CausalLMBackend(load_model(name="smollm2", dtype=args.dtype, attn_implementation=attn).model)
        for prefix_len in args.prefixes:
            prefix = synthetic_prefix(prefix_len + 1, backend.vocab_size)
            got = verify_times_by_shape(
                backend, prefix_ids=prefix, ns=args.ns, shapes=("chain", "heap"), repeats=args.repeats
            )
            med = {shape: {n: statistics.median(v) for n, v in by_n.items()} for shape, by_n in got.items()}
            for n in args.ns:
                row = {
                    "attn": attn,
                    "dtype": args.dtype,
                    "prefix": prefix_len,
                    "n": n,
                    "chain_ms": round(med["chain"][n], 2),
                    "tree_ms": round(med["heap"][n], 2),
                    "tree_over_chain": round(med["heap"][n] / med["chain"][n], 3),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        del backend
    for attn in args.attn:
        print(f"\n{attn} ({args.dtype}): tree/chain by prefix (rows) x n (columns)", file=sys.stderr)
        print("prefix " + " ".join(f"{n:>6}" for n in args.ns), file=sys.stderr)
        for p in args.prefixes:
            cells = [r["tree_over_chain"] for r in rows if r["attn"] == attn and r["prefix"] == p]
            print(f"{p:>6} " + " ".join(f"{c:>6.2f}" for c in cells), file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "threads": args.threads}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
