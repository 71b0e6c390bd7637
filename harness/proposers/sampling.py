"""Proposal-side child sampling through a :class:`~harness.random_source.RandomSource`.

A proposer that samples its candidates (a draft model, the oracle's synthetic drafts) draws every
child here, so that the law each child was drawn from is recorded next to it and the exactness
oracle can enumerate the same code (a multi-draft verifier is exact only for the law really
sampled: SpecInfer's i.i.d. residual update, Sequoia's sampling without replacement).

Sampling relations (contract vocabulary):

- ``"iid"``: ``k`` independent draws from ``q`` (SpecInfer's stochastic expansion). Duplicates
  are kept as separate draws; the compiler merges them into one row and keeps every draw.
- ``"without_replacement"``: Sequoia's per-parent process (sampling without replacement). Draw
  ``i`` is taken from ``q`` with the tokens of draws ``< i`` removed and the rest renormalised;
  once all nonzero ``q`` mass is sampled, the law is uniform over the still unsampled tokens. Each
  draw records the law it was *actually* drawn from.
- ``"beam"``: the deterministic top-``k`` of ``q`` (descending, lowest index first on a tie). No
  law: the tokens come back with ``None`` and a proposal built from them is ``score_only``.

Ranked trees (``topology=choices``, a published choice list such as Medusa's): a node of rank
``r`` below its parent is the parent's ``r``-th child in the order the relation produces them:
the ``r``-th most probable token for ``"beam"``, the ``r``-th draw for ``"iid"`` and
``"without_replacement"`` (which therefore need ranks ``0 .. n - 1`` below every node: a skipped
draw would change the law the verifier must see). :func:`sample_ranked_tree_proposal` is the one
implementation; a proposer that ranks children per node (a ``q_level`` callback, as below) supports
``topology=choices`` by listing the shape and calling it with ``budget.parents`` and
``budget.ranks``.

Prefixes here are tuples of candidate tokens below the prefix frontier (``()`` is the frontier;
the committed tokens are implicit), which is exactly ``CompiledTree.full_prefixes``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from harness.contracts import (
    NO_STATE,
    PREFIX_FRONTIER,
    ContractError,
    ProposalNode,
    ProposalResult,
    ProposalStateHandle,
    check_probability_vector,
)
from harness.random_source import RandomSource
from harness.topology.choices import choices_path, first_rank_gap

#: relations :func:`sample_children` implements
CHILD_RELATIONS: tuple[str, ...] = ("iid", "without_replacement", "beam")

#: ``(prefixes) -> [len(prefixes), V]``: the proposal law below each prefix, one level at a time
QLevelFn = Callable[[list[tuple[int, ...]]], torch.Tensor]


def without_replacement_law(q: torch.Tensor, sampled: Sequence[int], *, domain: int | None = None) -> torch.Tensor:
    """The law of the next without-replacement draw after ``sampled`` (Sequoia). ``[V]``.

    ``q`` with the sampled tokens zeroed and renormalised; uniform over the unsampled tokens when
    no nonzero ``q`` mass is left. ``domain``: the ids ``0 .. domain - 1`` the proposer can draw and
    expand (a draft whose vocabulary is smaller than the target's pads ``q`` with zeros beyond its
    own); the uniform fallback stays inside it (default: all ``V``).
    """
    vocab = q.shape[-1]
    domain = vocab if domain is None else min(int(domain), vocab)
    inside = {int(t) for t in sampled if int(t) < domain}
    if len(inside) >= domain:
        raise ValueError(f"cannot draw without replacement: all {domain} tokens already sampled")
    law = q.clone()  # [V]
    taken = torch.zeros(vocab, dtype=torch.bool, device=q.device)  # [V]
    if sampled:
        taken[torch.tensor(list(sampled), dtype=torch.long, device=q.device)] = True
    law = law.masked_fill(taken, 0.0)
    z = float(law.sum())
    if z > 0.0:
        return law / z
    fallback = (~taken).to(q.dtype)  # [V] uniform over unsampled tokens of the domain
    fallback[domain:] = 0.0
    return fallback / fallback.sum()


def beam_tokens(q: torch.Tensor, k: int) -> list[int]:
    """Deterministic top-``k`` tokens of ``q`` ``[V]``: descending, lowest index on a tie (the first
    ``k`` of a full stable descending sort). See :func:`beam_rows`."""
    return [t for t, _ in beam_rows(q[None], k)[0]]


def beam_rows(q: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's deterministic top-``k`` of ``q`` ``[F, V]`` as ``(token, value)``: descending, lowest
    index on a tie, the values as ``q`` holds them.

    One ``topk`` of ``2k`` per row and one read of its values and indices for all rows (on a GPU two
    waits per call, not one per row and token); the order is then settled on the host. Where a row's
    ``2k``-th value still reaches its ``k``-th (a tie running past the ``2k`` read), that row takes every
    token at or above its ``k``-th value from ``q`` itself, so the result is always a full stable
    descending sort's first ``k`` (a 49,152-way stable sort cost ~7 ms per call on 2 CPU cores)."""
    if k <= 0:
        return [[] for _ in range(q.shape[0])]
    v = q.shape[-1]
    k = min(k, v)
    m = min(v, 2 * k)
    top = torch.topk(q, m, dim=-1, sorted=True)
    values, ids = top.values.tolist(), top.indices.tolist()
    out = []
    for row, (vals, idx) in enumerate(zip(values, ids)):
        kth = vals[k - 1]
        if m < v and vals[m - 1] >= kth:  # the boundary's tie may run past what topk returned
            candidates = torch.nonzero(q[row] >= kth, as_tuple=True)[0]
            vals, idx = q[row, candidates].tolist(), candidates.tolist()
        kept = sorted((x for x in zip(vals, idx) if x[0] >= kth), key=lambda x: (-x[0], x[1]))[:k]
        out.append([(int(t), float(x)) for x, t in kept])
    return out


