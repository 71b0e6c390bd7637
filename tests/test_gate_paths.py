"""The statistical gate's shared computations, piece by piece: target rows by path (equal to a
tree's own verify forward), verifiers served row by row (the same selection as on the whole
tensor, for every verifier the gate runs), draws replayed across passes (equal to drawing again),
and the law table's passes (a proposal stops where a law is missing and resumes after a fill)."""

from __future__ import annotations

import pytest
import torch

from harness.contracts import Budget
from harness.gates.statistical import AllRowsNeeded, LazyRows, RowPending
from harness.proposers.memo import LawPending, LawTable, ReplayingSource
from harness.proposers.sampling import sample_tree_proposal
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.target.paths import PathRows
from harness.topology.compiler import compile_tree
from harness.verifiers import broken  # noqa: F401  (registers the oracles' broken verifier)
from harness.verifiers.base import get_verifier

PROMPT = [3, 17, 42, 5, 9, 11, 2, 8]


@pytest.fixture(scope="module")
def backend():
    return CausalLMBackend(build_tiny_model(seed=0))


def sampled_tree(widths, relation, seed, vocab=64):
    """A proposal tree drawn level by level from fixed random laws (one per prefix)."""
    laws: dict[tuple, torch.Tensor] = {}

    def q_level(prefixes):
        out = []
        for p in prefixes:
            if p not in laws:
                g = torch.Generator().manual_seed(hash(p) % (2**31))
                laws[p] = torch.softmax(torch.randn(vocab, generator=g) * 2, dim=-1)
            out.append(laws[p])
        return torch.stack(out)

    proposal = sample_tree_proposal(q_level, widths=widths, relation=relation, rng=TorchRandomSource(seed))
    return compile_tree([proposal], prefix_len=len(PROMPT))


def test_rows_by_path_equal_the_trees_own_verify_forward(backend):
    tree = sampled_tree((2, 2, 1), "iid", seed=1)
    state = backend.prefill_one(PROMPT)
    whole = backend.verify_one(state, PROMPT[-1], tree).logits  # [1 + N, V]
    backend.rollback(state)
    root = (PROMPT[-1],)
    paths = [root] + [root + p for p in tree.full_prefixes]
    # deepest rows first, one row per forward: their ancestors come in earlier forwards
    rows = PathRows(backend, backend.prefill_one(PROMPT), rows_per_forward=1)
    deepest = max(paths, key=len)
    assert rows.compute([deepest]) == len(deepest)
    assert rows.compute(paths) == len(paths) - len(deepest)
    assert rows.compute(paths) == 0  # nothing twice
    for i, path in enumerate(paths):
        torch.testing.assert_close(rows[path], whole[i], rtol=1e-4, atol=1e-4)
    assert rows.rows_computed == len(paths) == rows.forwards
    # all at once, many rows per forward: the same rows
    together = PathRows(backend, backend.prefill_one(PROMPT))
    together.compute(paths)
    assert together.forwards == 1
    for path in paths:
        torch.testing.assert_close(together[path], rows[path], rtol=1e-4, atol=1e-4)


def test_a_path_holds_its_own_token(backend):
    with pytest.raises(ValueError, match="its own token"):
        PathRows(backend, backend.prefill_one(PROMPT)).compute([()])


#: every verifier the gate runs at T > 0, with a tree it admits
VERIFIERS = [
    ("membership", (2, 2, 1), "iid"),
    ("rejection", (1, 1, 1, 1), "iid"),
    ("specinfer", (3, 2), "iid"),
    ("sequoia", (3, 2), "without_replacement"),
    ("naive_multi_draft", (3, 2), "iid"),  # the oracles' broken verifier: the gate must serve it too
    ("typical", (2, 2, 1), "iid"),  # reads every row at once: served the whole tensor
]


