"""Topology budgets: ``topology=<name>`` -> the :class:`~harness.contracts.Budget` a proposer shapes
its candidates to, known from config alone (negotiation runs before any model work).

``TOPOLOGIES`` maps a topology name to its budget function ``function(topology_cfg) -> Budget``.

Cartesian future-head trees: depth ``i`` keeps ``b_i`` candidates below *every* node of depth
``i - 1``, so the full tree has ``N_tree = sum_{i=1..D} prod_{j<=i} b_j`` candidate rows
(``b = [3, 2, 2]``: 3 + 6 + 12 = 21). ``conf/topology/cartesian.yaml`` derives ``max_nodes`` from
the widths with the ``cartesian_rows`` resolver, so the budget is exactly the full tree.

A choices tree (``topology=choices``) is a rank-path list, given inline or as a JSON file
(:mod:`harness.topology.choices`): its budget carries the node order's parents and ranks, and
``max_nodes`` / ``max_depth`` are the list's node count and depth.
A dynamic tree (EAGLE-2, Li et al., 2024) is shaped by the proposer every round from its own
confidences: ``topk`` children per expanded node, the ``topk`` most confident nodes of each depth
expanded, up to ``max_depth``, then at most ``max_nodes`` rows kept (:mod:`harness.topology.dynamic`).

A Sequoia tree is chosen after the models are loaded (calibration and a hardware profile, see
:mod:`harness.prepare.sequoia`); before that its budget is the search bounds.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.contracts import Budget, ConfigError
from harness.topology.choices import ChoicesError, resolve_choices
from harness.topology.sequoia import DP_TABLE_LIMIT_BYTES, dp_table_bytes, shape_search_bytes


def chain_budget(t) -> Budget:
    return Budget(shape=t.name, max_nodes=t.max_nodes, max_depth=t.max_depth)


def set_budget(t) -> Budget:
    return Budget(shape="set", max_nodes=t.max_nodes, max_depth=1, widths=(t.max_nodes,))


def unreached_level(widths: Sequence[int], max_nodes: int) -> int | None:
    """The first depth of an expansion of ``widths`` that ``max_nodes`` candidate rows never reach
    (the rows of the levels before it fill the budget, siblings being distinct), or None."""
    rows, level = 0, 1
    for depth, width in enumerate(widths, start=1):
        if rows >= int(max_nodes):
            return depth
        level *= width
        rows += level
    return None


def expansion_budget(t) -> Budget:
    widths = tuple(int(w) for w in t.widths)
    if not widths:
        raise ConfigError("topology=expansion needs topology.widths, e.g. [2,2,1]")
    if len(widths) > t.max_depth:
        raise ConfigError(
            f"topology.widths has {len(widths)} levels, over topology.max_depth={t.max_depth}",
            suggestions=[(f"topology.max_depth={len(widths)}",)],
        )
    return Budget(shape="expansion", max_nodes=t.max_nodes, max_depth=len(widths), widths=widths)


def sequoia_budget(t) -> Budget:
    """The search bounds as a tree budget, for negotiation before model work; bounds whose DP
    would not fit in memory are refused here, before any calibration."""
    rows, depth = int(t.max_nodes), int(t.max_depth)
    min_nodes = int(t.get("min_nodes", 2))
    if min_nodes > rows + 1:  # nodes count the root; topology.max_nodes counts candidate rows
        raise ConfigError(
            f"topology.min_nodes={min_nodes} exceeds topology.max_nodes + 1 = {rows + 1} (min_nodes counts the "
            f"root, max_nodes the candidate rows): the search would have no size to try",
            suggestions=[(f"topology.min_nodes={rows + 1}",), (f"topology.max_nodes={min_nodes - 1}",)],
        )
    branches = int(t.calibration.branches) if t.get("calibration") is not None else 8

    # each node has at most `branches` children (the calibration ranks that many siblings)
    def largest(d: int) -> int:
        return sum(branches**i for i in range(min(d, rows) + 1))

    if min_nodes > largest(depth):
        deeper = [f"topology.max_depth={d}" for d in range(depth + 1, rows + 1) if largest(d) >= min_nodes][:1]
        raise ConfigError(
            f"topology.min_nodes={min_nodes}: a tree of depth <= topology.max_depth={depth} with at most "
            f"topology.calibration.branches={branches} children per node holds at most {largest(depth)} nodes (the "
            "root counted): the search would have no size to try",
            suggestions=[(f"topology.min_nodes={largest(depth)}",), *[(d,) for d in deeper]],
        )
    prefix = int(t.profile.prefix_len) if t.get("profile") is not None else None
    reach = min(depth, rows)  # the deepest tree searched: one of `rows` candidate rows is at most `rows` deep
    if prefix is not None and prefix < reach + 2:  # the draft's pass over reach + 1 committed tokens is timed
        bound = "topology.max_depth" if reach == depth else "topology.max_nodes"
        why = "" if reach == depth else f" (a tree of {rows} candidate rows is at most {rows} deep)"
        raise ConfigError(
            f"topology.profile.prefix_len={prefix}: the profile times the draft's pass over up to "
            f"{bound} + 1 = {reach + 1} committed tokens after a cached prefix of at least one{why}",
            suggestions=[(f"topology.profile.prefix_len={reach + 2}",)],
        )
    capped = f"; a tree of {rows} rows is at most {rows} deep" if depth > rows else ""
    for need, what in (
        (dp_table_bytes(rows + 1, depth, branches), f"the Sequoia DP over {branches} ranks"),
        # the tree stage's search under the measured profile's draft costs, which follows calibration
        (shape_search_bytes(rows + 1, depth), "the search over tree shapes under the profile's draft costs"),
    ):
        if need > DP_TABLE_LIMIT_BYTES:
            raise ConfigError(
                f"topology.max_nodes={rows} topology.max_depth={depth}: {what} would hold "
                f"{need / 2**30:.1f} GiB (limit {DP_TABLE_LIMIT_BYTES / 2**30:.0f} GiB{capped}); lower "
                "topology.max_nodes or topology.max_depth"
            )
    return Budget(shape="tree", max_nodes=rows, max_depth=depth)


def cartesian_rows(widths: Sequence[int]) -> int:
    """``sum_i prod_{j <= i} b_j``; every width must be an int >= 1."""
    widths = list(widths)
    if not widths or any(type(w) is not int or w < 1 for w in widths):
        raise ValueError(f"cartesian widths must be a non-empty list of ints >= 1; got {widths!r}")
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
    return total


def cartesian_budget(t) -> Budget:
    """``topology=cartesian`` -> Budget(shape="cartesian", widths=b, max_nodes=N_tree)."""
    widths = tuple(int(w) for w in t.widths)
    try:
        n = cartesian_rows(list(widths))
    except ValueError as exc:
        raise ConfigError(f"topology=cartesian: {exc}") from None
    if int(t.max_nodes) != n:
        raise ConfigError(
            f"topology=cartesian with widths {list(widths)} has {n} candidate rows (the sum over depths "
            f"of the product of the widths so far); got topology.max_nodes={t.max_nodes} (leave it to the "
            "default interpolation)",
            suggestions=[(f"topology.max_nodes={n}",)],
        )
    if len(widths) > int(t.max_depth):
        raise ConfigError(
            f"topology.widths has {len(widths)} levels, over topology.max_depth={t.max_depth}",
            suggestions=[(f"topology.max_depth={len(widths)}",)],
        )
    return Budget(shape="cartesian", max_nodes=n, max_depth=len(widths), widths=widths)


def choices_budget(t) -> Budget:
    """``topology=choices`` -> Budget(shape="choices", parents=..., ranks=...) in Medusa's node order."""
    try:
        tree = resolve_choices(t.get("choices"), t.get("choices_file"))
    except ChoicesError as exc:
        raise ConfigError(f"topology=choices: {exc}") from None
    for key, derived in (("max_nodes", tree.num_nodes), ("max_depth", tree.depth)):
        given = int(t.get(key) or 0)
        if given not in (0, derived):
            raise ConfigError(
                f"topology=choices: the choice list has {derived} for {key}; got topology.{key}={given} "
                "(leave it to the default interpolation)"
            )
    return Budget(
        shape="choices", max_nodes=tree.num_nodes, max_depth=tree.depth, parents=tree.parents, ranks=tree.ranks
    )


