"""Verify-forward t(n) under several linear kernels and cache layouts, interleaved in one process.

One model is loaded once; each round switches every ``nn.Linear`` of it to each kernel in turn (in
an order rotated per round; the KV cache is the harness's default preallocated one, a kernel named
``KERNEL+dynamic`` also switches the model to transformers' DynamicCache,
``model.static_cache=false``, and ``KERNEL+fused`` runs the decoder layers as native calls,
``model.fused_layers=true``; every other variant runs transformers' layers) and times the backend's
own verify forward at each n with :func:`harness.target.timing.verify_times_by_shape`, as a chain
(the causal path) and as a branching tree (the masked path), the shapes of each n back to back.
Interleaving kernels within one process keeps this machine's drift between sittings out of the
comparison. Writes ``kernel_ab.md`` (median ms per kernel, shape and n, with t(n)/t(1) and each
kernel's ratio to the first) and ``kernel_ab.json`` into ``--out``.

    .venv/bin/python scripts/kernel_ab.py --out results/kernel_ab                      # SmolLM2, ~5 min
    .venv/bin/python scripts/kernel_ab.py --model tiny --rounds 1 --repeats 1 --out /tmp/ab  # smoke
    .venv/bin/python scripts/kernel_ab.py --kernels default default+dynamic --prefix-len 1024 --out results/cache_ab
    .venv/bin/python scripts/kernel_ab.py --kernels streaming streaming+fused --out results/fused_ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.proposers.base import NullProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.fused_layers import apply_fused_layers
from harness.target.loading import load_model
from harness.target.options import (
    LINEAR_KERNELS,
    apply_linear_kernel,
    apply_static_cache,
    fused_layers_problem,
    linear_kernel_of,
    linear_kernel_problem,
    static_cache_of,
)
from harness.target.timing import synthetic_prefix, verify_times_by_shape
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy

DYNAMIC = "+dynamic"
FUSED = "+fused"


def ar_decode_ms_per_token(backend: CausalLMBackend, prompt: list[int], tokens: int) -> float:
    """Decode ms per token of the harness's autoregressive round loop (no EOS), prefill excluded."""
    res = decode(
        target=backend,
        proposer=NullProposer(budget=Budget("sequence", 1, 1), manifest_hash="kernel_ab"),
        verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompt_ids=prompt,
        max_new_tokens=tokens,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=1, max_depth=1),
    )
    return res.decode_ms / len(res.tokens)


