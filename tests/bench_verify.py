"""Micro-benchmarks of the verify forward on the embedded SmolLM2 (skipped by default; `make bench`):
one forward of n rows (pending row included) over a cached prefix of 256 tokens, as a chain (the
causal path) and as a branching tree (the masked path): transformers' stock model (SDPA, F.linear,
its own layers) in fp32, and the target as a run loads it (the harness's grouped tree attention and
the configured defaults of model.linear_kernel, model.static_cache and model.fused_layers) in fp32
and bf16. pytest-benchmark times the forward alone, closed by the device sync the runs' clock
(:class:`~harness.measure.ledger.StageClock`) makes; each round's rollback, and the check that it
leaves the cache at the prefix, run in its setup and teardown, outside the time. Figures belong here
and in docs/measurements.md, never in a timed unit test."""

import time

import pytest
import torch

from harness.gates.equivalence import tolerance
from harness.measure.ledger import StageClock
from harness.target.backend import CausalLMBackend
from harness.target.loading import load_model
from harness.target.timing import synthetic_prefix, timing_tree

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


def bench_verify_forward(benchmark, backend, state, *, pending: int, tree, rounds: int = 7, warmup_rounds: int = 1):
    """pytest-benchmark's figure for ONE verify forward of ``tree`` for every request of ``state``:
    the timed call is the forward and the device sync that closes it; the sync that opens it (the
    device idle, the last rollback done) runs in pedantic's setup, and the rollback, the forward
    counter's reset and the check that the cache is back at its prefix run in its teardown, so none
    of them is in the figure. Returns the backend's forward output of the last round."""
    clock = StageClock(backend.device)
    at_prefix = cache_at(state)
    forwards = backend.forwards
    pendings, trees = [pending] * state.batch_size, [tree] * state.batch_size

    def ready():  # before every timed call, outside its time
        assert cache_at(state) == at_prefix
        clock.now()  # synchronises the device

    def forward():  # the timed call
        out = backend.verify(state, pendings, trees)
        clock.now()
        return out

    def rolled_back(*args, **kwargs):  # after every timed call, outside its time
        backend.rollback(state)
        backend.forwards = forwards  # benchmark forwards are not decode forwards
        assert cache_at(state) == at_prefix

    out = benchmark.pedantic(forward, setup=ready, teardown=rolled_back, rounds=rounds, warmup_rounds=warmup_rounds)
    rolled_back()  # a disabled benchmark (--benchmark-disable) calls the target once and no teardown
    return out


@pytest.mark.parametrize("shape", ["chain", "heap"])
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_verify_forward(benchmark, setup, n, shape):
    backend, state, prefix = setup
    tree = timing_tree(n - 1, prefix_len=len(prefix), vocab=backend.vocab_size, shape=shape)
    at_prefix = cache_at(state)
    assert at_prefix[:2] == (PREFIX, [PREFIX])
    bench_verify_forward(benchmark, backend, state, pending=prefix[-1], tree=tree)
    # what was timed is the forward a round runs: its pending row is one autoregressive step
    step = pending_row_logits(backend, state, prefix[-1], None)
    row0 = pending_row_logits(backend, state, prefix[-1], tree)
    assert cache_at(state) == at_prefix
    atol = tolerance(backend.dtype, float(step.abs().max()))  # the equivalence gate's, by dtype
    assert float((row0 - step).abs().max()) <= atol


class _SleepingBackend:
    """A stand-in backend whose verify forward takes ``forward_s`` and whose rollback takes ``rollback_s``
    (sleeps), with the cache fields :func:`cache_at` reads."""

    device = "cpu"

    def __init__(self, forward_s: float, rollback_s: float) -> None:
        self.forward_s, self.rollback_s = forward_s, rollback_s
        self.forwards = 0
        self.calls: list[str] = []

    def verify(self, state, pending, trees):
        self.calls.append("verify")
        time.sleep(self.forward_s)
        state.phys_len += len(pending)
        state.provisional_rows = len(pending)
        self.forwards += 1

    def rollback(self, state):
        self.calls.append("rollback")
        time.sleep(self.rollback_s)
        state.phys_len -= state.provisional_rows
        state.provisional_rows = 0


class _State:
    batch_size = 1

    def __init__(self) -> None:
        self.phys_len, self.lengths, self.provisional_rows = PREFIX, [PREFIX], 0


def test_the_benchmarks_figure_is_the_forward_without_the_rollback(benchmark):
    """A rollback fifty times the forward's time stays out of the figure: the timed call is the
    forward alone, and every round rolls back (the forward counter and the cache back as they were)."""
    backend, state = _SleepingBackend(forward_s=0.001, rollback_s=0.05), _State()
    bench_verify_forward(benchmark, backend, state, pending=7, tree=None, rounds=3, warmup_rounds=1)
    assert backend.calls == ["verify", "rollback"] * 4 + ["rollback"]
    assert (cache_at(state), backend.forwards) == ((PREFIX, [PREFIX], 0), 0)
    assert benchmark.stats.stats.max < 0.025  # seconds: the forward's 1 ms, nowhere near the rollback's 50
