"""Sequoia tree optimisation: acceptance vectors, the depth-indexed DP, hardware-aware choice.

Sequoia (Chen et al., 2024): a positional acceptance model, the depth-indexed dynamic program over
(nodes, depth, branches), and the hardware-aware objective G(n, d) / (t(n) + d c); with a measured
profile's draft costs by size, each tree's drafting priced by its shape (:func:`select_hardware_aware`
says which trees that search covers).

Conventions, used throughout this module and `harness tree`:

* ``n`` counts the root, as Sequoia does: ``n = candidate rows + 1``, the verify forward length.
  ``topology.max_nodes`` and :class:`harness.proposers.base.Budget` count candidate rows instead;
  :func:`tree_to_budget_parents` converts a tree found here to that form.
* ``d`` counts edges from the root. Table entries are indexed by a depth *bound*: ``best(n, d)``
  is the best tree with exactly ``n`` nodes and depth **at most** ``d``
  (:attr:`TreeResult.depth` is the depth the tree actually has, ``<= d``).
* ``G`` (expected generated tokens) includes the root's 1, so ``1 <= G <= min(n, d + 1)``.
* A tree is a parent array with the root at index 0 (parent -1) and every parent before its
  child, plus a rank per node: the rank-``j`` child of a node is the ``j``-th sibling tried, and is
  reached with the selected-child probability ``p_j`` (``acceptance[j - 1]``). A node's children
  carry ranks ``1..k``; the root's rank is 0.

This module is pure numpy / stdlib (no torch), so `harness tree` starts fast.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import binomtest, norm

#: slack for sibling mass and for the 1 <= G <= min(n, d+1) check (float summation error)
MASS_ATOL = 1e-12
BOUND_ATOL = 1e-9


# ------------------------------------------------------- acceptance vectors (positional model)


def _as_floats(values: Sequence[float], *, name: str) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence | np.ndarray):
        raise ValueError(f"{name} must be a sequence of numbers; got {type(values).__name__}")
    out: list[float] = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
            raise ValueError(f"{name}[{i}] must be a number; got {v!r}")
        out.append(float(v))
    return out


def selected_child_probabilities(h: Sequence[float]) -> list[float]:
    """Conditional sibling rates ``h`` -> selected-child probabilities ``p``.

    ``h_j`` is the acceptance rate of sibling ``j`` given that siblings ``1..j-1`` were rejected;
    ``p_j = h_j * prod_{i<j} (1 - h_i)`` (the chain rule, no independence assumed).
    ``[0.82, 0.48, 0.24] -> [0.82, 0.0864, 0.022464]``.
    """
    rates = _as_floats(h, name="h")
    for j, v in enumerate(rates):
        if not math.isfinite(v) or not 0.0 <= v <= 1.0:
            raise ValueError(f"conditional rate h[{j}] must be a finite number in [0, 1]; got {v}")
    p: list[float] = []
    none_yet = 1.0  # probability that siblings 1..j-1 were all rejected
    for v in rates:
        p.append(v * none_yet)
        none_yet *= 1.0 - v
    return p


def validate_selected_child_probabilities(p: Sequence[float]) -> list[float]:
    """Refuse anything that is not a selected-child probability vector; return it as floats.

    Each ``p_j`` must be finite and in ``[0, 1]`` and the sibling mass ``sum p_j`` at most one
    (the remainder is the chance that no represented child is selected). A vector of valid rates
    whose sum exceeds one is most likely the conditional rates ``h``; the error says so.
    """
    probs = _as_floats(p, name="acceptance")
    if not probs:
        raise ValueError("acceptance must list at least one selected-child probability p_1; got []")
    for j, v in enumerate(probs):
        if not math.isfinite(v):
            raise ValueError(f"selected-child probability p_{j + 1} is not finite; got {v}")
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"selected-child probability p_{j + 1} must be in [0, 1]; got {v}")
    mass = math.fsum(probs)
    if mass > 1.0 + MASS_ATOL:
        raise ValueError(
            f"sibling probability mass sum(p) must be <= 1 (at most one sibling is selected); got "
            f"{mass:.6g} for {probs}. These look like conditional sibling rates h_j (acceptance "
            f"given every earlier sibling was rejected), not selected-child probabilities p_j: "
            f"convert them with p_j = h_j * prod_{{i<j}}(1 - h_i) "
            f"(selected_child_probabilities(h), or `harness tree h=[...]`)"
        )
    return probs


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial rate ``successes / trials`` at normal quantile ``z``.

    Delegates to :func:`scipy.stats.binomtest` (``method="wilson"``) at confidence
    ``2 * Phi(z) - 1``; ``z = 1.96`` is the usual 95 % interval. A ``z`` whose confidence rounds to 1
    in double precision (above about 8.2) is refused: it has no interval (scipy's would be NaN).
    """
    for name, v in (("successes", successes), ("trials", trials)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ValueError(f"{name} must be an integer; got {v!r}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1 for an interval; got {trials}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, trials={trials}]; got {successes}")
    if not math.isfinite(z) or z <= 0:
        raise ValueError(f"z must be a positive finite quantile; got {z}")

    confidence = float(2.0 * norm.cdf(z) - 1.0)
    if confidence >= 1.0:
        raise ValueError(f"z={z} is too large: its confidence 2 Phi(z) - 1 rounds to 1 (z must be below about 8.2)")
    ci = binomtest(int(successes), int(trials)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


# ---------------------------------------------------------------- trees as parent arrays


def _check_tree(parents: Sequence[int], ranks: Sequence[int] | None, branches: int | None) -> list[int]:
    """Validate a root-inclusive parent array (and ranks); return the ranks (inferred if None)."""
    par = [int(x) for x in parents]
    if not par or par[0] != -1:
        raise ValueError(f"parents must start with the root (parent -1) at index 0; got {par[:4]}")
    for v in range(1, len(par)):
        if not 0 <= par[v] < v:
            raise ValueError(f"parents[{v}] must be an earlier node in [0, {v}); got {par[v]}")
    if ranks is None:
        seen: dict[int, int] = {}
        rk = [0]
        for v in range(1, len(par)):
            seen[par[v]] = seen.get(par[v], 0) + 1
            rk.append(seen[par[v]])
    else:
        rk = [int(x) for x in ranks]
        if len(rk) != len(par):
            raise ValueError(f"ranks must have one entry per node ({len(par)}); got {len(rk)}")
        if rk[0] != 0:
            raise ValueError(f"the root's rank must be 0; got {rk[0]}")
    children: dict[int, list[int]] = {}
    for v in range(1, len(par)):
        children.setdefault(par[v], []).append(rk[v])
    for u, got in children.items():
        if sorted(got) != list(range(1, len(got) + 1)):
            raise ValueError(f"the children of node {u} must carry ranks 1..{len(got)}; got {got}")
        if branches is not None and len(got) > branches:
            raise ValueError(f"node {u} has {len(got)} children but acceptance has only {branches} slots")
    return rk


def tree_depth(parents: Sequence[int]) -> int:
    """Depth in edges of a root-inclusive parent array (0 for the root alone)."""
    _check_tree(parents, None, None)
    depth = [0] * len(parents)
    for v in range(1, len(parents)):
        depth[v] = depth[parents[v]] + 1
    return max(depth)


def expected_tokens(parents: Sequence[int], ranks: Sequence[int] | None, acceptance: Sequence[float]) -> float:
    """Expected generated tokens ``G = sum_v prod_{j in Path(v)} p_j`` of a tree (root counted).

    Independent of the DP: it walks the parent array. ``ranks=None`` ranks children by order.
    """
    p = validate_selected_child_probabilities(acceptance)
    rk = _check_tree(parents, ranks, len(p))
    reach = [1.0] * len(parents)  # f(v): probability verification reaches node v
    for v in range(1, len(parents)):
        reach[v] = reach[parents[v]] * p[rk[v] - 1]
    return math.fsum(reach)


def tree_to_budget_parents(parents: Sequence[int]) -> tuple[int, ...]:
    """Root-inclusive parent array (root = index 0) -> candidate-row parents for a proposer.

    The root is dropped, so node ``v`` becomes candidate row ``v - 1`` (same order); a child of the
    root gets ``-1`` (the prefix frontier), any other parent ``u`` becomes row ``u - 1``.
    ``[-1, 0, 1, 0] -> (-1, 0, -1)``.
    """
    _check_tree(parents, None, None)
    return tuple(-1 if int(u) == 0 else int(u) - 1 for u in list(parents)[1:])


# --------------------------------------------------------------------- the depth-indexed DP


@dataclass(frozen=True)
class TreeResult:
    """One optimal tree. ``parents[0] == -1`` is the root; ``ranks[v]`` picks ``p_{ranks[v]}``."""

    expected_tokens: float  # G, root included
    nodes: int  # n, root included
    depth: int  # actual depth in edges (<= the bound it was asked for)
    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def candidate_rows(self) -> int:
        return self.nodes - 1


@dataclass(frozen=True, eq=False)
class SequoiaTable:
    """Filled DP. ``score[n, d, b]``: best G with exactly n nodes, depth <= d, b root children.

    Arrays (index 0 along n is unused; it is -inf):
      score  [N+1, D+1, B+1] float64, -inf = infeasible
      split  [N+1, D+1, B+1] int64, nodes y in the left part (root + first b-1 subtrees), -1 = none
      best_g [N+1, D+1]      float64, max_b score, -inf = infeasible
      best_b [N+1, D+1]      int64, argmax_b (smallest on ties)
    """

    acceptance: tuple[float, ...]
    max_nodes: int
    max_depth: int
    score: np.ndarray
    split: np.ndarray
    best_g: np.ndarray
    best_b: np.ndarray

    def _check_query(self, n: int, d: int) -> int:
        """``d`` as stored: a depth bound past the table's (at most max_nodes - 1) reads as it."""
        if not (1 <= n <= self.max_nodes and 0 <= d):
            raise ValueError(f"(n, d) must satisfy 1 <= n <= {self.max_nodes} and 0 <= d; got ({n}, {d})")
        return min(int(d), self.max_depth)

    def g(self, n: int, d: int) -> float | None:
        """Best expected tokens with exactly n nodes and depth <= d; None where infeasible."""
        d = self._check_query(n, d)
        value = float(self.best_g[n, d])
        return value if math.isfinite(value) else None

    def best(self, n: int, d: int) -> TreeResult | None:
        """The optimal tree with exactly n nodes (root included) and depth <= d; None if none fits."""
        d = self._check_query(n, d)
        if not math.isfinite(float(self.best_g[n, d])):
            return None
        parents: list[int] = [-1]
        ranks: list[int] = [0]
        self._emit(n, d, int(self.best_b[n, d]), 0, parents, ranks)
        p = list(self.acceptance)
        g = expected_tokens(parents, ranks, p)
        if abs(g - float(self.best_g[n, d])) > BOUND_ATOL * max(1.0, g):
            raise AssertionError(f"reconstructed tree scores {g}, the DP said {float(self.best_g[n, d])} at ({n}, {d})")
        if len(parents) != n:
            raise AssertionError(f"reconstructed {len(parents)} nodes at ({n}, {d})")
        depth = tree_depth(parents)
        if depth > d:
            raise AssertionError(f"reconstructed depth {depth} > bound {d} at ({n}, {d})")
        return TreeResult(expected_tokens=g, nodes=n, depth=depth, parents=tuple(parents), ranks=tuple(ranks))

    def widest(self, d: int) -> TreeResult:
        """The most expected tokens any tree of depth <= d reaches: the best tree of the largest
        feasible size (a node never lowers G), which is below ``max_nodes`` where that many nodes
        cannot fit the depth with the ranks calibrated."""
        n = max(k for k in range(1, self.max_nodes + 1) if self.g(k, d) is not None)  # n = 1 always fits
        tree = self.best(n, d)
        assert tree is not None
        return tree

    def _emit(self, n: int, d: int, b: int, node: int, parents: list[int], ranks: list[int]) -> None:
        """Append the children of ``node`` (a subtree of n nodes, depth <= d, b children), pre-order."""
        subtrees: list[tuple[int, int]] = []  # (nodes, branch count) of child subtrees, rank b..1
        while b > 0:
            y = int(self.split[n, d, b])
            m = n - y
            subtrees.append((m, int(self.best_b[m, d - 1])))
            n, b = y, b - 1
        for rank, (m, mb) in enumerate(reversed(subtrees), start=1):
            child = len(parents)
            parents.append(node)
            ranks.append(rank)
            self._emit(m, d - 1, mb, child, parents, ranks)

    def expected_tokens_table(self) -> list[list]:
        """``[n, d, G]`` for every 1 <= n <= N and 0 <= d <= D (G None where infeasible)."""
        return [[n, d, self.g(n, d)] for n in range(1, self.max_nodes + 1) for d in range(self.max_depth + 1)]


#: the largest DP table (and its temporaries) :func:`optimize_tree` fills, in bytes
DP_TABLE_LIMIT_BYTES = 2 << 30


def dp_table_bytes(max_nodes: int, max_depth: int, branches: int) -> int:
    """Bytes the DP for these bounds holds at once: the [N+1, D+1, B+1] score and split tables,
    the [N+1, D+1] best tables and about six [N+1, N+1] temporaries (D capped at N - 1)."""
    n, d = int(max_nodes) + 1, min(int(max_depth), int(max_nodes) - 1) + 1
    return n * d * (int(branches) + 1) * 16 + n * d * 16 + 6 * n * n * 8


def shape_search_bytes(max_nodes: int, max_depth: int) -> int:
    """Bytes the search over tree shapes under a profile's varying draft costs holds at once
    (:func:`select_hardware_aware` with ``feed_cost`` and ``level_cost``, which every measured profile
    has), for bounds ``max_nodes`` (root included) and ``max_depth`` (capped at ``max_nodes - 1``,
    as the DP table is)."""
    n, d = int(max_nodes), min(int(max_depth), int(max_nodes) - 1)
    return max(d - 1, 1) * (n + 1) * (d + 1) * 16


def check_dp_size(max_nodes: int, max_depth: int, branches: int, *, keys: tuple[str, str] = ("max_nodes", "max_depth")):
    """Refuse bounds whose DP would not fit :data:`DP_TABLE_LIMIT_BYTES`, naming what to lower."""
    need = dp_table_bytes(max_nodes, max_depth, branches)
    if need > DP_TABLE_LIMIT_BYTES:
        depth = min(int(max_depth), int(max_nodes) - 1)
        capped = f"; depth {depth} used, a tree of n nodes being at most n - 1 deep" if depth < int(max_depth) else ""
        raise ValueError(
            f"{keys[0]}={max_nodes} {keys[1]}={max_depth} over {branches} ranks: the Sequoia DP would hold "
            f"{need / 2**30:.1f} GiB (limit {DP_TABLE_LIMIT_BYTES / 2**30:.0f} GiB{capped}); lower {keys[0]} or "
            f"{keys[1]}"
        )


def optimize_tree(*, acceptance: Sequence[float], max_nodes: int, max_depth: int) -> SequoiaTable:
    """Fill Sequoia's depth-indexed DP table T[n, d, b] for n <= max_nodes (root included),
    d <= max_depth edges.

    T[1, d, 0] = 1; T[n, d, b] = max_y T[y, d, b-1] + p_b * max_j T[n-y, d-1, j], where the left
    part (y nodes) is the root with its first b-1 child subtrees and the right part (n-y nodes) is
    the rank-b child's subtree. Vectorised over (n, y) for each (d, b).
    """
    p = validate_selected_child_probabilities(acceptance)
    for name, v, lo in (("max_nodes", max_nodes, 1), ("max_depth", max_depth, 0)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}; got {v!r}")
    # a tree of n nodes is at most n - 1 deep: deeper bounds change nothing and are not stored
    N, D, B = int(max_nodes), min(int(max_depth), int(max_nodes) - 1), len(p)
    check_dp_size(N, int(max_depth), B)

    score = np.full((N + 1, D + 1, B + 1), -np.inf)  # [N+1, D+1, B+1]
    split = np.full((N + 1, D + 1, B + 1), -1, dtype=np.int64)  # [N+1, D+1, B+1]
    best_g = np.full((N + 1, D + 1), -np.inf)  # [N+1, D+1]
    best_b = np.zeros((N + 1, D + 1), dtype=np.int64)  # [N+1, D+1]

    idx = np.arange(N + 1)
    n_of = idx[:, None]  # [N+1, 1] total nodes n
    y_of = idx[None, :]  # [1, N+1] left-part nodes y
    m_of = n_of - y_of  # [N+1, N+1] right-part nodes n - y
    valid = (y_of >= 1) & (m_of >= 1)  # [N+1, N+1]
    m_idx = np.where(valid, m_of, 0)  # [N+1, N+1], 0 where invalid (score -inf there)

    score[1, :, 0] = 1.0
    for d in range(D + 1):
        if d >= 1:
            below = best_g[:, d - 1]  # [N+1] best subtree score one level down, by size
            ok = np.isfinite(below)  # [N+1]; keeps 0 * -inf (a p_b = 0 slot) from making NaN
            below0 = np.where(ok, below, 0.0)  # [N+1]
            for b in range(1, B + 1):
                right = np.where(ok, p[b - 1] * below0, -np.inf)  # [N+1] by size m
                left = score[:, d, b - 1]  # [N+1] by size y
                cand = np.where(valid, left[None, :] + right[m_idx], -np.inf)  # [N+1 (n), N+1 (y)]
                y_best = cand.argmax(axis=1)  # [N+1], smallest y on ties
                s = cand[idx, y_best]  # [N+1]
                score[:, d, b] = s
                split[:, d, b] = np.where(np.isfinite(s), y_best, -1)
        best_b[:, d] = score[:, d, :].argmax(axis=1)  # smallest b on ties
        best_g[:, d] = score[:, d, :].max(axis=1)

    # every result checked: 1 <= G <= min(n, d + 1)
    feasible = np.isfinite(best_g[1:])  # [N, D+1]
    g = np.where(feasible, best_g[1:], 1.0)
    cap = np.minimum(idx[1:, None], np.arange(D + 1)[None, :] + 1)  # [N, D+1]
    bad = feasible & ((g < 1.0 - BOUND_ATOL) | (g > cap + BOUND_ATOL))
    if bad.any():
        n_bad, d_bad = (int(x) for x in np.argwhere(bad)[0])
        raise AssertionError(
            f"G out of [1, min(n, d+1)] at n={n_bad + 1}, d={d_bad}: {float(best_g[n_bad + 1, d_bad])}"
        )
    if not feasible[0].all():
        raise AssertionError("the root-only tree must be feasible at every depth bound")

    return SequoiaTable(
        acceptance=tuple(p), max_nodes=N, max_depth=D, score=score, split=split, best_g=best_g, best_b=best_b
    )


# -------------------------------------------------------------------- hardware-aware choice


@dataclass(frozen=True)
class Choice:
    """The tree of least (t(n) + draft time) / G over the trees :func:`select_hardware_aware` searched
    (``searched`` says which)."""

    n: int  # nodes, root included
    d: int  # depth in edges of the chosen tree
    expected_tokens: float  # G of the chosen tree
    time_per_token: float  # (t(n) + draft time) / G, in units of one autoregressive step t(1)
    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    draft_time: float = 0.0  # the chosen tree's expected drafting time, in units of t(1)
    searched: str = ""  # the trees the choice is the best of (SEARCHED_EVERY_TREE, SEARCHED_FAMILY)

    @property
    def candidate_rows(self) -> int:
        return self.n - 1

    @property
    def tree(self) -> TreeResult:
        """The chosen tree as a :class:`TreeResult` (under shaped draft costs it need not be the
        table's ``best(n, d)``: a tree of fewer expected tokens may draft cheaper)."""
        return TreeResult(
            expected_tokens=self.expected_tokens, nodes=self.n, depth=self.d, parents=self.parents, ranks=self.ranks
        )


def draft_time(depth: int, *, draft_cost: float, draft_base_cost: float | None = None) -> float:
    """The drafting time of a round whose tree is ``depth`` levels deep: the first level's law comes
    from the proposer's pass on the pending token (``draft_base_cost`` c0; None: c, as Sequoia
    counts it) and each deeper level from one step over the level above (``draft_cost`` c); the
    deepest level's tokens are drafted, never passed. ``c0 + (depth - 1) c``; 0 for no tree."""
    if depth <= 0:
        return 0.0
    c0 = float(draft_cost) if draft_base_cost is None else float(draft_base_cost)
    return c0 + (depth - 1) * float(draft_cost)


def level_internal_nodes(parents: Sequence[int]) -> list[int]:
    """``r[l - 1]``: the nodes at depth ``l`` (1 .. depth - 1) that have children, the rows a draft
    forwards at that depth to draw the level below (root-inclusive ``parents``)."""
    _check_tree(parents, None, None)
    par = [int(u) for u in parents]
    depth = [0] * len(par)
    for v in range(1, len(par)):
        depth[v] = depth[par[v]] + 1
    has_children = set(par[1:])
    levels = max(depth) if depth else 0
    return [sum(1 for v in range(1, len(par)) if depth[v] == lvl and v in has_children) for lvl in range(1, levels)]


def tree_draft_time(
    parents: Sequence[int],
    ranks: Sequence[int] | None,
    acceptance: Sequence[float],
    *,
    draft_cost: float,
    draft_base_cost: float,
    feed_cost: Sequence[float] | None = None,
    level_cost: Sequence[float] | None = None,
) -> float:
    """Expected drafting time of a round over this tree, as a draft model drafts it.

    The first level's law comes from the draft's pass over what it has not seen. After a branching
    tree the draft's cache is cut back to the committed prefix, so that is every token the last round
    committed (``k`` = accepted + 1); after a chain the draft keeps the rows it drafted, so it is the
    bonus token alone, or the chain's last drafted token and the bonus where the whole chain was
    accepted (``k`` = 2). ``feed_cost[k - 1]`` is that pass over ``k`` tokens, averaged over the
    tree's own acceptance law (``P(accepted >= j)`` is the summed reach probability of the depth-``j``
    nodes). Each deeper level is one forward of that level's nodes with children:
    one unmasked row while the tree is a chain down to it (``draft_cost`` c), else ``level_cost[r - 1]``
    for ``r`` rows under an ancestor mask. Without the vectors it is Sequoia's scalar model,
    :func:`draft_time` (``c0 + (d - 1) c``)."""
    depth = tree_depth(parents)
    if depth <= 0:
        return 0.0
    if feed_cost is None and level_cost is None:
        return draft_time(depth, draft_cost=draft_cost, draft_base_cost=draft_base_cost)
    p = validate_selected_child_probabilities(acceptance)
    rk = _check_tree(parents, ranks, len(p))
    par = [int(u) for u in parents]
    return _draft_time_of(
        *_shape_of(par, rk, p),
        draft_cost=draft_cost,
        draft_base_cost=draft_base_cost,
        feed_cost=feed_cost,
        level_cost=level_cost,
    )


def _shape_of(par: list[int], rk: Sequence[int], p: Sequence[float]) -> tuple[list[float], list[int], bool]:
    """What a (valid, unchecked) tree's drafting time depends on: ``at_least[j]``, the summed reach
    probability of its depth-``j`` nodes (P(accepted >= j); one entry past its depth, 0), ``rows[l]``,
    its depth-``l`` nodes with children (l < depth), and whether it is a chain."""
    reach, node_depth = [1.0] * len(par), [0] * len(par)
    for v in range(1, len(par)):
        reach[v] = reach[par[v]] * p[rk[v] - 1]
        node_depth[v] = node_depth[par[v]] + 1
    depth = max(node_depth)
    by_depth: list[list[float]] = [[] for _ in range(depth + 2)]
    for v in range(len(par)):
        by_depth[node_depth[v]].append(reach[v])
    rows = [0] * depth
    for u in set(par[1:]):
        rows[node_depth[u]] += 1
    return [math.fsum(x) for x in by_depth], rows, len(set(par[1:])) == len(par) - 1


def _draft_time_of(
    at_least: Sequence[float],
    rows: Sequence[int],
    chain_tree: bool,
    *,
    draft_cost: float,
    draft_base_cost: float,
    feed_cost: Sequence[float] | None,
    level_cost: Sequence[float] | None,
) -> float:
    """:func:`tree_draft_time` from a tree's shape (:func:`_shape_of`), depth >= 1."""
    depth = len(rows)
    if feed_cost is None:
        feed = float(draft_base_cost)
    else:
        longest = 2 if chain_tree else depth + 1  # a chain's draft keeps its rows
        if len(feed_cost) < longest:
            raise ValueError(f"feed_cost must give the pass over 1..{longest} tokens; got {len(feed_cost)} entries")
        if chain_tree:
            feed = (1.0 - at_least[depth]) * float(feed_cost[0]) + at_least[depth] * float(feed_cost[1])
        else:
            feed = math.fsum((at_least[j] - at_least[j + 1]) * float(feed_cost[j]) for j in range(depth + 1))
    total, chain = feed, True
    for r in rows[1:]:  # level_internal_nodes
        chain = chain and r == 1
        if chain or level_cost is None:
            total += float(draft_cost)
        else:
            if len(level_cost) < r:
                raise ValueError(f"level_cost must give a masked step of 1..{r} rows; got {len(level_cost)} entries")
            total += float(level_cost[r - 1])
    return total


# ------------------------------------------------------- the search under shaped draft costs

#: what a :class:`Choice` is the best of (:attr:`Choice.searched`, the tree artifact's ``searched``)
SEARCHED_BY_DEPTH = (
    "every tree within the bounds: the draft time c0 + (d - 1) c depends on the depth alone, so the tree of "
    "most expected tokens of each node count n and depth d is the best of them"
)
SEARCHED_EVERY_TREE = (
    "every tree within the bounds: the profile prices the draft's pass and its masked step alike whatever "
    "they feed, so a tree's drafting time depends on its node count, depth and chain prefix alone, and the "
    "tree of most expected tokens of each is the best of them"
)
SEARCHED_FAMILY = (
    "the cheapest of a family, not of every tree (the profile's draft pass or masked step costs more or less "
    "with what it feeds): every chain, and for each node count n and depth bound d the tree of most expected "
    "tokens among all trees, among the trees whose nodes with children lie on one path, and, for each k, "
    "among the trees whose levels 1..k hold one node with children each and level k + 1 two or more"
)

#: a subtree's shape summary (:meth:`_ShapeClasses.summary`): per depth below its root the summed reach
#: (its root's 1 first) and the nodes with children, its depth, and whether it is a chain
_LEAF = ((1.0,), (0,), 0, True)


def _join(children: Sequence[tuple[float, tuple]]) -> tuple:
    """The shape summary of a node over its child subtrees, each ``(p_rank, summary)`` in rank order."""
    if not children:
        return _LEAF
    depth = 1 + max(s[2] for _, s in children)
    reach, rows = [1.0] + [0.0] * depth, [1] + [0] * depth
    for q, (sub_reach, sub_rows, sub_depth, _) in children:
        for j in range(sub_depth + 1):
            reach[j + 1] += q * sub_reach[j]
            rows[j + 1] += sub_rows[j]
    return tuple(reach), tuple(rows), depth, len(children) == 1 and children[0][1][3]


def _max_plus(left: np.ndarray, right: np.ndarray, min_right: int) -> tuple[np.ndarray, np.ndarray]:
    """``out[n] = max_y left[y] + right[n - y]`` over ``n - y >= min_right`` (``-inf`` where none);
    with the ``y`` that gives it (the smallest on ties). ``left``, ``right``: [N+1] by size."""
    idx = np.arange(len(left))
    m = idx[:, None] - idx[None, :]  # [N+1 (n), N+1 (y)] right-part size n - y
    valid = m >= min_right
    cand = np.where(valid, left[None, :] + right[np.where(valid, m, 0)], -np.inf)  # [N+1, N+1]
    y = cand.argmax(axis=1)  # [N+1]
    return cand[idx, y], y


class _ShapeClasses:
    """The most expected tokens of each class of trees whose drafting a profile prices alike where its
    draft pass and masked step cost the same whatever they feed (:data:`SEARCHED_EVERY_TREE`), n nodes
    and depth <= d each, with their trees:

    * ``caterpillar[n, d]``: every node with children on one path (each level drafted by one unmasked
      row, ``c``); a node of that path with ``j`` children continues it through the child of largest p
      among ranks 1..j (a subtree of G >= 1 under rank s adds ``p_s (G - 1)`` to the leaves' ``1 + p_1 +
      .. + p_j``, most at the largest ``p_s``), its other children leaves;
    * ``prefixed[k][n, e]``: levels 1..k hold one node with children each (such a path of k nodes below
      the root, with leaf siblings), and the node ending it, the fan root, two or more children with
      children, its subtree of depth <= e (d = k + e). ``k = 0``: the root is the fan root; a fan root's
      child subtrees are the table's best of their size and depth.

    A tree is given by a spec: ``("table", m, d)`` (the table's best(m, d)) or a tuple of
    ``(rank, child spec)`` pairs, ``()`` a leaf (:meth:`spec`); :meth:`summary` is what its drafting
    time depends on, :meth:`tree` its parent array."""

    def __init__(self, table: SequoiaTable):
        self.table = table
        p = np.asarray(table.acceptance, dtype=np.float64)  # [B]
        N, D, B = table.max_nodes, table.max_depth, len(p)
        self.mass = np.concatenate([[0.0], np.cumsum(p)])  # [B+1] p_1 + .. + p_j
        self.top = [0] + [int(np.argmax(p[:j])) + 1 for j in range(1, B + 1)]  # rank of the largest p_1..p_j
        self.caterpillar = np.full((N + 1, D + 1), -np.inf)  # [N+1, D+1]
        self.caterpillar_children = np.zeros((N + 1, D + 1), dtype=np.int64)  # j; -j where all leaves
        self.caterpillar[1, :] = 1.0
        for d in range(1, D + 1):
            self.caterpillar[:, d], self.caterpillar_children[:, d] = self._below_one_path(
                self.caterpillar[:, d - 1], leaves_only=True
            )
        self._fans: dict[int, list] = {}
        self.fan = np.full((N + 1, D + 1), -np.inf)  # [N+1, D+1]: prefixed[0]
        for e in range(2, D + 1):
            self.fan[:, e] = np.max([value[:, 2] for value, _, _ in self._fan_layers(e)], axis=0)
        prefixed, how = [self.fan], [np.zeros((N + 1, D + 1), dtype=np.int64)]
        for _ in range(1, max(D - 1, 1)):  # k = 1 .. D - 2
            value, children = self._below_one_path(prefixed[-1], leaves_only=False)
            prefixed.append(value)
            how.append(children)
        self.prefixed = np.stack(prefixed)  # [K, N+1, D+1]
        self.prefixed_children = np.stack(how)  # [K, N+1, D+1] j
        self._summaries: dict[tuple[int, int], tuple] = {}

    def _below_one_path(self, below: np.ndarray, *, leaves_only: bool) -> tuple[np.ndarray, np.ndarray]:
        """Over ``below`` (G of the path's next subtree by size, [N+1] or [N+1, E]): by size, the G of
        a node with j children of which the one of largest p roots that subtree (``leaves_only``: or
        none, all leaves), and the j chosen (-j: all leaves)."""
        p = self.table.acceptance
        N = self.table.max_nodes
        out = np.full(below.shape, -np.inf)
        how = np.zeros(below.shape, dtype=np.int64)
        for j in range(1, len(p) + 1):
            if leaves_only and j + 1 <= N and 1.0 + self.mass[j] > out[j + 1]:
                out[j + 1], how[j + 1] = 1.0 + self.mass[j], -j
            sub = below[2 : max(N + 1 - j, 2)]  # subtrees of 2 .. N - j nodes
            ok = np.isfinite(sub)
            val = np.where(ok, 1.0 + self.mass[j] + p[self.top[j] - 1] * (np.where(ok, sub, 1.0) - 1.0), -np.inf)
            target, chosen = out[j + 2 :], how[j + 2 :]
            better = val > target
            target[better] = val[better]
            chosen[better] = j
        return out, how

    def _fan_layers(self, e: int) -> list:
        """``layers[b] = (value, left, left_c)``, each [N+1, 3] by nodes in all and ``c = min(2, child
        subtrees with children)``: the G of the root with its first b child subtrees (of depth <= e - 1),
        and (b >= 1) the size and ``c`` of the part without the b-th."""
        if e in self._fans:
            return self._fans[e]
        t = self.table
        N = t.max_nodes
        below = t.best_g[:, e - 1]  # [N+1]
        ok = np.isfinite(below)
        value = np.full((N + 1, 3), -np.inf)
        value[1, 0] = 1.0
        layers = [(value, None, None)]
        for b in range(1, len(t.acceptance) + 1):
            right = np.where(ok, t.acceptance[b - 1] * np.where(ok, below, 0.0), -np.inf)  # [N+1] by child size
            new = np.full((N + 1, 3), -np.inf)
            left = np.full((N + 1, 3), -1, dtype=np.int64)
            left_c = np.full((N + 1, 3), -1, dtype=np.int64)
            for c in range(3):
                leaf = np.full(N + 1, -np.inf)
                leaf[1:] = value[:-1, c] + right[1]
                # a leaf child keeps the count, a child with children adds one (at most 2 counted)
                for got, y, to in ((leaf, np.arange(N + 1) - 1, c), (*_max_plus(value[:, c], right, 2), min(2, c + 1))):
                    better = got > new[:, to]
                    new[better, to] = got[better]
                    left[better, to] = y[better]
                    left_c[better, to] = c
            value = new
            layers.append((new, left, left_c))
        self._fans[e] = layers
        return layers

    def spec(self, kind: str, n: int, a: int, b: int) -> tuple:
        """The tree of a candidate: ``("table", n, d=a)``, ``("caterpillar", n, d=a)``,
        ``("prefixed", n, k=a, e=b)`` or ``("chain", n)``."""
        if kind == "table":
            return ("table", n, a)
        if kind == "chain":
            out: tuple = ()
            for _ in range(n - 1):
                out = ((1, out),)
            return out
        path: list[int] = []  # the children of each node of the path, from the root
        if kind == "caterpillar":
            for d in range(a, 0, -1):
                j = int(self.caterpillar_children[n, d])
                path.append(j)
                if j < 0:
                    break
                n -= j
            out = ()
        else:
            for k in range(a, 0, -1):
                j = int(self.prefixed_children[k][n, b])
                path.append(j)
                n -= j
            out = self._fan_spec(n, b)
        for j in reversed(path):
            out = tuple((rank, out if rank == self.top[j] else ()) for rank in range(1, abs(j) + 1))
        return out

    def _fan_spec(self, n: int, e: int) -> tuple:
        layers = self._fan_layers(e)
        b = next(b for b in range(1, len(layers)) if layers[b][0][n, 2] == self.fan[n, e])
        c, children = 2, []
        while b > 0:
            _, left, left_c = layers[b]
            y, c = int(left[n, c]), int(left_c[n, c])
            children.append((b, ("table", n - y, e - 1) if n - y > 1 else ()))
            n, b = y, b - 1
        return tuple(reversed(children))

    def summary(self, spec: tuple) -> tuple:
        """What the drafting time of the tree ``spec`` depends on (:func:`_join`)."""
        if not spec:
            return _LEAF
        p = self.table.acceptance
        if spec[0] != "table":
            return _join([(p[rank - 1], self.summary(child)) for rank, child in spec])
        _, m, d = spec
        if (m, d) not in self._summaries:
            sizes, b = [], int(self.table.best_b[m, d])  # the child subtrees' sizes, rank b..1 (as _emit)
            left = m
            while b > 0:
                y = int(self.table.split[left, d, b])
                sizes.append(left - y)
                left, b = y, b - 1
            children = [
                (p[r], self.summary(("table", s, d - 1)) if s > 1 else _LEAF) for r, s in enumerate(sizes[::-1])
            ]
            self._summaries[(m, d)] = _join(children)
        return self._summaries[(m, d)]

    def tree(self, spec: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The parent array and ranks of ``spec``, numbered as :meth:`SequoiaTable.best` numbers its trees
        (pre-order, siblings by rank)."""
        parents, ranks = [-1], [0]

        def emit(spec: tuple, node: int) -> None:
            if spec and spec[0] == "table":
                _, m, d = spec
                self.table._emit(m, d, int(self.table.best_b[m, d]), node, parents, ranks)
                return
            for rank, child in spec:
                parents.append(node)
                ranks.append(rank)
                emit(child, len(parents) - 1)

        emit(spec, 0)
        return tuple(parents), tuple(ranks)


def select_hardware_aware(
    table: SequoiaTable,
    *,
    verify_cost: Sequence[float],
    draft_cost: float,
    draft_base_cost: float | None = None,
    feed_cost: Sequence[float] | None = None,
    level_cost: Sequence[float] | None = None,
    min_nodes: int = 2,
) -> Choice:
    """Choose the tree minimising ``(t(n) + draft time) / G`` within the table's bounds (Sequoia's
    hardware-aware objective, the draft time counted as the draft model drafts the tree).

    ``verify_cost[n-1] = t(n)``, the verify forward over n nodes normalised so ``t(1) = 1``
    (at least ``table.max_nodes`` entries); ``draft_cost`` = c per depth step below the first,
    ``draft_base_cost`` = c0, the proposer's pass on the pending token that gives the first level
    (:func:`draft_time`; None: c0 = c, Sequoia's (t(n) + d c) / G). That scalar model prices a tree by
    its depth alone, so the table's ``best(n, d)`` over every (n, d) is the optimum over every tree
    (:data:`SEARCHED_BY_DEPTH`).

    ``feed_cost`` (the pass over ``k`` committed tokens, ``k = 1 .. max_depth + 1``) and
    ``level_cost`` (a masked depth step of ``r`` rows) price each candidate tree by its own shape
    and acceptance (:func:`tree_draft_time`): then a tree of fewer expected tokens than the best of
    its size and depth may draft cheaper. The search covers every chain and, for each n and depth
    bound d, the tree of most expected tokens among all trees, among the trees whose nodes with
    children lie on one path, and among the trees whose first level with two or more nodes with
    children is k + 1, for each k (:class:`_ShapeClasses`, :func:`_select_shaped`); ties between
    trees of most expected tokens go to the DP's. Where each vector is the same at every size a
    tree within the bounds uses, a tree's drafting time depends on its node count, depth and chain
    prefix alone and this is the optimum over every tree (:data:`SEARCHED_EVERY_TREE`); otherwise
    it is the best of that family (:data:`SEARCHED_FAMILY`), and a tree outside it may be faster.
    In small random trials against every tree of up to 10 nodes: under 1 % where the verify costs
    and the draft costs all rise with size and ``min_nodes=2``; up to 9.4 % where only the draft costs
    rise; up to 21 % with a larger ``min_nodes``, and 27 % with draft costs that fall with more
    tokens or rows. ``Choice.searched`` says which.

    ``min_nodes`` is the smallest n searched. The default 2 (at least one candidate row) searches
    n = 2..N. With ``min_nodes=1`` the root-only "tree" is plain autoregressive decoding: G = 1 and
    time t(1) = 1, no draft cost paid (nothing is drafted). Ties go to the smaller n, then the
    smaller d. ``d`` is the chosen tree's actual depth.
    """
    costs = _as_floats(verify_cost, name="verify_cost")
    N = table.max_nodes
    if len(costs) < N:
        raise ValueError(f"verify_cost must give t(1..{N}) (max_nodes={N}); got {len(costs)} entries")
    for i, t in enumerate(costs):
        if not math.isfinite(t) or t <= 0:
            raise ValueError(f"verify_cost t({i + 1}) must be finite and > 0; got {t}")
    if abs(costs[0] - 1.0) > 1e-9:
        raise ValueError(f"verify_cost must be normalised to one autoregressive step, t(1) = 1; got t(1) = {costs[0]}")
    if draft_base_cost is None:
        draft_base_cost = draft_cost
    for name, v in (("draft_cost", draft_cost), ("draft_base_cost", draft_base_cost)):
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float | np.integer | np.floating)
            or not math.isfinite(v)
            or v < 0
        ):
            raise ValueError(f"{name} must be a finite number >= 0; got {v!r}")
    if isinstance(min_nodes, bool) or not isinstance(min_nodes, int) or not 1 <= min_nodes <= N:
        raise ValueError(f"min_nodes must be an integer in [1, {N}]; got {min_nodes!r}")
    vectors = {}
    for name, vec, need in (
        ("feed_cost", feed_cost, table.max_depth + 1),
        ("level_cost", level_cost, max(1, (N - 1) // 2)),  # r internal nodes at a level need r children below
    ):
        if vec is None:
            continue
        vals = _as_floats(vec, name=name)
        if len(vals) < need or any(not math.isfinite(v) or v < 0 for v in vals):
            raise ValueError(f"{name} must give {need} finite numbers >= 0; got {vals}")
        vectors[name] = vals

    c, c0 = float(draft_cost), float(draft_base_cost)
    if vectors:  # each tree's own shape decides its drafting time
        return _select_shaped(table, costs, c, c0, vectors, min_nodes)
    best: tuple[float, int, int] | None = None  # (time, n, d bound)
    for n in range(min_nodes, N + 1):
        for d in range(table.max_depth + 1):
            g = table.g(n, d)
            if g is None:
                continue
            cost = costs[0] if n == 1 else costs[n - 1] + draft_time(d, draft_cost=c, draft_base_cost=c0)
            t = cost / g
            if best is None or t < best[0]:
                best = (t, n, d)
    if best is None:
        raise ValueError(f"no feasible tree with {min_nodes} <= n <= {N} and depth <= {table.max_depth}")
    _, n, d = best
    tree = table.best(n, d)
    assert tree is not None  # feasible by construction
    drafted = 0.0 if n == 1 else draft_time(tree.depth, draft_cost=c, draft_base_cost=c0)
    return Choice(
        n=n,
        d=tree.depth,
        expected_tokens=tree.expected_tokens,
        time_per_token=(costs[n - 1] + drafted) / tree.expected_tokens,
        parents=tree.parents,
        ranks=tree.ranks,
        draft_time=drafted,
        searched=SEARCHED_BY_DEPTH,
    )


def _lower_hull(ys: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The vertices of the lower convex hull of the points ``(j, ys[j])``."""
    hull: list[tuple[float, float]] = []
    for x, y in enumerate(ys):
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0]) >= (y - hull[-2][1]) * (
            hull[-1][0] - hull[-2][0]
        ):
            hull.pop()
        hull.append((float(x), float(y)))
    return np.array([x for x, _ in hull]), np.array([y for _, y in hull])


def _select_shaped(
    table: SequoiaTable, costs: list[float], c: float, c0: float, vectors: dict, min_nodes: int
) -> Choice:
    """:func:`select_hardware_aware` under a profile's draft pass and masked step by size.

    The candidates: for each n and depth bound d, ``table.best(n, d)`` and the class trees of
    :class:`_ShapeClasses`, and every chain; each priced by its own shape (:func:`tree_draft_time`).
    A bound deeper than one with the same G keeps that one's tree (of most expected tokens at the
    deeper bound too). Candidates are priced in order of the least time their class admits, and
    pricing stops where that exceeds the best found: its verify time plus the least drafting a tree
    of its G, node count, depth bound and chain prefix can cost, over G. That drafting floor: the
    first pass averages the passes over 1 .. depth + 1 tokens with mean G (accepted tokens average
    G - 1), so it is at least their lower convex hull at G - 1 (a chain's, over one token or two, at
    least the cheaper: every chain is a candidate of its own, priced exactly); a tree of G tokens is
    at least G - 1 deep; every level past the chain prefix costs at least the cheapest masked step,
    the first of them one of two or more rows, and a level of r rows at least r times the least cost
    per row; a tree of n nodes over B ranks has at least ceil((n - 1) / B) - 1 nodes with children
    below the root."""
    N, D, B = table.max_nodes, table.max_depth, len(table.acceptance)
    need = shape_search_bytes(N, D)
    if need > DP_TABLE_LIMIT_BYTES:
        raise ValueError(
            f"max_nodes={N} max_depth={D}: the search over tree shapes under the profile's draft_feed_cost and "
            f"draft_level_cost would hold {need / 2**30:.1f} GiB (limit {DP_TABLE_LIMIT_BYTES / 2**30:.0f} GiB); "
            "lower max_nodes or max_depth"
        )
    p = table.acceptance
    feed, level = vectors.get("feed_cost"), vectors.get("level_cost")
    priced_as = dict(draft_cost=c, draft_base_cost=c0, feed_cost=feed, level_cost=level)
    # the entries a tree within the bounds can use, each the same: every tree is searched
    flat = all(v is None or len(set(v[:used])) == 1 for v, used in ((feed, D + 1), (level, max(1, (N - 1) // 2))))
    classes = _ShapeClasses(table)

    level_floor = min(level) if level is not None else c  # a masked level past the chain prefix
    branching_floor = min(level[1:], default=level_floor) if level is not None else c  # its first: >= 2 rows
    row_floor = min(x / r for r, x in enumerate(level, start=1)) if level is not None else 0.0
    hulls = [_lower_hull(feed[: d + 1]) for d in range(D + 1)] if feed is not None else None
    sizes = np.arange(N + 1)
    t = np.array([0.0] + costs[:N])  # [N+1] t(n) by n (index 0 unused)
    with_children = np.maximum(np.ceil((sizes - 1) / B) - 1, 0)  # [N+1] the fewest nodes with children below the root
    lower: list[np.ndarray] = []  # per class, [N+1]: the least time its tree of n nodes can take (inf: none)
    labels: list[tuple[str, int, int]] = []

    def add(kind: str, a: int, b: int, g: np.ndarray, d: int, prefix: int | None) -> None:
        """One class by size: ``g`` [N+1] its G (-inf: none), depth bound d, chain prefix (None: any)."""
        ok = np.isfinite(g) & (sizes >= max(min_nodes, 2))
        g = np.where(ok, g, 2.0)
        first = np.interp(g - 1.0, *hulls[d]) if hulls is not None else np.full(N + 1, c0)
        deep = np.maximum(np.ceil(g - 1.0 - BOUND_ATOL), 1.0)  # the fewest levels a tree of G tokens has
        if prefix is None:  # any prefix: a level is one row at c or a masked step
            levels = np.maximum((deep - 1) * min(c, level_floor), with_children * min(c, row_floor))
        elif prefix == d:  # every node with children on one path: each level one row, c
            levels = (deep - 1) * c
        else:
            deep = np.maximum(deep, prefix + 2)
            past = np.maximum(branching_floor + (deep - prefix - 2) * level_floor, (with_children - prefix) * row_floor)
            levels = prefix * c + past
        lower.append(np.where(ok, (t + first + levels) / g, np.inf))
        labels.append((kind, a, b))

    for d in range(1, D + 1):
        for kind, values, prefix in (("table", table.best_g, None), ("caterpillar", classes.caterpillar, d)):
            fresh = values[:, d] != values[:, d - 1]  # a deeper bound with the same G keeps the shallower tree
            add(kind, d, 0, np.where(fresh, values[:, d], -np.inf), d, prefix)
        for k in range(0, d - 1):
            values = classes.prefixed[k]
            fresh = values[:, d - k] != values[:, d - k - 1]
            add("prefixed", k, d - k, np.where(fresh, values[:, d - k], -np.inf), d, k)
    chain = np.full(N + 1, np.inf)
    for n in range(max(min_nodes, 2), min(N, D + 1) + 1):  # a chain's pass feeds one token or two
        first = min(feed[0], feed[1]) if feed is not None else c0
        chain[n] = (costs[n - 1] + first + (n - 2) * c) / math.fsum(p[0] ** i for i in range(n))
    lower.append(chain)
    labels.append(("chain", 0, 0))

    least = np.stack(lower)  # [classes, N+1]
    cls, size = np.nonzero(np.isfinite(least))
    best: tuple | None = None  # ((time, n, depth, rank), spec)
    if min_nodes == 1:  # plain autoregressive decoding: G = 1 at t(1) = 1, nothing drafted
        best = ((costs[0], 1, 0, -1), ())
    for rank, i in enumerate(np.lexsort((size, least[cls, size]))):  # by least time, then n
        n = int(size[i])
        if best is not None and least[cls[i], n] * (1.0 - BOUND_ATOL) > best[0][0]:
            break  # no later candidate can be cheaper
        spec = classes.spec(labels[cls[i]][0], n, *labels[cls[i]][1:])
        reach, rows, depth, chain_tree = classes.summary(spec)
        drafted = _draft_time_of([*reach, 0.0], rows[:depth], chain_tree, **priced_as)
        key = ((costs[n - 1] + drafted) / math.fsum(reach), n, depth, rank)
        if best is None or key < best[0]:
            best = (key, spec)
    if best is None:
        raise ValueError(f"no feasible tree with {min_nodes} <= n <= {N} and depth <= {D}")
    (time, n, depth, _), spec = best
    parents, ranks = classes.tree(spec)
    if n == 1:
        g, drafted = 1.0, 0.0
    else:  # priced again from its parent array, as tree_draft_time prices it
        at_least, rows, chain_tree = _shape_of(list(parents), ranks, p)
        g, drafted = math.fsum(at_least), _draft_time_of(at_least, rows, chain_tree, **priced_as)
        if len(parents) != n or len(rows) != depth or abs((costs[n - 1] + drafted) / g - time) > BOUND_ATOL * time:
            raise AssertionError(f"the tree {parents} does not price as its shape did ({time}) at n={n}")
    return Choice(
        n=n,
        d=depth,
        expected_tokens=g,
        time_per_token=(costs[n - 1] + drafted) / g,
        parents=parents,
        ranks=ranks,
        draft_time=drafted,
        searched=SEARCHED_EVERY_TREE if flat else SEARCHED_FAMILY,
    )