def sample_children(
    q: torch.Tensor, k: int, *, relation: str, rng: RandomSource, domain: int | None = None
) -> list[tuple[int, torch.Tensor | None]]:
    """``k`` children below one parent whose proposal law is ``q`` ``[V]``.

    Returns ``(token, law)`` per draw in draw order; ``law`` ``[V]`` is the distribution that
    token was drawn from (``None`` for ``"beam"``, which draws nothing). ``domain``: the ids a
    draw without replacement may fall back to (:func:`without_replacement_law`).
    """
    if q.dim() != 1:
        raise ValueError(f"q must be a vector [V]; got shape {tuple(q.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0; got {k}")
    if relation not in CHILD_RELATIONS:
        raise ValueError(f"relation must be one of {list(CHILD_RELATIONS)}; got {relation!r}")
    check_probability_vector(q, name="q")
    if relation == "beam":
        if k > q.shape[0]:
            raise ValueError(f"beam of width {k} over a vocabulary of {q.shape[0]}")
        return [(t, None) for t in beam_tokens(q, k)]
    out: list[tuple[int, torch.Tensor | None]] = []
    if relation == "iid":
        for _ in range(k):
            out.append((rng.categorical(q), q))
        return out
    size = q.shape[0] if domain is None else min(int(domain), q.shape[0])
    if k > size:
        raise ValueError(f"{k} draws without replacement from a vocabulary of {size}")
    sampled: list[int] = []
    for _ in range(k):
        law = without_replacement_law(q, sampled, domain=domain)  # [V]
        tok = rng.categorical(law)
        sampled.append(tok)
        out.append((tok, law))
    return out


