"""The preallocated KV cache (``model.static_cache=true``): the same values as transformers'
concatenating cache, bit for bit, through every move the backend makes, written in place."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_lookup_tokens

from harness.config import compose
from harness.contracts import Budget, ProposalResult
from harness.engine.decode import RoundConfig
from harness.proposers.prompt_lookup import PromptLookupProposer
from harness.random_source import TorchRandomSource
from harness.target import kv_cache
from harness.target.backend import CausalLMBackend, cache_bytes
from harness.target.loading import build_tiny_model
from harness.target.options import apply_static_cache, static_cache_of
from harness.topology.compiler import compile_tree
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy

PROMPTS = [[1, 5, 9, 14, 3, 7, 22, 8], [4, 4, 9, 2, 30], [7, 3, 3, 8, 1, 2, 6, 5, 11, 12, 13]]


def _tree(paths, prefix_len):
    return compile_tree([ProposalResult.from_paths(paths, source="t", manifest_hash="t")], prefix_len=prefix_len)


def _pair(seed=2, dtype=torch.float32):
    plain, static = build_tiny_model(seed=seed, dtype=dtype), build_tiny_model(seed=seed, dtype=dtype)
    assert static_cache_of(static)  # the default
    apply_static_cache(plain, False)  # transformers' concatenating DynamicCache
    return CausalLMBackend(plain), CausalLMBackend(static)


def _same_cache(a, b):
    assert a.lengths == b.lengths and a.phys_len == b.phys_len and a.tokens == b.tokens
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert isinstance(lb, kv_cache.PreallocatedLayer) and not isinstance(la, kv_cache.PreallocatedLayer)
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_backend_move_gives_the_dynamic_cache_values_bit_for_bit(monkeypatch, dtype):
    """Prefill of ragged prompts, tree verifies, non-contiguous commits, a rollback, a finished
    request dropped, single-row steps: logits and cache rows equal transformers' DynamicCache
    exactly, while a small reserve forces the buffers to be reallocated several times."""
    monkeypatch.setattr(kv_cache, "DEFAULT_RESERVE", 3)
    plain, static = _pair(dtype=dtype)
    states = [plain.prefill(PROMPTS), static.prefill(PROMPTS)]
    _same_cache(*states)
    capacities = {states[1].cache.layers[0].capacity}
    pending = [p[-1] for p in PROMPTS]
    rounds = [
        ([[10, 11, 12], [10, 11, 13], [10, 15], [30]], [[0, 1, 3], [2], []]),  # A B D: rows 0, 1, 3
        ([[4, 6], [4, 7, 8]], [[1, 2, 3], [0], [0, 1]]),
        (None, None),  # a rolled-back verify
        ([[50, 51, 52, 53, 54]], [[0, 1, 2, 3, 4], [0, 1], []]),
    ]
    for paths, accept in rounds:
        outs = []
        for backend, state in zip((plain, static), states):
            trees = [_tree(paths or [[20]], state.lengths[i] + 1) for i in range(state.batch_size)]
            outs.append(backend.verify(state, pending, trees))
            if accept is None:
                backend.rollback(state)
            else:
                backend.commit(state, accept)
        assert all(torch.equal(a, b) for a, b in zip(outs[0].logits, outs[1].logits))
        assert outs[0].kv_bytes_added == outs[1].kv_bytes_added  # the rows a forward appends, either way
        _same_cache(*states)
        capacities.add(states[1].cache.layers[0].capacity)
    for backend, state in zip((plain, static), states):
        backend.drop(state, [1])  # a finished request: its batch row leaves both caches
    _same_cache(*states)
    for _ in range(12):  # single-row steps of the two requests left
        outs = [b.verify(s, pending[:2], [None, None]) for b, s in zip((plain, static), states)]
        assert all(torch.equal(a, b) for a, b in zip(outs[0].logits, outs[1].logits))
        for b, s in zip((plain, static), states):
            b.commit(s, [[], []])
        _same_cache(*states)
        capacities.add(states[1].cache.layers[0].capacity)
    assert len(capacities) >= 3  # the buffers were outgrown and reallocated along the way
    assert kv_cache.reserved_bytes(states[1].cache) >= cache_bytes(states[1].cache)


def test_appends_write_in_place_until_the_buffer_is_full_then_at_least_double_it(monkeypatch):
    monkeypatch.setattr(kv_cache, "DEFAULT_RESERVE", 8)
    _, static = _pair()
    state = static.prefill([PROMPTS[0]])
    layer = state.cache.layers[0]
    buffer, capacity = layer._key_buffer.data_ptr(), layer.capacity
    assert capacity == len(PROMPTS[0]) - 1 + 8
    for _ in range(8):  # one row per step: 8 slots reserved
        static.verify(state, [3], [None])
        static.commit(state, [[]])
        assert layer.keys.data_ptr() == buffer  # a view of the same buffer: nothing concatenated or copied
    assert layer.capacity == capacity and layer.get_seq_length() == capacity
    static.verify(state, [3], [None])
    assert layer.capacity >= 2 * capacity and layer.keys.data_ptr() != buffer


def test_a_static_cache_run_decodes_what_transformers_generate_decodes():
    """Greedy prompt lookup on the preallocated cache equals plain decoding on the dynamic cache and
    transformers' own greedy generate, token for token."""
    plain, static = _pair(seed=5)
    prompt = [3 + (7 * i) % 40 for i in range(30)]
    tokens = [greedy_lookup_tokens(backend, prompt, matches=4) for backend in (plain, static)]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        ref = plain.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    assert tokens[0] == tokens[1] == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("static", [True, False])
