"""The equivalence gate's tolerance in half precision scales with the magnitude it compares (units in
the last place), so reduction-order noise passes while a wrong context or position fails."""

from __future__ import annotations

import pytest
import torch

from harness.gates.equivalence import EQUIVALENCE_ATOL, equivalence_gate, tolerance
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model

FIB = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def test_half_precision_tolerance_is_counted_in_ulps_of_the_largest_magnitude():
    assert tolerance(torch.float32, 40.0) == EQUIVALENCE_ATOL[torch.float32] == 2e-3  # absolute
    assert tolerance(torch.bfloat16, 37.0) == 8 * 2**-7 * 32 == 2.0  # 8 ulps at [32, 64)
    assert tolerance(torch.float16, 36.8) == 16 * 2**-10 * 32 == 0.5  # 16 ulps at [32, 64)
    # small values: ulps at their own magnitude (a fixed 0.25 floor was most of a tiny model's range)
    assert tolerance(torch.bfloat16, 1.5) == 8 * 2**-7 == 0.0625
    assert tolerance(torch.bfloat16, 0.42) == 8 * 2**-7 * 2**-2
    assert tolerance(torch.bfloat16, 0.0) == EQUIVALENCE_ATOL[torch.bfloat16]  # nothing to count ulps at


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_tiny_model_passes_and_a_shifted_row_fails(dtype, monkeypatch):
    model = build_tiny_model(seed=0, dtype=dtype)
    backend = CausalLMBackend(model)
    prompt = list(range(3, 40))
    ev = equivalence_gate(backend, prompt)
    assert ev["status"] == "passed", ev
    real = CausalLMBackend.verify_one

    def wrong_row(self, seq, last, tree):  # WRONG: one row's logits moved as a position error moves them
        out = real(self, seq, last, tree)
        out.logits[2] += 4 * ev["tolerance"]
        return out

    monkeypatch.setattr(CausalLMBackend, "verify_one", wrong_row)
    assert equivalence_gate(backend, prompt)["status"] == "failed"


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_smollm2_in_half_precision_passes_the_gate_and_a_position_error_fails_it(dtype, monkeypatch):
    """On this prompt the bfloat16 tree forward differs from the sequential one by 0.59 (2.4 ulps,
    more than a fixed 0.25 would admit); a position off by one moves a logit by ~4.3."""
    from harness.target.loading import load_model

    lm = load_model(name="smollm2", dtype=dtype)
    backend = CausalLMBackend(lm.model)
    ids = lm.tokenizer(FIB)["input_ids"]
    ev = equivalence_gate(backend, ids)
    assert ev["status"] == "passed" and ev["tree_max_abs_logit_diff"] > 0, ev
    assert ev["tolerance"] < 4.3  # a position error (measured in float32: 4.30) is still caught
    real = CausalLMBackend.verify_one

    def shifted(self, seq, last, tree):
        out = real(self, seq, last, tree)
        out.logits[1, int(out.logits[1].argmax())] += 4.3
        return out

    monkeypatch.setattr(CausalLMBackend, "verify_one", shifted)
    assert equivalence_gate(backend, ids)["status"] == "failed"


def test_the_gate_tree_branches_whatever_the_prompt_s_tail():
    """The gate's tree was built from the prompt's last seven tokens: a tail of one repeated token
    folded it into a three-row chain, with no sibling whose attention could leak. It takes seven
    distinct tokens now (the tail's, then ids the tail lacks): eight rows, three siblings under one
    parent, one token under two parents, whatever the text; the evidence names the rows."""
    from harness.contracts import ProposalResult
    from harness.gates.equivalence import GATE_TREE_ROWS, _paths_from
    from harness.topology.compiler import compile_tree

    for tail in ([5] * 7, [5, 6] * 4, list(range(10, 20))):
        paths = _paths_from(tail, vocab_size=64)
        tree = compile_tree([ProposalResult.from_paths(paths, source="gate", manifest_hash="gate")], prefix_len=9)
        assert tree.num_rows == GATE_TREE_ROWS == 8
        assert max(len(tree.children(r)) for r in range(-1, tree.num_rows)) == 3
        tokens = [int(t) for t in tree.token_ids]
        assert len(set(tokens)) == 7 and any(tokens.count(t) == 2 for t in tokens)  # B under A and under X
    assert set(_paths_from([5] * 7, vocab_size=64)[0]) <= {5, 0, 1, 2, 3, 4, 6}
    backend = CausalLMBackend(build_tiny_model(seed=0))
    ev = equivalence_gate(backend, [7] * 20)
    assert ev["status"] == "passed" and ev["tree_rows"] == 8