def sample_tree_proposal(
    q_level: QLevelFn,
    *,
    widths: Sequence[int],
    relation: str,
    rng: RandomSource,
    max_nodes: int | None = None,
    **evidence,
) -> ProposalResult:
    """Expand a proposal tree level by level, ``widths[d]`` draws below each node of depth ``d``.

    ``q_level(prefixes)`` returns ``[len(prefixes), V]``: the proposal law conditional on each
    node's *own* prefix (one call per level, so a draft model can batch a level in one forward).
    Under i.i.d. sampling a parent may draw one token twice: both draws are kept (the compiler
    merges them into one row and the verifier sees both), and only the first is expanded further,
    so every distinct row has exactly ``widths[d]`` draws below it.

    ``iid``/``without_replacement`` give ``normalized_conditional`` evidence with ``q_dists``
    ``[N, V]`` = the law of each draw; ``beam`` gives ``score_only`` evidence (score = ``q`` of
    the token) and no ``q``. ``evidence``: ``source``, ``manifest_hash`` and ``state_handle``, as
    for :func:`sample_shaped_tree_proposal`, which draws the tree (the full ``widths`` tree in
    breadth-first order is its shape). ``max_nodes``: draw only the first ``max_nodes`` nodes of
    that breadth-first shape, so a level whose nodes all lie past them costs no ``q_level`` call.
    """
    if not widths or any(int(w) < 1 for w in widths):
        raise ValueError(f"widths must be a non-empty sequence of ints >= 1; got {list(widths)}")
    parents = widths_parents(widths, max_nodes)
    return sample_shaped_tree_proposal(q_level, parents=parents, relation=relation, rng=rng, **evidence)


def widths_parents(widths: Sequence[int], max_nodes: int | None = None) -> list[int]:
    """The parents of the full tree with ``widths[d]`` children below every node of depth ``d``,
    breadth first (``-1``: the prefix frontier); its first ``max_nodes`` nodes when given."""
    parents: list[int] = []
    level = [PREFIX_FRONTIER]
    limit = None if max_nodes is None else int(max_nodes)
    for width in widths:
        next_level: list[int] = []
        for parent in level:
            for _ in range(int(width)):
                if limit is not None and len(parents) >= limit:
                    return parents
                next_level.append(len(parents))
                parents.append(parent)
        level = next_level
    return parents


def check_shape_parents(parents: Sequence[int]) -> list[int]:
    """Validate an explicit tree shape: ``parents[i]`` is shape node ``i``'s parent, ``-1`` the
    prefix frontier, every parent before its children. Returns it as a list of ints."""
    par = [int(p) for p in parents]
    if not par:
        raise ValueError("a tree shape needs at least one node; got parents=[]")
    for i, p in enumerate(par):
        if not PREFIX_FRONTIER <= p < i:
            raise ValueError(f"parents[{i}] must be -1 (the frontier) or an earlier node in [0, {i}); got {p}")
    return par


