"""Topology compiler fixtures: the proposal-buffer trace, candidate/predictor/KV row coordinates,
the implementation assertions."""

import pytest
import torch

from harness.contracts import NO_STATE, ContractError, ProposalNode, ProposalResult
from harness.topology.compiler import (
    build_ancestor_mask,
    compile_tree,
    full_attention_mask,
    validate_candidate_graph,
    validate_commit,
)

A, B, C, D, E, F, X = 10, 11, 12, 13, 14, 15, 16


def paths_proposal(paths, source, semantics="score_only"):
    result = ProposalResult.from_paths(paths, source=source, manifest_hash="h", probability_semantics=semantics)
    assert all(n.source == source for n in result.nodes)
    return result


def buffer_trace():
    hydra = paths_proposal([[A, B, C], [A, B, D]], "hydra")
    rest = paths_proposal([[A, B, E], [A, F]], "rest")
    hydra2 = paths_proposal([[X, B]], "hydra")
    return compile_tree([hydra, rest, hydra2], prefix_len=5)


def test_buffer_trace_eight_rows_two_distinct_b_rows():
    tree = buffer_trace()
    # A, B, C, D, E, F, X, B(X): eight rows (both B rows count: a tally of seven would merge them)
    assert tree.num_rows == 8
    assert tree.token_ids.tolist() == [A, B, C, D, E, F, X, B]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 1, 0, -1, 6]
    # rows 1 and 7 carry the same token under different parents: not merged
    assert int(tree.token_ids[1]) == int(tree.token_ids[7]) == B
    assert tree.full_prefixes[1] == (A, B) and tree.full_prefixes[7] == (X, B)
    assert not torch.equal(tree.ancestor_mask[1], tree.ancestor_mask[7])
    # rows 3 and 4 (D, E) share predictor row 1 but not input/KV rows
    assert int(tree.predictor_rows[3]) == int(tree.predictor_rows[4]) == 1
    assert tree.sources[0] == ("hydra", "rest")  # A proposed by both sources
    assert tree.sources[4] == ("rest",)
    assert tree.children(1) == (2, 3, 4) and tree.children(-1) == (0, 6)
    validate_candidate_graph(tree)


def test_candidate_predictor_and_kv_row_coordinates():
    # rows [A, B, C, D] with parents [-1, 0, 1, 1]
    tree = compile_tree([paths_proposal([[A, B, C], [A, B, D]], "s")], prefix_len=7)
    assert tree.parents.tolist() == [-1, 0, 1, 1]
    assert tree.depths.tolist() == [1, 2, 3, 3]
    assert tree.position_ids.tolist() == [7, 8, 9, 9]  # T + d_r - 1
    assert tree.predictor_rows.tolist() == [-1, 0, 1, 1]  # A by the frontier, B by A, C and D by B
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask, expected)  # C and D never see each other
    full = full_attention_mask(tree, cache_len=6)
    assert full.shape == (5, 6 + 1 + 4)
    assert full[:, :7].all()  # prefix + pending visible to all
    assert torch.equal(full[1:, 7:], expected)
    assert not full[0, 7:].any()  # the pending token sees no candidate


def test_merge_is_by_full_prefix_not_depth_and_token():
    tree = compile_tree([paths_proposal([[A, B], [X, B]], "s")], prefix_len=3)
    assert tree.num_rows == 4  # a (depth, token) merge would give 3


def test_budget_keeps_first_rows_and_stays_a_tree():
    tree = compile_tree([buffer_trace_proposal()], prefix_len=5, max_nodes=4)
    assert tree.token_ids.tolist() == [A, B, C, D]
    validate_candidate_graph(tree)
    shallow = compile_tree([buffer_trace_proposal()], prefix_len=5, max_depth=1)
    assert shallow.token_ids.tolist() == [A, X]


def buffer_trace_proposal():
    return paths_proposal([[A, B, C], [A, B, D], [A, B, E], [A, F], [X, B]], "s")


