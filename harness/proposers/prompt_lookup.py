"""Prompt lookup (reference 0x04A): copy what followed an earlier occurrence of the suffix n-gram.

``shape=sequence`` copies one continuation (the most recent occurrence of the longest matching
suffix n-gram, as in the reference's pseudocode). ``shape=sequences`` merges the continuations of
up to ``max_matches`` occurrences (longest n first, then more recent first; shorter n-grams fill
the remaining matches) into one prefix tree within the node budget: several matches verified in
one forward, which is what a single-sequence lookup lacks. Candidates carry a ``score`` (the
matched n-gram length), never a ``q``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from harness.contracts import ProposalNode, ProposalResult
from harness.proposers.base import Budget, Proposer
from harness.random_source import RandomSource


def find_continuations(tokens: np.ndarray, *, max_ngram: int, min_ngram: int, max_depth: int,
                       max_matches: int) -> list[tuple[int, np.ndarray]]:
    """``[(ngram_len, continuation)]`` for earlier occurrences of the suffix, best first.

    tokens: ``[T]`` int. An occurrence at ``i`` matches ``tokens[i:i+n] == tokens[T-n:]`` with
    ``i + n < T`` (it has at least one following token) and ``i < T - n`` (not the suffix itself).
    """
    total = len(tokens)
    out: list[tuple[int, np.ndarray]] = []
    seen_starts: set[int] = set()
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        suffix = tokens[total - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)  # [T-n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        for i in hits[::-1]:  # most recent first
            start = int(i) + n
            if start >= total or start in seen_starts:
                continue
            seen_starts.add(start)
            out.append((n, tokens[start: start + max_depth]))
            if len(out) >= max_matches:
                return out
    return out


class PromptLookupProposer(Proposer):
    name: ClassVar[str] = "prompt_lookup"
    probability_semantics: ClassVar[str] = "score_only"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"sequence", "sequences"})

    def __init__(self, *, budget: Budget, manifest_hash: str, policy=None, max_ngram: int = 3,
                 min_ngram: int = 1, max_matches: int = 8) -> None:
        super().__init__(budget=budget, manifest_hash=manifest_hash, policy=policy)
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = 1 if budget.shape == "sequence" else max_matches

    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        tokens = np.asarray(committed, dtype=np.int64)
        depth = self.budget.max_depth if self.budget.shape != "sequence" else min(
            self.budget.max_depth, self.budget.max_nodes)
        matches = find_continuations(tokens, max_ngram=self.max_ngram, min_ngram=self.min_ngram,
                                     max_depth=depth, max_matches=self.max_matches)
        nodes: list[ProposalNode] = []
        index: dict[tuple[int, ...], int] = {}
        for n, cont in matches:
            parent, prefix = -1, ()
            for tok in cont.tolist():
                prefix += (tok,)
                node = index.get(prefix)
                if node is None:
                    if len(nodes) >= self.budget.max_nodes:
                        break
                    node = index[prefix] = len(nodes)
                    nodes.append(ProposalNode(token_id=tok, parent=parent, score=float(n), source=self.name))
                parent = node
        topology = "sequence" if all(nd.parent == i - 1 for i, nd in enumerate(nodes)) else "tree"
        return ProposalResult(nodes=tuple(nodes), probability_semantics="score_only",
                              sampling_relation="deterministic_lookup", topology=topology,
                              state_handle=self._handle(len(committed)), manifest_hash=self.manifest_hash,
                              source=self.name)

    def _handle(self, committed_len: int):
        from harness.contracts import ProposalStateHandle

        return ProposalStateHandle(owner=self.name, committed_len=committed_len)


class NullProposer(Proposer):
    """Proposes nothing: the round degenerates to one autoregressive target step. The AR baseline
    runs through the same round code with this proposer."""

    name: ClassVar[str] = "none"
    probability_semantics: ClassVar[str] = "absent"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"sequence"})

    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        return ProposalResult.empty_result(source=self.name, manifest_hash=self.manifest_hash)
