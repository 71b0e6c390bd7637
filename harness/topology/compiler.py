"""Topology compiler: proposals -> parent-unique candidate rows and target coordinates.

Pure functions, no model: prefix-merged trees, candidate/predictor/KV row coordinates, and the
implementation assertions over them.

Coordinates. ``prefix_len`` counts every committed token *including* the pending bonus/correction
token that the verify forward processes first. Candidate row ``r`` at depth ``d_r >= 1`` processes
``token_ids[r]`` at position ``prefix_len + d_r - 1``. The distribution that verifies
``token_ids[r]`` is the frontier (the pending token's logits) when ``parents[r] == -1``, else the
logits of row ``parents[r]`` (its *predictor row*). Row ``r``'s own logits predict its children.
Rows are keyed by the full token prefix, never by (depth, token): equal tokens under different
parents stay distinct rows with distinct KV.

Row order. Rows are materialised in first-insertion order while walking the proposals' nodes in
order (proposal 0 first); a parent is always inserted before its children, so the order is
topological. Budgets (``max_nodes`` candidate rows, root excluded; ``max_depth``) keep the first
rows of that order; because a parent precedes its children the kept set is still a tree. A depth cut
drops draws whatever their values, so a sampled proposal's draw law is unchanged by it; a sampled
proposal (one that records q) with more nodes within ``max_depth`` than ``max_nodes`` leaves is
refused instead (a ``ContractError``): whether one of its draws needs a new row depends on the
draw's value, and dropping new ones while keeping repeats of kept tokens would bias the verifier.

Draws. A parent may receive the same token several times from i.i.d. sampling. The row is
materialised once, but ``draws[parent+1]`` keeps every draw in proposal order with the index of
the distribution it was drawn from, which is what the multi-candidate verifiers consume.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from harness.contracts import PREFIX_FRONTIER, Capabilities, ContractError, ProposalResult


@dataclass(frozen=True)
class Draw:
    """One proposal draw under a parent: the row it landed on and the law it was drawn from."""

    row: int
    q_index: int  # row of CompiledTree.q_dists, or -1 when the proposal carries no q
    source: str


@dataclass(frozen=True)
class CompiledTree:
    token_ids: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, -1 = prefix frontier
    depths: torch.Tensor  # [N] long, >= 1
    position_ids: torch.Tensor  # [N] long, prefix_len + depth - 1
    predictor_rows: torch.Tensor  # [N] long, -1 = frontier logits, else parent row
    ancestor_mask: torch.Tensor  # [N, N] bool, self + ancestors (candidate columns only)
    full_prefixes: tuple[tuple[int, ...], ...]
    sources: tuple[tuple[str, ...], ...]  # sources that proposed each row
    draws: tuple[tuple[Draw, ...], ...]  # [N + 1]: draws[0] = frontier's children, draws[r+1] = row r's
    q_dists: torch.Tensor | None  # [M, V] laws draws were taken from, or None
    prefix_len: int
    probability_semantics: frozenset[str]
    sampling_relations: frozenset[str]
    topology: str  # "sequence" | "set" | "tree"

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.numel())

    def children(self, row: int) -> tuple[int, ...]:
        """Distinct child rows of ``row`` (``-1``: the frontier) in declared order."""
        seen: list[int] = []
        for d in self.draws[row + 1]:
            if d.row not in seen:
                seen.append(d.row)
        return tuple(seen)

    def path_to(self, row: int) -> tuple[int, ...]:
        """Rows from the root to ``row`` inclusive."""
        out = []
        while row != PREFIX_FRONTIER:
            out.append(row)
            row = int(self.parents[row])
        return tuple(reversed(out))


def _topology_of(parents: list[int]) -> str:
    if all(p == PREFIX_FRONTIER for p in parents):
        return "set" if len(parents) > 1 else "sequence"
    if all(p == i - 1 for i, p in enumerate(parents)):
        return "sequence"
    return "tree"


def build_ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """``mask[u, v]`` is True iff ``v`` is ``u`` or an ancestor of ``u``. ``[N, N]`` bool."""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)  # built in NumPy: a row copy there is a fraction of a torch op's dispatch
    for u, p in enumerate(parents):
        if p != PREFIX_FRONTIER:
            mask[u] = mask[p]
        mask[u, u] = True
    return torch.from_numpy(mask)


def _check_sampled_budget(proposal: ProposalResult, *, rows_before: int, max_nodes: int, max_depth: int | None) -> None:
    """A sampled proposal fits the row budget whatever its draws' values: its nodes within
    ``max_depth`` (the depth cut is value-free) are at most the rows ``max_nodes`` leaves."""
    depth: list[int] = []
    for node in proposal.nodes:
        depth.append(1 if node.parent == PREFIX_FRONTIER else depth[node.parent] + 1)
    kept = sum(1 for d in depth if max_depth is None or d <= max_depth)
    if rows_before + kept > max_nodes:
        raise ContractError(
            f"a sampled proposal ({proposal.source}) has {kept} nodes for {max_nodes - rows_before} rows of the "
            f"budget (max_nodes={max_nodes}): a proposer that records q trims its draws to the budget itself "
            "(a cut here would keep or drop a draw by its value, and bias the verifier)"
        )


def _check_declared(proposal: ProposalResult, capabilities: Capabilities) -> None:
    """Refuse a proposal whose probability semantics or sampling relation its proposer did not declare."""
    bad = []
    if proposal.probability_semantics not in capabilities.probability_semantics:
        bad.append(
            f"probability_semantics={proposal.probability_semantics!r} "
            f"(declared {sorted(capabilities.probability_semantics)})"
        )
    if proposal.sampling_relation not in capabilities.sampling_relations:
        bad.append(
            f"sampling_relation={proposal.sampling_relation!r} (declared {sorted(capabilities.sampling_relations)})"
        )
    if bad:
        raise ContractError(
            f"proposal from {proposal.source!r} carries {' and '.join(bad)}, outside what proposer "
            f"{capabilities.name!r} declared and negotiation admitted the verifier for"
        )


def compile_tree(
    proposals: Sequence[ProposalResult],
    prefix_len: int,
    *,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    capabilities: Capabilities | None = None,
) -> CompiledTree:
    """Merge proposals by full token prefix into parent-unique rows with target coordinates.

    ``capabilities``: what negotiation admitted for the proposer (its ``declare()``). Given, a
    non-empty proposal whose ``probability_semantics`` or ``sampling_relation`` is not among them is
    refused (a :class:`~harness.contracts.ContractError`): the verifier was chosen for the declared
    semantics and relations, and its exactness holds for those only."""
    if prefix_len < 1:
        raise ContractError(f"prefix_len counts the pending token and must be >= 1; got {prefix_len}")
    rows_by_prefix: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    prefixes: list[tuple[int, ...]] = []
    sources: list[list[str]] = []
    draws: list[list[Draw]] = [[]]
    q_blocks: list[torch.Tensor] = []
    q_offset = 0
    semantics: set[str] = set()
    relations: set[str] = set()

    for proposal in proposals:
        if proposal.empty:
            continue
        if capabilities is not None:
            _check_declared(proposal, capabilities)
        semantics.add(proposal.probability_semantics)
        relations.add(proposal.sampling_relation)
        node_row: list[int | None] = []  # proposal node index -> row (None: dropped by budget)
        if proposal.q_dists is not None and max_nodes is not None:
            _check_sampled_budget(proposal, rows_before=len(tokens), max_nodes=max_nodes, max_depth=max_depth)
        for i, node in enumerate(proposal.nodes):
            parent_row = PREFIX_FRONTIER if node.parent == PREFIX_FRONTIER else node_row[node.parent]
            if node.parent != PREFIX_FRONTIER and parent_row is None:
                node_row.append(None)
                continue
            parent_prefix = () if parent_row == PREFIX_FRONTIER else prefixes[parent_row]
            prefix = parent_prefix + (node.token_id,)
            depth = len(prefix)
            row = rows_by_prefix.get(prefix)
            if row is None:
                over_nodes = max_nodes is not None and len(tokens) >= max_nodes
                over_depth = max_depth is not None and depth > max_depth
                if over_nodes or over_depth:
                    node_row.append(None)
                    continue
                row = len(tokens)
                rows_by_prefix[prefix] = row
                tokens.append(node.token_id)
                parents.append(parent_row)
                depths.append(depth)
                prefixes.append(prefix)
                sources.append([])
                draws.append([])
            if node.source not in sources[row]:
                sources[row].append(node.source)
            q_index = q_offset + i if proposal.q_dists is not None else -1
            draws[parent_row + 1].append(Draw(row=row, q_index=q_index, source=node.source))
            node_row.append(row)
        if proposal.q_dists is not None:
            q_blocks.append(proposal.q_dists)
            q_offset += proposal.q_dists.shape[0]

    if q_blocks:
        vocab = {b.shape[1] for b in q_blocks}
        if len(vocab) != 1:
            raise ContractError(f"proposals disagree on vocabulary size: {sorted(vocab)}")
        # one proposal's laws are used as they are (a tree never writes to them): no copy per round
        q_dists = q_blocks[0] if len(q_blocks) == 1 else torch.cat(q_blocks, dim=0)
    else:
        q_dists = None

    tok = torch.tensor(tokens, dtype=torch.long)
    par = torch.tensor(parents, dtype=torch.long)
    dep = torch.tensor(depths, dtype=torch.long)
    return CompiledTree(
        token_ids=tok,
        parents=par,
        depths=dep,
        position_ids=prefix_len + dep - 1,
        predictor_rows=par.clone(),
        ancestor_mask=build_ancestor_mask(parents),
        full_prefixes=tuple(prefixes),
        sources=tuple(tuple(s) for s in sources),
        draws=tuple(tuple(d) for d in draws),
        q_dists=q_dists,
        prefix_len=prefix_len,
        probability_semantics=frozenset(semantics),
        sampling_relations=frozenset(relations),
        topology=_topology_of(parents),
    )


def full_attention_mask(tree: CompiledTree, cache_len: int) -> torch.Tensor:
    """Boolean mask ``[1 + N, cache_len + 1 + N]`` for the verify forward.

    Row 0 is the pending token at position ``cache_len`` (sees the cached prefix and itself);
    row ``1 + r`` is candidate row ``r`` (sees the cached prefix, the pending token, its ancestors
    and itself; never a sibling).
    """
    n = tree.num_rows
    mask = torch.zeros((1 + n, cache_len + 1 + n), dtype=torch.bool)
    mask[:, : cache_len + 1] = True
    mask[1:, cache_len + 1 :] = tree.ancestor_mask
    return mask


# ------------------------------------------------------------------- implementation assertions


def validate_candidate_graph(tree: CompiledTree, prefix_len: int | None = None) -> None:
    """``validate_candidate_graph`` over a compiled tree: parents, depths, positions, predictor rows,
    full prefixes and the ancestor mask agree. Raises ContractError."""
    prefix_len = tree.prefix_len if prefix_len is None else prefix_len
    if prefix_len < 0:
        raise ContractError(f"prefix_len must be >= 0; got {prefix_len}")
    n = tree.num_rows
    parents = tree.parents.tolist()
    for r in range(n):
        p = parents[r]
        if not (-1 <= p < r):
            raise ContractError(f"row {r}: parent {p} must satisfy -1 <= parent < row")
        expected_depth = 1 if p == -1 else int(tree.depths[p]) + 1
        if int(tree.depths[r]) != expected_depth:
            raise ContractError(f"row {r}: depth {int(tree.depths[r])} != expected {expected_depth}")
        if int(tree.position_ids[r]) != prefix_len + expected_depth - 1:
            raise ContractError(
                f"row {r}: position id {int(tree.position_ids[r])} != {prefix_len + expected_depth - 1}"
            )
        parent_prefix = () if p == -1 else tree.full_prefixes[p]
        if tree.full_prefixes[r] != parent_prefix + (int(tree.token_ids[r]),):
            raise ContractError(f"row {r}: full prefix does not extend its parent's")
        if int(tree.predictor_rows[r]) != (PREFIX_FRONTIER if p == -1 else p):
            raise ContractError(f"row {r}: predictor row {int(tree.predictor_rows[r])} is not its parent {p}")
    if len(set(tree.full_prefixes)) != n:
        raise ContractError("two rows share a full prefix: rows must be parent-unique")
    expected = build_ancestor_mask(parents)
    if tree.ancestor_mask.shape != (n, n) or not torch.equal(tree.ancestor_mask, expected):
        raise ContractError("ancestor mask differs from self + ancestors")
    if tree.q_dists is not None:
        for slot in tree.draws:
            for d in slot:
                if d.q_index >= 0 and float(tree.q_dists[d.q_index, int(tree.token_ids[d.row])]) <= 0.0:
                    raise ContractError(f"row {d.row} was drawn from a law that gives it no mass")


def validate_commit(
    tree: CompiledTree, accepted_rows: Sequence[int], branch_token_ids: Sequence[int] | None = None
) -> None:
    """``validate_commit``: one root-to-node path, no siblings, tokens match."""
    accepted = list(accepted_rows)
    if len(set(accepted)) != len(accepted):
        raise ContractError(f"accepted rows repeat: {accepted}")
    expected_parent = PREFIX_FRONTIER
    for r in accepted:
        if not (0 <= r < tree.num_rows):
            raise ContractError(f"accepted row {r} out of range [0, {tree.num_rows})")
        if int(tree.parents[r]) != expected_parent:
            raise ContractError(
                f"accepted rows {accepted} are not one root-to-node path (row {r} has parent "
                f"{int(tree.parents[r])}, expected {expected_parent}); siblings are never committed"
            )
        expected_parent = r
    if branch_token_ids is not None:
        for r in accepted:
            if int(branch_token_ids[r]) != int(tree.token_ids[r]):
                raise ContractError(
                    f"branch cache row {r} holds token {branch_token_ids[r]}, tree has {int(tree.token_ids[r])}"
                )
