"""Sequoia acceptance vectors, tree DP and hardware-aware choice."""

from __future__ import annotations

import math
import random
from functools import cache

import pytest

from harness.topology.sequoia import (
    SEARCHED_EVERY_TREE,
    draft_time,
    expected_tokens,
    level_internal_nodes,
    optimize_tree,
    select_hardware_aware,
    selected_child_probabilities,
    tree_depth,
    tree_draft_time,
    tree_to_budget_parents,
    validate_selected_child_probabilities,
    wilson_interval,
)

TOY_H = [0.82, 0.48, 0.24]
TOY_P = [0.82, 0.0864, 0.022464]
TOY_T = [1.0, 1.0, 1.03, 1.08, 1.16, 1.28, 1.43, 1.62]
TOY_C = 0.09
CHAIN5_G = 1 + 0.82 + 0.82**2 + 0.82**3 + 0.82**4  # 3.49588976


# ---------------------------------------------------------------- acceptance vectors


def test_h_to_p_matches_the_toy():
    p = selected_child_probabilities(TOY_H)
    assert p == pytest.approx(TOY_P, abs=1e-15)
    assert math.fsum(p) == pytest.approx(0.928864, abs=1e-12)  # 0.071136 left for "no child"
    assert selected_child_probabilities([]) == []
    assert selected_child_probabilities([1.0, 0.7]) == [1.0, 0.0]  # first always taken


@pytest.mark.parametrize("h", [[0.5, 1.2], [-0.1], [float("nan")], ["0.5"]])
def test_h_refused_outside_unit_interval(h):
    with pytest.raises(ValueError, match="h"):
        selected_child_probabilities(h)


def test_passing_h_as_p_is_refused_with_conversion_hint():
    with pytest.raises(ValueError) as err:
        validate_selected_child_probabilities(TOY_H)
    msg = str(err.value)
    assert "1.54" in msg and "conditional" in msg and "h_j" in msg and "p_j = h_j" in msg


@pytest.mark.parametrize(
    "p, reason",
    [
        ([0.5, float("inf")], "not finite"),
        ([float("nan")], "not finite"),
        ([0.5, -0.01], r"\[0, 1\]"),
        ([1.5], r"\[0, 1\]"),
        ([0.6, 0.5], "mass"),
        ([], "at least one"),
        ([True], "number"),
    ],
)
def test_invalid_acceptance_refused_with_reason(p, reason):
    with pytest.raises(ValueError, match=reason):
        validate_selected_child_probabilities(p)


def test_valid_acceptance_passes_exact_mass_one():
    assert validate_selected_child_probabilities([0.7, 0.3]) == [0.7, 0.3]
    assert validate_selected_child_probabilities(TOY_P) == TOY_P


def _wilson_closed_form(k: int, n: int, z: float) -> tuple[float, float]:
    phat = k / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n))
    return centre - half, centre + half


@pytest.mark.parametrize(
    "k, n, z", [(7, 10, 1.96), (0, 10, 1.96), (10, 10, 1.96), (410, 500, 1.96), (43, 500, 2.576), (1, 1, 1.0)]
)
def test_wilson_interval_matches_closed_form(k, n, z):
    lo, hi = wilson_interval(k, n, z=z)
    want_lo, want_hi = _wilson_closed_form(k, n, z)
    assert lo == pytest.approx(want_lo, abs=1e-9) and hi == pytest.approx(want_hi, abs=1e-9)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_wilson_interval_known_value_and_refusals():
    lo, hi = wilson_interval(7, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.3968, 0.8922)  # not the Wald (0.416, 0.984)
    with pytest.raises(ValueError, match="trials"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="integer"):
        wilson_interval(0.5, 10)


# ---------------------------------------------------------------- trees and the evaluator


