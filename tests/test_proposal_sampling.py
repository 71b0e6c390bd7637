"""Proposal-side child sampling: the laws recorded are the laws sampled."""

from __future__ import annotations

import pytest
import torch

from harness.contracts import ContractError
from harness.gates.oracle import enumerate_marginal
from harness.proposers.sampling import (
    beam_tokens,
    sample_children,
    sample_tree_proposal,
    without_replacement_law,
)
from harness.random_source import TorchRandomSource
from harness.topology.compiler import compile_tree

Q_REF = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)


def _tokens(draws):
    return tuple(t for t, _ in draws)


def test_iid_pairs_have_product_law():
    marg = enumerate_marginal(lambda rng: _tokens(sample_children(Q_REF, 2, relation="iid", rng=rng)))
    assert len(marg) == 9  # all ordered pairs, duplicates included
    assert marg[(0, 0)] == pytest.approx(0.16, abs=1e-15)
    assert marg[(0, 2)] == pytest.approx(0.08, abs=1e-15)
    assert marg[(2, 2)] == pytest.approx(0.04, abs=1e-15)


def test_iid_draws_record_the_law_they_came_from():
    draws = sample_children(Q_REF, 3, relation="iid", rng=TorchRandomSource(0))
    assert len(draws) == 3
    for _, law in draws:
        assert torch.equal(law, Q_REF)


def test_without_replacement_renormalises_after_each_draw():
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    marg = enumerate_marginal(lambda rng: _tokens(sample_children(q, 2, relation="without_replacement", rng=rng)))
    assert set(marg) == {(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)}  # never a duplicate
    assert marg[(0, 1)] == pytest.approx(0.5 * 0.3 / 0.5, abs=1e-15)
    assert marg[(1, 0)] == pytest.approx(0.3 * 0.5 / 0.7, abs=1e-15)
    assert marg[(2, 1)] == pytest.approx(0.2 * 0.3 / 0.8, abs=1e-15)
    # the recorded law of the second draw after token 1: q without token 1
    law = without_replacement_law(q, [1])
    assert law.tolist() == pytest.approx([0.5 / 0.7, 0.0, 0.2 / 0.7], abs=1e-15)


def test_without_replacement_uniform_fallback_when_q_is_exhausted():
    q = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    draws = sample_children(q, 3, relation="without_replacement", rng=TorchRandomSource(3))
    assert draws[0][0] == 1
    # second draw: q has no mass left -> uniform over the unsampled tokens {0, 2, 3}
    assert draws[1][1].tolist() == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3], abs=1e-15)
    second = draws[1][0]
    expected_third = [0.0 if t in (1, second) else 0.5 for t in range(4)]
    assert draws[2][1].tolist() == pytest.approx(expected_third, abs=1e-15)
    marg = enumerate_marginal(lambda rng: _tokens(sample_children(q, 3, relation="without_replacement", rng=rng)))
    assert len(marg) == 6
    assert marg[(1, 0, 2)] == pytest.approx(1 / 6, abs=1e-15)


def test_without_replacement_falls_back_inside_the_domain_the_proposer_can_expand():
    """A draft whose vocabulary ends before the target's pads q with zeros past its own ids; once q's
    mass was used up, the uniform fallback drew ids the draft has no embedding for (an IndexError when
    the draft expanded them). The fallback stays inside ``domain``, and its law says so."""
    q = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # a 3-id draft's law, padded to 5
    law = without_replacement_law(q, [1], domain=3)
    assert law.tolist() == pytest.approx([0.5, 0.0, 0.5, 0.0, 0.0], abs=1e-15)
    marg = enumerate_marginal(
        lambda rng: _tokens(sample_children(q, 3, relation="without_replacement", rng=rng, domain=3))
    )
    assert marg == pytest.approx({(1, 0, 2): 0.5, (1, 2, 0): 0.5}, abs=1e-15)
    with pytest.raises(ValueError, match="4 draws without replacement from a vocabulary of 3"):
        sample_children(q, 4, relation="without_replacement", rng=TorchRandomSource(0), domain=3)
    # without a domain the whole vocabulary, as before
    assert without_replacement_law(q, [1]).tolist() == pytest.approx([0.25, 0.0, 0.25, 0.25, 0.25], abs=1e-15)