def sample_shaped_tree_proposal(
    q_level: QLevelFn,
    *,
    parents: Sequence[int],
    relation: str,
    rng: RandomSource,
    ranks: Sequence[int] | None = None,
    max_depth: int | None = None,
    max_nodes: int | None = None,
    domain: int | None = None,
    source: str = "sampled",
    manifest_hash: str = "unhashed",
    state_handle: ProposalStateHandle = NO_STATE,
) -> ProposalResult:
    """Sample a proposal tree of an explicit shape (e.g. a Sequoia DP tree), level by level.

    ``parents[i]`` is the parent of shape node ``i`` (``-1`` = the prefix frontier; candidate-row
    parents, as :func:`harness.topology.sequoia.tree_to_budget_parents` gives them). The ``k``
    children of one node are drawn together by :func:`sample_children` in index order, so the
    ``j``-th child in index order is the ``j``-th draw (Sequoia's sibling rank ``j``).
    ``q_level(prefixes)`` returns ``[len(prefixes), V]``, one call per depth.

    Under i.i.d. sampling a node may repeat a sibling's token: the draw is kept (the compiler
    merges it into the sibling's row and the verifier sees both draws), but its subtree is not
    expanded, so the shape nodes below it are absent this round. Nodes come back in shape order
    with such absent nodes left out.

    ``ranks`` (a choice list, :func:`sample_ranked_tree_proposal`): node ``i`` is the
    ``ranks[i]``-th child of its parent. Ranks ``0 .. n - 1`` below every node are the sibling
    order above; ``beam`` also takes lists that skip ranks: a node whose children have ranks up to
    ``r`` ranks ``r + 1`` tokens and keeps the listed ones.

    ``max_depth`` (default: the whole shape): draw no deeper; the shape's deeper nodes are absent
    (the round cannot commit them). ``0`` draws nothing.

    ``max_nodes`` (default: the whole shape): draw only shape nodes ``0 .. max_nodes - 1`` (parents
    precede children, so they are a tree); a depth none of them reaches is never asked of
    ``q_level``.

    ``domain``: the ids ``0 .. domain - 1`` the proposer can expand (default: all); a draw without
    replacement that has used up ``q``'s mass falls back to the unsampled ids inside it.
    """
    if max_nodes is not None:
        if int(max_nodes) < 1:
            raise ValueError(f"max_nodes must be >= 1; got {max_nodes}")
        parents = list(parents)[: int(max_nodes)]
        ranks = None if ranks is None else list(ranks)[: int(max_nodes)]
    if ranks is None:
        par, gap = check_shape_parents(parents), None
    else:
        check_ranked_shape(parents, ranks, relation)
        par = [int(p) for p in parents]
        gap = first_rank_gap(par, ranks)

    def draws(q: torch.Tensor, kids: list[int]) -> list[tuple[int, torch.Tensor | None]]:
        """The ``(token, law)`` of each child in ``kids``, drawn below one node whose law is ``q``."""
        if gap is None:  # the j-th child is the j-th draw
            return sample_children(q, len(kids), relation=relation, rng=rng, domain=domain)
        top = max(int(ranks[v]) for v in kids) + 1
        ranked = [tok for tok, _ in sample_children(q, top, relation="beam", rng=rng)]
        return [(ranked[int(ranks[v])], None) for v in kids]

    children: dict[int, list[int]] = {}
    for i, p in enumerate(par):
        children.setdefault(p, []).append(i)
    token: dict[int, int] = {}  # shape node -> sampled token
    law_of: dict[int, torch.Tensor | None] = {}  # shape node -> law it was drawn from (None: beam)
    score_of: dict[int, float] = {}  # shape node -> q of its token (beam's score-only evidence)
    expand: dict[int, tuple[int, ...]] = {PREFIX_FRONTIER: ()}  # expandable shape node -> prefix
    level = [PREFIX_FRONTIER]  # shape nodes whose children are drawn at this depth
    depth = 0
    while level and (max_depth is None or depth < max_depth):
        depth += 1
        qs = q_level([expand[u] for u in level])  # [len(level), V]
        if qs.dim() != 2 or qs.shape[0] != len(level):
            raise ContractError(f"q_level must return [{len(level)}, V]; got {tuple(qs.shape)}")
        next_level: list[int] = []
        for u, q in zip(level, qs):
            kids = children[u]
            seen: set[int] = set()
            for v, (tok, law) in zip(kids, draws(q, kids)):
                token[v], law_of[v], score_of[v] = tok, law, float(q[tok])
                if tok in seen and gap is None:  # an i.i.d. duplicate: kept as a draw, not expanded
                    continue
                seen.add(tok)
                if v in children:
                    expand[v] = expand[u] + (tok,)
                    next_level.append(v)
        level = next_level

    nodes: list[ProposalNode] = []
    laws: list[torch.Tensor] = []
    index: dict[int, int] = {}  # shape node -> node index in the result
    for v, p in enumerate(par):
        if v not in token or (p != PREFIX_FRONTIER and p not in index):
            continue  # below an unexpanded duplicate
        parent = PREFIX_FRONTIER if p == PREFIX_FRONTIER else index[p]
        index[v] = len(nodes)
        law = law_of[v]
        if law is None:
            nodes.append(ProposalNode(token_id=token[v], parent=parent, score=score_of[v], source=source))
        else:
            nodes.append(ProposalNode(token_id=token[v], parent=parent, q=float(law[token[v]]), source=source))
            laws.append(law)
    return _sampled_result(
        nodes, laws, relation=relation, source=source, manifest_hash=manifest_hash, state_handle=state_handle
    )


