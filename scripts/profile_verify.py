"""Per-operator profile of the target's verify forward at n rows: where t(n)/t(1) comes from.

For each dtype and each tree shape, the verify forward of ``n`` rows (the pending row included, as
in every t(n) of the harness) over a cached prefix is run through the harness's own
``CausalLMBackend.verify`` (the code the runs use):

- ``chain``: the candidate rows form one chain, so the backend takes transformers' causal path (no
  explicit mask);
- ``heap``: a branching tree (a binary heap of rows), so the backend builds the ancestor mask (the
  masked path). ``n = 1`` has no candidates and runs the causal path under both shapes; ``n = 2``
  under ``heap`` is two siblings.

Wall time: :func:`harness.target.timing.verify_times` (sizes rotated per round, one warm-up round,
median of ``--repeats``). Operators: one ``torch.profiler`` pass of ``--repeats`` forwards per cell
(CPU activity; CUDA activity too on a CUDA device), each operator's self time divided by the
forwards. The profiler's own overhead inflates per-operator times a little; t(n) comes from the
unprofiled pass. Writes ``profile_verify.md`` (top operators by self time per n, then t(n) and
t(n)/t(1)) and ``profile_verify.json`` into ``--out``.

    .venv/bin/python scripts/profile_verify.py --out results/profile_verify           # SmolLM2, ~3-6 min
    .venv/bin/python scripts/profile_verify.py --model tiny --ns 1 2 --repeats 2 --out /tmp/pv  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from harness.measure.ledger import StageClock
from harness.target.backend import CausalLMBackend
from harness.target.loading import load_model
from harness.target.options import (
    LINEAR_KERNELS,
    apply_linear_kernel,
    compile_model,
    linear_kernel_of,
    linear_kernel_problem,
)
from harness.target.timing import TIMING_SHAPES, synthetic_prefix, timed_verify_ms, timing_tree, verify_times


def load(args):
    """The target as the runner loads it: ``smollm2`` (embedded), ``tiny``, or a checkpoint path/hub id."""
    if args.model in ("smollm2", "tiny"):
        return load_model(name=args.model, dtype=args.dtype_now, device=args.device, attn_implementation=args.attn)
    return load_model(
        name="hf", name_or_path=args.model, dtype=args.dtype_now, device=args.device, attn_implementation=args.attn
    )


@torch.inference_mode()
def profile_cell(backend: CausalLMBackend, state, prefix: list[int], n: int, shape: str, repeats: int) -> list[dict]:
    """Operators of ``repeats`` verify forwards of ``n`` rows, self time per forward (ms)."""
    tree = timing_tree(n - 1, prefix_len=len(prefix), vocab=backend.vocab_size, shape=shape)
    clock = StageClock(backend.device)
    timed_verify_ms(backend, state, pending=prefix[-1], tree=tree, clock=clock)  # warm (untimed)
    activities = [ProfilerActivity.CPU]
    if backend.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            timed_verify_ms(backend, state, pending=prefix[-1], tree=tree, clock=clock)
    ops = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0.0)
        ops.append(
            {
                "op": e.key,
                "self_cpu_ms": e.self_cpu_time_total / 1e3 / repeats,
                "self_device_ms": float(device_us or 0.0) / 1e3 / repeats,
                "calls": e.count / repeats,
            }
        )
    key = "self_device_ms" if backend.device.type == "cuda" else "self_cpu_ms"
    return sorted(ops, key=lambda o: -o[key])


def markdown(result: dict, top: int) -> str:
    dev = result["device"]
    key = "self_device_ms" if dev.startswith("cuda") else "self_cpu_ms"
    lines = [
        f"# Verify forward profile: {result['model']}, {dev}, {result['threads']} threads, "
        f"prefix {result['prefix_len']} cached tokens, median of {result['repeats']}, "
        f"linear kernel {result['linear_kernel']}{', compiled' if result['compile'] else ''}",
        "",
        f"Operator rows: {key.replace('_', ' ')} per forward (ms), profiled pass. t(n): unprofiled wall ms.",
    ]
    for cell in result["cells"]:
        ns = [int(n) for n in cell["t_ms"]]
        names: list[str] = []
        for n in ns:
            for o in cell["ops"][str(n)][:top]:
                if o["op"] not in names:
                    names.append(o["op"])
        lines += [
            "",
            f"## {cell['dtype']}, {cell['shape']} ({cell['path']}), linear kernel {', '.join(cell['linear_kernel'])}",
            "",
            "| operator | " + " | ".join(f"n={n}" for n in ns) + " |",
            "|---|" + "---:|" * len(ns),
        ]
        for name in names:
            vals = []
            for n in ns:
                o = next((o for o in cell["ops"][str(n)] if o["op"] == name), None)
                vals.append("" if o is None else f"{o[key]:.2f}")
            lines.append(f"| `{name}` | " + " | ".join(vals) + " |")
        t1 = cell["t_ms"][str(ns[0])]
        lines.append("| **t(n) ms** | " + " | ".join(f"**{cell['t_ms'][str(n)]:.2f}**" for n in ns) + " |")
        lines.append("| **t(n)/t(1)** | " + " | ".join(f"**{cell['t_ms'][str(n)] / t1:.2f}**" for n in ns) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (embedded), tiny, or a checkpoint path / hub id")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--shapes", nargs="+", default=list(TIMING_SHAPES), choices=TIMING_SHAPES)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="rows n (pending row included)")
    ap.add_argument("--prefix-len", type=int, default=256, help="cached prefix tokens")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "harness_sdpa", "eager"])
    ap.add_argument("--linear-kernel", default="auto", choices=LINEAR_KERNELS)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model's forward (model.compile)")
    ap.add_argument("--top", type=int, default=8, help="operators shown per n (the union over n is tabled)")
    ap.add_argument("--out", required=True, help="folder for profile_verify.md and profile_verify.json")
    args = ap.parse_args(argv)
    if min(args.ns) < 1 or args.repeats < 1 or args.prefix_len < 1:
        ap.error("--ns, --repeats and --prefix-len must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch has no CUDA device")
    for dtype in args.dtypes:
        problem = linear_kernel_problem(args.linear_kernel, getattr(torch, dtype), args.device)
        if problem:
            ap.error(problem)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    cells = []
    for dtype in args.dtypes:
        args.dtype_now = dtype
        loaded = load(args)
        apply_linear_kernel(loaded.model, args.linear_kernel)
        if args.compile:
            compile_model(loaded.model)
        backend = CausalLMBackend(loaded.model, device=args.device)
        prefix = synthetic_prefix(args.prefix_len + 1, backend.vocab_size)  # last token: the pending one
        state = backend.prefill([prefix])
        for shape in args.shapes:
            print(f"{dtype} {shape}: timing n={args.ns}", file=sys.stderr)
            samples = verify_times(backend, prefix_ids=prefix, ns=args.ns, shape=shape, warmup=1, repeats=args.repeats)
            ops = {}
            for n in sorted(set(args.ns)):
                ops[str(n)] = profile_cell(backend, state, prefix, n, shape, args.repeats)
            cells.append(
                {
                    "dtype": dtype,
                    "linear_kernel": sorted(linear_kernel_of(loaded.model)),
                    "shape": shape,
                    "path": "causal path, no mask" if shape == "chain" else "ancestor mask for n >= 2",
                    "t_samples_ms": {str(n): v for n, v in samples.items()},
                    "t_ms": {str(n): statistics.median(v) for n, v in samples.items()},
                    "ops": ops,
                }
            )
        del backend, loaded, state
    result = {
        "model": args.model,
        "device": args.device,
        "attn": args.attn,
        "linear_kernel": args.linear_kernel,
        "compile": args.compile,
        "threads": torch.get_num_threads(),
        "prefix_len": args.prefix_len,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "cells": cells,
    }
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(result, args.top)
    (out / "profile_verify.md").write_text(text)
    (out / "profile_verify.json").write_text(json.dumps(result, indent=2))
    print(text)
    print(f"wrote {out / 'profile_verify.md'} and {out / 'profile_verify.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
