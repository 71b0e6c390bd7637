"""Cartesian future-head trees.

Depth ``i`` keeps ``b_i`` candidates below *every* node of depth ``i - 1``, so the full tree has
``N_tree = sum_{i=1..D} prod_{j<=i} b_j`` candidate rows (``b = [3, 2, 2]``: 3 + 6 + 12 = 21).
``conf/topology/cartesian.yaml`` derives ``max_nodes`` from the widths with the
``cartesian_rows`` resolver, so the budget is exactly the full tree.
"""

from __future__ import annotations

from collections.abc import Sequence


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


def cartesian_budget(t):
    """``topology=cartesian`` -> Budget(shape="cartesian", widths=b, max_nodes=N_tree)."""
    from harness.engine.build import ConfigError
    from harness.proposers.base import Budget

    widths = tuple(int(w) for w in t.widths)
    try:
        n = cartesian_rows(list(widths))
    except ValueError as exc:
        raise ConfigError(f"topology=cartesian: {exc}") from None
    if int(t.max_nodes) != n:
        raise ConfigError(
            f"topology=cartesian with widths {list(widths)} has {n} candidate rows (the sum over depths "
            f"of the product of the widths so far); got topology.max_nodes={t.max_nodes} (leave it to the "
            "default interpolation)"
        )
    if len(widths) > int(t.max_depth):
        raise ConfigError(f"topology.widths has {len(widths)} levels, over topology.max_depth={t.max_depth}")
    return Budget(shape="cartesian", max_nodes=n, max_depth=len(widths), widths=widths)
