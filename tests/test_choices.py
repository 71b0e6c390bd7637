"""topology=choices: rank-path lists (given on the command line or as a JSON file, the form a
published tree such as Medusa's mc_sim_7b_63 is saved in) validated, numbered as Medusa numbers
them, and sampled by rank: the rank-r child is the r-th most probable token (beam) or the r-th
draw (sampled, ranks 0..n-1 only)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_fixtures import best_first_choices, write_choices

from harness.config import compose
from harness.contracts import Budget, ConfigError
from harness.proposers.sampling import (
    beam_tokens,
    sample_ranked_tree_proposal,
    sample_shaped_tree_proposal,
)
from harness.random_source import TorchRandomSource
from harness.topology.budgets import budget_from_config
from harness.topology.choices import ChoicesError, choice_tree, resolve_choices

TREE63 = best_first_choices(63)  # a sparse 63-node, depth-4 tree of the published kind, built here


@pytest.fixture
def tree63_file(tmp_path):
    return write_choices(tmp_path / "tree63.json", TREE63)


def test_a_choices_file_gives_its_tree(tree63_file):
    tree = resolve_choices(None, str(tree63_file))
    assert tree.num_nodes == 63 and tree.depth == 4 and len({tuple(p) for p in TREE63}) == 63
    assert tree.nodes_per_depth() == [9, 28, 21, 5]
    assert len(tree.leaves()) == 42
    assert tree.paths == tuple(sorted((tuple(p) for p in TREE63), key=lambda p: (len(p), p)))
    assert tree.rank_gap() is None
    assert resolve_choices(TREE63, None) == tree  # the same list given inline


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "no such file"),
        ("[[0], [0, 0]", "is not JSON"),
        ('{"choices": [[0]]}', "must hold one JSON list of paths"),
        ("[0, 1]", "must hold one JSON list of paths"),
        ("[[0], [1, 0]]", r"path \[1, 0\] needs its parent \[1\]"),
    ],
)
def test_a_bad_choices_file_is_refused_in_one_line(tmp_path, content, match):
    path = tmp_path / "tree.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ChoicesError, match=match):
        resolve_choices(None, str(path))
    cfg = compose(["model=tiny", "topology=choices", f"topology.choices_file={path}"])
    with pytest.raises(ConfigError, match=match):
        budget_from_config(cfg)


def test_node_order_parents_and_ranks_follow_medusa():
    tree = choice_tree([[0], [1], [0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0)) and tree.parents == (-1, -1, 0) and tree.ranks == (0, 1, 0)
    tree = choice_tree([[1, 0], [0, 2], [1], [0], [0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 2), (1, 0))
    assert tree.parents == (-1, -1, 0, 0, 1) and tree.ranks == (0, 1, 0, 2, 0)
    assert tree.rank_gap() == ((0,), 1)


@pytest.mark.parametrize(
    "choices, match",
    [
        ([], "at least one path"),
        ([[0], [0]], r"path \[0\] appears twice"),
        ([[0], [1, 0]], r"path \[1, 0\] needs its parent \[1\]"),
        ([[0], []], "non-empty list"),
        ([[0], [-1]], "ranks must be ints >= 0"),
        ([[0], [1.5]], "ranks must be ints >= 0"),
    ],
)
def test_bad_choice_lists_are_refused_naming_the_path(choices, match):
    with pytest.raises(ChoicesError, match=match):
        choice_tree(choices)


def test_topology_choices_composes_from_a_list_or_a_file(tree63_file):
    cfg = compose(["model=tiny", "topology=choices", f"topology.choices_file={tree63_file}"])
    assert (cfg.topology.max_nodes, cfg.topology.max_depth) == (63, 4)
    budget = budget_from_config(cfg)
    assert budget.shape == "choices" and budget.max_nodes == 63 and len(budget.ranks) == 63
    cfg = compose(["model=tiny", "topology=choices", "topology.choices=[[0],[0,0],[1],[0,1],[2]]"])
    assert (cfg.topology.max_nodes, cfg.topology.max_depth) == (5, 2)
    assert budget_from_config(cfg).parents == (-1, -1, -1, 0, 0)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ([], "give exactly one of topology.choices"),
        (["topology.choices_file=tree.json", "topology.choices=[[0]]"], "give exactly one of topology.choices"),
        (["topology.choices_file=/no/such/tree.json"], "no such file"),
        (["topology.choices=[[0],[2,0]]"], r"path \[2, 0\] needs its parent \[2\]"),
        (["topology.choices=[[0],[1]]", "topology.max_nodes=3"], "has 2 for max_nodes; got topology.max_nodes=3"),
    ],
)
def test_topology_choices_refusals(overrides, match):
    cfg = compose(["model=tiny", "topology=choices", *overrides])
    with pytest.raises(ConfigError, match=match):
        budget_from_config(cfg)


def fixed_levels(vocab=12, seed=0):
    """A q_level whose law depends on the prefix (deterministic), and a log of its calls."""
    calls = []

    def q_level(prefixes):
        calls.append(list(prefixes))
        rows = []
        for p in prefixes:
            g = torch.Generator().manual_seed(seed + 1000 * len(p) + sum((i + 1) * t for i, t in enumerate(p)))
            rows.append(torch.softmax(torch.randn(vocab, generator=g) * 2, -1))
        return torch.stack(rows)

    return q_level, calls


def test_beam_ranks_are_the_nodes_own_ranked_children_and_may_skip_ranks():
    tree = choice_tree([[0], [2], [0, 1], [0, 3], [2, 0], [0, 1, 0]])
    q_level, calls = fixed_levels()
    res = sample_ranked_tree_proposal(
        q_level, parents=tree.parents, ranks=tree.ranks, relation="beam", rng=TorchRandomSource(0)
    )
    assert res.probability_semantics == "score_only" and len(res.nodes) == tree.num_nodes
    assert [len(c) for c in calls] == [1, 2, 1]  # one call per depth, one row per expanded node
    prefix = {}
    for i, node in enumerate(res.nodes):
        assert node.parent == tree.parents[i]
        parent_prefix = () if node.parent == -1 else prefix[node.parent]
        law = q_level([parent_prefix])[0]
        assert node.token_id == beam_tokens(law, tree.ranks[i] + 1)[tree.ranks[i]]
        prefix[i] = parent_prefix + (node.token_id,)


def test_sampled_choices_need_contiguous_ranks_and_equal_the_shaped_sampler():
    gap = choice_tree([[0], [2]])
    q_level, _ = fixed_levels()
    with pytest.raises(ValueError, match="skips rank 1 below the first token"):
        sample_ranked_tree_proposal(
            q_level, parents=gap.parents, ranks=gap.ranks, relation="iid", rng=TorchRandomSource(0)
        )
    tree = choice_tree([[0], [1], [0, 0], [0, 1], [1, 0]])
    for relation in ("iid", "without_replacement"):
        a = sample_ranked_tree_proposal(
            q_level, parents=tree.parents, ranks=tree.ranks, relation=relation, rng=TorchRandomSource(3)
        )
        b = sample_shaped_tree_proposal(q_level, parents=tree.parents, relation=relation, rng=TorchRandomSource(3))
        assert a.nodes == b.nodes and torch.equal(a.q_dists, b.q_dists)


def test_declared_sampling_refuses_a_gapped_list_before_model_work():
    from harness.engine.build import plan

    cfg = compose(
        ["model=tiny", "proposer=draft_model", "proposer.sampling=iid", "verifier=specinfer"]
        + ["generation.temperature=0.7", "topology=choices", "topology.choices=[[0],[2]]"]
    )
    with pytest.raises(ValueError, match="skips rank 1"):
        plan(cfg)
    cfg = compose(
        ["model=tiny", "proposer=draft_model", "proposer.sampling=beam", "topology=choices"]
        + ["topology.choices=[[0],[2]]"]
    )
    assert plan(cfg).budget.shape == "choices"


def test_a_draft_model_ranks_children_by_its_own_law(tiny_model):
    from harness.proposers.draft_model import DraftModelProposer
    from harness.target.backend import CausalLMBackend
    from harness.verifiers.sampling import SamplingPolicy

    tree = choice_tree([[0], [1], [0, 0], [0, 2], [1, 0]])
    budget = Budget(shape="choices", max_nodes=5, max_depth=2, parents=tree.parents, ranks=tree.ranks)
    backend = CausalLMBackend(tiny_model)
    proposer = DraftModelProposer(
        budget=budget, manifest_hash="h", policy=SamplingPolicy(), backend=backend, sampling="beam"
    )
    prompt = [5, 9, 14, 3, 22]
    proposer.start(prompt)
    res = proposer.propose(prompt, TorchRandomSource(0))
    assert len(res.nodes) == 5
    with torch.no_grad():
        for i, node in enumerate(res.nodes):
            path = [] if node.parent == -1 else [res.nodes[node.parent].token_id]
            logits = tiny_model(torch.tensor([prompt + path])).logits[0, -1]
            law = torch.softmax(logits.float(), -1)
            assert node.token_id == beam_tokens(law, tree.ranks[i] + 1)[tree.ranks[i]]


def test_a_draft_model_on_a_63_node_choices_tree_keeps_greedy_equality(tmp_path, monkeypatch, tree63_file):
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        ["model=tiny", "proposer=draft_model", "proposer.sampling=beam", "proposer.model.num_layers=1"]
        + [
            "topology=choices",
            f"topology.choices_file={tree63_file}",
            "workload.limit=1",
            "generation.max_new_tokens=12",
        ]
        + ["gates.oracle=false"]
    )
    record = run_job(cfg, run_dir=tmp_path / "run")
    m = record["metrics"]
    assert m["greedy_identical"] is True
    assert record["config"]["topology"]["max_nodes"] == 63
    # every round verifies the whole tree (9, 28, 21 and 5 nodes at depths 1-4), except near the end
    # of the request, where it is cut to the depths the round can still commit (tokens left - 1)
    rounds = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    rows_to_depth = [0, 9, 37, 58, 63]
    left, expected = 12, []
    for r in rounds:
        expected.append(rows_to_depth[min(4, left - 1)])
        left -= r["committed"]
    assert [r["candidate_rows"] for r in rounds] == expected and expected[0] == 63
    assert m["mean_candidate_rows"] == sum(expected) / len(expected)


def test_medusa_heads_on_a_choices_tree_are_cartesian_per_depth(tmp_path):
    """Medusa's heads are independent: the rank-r token at depth d is the same under every parent."""
    from checkpoint_fixtures import medusa_config, medusa_state, write_medusa

    from harness.engine.decode import RoundConfig, decode
    from harness.heads.artifacts import load_configured_heads
    from harness.heads.checkpoint import target_fingerprint
    from harness.proposers.heads import MedusaProposer
    from harness.target.backend import CausalLMBackend
    from harness.target.loading import build_tiny_model
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    model = build_tiny_model(seed=0)
    path = write_medusa(
        tmp_path / "m", medusa_state(heads=3, layers=1, hidden=32, vocab=96), config=medusa_config(3, 1)
    )
    art = load_configured_heads("medusa", {"artifact": str(path)}, model=model, tokenizer=None)
    tree = choice_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [0, 0, 0], [1, 1, 0]])
    budget = Budget(shape="choices", max_nodes=tree.num_nodes, max_depth=3, parents=tree.parents, ranks=tree.ranks)
    proposer = MedusaProposer(
        budget=budget,
        manifest_hash="h",
        policy=SamplingPolicy(),
        model=model,
        heads=art.heads,
        checkpoint=target_fingerprint(model),
        artifact_manifest=art.manifest,
    )
    trees = []
    decode(
        target=CausalLMBackend(model),
        proposer=proposer,
        verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompt_ids=[5, 9, 14, 3, 22, 7],
        max_new_tokens=10,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=budget.max_nodes, max_depth=budget.max_depth),
        on_round=lambda **kw: trees.append(kw["trees"][0]),
    )
    full = [t for t in trees if t is not None and t.num_rows == tree.num_nodes]
    assert full, "no round proposed the whole tree"
    for t in full:
        by_key: dict[tuple[int, int], set[int]] = {}
        for r in range(t.num_rows):
            depth, rank = len(tree.paths[r]), tree.ranks[r]
            by_key.setdefault((depth, rank), set()).add(int(t.token_ids[r]))
        assert all(len(tokens) == 1 for tokens in by_key.values()), by_key


def test_the_manifest_binds_the_choices_file_content(tmp_path):
    """A sweep skips a job whose manifest hash it has seen: editing the tree file must change it."""
    import hashlib

    from harness.manifest import manifest_extras

    path = write_choices(tmp_path / "tree.json", [[0], [1], [0, 0]])
    cfg = compose(["model=tiny", "topology=choices", f"topology.choices_file={path}"])
    first = manifest_extras(cfg)["topology_choices_file"]
    assert first == {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    write_choices(path, [[0], [1], [1, 0]])  # same node count and depth, another tree
    assert manifest_extras(cfg)["topology_choices_file"]["sha256"] != first["sha256"]
    assert "topology_choices_file" not in manifest_extras(
        compose(["model=tiny", "topology=choices", "topology.choices=[[0]]"])
    )