def choices_size(choices, choices_file, what: str) -> int:
    """``max_nodes`` / ``max_depth`` of a choice list or file for the config interpolation; 0 when
    the list is invalid (the budget then refuses it with the reason)."""
    try:
        tree = resolve_choices(choices, choices_file)
    except ChoicesError:
        return 0
    return tree.num_nodes if what == "nodes" else tree.depth


def dynamic_budget(t) -> Budget:
    """``topology=dynamic`` -> Budget(shape="dynamic", max_nodes, max_depth, topk)."""
    topk = int(t.topk)
    if topk < 1:
        raise ConfigError(f"topology=dynamic needs topology.topk >= 1; got {t.topk}")
    if int(t.max_nodes) < 1 or int(t.max_depth) < 1:
        raise ConfigError(f"topology=dynamic needs max_nodes, max_depth >= 1; got {t.max_nodes}, {t.max_depth}")
    return Budget(shape="dynamic", max_nodes=int(t.max_nodes), max_depth=int(t.max_depth), topk=topk)


TOPOLOGIES = {
    "sequence": chain_budget,
    "sequences": chain_budget,
    "set": set_budget,
    "expansion": expansion_budget,
    "merged": chain_budget,  # a node/depth budget for proposer=merged
    "sequoia": sequoia_budget,
    "cartesian": cartesian_budget,
    "choices": choices_budget,
    "dynamic": dynamic_budget,
}