def test_expected_tokens_by_hand():
    assert expected_tokens([-1, 0, 1, 2, 3], None, TOY_P) == pytest.approx(3.49588976, abs=1e-12)
    assert expected_tokens([-1, 0, 0, 0], None, TOY_P) == pytest.approx(1.928864, abs=1e-12)
    # root -> a (rank 1) -> a' (rank 1); root -> b (rank 2)
    assert expected_tokens([-1, 0, 1, 0], [0, 1, 1, 2], TOY_P) == pytest.approx(1 + 0.82 + 0.82**2 + 0.0864)
    # explicit ranks may list siblings out of order; the rank, not the position, picks p
    assert expected_tokens([-1, 0, 0], [0, 2, 1], TOY_P) == pytest.approx(1 + 0.82 + 0.0864)
    assert expected_tokens([-1], None, TOY_P) == 1.0


@pytest.mark.parametrize(
    "parents, ranks, reason",
    [
        ([0, 0], None, "root"),
        ([-1, 1], None, "earlier node"),
        ([-1, 0, 3, 0], None, "earlier node"),
        ([-1, 0], [0, 2], "ranks 1..1"),  # a rank-2 child without the rank-1 sibling
        ([-1, 0, 0], [0, 1, 1], "ranks 1..2"),
        ([-1, 0, 0, 0, 0], None, "only 3 slots"),
        ([-1, 0], [1, 1], "root's rank"),
    ],
)
def test_bad_trees_refused(parents, ranks, reason):
    with pytest.raises(ValueError, match=reason):
        expected_tokens(parents, ranks, TOY_P)


def test_tree_to_budget_parents():
    assert tree_to_budget_parents([-1, 0, 1, 2, 3]) == (-1, 0, 1, 2)  # chain: row r hangs on r-1
    assert tree_to_budget_parents([-1, 0, 0, 0]) == (-1, -1, -1)  # star: all on the frontier
    assert tree_to_budget_parents([-1, 0, 1, 2, 3, 1, 0, 6]) == (-1, 0, 1, 2, 0, -1, 5)
    assert tree_to_budget_parents([-1]) == ()
    with pytest.raises(ValueError, match="root"):
        tree_to_budget_parents([0, 0])


def test_budget_parents_preserve_depths():
    parents = [-1, 0, 1, 2, 3, 1, 0, 6]
    rows = tree_to_budget_parents(parents)
    node_depth = [0]
    for v in range(1, len(parents)):
        node_depth.append(node_depth[parents[v]] + 1)
    row_depth: list[int] = []
    for r, u in enumerate(rows):
        row_depth.append(1 if u == -1 else row_depth[u] + 1)
        assert u < r
    assert row_depth == node_depth[1:]


# ---------------------------------------------------------------- the DP


def test_dp_toy():
    table = optimize_tree(acceptance=TOY_P, max_nodes=8, max_depth=4)
    chain = table.best(5, 4)
    assert chain is not None
    assert chain.parents == (-1, 0, 1, 2, 3) and chain.ranks == (0, 1, 1, 1, 1)
    assert chain.expected_tokens == pytest.approx(3.49588976, abs=1e-8)
    assert (chain.nodes, chain.depth, chain.candidate_rows) == (5, 4, 4)
    # depth 1 with 3 slots: a star of at most 4 nodes
    assert table.g(4, 1) == pytest.approx(1.928864, abs=1e-12)
    assert table.g(5, 1) is None and table.best(5, 1) is None
    assert table.g(2, 0) is None and table.g(1, 0) == 1.0
    # the depth index is a bound ("at most d"): a 2-node tree has depth 1 under every bound >= 1
    assert table.g(2, 4) == table.g(2, 1) == pytest.approx(1.82)
    assert table.best(2, 4).depth == 1
    assert table.g(5, 3) < CHAIN5_G  # the five-node chain needs depth 4


