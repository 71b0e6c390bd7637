"""Where the autoregressive step's time goes, against the weight-streaming floor, in one process.

For the target as a run loads it (linear kernel, cache layout and attention as configured), each
round times, in turn:

- ``read``: the read bandwidth of this process (:func:`harness.target.timing.read_bandwidth_gbs`),
  and from it the floor, the weight bytes one step streams over that bandwidth;
- ``step``: one autoregressive step, the backend's verify forward of the pending row alone over a
  cached prefix (t(1), as every t(n) of the harness);
- ``products``: every ``nn.Linear`` of the model on one row, in the model's order and with its
  kernel: the matrix-vector products a step cannot avoid, streaming the same weights;
- ``skeleton``: the same step on the same architecture shrunk to a hidden size of 64 (two heads,
  a 256-token vocabulary, every layer kept): the same operators in the same number, doing almost
  no arithmetic, i.e. what the eager forward costs in dispatch and Python alone;
- ``step_per_layer`` (with ``--fused-layers``): the step with the decoder layers one native call
  each instead of the whole stack in one (:mod:`harness.target.fused_layers`), the same model
  switched back and forth between rounds.

What the step spends beyond ``products + skeleton`` is the arithmetic and memory traffic of the
rest at full width (attention over the prefix, norms, rotary embeddings, the cache append).
Writes ``ar_floor.md`` and ``ar_floor.json`` into ``--out``.

    .venv/bin/python scripts/ar_floor.py --out results/ar_floor                     # SmolLM2, ~1 min
    .venv/bin/python scripts/ar_floor.py --fused-layers --out results/ar_floor_fused
    .venv/bin/python scripts/ar_floor.py --model tiny --rounds 1 --repeats 2 --out /tmp/af  # smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from harness.measure.hardware import cpu_capability, cpu_name
from harness.target.backend import CausalLMBackend
from harness.target.fused_layers import apply_fused_layers, fused_layers_of, fused_stack_of
from harness.target.loading import load_model
from harness.target.options import (
    LINEAR_KERNELS,
    apply_linear_kernel,
    apply_static_cache,
    compile_model,
    compile_problem,
    fused_layers_problem,
    linear_kernel_of,
    linear_kernel_problem,
    static_cache_of,
)
from harness.target.timing import (
    read_bandwidth_gbs,
    streamed_weight_bytes,
    synthetic_prefix,
    verify_times,
    weight_stream_floor_ms,
)


def skeleton_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model's architecture with every layer kept but widths shrunk to almost nothing."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = 64, 128, 256
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 32
    small = AutoModelForCausalLM.from_config(cfg, attn_implementation=model.config._attn_implementation)
    return small.to(dtype=next(model.parameters()).dtype).eval()


@torch.inference_mode()
def products_ms(model: torch.nn.Module, repeats: int) -> float:
    """Median ms of every ``nn.Linear`` of ``model`` on one row, in module order."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    p = next(model.parameters())
    rows = {m.in_features: torch.randn(1, m.in_features, dtype=p.dtype, device=p.device) for m in linears}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m in linears:
            m(rows[m.in_features])
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (embedded), tiny, or a checkpoint path / hub id")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--linear-kernel", default="auto", choices=LINEAR_KERNELS)
    ap.add_argument("--static-cache", default="true", choices=["true", "false"])
    ap.add_argument("--fused-layers", action="store_true", help="decoder layers as native calls (model.fused_layers)")
    ap.add_argument("--attn", default="harness_sdpa", choices=["sdpa", "harness_sdpa", "eager"])
    ap.add_argument("--compile", action="store_true", help="torch.compile both models' forwards (model.compile)")
    ap.add_argument("--prefix-len", type=int, default=256, help="cached prefix tokens")
    ap.add_argument("--rounds", type=int, default=4, help="alternations of the four measurements")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per measurement and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="folder for ar_floor.md and ar_floor.json")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1 or args.prefix_len < 1:
        ap.error("--rounds, --repeats and --prefix-len must be >= 1")
    problem = linear_kernel_problem(args.linear_kernel, getattr(torch, args.dtype), "cpu")
    if problem:
        ap.error(problem)
    torch.set_num_threads(args.threads)
    name = args.model if args.model in ("smollm2", "tiny") else "hf"
    path = None if name != "hf" else args.model
    model = load_model(name=name, name_or_path=path, dtype=args.dtype, attn_implementation=args.attn).model
    skeleton = skeleton_of(model)
    if args.compile and compile_problem("cpu"):
        ap.error(compile_problem("cpu"))
    static = args.static_cache == "true"
    if args.fused_layers and (
        problem := fused_layers_problem(model.dtype, "cpu", compiled=args.compile, static_cache=static)
    ):
        ap.error(problem)
    for m in (model, skeleton):
        apply_linear_kernel(m, args.linear_kernel)
        apply_static_cache(m, static)
        apply_fused_layers(m, args.fused_layers)
        if args.compile:
            compile_model(m)
    backends = {"step": CausalLMBackend(model), "skeleton": CausalLMBackend(skeleton)}
    prefix = {k: synthetic_prefix(args.prefix_len + 1, b.vocab_size) for k, b in backends.items()}
    keys = ("read_gbs", "step", "products", "skeleton") + (("step_per_layer",) if args.fused_layers else ())
    samples: dict[str, list[float]] = {k: [] for k in keys}
    for k in ("step", "skeleton"):  # warm-up, untimed: a compiled model compiles here (each shape it meets)
        verify_times(backends[k], prefix_ids=prefix[k], ns=[1], warmup=2, repeats=1)
    products_ms(model, 1)
    with tqdm(total=args.rounds, desc="ar floor", unit="round", file=sys.stderr) as bar:
        for _ in range(args.rounds):
            samples["read_gbs"].append(read_bandwidth_gbs(repeats=args.repeats))
            for k in ("step", "skeleton"):
                got = verify_times(backends[k], prefix_ids=prefix[k], ns=[1], repeats=args.repeats)
                samples[k].extend(got[1])
            samples["products"].append(products_ms(model, args.repeats))
            if args.fused_layers:  # the same step, every layer its own native call
                apply_fused_layers(model, True, stack=False)
                got = verify_times(backends["step"], prefix_ids=prefix["step"], ns=[1], repeats=args.repeats)
                samples["step_per_layer"].extend(got[1])
                apply_fused_layers(model, True)
            bar.update()
    med = {k: statistics.median(v) for k, v in samples.items()}
    floor = weight_stream_floor_ms(model, med["read_gbs"])
    rest = med["step"] - med["products"] - med["skeleton"]
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "cpu": cpu_name(),
        "cpu_capability": cpu_capability(),
        "threads": torch.get_num_threads(),
        "linear_kernel": sorted(linear_kernel_of(model)),
        "static_cache": static_cache_of(model),
        "compile": args.compile,
        "fused_layers": fused_layers_of(model),
        "fused_stack": fused_stack_of(model),
        "attention": args.attn,
        "prefix_len": args.prefix_len,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "streamed_weight_bytes": streamed_weight_bytes(model),
        "read_bandwidth_gbs": med["read_gbs"],
        "weight_stream_floor_ms": floor,
        "ar_step_ms": med["step"],
        "products_ms": med["products"],
        "skeleton_step_ms": med["skeleton"],
        "rest_ms": rest,
        "ar_step_vs_floor": med["step"] / floor,
        "ar_step_per_layer_ms": med.get("step_per_layer"),
        "samples": samples,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ar_floor.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        ("weight-streaming floor", floor),
        ("autoregressive step t(1)", med["step"]),
        ("  the linear products on one row", med["products"]),
        ("  the same step, every width shrunk (dispatch and Python)", med["skeleton"]),
        ("  the rest at full width (attention, norms, rotary, cache)", rest),
    ]
    if args.fused_layers:
        rows.append(("the step with each layer its own native call", med["step_per_layer"]))
    text = "\n".join(
        [
            f"# The autoregressive step against the weight-streaming floor: {args.model} {args.dtype}, "
            f"{result['cpu']} ({result['cpu_capability']}), {result['threads']} threads, prefix {args.prefix_len}, "
            f"kernel {', '.join(result['linear_kernel'])}, static cache {str(result['static_cache']).lower()}, "
            f"{'compiled' if args.compile else 'eager'}, {'fused' if args.fused_layers else 'transformers'} layers, "
            f"{args.rounds} rounds x {args.repeats} repeats, medians",
            "",
            f"Floor: {result['streamed_weight_bytes'] / 1e6:.0f} MB of weights at {med['read_gbs']:.1f} GB/s read.",
            "",
            "| part | ms | floors |",
            "|---|---:|---:|",
            *(f"| {label} | {ms:.1f} | {ms / floor:.2f} |" for label, ms in rows),
        ]
    )
    (out / "ar_floor.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out / 'ar_floor.md'} and {out / 'ar_floor.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
