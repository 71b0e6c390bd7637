"""Tree-attention equivalence, commit equivalence and KV accounting on the tiny model."""

import pytest
import torch

from harness.contracts import ProposalResult
from harness.target.backend import CausalLMBackend, kv_bytes_per_token
from harness.topology.compiler import compile_tree


def det_proposal(paths):
    return ProposalResult.from_paths(paths, source="test", manifest_hash="test")


def sequential_logits(model, tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0]


PROMPT = [1, 5, 9, 14, 3, 7, 22, 8]
PATHS = [[10, 11, 12], [10, 11, 13], [10, 11, 40], [10, 15], [30, 11]]  # proposal-buffer trace: A B {C,D,E}, A F, X B


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tree_rows_match_sequential_decoding(dtype):
    from harness.target.loading import build_tiny_model

    model = build_tiny_model(seed=1, dtype=dtype)
    backend = CausalLMBackend(model)
    seq = backend.prefill_one(PROMPT)
    tree = compile_tree([det_proposal(PATHS)], prefix_len=len(PROMPT))
    assert tree.num_rows == 8
    out = backend.verify_one(seq, PROMPT[-1], tree)
    # the verify input is [pending] + rows over a cache holding the prompt minus the pending token
    assert out.logits.shape[0] == 1 + tree.num_rows
    assert seq.phys_len == len(PROMPT) - 1 + 1 + tree.num_rows  # provisional until committed
    assert seq.cache_len == len(PROMPT) - 1
    full = sequential_logits(model, PROMPT)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose(out.logits[0], full[-1], atol=tol)
    for r in range(tree.num_rows):
        path_tokens = [int(tree.token_ids[x]) for x in tree.path_to(r)]
        ref = sequential_logits(model, PROMPT + path_tokens)[-1]
        assert torch.allclose(out.logits[1 + r], ref, atol=tol), f"row {r} path {path_tokens}"


def test_commit_non_contiguous_path_equals_sequential_cache(tiny_model):
    backend = CausalLMBackend(tiny_model)
    seq = backend.prefill_one(PROMPT)
    committed = list(PROMPT)
    for round_paths, accept_path in [
        (PATHS, [10, 11, 13]),  # A -> B -> D: rows 0, 1, 3 (non-contiguous)
        ([[4, 4, 4], [4, 6]], [4, 6]),
        ([[50, 51], [52]], [52]),
    ]:
        tree = compile_tree([det_proposal(round_paths)], prefix_len=len(committed))
        backend.verify_one(seq, committed[-1], tree)
        rows, node = [], -1
        for tok in accept_path:
            node = next(c for c in tree.children(node) if int(tree.token_ids[c]) == tok)
            rows.append(node)
        backend.commit_one(seq, rows)
        committed += accept_path + [7]  # 7 plays the correction token (pending next round)
        assert seq.cached_tokens == committed[:-1]
    ref = backend.prefill_one(committed)
    assert seq.cache_len == ref.cache_len
    for a, b in zip(seq.cache.layers, ref.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5)
        assert torch.allclose(a.values, b.values, atol=1e-5)


def test_temp_kv_bytes_equals_formula(tiny_model):
    backend = CausalLMBackend(tiny_model)
    seq = backend.prefill_one(PROMPT)
    tree = compile_tree([det_proposal(PATHS)], prefix_len=len(PROMPT))
    out = backend.verify_one(seq, PROMPT[-1], tree)
    cfg = tiny_model.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert kv_bytes_per_token(tiny_model) == per_token
    # the verify forward adds the pending token's row plus N candidate rows
    assert out.kv_bytes_added - per_token == tree.num_rows * per_token


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_grouped_tree_attention_matches_sequential_decoding_and_stock_sdpa(dtype):
    """harness_sdpa folds grouped query heads into rows (no K/V copies) and takes boolean tree masks:
    every tree row still equals its path decoded sequentially, batched requests included."""
    from harness.target.loading import load_model

    grouped = load_model(name="tiny", dtype=dtype, seed=3, attn_implementation="harness_sdpa").model
    stock = load_model(name="tiny", dtype=dtype, seed=3, attn_implementation="sdpa").model
    assert grouped.config._attn_implementation == "harness_sdpa" and stock.config._attn_implementation == "sdpa"
    assert grouped.config.num_attention_heads // grouped.config.num_key_value_heads == 2  # grouped queries
    tol = 1e-4 if dtype == "float32" else 1e-10
    tree = compile_tree([det_proposal(PATHS)], prefix_len=len(PROMPT))
    outs = []
    for model in (grouped, stock):
        backend = CausalLMBackend(model)
        out = backend.verify_one(backend.prefill_one(PROMPT), PROMPT[-1], tree)
        outs.append(out.logits)
        for r in range(tree.num_rows):
            path = [int(tree.token_ids[x]) for x in tree.path_to(r)]
            assert torch.allclose(out.logits[1 + r], sequential_logits(model, PROMPT + path)[-1], atol=tol)
    assert torch.allclose(outs[0], outs[1], atol=tol)
    # two ragged requests in one forward (holes and padding masked) through the grouped kernel
    backend = CausalLMBackend(grouped)
    short = PROMPT[:5]
    state = backend.prefill([PROMPT, short])
    trees = [tree, compile_tree([det_proposal([[10, 11]])], prefix_len=len(short))]
    res = backend.verify(state, [PROMPT[-1], short[-1]], trees)
    assert torch.allclose(res.logits[0], outs[0], atol=tol)
    assert torch.allclose(res.logits[1][2], sequential_logits(grouped, short + [10, 11])[-1], atol=tol)