def check_ranked_shape(parents: Sequence[int], ranks: Sequence[int], relation: str) -> None:
    """Refuse a ranked tree a relation cannot draw: sampled relations need ranks ``0 .. n - 1``
    below every node (names the node and the skipped rank)."""
    par = check_shape_parents(parents)
    if len(ranks) != len(par):
        raise ValueError(f"a ranked tree needs one rank per node; got {len(ranks)} ranks for {len(par)} nodes")
    if any(int(r) < 0 for r in ranks):
        raise ValueError(f"ranks must be >= 0; got {list(ranks)}")
    gap = first_rank_gap(par, ranks)
    if gap is not None and relation != "beam":
        parent, rank = gap
        where = "the first token" if parent == PREFIX_FRONTIER else f"node {list(choices_path(par, ranks, parent))}"
        raise ValueError(
            f"sampling={relation} draws a node's children in rank order, but the choice list skips rank {rank} "
            f"below {where}: sampled trees need ranks 0..n-1 below every node (or use sampling=beam)"
        )


def sample_ranked_tree_proposal(
    q_level: QLevelFn, *, parents: Sequence[int], ranks: Sequence[int], relation: str, rng: RandomSource, **evidence
) -> ProposalResult:
    """A proposal shaped by a choice list (``topology=choices``): node ``i`` is the
    ``ranks[i]``-th child of node ``parents[i]`` (``-1``: the prefix frontier), parents before
    children, siblings in ascending rank. One ``q_level`` call per depth.

    With ranks ``0 .. n - 1`` below every node this is :func:`sample_shaped_tree_proposal` (the
    ``j``-th child is the ``j``-th draw). ``beam`` also takes lists that skip ranks: a node whose
    children have ranks up to ``r`` ranks ``r + 1`` tokens and keeps the listed ones.
    ``evidence``: ``source``, ``manifest_hash`` and ``state_handle``, as for that function."""
    return sample_shaped_tree_proposal(q_level, parents=parents, ranks=ranks, relation=relation, rng=rng, **evidence)


def topology_of(nodes: Sequence[ProposalNode]) -> str:
    """The topology a proposal's parents describe: ``sequence`` (a chain, or nothing), ``set`` (all
    below the frontier) or ``tree``."""
    parents = [n.parent for n in nodes]
    if all(p == i - 1 for i, p in enumerate(parents)):
        return "sequence"
    if all(p == PREFIX_FRONTIER for p in parents):
        return "set"
    return "tree"


def _sampled_result(
    nodes: list[ProposalNode],
    laws: list[torch.Tensor],
    *,
    relation: str,
    source: str,
    manifest_hash: str,
    state_handle: ProposalStateHandle,
) -> ProposalResult:
    """Typed evidence from sampled nodes: ``normalized_conditional`` with the law of each draw, or
    ``score_only`` for ``beam`` (no law). The topology is read off the parents."""
    topology = topology_of(nodes)
    if relation == "beam":
        return ProposalResult(
            nodes=tuple(nodes),
            probability_semantics="score_only",
            sampling_relation="beam",
            topology=topology,
            state_handle=state_handle,
            manifest_hash=manifest_hash,
            source=source,
        )
    return ProposalResult(
        nodes=tuple(nodes),
        probability_semantics="normalized_conditional",
        sampling_relation=relation,
        topology=topology,
        state_handle=state_handle,
        manifest_hash=manifest_hash,
        q_dists=torch.stack(laws) if laws else None,
        source=source,
    )
