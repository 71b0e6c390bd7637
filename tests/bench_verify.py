"""Micro-benchmarks of the verify forward on the embedded SmolLM2 (skipped by default; `make bench`):
one forward of n rows (pending row included) over a cached prefix of 256 tokens, as a chain (the
causal path) and as a branching tree (the masked path): transformers' stock model (SDPA, F.linear,
its own layers) in fp32, and the target as a run loads it (the harness's grouped tree attention and
the configured defaults of model.linear_kernel, model.static_cache and model.fused_layers) in fp32
and bf16. Figures belong here and in docs/measurements.md, never in a timed unit test."""

import pytest
import torch

from harness.measure.ledger import StageClock
from harness.target.backend import CausalLMBackend
from harness.target.loading import load_model
from harness.target.timing import synthetic_prefix, timed_verify_ms, timing_tree

PREFIX = 256


@pytest.fixture(
    scope="module",
    params=[("float32", "sdpa", "stock"), ("float32", "harness_sdpa", "run"), ("bfloat16", "harness_sdpa", "run")],
    ids=["fp32-stock", "fp32-run", "bf16-run"],
)
def setup(request):
    from harness.config import compose
    from harness.runner import apply_model_options

    torch.set_num_threads(2)
    dtype, attn, options = request.param
    loaded = load_model(name="smollm2", dtype=dtype, attn_implementation=attn)
    if options == "run":
        apply_model_options(loaded, compose(["model=smollm2", f"model.dtype={dtype}"]).model)
    else:
        from harness.target.options import apply_linear_kernel

        apply_linear_kernel(loaded.model, "default")
    backend = CausalLMBackend(loaded.model)
    prefix = synthetic_prefix(PREFIX + 1, backend.vocab_size)
    return backend, backend.prefill([prefix]), prefix


@pytest.mark.parametrize("shape", ["chain", "heap"])
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_verify_forward(benchmark, setup, n, shape):
    backend, state, prefix = setup
    tree = timing_tree(n - 1, prefix_len=len(prefix), vocab=backend.vocab_size, shape=shape)
    clock = StageClock(backend.device)
    benchmark.pedantic(
        timed_verify_ms,
        args=(backend, state),
        kwargs={"pending": prefix[-1], "tree": tree, "clock": clock},
        rounds=7,
        warmup_rounds=1,
    )