def test_a_commit_moves_the_same_slots_natively_as_with_torch_in_every_layer(monkeypatch):
    """Where every layer's cache is a preallocated one and the native kernels are loaded, a commit
    moves its accepted rows in every layer's key and value buffers in one native call; elsewhere
    torch gathers and scatters them layer by layer. Both must leave the same bits in every slot of
    every buffer, for two requests with paths of different lengths, contiguous and not, over
    several rounds."""
    from harness.target import backend as backend_module
    from harness.target import native
    from harness.target.kv_cache import PreallocatedLayer
    from harness.target.loading import build_tiny_model

    if native.native_kernels_problem() is not None:
        pytest.skip("the native kernels do not build here")
    calls = []
    native_move = torch.ops.harness.move_slots
    rounds = [
        ([PATHS, [[4, 4, 4], [4, 6]]], [[0, 1, 3], [1, 2]]),  # non-contiguous and contiguous paths
        ([[[50, 51], [52]], PATHS], [[2], []]),
        ([[[9, 9, 9]], [[30, 11], [10, 15]]], [[0, 1, 2], [2, 3]]),
    ]
    buffers = {}
    for native_on in (True, False):
        monkeypatch.setattr(backend_module, "native_kernels_loaded", lambda on=native_on: on)
        model = build_tiny_model(seed=1)
        backend = CausalLMBackend(model)
        prompts = [PROMPT, PROMPT[:5]]
        state = backend.prefill(prompts, reserve=32)
        assert all(isinstance(layer, PreallocatedLayer) for layer in state.cache.layers)
        committed = [list(p) for p in prompts]
        for paths, accepted in rounds:
            trees = [compile_tree([det_proposal(p)], prefix_len=len(c)) for p, c in zip(paths, committed)]
            backend.verify(state, [c[-1] for c in committed], trees)
            with monkeypatch.context() as m:
                m.setattr(torch.ops.harness, "move_slots", lambda *a: calls.append(1) or native_move(*a))
                backend.commit(state, accepted)
            for i, (tree, rows) in enumerate(zip(trees, accepted)):
                committed[i] += [int(tree.token_ids[r]) for r in rows] + [7]
        buffers[native_on] = [
            (layer._key_buffer.clone(), layer._value_buffer.clone(), layer.get_seq_length())
            for layer in state.cache.layers
        ]
    assert calls, "the native move never ran"
    for (k1, v1, n1), (k2, v2, n2) in zip(buffers[True], buffers[False]):
        assert n1 == n2
        assert torch.equal(k1[:, :, :n1], k2[:, :, :n2]) and torch.equal(v1[:, :, :n1], v2[:, :, :n2])


def test_move_slots_refuses_a_slot_outside_any_buffer_before_writing_one():
    from harness.target import native

    if native.native_kernels_problem() is not None:
        pytest.skip("the native kernels do not build here")
    big, small = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 4, 4)
    before = [big.clone(), small.clone()]
    with pytest.raises(RuntimeError, match="inside cap"):  # slot 5 fits the first buffer, not the second
        torch.ops.harness.move_slots([big, small], torch.tensor([[5]]), torch.tensor([[0]]))
    assert torch.equal(big, before[0]) and torch.equal(small, before[1])
    torch.ops.harness.move_slots([big], torch.tensor([[5, 6]]), torch.tensor([[1, 2]]))
    assert torch.equal(big[:, :, 1:3], before[0][:, :, 5:7]) and torch.equal(big[:, :, 5:], before[0][:, :, 5:])


def test_a_candidate_id_past_the_target_s_embedding_is_refused_naming_its_row_and_source(tiny_model):
    """Compilation does not know the vocabulary: an id past it crashed the forward's embedding
    lookup (a device-side assert on CUDA) naming neither the row nor the proposer."""
    from harness.contracts import ContractError

    backend = CausalLMBackend(tiny_model)
    seq = backend.prefill_one(PROMPT)
    past = backend.embedding_rows
    tree = compile_tree([det_proposal([[10, 11], [12, past]])], prefix_len=len(PROMPT))
    with pytest.raises(ContractError, match=rf"^batch row 0: candidate row 3 holds token id {past}, past the target's"):
        backend.verify_one(seq, PROMPT[-1], tree)
    assert seq.cache_len == len(PROMPT) - 1 and seq.provisional_rows == 0  # nothing was appended
    out = backend.verify_one(seq, PROMPT[-1], compile_tree([det_proposal([[10, 11]])], prefix_len=len(PROMPT)))
    assert out.logits.shape[0] == 3
