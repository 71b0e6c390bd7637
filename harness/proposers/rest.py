"""``proposer=rest``: retrieval drafting from a datastore (reference 0x04B, 0x04C).

Per round: search the committed tokens' suffix in the datastore with decreasing ``n``
(``max_suffix`` down to ``min_suffix``), take the continuations of the first ``n`` that has
matches (the datastore's declared match-selection rule and ``max_matches``), merge them into a
trie whose nodes count prefix frequency, prune to the node budget and linearise.

Semantics are ``frequency``: a node's ``score`` is its prefix count, never ``q``. Trie counts are
corpus statistics, not a proposal law, so negotiation allows greedy and membership verification
and refuses p/q verifiers (rejection, SpecInfer, Sequoia).

Declared orders (also written into every datastore manifest):

* siblings: descending prefix count, then ascending token id;
* pruning (global): rank every trie node of depth <= ``max_depth`` by descending count, then by
  breadth-first position (siblings in declared order); keep the first ``max_nodes``. A child's
  count never exceeds its parent's and a parent comes first breadth-first, so the kept set is
  closed under prefixes;
* output: kept nodes breadth-first, siblings in declared order (parents precede children).

With ``Budget.shape == "sequence"`` the proposal is the single path that follows the first child
in sibling order from the root.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from harness.contracts import PREFIX_FRONTIER, ProposalNode, ProposalResult, ProposalStateHandle
from harness.proposers.base import Budget, Proposer, budget_topology
from harness.random_source import RandomSource
from harness.workloads.datastore import Datastore, DatastoreError


@dataclass
class TrieNode:
    token: int
    count: int = 0
    children: dict[int, "TrieNode"] = field(default_factory=dict)

    def ordered_children(self) -> list["TrieNode"]:
        """Siblings in declared order: descending count, then ascending token id."""
        return sorted(self.children.values(), key=lambda c: (-c.count, c.token))


def build_trie(continuations: Sequence[Sequence[int]]) -> TrieNode:
    """Merge continuations by full prefix; each node counts the continuations through it."""
    root = TrieNode(token=-1)
    for cont in continuations:
        node = root
        node.count += 1
        for tok in cont:
            child = node.children.get(int(tok))
            if child is None:
                child = node.children[int(tok)] = TrieNode(token=int(tok))
            child.count += 1
            node = child
    return root


def linearize_trie(root: TrieNode, *, max_nodes: int, max_depth: int) -> list[tuple[int, int, int]]:
    """Prune (global policy above) and linearise: ``[(token, parent_index, count)]`` breadth-first."""
    if max_nodes < 1 or max_depth < 1:
        raise ValueError(f"max_nodes and max_depth must be >= 1; got {max_nodes}, {max_depth}")
    # breadth-first enumeration, siblings in declared order: (node, parent_bfs, depth)
    bfs: list[tuple[TrieNode, int, int]] = []
    frontier = [(child, PREFIX_FRONTIER, 1) for child in root.ordered_children()]
    while frontier:
        nxt = []
        for node, parent, depth in frontier:
            idx = len(bfs)
            bfs.append((node, parent, depth))
            if depth < max_depth:
                nxt.extend((c, idx, depth + 1) for c in node.ordered_children())
        frontier = nxt
    ranked = sorted(range(len(bfs)), key=lambda i: (-bfs[i][0].count, i))
    kept = sorted(ranked[:max_nodes])  # breadth-first order again
    new_index = {old: new for new, old in enumerate(kept)}
    out = []
    for old in kept:
        node, parent, _ = bfs[old]
        out.append((node.token, PREFIX_FRONTIER if parent == PREFIX_FRONTIER else new_index[parent], node.count))
    return out


def best_path(root: TrieNode, *, max_len: int) -> list[tuple[int, int, int]]:
    """The chain following the first child in sibling order: ``[(token, parent_index, count)]``."""
    out, node = [], root
    while len(out) < max_len and node.children:
        node = node.ordered_children()[0]
        out.append((node.token, len(out) - 1, node.count))
    return out


class RestProposer(Proposer):
    """Retrieval drafting over a :class:`~harness.workloads.datastore.Datastore`."""

    name: ClassVar[str] = "rest"
    probability_semantics: ClassVar[str] = "frequency"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"sequence", "tree"})

    def __init__(self, *, budget: Budget, manifest_hash: str, datastore: Datastore,
                 max_suffix: int | None = None, min_suffix: int = 1, max_matches: int | None = None,
                 continuation_len: int | None = None, policy=None) -> None:
        super().__init__(budget=budget, manifest_hash=manifest_hash, policy=policy)
        m = datastore.manifest
        released = {"context_len": int(m.get("context_len", 16)),
                    "max_matches": int(m.get("match_selection", {}).get("max_matches", 64)),
                    "continuation_len": int(m.get("continuation_len", 8))}
        self.max_suffix = released["context_len"] if max_suffix is None else int(max_suffix)
        self.max_matches = released["max_matches"] if max_matches is None else int(max_matches)
        self.continuation_len = released["continuation_len"] if continuation_len is None else int(continuation_len)
        self.min_suffix = int(min_suffix)
        for key, value in (("max_suffix", self.max_suffix), ("max_matches", self.max_matches),
                           ("continuation_len", self.continuation_len)):
            limit = released["context_len" if key == "max_suffix" else key]
            if value > limit:
                raise DatastoreError(
                    f"proposer.{key}={value} exceeds the datastore release's "
                    f"{'context_len' if key == 'max_suffix' else key}={limit}; rebuild the datastore or lower it")
        if not 1 <= self.min_suffix <= self.max_suffix:
            raise ValueError(f"need 1 <= min_suffix <= max_suffix; got {self.min_suffix}, {self.max_suffix}")
        if self.max_matches < 1 or self.continuation_len < 1:
            raise ValueError(f"max_matches and continuation_len must be >= 1; got {self.max_matches}, "
                             f"{self.continuation_len}")
        self.datastore = datastore
        self.source_id = f"rest:{datastore.release_id[:12]}"
        self.stats.proposal_state_bytes = datastore.nbytes
        self.stats.extras.update({"rounds": 0, "misses": 0, "match_len_sum": 0, "trie_ms": 0.0,
                                  "last_match_len": 0, "last_retrieval_ms": 0.0,
                                  "datastore_bytes": datastore.nbytes,
                                  "datastore_release_id": datastore.release_id})

    def state_bytes(self) -> int:
        return self.datastore.nbytes

    @property
    def miss_rate(self) -> float | None:
        rounds = self.stats.extras["rounds"]
        return None if rounds == 0 else self.stats.extras["misses"] / rounds

    def retrieve(self, committed: Sequence[int]) -> tuple[int, list[list[int]]]:
        """``(match_len, continuations)`` for the longest matching suffix (``(0, [])`` on a miss)."""
        depth = min(self.continuation_len, self.budget.max_depth)
        for n in range(min(self.max_suffix, len(committed)), self.min_suffix - 1, -1):
            suffix = committed[len(committed) - n:]
            starts = self.datastore.occurrences(suffix, max_matches=self.max_matches, need_continuation=True)
            if len(starts):
                return n, self.datastore.continuations(starts, offset=n, length=depth)
        return 0, []

    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        t0 = time.perf_counter()
        match_len, conts = self.retrieve(committed)
        t1 = time.perf_counter()
        root = build_trie(conts)
        if self.budget.shape == "sequence":
            rows = best_path(root, max_len=min(self.budget.max_nodes, self.budget.max_depth))
        else:
            rows = linearize_trie(root, max_nodes=self.budget.max_nodes, max_depth=self.budget.max_depth)
        nodes = tuple(ProposalNode(token_id=tok, parent=parent, score=float(count), source=self.source_id)
                      for tok, parent, count in rows)
        t2 = time.perf_counter()
        retrieval_ms, trie_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        ex = self.stats.extras
        ex["rounds"] += 1
        ex["misses"] += int(not nodes)
        ex["match_len_sum"] += match_len
        ex["trie_ms"] += trie_ms
        ex["last_match_len"], ex["last_retrieval_ms"] = match_len, retrieval_ms
        self.stats.retrieval_ms += retrieval_ms
        extras = {"retrieval_ms": retrieval_ms, "trie_ms": trie_ms, "match_len": match_len,
                  "n_matches": len(conts), "miss": not nodes,
                  "datastore_release_id": self.datastore.release_id}
        handle = ProposalStateHandle(owner=self.name, committed_len=len(committed))
        return ProposalResult(nodes=nodes, probability_semantics="frequency",
                              sampling_relation="deterministic_lookup",
                              topology=budget_topology(self.budget), state_handle=handle,
                              manifest_hash=self.manifest_hash, source=self.name, extras=extras)