def test_without_replacement_refuses_more_draws_than_tokens():
    with pytest.raises(ValueError, match="4 draws without replacement from a vocabulary of 3"):
        sample_children(Q_REF, 4, relation="without_replacement", rng=TorchRandomSource(0))


def test_beam_is_deterministic_top_k_without_a_law():
    q = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    assert beam_tokens(q, 2) == [2, 0]  # tie 0.3/0.3: lowest index first, not [2, 1]
    draws = sample_children(q, 2, relation="beam", rng=TorchRandomSource(0))
    assert draws == [(2, None), (0, None)]


@pytest.mark.parametrize("seed", range(6))
def test_beam_tokens_equal_a_full_stable_sort_with_ties_and_zeros(seed):
    """The topk + boundary-tie path returns exactly what a full stable descending sort does,
    including ties straddling the k-th place and a law with fewer nonzeros than k."""
    g = torch.Generator().manual_seed(seed)
    for vocab in (5, 17, 300):
        levels = torch.randint(0, 4, (vocab,), generator=g).to(torch.float64)  # many exact ties, some zeros
        q = levels / levels.sum()
        reference = torch.sort(q, descending=True, stable=True).indices.tolist()
        for k in range(1, vocab + 1):
            assert beam_tokens(q, k) == reference[:k], (seed, vocab, k)
    assert beam_tokens(torch.tensor([0.0, 1.0, 0.0]), 3) == [1, 0, 2]


@pytest.mark.parametrize("levels", [4, None])
def test_beam_rows_give_each_rows_stable_top_k_with_its_values_in_one_read(levels):
    """Every row of a ``[F, V]`` law at once (EAGLE-2's level): each row's tokens a full stable sort's
    first ``k`` (ties past the ``2k`` read included), each with the value the row holds for it."""
    from harness.proposers.sampling import beam_rows

    g = torch.Generator().manual_seed(7)
    for vocab in (3, 17, 300):
        if levels is None:  # log-probabilities without ties, as a draft gives them
            q = torch.log_softmax(torch.randn(5, vocab, generator=g), dim=-1)
        else:
            q = torch.randint(0, levels, (5, vocab), generator=g).to(torch.float32)
        for k in (1, 2, 5, vocab):
            rows = beam_rows(q, k)
            assert len(rows) == 5
            for row, got in zip(q, rows):
                want = torch.sort(row, descending=True, stable=True).indices[: min(k, vocab)].tolist()
                assert [t for t, _ in got] == want
                assert [v for _, v in got] == [float(row[t]) for t in want]
    assert beam_rows(torch.zeros(2, 4), 0) == [[], []]


def test_bad_inputs_are_refused_at_the_boundary():
    with pytest.raises(ValueError, match="relation must be one of"):
        sample_children(Q_REF, 1, relation="nucleus", rng=TorchRandomSource(0))
    with pytest.raises(ContractError, match="sum to 1"):
        sample_children(torch.tensor([0.5, 0.6]), 1, relation="iid", rng=TorchRandomSource(0))


def _table(prefix_laws):
    def level(prefixes):
        return torch.stack([prefix_laws[p] for p in prefixes])

    return level


def test_tree_children_carry_the_law_of_their_own_prefix():
    laws = {
        (): torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64),
        (1,): torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
        (2,): torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64),
    }
    prop = sample_tree_proposal(_table(laws), widths=(2, 1), relation="without_replacement", rng=TorchRandomSource(0))
    assert prop.probability_semantics == "normalized_conditional"
    assert prop.sampling_relation == "without_replacement"
    assert prop.topology == "tree"
    roots = [n.token_id for n in prop.nodes if n.parent == -1]
    assert sorted(roots) == [1, 2]
    for i, node in enumerate(prop.nodes):
        if node.parent >= 0:
            parent_tok = prop.nodes[node.parent].token_id
            assert node.token_id == {1: 0, 2: 2}[parent_tok]  # conditional on its own prefix
            assert torch.equal(prop.q_dists[i], laws[(parent_tok,)])


