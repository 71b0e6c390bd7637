"""Fused decoder layers (``model.fused_layers``): the native layer computes what transformers' Llama
layer computes, through every move the backend makes, and falls back where it does not apply."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_lookup_tokens
from torch.profiler import profile

from harness.config import compose
from harness.contracts import ConfigError, ProposalResult
from harness.gates.equivalence import equivalence_gate
from harness.heads.state import HiddenTap
from harness.runner import check_models
from harness.target import kv_cache, native, options
from harness.target.backend import CausalLMBackend
from harness.target.fused_layers import apply_fused_layers, decoder_layers, fusable, fused_layers_of, fused_stack_of
from harness.target.loading import build_tiny_model
from harness.topology.compiler import compile_tree

pytestmark = pytest.mark.skipif(
    native.native_kernels_problem() is not None, reason=f"no native kernels here: {native.native_kernels_problem()}"
)

PROMPTS = [[1, 5, 9, 14, 3, 7, 22, 8], [4, 4, 9, 2, 30], [7, 3, 3, 8, 1, 2, 6, 5, 11, 12, 13]]
# head layouts: grouped-query with heads shorter than a vector; multi-head; wider heads with a bias
GEOMETRIES = [
    {},
    {"num_heads": 4, "num_kv_heads": 4},
    {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 200},
]


def _tree(paths, prefix_len):
    return compile_tree([ProposalResult.from_paths(paths, source="t", manifest_hash="t")], prefix_len=prefix_len)


def _pair(geometry, seed=2, bias=False):
    plain, fused = (build_tiny_model(seed=seed, **geometry) for _ in range(2))
    if bias:  # attention and MLP biases (Llama's attention_bias / mlp_bias), the same in both
        for model in (plain, fused):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for layer in decoder_layers(model):
                    for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.down_proj):
                        lin.bias = torch.nn.Parameter(0.1 * torch.randn(lin.out_features))
    assert apply_fused_layers(fused, True) == len(decoder_layers(fused)) > 0
    return CausalLMBackend(plain), CausalLMBackend(fused)


def _close_caches(a, b):
    assert a.lengths == b.lengths and a.phys_len == b.phys_len and a.tokens == b.tokens
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert isinstance(lb, kv_cache.PreallocatedLayer)
        torch.testing.assert_close(la.keys, lb.keys, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(la.values, lb.values, atol=2e-5, rtol=1e-5)


def _native_calls(fn) -> dict[str, int]:
    """The native layer ops ``fn`` called: ``{"llama_stack": 1}`` for a decoder run as one call,
    ``{"llama_layer": n}`` for n layers one call each, ``{}`` for transformers' own layers."""
    with profile() as prof:
        fn()
    ops = ("harness::llama_layer", "harness::llama_stack")
    return {e.key.split("::")[1]: e.count for e in prof.key_averages() if e.key in ops}


STACK = {"llama_stack": 1}


def _every_move(backends, same_logits, same_caches, calls):
    """Prefill of ragged prompts, tree verifies with padding, non-contiguous commits, a rollback, a
    finished request dropped, single-row steps, buffers outgrown (with a reserve of 3): the same moves
    on each backend. ``same_logits(a, b)`` and ``same_caches(a, b)`` compare the first backend's to
    each other's after every move; ``calls[i]``: the native ops backend i's verifies must call."""
    with torch.inference_mode():
        states = [b.prefill(PROMPTS) for b in backends]
        for other in states[1:]:
            same_caches(states[0], other)
        pending = [p[-1] for p in PROMPTS]
        rounds = [
            ([[10, 11, 12], [10, 11, 13], [10, 15], [30]], [[0, 1, 3], [2], []]),
            ([[4, 6], [4, 7, 8]], [[1, 2, 3], [0], [0, 1]]),
            (None, None),  # a rolled-back verify
            ([[50, 51, 52, 53, 54]], [[0, 1, 2, 3, 4], [0, 1], []]),
        ]
        for paths, accept in rounds:
            outs = []
            for backend, state, expected in zip(backends, states, calls):
                trees = [_tree(paths or [[20]], state.lengths[i] + 1) for i in range(state.batch_size)]
                got = _native_calls(lambda b=backend, s=state, t=trees, o=outs: o.append(b.verify(s, pending, t)))
                assert got == expected
                backend.rollback(state) if accept is None else backend.commit(state, accept)
            for out, state in zip(outs[1:], states[1:]):
                for a, b in zip(outs[0].logits, out.logits):
                    same_logits(a, b)
                same_caches(states[0], state)
        for backend, state in zip(backends, states):
            backend.drop(state, [1])
        for _ in range(10):  # single-row steps: the causal rule without a mask
            outs = [b.verify(s, pending[:2], [None, None]) for b, s in zip(backends, states)]
            for out in outs[1:]:
                for a, b in zip(outs[0].logits, out.logits):
                    same_logits(a, b)
            for b, s in zip(backends, states):
                b.commit(s, [[], []])
            for state in states[1:]:
                same_caches(states[0], state)