def test_the_gate_stays_inside_the_runs_context_limit():
    """The gate kept 48 prompt tokens and added twelve positions whatever the run's limit: a model of
    fewer positions (a sliding window, a longrope switch, GPT-2's table) failed or crashed in the gate
    though the run fit. Its prompt and rounds are fitted to the limit now, and a vocabulary of fewer
    than seven ids folds the tree rather than failing."""
    from harness.gates.equivalence import batched_equivalence_gate, fit_to_positions

    assert fit_to_positions(None, 48, 3) == (48, 3)
    assert fit_to_positions(512, 48, 3) == (48, 3)
    assert fit_to_positions(40, 48, 3) == (28, 3)
    assert fit_to_positions(9, 48, 3) == (5, 1)
    backend = CausalLMBackend(build_tiny_model(seed=0))
    prompt = list(range(3, 60))
    ev = equivalence_gate(backend, prompt, positions=40)
    assert ev["status"] == "passed" and ev["last_position"] <= 39 and ev["prompt_tokens"] == 20  # five rounds
    assert equivalence_gate(backend, prompt, positions=9)["last_position"] <= 8  # the chain round too
    assert batched_equivalence_gate(backend, [prompt, prompt[5:]], positions=9)["last_position"] <= 8
    assert equivalence_gate(backend, prompt)["last_position"] > 40  # unlimited: the whole 48 and five rounds
    batched = batched_equivalence_gate(backend, [prompt, prompt[5:]], positions=40)
    assert batched["status"] == "passed" and batched["last_position"] <= 39
    small = CausalLMBackend(build_tiny_model(seed=0, vocab_size=4))
    assert equivalence_gate(small, [1, 2, 3, 1, 2])["status"] == "passed"


def test_the_batched_gate_drops_a_request_as_a_run_does_and_a_broken_drop_fails_it(monkeypatch):
    """Every batched run compacts the cache when a request finishes; the gate never dropped one, so a
    backend whose compaction kept the wrong rows passed it. It drops the first request after round 1
    now, and keeps checking the others against their sequences decoded alone."""
    from harness.gates.equivalence import batched_equivalence_gate
    from harness.target.backend import cache_layers

    backend = CausalLMBackend(build_tiny_model(seed=0))
    prompts = [list(range(3, 40)), list(range(5, 30)), list(range(7, 50))]
    ev = batched_equivalence_gate(backend, prompts)
    assert ev["status"] == "passed" and ev["dropped_after_round_1"] == 1 and ev["batch_size"] == 3
    # a batch of more requests than the prompt cut was made for: every prompt kept (one emptied raised)
    many = batched_equivalence_gate(backend, [list(range(3, 60))] * 10 + [[5, 6]])
    assert many["status"] == "passed" and min(many["prompt_tokens"]) == 2
    real = CausalLMBackend.drop

    def stale_values(self, state, batch_rows):  # WRONG: the requests left keep the batch's first values
        before = [layer.values.clone() for layer in cache_layers(state.cache)]
        real(self, state, batch_rows)
        for layer, old in zip(cache_layers(state.cache), before):
            layer.values = old[: layer.values.shape[0], :, : layer.values.shape[2]].contiguous()

    monkeypatch.setattr(CausalLMBackend, "drop", stale_values)
    assert batched_equivalence_gate(backend, prompts)["status"] == "failed"