def test_the_runner_applies_the_cache_layout_to_the_target_both_arms_share(tmp_path, monkeypatch, static):
    import harness.runner as runner

    seen = []

    class Recording(runner.Arms):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(static_cache_of(kwargs["target"].model))

    monkeypatch.setattr(runner, "Arms", Recording)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        ["model=tiny", "proposer=prompt_lookup", "workload.limit=1", "generation.max_new_tokens=12"]
        + ["gates.oracle=false"]
        + ([] if static else ["model.static_cache=false"])  # preallocated is the default
    )
    record = runner.run_job(cfg, run_dir=tmp_path / "run")
    assert seen == [static]
    assert record["manifest"]["backend"]["static_cache"] is static
    assert record["metrics"]["greedy_identical"] is True
    assert record["gates"]["equivalence"]["status"] == "passed"


def test_a_decode_reserves_its_whole_budget_up_front_and_a_dropped_request_does_not_grow_the_buffers():
    """The round loop asks for ``max_new_tokens + max_nodes + 1`` slots at prefill, so a run never
    reallocates; a batch row leaving (a new tensor for the layer) keeps the buffers' capacity."""
    from harness.engine.decode import decode_batch

    _, static = _pair(seed=6)
    seen = []
    new, cfg = 24, RoundConfig(max_nodes=6, max_depth=3)

    def on_round(**kw):
        layer = kw["state"].cache.layers[0]
        seen.append((layer.capacity, layer._key_buffer.shape[0], kw["state"].batch_size))

    prompts = [PROMPTS[0], PROMPTS[2]]
    decode_batch(
        target=static,
        proposers=[
            PromptLookupProposer(budget=Budget("sequences", 6, 3), manifest_hash="t", max_matches=2) for _ in prompts
        ],
        verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompts=prompts,
        max_new_tokens=new,
        eos_token_ids=frozenset({int(t) for t in range(90, 96)}),  # one request may stop early
        rngs=[TorchRandomSource(k) for k in range(len(prompts))],
        round_cfg=cfg,
        on_round=on_round,
    )
    capacity = max(len(p) for p in prompts) - 1 + new + cfg.max_nodes + 1
    assert {b for _, _, b in seen} == {1, 2}  # one request left the batch before the other
    assert {b for _, b, _ in seen} == {1, 2}  # and its buffers left with it
    assert {c for c, _, _ in seen} == {capacity}  # one capacity throughout: never outgrown, never doubled


@pytest.mark.slow  # torch.compile builds C++ kernels: a minute or more on a 2-core machine
def test_a_compiled_target_on_the_static_cache_decodes_what_the_plain_target_decodes():
    from test_target_options import _greedy

    from harness.target import options

    if options.compile_problem("cpu"):
        pytest.skip(options.compile_problem("cpu"))

    torch._dynamo.reset()
    prompt = [3 + (5 * i) % 90 for i in range(24)]
    compiled = build_tiny_model(seed=4)
    apply_static_cache(compiled, True)
    options.compile_model(compiled)
    assert _greedy(compiled, prompt) == _greedy(build_tiny_model(seed=4), prompt)