@pytest.mark.parametrize("geometry", range(len(GEOMETRIES)))
def test_every_backend_move_gives_the_unfused_logits_and_cache(monkeypatch, geometry):
    """Through every move of the backend, logits and cache rows equal transformers' own layers to
    float32 rounding, and every forward ran the decoder as one native call."""
    monkeypatch.setattr(kv_cache, "DEFAULT_RESERVE", 3)
    plain, fused = _pair(GEOMETRIES[geometry], bias=geometry == 2)

    def close(a, b):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, equal_nan=True)

    _every_move([plain, fused], close, _close_caches, [{}, STACK])


def _equal_caches(a, b):
    assert a.lengths == b.lengths and a.phys_len == b.phys_len and a.tokens == b.tokens
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize(("dtype", "layers"), [(torch.float32, 3), (torch.bfloat16, 2)])
def test_the_decoder_as_one_call_computes_what_the_layers_one_call_each_compute_bit_for_bit(monkeypatch, dtype, layers):
    """The native stack (one call for every layer) against the same layers one native call each:
    the same logits and cache bits through every backend move, an odd and an even number of layers."""
    monkeypatch.setattr(kv_cache, "DEFAULT_RESERVE", 3)
    stacked, layered = (build_tiny_model(seed=6, dtype=dtype, num_layers=layers, **GEOMETRIES[2]) for _ in range(2))
    for model, stack in ((stacked, True), (layered, False)):
        options.apply_linear_kernel(model, "streaming")
        assert apply_fused_layers(model, True, stack=stack) == layers and fused_stack_of(model) is stack

    def equal(a, b):
        assert torch.equal(a, b)

    backends = [CausalLMBackend(stacked), CausalLMBackend(layered)]
    _every_move(backends, equal, _equal_caches, [STACK, {"llama_layer": layers}])


@pytest.mark.parametrize("kernel", ["default", "streaming_panels"])
def test_forwards_that_need_the_layers_one_by_one_leave_the_stack_and_compute_the_same_bits(kernel):
    """Hidden states asked for, a hook on a decoder layer (a head reading the residual stream entering
    it), a two-dimensional padding mask: transformers' forward over the layers one native call each,
    the same logits bits as the stack; once hidden states were asked for (transformers leaves its
    capturing hooks on the layers) a plain forward runs the stack again. With the products' weights
    in panels as well."""
    model = build_tiny_model(seed=7)
    options.apply_linear_kernel(model, kernel)
    apply_fused_layers(model, True)
    ids = torch.tensor([PROMPTS[2]])

    def run(**kwargs):
        return model(input_ids=ids, cache=kv_cache.new_cache(model.config, preallocated=True), **kwargs)

    per_layer = {"llama_layer": 2}
    with torch.inference_mode():
        stacked = run().logits
        assert _native_calls(run) == STACK
        hidden = run(output_hidden_states=True)
        assert torch.equal(hidden.logits, stacked) and len(hidden.hidden_states) == 3
        assert _native_calls(lambda: run(output_hidden_states=True)) == per_layer
        assert _native_calls(run) == STACK  # transformers' capturing hooks are still on the layers
        assert _native_calls(lambda: run(attention_mask=torch.ones_like(ids))) == per_layer
        assert torch.equal(run(attention_mask=torch.ones_like(ids)).logits, stacked)
        tap = HiddenTap.on(model)
        tap.capture_layers([1])
        assert _native_calls(run) == per_layer
        assert torch.equal(run().logits, stacked)
        # suspended (the autoregressive arm's forwards): the whole stack again, and nothing captured
        serial = tap.serial
        with HiddenTap.suspended(model):
            assert _native_calls(run) == STACK
            assert torch.equal(run().logits, stacked)
        assert tap.serial == serial
        assert _native_calls(run) == per_layer  # the hooks are back, the layer's capture included
        assert tap.serial == serial + 1 and set(tap.last.aux) == {1}


