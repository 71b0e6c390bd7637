"""Prompt lookup: copy what followed an earlier occurrence of the suffix n-gram.

``shape=sequence`` copies one continuation: that of the occurrence of the suffix n-gram (n from
``max_ngram`` down to ``min_ngram``) whose preceding context agrees with the current one the
longest, the most recent among equals. ``shape=sequences`` merges the continuations of up to
``max_matches`` occurrences, best first, into one prefix tree: several matches verified in one
forward.

An occurrence's *context length* is how many tokens before its continuation equal the tokens
before the current position, counted back from the matched n-gram (at least n, at most
``MAX_CONTEXT``). It is what predicts a copy: on held-out prompts (SmolLM2, dev split of HumanEval
and ShareGPT) a candidate whose context length is 1 was the target's next token 22% of the times it
was tried, 3-4 tokens 70%, 17 or more 97%.

``budget=adaptive`` sizes each round's tree from the measured verify cost instead of a fixed
count: every candidate row gets an estimated reach probability (the product, along its path, of
acceptance rates learned online per effective context length (the occurrence's context length
plus the candidate's depth below it: a row at depth d extends the match by d - 1 tokens) and
sibling rank), rows are taken in descending reach order (a prefix-closed set, since a child never
out-reaches its parent), and the round keeps the ``k`` rows that minimise ``t(1 + k) / (1 + sum of
their reach)``, the predicted time per committed token. The rates are proposal-side statistics
only: they change which candidates are verified, never what is accepted, so exactness is untouched.

Candidates carry a ``score`` (the matched context length), never a ``q``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from harness.contracts import Budget, ProposalNode, ProposalResult, ProposalStateHandle
from harness.proposers.base import Proposer
from harness.random_source import RandomSource

#: the longest context an occurrence's match is measured over (tokens)
MAX_CONTEXT = 32


def find_continuations(
    tokens: np.ndarray, *, max_ngram: int, min_ngram: int, max_depth: int, max_matches: int
) -> list[tuple[int, np.ndarray]]:
    """``[(context_len, continuation)]`` for earlier occurrences of the suffix, best first.

    tokens: ``[T]`` int. An occurrence at ``i`` matches ``tokens[i:i+n] == tokens[T-n:]`` with
    ``i + n < T`` (it has at least one following token, so it is not the suffix itself), for the
    longest ``n`` in ``[min_ngram, max_ngram]`` that matches there. Its context length extends the
    n-gram backwards while ``tokens[i-k] == tokens[T-n-k]`` (up to ``MAX_CONTEXT`` tokens in all).
    Occurrences are ranked by context length, then the more recent first.
    """
    total = len(tokens)
    starts: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    seen = np.zeros(total + 1, dtype=bool)  # continuation starts already taken by a longer n-gram
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        suffix = tokens[total - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)  # [T-n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))  # window starts i, continuation at i + n
        hits = hits[~seen[hits + n]]
        if not len(hits):
            continue
        seen[hits + n] = True
        reach = min(MAX_CONTEXT, total - 1) - n  # further tokens a match may extend over
        context = np.full(len(hits), n)
        if reach > 0:
            back = np.arange(1, reach + 1)  # [E]
            before = hits[:, None] - back[None, :]  # [H, E] positions before each occurrence
            same = (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[total - n - back][None, :])
            context += np.cumprod(same, axis=1).sum(axis=1)  # leading run of equal tokens
        starts.append(hits + n)
        lengths.append(context)
    if not starts:
        return []
    start, context = np.concatenate(starts), np.concatenate(lengths)
    order = np.lexsort((-start, -context))[:max_matches]  # longest context, then most recent
    return [(int(context[k]), tokens[start[k] : start[k] + max_depth]) for k in order]


class AcceptanceRates:
    """Online acceptance rates per (effective context bucket, sibling rank): Beta posteriors whose
    prior means rise with the context a candidate's match has (``PRIOR_MEAN``, measured on held-out
    dev prompts), ``prior_strength`` pseudo-observations each, so a run starts from what context
    length says and learns its own workload from there."""

    #: upper bounds of the effective-context buckets (the last one is open)
    BUCKETS: ClassVar[tuple[int, ...]] = (1, 2, 4, 8, 16)
    #: prior acceptance per bucket: SmolLM2, dev split of HumanEval, ShareGPT and copy prompts
    #: (0.22, 0.35, 0.71, 0.82, 0.83, 0.97 measured by scripts/lookup_context_calibration.py), to 0.05
    PRIOR_MEAN: ClassVar[tuple[float, ...]] = (0.2, 0.35, 0.7, 0.8, 0.85, 0.95)

    def __init__(self, *, prior_strength: float = 4.0, max_rank_key: int = 3) -> None:
        self.prior_strength = prior_strength
        self.max_rank_key = max_rank_key
        self.accepted: dict[tuple[int, int], int] = {}
        self.tried: dict[tuple[int, int], int] = {}

    def key(self, depth: int, context: int, rank: int) -> tuple[int, int]:
        """The key of a candidate at ``depth`` (1 = the first token of its continuation) below a
        match of ``context`` tokens, ``rank``-th among its siblings."""
        effective = context + depth - 1
        bucket = next((b for b, bound in enumerate(self.BUCKETS) if effective <= bound), len(self.BUCKETS))
        return bucket, min(rank, self.max_rank_key)

    def rate(self, key: tuple[int, int]) -> float:
        a = self.PRIOR_MEAN[key[0]] * self.prior_strength
        return (self.accepted.get(key, 0) + a) / (self.tried.get(key, 0) + self.prior_strength)

    def observe(self, key: tuple[int, int], accepted: bool) -> None:
        self.tried[key] = self.tried.get(key, 0) + 1
        if accepted:
            self.accepted[key] = self.accepted.get(key, 0) + 1


class PromptLookupProposer(Proposer):
    name: ClassVar[str] = "prompt_lookup"
    probability_semantics: ClassVar[str] = "score_only"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"sequence", "sequences"})

    def __init__(
        self,
        *,
        budget: Budget,
        manifest_hash: str,
        policy=None,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_matches: int = 8,
        budget_policy: str = "fixed",
        verify_cost: list[float] | None = None,
    ) -> None:
        super().__init__(budget=budget, manifest_hash=manifest_hash, policy=policy)
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        if budget_policy not in ("fixed", "adaptive"):
            raise ValueError(f"proposer.budget_policy must be fixed or adaptive; got {budget_policy!r}")
        if budget_policy == "adaptive":
            if not verify_cost or len(verify_cost) < budget.max_nodes + 1:
                raise ValueError(
                    f"budget_policy=adaptive needs verify_cost t(1..{budget.max_nodes + 1}) (normalised verify "
                    f"cost per row count; a run's prepare stage measures it); got {verify_cost!r}"
                )
            if any(not np.isfinite(c) or c <= 0 for c in verify_cost):
                raise ValueError(f"verify_cost must be positive and finite; got {verify_cost}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = 1 if budget.shape == "sequence" else max_matches
        self.budget_policy = budget_policy
        self.verify_cost = np.asarray(verify_cost, dtype=np.float64) if verify_cost else None
        self.rates = AcceptanceRates()
        self._last: tuple[int, list[tuple[int, ...]], list[tuple[int, int]]] | None = None
        self.stats.extras.update({"rows_proposed": 0, "rows_kept": 0})

    # ------------------------------------------------------------------ proposing
    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        tokens = np.asarray(committed, dtype=np.int64)
        depth = (
            self.budget.max_depth
            if self.budget.shape != "sequence"
            else min(self.budget.max_depth, self.budget.max_nodes)
        )
        matches = find_continuations(
            tokens, max_ngram=self.max_ngram, min_ngram=self.min_ngram, max_depth=depth, max_matches=self.max_matches
        )
        prefixes: list[tuple[int, ...]] = []  # full candidate prefix of each node
        parents: list[int] = []
        keys: list[tuple[int, int]] = []
        context_of: list[int] = []
        index: dict[tuple[int, ...], int] = {}
        children: dict[int, int] = {}
        limit = self.budget.max_nodes if self.budget_policy == "fixed" else 4 * self.budget.max_nodes
        for context, cont in matches:
            parent, prefix = -1, ()
            for tok in cont.tolist():
                prefix += (tok,)
                node = index.get(prefix)
                if node is None:
                    if len(prefixes) >= limit:
                        break
                    node = index[prefix] = len(prefixes)
                    rank = children.get(parent, 0)
                    children[parent] = rank + 1
                    prefixes.append(prefix)
                    parents.append(parent)
                    context_of.append(context)
                    keys.append(self.rates.key(len(prefix), context, rank))
                parent = node
        keep = list(range(len(prefixes)))
        if self.budget_policy == "adaptive" and prefixes:
            keep = self._choose_rows(parents, keys)
        remap = {old: new for new, old in enumerate(keep)}
        nodes = tuple(
            ProposalNode(
                token_id=prefixes[i][-1],
                parent=remap[parents[i]] if parents[i] >= 0 else -1,
                score=float(context_of[i]),
                source=self.name,
            )
            for i in keep
        )
        self.stats.extras["rows_proposed"] += len(prefixes)
        self.stats.extras["rows_kept"] += len(keep)
        self._last = (len(committed), prefixes, keys)
        topology = "sequence" if all(nd.parent == i - 1 for i, nd in enumerate(nodes)) else "tree"
        return ProposalResult(
            nodes=nodes,
            probability_semantics="score_only",
            sampling_relation="deterministic_lookup",
            topology=topology,
            state_handle=ProposalStateHandle(owner=self.name, committed_len=len(committed)),
            manifest_hash=self.manifest_hash,
            source=self.name,
        )

    def _choose_rows(self, parents: list[int], keys: list[tuple[int, int]]) -> list[int]:
        """Rows in descending reach order; the count minimising predicted time per token."""
        reach = np.empty(len(parents))
        for i, (p, key) in enumerate(zip(parents, keys)):
            reach[i] = (1.0 if p < 0 else reach[p]) * self.rates.rate(key)
        order = np.argsort(-reach, kind="stable")  # a parent (earlier, reach >=) precedes its children
        cap = min(len(order), self.budget.max_nodes)
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(reach[order[:cap]])])  # k = 0..cap
        cost = self.verify_cost[: cap + 1]  # t(1 + k)
        k = int(np.argmin(cost / expected))
        return sorted(order[:k].tolist())

    def observe_commit(self, committed: list[int]) -> None:
        """Update acceptance rates: walk the committed continuation through the last proposal."""
        if self._last is None:
            return
        start, prefixes, keys = self._last
        self._last = None
        if not prefixes:
            return
        continuation = tuple(committed[start:])
        for prefix, key in zip(prefixes, keys):
            parent_reached = continuation[: len(prefix) - 1] == prefix[:-1]
            if parent_reached and len(continuation) >= len(prefix):
                self.rates.observe(key, continuation[: len(prefix)] == prefix)
