"""Micro-benchmarks of the verify forward on the embedded SmolLM2 (skipped by default; `make bench`):
one forward of n rows (pending row included) over a cached prefix of 256 tokens, as a chain (the
causal path) and as a branching tree (the masked path): transformers' stock model (SDPA, F.linear,
its own layers) in fp32, and the target as a run loads it (the harness's grouped tree attention and
the configured defaults of model.linear_kernel, model.static_cache and model.fused_layers) in fp32
and bf16. Figures belong here and in docs/measurements.md, never in a timed unit test."""

import pytest
import torch

from harness.gates.equivalence import tolerance
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


def cache_at(state) -> tuple:
    """What a rolled-back verify forward leaves as it found: the cache's lengths, physical and valid,
    and no provisional rows."""
    return state.phys_len, list(state.lengths), state.provisional_rows


def pending_row_logits(backend, state, pending: int, tree) -> torch.Tensor:
    """Row 0 (the pending token's) of one verify forward of ``tree``, rolled back."""
    out = backend.verify(state, [pending], [tree]).logits[0][0].float()
    backend.rollback(state)
    return out


@pytest.mark.parametrize("shape", ["chain", "heap"])
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_verify_forward(benchmark, setup, n, shape):
    backend, state, prefix = setup
    tree = timing_tree(n - 1, prefix_len=len(prefix), vocab=backend.vocab_size, shape=shape)
    clock = StageClock(backend.device)
    at_prefix = cache_at(state)
    assert at_prefix[:2] == (PREFIX, [PREFIX])

    def rolled_back(*args, **kwargs):  # after every timed call, outside its time
        assert cache_at(state) == at_prefix

    benchmark.pedantic(
        timed_verify_ms,
        args=(backend, state),
        kwargs={"pending": prefix[-1], "tree": tree, "clock": clock},
        teardown=rolled_back,
        rounds=7,
        warmup_rounds=1,
    )
    # what was timed is the forward a round runs: its pending row is one autoregressive step
    step = pending_row_logits(backend, state, prefix[-1], None)
    row0 = pending_row_logits(backend, state, prefix[-1], tree)
    assert cache_at(state) == at_prefix
    atol = tolerance(backend.dtype, float(step.abs().max()))  # the equivalence gate's, by dtype
    assert float((row0 - step).abs().max()) <= atol
