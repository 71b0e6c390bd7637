"""Sequoia's hardware-aware choice under a measured profile's shaped draft costs, checked against
brute force over every small tree; the idle-nodes note; the Wilson quantile's bound."""

from __future__ import annotations

import math
import random
from functools import cache

import pytest

from harness.topology.sequoia import (
    SEARCHED_EVERY_TREE,
    SEARCHED_FAMILY,
    expected_tokens,
    level_internal_nodes,
    optimize_tree,
    select_hardware_aware,
    tree_depth,
    tree_draft_time,
    wilson_interval,
)


@cache
def _forests(n: int) -> tuple:
    """Every ordered forest of ``n`` nodes, each tree the tuple of its children's trees."""
    if n == 0:
        return ((),)
    return tuple((first, *rest) for k in range(1, n + 1) for first in _forests(k - 1) for rest in _forests(n - k))


def _parents_ranks(forest: tuple) -> tuple[list[int], list[int]]:
    parents, ranks = [-1], [0]

    def emit(children: tuple, node: int) -> None:
        for rank, child in enumerate(children, start=1):
            parents.append(node)
            ranks.append(rank)
            emit(child, len(parents) - 1)

    emit(forest, 0)
    return parents, ranks


def _every_tree(max_nodes: int, max_depth: int, branches: int) -> list[dict]:
    """Every tree of 2..max_nodes nodes within the bounds, with what its drafting cost depends on."""
    out = []
    for n in range(2, max_nodes + 1):
        for forest in _forests(n - 1):
            parents, ranks = _parents_ranks(forest)
            depth = tree_depth(parents)
            if max(ranks) > branches or depth > max_depth:
                continue
            levels = level_internal_nodes(parents)
            prefix = next((i for i, r in enumerate(levels) if r != 1), len(levels))
            out.append(
                dict(
                    n=n,
                    depth=depth,
                    parents=parents,
                    ranks=ranks,
                    caterpillar=prefix == len(levels),  # every node with children on one path
                    path=len(set(parents[1:])) == n - 1,
                    prefix=prefix,
                )
            )
    return out


def _time(tree: dict, p, t, costs: dict) -> float:
    drafting = tree_draft_time(tree["parents"], tree["ranks"], p, **costs)
    return (t[tree["n"] - 1] + drafting) / expected_tokens(tree["parents"], tree["ranks"], p)