def test_the_stack_op_refuses_lists_that_do_not_match_in_one_line():
    model = build_tiny_model(seed=7)
    layer = decoder_layers(model)[0]
    buffers = torch.zeros(1, 2, 8, 16)
    weights = [p.detach() for p in (layer.input_layernorm.weight, layer.self_attn.q_proj.weight)]
    with pytest.raises(RuntimeError, match="llama_stack: per layer one key and one value buffer, 9 weights"):
        torch.ops.harness.llama_stack(
            torch.zeros(1, 1, 64),
            torch.zeros(1, 1, 16),
            torch.zeros(1, 1, 16),
            None,
            [buffers],
            [buffers],
            0,
            weights,
            [None] * 7,
            [1e-5],
            [1e-5],
            0.25,
        )


def test_a_fused_target_decodes_what_transformers_generate_decodes_and_passes_the_equivalence_gate():
    prompt = [3 + (7 * i) % 40 for i in range(30)] * 2
    plain, fused = _pair({}, seed=5)
    tokens = [greedy_lookup_tokens(backend, prompt) for backend in (plain, fused)]
    with torch.inference_mode():  # transformers' own greedy loop (its own cache: its own layers)
        ids = torch.tensor([prompt])
        ref = plain.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    assert tokens[0] == tokens[1] == ref[0, len(prompt) :].tolist() and len(tokens[0]) == 40
    assert equivalence_gate(fused, prompt)["status"] == "passed"


def test_forwards_it_does_not_cover_run_the_layers_own_forward():
    plain, fused = _pair({})
    model, ids = fused.model, torch.tensor([PROMPTS[0]])

    def run(tokens, *, preallocated=True):
        return model(input_ids=tokens, cache=kv_cache.new_cache(model.config, preallocated=preallocated))

    with torch.no_grad():
        assert _native_calls(lambda: run(ids)) == STACK  # a preallocated cache: the decoder in one call
        assert _native_calls(lambda: run(ids, preallocated=False)) == {}  # DynamicCache: nothing to fill in place
        assert _native_calls(lambda: model(input_ids=ids)) == {}  # transformers' own cache
        torch.testing.assert_close(run(ids).logits, plain.model(input_ids=ids).logits, atol=2e-5, rtol=1e-5)
    with torch.enable_grad():  # gradients: autograd's own layers
        assert run(ids).logits.requires_grad and _native_calls(lambda: run(ids)) == {}
    model.set_attn_implementation("eager")  # eager attention asked for: transformers' layers throughout
    with torch.no_grad():
        assert _native_calls(lambda: run(ids)) == {}


