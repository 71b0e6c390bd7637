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