def test_validate_candidate_graph_catches_a_shifted_position():
    from dataclasses import replace

    tree = buffer_trace()
    bad = replace(tree, position_ids=tree.position_ids + 1)
    with pytest.raises(ContractError, match="position id"):
        validate_candidate_graph(bad)
    bad_mask = tree.ancestor_mask.clone()
    bad_mask[3, 2] = True  # D sees its sibling C
    with pytest.raises(ContractError, match="ancestor mask"):
        validate_candidate_graph(replace(tree, ancestor_mask=bad_mask))
    bad_pred = tree.predictor_rows.clone()
    bad_pred[2] = 2  # the one-position shift bug: a row predicting itself
    with pytest.raises(ContractError, match="predictor row"):
        validate_candidate_graph(replace(tree, predictor_rows=bad_pred))


def test_validate_commit():
    tree = buffer_trace()
    validate_commit(tree, [0, 1, 3])  # A -> B -> D, non-contiguous rows
    validate_commit(tree, [])
    with pytest.raises(ContractError, match="root-to-node"):
        validate_commit(tree, [0, 2])  # skips B
    with pytest.raises(ContractError, match="root-to-node"):
        validate_commit(tree, [0, 5, 1])  # siblings F and B
    with pytest.raises(ContractError, match="holds token"):
        validate_commit(tree, [0, 1], branch_token_ids=[A, C, C, D, E, F, X, B])


def test_iid_duplicate_draws_merge_rows_but_keep_draws():
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    nodes = [
        ProposalNode(token_id=1, q=0.5, source="d"),
        ProposalNode(token_id=1, q=0.5, source="d"),
        ProposalNode(token_id=0, q=0.5, source="d"),
    ]
    prop = ProposalResult(
        nodes=tuple(nodes),
        probability_semantics="normalized_conditional",
        sampling_relation="iid",
        topology="set",
        state_handle=NO_STATE,
        manifest_hash="h",
        q_dists=q,
    )
    tree = compile_tree([prop], prefix_len=1)
    assert tree.num_rows == 2
    assert [d.row for d in tree.draws[0]] == [0, 0, 1]
    assert [d.q_index for d in tree.draws[0]] == [0, 1, 2]


def test_ancestor_mask_matches_definition():
    parents = [-1, 0, 1, 1, 0, -1, 5]
    mask = build_ancestor_mask(parents)
    assert mask.dtype == torch.bool and mask.shape == (len(parents), len(parents))
    for u in range(len(parents)):
        anc, p = {u}, parents[u]
        while p != -1:
            anc.add(p)
            p = parents[p]
        assert {v for v in range(len(parents)) if mask[u, v]} == anc


def test_contracts_reject_invalid_values():
    with pytest.raises(ContractError, match="q must be a probability"):
        ProposalNode(token_id=1, q=1.5)
    with pytest.raises(ContractError, match="score"):
        ProposalResult(
            nodes=(ProposalNode(token_id=1, q=0.5),),
            probability_semantics="score_only",
            sampling_relation="deterministic_lookup",
            topology="sequence",
            state_handle=NO_STATE,
            manifest_hash="h",
        )
    with pytest.raises(ContractError, match="q_dists"):
        ProposalResult(
            nodes=(ProposalNode(token_id=1, q=0.5),),
            probability_semantics="normalized_conditional",
            sampling_relation="iid",
            topology="sequence",
            state_handle=NO_STATE,
            manifest_hash="h",
        )
    with pytest.raises(ContractError, match="sum to 1"):
        ProposalResult(
            nodes=(ProposalNode(token_id=1, q=0.5),),
            probability_semantics="normalized_conditional",
            sampling_relation="iid",
            topology="sequence",
            state_handle=NO_STATE,
            manifest_hash="h",
            q_dists=torch.tensor([[0.5, 0.6]]),
        )
    with pytest.raises(ContractError, match="sampling_relation"):
        ProposalResult(
            nodes=(),
            probability_semantics="absent",
            sampling_relation="greedyish",
            topology="sequence",
            state_handle=NO_STATE,
            manifest_hash="h",
        )
    with pytest.raises(ContractError, match="chain"):
        ProposalResult(
            nodes=(ProposalNode(token_id=1), ProposalNode(token_id=2)),
            probability_semantics="absent",
            sampling_relation="deterministic_lookup",
            topology="sequence",
            state_handle=NO_STATE,
            manifest_hash="h",
        )