def test_a_batch_without_position_ids_runs_natively_with_the_positions_transformers_gives_it():
    """Without position ids transformers gives every row of a batch the same positions ([1, R] cos and
    sin); the native ops took only [B, R] and raised at B > 1, in one call and layer by layer."""
    plain, fused = _pair({})
    model = fused.model
    ids = torch.tensor([PROMPTS[0][:6], PROMPTS[2][:6]])
    with torch.no_grad():
        want = plain.model(input_ids=ids).logits
        for hidden, ops in ((False, {"llama_stack"}), (True, {"llama_layer"})):  # in one call; layer by layer

            def run(hidden=hidden):
                cache = kv_cache.new_cache(model.config, preallocated=True)
                return model(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=hidden)

            assert set(_native_calls(run)) == ops
            torch.testing.assert_close(run().logits, want, atol=2e-5, rtol=1e-5)


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_fusing_is_undone_and_only_llama_layers_are_fused():
    model = build_tiny_model(seed=1)
    assert apply_fused_layers(model, True) == 2 and fused_layers_of(model) == 2 and fused_stack_of(model)
    reference = build_tiny_model(seed=1)
    for m in (model, reference):  # a parameter replaced after fusing is the one computed with
        m.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(torch.full((32, 64), 0.01))
        # and a parametrised one (no longer a registered parameter: read by attribute) as it computes
        torch.nn.utils.parametrize.register_parametrization(m.model.layers[0].self_attn.q_proj, "weight", _Doubled())
    ids, cache = torch.tensor([PROMPTS[0]]), kv_cache.new_cache(model.config, preallocated=True)
    with torch.no_grad():
        assert _native_calls(lambda: model(input_ids=ids, cache=cache)) == STACK
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=2e-5, rtol=1e-5)
        fused = model(input_ids=ids, cache=kv_cache.new_cache(model.config, preallocated=True)).logits
        torch.testing.assert_close(fused, reference(input_ids=ids).logits, atol=2e-5, rtol=1e-5)
    assert apply_fused_layers(model, False) == 0 and fused_layers_of(model) == 0 and not fused_stack_of(model)
    assert all("forward" not in m.__dict__ for m in [model.model, *decoder_layers(model)])
    layer = decoder_layers(model)[0]
    layer.mlp.act_fn = torch.nn.GELU()
    model.config.hidden_act = "gelu"
    assert "hidden_act='gelu'" in fusable(layer)
    assert apply_fused_layers(model, True) == 0
    assert "is not one of" in fusable(torch.nn.Linear(2, 2))


def test_the_stack_computes_with_the_weights_its_modules_hold_however_they_were_replaced():
    import copy

    model, reference = build_tiny_model(seed=1), build_tiny_model(seed=1)
    assert apply_fused_layers(model, True) == 2 and fused_stack_of(model)
    ids = torch.tensor([PROMPTS[0]])

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids, cache=kv_cache.new_cache(m.config, preallocated=True)).logits

    def same_logits(fused=model):
        with torch.no_grad():
            assert (
                _native_calls(lambda: fused(input_ids=ids, cache=kv_cache.new_cache(fused.config, preallocated=True)))
                == STACK
            )
        torch.testing.assert_close(logits(fused), reference(input_ids=ids).logits, atol=2e-5, rtol=1e-5)

    def both(edit):
        for m in (model, reference):
            edit(m)
        same_logits()

    same_logits()

    def parameter(m):  # setattr
        m.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(torch.full((64, 32), 0.02))

    def written(m):  # straight into the module's parameter dict, as torch.func and accelerate do
        m.model.layers[0].self_attn.o_proj._parameters["weight"] = torch.nn.Parameter(torch.full((32, 32), -0.01))

    def plain_tensor(m):  # the parameter deleted, a plain tensor in its place
        lin = m.model.layers[1].self_attn.k_proj
        w = lin.weight.detach() * 0.5
        del lin.weight
        lin.weight = w

    def children_replaced(m):  # a module's whole dict of submodules replaced, then an entry of the new one
        mlp = m.model.layers[0].mlp
        mlp._modules = dict(mlp._modules)
        up = torch.nn.Linear(32, 64, bias=False)
        torch.nn.init.constant_(up.weight, 0.04)
        mlp._modules["up_proj"] = up

    def unregistered_bias(m):  # no bias before; the registered None deleted and a plain tensor set
        lin = m.model.layers[0].self_attn.q_proj
        del lin.bias
        lin.bias = torch.full((32,), 0.1)

    def layer_swapped(m):  # a layer taken out of the list and a changed copy put back
        layer = copy.deepcopy(m.model.layers[1])
        with torch.no_grad():
            layer.mlp.down_proj.weight.mul_(-1.0)
        del m.model.layers[1]
        m.model.layers.insert(1, layer)

    both(parameter)
    both(written)
    both(layer_swapped)
    both(children_replaced)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:  # one layer's parameters replaced by Module.to, then changed in place
        model.model.layers[1].to(torch.float64).to(torch.float32)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    both(lambda m: torch.nn.init.constant_(m.model.layers[1].self_attn.v_proj.weight, 0.03))
    name, value = "model.layers.0.mlp.gate_proj.weight", torch.full((64, 32), 0.05)
    with torch.no_grad():  # parameters swapped in for one call only
        torch.testing.assert_close(
            torch.func.functional_call(
                model, {name: value}, (ids,), {"cache": kv_cache.new_cache(model.config, preallocated=True)}
            ).logits,
            torch.func.functional_call(reference, {name: value}, (ids,)).logits,
            atol=2e-5,
            rtol=1e-5,
        )
    same_logits()
    twin = copy.deepcopy(model)  # a copy computes with its own modules
    twin.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(torch.full((64, 32), 0.07))
    reference_twin = copy.deepcopy(reference)
    reference_twin.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(torch.full((64, 32), 0.07))
    torch.testing.assert_close(logits(twin), reference_twin(input_ids=ids).logits, atol=2e-5, rtol=1e-5)
    same_logits()
    both(unregistered_bias)
    for m in (model, reference):
        m.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.full((32,), 0.1))
    same_logits()
    both(plain_tensor)
    for m in (model, reference):  # parametrised: computed by each read
        torch.nn.utils.parametrize.register_parametrization(m.model.layers[0].mlp.gate_proj, "weight", _Doubled())
    same_logits()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)  # torch.compile's import