def test_iid_duplicates_are_kept_but_expanded_once():
    laws = {(): torch.tensor([0.0, 1.0], dtype=torch.float64), (1,): torch.tensor([0.5, 0.5], dtype=torch.float64)}
    prop = sample_tree_proposal(_table(laws), widths=(2, 3), relation="iid", rng=TorchRandomSource(0))
    parents = [n.parent for n in prop.nodes]
    assert parents == [-1, -1, 0, 0, 0]  # two draws of token 1, three children below the first only
    tree = compile_tree([prop], 1)
    assert tree.num_rows <= 3
    assert len(tree.draws[0]) == 2 and tree.draws[0][0].row == tree.draws[0][1].row
    assert len(tree.draws[1]) == 3


def test_beam_tree_is_score_only():
    laws = {(): torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)}
    prop = sample_tree_proposal(_table(laws), widths=(2,), relation="beam", rng=TorchRandomSource(0))
    assert prop.probability_semantics == "score_only" and prop.q_dists is None
    assert [n.token_id for n in prop.nodes] == [1, 2]
    assert [n.score for n in prop.nodes] == [0.5, 0.3]
    assert all(n.q is None for n in prop.nodes)
    assert prop.topology == "set"


def test_chain_is_a_sequence():
    laws = {(): torch.tensor([0.2, 0.8]), (0,): torch.tensor([1.0, 0.0]), (1,): torch.tensor([0.0, 1.0])}
    prop = sample_tree_proposal(_table(laws), widths=(1, 1), relation="iid", rng=TorchRandomSource(1))
    assert prop.topology == "sequence"
    assert [n.parent for n in prop.nodes] == [-1, 0]


def _depths(nodes):
    depths = []
    for node in nodes:
        depths.append(1 if node.parent == -1 else depths[node.parent] + 1)
    return depths


def _counting_draft(monkeypatch, seed=1, **model_kw):
    from harness.target.backend import CausalLMBackend
    from harness.target.loading import build_tiny_model

    backend = CausalLMBackend(build_tiny_model(seed=seed, **model_kw))
    rows: list[int] = []
    forward = backend.forward_rows

    def counted(state, ids, pos, mask, **kw):
        rows.append(len(ids))
        return forward(state, ids, pos, mask, **kw)

    monkeypatch.setattr(backend, "forward_rows", counted)
    return backend, rows


def test_a_draft_model_runs_no_forward_for_levels_max_nodes_drops(monkeypatch):
    """widths (2,2,1) under max_nodes=4 keeps depths 1-2 only: the draft feeds the prefix and
    forwards the one depth-1 row that has kept children, never a depth-2 or depth-3 level; the
    kept tree is the first max_nodes nodes of the full tree (same tokens and scores at T=0)."""
    from harness.contracts import Budget
    from harness.proposers.draft_model import DraftModelProposer
    from harness.topology.choices import choice_tree
    from harness.verifiers.sampling import SamplingPolicy

    backend, rows = _counting_draft(monkeypatch)
    prompt = [5, 17, 33, 8, 5]
    tree = choice_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])

    def budgets(n):
        return [
            Budget(shape="expansion", max_nodes=n, max_depth=3, widths=(2, 2, 1)),
            Budget(shape="choices", max_nodes=min(n, 5), max_depth=3, parents=tree.parents, ranks=tree.ranks),
        ]

    def propose(budget):
        proposer = DraftModelProposer(
            budget=budget, manifest_hash="h", policy=SamplingPolicy(), backend=backend, sampling="beam"
        )
        rows.clear()
        result = proposer.propose(prompt, TorchRandomSource(0))
        return result, list(rows)

    (cut, cut_rows), (cut_ch, cut_ch_rows) = (propose(b) for b in budgets(4))
    (full, full_rows), (full_ch, full_ch_rows) = (propose(b) for b in budgets(10))
    assert full_rows == [1, 2, 4]  # feed, depth-1 rows, depth-2 rows: the full tree's forwards
    assert cut_rows == [1, 1]  # feed, node 0 (the only kept node with kept children)
    assert _depths(cut.nodes) == [1, 1, 2, 2]
    assert cut.nodes == full.nodes[:4]
    assert full_ch_rows == [1, 1, 1]  # feed, [0], [0, 0]: the nodes with children
    assert cut_ch_rows == [1, 1]  # [0, 0, 0] is cut, so [0, 0] is never forwarded
    assert cut_ch.nodes == full_ch.nodes[:4]


