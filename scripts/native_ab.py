"""The native kernels of this checkout against those of an earlier revision, interleaved in one process.

The kernel source at ``--base`` (any git revision) is built under its own op namespace beside this
checkout's, and both compute SmolLM2's decoder stack the way a verify forward does: every layer's
``llama_layer`` on ``n`` rows over a cached prefix, then the LM head's ``streaming_linear``, on the
same weights and inputs. Each round times both in an order that alternates, so this machine's drift
between sittings stays out of the ratio; both builds' outputs are compared as well (bit-identical
when a change only reorganises the computation). Writes ``native_ab.md`` and ``native_ab.json``
into ``--out``.

    .venv/bin/python scripts/native_ab.py --base ff56a4b --out results/native_ab            # ~3 min
    .venv/bin/python scripts/native_ab.py --base HEAD~1 --dtype bfloat16 --rows 1 8 --out /tmp/ab
    .venv/bin/python scripts/native_ab.py --base HEAD~1 --panels --out /tmp/ab   # float32 weights in panels
    .venv/bin/python scripts/native_ab.py --base HEAD~1 --dtype bfloat16 --panels --rows 1 32 --out /tmp/ab

With ``--panels`` both builds read every product's weight packed as ``model.linear_kernel=
streaming_panels`` packs it (float32 in panels, bfloat16 in pairs), so the base revision must know
that layout. Where a row count 1 is measured, the table gives each build's t(n) / t(1) as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from harness.measure.hardware import cpu_capability, cpu_name
from harness.target import native
from harness.target.fused_layers import _parameters
from harness.target.loading import load_model
from harness.target.options import weight_panels

#: the largest relative error a build's product may show against the float64 reference (float32
#: accumulation; bfloat16 also rounds its outputs)
PRODUCT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}

REPO_ROOT = Path(__file__).resolve().parents[1]  # git reads this checkout, wherever the script runs from


def build_at(revision: str, out_dir: Path) -> Path:
    """The kernel library of ``revision``'s source, under the op namespace ``harness_base``."""
    rel = native.SOURCE.relative_to(REPO_ROOT)
    text = subprocess.run(
        ["git", "show", f"{revision}:{rel}"], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    ).stdout
    source = out_dir / "cpu_decode_base.cpp"
    source.write_text(text)
    here = native.SOURCE
    native.SOURCE = source
    try:
        return native.build(namespace="harness_base", out_dir=out_dir)
    finally:
        native.SOURCE = here