def test_the_backend_reads_the_stacks_logits_directly_with_the_bits_of_the_models_forward(monkeypatch, dtype):
    from harness.target import backend as backend_module
    from harness.target.fused_layers import stack_logits

    model = build_tiny_model(seed=3).to(dtype)
    assert apply_fused_layers(model, True) == 2
    ids, pos = torch.tensor([PROMPTS[2]]), torch.arange(len(PROMPTS[2]))[None]
    with torch.no_grad():
        caches = [kv_cache.new_cache(model.config, preallocated=True) for _ in range(2)]
        direct = stack_logits(model, ids, pos, None, caches[0])
        through = model(input_ids=ids, position_ids=pos, cache=caches[1], use_cache=True).logits
        assert direct.shape == through.shape and torch.equal(direct, through)
        step = torch.tensor([[5]]), torch.tensor([[len(PROMPTS[2])]])
        last = stack_logits(model, *step, None, caches[0], last_only=True)
        assert torch.equal(
            last, model(input_ids=step[0], position_ids=step[1], cache=caches[1], logits_to_keep=1).logits
        )
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

    calls = []

    def counted(*args, **kwargs):
        calls.append(stack_logits(*args, **kwargs))
        return calls[-1]

    def run(direct: bool):  # a prefill, tree verifies with commits, a rollback, single-row steps
        monkeypatch.setattr(backend_module, "stack_logits", counted if direct else lambda *a, **k: None)
        backend, got = CausalLMBackend(model), []
        with torch.inference_mode():
            state = backend.prefill(PROMPTS[:2])
            for paths, accept in (([[10, 11, 12], [10, 13], [14]], [[0, 1], [2]]), ([[4, 6]], None), (None, None)):
                trees = [_tree(paths, state.lengths[i] + 1) if paths else None for i in range(2)]
                got += backend.verify(state, [3, 9], trees).logits
                backend.rollback(state) if accept is None else backend.commit(state, accept)
        return got

    with_direct, without = run(True), run(False)
    assert calls and all(c is not None for c in calls)
    assert len(with_direct) == len(without) and all(torch.equal(a, b) for a, b in zip(with_direct, without))

    seen = []  # a hook on the LM head: transformers' forward, which calls it
    handle = model.lm_head.register_forward_hook(lambda *_: seen.append(1))
    calls.clear()
    run(True)
    assert seen and calls and all(c is None for c in calls)
    handle.remove()

    def direct() -> bool:
        with torch.no_grad():
            return stack_logits(model, ids, pos, None, kv_cache.new_cache(model.config, preallocated=True)) is not None

    assert direct()
    cls, original = type(model), type(model).forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: original(self, *a, **k))
    assert not direct()  # the class's forward patched since fusing
    monkeypatch.undo()
    fused_forward = model.model.forward
    model.model.forward = lambda *a, **k: fused_forward(*a, **k)  # the decoder's forward wrapped (as accelerate does)
    assert not direct()
    model.model.forward = fused_forward
    assert direct()
    model.compile()  # a compiled model calls its compiled forward
    assert not direct()