def test_dp_table_shape_and_bounds():
    table = optimize_tree(acceptance=TOY_P, max_nodes=8, max_depth=4)
    rows = table.expected_tokens_table()
    assert [(n, d) for n, d, _ in rows] == [(n, d) for n in range(1, 9) for d in range(5)]
    for n, d, g in rows:
        assert (g is None) == (n > sum(3**k for k in range(d + 1)))  # max nodes within depth d
        if g is not None:
            assert 1.0 <= g <= min(n, d + 1)
            tree = table.best(n, d)
            assert expected_tokens(tree.parents, tree.ranks, TOY_P) == pytest.approx(g, abs=1e-12)
            assert tree.nodes == n and tree.depth <= d and tree_depth(tree.parents) == tree.depth


def _ordered_trees(k: int, d: int, b: int):
    """All ordered trees with exactly k nodes, depth <= d, <= b children per node (nested tuples)."""

    @cache
    def trees(k: int, d: int) -> tuple:
        if k == 1:
            return ((),)
        if d == 0:
            return ()
        return forests(k - 1, d - 1, b)

    @cache
    def forests(k: int, d: int, slots: int) -> tuple:
        if k == 0:
            return ((),)
        if slots == 0:
            return ()
        out = []
        for s in range(1, k + 1):
            for first in trees(s, d):
                for rest in forests(k - s, d, slots - 1):
                    out.append((first,) + rest)
        return tuple(out)

    return trees(k, d)


def _g_nested(tree: tuple, p: list[float]) -> float:
    return 1.0 + sum(p[j] * _g_nested(child, p) for j, child in enumerate(tree))


def _to_parents(tree: tuple) -> list[int]:
    parents = [-1]

    def walk(node: tuple, me: int) -> None:
        for child in node:
            parents.append(me)
            walk(child, len(parents) - 1)

    walk(tree, 0)
    return parents


def test_tree_enumeration_counts():
    # Catalan numbers: ordered trees with k nodes, unbounded width and depth
    assert [len(_ordered_trees(k, 10, 10)) for k in range(1, 8)] == [1, 1, 2, 5, 14, 42, 132]
    assert len(_ordered_trees(4, 1, 3)) == 1 and len(_ordered_trees(5, 1, 3)) == 0


@pytest.mark.parametrize(
    "acceptance",
    [
        TOY_P,
        [0.82],  # chains only
        [0.3, 0.6],  # p not decreasing: a wider tree may beat the chain
        [0.5, 0.0, 0.4],  # a useless slot
        [0.6, 0.25, 0.1, 0.05],
        [0.0],  # nothing is ever accepted: G = 1
    ],
)
def test_dp_agrees_with_enumeration_of_all_small_trees(acceptance):
    N, D = 7, 4
    table = optimize_tree(acceptance=acceptance, max_nodes=N, max_depth=D)
    for n in range(1, N + 1):
        for d in range(D + 1):
            trees = _ordered_trees(n, d, len(acceptance))
            got = table.best(n, d)
            if not trees:
                assert got is None and table.g(n, d) is None, (n, d)
                continue
            brute = max(_g_nested(t, acceptance) for t in trees)
            assert got is not None, (n, d)
            assert got.expected_tokens == pytest.approx(brute, abs=1e-12), (n, d)
            assert table.g(n, d) == pytest.approx(brute, abs=1e-12)
            # the reconstructed shape is one of the optimal enumerated trees
            optimal = {tuple(_to_parents(t)) for t in trees if abs(_g_nested(t, acceptance) - brute) <= 1e-12}
            assert got.parents in optimal, (n, d, got.parents)
            for t in trees[:20]:  # the module's evaluator agrees with the nested one
                assert expected_tokens(_to_parents(t), None, acceptance) == pytest.approx(_g_nested(t, acceptance))


def test_dp_beats_random_larger_trees():
    rng = random.Random(0)
    p = selected_child_probabilities([0.7, 0.5, 0.4, 0.3])
    table = optimize_tree(acceptance=p, max_nodes=40, max_depth=7)
    for _ in range(300):
        n = rng.randint(1, 40)
        parents, depth, kids = [-1], [0], [0]
        while len(parents) < n:
            u = rng.randrange(len(parents))
            if kids[u] < len(p) and depth[u] < 7:
                parents.append(u)
                depth.append(depth[u] + 1)
                kids.append(0)
                kids[u] += 1
        g = expected_tokens(parents, None, p)
        best = table.g(n, max(depth))
        assert best is not None and g <= best + 1e-12