def test_a_shape_is_cut_to_max_nodes_before_anything_is_drawn():
    """sample_tree_proposal(max_nodes=...) asks q_level only for levels its kept nodes reach, and
    draws the same first nodes as the full tree (the draws past the cut come later in the stream)."""
    vocab = 6
    asked: list[int] = []

    def q_level(prefixes):
        asked.append(len(prefixes))
        out = []
        for p in prefixes:
            g = torch.Generator().manual_seed(hash(p) % 1000)
            q = torch.rand(vocab, generator=g, dtype=torch.float64)
            out.append(q / q.sum())
        return torch.stack(out)

    for relation in ("without_replacement", "beam"):
        asked.clear()
        full = sample_tree_proposal(q_level, widths=(2, 2, 1), relation=relation, rng=TorchRandomSource(3))
        assert asked == [1, 2, 4]
        asked.clear()
        cut = sample_tree_proposal(q_level, widths=(2, 2, 1), relation=relation, rng=TorchRandomSource(3), max_nodes=5)
        assert asked == [1, 2]  # depth 3 has no kept node: no law asked for it
        assert cut.nodes == full.nodes[:5]
        if relation != "beam":
            assert torch.equal(cut.q_dists, full.q_dists[:5])


def test_hidden_row_proposers_cut_the_shape_before_drawing():
    """EAGLE / heads (HiddenRowProposer._fixed_tree) draw no level max_nodes drops."""
    from types import SimpleNamespace

    from harness.contracts import NO_STATE, Budget
    from harness.proposers.target_bound import HiddenRowProposer

    asked: list[int] = []

    def q_level(prefixes):
        asked.append(len(prefixes))
        return torch.full((len(prefixes), 8), 1 / 8, dtype=torch.float64)

    stub = SimpleNamespace(
        budget=Budget(shape="expansion", max_nodes=3, max_depth=3, widths=(2, 2, 1)),
        sampling="beam",
        name="eagle",
        manifest_hash="h",
        depth_cap=None,
    )
    result = HiddenRowProposer._fixed_tree(stub, q_level, (2, 2, 1), TorchRandomSource(0), NO_STATE)
    assert asked == [1, 1]
    assert _depths(result.nodes) == [1, 1, 2]


@pytest.mark.parametrize(
    ("shape", "sampling", "fragment"),
    [
        ("widths", "beam", "width 10"),
        ("widths", "without_replacement", "width 10"),
        ("choices", "beam", "choice rank 9"),
    ],
)
def test_a_draft_with_fewer_shared_ids_than_a_width_or_rank_is_refused(shape, sampling, fragment):
    from harness.contracts import Budget, ConfigError
    from harness.proposers.draft_model import DraftModelProposer
    from harness.target.backend import CausalLMBackend
    from harness.target.loading import build_tiny_model
    from harness.topology.choices import choice_tree
    from harness.verifiers.sampling import SamplingPolicy

    draft = CausalLMBackend(build_tiny_model(seed=1, vocab_size=8))
    if shape == "widths":
        budget = Budget(shape="expansion", max_nodes=20, max_depth=2, widths=(10, 1))
    else:
        tree = choice_tree([[0], [9], [9, 0]])
        budget = Budget(shape="choices", max_nodes=3, max_depth=2, parents=tree.parents, ranks=tree.ranks)
    common = dict(manifest_hash="h", policy=SamplingPolicy(), backend=draft, vocab_range=8, target_vocab=96)
    with pytest.raises(ConfigError, match=f"{fragment}.*only 8 ids"):
        DraftModelProposer(budget=budget, sampling=sampling, **common)
    # within the shared ids (or i.i.d., which may repeat a token) it draws only ids the draft can read
    fits = Budget(shape="expansion", max_nodes=20, max_depth=2, widths=(8, 1))
    for ok_budget, ok_sampling in ((fits, sampling), (budget, "iid") if shape == "widths" else (fits, "beam")):
        proposer = DraftModelProposer(budget=ok_budget, sampling=ok_sampling, **common)
        result = proposer.propose([1, 2, 3], TorchRandomSource(0))
        assert result.nodes and all(n.token_id < 8 for n in result.nodes)