def test_the_option_resolves_records_and_refuses_in_one_line(tmp_path, monkeypatch):
    from harness.manifest import job_manifest

    streams = options.resolve_linear_kernel("auto", torch.float32, "cpu") in options.STREAMING_KERNELS
    assert job_manifest(compose(["model=tiny"]), versions={})["backend"]["fused_layers"] is streams
    for overrides, expected in (
        (["model.fused_layers=true"], True),
        (["model.fused_layers=false"], False),
        (["model.static_cache=false"], False),
        (["model.linear_kernel=default"], False),
        (["model.compile=true"], False),
    ):
        manifest = job_manifest(compose(["model=tiny", *overrides]), versions={})
        assert manifest["backend"]["fused_layers"] is (expected and (streams or "model.fused_layers=true" in overrides))
    for overrides, message in (
        (
            ["model.dtype=float16", "model.linear_kernel=default"],
            r"^model.fused_layers=true computes float32 and bfloat16",
        ),
        (["model.static_cache=false"], r"^model.fused_layers=true appends to preallocated caches"),
        (["model.compile=true"], r"^model.fused_layers=true and model.compile=true"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            check_models(compose(["model=tiny", "model.fused_layers=true", *overrides]))
        assert "\n" not in str(err.value) and err.value.suggestions == (("model.fused_layers=false",),)


def test_a_run_records_its_fused_layers_and_both_arms_agree(tmp_path, monkeypatch):
    import harness.runner as runner

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        ["model=tiny", "model.fused_layers=true", "proposer=prompt_lookup", "workload.limit=1"]
        + ["generation.max_new_tokens=12", "gates.oracle=false"]
    )
    record = runner.run_job(cfg, run_dir=tmp_path / "run")
    assert record["manifest"]["backend"]["fused_layers"] is True
    assert record["load_report"]["target"]["fused_layers"] == cfg.model.tiny.num_layers
    assert record["load_report"]["target"]["fused_stack"] is True
    # which of the build's code paths summed the bits: two machines' records differ where these do
    assert record["load_report"]["target"]["native_code_paths"] == native.code_paths()
    assert set(native.code_paths()) == {"float32_width", "avx512", "avx512_bf16", "amx_tiles", "compiler"}
    assert record["metrics"]["greedy_identical"] is True
    assert record["gates"]["equivalence"]["status"] == "passed"


PAIRED = {**GEOMETRIES[2], "intermediate_size": 192}  # heads of 64; every product's K a multiple of 32


@pytest.mark.parametrize(
    ("dtype", "kernel", "geometry"),
    [
        (torch.float32, "streaming", {}),
        (torch.bfloat16, "streaming", {}),
        (torch.bfloat16, "streaming_panels", {}),
        (torch.bfloat16, "streaming_panels", PAIRED),
    ],
)
def test_a_rows_logits_do_not_depend_on_how_the_forwards_were_split(dtype, kernel, geometry):
    """Batch invariance: a prompt of 150 tokens (three passes of the kernel over the weights)
    prefilled in one forward, or as 149 tokens and then the last one alone, or in forwards of
    1, 64 and 85 rows, leaves the same cache bits and gives the last row the same logits bits.
    A greedy run prefills all but the last prompt token and transformers' generate prefills all of
    them, so this is what makes the two decode the same tokens. bfloat16 weights in pairs (AMX's
    tiles where the CPU has them) as well, and heads of 64 dimensions (attention on the tiles)."""
    model = build_tiny_model(seed=4, dtype=dtype, **geometry)
    options.apply_linear_kernel(model, kernel)
    apply_fused_layers(model, True)
    ids = torch.tensor([[3 + (11 * i) % 90 for i in range(150)]])

    def forwards(splits):
        cache, start = kv_cache.new_cache(model.config, preallocated=True, reserve=160), 0
        with torch.inference_mode():
            for end in splits:
                out = model(input_ids=ids[:, start:end], cache=cache).logits[0, -1]
                start = end
        return out, [layer.keys[:, :, :150].clone() for layer in cache.layers]

    whole, whole_keys = forwards([150])
    assert _native_calls(lambda: forwards([150])) == STACK  # the prefill ran natively
    for splits in ([149, 150], [1, 65, 150]):
        logits, keys = forwards(splits)
        assert torch.equal(logits, whole), splits
        assert all(torch.equal(a, b) for a, b in zip(keys, whole_keys)), splits


@pytest.mark.parametrize(
    ("kernel", "geometry"),
    [("streaming", {}), ("streaming_panels", {}), ("streaming", PAIRED), ("streaming_panels", PAIRED)],
)
def test_in_bfloat16_the_fused_target_follows_transformers_and_speculation_decodes_its_own_greedy_output(
    kernel, geometry
):
    """bfloat16: the fused layer's logits follow transformers' bfloat16 layers to bfloat16 rounding;
    with the streaming kernel for every product (its weights as they are, or in pairs for AMX's
    tiles) a row's logits do not depend on the rows beside it, so greedy prompt lookup decodes
    exactly what one-row greedy steps of the same target decode (transformers' generate, on a
    preallocated cache), and the equivalence gate finds every tree row bit-identical to its path
    decoded sequentially. Heads of 64 dimensions as well: where the CPU has AMX, their attention
    runs on its tiles too."""
    prompt = [3 + (7 * i) % 40 for i in range(30)] * 2
    plain, fused = (build_tiny_model(seed=5, dtype=torch.bfloat16, **geometry) for _ in range(2))
    options.apply_linear_kernel(fused, kernel)
    assert apply_fused_layers(fused, True) == len(decoder_layers(fused))
    ids = torch.tensor([prompt[:20]])

    def prefill(model):
        return model(input_ids=ids, cache=kv_cache.new_cache(model.config, preallocated=True)).logits

    with torch.inference_mode():
        logits = [prefill(plain), prefill(fused)]
        assert _native_calls(lambda: prefill(fused)) == STACK
    assert logits[1].dtype == torch.bfloat16
    torch.testing.assert_close(logits[1].float(), logits[0].float(), rtol=2**-6, atol=2**-6)
    backend = CausalLMBackend(fused)
    tokens = greedy_lookup_tokens(backend, prompt)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        cache = kv_cache.new_cache(fused.config, preallocated=True, reserve=len(prompt) + 41)
        ref = fused.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False, cache=cache)
    assert tokens == ref[0, len(prompt) :].tolist() and len(tokens) == 40
    gate = equivalence_gate(backend, prompt)  # its sequential reference runs the same native forward
    assert gate["status"] == "passed" and gate["tree_max_abs_logit_diff"] == 0.0