def test_a_crop_narrows_the_buffers_and_a_cache_held_elsewhere_is_sliced():
    layer = kv_cache.PreallocatedLayer(reserve=8)
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer.update(keys, values)
    buffer = layer._key_buffer
    layer.keep_first(3)  # a prefix of the buffers: a narrower view of them, still appended in place
    assert layer.keys.shape[-2] == 3 and layer.keys.data_ptr() == buffer.data_ptr()
    assert torch.equal(layer.keys, keys[:, :, :3]) and torch.equal(layer.values, values[:, :, :3])
    more = torch.randn(1, 2, 2, 4)
    layer.update(more, more)
    assert layer._key_buffer is buffer and torch.equal(layer.keys, torch.cat([keys[:, :, :3], more], dim=2))
    held = torch.randn(1, 2, 5, 4)  # a cache assigned from outside (a batch-row selection): not the buffers
    layer.keys, layer.values = held, held.clone()
    layer.keep_first(2)
    assert torch.equal(layer.keys, held[:, :, :2]) and not layer._keys_in_buffer
    layer.update(more, more)  # the next append copies it into buffers again
    assert torch.equal(layer.keys, torch.cat([held[:, :, :2], more], dim=2)) and layer._keys_in_buffer


def test_a_filled_count_stands_for_the_views_until_someone_reads_them():
    layer = kv_cache.PreallocatedLayer(reserve=8)
    keys, values = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    layer.update(keys, values)
    start = layer.reserve_rows(2, keys[:, :, :2], values[:, :, :2])  # what the native stack does
    new_k, new_v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    layer._key_buffer[:, :, start : start + 2] = new_k
    layer._value_buffer[:, :, start : start + 2] = new_v
    layer.mark_filled(start + 2)
    assert layer._keys is not None and layer._keys.shape[-2] == 6  # no view made yet
    assert layer.get_seq_length() == 8
    assert layer.cached_bytes() == 2 * 2 * 3 * 8 * 4 * 4
    assert torch.equal(layer.keys, torch.cat([keys, new_k], dim=2))  # made when read
    assert torch.equal(layer.values, torch.cat([values, new_v], dim=2))
    assert layer.cached_bytes() == layer.keys.numel() * 4 + layer.values.numel() * 4
    layer.keep_first(5)  # a crop: the count alone
    assert layer.get_seq_length() == 5 and torch.equal(layer.keys, keys[:, :, :5])
    layer.keep_first(4)
    layer.keys = layer.keys[1:]  # one side replaced from outside: the other's view is made first
    assert torch.equal(layer.values, values[:, :, :4]) and not layer._keys_in_buffer
    layer.values = layer.values[1:]
    more = torch.randn(1, 3, 1, 4)
    got_k, got_v = layer.update(more, more)  # a selection of batch rows: copied into fresh buffers
    assert torch.equal(got_k, torch.cat([keys[1:, :, :4], more], dim=2))
    assert torch.equal(got_v, torch.cat([values[1:, :, :4], more], dim=2))
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.cached_bytes() == 0


def test_a_reservation_that_fits_moves_nothing_and_one_that_does_not_fit_or_match_does():
    layer = kv_cache.PreallocatedLayer(reserve=8)
    keys = torch.randn(2, 3, 6, 4)
    layer.update(keys, keys.clone())
    layer.mark_filled(layer.reserve_rows(2, keys[:, :, :2], keys[:, :, :2]) + 2)  # 8 of 14 slots filled
    buffer = layer._key_buffer.data_ptr()
    assert layer.capacity == 14 and layer.reserve_rows(6, keys, keys) == 8 and layer._key_buffer.data_ptr() == buffer
    with pytest.raises(ValueError, match=r"cannot append \(1, 3, 1, 4\)"):
        layer.reserve_rows(1, keys[:1, :, :1], keys[:1, :, :1])  # another batch: refused, not reserved
    assert layer.reserve_rows(7, keys, keys) == 8  # 15 slots: the buffers at least doubled, the rows kept
    assert layer.capacity >= 28 and layer._key_buffer.data_ptr() != buffer
    assert torch.equal(layer._key_buffer[:, :, :6], keys) and layer.cached_bytes() == 2 * 2 * 3 * 8 * 4 * 4


def test_a_cache_is_made_on_a_transformers_release_without_its_stateless_layer(monkeypatch):
    """Older transformers releases (a GPU image's) have no ``DummyLayer``: making a cache imported it
    and every forward failed there; it is looked up only where it exists."""
    import transformers.cache_utils as cache_utils

    model = build_tiny_model()
    monkeypatch.delattr(cache_utils, "DummyLayer", raising=False)
    cache = kv_cache.new_cache(model.config, preallocated=True)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(isinstance(layer, kv_cache.PreallocatedLayer) for layer in cache.layers)
