"""Dynamic draft trees (EAGLE-2, Li et al., 2024): the rerank that turns an expanded candidate pool
into the verified tree.

A proposer with a dynamic budget expands its own tree every round: at each depth the ``topk`` most
confident nodes get ``topk`` children each, where a node's confidence is the joint draft
probability of its path (the product of the conditional probabilities along it, summed here as
log-probabilities). :func:`rerank_connected` then keeps the ``max_nodes`` most confident drafted
nodes as the verified tree, a node only together with its parent, in ascending pool order (the pool
is built depth by depth, so that order is topological).

Pure functions: no model, no randomness.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.contracts import PREFIX_FRONTIER


def confidence_order(scores: Sequence[float]) -> list[int]:
    """Pool indices by descending score, the lower index first on a tie (so a parent, drafted
    before its children, wins a tie with them)."""
    return sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))


def rerank_connected(parents: Sequence[int], scores: Sequence[float], max_nodes: int) -> list[int]:
    """The ``max_nodes`` best pool nodes by ``scores`` that form a connected subtree.

    ``parents[i]`` is node ``i``'s parent pool index (``-1``: a child of the prefix frontier; every
    parent precedes its children). Nodes are taken in :func:`confidence_order`; a node whose
    parent was not taken is skipped. With joint log-probabilities a child never scores above its
    parent, so nothing is skipped and the result is exactly the top ``max_nodes``. Returns the
    kept indices ascending.
    """
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0; got {max_nodes}")
    if len(parents) != len(scores):
        raise ValueError(f"parents and scores differ in length: {len(parents)} vs {len(scores)}")
    for i, p in enumerate(parents):
        if not PREFIX_FRONTIER <= int(p) < i:
            raise ValueError(f"parents[{i}] must be -1 or an earlier node in [0, {i}); got {p}")
    kept: set[int] = set()
    for i in confidence_order(scores):
        if len(kept) >= max_nodes:
            break
        p = int(parents[i])
        if p == PREFIX_FRONTIER or p in kept:
            kept.add(i)
    return sorted(kept)


def deeper_nodes_cannot_enter(scores: Sequence[float], frontier_best: float, max_nodes: int) -> bool:
    """Whether expanding the frontier further can change :func:`rerank_connected`'s result.

    Every node below the frontier scores at most ``frontier_best`` (joint log-probabilities only
    fall along a path) and comes later in the pool, so it loses every tie. Once the pool holds
    ``max_nodes`` nodes scoring at least ``frontier_best``, no deeper node can be kept.
    """
    if len(scores) < max_nodes or max_nodes == 0:
        return max_nodes == 0
    kth = float(sorted((float(s) for s in scores), reverse=True)[max_nodes - 1])
    return frontier_best <= kth