def test_dp_refuses_bad_input():
    with pytest.raises(ValueError, match="mass"):
        optimize_tree(acceptance=TOY_H, max_nodes=8, max_depth=4)
    with pytest.raises(ValueError, match="max_nodes"):
        optimize_tree(acceptance=TOY_P, max_nodes=0, max_depth=4)
    with pytest.raises(ValueError, match="max_depth"):
        optimize_tree(acceptance=TOY_P, max_nodes=8, max_depth=-1)
    with pytest.raises(ValueError, match="max_nodes"):
        optimize_tree(acceptance=TOY_P, max_nodes=8.0, max_depth=4)
    table = optimize_tree(acceptance=TOY_P, max_nodes=8, max_depth=4)
    with pytest.raises(ValueError, match="1 <= n <= 8"):
        table.best(9, 4)


def test_dp_large_budget_chain_and_bounds():
    table = optimize_tree(acceptance=[0.9], max_nodes=128, max_depth=12)
    tree = table.best(13, 12)
    assert tree.parents == tuple(range(-1, 12))
    assert tree.expected_tokens == pytest.approx(sum(0.9**k for k in range(13)))
    assert table.g(14, 12) is None  # B = 1: only chains, at most d + 1 nodes


# ---------------------------------------------------------------- hardware-aware choice


def _time(table, n, d, t, c, c0=None):
    """Sequoia's (t(n) + d c) / G with the first level's pass c0 in place of one c."""
    return (t[n - 1] + (c if c0 is None else c0) + (d - 1) * c) / table.g(n, d)


def test_hardware_aware_toy():
    table = optimize_tree(acceptance=TOY_P, max_nodes=8, max_depth=4)
    choice = select_hardware_aware(table, verify_cost=TOY_T, draft_cost=TOY_C)
    assert (choice.n, choice.d, choice.candidate_rows) == (5, 4, 4)
    assert choice.parents == (-1, 0, 1, 2, 3)
    assert choice.expected_tokens == pytest.approx(3.49588976, abs=1e-8)
    assert choice.time_per_token == pytest.approx((1.16 + 4 * 0.09) / CHAIN5_G, abs=1e-12)
    assert round(choice.time_per_token, 4) == 0.4348
    # runners-up: Not n=4 (0.4435) or n=6 (0.4578)
    assert _time(table, 4, 3, TOY_T, TOY_C) == pytest.approx(0.4435, abs=1e-4)
    assert _time(table, 6, 4, TOY_T, TOY_C) == pytest.approx(0.4578, abs=1e-4)
    # admitting plain AR (n=1, time t(1)=1) does not change the toy's answer
    assert select_hardware_aware(table, verify_cost=TOY_T, draft_cost=TOY_C, min_nodes=1).n == 5


def test_hardware_aware_equals_brute_force_over_table():
    rng = random.Random(1)
    p = selected_child_probabilities([0.8, 0.5, 0.3])
    table = optimize_tree(acceptance=p, max_nodes=24, max_depth=6)
    for _ in range(30):
        t = [1.0] + sorted(1.0 + rng.uniform(0, 2.0) for _ in range(23))
        c, c0 = rng.uniform(0, 0.3), rng.uniform(0, 0.5)
        choice = select_hardware_aware(table, verify_cost=t, draft_cost=c, draft_base_cost=c0)
        brute = min(_time(table, n, d, t, c, c0) for n in range(2, 25) for d in range(7) if table.g(n, d) is not None)
        assert choice.time_per_token == pytest.approx(brute, abs=1e-12)
        assert choice.time_per_token == pytest.approx(_time(table, choice.n, choice.d, t, c, c0), abs=1e-12)


