"""The verify forward from cache-line-aligned weights against the same weights 40 bytes past a line
(where SmolLM2's fp32 safetensors file maps them), interleaved in one process.

``load_model`` copies misaligned CPU parameters into aligned memory
(:func:`harness.target.loading.align_parameters`); this times what that copy buys. Two backends of
the same model, one with every parameter moved back to the file's offset, each with the run's
target options (kernel ``auto``, preallocated cache, fused layers); each round times both at every
size in an alternating order.

    .venv/bin/python scripts/weight_alignment_ab.py                    # SmolLM2 fp32, ~3 min
    .venv/bin/python scripts/weight_alignment_ab.py --rows 1 4 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics

import torch

from harness.target.backend import CausalLMBackend
from harness.target.fused_layers import apply_fused_layers
from harness.target.loading import PARAMETER_ALIGNMENT, load_model
from harness.target.options import apply_linear_kernel, apply_static_cache
from harness.target.timing import synthetic_prefix, verify_times

FILE_OFFSET = 40  # bytes past a cache line: where SmolLM2's converted fp32 checkpoint maps every tensor


def misalign(model: torch.nn.Module, offset: int = FILE_OFFSET) -> None:
    """Move every parameter to ``offset`` bytes past an alignment boundary (same values)."""
    for p in model.parameters():
        slack = PARAMETER_ALIGNMENT // p.element_size() + 1
        storage = torch.empty(p.numel() + slack, dtype=p.dtype)
        start = ((offset - storage.data_ptr()) % PARAMETER_ALIGNMENT) // p.element_size()
        p.data = storage[start : start + p.numel()].view_as(p).copy_(p.data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.rounds < 2 or min(args.rows) < 1 or args.prefix_len < 1:
        ap.error("--rounds must be >= 2, --rows and --prefix-len >= 1")
    torch.set_num_threads(args.threads)
    backends = {}
    for name in ("aligned", f"offset {FILE_OFFSET}"):
        model = load_model(name="smollm2", dtype="float32", attn_implementation="harness_sdpa").model
        if name != "aligned":
            misalign(model)
        apply_linear_kernel(model, "auto")
        apply_static_cache(model, True)
        apply_fused_layers(model, True)
        backends[name] = CausalLMBackend(model)
    prefix = synthetic_prefix(args.prefix_len + 1, backends["aligned"].vocab_size)
    samples = {k: {n: [] for n in args.rows} for k in backends}
    order = list(backends)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            for n, times in verify_times(backends[name], prefix_ids=prefix, ns=args.rows, repeats=5).items():
                samples[name][n].extend(times)
    print(f"| rows | aligned ms | offset {FILE_OFFSET} ms | aligned / offset |")
    print("|---:|---:|---:|---:|")
    for n in args.rows:
        a, b = (statistics.median(samples[k][n]) for k in order)
        print(f"| {n} | {a:.1f} | {b:.1f} | {a / b:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