def stack_inputs(
    model: torch.nn.Module, rows: int, prefix: int, dtype: torch.dtype, seed: int, panels: bool = False
) -> list[list]:
    """Per layer: ``llama_layer``'s arguments for ``rows`` new rows after ``prefix`` cached ones (the
    products' weights in panels with ``panels``)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    dh = cfg.head_dim
    out = []
    for layer in model.model.layers:
        weights, biases = _parameters(layer)
        if panels:
            weights = [w if w.dim() == 1 else weight_panels(w) for w in weights]
        cache = [torch.randn(1, cfg.num_key_value_heads, prefix + rows, dh, generator=g).to(dtype) for _ in range(2)]
        hidden, angles = torch.randn(1, rows, cfg.hidden_size, generator=g), torch.randn(1, rows, dh, generator=g)
        out.append([hidden.to(dtype), angles.cos().to(dtype), angles.sin().to(dtype), None, *cache, prefix])
        out[-1] += [weights, biases, 1e-5, 1e-5, dh**-0.5]
    return out


def run_stack(namespace: str, layers: list[list], head: torch.Tensor) -> tuple[float, torch.Tensor]:
    """ms of the whole stack and the LM head, and the logits."""
    ops = getattr(torch.ops, namespace)
    t0 = time.perf_counter()
    hidden = None
    for args in layers:
        hidden = ops.llama_layer(*args)
    logits = ops.streaming_linear(hidden[0], head, None)
    return (time.perf_counter() - t0) * 1e3, logits


def product_error_of(
    namespace: str, rows: int, weight: torch.Tensor, dtype: torch.dtype, seed: int, panels: bool = False
) -> float:
    """The largest error, relative to the largest reference value, of the build's product of ``rows``
    random rows with ``weight`` (read in panels with ``panels``) against a float64 reference: a check
    of each build that does not depend on the other one."""
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed)).to(dtype)
    got = getattr(torch.ops, namespace).streaming_linear(x, weight_panels(weight) if panels else weight, None).double()
    ref = x.double() @ weight.double().T
    return float((got - ref).abs().max() / ref.abs().max())


def _outputs(result: dict) -> str:
    worst = max(result.get("product_error", {}).values(), default=0.0)
    if not worst <= PRODUCT_TOLERANCE[result.get("dtype", "float32")]:
        return f"WRONG PRODUCT (relative error {worst:.2g})"
    return "identical" if result["identical"] else f"max diff {result['max_abs_diff']:.2g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose kernel source is the baseline")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--panels",
        action="store_true",
        help="weights packed as streaming_panels packs them (float32 panels, bf16 pairs)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.rounds < 2 or min(args.rows) < 1 or min(args.prefixes) < 1:
        ap.error("--rounds must be >= 2, --rows and --prefixes >= 1")
    if argv is None and os.environ.get("MALLOC_PERTURB_") is None:
        # glibc fills every allocation with a pattern: an op that leaves its output unwritten cannot
        # pass the bit comparison below by reading the base build's freed result from reused memory
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_PERTURB_": "165"})
    torch.set_num_threads(args.threads)
    native.load_native_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            library = build_at(args.base, Path(tmp))
        except subprocess.CalledProcessError as exc:
            ap.error(f"cannot read the kernel source at {args.base!r}: {exc.stderr.strip().splitlines()[-1]}")
        torch.ops.load_library(str(library))
    dtype = getattr(torch, args.dtype)
    model = load_model(name="smollm2", dtype=args.dtype).model
    head = model.lm_head.weight
    head_read = weight_panels(head) if args.panels else head
    cases = [(p, r) for p in args.prefixes for r in args.rows]
    results = []
    for prefix, rows in tqdm(cases, desc="native a/b", file=sys.stderr):
        layers = stack_inputs(model, rows, prefix, dtype, seed=rows, panels=args.panels)
        samples: dict[str, list[float]] = {"harness_base": [], "harness": []}
        outputs = {}
        for r in range(args.rounds):
            for ns in ("harness_base", "harness") if r % 2 == 0 else ("harness", "harness_base"):
                ms, outputs[ns] = run_stack(ns, layers, head_read)
                samples[ns].append(ms)
        ratios = sorted(b / a for a, b in zip(samples["harness_base"], samples["harness"]))
        product_error = {ns: product_error_of(ns, rows, head, dtype, seed=rows, panels=args.panels) for ns in samples}
        results.append(
            {
                "prefix": prefix,
                "rows": rows,
                "base_ms": statistics.median(samples["harness_base"]),
                "this_ms": statistics.median(samples["harness"]),
                "ratio_median": statistics.median(ratios),
                "identical": bool(torch.equal(outputs["harness_base"], outputs["harness"])),
                "max_abs_diff": float((outputs["harness_base"].float() - outputs["harness"].float()).abs().max()),
                "product_error": product_error,
                "dtype": args.dtype,
                "samples": samples,
            }
        )
    meta = {
        "base": args.base,
        "head": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT
        ).stdout.strip(),
        "dtype": args.dtype,
        "cpu": cpu_name(),
        "cpu_capability": cpu_capability(),
        "threads": args.threads,
        "rounds": args.rounds,
        "float32_width": native.float32_width(),
        "panels": args.panels,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "native_ab.json").write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    one_row = {r["prefix"]: r for r in results if r["rows"] == 1}

    def per_row(r: dict, key: str) -> str:  # t(n) / t(1) at the same prefix, where t(1) was measured
        return f"{r[key] / one_row[r['prefix']][key]:.2f}" if r["prefix"] in one_row else "-"

    lines = [
        f"# SmolLM2's layers and LM head, {args.dtype}{', weights packed' if args.panels else ''}: kernels at "
        f"{meta['head']} against {args.base} "
        f"({meta['cpu']}, {args.threads} threads, {args.rounds} alternating rounds, medians)",
        "",
        "| prefix | rows | base ms | this ms | this / base | base t(n) / t(1) | this t(n) / t(1) | outputs |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        *(
            f"| {r['prefix']} | {r['rows']} | {r['base_ms']:.1f} | {r['this_ms']:.1f} | {r['ratio_median']:.2f} | "
            f"{per_row(r, 'base_ms')} | {per_row(r, 'this_ms')} | {_outputs(r)} |"
            for r in results
        ),
    ]
    (out / "native_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