#: the budget shape each topology gives a proposer (its ``Proposer.shapes`` must hold it)
TOPOLOGY_SHAPES = {
    "sequence": "sequence",
    "sequences": "sequences",
    "set": "set",
    "expansion": "expansion",
    "merged": "merged",
    "sequoia": "tree",
    "cartesian": "cartesian",
    "dynamic": "dynamic",
}


def budget_from_config(cfg) -> Budget:
    name = cfg.topology.name
    if name not in TOPOLOGIES:
        raise ConfigError(f"unknown topology {name!r}; one of {sorted(TOPOLOGIES)}")
    return TOPOLOGIES[name](cfg.topology)


def verified_rows(budget: Budget) -> tuple[int, str | None]:
    """The most candidate rows one round can verify under ``budget``, and what caps them below
    ``topology.max_nodes`` (None where nothing does): a chain drafts at most ``max_depth`` rows, an
    expansion at most the rows its widths make (``sum_i prod_{j <= i} b_j``), a dynamic tree at most
    the rows its pool holds (``topk`` at the first level, ``topk**2`` at each later one). The context
    limit, the temporary-KV budget, each request's cache reserve and the verify-cost profile of an
    adaptive budget are sized from them."""
    rows = int(budget.max_nodes)
    if budget.shape == "sequence" and int(budget.max_depth) < rows:
        return int(budget.max_depth), f"topology=sequence drafts one chain of topology.max_depth={budget.max_depth}"
    if budget.shape == "expansion" and budget.widths and cartesian_rows(list(budget.widths)) < rows:
        full = cartesian_rows(list(budget.widths))
        widths = "[" + ",".join(str(int(w)) for w in budget.widths) + "]"
        return full, f"topology.widths={widths} make {full} candidate rows"
    if budget.shape == "dynamic" and budget.topk:
        k, depth = int(budget.topk), int(budget.max_depth)
        pool = k + (depth - 1) * k * k
        if pool < rows:
            return pool, (
                f"topology=dynamic's pool holds topology.topk + (topology.max_depth - 1) * topology.topk^2 = {pool} "
                f"candidate rows (topk={k}, max_depth={depth})"
            )
    return rows, None
