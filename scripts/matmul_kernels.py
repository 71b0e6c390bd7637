"""Candidate CPU kernels for SmolLM2's linear layers at small row counts, next to the weight-streaming floor.

A verify forward of ``m`` rows is, on this CPU, mostly ``m x K`` by ``K x N`` products with
``m <= 32``: memory-bound (the weights are read once whatever ``m`` is), so ideally ``t(m) ~ t(1)``.
This script times, per shape, row count and dtype, each kernel that computes ``x @ W.T``:

- ``linear``: ``F.linear(x, W)`` (the default; MKL sgemm for float32 on x86);
- ``pretransposed``: ``x @ Wt`` with ``Wt = W.t().contiguous()`` made once;
- ``matvec``: ``m`` separate one-row ``F.linear`` calls, concatenated;
- ``onednn``: an ``nn.Linear`` converted by ``torch.utils.mkldnn.to_mkldnn`` (oneDNN inner product;
  the input's conversion to and from oneDNN's layout is inside the time);
- ``onednn_dense``: ``torch.ops.mkldnn._linear_pointwise`` on dense tensors (oneDNN, no conversion);
- ``linear_1t``: ``F.linear`` with torch's threads set to one around the call (is it the threading?);
- ``mkl_packed``: MKL's packed sgemm (``torch.ops.mkl._mkl_linear`` with the weight packed once by
  ``_mkl_reorder_linear_weight``; what the inductor uses for float32 linear layers on CPU).

A kernel this build or CPU cannot run shows ``n/a`` (bfloat16 oneDNN inner products need AVX-512).
``max abs diff`` is the largest absolute difference from the float64 product over all cells of that
kernel (the weights are scaled so outputs are O(1); float32 rounding gives ~1e-6). ``floor`` is the
weight bytes over this process's measured read bandwidth
(:func:`harness.target.timing.read_bandwidth_gbs`).

Environment switches that steer MKL are read when the library loads, so ``--env`` runs the MKL
kernels again in a child process per setting, e.g. ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (caps MKL's
code path; documented by oneMKL's developer guide) or ``MKL_DEBUG_CPU_TYPE=5`` (the old switch that
made MKL take its AVX2 path on AMD CPUs; ignored by MKL 2020.1 and later, kept to show it).

``--fake-intel`` (on by default; ``--no-fake-intel`` to skip) reruns the MKL kernels with
``LD_PRELOAD`` of a one-function library, built here with the C compiler, whose
``mkl_serv_intel_cpu_true`` returns 1: MKL (through 2024) picks its kernels by CPU vendor and gives
non-Intel CPUs SSE kernels where it has no Zen kernel (sgemm among them), and torch's wheel links
MKL with that function resolved through the PLT, so the preload reaches it. If the step from m=1 to
m=2 disappears under it, MKL's vendor dispatch is the cause.

    .venv/bin/python scripts/matmul_kernels.py --out results/kernels            # ~5 min, 2 threads
    .venv/bin/python scripts/matmul_kernels.py --m 1 2 --dtypes float32 --budget-s 0.02  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.target.timing import read_bandwidth_gbs

#: (name, in_features K, out_features N) of SmolLM2-135M's linear layers
SHAPES = (
    ("q/o 576->576", 576, 576),
    ("k/v 576->192", 576, 192),
    ("gate/up 576->1536", 576, 1536),
    ("down 1536->576", 1536, 576),
    ("lm_head 576->49152", 576, 49152),
)
KERNELS = ("linear", "pretransposed", "matvec", "linear_1t", "onednn", "onednn_dense", "mkl_packed")
MKL_KERNELS = ("linear", "pretransposed", "linear_1t", "mkl_packed")
FAKE_INTEL_C = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
DEFAULT_ENVS = ("MKL_ENABLE_INSTRUCTIONS=AVX2", "MKL_DEBUG_CPU_TYPE=5")


def build_kernel(name: str, w: torch.Tensor):
    """A callable ``x [m, K] -> [m, N]`` for kernel ``name`` over weight ``w [N, K]`` (prepared once)."""
    if name == "linear":
        return lambda x: F.linear(x, w)
    if name == "pretransposed":
        wt = w.t().contiguous()  # [K, N]
        return lambda x: x @ wt
    if name == "matvec":
        return lambda x: torch.cat([F.linear(x[i : i + 1], w) for i in range(x.shape[0])])
    if name == "linear_1t":

        def one_thread(x):
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return F.linear(x, w)
            finally:
                torch.set_num_threads(threads)

        return one_thread
    if name == "onednn":
        from torch.utils import mkldnn as mkldnn_utils

        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        lin.weight.data = w.clone()
        lin.requires_grad_(False)
        mod = mkldnn_utils.to_mkldnn(lin, dtype=w.dtype)
        return lambda x: mod(x)
    if name == "onednn_dense":
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    if name == "mkl_packed":
        if w.dtype != torch.float32:
            raise RuntimeError("MKL's packed sgemm is float32 only")
        # the batch size the packing is tuned for; any m runs
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, x.shape[0])
    raise ValueError(f"unknown kernel {name!r}")


def fake_intel_library() -> str | None:
    """Build (once per temp folder) the one-function stub library; its path, or None without a compiler."""
    import shutil
    import tempfile

    cc = next((shutil.which(c) for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    if cc is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="fake_intel_"))
    (folder / "fake_intel.c").write_text(FAKE_INTEL_C)
    lib = folder / "libfake_intel.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(folder / "fake_intel.c")], check=True)
    return str(lib)


def time_call(fn, x: torch.Tensor, *, budget_s: float, min_reps: int = 5, max_reps: int = 500) -> list[float]:
    """Per-call ms samples: two untimed calls, then calls until ``budget_s`` is spent (>= min_reps)."""
    fn(x)
    fn(x)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < max_reps and (len(samples) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn(x)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


@torch.inference_mode()
def measure(args) -> dict:
    names = [name for name, _, _ in SHAPES]
    unmatched = [s for s in args.shapes if not any(s in name for name in names)]
    if unmatched:
        raise SystemExit(
            f"matmul_kernels.py: --shapes {' '.join(unmatched)} matches no shape; the shapes: {', '.join(names)}"
        )
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bandwidth = read_bandwidth_gbs()
    cells = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for shape_name, k, n in SHAPES:
            if args.shapes and not any(s in shape_name for s in args.shapes):
                continue
            w = (torch.randn(n, k) / k**0.5).to(dtype)
            floor_ms = w.numel() * w.element_size() / (bandwidth * 1e9) * 1e3
            kernels = {}
            for kname in args.kernels:
                try:
                    kernels[kname] = build_kernel(kname, w)
                except Exception as exc:  # a kernel this build or CPU lacks
                    kernels[kname] = exc
            for m in args.m:
                x = torch.randn(m, k).to(dtype)
                ref = (x.double() @ w.double().t()).float()
                for kname, fn in kernels.items():
                    cell = {"dtype": dtype_name, "shape": shape_name, "K": k, "N": n, "m": m, "kernel": kname}
                    cell["floor_ms"] = floor_ms
                    if isinstance(fn, Exception):
                        cell["error"] = f"{type(fn).__name__}: {str(fn).splitlines()[0][:120]}"
                    else:
                        try:
                            y = fn(x)
                            cell["max_abs_diff"] = float((y.float() - ref).abs().max())
                            samples = time_call(fn, x, budget_s=args.budget_s)
                            cell["median_ms"] = statistics.median(samples)
                            cell["reps"] = len(samples)
                        except Exception as exc:
                            cell["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    cells.append(cell)
    return {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "read_bandwidth_gbs": bandwidth,
        "env": {
            k: os.environ[k]
            for k in sorted(os.environ)
            if k.startswith(("MKL_", "ONEDNN_", "DNNL_", "OMP_", "LD_PRELOAD"))
        },
        "cells": cells,
    }


def table(result: dict, label: str) -> str:
    """One markdown table: rows (dtype, shape, kernel), columns m; a cell is median ms, and the
    floor and max|diff| close each row."""
    cells = result["cells"]
    ms = sorted({c["m"] for c in cells})
    lines = [
        f"### {label}: {result['threads']} threads, read bandwidth {result['read_bandwidth_gbs']:.1f} GB/s",
        "",
        "| dtype | shape | kernel | " + " | ".join(f"m={m}" for m in ms) + " | floor ms | max abs diff |",
        "|---|---|---|" + "---:|" * len(ms) + "---:|---:|",
    ]
    keys = list(dict.fromkeys((c["dtype"], c["shape"], c["kernel"]) for c in cells))
    for key in keys:
        row = {c["m"]: c for c in cells if (c["dtype"], c["shape"], c["kernel"]) == key}
        any_cell = next(iter(row.values()))
        vals = []
        for m in ms:
            c = row.get(m)
            vals.append("" if c is None else ("n/a" if "error" in c else f"{c['median_ms']:.3f}"))
        diffs = [c["max_abs_diff"] for c in row.values() if "max_abs_diff" in c]
        err = next((c["error"] for c in row.values() if "error" in c), None)
        diff = f"{max(diffs):.1e}" if diffs else (err or "")
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(vals) + f" | {any_cell['floor_ms']:.3f} | {diff} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="row counts")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--shapes", nargs="*", default=[], help="substrings of shape names to keep (default all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=0.15, help="seconds of timed calls per cell (>= 5 calls)")
    ap.add_argument(
        "--env",
        nargs="*",
        default=list(DEFAULT_ENVS),
        help="NAME=VALUE settings, each rerunning the MKL kernels in a child process ('--env' alone: none)",
    )
    ap.add_argument("--fake-intel", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=None, help="folder for kernels.md and kernels.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for s in args.env:
        if "=" not in s or not s.split("=", 1)[0]:
            ap.error(f"--env takes NAME=VALUE settings; got {s!r}")
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    results = {"default": measure(args)}
    md = [table(results["default"], "default environment")]
    settings = [(s, dict([s.split("=", 1)])) for s in args.env]
    if args.fake_intel:
        stub = fake_intel_library()
        if stub is None:
            print("--fake-intel: no C compiler (cc/gcc) to build the stub; skipped", file=sys.stderr)
        else:
            settings.append(("LD_PRELOAD=mkl_serv_intel_cpu_true stub", {"LD_PRELOAD": stub}))
    kernels = [k for k in args.kernels if k in MKL_KERNELS]
    for setting, extra_env in settings if kernels else []:
        cmd = [sys.executable, __file__, "--child", "--env", "--threads", str(args.threads)]
        cmd += ["--budget-s", str(args.budget_s), "--m", *map(str, args.m), "--dtypes", *args.dtypes]
        cmd += ["--kernels", *kernels] + (["--shapes", *args.shapes] if args.shapes else [])
        proc = subprocess.run(cmd, env={**os.environ, **extra_env}, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"{setting}: child failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        results[setting] = json.loads(proc.stdout.strip().splitlines()[-1])
        md.append(table(results[setting], setting))
    text = "\n\n".join(md)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernels.md").write_text(text + "\n")
        (out / "kernels.json").write_text(json.dumps(results, indent=2))
        print(f"wrote {out / 'kernels.md'} and {out / 'kernels.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