def test_a_sampled_proposal_over_the_row_budget_is_refused_not_cut_by_its_draws_values():
    """Three i.i.d. draws [0, 1, 0] under one row of budget: the cut kept the first draw and the
    repeat of its token and dropped the new one, so which draws reached the verifier depended on
    their values, and SpecInfer's first-token law moved (0.30 -> 0.37 for token 1 in an exact
    enumeration). A sampled proposal must fit the budget whatever it draws; a depth cut, which
    drops draws whatever their values, still applies."""
    from harness.gates.oracle import first_token_marginal, sampled_builder, verifier_output_marginal
    from harness.verifiers import get_verifier

    q = torch.tensor([0.5, 0.1, 0.2, 0.2], dtype=torch.float64)

    def sampled(tokens, parents):
        nodes = tuple(
            ProposalNode(token_id=t, parent=p, score=1.0, q=float(q[t]), source="x")
            for t, p in zip(tokens, parents, strict=True)
        )
        return ProposalResult(
            nodes=nodes,
            probability_semantics="normalized_conditional",
            sampling_relation="iid",
            topology="set" if all(p == -1 for p in parents) else "sequence",
            state_handle=NO_STATE,
            manifest_hash="h",
            source="x",
            q_dists=torch.stack([q] * len(tokens)),
        )

    for tokens in ((0, 1, 0), (0, 0, 0)):  # refused whatever the draws: three nodes, one row
        with pytest.raises(ContractError, match=r"has 3 nodes for 1 rows of the budget \(max_nodes=1\)"):
            compile_tree([sampled(tokens, (-1, -1, -1))], 1, max_nodes=1)
    chain = compile_tree([sampled((0, 1, 2), (-1, 0, 1))], 1, max_nodes=2, max_depth=2)  # depth cut: 2 nodes
    assert chain.token_ids.tolist() == [0, 1]

    class Laws:
        def level(self, prefixes):
            return torch.stack([q for _ in prefixes])

    p = torch.tensor([0.1, 0.3, 0.35, 0.25], dtype=torch.float64)
    law = verifier_output_marginal(get_verifier("specinfer"), sampled_builder(Laws(), (3,), "iid"), lambda pre: p)
    torch.testing.assert_close(first_token_marginal(law, 4), p, rtol=0, atol=1e-12)
    with pytest.raises(ContractError, match="trims its draws to the budget itself"):
        verifier_output_marginal(
            get_verifier("specinfer"), sampled_builder(Laws(), (3,), "iid"), lambda pre: p, max_nodes=1
        )


def _result(nodes, semantics, relation="iid", q_dists=None):
    return ProposalResult(
        nodes=tuple(nodes),
        probability_semantics=semantics,
        sampling_relation=relation,
        topology="sequence",
        state_handle=NO_STATE,
        manifest_hash="h",
        q_dists=q_dists,
    )


def test_a_proposal_s_evidence_is_refused_where_it_would_stand_in_for_a_law():
    """A proposal is refused where its evidence could pass for a proposal law: a q on a score or
    frequency (a count is no probability), normalised conditionals without the law they were drawn
    from, a q that disagrees with that law, and a draw of a token the law gives no mass."""
    law = torch.tensor([[0.5, 0.5]])
    with pytest.raises(ContractError, match=r"probability_semantics='frequency' carries no q"):
        _result([ProposalNode(1, q=0.5)], "frequency", relation="deterministic_lookup")
    with pytest.raises(ContractError, match=r"probability_semantics='score_only' carries no q"):
        _result([ProposalNode(1, q=0.5)], "score_only", relation="deterministic_lookup")
    with pytest.raises(ContractError, match=r"normalized_conditional proposals must carry q_dists"):
        _result([ProposalNode(1, q=0.5)], "normalized_conditional")
    with pytest.raises(ContractError, match=r"node 0: q=0.4 disagrees with q_dists\[0, 1\]=0.5"):
        _result([ProposalNode(1, q=0.4)], "normalized_conditional", q_dists=law)
    with pytest.raises(ContractError, match=r"node 0: token 1 has zero mass in the law it was drawn from"):
        _result([ProposalNode(1, q=0.0)], "normalized_conditional", q_dists=torch.tensor([[1.0, 0.0]]))
    ok = _result([ProposalNode(1, q=0.5)], "normalized_conditional", q_dists=law)  # the law it was drawn from
    assert ok.nodes[0].q == 0.5