def test_expensive_drafting_makes_plain_ar_win_only_when_admitted():
    table = optimize_tree(acceptance=[0.3], max_nodes=4, max_depth=3)
    t = [1.0, 2.0, 3.0, 4.0]
    spec = select_hardware_aware(table, verify_cost=t, draft_cost=0.5)
    assert spec.n == 2 and spec.time_per_token == pytest.approx(2.5 / 1.3)  # > 1: speculation loses
    ar = select_hardware_aware(table, verify_cost=t, draft_cost=0.5, min_nodes=1)
    assert (ar.n, ar.d, ar.time_per_token, ar.parents) == (1, 0, 1.0, (-1,))


def test_the_draft_time_counts_one_pass_per_level_that_has_children():
    """A depth-d tree is drafted by the pass on the pending token (c0: the first level) and d - 1
    steps (the deepest level is drafted, not passed): the model charged c0 + d c, one step too many,
    which made every tree look dearer than plain decoding by c and overstated its predicted time."""
    assert draft_time(1, draft_cost=0.3, draft_base_cost=0.5) == 0.5
    assert draft_time(3, draft_cost=0.3, draft_base_cost=0.5) == pytest.approx(1.1)
    assert draft_time(3, draft_cost=0.3) == pytest.approx(0.9) and draft_time(0, draft_cost=0.3) == 0.0
    table = optimize_tree(acceptance=[0.3], max_nodes=4, max_depth=3)
    t = [1.0, 1.2, 1.4, 1.6]
    # a draft whose pending-token pass c0 is its whole cost for a one-level set
    one = select_hardware_aware(table, verify_cost=t, draft_cost=0.5, draft_base_cost=0.1)
    assert (one.n, one.d) == (2, 1) and one.time_per_token == pytest.approx((1.2 + 0.1) / 1.3)


def test_draft_base_cost_pushes_toward_larger_trees():
    table = optimize_tree(acceptance=TOY_P, max_nodes=8, max_depth=4)
    flat = [1.0] * 8  # free verification width
    cheap = select_hardware_aware(table, verify_cost=flat, draft_cost=0.3)
    dear = select_hardware_aware(table, verify_cost=flat, draft_cost=0.3, draft_base_cost=5.0)
    assert cheap.time_per_token == pytest.approx(_time(table, cheap.n, cheap.d, flat, 0.3))
    assert cheap.time_per_token < dear.time_per_token
    assert dear.expected_tokens >= cheap.expected_tokens


def test_a_trees_draft_time_follows_its_shape_and_its_acceptance():
    """The draft's first pass takes the last round's committed tokens (k = accepted + 1: P(accepted >= j)
    is the reach probability summed over depth j), and each level with children is one forward of its
    nodes with children: unmasked while the tree is a chain down to it, else a masked step of r rows."""
    feed, level = [1.0, 2.0, 3.0], [10.0, 20.0]
    c = 0.5
    # a chain of depth 2 at p = [0.5]: the draft keeps its drafted rows, so the next pass feeds the bonus
    # token alone, or two tokens where the whole chain was accepted (P = 0.25); one chain step
    assert level_internal_nodes([-1, 0, 1]) == [1]
    t = tree_draft_time([-1, 0, 1], None, [0.5], draft_cost=c, draft_base_cost=9.0, feed_cost=feed, level_cost=level)
    assert t == pytest.approx(0.75 * 1 + 0.25 * 2 + c)
    # two root children, the first with a child: P(a = 0, 1, 2) = 0.2, 0.55, 0.25; the level-2 forward
    # is one row whose ancestors are the committed prefix: a chain step, as the draft runs it
    t = tree_draft_time(
        [-1, 0, 0, 1], None, [0.5, 0.3], draft_cost=c, draft_base_cost=9.0, feed_cost=feed, level_cost=level
    )
    assert t == pytest.approx(0.2 * 1 + 0.55 * 2 + 0.25 * 3 + c)
    # both root children have children: one masked step of 2 rows
    parents = [-1, 0, 0, 1, 2]
    assert level_internal_nodes(parents) == [2]
    reach2 = 0.5 * 0.5 + 0.3 * 0.5
    want = (1 - 0.8) * 1 + (0.8 - reach2) * 2 + reach2 * 3 + 20.0
    assert tree_draft_time(
        parents, None, [0.5, 0.3], draft_cost=c, draft_base_cost=9.0, feed_cost=feed, level_cost=level
    ) == pytest.approx(want)
    # without the vectors: Sequoia's scalar model, c0 + (d - 1) c
    assert tree_draft_time(parents, None, [0.5, 0.3], draft_cost=c, draft_base_cost=9.0) == draft_time(
        2, draft_cost=c, draft_base_cost=9.0
    )
    with pytest.raises(ValueError, match="feed_cost must give the pass over 1..3 tokens"):
        tree_draft_time(parents, None, [0.5, 0.3], draft_cost=c, draft_base_cost=1.0, feed_cost=[1.0])