@pytest.mark.parametrize(("dtype", "kernel"), [(torch.float32, "streaming"), (torch.bfloat16, "streaming_panels")])
def test_a_wide_tree_s_rows_are_the_bits_of_their_paths_decoded_in_order(dtype, kernel):
    """Twelve siblings and then a path five deep: the deep path's rows sit after the siblings, so its
    ancestors are at other cache positions than the same tokens decoded in order, and over prefixes
    of 44-62 tokens the tree's rows cross a multiple of 64 keys that the path does not. Each row's
    logits must be the bits of its path decoded sequentially (a reduction over keys that depends on
    their positions, such as one in blocks of keys, breaks this; heads of 64 dimensions). Over
    prefixes of 70-133 tokens as well, with a path 36 deep: on AMX bfloat16 attention sums most of a
    row's keys on tiles, steps of 32 keys that must hold the path's keys as the sequential decode
    holds them (past a hole in the mask for the deepest rows)."""
    backends = {}
    for seed in (5, 6):
        model = build_tiny_model(seed=seed, dtype=dtype, **PAIRED)
        options.apply_linear_kernel(model, kernel)
        apply_fused_layers(model, True)
        backends[seed] = CausalLMBackend(model)
    cases = [(seed, n, 5) for seed in (5, 6) for n in range(44, 64, 2)] + [(5, n, 36) for n in (70, 94, 133)]
    for seed, prefix_len, depth in cases:
        backend = backends[seed]
        ids = [3 + (7 * i + i // 3) % 40 for i in range(prefix_len)]
        deep = [ids[-1], 21] + [30 + k % 9 for k in range(depth - 1)]
        tree = _tree([[ids[-1], 10 + k] for k in range(12)] + [deep], prefix_len)
        assert tree.num_rows == 12 + depth and max(int(d) for d in tree.depths) == depth + 1
        with torch.inference_mode():
            out = backend.verify_one(backend.prefill_one(ids), ids[-1], tree)
            for row in range(tree.num_rows):
                sequence = ids + [int(tree.token_ids[x]) for x in tree.path_to(row)]
                alone = backend.forward_rows(backend.new_state(), sequence, list(range(len(sequence))), None)
                assert torch.equal(out.logits[row + 1], alone.logits[-1]), (seed, prefix_len, row)


def test_a_fused_layer_reads_its_weights_panels_again_when_a_weight_changes_or_is_replaced():
    from harness.target.fused_layers import _parameters

    model = build_tiny_model(seed=7)
    options.apply_linear_kernel(model, "streaming_panels")
    apply_fused_layers(model, True)
    layer = decoder_layers(model)[0]
    q, down = layer.self_attn.q_proj, layer.mlp.down_proj
    first = _parameters(layer)[0]
    assert torch.equal(first[1], options.weight_panels(q.weight)) and first[1].dim() == 3
    bf16 = build_tiny_model(seed=7, dtype=torch.bfloat16)  # bfloat16: the seven products in pairs
    options.apply_linear_kernel(bf16, "streaming_panels")
    apply_fused_layers(bf16, True)
    assert [w.dim() for w in _parameters(decoder_layers(bf16)[0])[0]] == [1, 4, 4, 4, 4, 1, 4, 4, 4]
    assert _parameters(layer)[0][1] is first[1]  # kept between forwards
    with torch.no_grad():
        q.weight.mul_(2)  # in place: a new version
    assert torch.equal(_parameters(layer)[0][1], 2 * first[1])
    down.weight = torch.nn.Parameter(torch.ones_like(down.weight), requires_grad=False)  # replaced
    assert _parameters(layer)[0][8].eq(1).all()
    down.weight.data = torch.full_like(down.weight, 3.0)  # new storage under the same parameter
    assert _parameters(layer)[0][8].eq(3).all()
    options.apply_linear_kernel(model, "streaming")  # another kernel: the weights as they are, no copies kept
    assert _parameters(layer)[0][1].dim() == 2 and "_harness_panel_weights" not in layer.__dict__


def test_a_checkpoint_s_own_class_named_like_llama_s_layer_runs_its_own_forward():
    """Remote code that subclassed the layer under the same name, with another forward, was fused
    by its name: both arms ran the native Llama layer, every gate passed, and the tokens were not
    the model's."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Transformers

    class LlamaDecoderLayer(Transformers):  # what a checkpoint's modeling file may define
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states, *args, **kwargs) * 3

    model = build_tiny_model(seed=0)
    layers = decoder_layers(model)
    assert all(fusable(layer) is None for layer in layers)
    layers[0].__class__ = LlamaDecoderLayer
    assert fusable(layers[0]).endswith("is not transformers' own LlamaDecoderLayer (the checkpoint's code defines it)")
    assert apply_fused_layers(model, True) == len(layers) - 1
    assert fused_layers_of(model) == len(layers) - 1 and not fused_stack_of(model)
