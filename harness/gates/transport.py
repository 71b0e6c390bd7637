"""SpecTr (Sun et al., 2023) membership-cost optimal transport, solved exactly for small instances.

For ``k`` i.i.d. candidates ``X = (X_1..X_k) ~ q^{(x)k}`` and the target token ``Y ~ p``, a
valid coupling ``pi(X, Y)`` keeps both marginals; its cost is ``1[Y not in S(X)]`` with ``S(X)``
the set of distinct candidates. The optimum ``1 - min cost`` is the largest probability that
ANY exact one-position verifier emits a token that was among the candidates.

Solving it: with equality marginals, mass on cost-one edges can always be completed freely (the
unassigned supply and demand have equal totals), so the optimum equals the maximum zero-cost
flow: maximise ``sum pi(S, y)`` over membership edges ``y in S`` subject to
``sum_y pi(S, y) <= Q(S)`` and ``sum_S pi(S, y) <= p(y)``. The cost depends on ``X`` only
through ``S(X)``, so candidate vectors with the same distinct set are pooled into one supply node
``Q(S) = sum_{X: S(X) = S} q^{(x)k}(X)`` (an exact reduction). The LP is solved with
``scipy.optimize.linprog`` (HiGHS).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import numpy as np
import torch
from scipy.optimize import linprog

from harness.gates.oracle import enumerate_marginal, round_output, target_rows
from harness.proposers.sampling import sample_tree_proposal
from harness.topology.compiler import compile_tree

#: vocabulary^k above which the exhaustive construction is refused
MAX_CANDIDATE_VECTORS = 200_000


def candidate_set_supply(q: Sequence[float], k: int) -> dict[frozenset[int], float]:
    """``Q(S)``: probability that ``k`` i.i.d. draws from ``q`` have distinct-token set ``S``."""
    q = [float(x) for x in q]
    support = [i for i, x in enumerate(q) if x > 0.0]
    if len(support) ** k > MAX_CANDIDATE_VECTORS:
        raise ValueError(f"{len(support)}^{k} candidate vectors exceed {MAX_CANDIDATE_VECTORS}: instance too large")
    supply: dict[frozenset[int], float] = {}
    for vec in itertools.product(support, repeat=k):
        s = frozenset(vec)
        supply[s] = supply.get(s, 0.0) + math.prod(q[i] for i in vec)
    return supply


def membership_transport_optimum(p: Sequence[float], q: Sequence[float], k: int) -> float:
    """Maximum membership acceptance ``max_pi P(Y in S(X))`` over couplings of ``q^{(x)k}`` and
    ``p`` (SpecTr's membership cost), by linear programming. ``p``, ``q``: ``[V]``."""
    p_arr = np.asarray(p, dtype=np.float64)  # [V]
    q_arr = np.asarray(q, dtype=np.float64)  # [V]
    if p_arr.ndim != 1 or p_arr.shape != q_arr.shape:
        raise ValueError(f"p and q must be vectors of one length; got {p_arr.shape} and {q_arr.shape}")
    for name, v in (("p", p_arr), ("q", q_arr)):
        if (v < 0).any() or abs(float(v.sum()) - 1.0) > 1e-9:
            raise ValueError(f"{name} must be a probability vector; got {v.tolist()}")
    if k < 1:
        raise ValueError(f"k must be >= 1; got {k}")
    supply = candidate_set_supply(q_arr.tolist(), k)
    sets = list(supply)
    edges = [(si, y) for si, s in enumerate(sets) for y in sorted(s)]  # zero-cost (membership) edges
    n_sets, vocab, n_edges = len(sets), p_arr.shape[0], len(edges)
    a_ub = np.zeros((n_sets + vocab, n_edges), dtype=np.float64)
    for e, (si, y) in enumerate(edges):
        a_ub[si, e] = 1.0
        a_ub[n_sets + y, e] = 1.0
    b_ub = np.concatenate([np.array([supply[s] for s in sets]), p_arr])
    res = linprog(c=-np.ones(n_edges), A_ub=a_ub, b_ub=b_ub, bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"linprog failed on the membership transport LP: {res.message}")
    return float(-res.fun)


def verifier_membership_acceptance(verifier, p: Sequence[float], q: Sequence[float], k: int) -> float:
    """Exact ``P(first committed token in S(X))`` of ``verifier`` on ``k`` i.i.d. draws from ``q``
    at one position (a ``set``, or a one-node ``sequence`` when ``k == 1``), by enumeration of the
    same proposal-sampling, compiler and ``select`` code the runs use."""

    p_t = torch.tensor([float(x) for x in p], dtype=torch.float64)  # [V]
    q_t = torch.tensor([float(x) for x in q], dtype=torch.float64)  # [V]

    def one_round(rng) -> bool:
        proposal = sample_tree_proposal(
            lambda prefixes: q_t.expand(len(prefixes), -1),
            widths=(k,),
            relation="iid",
            rng=rng,
            source="transport",
            manifest_hash="transport",
        )
        tree = compile_tree([proposal], 1)
        out = round_output(verifier, tree, target_rows(tree, lambda prefix: p_t), rng)
        return out[0] in set(tree.token_ids.tolist())

    return enumerate_marginal(one_round).get(True, 0.0)


#: the finite transport toy instance (vocabulary {a, b, c}, k = 2): optimum 1.0
TOY_INSTANCE = ((0.5, 0.3, 0.2), (0.4, 0.4, 0.2), 2)


def transport_instances(*, count: int = 4, seed: int = 0, max_vocab: int = 5) -> list[tuple[str, tuple, tuple, int]]:
    """``(name, p, q, k)``: the toy instance, then ``count`` random small instances."""

    out: list[tuple[str, tuple, tuple, int]] = [("transport/toy-k2", *TOY_INSTANCE)]
    gen = torch.Generator().manual_seed(5003 + seed)
    for i in range(count):
        vocab = int(torch.randint(2, max_vocab + 1, (1,), generator=gen))
        k = 1 + i % 3
        laws = []
        for _ in range(2):
            w = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 2 + 1e-3
            laws.append(tuple((w / w.sum()).tolist()))
        out.append((f"transport/random-v{vocab}-k{k}/r{seed}.{i}", laws[0], laws[1], k))
    return out


def transport_applies(verifier) -> bool:
    """The one-position i.i.d. transport bound applies to verifiers taking i.i.d. sets with q at
    temperature > 0 (greedy is covered on one-hot targets by the marginal cases)."""
    return (
        "iid" in verifier.sampling_relations
        and "normalized_conditional" in verifier.probability_semantics
        and ("set" in verifier.topologies or "sequence" in verifier.topologies)
        and verifier.temperatures in {"positive", "any"}
    )


def check_transport(verifier, *, name: str, p: Sequence[float], q: Sequence[float], k: int) -> dict:
    """One row: the verifier's exact membership acceptance must not exceed the LP optimum."""

    t0 = time.perf_counter()
    optimum = membership_transport_optimum(p, q, k)
    acceptance = verifier_membership_acceptance(verifier, p, q, k)
    gap = acceptance - optimum
    excess = gap if gap > 0.0 or gap != gap else 0.0  # a NaN stays NaN (and fails), as max() would drop it
    return {
        "verifier": verifier.name,
        "case": name,
        "kind": "transport",
        "acceptance": acceptance,
        "optimum": optimum,
        "max_abs_error": excess,
        "bound": 1e-9,
        "passed": bool(excess <= 1e-9),
        "leaves": None,
        "seconds": time.perf_counter() - t0,
    }