def _random_case(rng: random.Random, flat: bool):
    branches = rng.randint(1, 3)
    raw = [rng.random() for _ in range(branches)]
    scale = sum(raw) * rng.uniform(1.0, 1.5)
    p = [x / scale for x in raw]
    n_max, d_max = rng.randint(2, 7), rng.randint(1, 5)
    t = [1.0] + sorted(1.0 + rng.random() * 0.5 for _ in range(n_max - 1))
    c, c0 = rng.random() * 0.5, rng.random() * 0.5
    feeds, levels = min(d_max, n_max - 1) + 1, max(1, (n_max - 1) // 2)
    if flat:  # the draft's pass and its masked step cost the same whatever they feed
        feed, level = [rng.random()] * feeds, [rng.random()] * levels
    else:
        feed = sorted(rng.random() * 1.5 for _ in range(feeds))
        level = [rng.random() for _ in range(levels)]
    costs = dict(draft_cost=c, draft_base_cost=c0, feed_cost=feed, level_cost=level)
    return p, n_max, d_max, t, costs


def test_a_cheaper_chain_with_fewer_expected_tokens_is_chosen():
    """Only the tree of most expected tokens of each (n, d) was priced: the three-node chain (depth 2),
    which expects fewer tokens than the three-node star but drafts far cheaper, was never considered
    and a single node was chosen, 7 % slower per token."""
    p = [0.4617, 0.2641]
    t = [1.0, 1.004, 1.146, 1.238, 1.487]
    costs = dict(draft_cost=0.115, draft_base_cost=0.4245, feed_cost=[0.1187, 0.7492, 1.1759, 1.4849])
    costs["level_cost"] = [0.0025, 0.7862]
    table = optimize_tree(acceptance=p, max_nodes=5, max_depth=3)
    choice = select_hardware_aware(table, verify_cost=t, **costs)
    trees = _every_tree(5, 3, len(p))
    best = min(trees, key=lambda tr: _time(tr, p, t, costs))
    assert choice.parents == tuple(best["parents"]) == (-1, 0, 1)
    assert choice.time_per_token == pytest.approx(_time(best, p, t, costs), abs=1e-12)


def test_with_flat_draft_vectors_the_choice_is_the_best_of_every_tree():
    """A masked level and the draft's pass priced alike whatever their size: the tree's drafting time
    depends on its node count, depth and chain prefix alone, and the search is exact; it priced only
    the trees of most expected tokens and missed a chain-prefixed one whose masked levels cost less."""
    rng = random.Random(7)
    choices = []
    for _ in range(120):
        p, n_max, d_max, t, costs = _random_case(rng, flat=True)
        table = optimize_tree(acceptance=p, max_nodes=n_max, max_depth=d_max)
        choice = select_hardware_aware(table, verify_cost=t, **costs)
        brute = min(_time(tr, p, t, costs) for tr in _every_tree(n_max, d_max, len(p)))
        assert choice.time_per_token == pytest.approx(brute, rel=1e-12), (p, n_max, d_max, t, costs)
        choices.append(choice)
    assert [choice.searched for choice in choices] == [SEARCHED_EVERY_TREE] * 120


def _family_bound(trees: list[dict], p, t, costs, d_max: int) -> float:
    """The dearest time the search may return: for every class it covers (all trees, caterpillars,
    trees whose first branching level is k + 1; each of n nodes and depth <= d) the dearest of the
    trees of most expected tokens (the search may hold any of those tied), and every chain; the least
    of these over the classes."""
    classes: dict[tuple, list[dict]] = {}
    for tr in trees:
        for d in range(tr["depth"], d_max + 1):
            classes.setdefault(("all", tr["n"], d), []).append(tr)
            if tr["caterpillar"]:
                classes.setdefault(("caterpillar", tr["n"], d), []).append(tr)
            else:
                classes.setdefault(("prefix", tr["n"], d, tr["prefix"]), []).append(tr)
        if tr["path"]:
            classes[("path", tr["n"])] = [tr]
    bound = math.inf
    for members in classes.values():
        g = [expected_tokens(m["parents"], m["ranks"], p) for m in members]
        top = max(g)
        bound = min(bound, max(_time(m, p, t, costs) for m, x in zip(members, g) if x >= top - 1e-9))
    return bound


def test_with_shaped_draft_vectors_the_choice_is_the_best_of_its_family():
    """Where the draft's pass costs more with more tokens and its masked step varies with its rows, the
    search covers its stated family: no tree of the family is cheaper than the choice, the choice is
    priced as the tree it is, and it is no faster than the brute-force optimum over every tree. Only
    the table's trees were priced, and chains and chain-prefixed trees of the family were missed."""
    rng = random.Random(3)
    choices = []
    for _ in range(150):
        p, n_max, d_max, t, costs = _random_case(rng, flat=False)
        table = optimize_tree(acceptance=p, max_nodes=n_max, max_depth=d_max)
        choice = select_hardware_aware(table, verify_cost=t, **costs)
        trees = _every_tree(n_max, d_max, len(p))
        own = _time(dict(n=choice.n, parents=list(choice.parents), ranks=list(choice.ranks)), p, t, costs)
        assert choice.time_per_token == pytest.approx(own, rel=1e-12)
        assert choice.d == tree_depth(choice.parents)
        assert choice.time_per_token <= _family_bound(trees, p, t, costs, d_max) * (1 + 1e-12)
        assert choice.time_per_token >= min(_time(tr, p, t, costs) for tr in trees) * (1 - 1e-12)
        choices.append(choice)
    assert [choice.searched for choice in choices] == [SEARCHED_FAMILY] * 150


@pytest.mark.parametrize("rising", [0.002, 0.5], ids=["flat-ish", "rising"])
def test_at_a_large_tree_the_pruned_search_is_quick_and_prices_no_family_tree_below_its_choice(rising):
    """129 nodes at depth 12 over eight ranks: the candidates are priced in order of the least time their
    class admits and pricing stops past the best found; every candidate priced without that stop (the
    draft's passes and masked steps costing the same or rising steeply with size) is no cheaper."""
    import time

    from harness.topology.sequoia import _draft_time_of, _ShapeClasses

    p = [0.5, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01]
    table = optimize_tree(acceptance=p, max_nodes=129, max_depth=12)
    t = [1.0 + 0.004 * n for n in range(129)]
    costs = dict(draft_cost=0.05, draft_base_cost=0.05)
    costs["feed_cost"] = [0.05 * (1 + rising * k) for k in range(13)]
    costs["level_cost"] = [0.06 * (1 + rising * r) for r in range(64)]
    start = time.perf_counter()
    choice = select_hardware_aware(table, verify_cost=t, **costs)
    assert time.perf_counter() - start < 10.0
    classes = _ShapeClasses(table)
    candidates = [("chain", n, 0, 0) for n in range(2, 14)]
    for n in range(2, 130):
        for d in range(1, 13):
            if math.isfinite(table.best_g[n, d]):
                candidates.append(("table", n, d, 0))
            if math.isfinite(classes.caterpillar[n, d]):
                candidates.append(("caterpillar", n, d, 0))
            candidates += [
                ("prefixed", n, k, d - k) for k in range(d - 1) if math.isfinite(classes.prefixed[k][n, d - k])
            ]
    cheapest = math.inf
    for kind, n, a, b in candidates:
        reach, rows, depth, chain = classes.summary(classes.spec(kind, n, a, b))
        drafted = _draft_time_of([*reach, 0.0], rows[:depth], chain, **costs)
        cheapest = min(cheapest, (t[n - 1] + drafted) / math.fsum(reach))
    assert choice.time_per_token == pytest.approx(cheapest, rel=1e-9)
    assert 2 < choice.n < 129 and choice.time_per_token < 1.0


# ---------------------------------------------------------------- the idle-nodes note


def _note_case(verify_cost, acceptance=(0.9, 0.05, 0.01), max_depth=2):
    from harness.prepare.sequoia import build_tree_artifact

    calibration = {"acceptance": list(acceptance), "hash": "c"}
    profile = {
        "verify_cost": verify_cost,
        "draft_cost": 10.0,
        "draft_base_cost": 0.0,
        "t1_ms": 1.0,
        "hash": "p",
        "synthetic": False,
    }
    search = {"max_nodes": 4, "max_depth": max_depth, "min_nodes": 2, "max_rows": 3}
    return build_tree_artifact(calibration=calibration, profile=profile, search=search)


def test_the_idle_nodes_note_compares_at_the_chosen_depth_and_blames_the_profile_only_when_it_is_to_blame():
    """The note compared the chosen tree with smaller ones at the search's largest depth: a one-level
    star of four nodes (G 1.96) was said to expect no more than the three-node chain (G 2.71, one level
    deeper and dearer to draft) and the flat verify cost blamed for pricing four rows below three."""
    from harness.prepare.sequoia import idle_nodes_note

    flat = _note_case([1.0, 1.0, 1.0, 1.0])
    assert (flat["chosen"]["n"], flat["chosen"]["d"]) == (4, 1)
    assert idle_nodes_note(flat) is None  # the best three-node star of depth 1 expects 1.95 < 1.96
    # a profile pricing four rows below two, the siblings of the one accepted child never accepted
    dear = _note_case([1.0, 1.3, 1.2, 1.1], acceptance=(0.9, 0.0, 0.0), max_depth=1)
    assert (dear["chosen"]["n"], dear["chosen"]["d"], dear["verify_cost"]) == (4, 1, [1.0, 1.3, 1.2, 1.1])
    note = idle_nodes_note(dear)
    assert note.startswith(
        "the chosen Sequoia tree of 4 nodes expects no more tokens per round (1.9) than the best of 2:"
    )
    assert "prices its verify forward no dearer than the smaller one's (t(4) = 1.1, t(2) = 1.3:" in note
    # where the smaller forward is the cheaper, the larger tree's drafting chose it, not the verify cost
    cheaper = idle_nodes_note({**dear, "verify_cost": [1.0, 1.0, 1.0, 1.1]})
    assert cheaper.endswith(
        "its drafting chose it, cheaper on this profile than that tree's by at least its dearer verify forward "
        "(t(4) - t(2) = 1.1 - 1)"
    )


# ---------------------------------------------------------------- the Wilson quantile


def test_a_wilson_quantile_whose_confidence_rounds_to_one_is_refused():
    """z above about 8.3 made the confidence 2 Phi(z) - 1 round to 1 and scipy's interval NaN, which
    failed writing the calibration artifact after the whole calibration had run."""
    assert all(math.isfinite(x) for x in wilson_interval(5, 10, z=7.0))
    with pytest.raises(ValueError, match="rounds to 1"):
        wilson_interval(5, 10, z=8.5)


def test_topology_calibration_z_is_bounded_before_any_model_work():
    from harness.app import with_sequoia
    from harness.config import compose
    from harness.contracts import ConfigError
    from harness.engine.build import plan

    base = ["model=tiny", "proposer=draft_model", "proposer.sampling=without_replacement", "topology=sequoia"]
    base += ["verifier=sequoia", "generation.temperature=0.7"]
    with pytest.raises(ConfigError) as info:
        plan(compose(with_sequoia([*base, "topology.calibration.z=9"])))
    assert "topology.calibration.z=9.0" in str(info.value) and "(0, 7]" in str(info.value)
    assert "\n" not in str(info.value)
    plan(compose(with_sequoia([*base, "topology.calibration.z=7"])))


def test_the_profile_prefix_is_sized_by_the_depth_the_search_reaches():
    """The search builds trees at most min(topology.max_depth, topology.max_nodes) deep (a tree of
    max_nodes rows is no deeper), and the profile times the draft's pass over that depth + 1 tokens: the
    prefix it needs is sized by that depth, so max_nodes=4 max_depth=30 takes the prefix max_depth=4 takes."""
    from harness.app import with_sequoia
    from harness.config import compose
    from harness.contracts import ConfigError
    from harness.topology.budgets import sequoia_budget

    base = ["model=tiny", "proposer=draft_model", "proposer.sampling=without_replacement", "topology=sequoia"]
    base += ["verifier=sequoia", "generation.temperature=0.7", "topology.max_nodes=4"]

    def budget(*over):
        return sequoia_budget(compose(with_sequoia([*base, *over])).topology)

    for depth in (4, 30):
        assert budget(f"topology.max_depth={depth}", "topology.profile.prefix_len=24").max_depth == depth
        assert budget(f"topology.max_depth={depth}", "topology.profile.prefix_len=6").max_nodes == 4
    with pytest.raises(ConfigError) as info:  # capped by max_nodes: 4 + 1 tokens after a prefix of one
        budget("topology.max_depth=30", "topology.profile.prefix_len=5")
    assert str(info.value).startswith(
        "topology.profile.prefix_len=5: the profile times the draft's pass over up to topology.max_nodes + 1 = 5 "
        "committed tokens after a cached prefix of at least one (a tree of 4 candidate rows is at most 4 deep)"
    )
    assert info.value.suggestions == (("topology.profile.prefix_len=6",),)
    with pytest.raises(ConfigError, match=r"up to topology.max_depth \+ 1 = 4 committed tokens"):
        budget("topology.max_depth=3", "topology.profile.prefix_len=4")
    budget("topology.max_depth=3", "topology.profile.prefix_len=5")