def test_a_masked_level_dearer_than_a_chain_step_moves_the_choice_to_a_chain():
    """Priced by the scalar model the toy's wide trees and its chain are drafted alike; where a masked
    level costs several chain steps (as a CPU draft's masked forwards do), the choice is the chain and
    its recorded draft time is the tree's own."""
    p = [0.5, 0.3, 0.1]
    table = optimize_tree(acceptance=p, max_nodes=8, max_depth=4)
    flat = [1.0] * 8
    scalar = select_hardware_aware(table, verify_cost=flat, draft_cost=0.1)
    assert any(r > 1 for r in level_internal_nodes(scalar.parents))  # a branching tree
    feed = [0.1] * 5
    priced = select_hardware_aware(table, verify_cost=flat, draft_cost=0.1, feed_cost=feed, level_cost=[0.9, 0.9, 0.9])
    assert all(r == 1 for r in level_internal_nodes(priced.parents))
    assert priced.draft_time == pytest.approx(
        tree_draft_time(priced.parents, priced.ranks, p, draft_cost=0.1, draft_base_cost=0.1, feed_cost=feed)
    )
    assert priced.time_per_token == pytest.approx((1.0 + priced.draft_time) / priced.expected_tokens)
    # brute force over every tree of 2..8 nodes and depth <= 4, each priced by its own shape: with these flat
    # vectors the search is exact (a tree of fewer expected tokens than the table's best of its size and depth
    # may draft cheaper: the table's trees alone miss it)
    brute = min(
        (
            1.0
            + tree_draft_time(
                _to_parents(t), None, p, draft_cost=0.1, draft_base_cost=0.1, feed_cost=feed, level_cost=[0.9, 0.9, 0.9]
            )
        )
        / _g_nested(t, p)
        for n in range(2, 9)
        for t in _ordered_trees(n, 4, len(p))
    )
    assert priced.time_per_token == pytest.approx(brute, abs=1e-12)
    assert priced.searched == SEARCHED_EVERY_TREE
    with pytest.raises(ValueError, match="level_cost must give 3 finite numbers"):
        select_hardware_aware(table, verify_cost=flat, draft_cost=0.1, level_cost=[0.9])


def test_the_widest_tree_is_the_largest_that_fits_the_depth():
    """Nine nodes cannot fit depth 1 under three ranks: the max-expected-tokens tree is the four-node one
    (the tree artifact said there was none)."""
    table = optimize_tree(acceptance=[0.5, 0.3, 0.1], max_nodes=9, max_depth=1)
    assert table.best(9, 1) is None
    widest = table.widest(1)
    assert (widest.nodes, widest.depth) == (4, 1) and widest.expected_tokens == pytest.approx(1.9)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(verify_cost=[2.0] + TOY_T[1:], draft_cost=TOY_C), "t\\(1\\) = 1"),
        (dict(verify_cost=TOY_T[:7], draft_cost=TOY_C), "t\\(1..8\\)"),
        (dict(verify_cost=TOY_T[:3] + [float("nan")] + TOY_T[4:], draft_cost=TOY_C), "t\\(4\\)"),
        (dict(verify_cost=TOY_T, draft_cost=-0.1), "draft_cost"),
        (dict(verify_cost=TOY_T, draft_cost=TOY_C, draft_base_cost=float("inf")), "draft_base_cost"),
        (dict(verify_cost=TOY_T, draft_cost=TOY_C, min_nodes=0), "min_nodes"),
    ],
)
def test_hardware_aware_refuses_bad_costs(kwargs, reason):
    table = optimize_tree(acceptance=TOY_P, max_nodes=8, max_depth=4)
    with pytest.raises(ValueError, match=reason):
        select_hardware_aware(table, **kwargs)