def variant(name: str) -> tuple[str, bool, bool]:
    """``KERNEL``, ``KERNEL+dynamic`` or ``KERNEL+fused`` -> (kernel, whether the cache is
    preallocated, whether the decoder layers run fused)."""
    kernel = name.removesuffix(DYNAMIC).removesuffix(FUSED)
    return kernel, not name.endswith(DYNAMIC), name.endswith(FUSED)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (embedded), tiny, or a checkpoint path / hub id")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=["default", "weight_major"],
        help=f"variants: a kernel of {list(LINEAR_KERNELS)}, optionally with {DYNAMIC} (transformers' "
        f"DynamicCache) or {FUSED} (fused decoder layers)",
    )
    ap.add_argument("--shapes", nargs="+", default=["chain", "heap"], choices=["chain", "heap"])
    ap.add_argument("--ns", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32], help="rows n (pending row included)")
    ap.add_argument("--prefix-len", type=int, default=256, help="cached prefix tokens")
    ap.add_argument("--rounds", type=int, default=3, help="kernel alternations")
    ap.add_argument("--repeats", type=int, default=3, help="timed forwards per size, kernel, shape and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--decode-tokens",
        type=int,
        default=0,
        help="also time the harness's autoregressive decode of this many tokens from the prefix, per variant "
        "and round (the cache grows by commits, as in a run)",
    )
    ap.add_argument("--out", required=True, help="folder for kernel_ab.md and kernel_ab.json")
    args = ap.parse_args(argv)
    if min(args.ns) < 1 or args.rounds < 1 or args.repeats < 1 or args.prefix_len < 1 or args.decode_tokens < 0:
        ap.error("--ns, --rounds, --repeats and --prefix-len must be >= 1, --decode-tokens >= 0")
    for name in args.kernels:
        kernel, preallocated, fused = variant(name)
        dtype = getattr(torch, args.dtype)
        problem = linear_kernel_problem(kernel, dtype, args.device) or (
            fused and fused_layers_problem(dtype, args.device, compiled=False, static_cache=preallocated)
        )
        if problem:
            ap.error(problem)
    torch.set_num_threads(args.threads)
    if args.model in ("smollm2", "tiny"):
        loaded = load_model(name=args.model, dtype=args.dtype, device=args.device)
    else:
        loaded = load_model(name="hf", name_or_path=args.model, dtype=args.dtype, device=args.device)
    backend = CausalLMBackend(loaded.model, device=args.device)
    prefix = synthetic_prefix(args.prefix_len + 1, backend.vocab_size)  # last token: the pending one
    samples: dict[str, dict[str, dict[int, list[float]]]] = {
        k: {s: {n: [] for n in sorted(set(args.ns))} for s in args.shapes} for k in args.kernels
    }
    decode_ms: dict[str, list[float]] = {k: [] for k in args.kernels}  # ms per decoded token, one per round
    resolved: dict[str, list[str]] = {}
    caches: dict[str, bool] = {}
    fused: dict[str, int] = {}  # decoder layers fused per variant
    steps = args.rounds * len(args.kernels) * (len(args.shapes) + bool(args.decode_tokens))
    with tqdm(total=steps, desc="kernel a/b", unit="cell", file=sys.stderr) as bar:
        for r in range(args.rounds):
            order = args.kernels[r % len(args.kernels) :] + args.kernels[: r % len(args.kernels)]
            for kernel in order:
                apply_linear_kernel(loaded.model, variant(kernel)[0])
                apply_static_cache(loaded.model, variant(kernel)[1])
                fused[kernel] = apply_fused_layers(loaded.model, variant(kernel)[2])
                resolved[kernel] = sorted(linear_kernel_of(loaded.model))
                caches[kernel] = static_cache_of(loaded.model)
                got = verify_times_by_shape(  # the shapes of each size back to back
                    backend, prefix_ids=prefix, ns=args.ns, shapes=args.shapes, warmup=1, repeats=args.repeats
                )
                for shape, by_n in got.items():
                    for n, v in by_n.items():
                        samples[kernel][shape][n].extend(v)
                    bar.update()
                if args.decode_tokens:
                    decode_ms[kernel].append(ar_decode_ms_per_token(backend, prefix, args.decode_tokens))
                    bar.update()
    medians = {
        k: {s: {n: statistics.median(v) for n, v in by_n.items()} for s, by_n in by_shape.items()}
        for k, by_shape in samples.items()
    }
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "prefix_len": args.prefix_len,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "kernels": {k: resolved[k] for k in args.kernels},
        "static_cache": {k: caches[k] for k in args.kernels},
        "fused_layers": {k: fused[k] for k in args.kernels},
        "torch": torch.__version__,
        "t_ms": {k: {s: {str(n): m for n, m in by_n.items()} for s, by_n in v.items()} for k, v in medians.items()},
        "decode_tokens": args.decode_tokens,
        "decode_ms_per_token": {k: statistics.median(v) for k, v in decode_ms.items() if v},
        "decode_ms_per_token_samples": {k: v for k, v in decode_ms.items() if v},
        "t_samples_ms": {
            k: {s: {str(n): x for n, x in by_n.items()} for s, by_n in v.items()} for k, v in samples.items()
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_ab.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "kernel_ab.md").write_text(markdown(result, medians, args))
    print((out / "kernel_ab.md").read_text())
    print(f"wrote {out / 'kernel_ab.md'} and {out / 'kernel_ab.json'}", file=sys.stderr)
    return 0


def markdown(result: dict, medians: dict, args) -> str:
    ns = sorted(set(args.ns))
    base = args.kernels[0]
    lines = [
        f"# Verify forward t(n) by linear kernel: {result['model']} {result['dtype']}, {result['device']}, "
        f"{result['threads']} threads, prefix {result['prefix_len']}, {result['rounds']} interleaved rounds x "
        f"{result['repeats']} repeats, median ms",
        "",
        "| kernel | shape | "
        + " | ".join(f"n={n}" for n in ns)
        + " | t(2)/t(1) | t(8)/t(1) | vs "
        + base
        + " (mean) |",
        "|---|---|" + "---:|" * (len(ns) + 3),
    ]
    for kernel in args.kernels:
        for shape in args.shapes:
            t = medians[kernel][shape]
            ratio = {n: f"{t[n] / t[min(ns)]:.2f}" if n in t else "n/a" for n in (2, 8)}
            vs = statistics.mean(t[n] / medians[base][shape][n] for n in ns)
            lines.append(
                f"| {kernel} | {shape} | "
                + " | ".join(f"{t[n]:.1f}" for n in ns)
                + f" | {ratio[2]} | {ratio[8]} | {vs:.2f} |"
            )
    if result["decode_ms_per_token"]:
        lines += [
            "",
            f"Autoregressive decode of {result['decode_tokens']} tokens from the prefix (the harness's round loop, "
            "median over rounds), ms per token:",
            "",
            "| variant | ms / token | vs " + base + " |",
            "|---|---:|---:|",
        ]
        ref = result["decode_ms_per_token"][base]
        for kernel in args.kernels:
            ms = result["decode_ms_per_token"][kernel]
            lines.append(f"| {kernel} | {ms:.1f} | {ms / ref:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
