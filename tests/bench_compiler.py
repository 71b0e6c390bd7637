"""Micro-benchmarks for the topology compiler and mask construction (skipped by default; run with
`make bench`)."""

import dataclasses

import pytest

from harness.contracts import NO_STATE, ContractError, ProposalNode, ProposalResult
from harness.topology.compiler import compile_tree, full_attention_mask, validate_candidate_graph


def kary_proposal(width: int, depth: int) -> ProposalResult:
    nodes, level = [], [-1]
    for _ in range(depth):
        nxt = []
        for parent in level:
            for w in range(width):
                nodes.append(ProposalNode(token_id=100 + w + len(nodes), parent=parent, score=1.0))
                nxt.append(len(nodes) - 1)
        level = nxt
    return ProposalResult(
        nodes=tuple(nodes),
        probability_semantics="score_only",
        sampling_relation="deterministic_lookup",
        topology="tree",
        state_handle=NO_STATE,
        manifest_hash="bench",
    )


@pytest.mark.parametrize("width,depth", [(1, 8), (2, 4), (4, 3)])
def test_bench_compile_tree(benchmark, width, depth):
    prop = kary_proposal(width, depth)
    tree = benchmark(compile_tree, [prop], 300)
    assert tree.num_rows == len(prop.nodes)


@pytest.mark.parametrize("width,depth", [(2, 4), (4, 3)])
def test_bench_full_mask(benchmark, width, depth):
    tree = compile_tree([kary_proposal(width, depth)], prefix_len=300)
    mask = benchmark(full_attention_mask, tree, 299)
    assert mask.shape == (1 + tree.num_rows, 300 + tree.num_rows)


def test_bench_validate(benchmark):
    tree = compile_tree([kary_proposal(2, 4)], prefix_len=300)
    assert benchmark(validate_candidate_graph, tree) is None  # a well-formed tree passes without a word
    # the timed checks are the real ones: a tree whose mask lost an ancestor is refused
    mask = tree.ancestor_mask.clone()
    row = tree.num_rows - 1
    mask[row, int(tree.parents[row])] = False
    with pytest.raises(ContractError, match="ancestor mask"):
        validate_candidate_graph(dataclasses.replace(tree, ancestor_mask=mask))