@pytest.mark.parametrize("name,widths,relation", VERIFIERS, ids=[v[0] for v in VERIFIERS])
def test_a_verifier_served_row_by_row_selects_as_on_the_whole_tensor(name, widths, relation):
    from harness.verifiers.base import VERIFIERS as REGISTRY

    verifier = REGISTRY[name]()
    for seed in range(40):
        tree = sampled_tree(widths, relation, seed)
        vocab = tree.q_dists.shape[1]
        g = torch.Generator().manual_seed(1000 + seed)
        target = torch.softmax(torch.randn(1 + tree.num_rows, vocab, generator=g) * 2, dim=-1)  # [1 + N, V]
        expected = verifier.select(tree, target, TorchRandomSource(seed))
        # the gate's passes: only the frontier row at first, a stopped selection retried from its
        # random source's state once the row it reached is there
        paths = [()] + list(tree.full_prefixes)
        have = {(): target[0]}
        rng = TorchRandomSource(seed)
        state = rng.generator.get_state()
        stops = 0
        while True:
            rng.generator.set_state(state)
            rows = target if len(have) == len(paths) else LazyRows(paths, have.get)
            try:
                got = verifier.select(tree, rows, rng)
                break
            except RowPending as pend:
                stops += 1
                have[pend.path] = target[paths.index(pend.path)]
            except AllRowsNeeded:
                stops += 1
                have = {p: target[i] for i, p in enumerate(paths)}
        assert got == expected
        assert stops <= tree.num_rows


def test_lazy_rows_refuse_any_use_but_one_row_at_a_time():
    rows = LazyRows([(), (5,)], {(): torch.full((4,), 0.25)}.get)
    assert rows[0].sum() == 1 and len(rows) == 2
    with pytest.raises(RowPending):
        rows[1]
    with pytest.raises(IndexError):
        rows[2]
    for use in (lambda r: r.argmax(dim=-1), lambda r: r[0:1], lambda r: r.shape, lambda r: torch.stack([r])):
        with pytest.raises(AllRowsNeeded):
            use(rows)


def test_replayed_draws_equal_drawing_again_and_a_changed_law_is_caught():
    q = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), dim=-1)
    fresh = TorchRandomSource(7)
    expected = [fresh.categorical(q), fresh.bernoulli(0.3), fresh.categorical(q)]
    replay = ReplayingSource(TorchRandomSource(7))
    assert [replay.categorical(q), replay.bernoulli(0.3)] == expected[:2]
    replay.rewind()  # proposed again: the first two replayed, the third drawn after them
    assert [replay.categorical(q), replay.bernoulli(0.3), replay.categorical(q)] == expected
    assert fresh.categorical(q) == replay.categorical(q)  # both sources are at the same place
    replay.rewind()
    with pytest.raises(RuntimeError, match="drew differently"):
        replay.categorical(torch.roll(q, 1))


def test_a_law_table_stops_a_proposal_at_a_missing_law_and_serves_it_after_a_fill(backend):
    table = LawTable(PathRows(backend, backend.prefill_one(PROMPT), transform=lambda x: torch.softmax(x, -1)), PROMPT)

    def propose():
        return sample_tree_proposal(table.level, widths=(1, 1, 1), relation="iid", rng=TorchRandomSource(3))

    fills = 0
    while True:
        try:
            proposal = propose()
            break
        except LawPending:
            fills += 1
            assert table.fill() == 1  # one law a pass: the chain's next depth
    assert fills == 3 and len(proposal.nodes) == 3
    # the laws it was served are the draft rows at its prefixes
    tokens = [n.token_id for n in proposal.nodes]
    for d in range(3):
        torch.testing.assert_close(proposal.q_dists[d], table.rows[(PROMPT[-1], *tokens[:d])])
    with pytest.raises(ValueError, match="one prefix"):
        table.check(PROMPT[:-1])


def test_the_gate_on_a_draft_chain_runs_in_passes_and_computes_each_path_once():
    from harness.gates.statistical import chi_square_test
    from harness.proposers.draft_model import DraftModelProposer
    from harness.verifiers.sampling import SamplingPolicy

    policy = SamplingPolicy(temperature=1.0)
    target = CausalLMBackend(build_tiny_model(seed=0))
    draft = CausalLMBackend(build_tiny_model(seed=1, num_layers=1))
    proposer = DraftModelProposer(
        budget=Budget(shape="sequence", max_nodes=3, max_depth=3), manifest_hash="t", policy=policy, backend=draft
    )
    out = chi_square_test(
        backend=target,
        proposer=proposer,
        verifier=get_verifier("rejection"),
        policy=policy,
        prompt_ids=PROMPT,
        samples=300,
        top_m=8,
        alpha=1e-3,
        stream=0,
        max_nodes=3,
        max_depth=3,
        batch=16,
    )
    assert out["proposal_passes"] == 4  # the root's law, then one depth per pass
    assert out["law_hits"] >= 300 * 3
    # each distinct path's law computed once: never more rows than the distinct trees hold
    assert 1 <= out["law_rows"] <= 1 + 3 * out["distinct_trees"]
    assert out["target_rows"] <= 1 + 3 * out["distinct_trees"]
    assert out["verify_passes"] >= 2 and sum(out["observed"]) == 300