def _stale_commit(kind: str):
    """WRONG (test-only): a commit that leaves the next, rejected row's KV in the last slot it keeps:
    after a contiguous path (its rows already in place) or after the empty path (the pending slot)."""
    from harness.target.backend import cache_layers

    real = CausalLMBackend.commit

    def commit(self, state, accepted_rows):
        base = state.phys_len - state.provisional_rows
        for i, acc in enumerate(accepted_rows):
            acc = list(acc)
            if kind == "contiguous" and acc and acc == list(range(len(acc))) and len(acc) + 1 < state.provisional_rows:
                slot = base + len(acc)
            elif kind == "empty" and not acc and state.provisional_rows > 1:
                slot = base
            else:
                continue
            for layer in cache_layers(state.cache):
                layer.keys[i, :, slot] = layer.keys[i, :, slot + 1]
                layer.values[i, :, slot] = layer.values[i, :, slot + 1]
        return real(self, state, accepted_rows)

    return commit


def test_the_gate_commits_a_non_contiguous_a_contiguous_and_an_empty_path():
    """Each kind of commit keeps other slots: a non-contiguous path moves rows, a contiguous one keeps
    them in place and drops the row after them, the empty path keeps the pending token only."""
    from harness.contracts import ProposalResult
    from harness.gates.equivalence import COMMIT_KINDS, _paths_from, batched_equivalence_gate, commit_rows
    from harness.topology.compiler import compile_tree

    tree = compile_tree(
        [ProposalResult.from_paths(_paths_from(list(range(3, 40)), 64), source="g", manifest_hash="g")],
        prefix_len=10,
    )
    deep, contiguous = commit_rows(tree, "deep"), commit_rows(tree, "contiguous")
    assert deep != list(range(len(deep)))  # skips a sibling
    assert len(contiguous) > 1 and contiguous == list(range(len(contiguous))) and len(contiguous) < tree.num_rows
    assert commit_rows(tree, "empty") == []
    backend = CausalLMBackend(build_tiny_model(seed=0))
    ev = equivalence_gate(backend, list(range(3, 40)))
    assert ev["status"] == "passed" and ev["commits"] == ["deep", "contiguous", "empty", "deep", "deep"]
    assert set(COMMIT_KINDS) == {"deep", "contiguous", "empty"}
    # the batched gate: the empty path and a contiguous path with a rejected row after it, on a request
    # that stays in the batch and is verified again after it
    seen = []
    real = CausalLMBackend.commit

    def record(self, state, accepted_rows):
        rows = state.provisional_rows - 1
        seen.extend((rid, list(acc), rows) for rid, acc in zip(state.request_ids, accepted_rows))
        return real(self, state, accepted_rows)

    CausalLMBackend.commit = record
    try:
        batched = batched_equivalence_gate(backend, [list(range(3, 40)), list(range(5, 30))])
    finally:
        CausalLMBackend.commit = real
    assert batched["status"] == "passed" and batched["dropped_after_round_1"] == 1
    assert batched["commits"] == [["empty", "deep"], ["deep"], ["deep"], ["empty"], ["contiguous"]]
    stays = [(acc, rows) for rid, acc, rows in seen if rid != 0]
    assert [] in [acc for acc, _ in stays]
    assert any(acc and acc == list(range(len(acc))) and len(acc) < rows for acc, rows in stays)


@pytest.mark.parametrize("kind", ["contiguous", "empty"])
def test_a_commit_that_keeps_a_rejected_row_fails_the_gate(kind, monkeypatch):
    """A commit whose last kept slot holds the next, rejected row's KV passed while the gate committed
    only non-contiguous paths; the contiguous and the empty path, and the forward after each, show it."""
    from harness.gates.equivalence import batched_equivalence_gate

    backend = CausalLMBackend(build_tiny_model(seed=0))
    prompts = [list(range(3, 40)), list(range(5, 30))]
    assert equivalence_gate(backend, prompts[0])["status"] == "passed"
    monkeypatch.setattr(CausalLMBackend, "commit", _stale_commit(kind))
    ev = equivalence_gate(backend, prompts[0])
    assert ev["status"] == "failed" and ev["commit_max_abs_kv_diff"] > ev["cache_tolerance"], ev
    batched = batched_equivalence_gate(backend, prompts)
    if kind == "contiguous":
        assert batched["status"] == "failed", batched
    else:  # the stale pending slot moves the next row's logits by ~1e-4, inside float32's 2e-3
        assert 0 < batched["max_abs_logit_diff"] <= batched["tolerance"], batched