def test_a_depth_past_the_node_count_is_capped_and_a_table_past_the_memory_limit_refused():
    """A tree of n nodes is at most n - 1 deep: a larger depth bound gives the same trees without
    the table growing with it; bounds whose DP would not fit are refused before any allocation."""
    from harness.topology.sequoia import DP_TABLE_LIMIT_BYTES, dp_table_bytes

    acc = [0.6, 0.2, 0.1]
    capped = optimize_tree(acceptance=acc, max_nodes=12, max_depth=1_000_000)
    exact = optimize_tree(acceptance=acc, max_nodes=12, max_depth=11)
    assert capped.max_depth == 11 and capped.score.shape == exact.score.shape
    assert capped.best(12, 1_000_000).parents == exact.best(12, 11).parents
    assert capped.g(12, 500) == exact.g(12, 11)
    assert dp_table_bytes(20_000, 20, 2) > DP_TABLE_LIMIT_BYTES
    with pytest.raises(ValueError, match=r"max_nodes=20000 max_depth=20 over 2 ranks: the Sequoia DP would hold"):
        optimize_tree(acceptance=[0.5, 0.2], max_nodes=20_000, max_depth=20)


# ---------------------------------------------------------------- the preparation's put-back


class _CutShort:
    """A file opened for writing whose write of ``data`` stops halfway with an interrupt, as a
    Ctrl-C in the middle of the write would; other writes go through."""

    def __init__(self, f, data: bytes):
        self._f, self._data = f, data

    def write(self, b):
        if bytes(b) != self._data:
            return self._f.write(b)
        self._f.write(bytes(b)[: len(b) // 2])
        self._f.flush()
        raise KeyboardInterrupt

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_an_interrupt_while_a_re_measured_file_is_put_back_leaves_it_whole(tmp_path, monkeypatch, capsys):
    """`harness calibrate` re-measures the calibration; when the tree search then refuses, the earlier
    file is put back. An interrupt in the middle of that write leaves the file whole (the earlier
    bytes or the re-measured ones, which load), never a part that later runs refuse, and no temporary
    file beside it."""
    import io
    import json
    from pathlib import Path

    from helpers import SEQUOIA_SMALL_TREE

    from harness.app import calibrate_main
    from harness.prepare import sequoia
    from harness.prepare.profile import read_artifact

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert calibrate_main(SEQUOIA_SMALL_TREE) == 0
    cal = Path(json.loads(capsys.readouterr().out)["sequoia_calibration"])
    earlier = cal.read_bytes()
    measured = {}
    real_open = io.open

    def opening(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _CutShort(f, earlier) if "w" in mode and measured else f

    def refuse(**_):
        measured["bytes"] = cal.read_bytes()  # the re-measured calibration, in place until the put-back
        raise ValueError("the hardware-aware choice is plain autoregressive decoding (n = 1)")

    monkeypatch.setattr(sequoia, "build_tree_artifact", refuse)
    monkeypatch.setattr(io, "open", opening)
    with pytest.raises(KeyboardInterrupt):
        calibrate_main(SEQUOIA_SMALL_TREE)
    monkeypatch.setattr(io, "open", real_open)
    assert measured and cal.read_bytes() in (earlier, measured["bytes"])
    read_artifact(cal, kind=sequoia.CALIBRATION_KIND)  # it loads
    assert [p.name for p in cal.parent.iterdir() if p.name.endswith(".tmp")] == []  # the put-back's temporary
