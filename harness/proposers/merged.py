"""``proposer=merged``: several proposers in one round, merged into one tree by full prefix (equal
tokens under different parents stay separate rows).

Config shape (conf/proposer/merged.yaml, schema ``MergedConfig``)::

    harness run proposer=merged topology=merged proposer.sources=[rest,prompt_lookup]

``proposer.sources`` lists the sources; each one's options are the sub-config of the same name
(``proposer.rest.*``, ``proposer.prompt_lookup.*``). The topology gives the round's budget
(``max_nodes`` candidate rows, ``max_depth``); the result is always a tree, so ``topology=merged``
(or ``sequences``) is expected.

Per round (:meth:`MergedProposer.propose`):

1. every source proposes with the round's full budget, in its tree-capable shape (``tree``, else
   ``sequences``, else ``sequence``). A source that prices its rows by the verify cost (prompt
   lookup's adaptive budget, ``prices_rows``) proposes after the others, being told the rows they
   offer that the merge keeps (``rows_before``, by token path, for that proposal only): the forward
   carries those rows too, so the lookup prices its own as ``t(1 + m + k)`` and a row another
   source already proposed as free. Such a source draws nothing from the round's random source,
   so the other sources draw what they drew in list order;
2. their nodes are interleaved round-robin (node ``i`` of source 0, node ``i`` of source 1, ...),
   which keeps each source's own order (parents before children) and shares the budget evenly;
3. nodes are keyed by their full token prefix (SpecInfer's merge): a new prefix becomes a new row
   while fewer than ``max_nodes`` rows exist and its depth is within the round's (``max_depth``, or
   the round loop's ``depth_cap`` in a request's last rounds, passed to every source), and a prefix
   another source already proposed is kept as a second node under the same parent, which
   :func:`~harness.topology.compiler.compile_tree` folds into the existing row while recording
   both sources (``CompiledTree.sources``). Equal tokens under different parents have different
   prefixes and stay distinct rows. A node whose parent was dropped is dropped.

The result is one :class:`~harness.contracts.ProposalResult` whose nodes keep their source's
``source`` id, so ``decode()`` attributes each accepted token to every source that proposed its
row (``metrics.accepted_by_source``).

Semantics. One result carries one ``probability_semantics``: the sources' common one when they
agree and it carries no ``q``, otherwise ``score_only`` (a merged tree has no single proposal law;
a source's ``q`` becomes the node's ranking ``score`` and ``q_dists`` are dropped). Negotiation sees
the union of the sources' semantics and relations (plus ``score_only`` when it is emitted), so
only a verifier that supports all of them (greedy, membership) passes; p/q verifiers are refused
before any model work. The result's ``sampling_relation`` is the sources' common one, else the
first non-empty source's (per-source laws are in ``extras["sources"]``).

Timing. The sources' own retrieval time (``stats.retrieval_ms``) is summed into this proposer's,
so ``decode()`` reports it as the round's retrieval stage; the rest of their proposal time stays
in the proposal stage. ``stats.extras`` (the record's ``metrics.retrieval``) holds each source's
live counters under ``sources`` and per-source proposal time and node counts under ``per_source``.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Sequence
from typing import ClassVar

from harness.contracts import (
    PREFIX_FRONTIER,
    Budget,
    Capabilities,
    ProposalNode,
    ProposalResult,
    ProposalStateHandle,
)
from harness.measure.ledger import device_synchronizer
from harness.proposers.base import Proposer
from harness.proposers.registry import PROPOSERS, proposer_class
from harness.random_source import RandomSource

#: a source's preferred budget shape, first match in its ``shapes``
_SUB_SHAPES = ("tree", "sequences", "sequence")


def sub_budget(cls: type[Proposer], budget: Budget, max_depth: int | None = None) -> Budget:
    """The budget a source proposes with: the round's node/depth budget in its tree-capable shape.

    ``max_depth`` (``proposer.depths[<source>]``) caps the source's depth below the round's.
    """
    depth = budget.max_depth if max_depth is None else min(int(max_depth), budget.max_depth)
    if depth < 1:
        raise ValueError(f"proposer.depths[{cls.name!r}] must be >= 1; got {max_depth}")
    for shape in _SUB_SHAPES:
        if shape in cls.shapes:
            return Budget(shape=shape, max_nodes=budget.max_nodes, max_depth=depth)
    raise ValueError(
        f"proposer {cls.name!r} cannot be a merged source: it builds {sorted(cls.shapes)}, none of {list(_SUB_SHAPES)}"
    )


def merged_semantics(semantics: frozenset[str]) -> str:
    """What one merged result declares: the common semantics when it carries no q, else score_only."""
    if len(semantics) == 1 and "normalized_conditional" not in semantics:
        return next(iter(semantics))
    return "score_only"


def merge_proposals(
    proposals: Sequence[ProposalResult], *, max_nodes: int, max_depth: int, default_sources: Sequence[str] | None = None
) -> tuple[list[ProposalNode], list[dict]]:
    """Interleave and merge proposals by full prefix (module docstring, steps 2-3).

    ``max_depth`` 0 (a round that commits the target's own token only) keeps no node.

    Returns ``(nodes, per_source)``: the merged nodes (parents precede children, a node's parent
    is the first node with its parent prefix) and, per proposal, ``offered`` (its nodes),
    ``new_rows`` (prefixes it added) and ``shared`` (nodes whose prefix already existed).
    """
    if max_nodes < 1 or max_depth < 0:
        raise ValueError(f"need max_nodes >= 1 and max_depth >= 0; got {max_nodes}, {max_depth}")
    names = list(default_sources) if default_sources is not None else [p.source for p in proposals]
    prefixes: list[list[tuple[int, ...] | None]] = [[] for _ in proposals]  # per proposal node
    first: dict[tuple[int, ...], int] = {}  # prefix -> first merged node with it
    out: list[ProposalNode] = []
    stats = [{"offered": len(p.nodes), "new_rows": 0, "shared": 0} for p in proposals]
    longest = max((len(p.nodes) for p in proposals), default=0)
    for i in range(longest):
        for k, proposal in enumerate(proposals):
            if i >= len(proposal.nodes):
                continue
            node = proposal.nodes[i]
            if node.parent == PREFIX_FRONTIER:
                parent_prefix: tuple[int, ...] | None = ()
            else:
                parent_prefix = prefixes[k][node.parent]
            if parent_prefix is None or len(parent_prefix) + 1 > max_depth:
                prefixes[k].append(None)
                continue
            prefix = parent_prefix + (node.token_id,)
            if prefix in first:
                stats[k]["shared"] += 1
            elif len(first) >= max_nodes:
                prefixes[k].append(None)
                continue
            else:
                first[prefix] = len(out)
                stats[k]["new_rows"] += 1
            score = node.score if node.score is not None else node.q
            source = node.source if node.source != "unknown" else names[k]
            parent = PREFIX_FRONTIER if not parent_prefix else first[parent_prefix]
            out.append(ProposalNode(token_id=node.token_id, parent=parent, score=score, source=source))
            prefixes[k].append(prefix)
    return out, stats


class MergedProposer(Proposer):
    """Composes source proposers into one merged tree per round."""

    name: ClassVar[str] = "merged"
    probability_semantics: ClassVar[str] = "score_only"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"merged", "sequences", "tree"})

    def __init__(
        self,
        *,
        budget: Budget,
        manifest_hash: str,
        sources: Sequence[Proposer],
        source_caps: Sequence[Capabilities] | None = None,
        policy=None,
    ) -> None:
        super().__init__(budget=budget, manifest_hash=manifest_hash, policy=policy)
        if not sources:
            raise ValueError("proposer=merged needs at least one source (proposer.sources)")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"proposer.sources must not repeat a proposer; got {names}")
        self.sources = list(sources)
        caps = list(source_caps) if source_caps is not None else [s.capabilities() for s in sources]
        if len(caps) != len(self.sources):
            raise ValueError(f"source_caps has {len(caps)} entries for {len(self.sources)} sources")
        self.source_caps = caps
        self._syncs: list | None = None  # the sources' devices' synchronizers, found on the first proposal
        self.semantics = merged_semantics(frozenset().union(*(c.probability_semantics for c in caps)))
        hashes = sorted({s.manifest_hash for s in sources} - {manifest_hash})
        if hashes:  # a source folded its own release (e.g. a datastore) into its hash
            self.manifest_hash = hashlib.sha256(":".join([manifest_hash, *hashes]).encode()).hexdigest()[:16]
        self.stats.extras.update(
            {
                "sources": {s.name: s.stats.extras for s in self.sources},  # live: read at record time
                "per_source": {
                    s.name: {"proposal_ms": 0.0, "offered": 0, "new_rows": 0, "shared": 0} for s in self.sources
                },
                "rounds": 0,
                "manifest_hash": self.manifest_hash,
            }
        )

    def counters(self) -> dict:
        return {
            "rounds": 0,
            "per_source": {
                s.name: {"proposal_ms": 0.0, "offered": 0, "new_rows": 0, "shared": 0} for s in self.sources
            },
        }

    def reset_counters(self) -> None:
        """Its own counters and every source's."""
        super().reset_counters()
        for s in self.sources:
            s.reset_counters()

    # ------------------------------------------------------------------ negotiation and wiring

    @classmethod
    def _source_entries(cls, options: dict, budget: Budget) -> list[tuple[str, type[Proposer], dict, Budget]]:

        sources = list(options.get("sources") or [])
        if not sources:
            raise ValueError("proposer=merged needs proposer.sources, e.g. [rest,prompt_lookup]")
        if len(set(sources)) != len(sources):
            raise ValueError(f"proposer.sources must not repeat a proposer; got {sources}")
        depths = dict(options.get("depths") or {})  # caps for sources not in use are simply unused
        unknown = sorted(set(depths) - set(PROPOSERS))
        if unknown:
            raise ValueError(f"proposer.depths names {unknown}, which are not proposers (one of {sorted(PROPOSERS)})")
        out = []
        for name in sources:
            if name == cls.name:
                raise ValueError("proposer.sources cannot contain 'merged' itself")
            sub = options.get(name)
            if not isinstance(sub, dict):
                configured = sorted(k for k, v in options.items() if isinstance(v, dict))
                raise ValueError(
                    f"proposer.sources names {name!r}, but proposer.{name} is not configured "
                    f"(merged sub-configs: {configured})"
                )
            sub = dict(sub)
            sub.pop("name", None)
            sub_cls = proposer_class(name)
            out.append((name, sub_cls, sub, sub_budget(sub_cls, budget, depths.get(name))))
        return out

    @classmethod
    def batch_limit(cls, options: dict, budget: Budget) -> tuple[int | None, str]:
        """The smallest of the sources' limits: every source serves every request of the batch."""
        limits = [
            (*sub_cls.batch_limit(sub, b), name) for name, sub_cls, sub, b in cls._source_entries(options, budget)
        ]
        bounded = [entry for entry in limits if entry[0] is not None]
        if not bounded:
            return None, ""
        limit, why, name = min(bounded, key=lambda entry: entry[0])
        return limit, f"its source {name}: {why}"

    @classmethod
    def declare(cls, options: dict, budget: Budget) -> Capabilities:
        """The union of the sources' semantics and relations (plus what the merge emits)."""
        if budget.shape not in cls.shapes:
            raise ValueError(
                f"proposer='merged' builds a tree: use topology=merged (or sequences); got topology {budget.shape!r}"
            )
        caps = [sub_cls.declare(sub, b) for _, sub_cls, sub, b in cls._source_entries(options, budget)]
        semantics = frozenset().union(*(c.probability_semantics for c in caps))
        relations = frozenset().union(*(c.sampling_relations for c in caps))
        return cls.capabilities_on(budget, semantics | {merged_semantics(semantics)}, relations)

    @classmethod
    def from_config(cls, *, options: dict, budget: Budget, manifest_hash: str, policy, context) -> MergedProposer:
        subs, caps = [], []
        for _, sub_cls, sub, b in cls._source_entries(options, budget):
            caps.append(sub_cls.declare(sub, b))
            subs.append(
                sub_cls.from_config(options=sub, budget=b, manifest_hash=manifest_hash, policy=policy, context=context)
            )
        return cls(budget=budget, manifest_hash=manifest_hash, sources=subs, source_caps=caps, policy=policy)

    def capabilities(self) -> Capabilities:
        semantics = frozenset().union(*(c.probability_semantics for c in self.source_caps))
        relations = frozenset().union(*(c.sampling_relations for c in self.source_caps))
        return self.capabilities_on(self.budget, semantics | {self.semantics}, relations)

    def check_workload(self, items: list, *, allow_leakage: bool = False) -> dict | None:
        entries = {}
        for s in self.sources:
            entry = s.check_workload(items, allow_leakage=allow_leakage)
            if entry is not None:
                entries[s.name] = entry
        Proposer.reset_counters(self)  # its own only: each source restarted its own above
        if not entries:
            return None
        statuses = {e["status"] for e in entries.values()}
        # a source with nothing to check (a published draft) is not a pass: the merged entry says so
        # only when no source checked anything
        checked = statuses - {"not_applicable"} or {"not_applicable"}
        worst = next(s for s in ("failed", "skipped", "passed", "not_applicable") if s in checked)
        override = {"override": "allow_leakage=true"} if worst == "skipped" else {}
        return {"status": worst, **override, "kind": "merged_sources", "sources": entries}

    # ------------------------------------------------------------------ lifecycle

    def join(self, first: Proposer) -> None:
        for mine, theirs in zip(self.sources, getattr(first, "sources", ()), strict=False):
            mine.join(theirs)

    def forget_requests(self) -> None:
        for s in self.sources:
            s.forget_requests()

    def snapshot_learning(self) -> dict:
        return {"sources": [s.snapshot_learning() for s in self.sources]}

    def restore_learning(self, snapshot: dict) -> None:
        for s, learned in zip(self.sources, snapshot["sources"], strict=True):
            s.restore_learning(learned)

    def start(self, prompt_ids: list[int]) -> None:
        for s in self.sources:
            s.start(prompt_ids)

    def observe_commit(self, committed: list[int]) -> None:
        for s in self.sources:
            s.observe_commit(committed)

    def finish(self) -> None:
        for s in self.sources:
            s.finish()

    @contextlib.contextmanager
    def target_unhooked(self):
        """The target without any source's hooks."""
        with contextlib.ExitStack() as unhooked:
            for s in self.sources:
                unhooked.enter_context(s.target_unhooked())
            yield

    def observe_verify(self, rows: int, ms: float) -> None:
        """Every source learns the round's verify time: what a forward of ``rows`` rows cost, whichever
        sources made them (prompt lookup's adaptive budget prices its rows with it)."""
        for s in self.sources:
            s.observe_verify(rows, ms)

    def state_bytes(self) -> int:
        return sum(s.state_bytes() for s in self.sources)

    def devices(self) -> set:
        return set().union(*(s.devices() for s in self.sources))

    def _now(self) -> float:
        """The clock of each source's share of the proposal, read once the sources' devices have run
        what was queued on them (a draft's kernels on a GPU are billed to the source that launched
        them, not to the next one that waits)."""
        if self._syncs is None:
            self._syncs = [f for f in map(device_synchronizer, sorted(self.devices(), key=str)) if f is not None]
        for sync in self._syncs:
            sync()
        return time.perf_counter()

    def _rows_before(self, proposals: list[ProposalResult]) -> frozenset[tuple[int, ...]]:
        """The distinct rows (token paths from the frontier) that ``proposals`` put in this round's
        merged tree: those the merge keeps within ``max_nodes`` and the round's depth."""
        if not proposals:
            return frozenset()
        nodes, _ = merge_proposals(proposals, max_nodes=self.budget.max_nodes, max_depth=self.round_max_depth())
        paths: list[tuple[int, ...]] = []
        for node in nodes:
            paths.append((() if node.parent == PREFIX_FRONTIER else paths[node.parent]) + (node.token_id,))
        return frozenset(paths)

    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        results: list[ProposalResult | None] = [None] * len(self.sources)
        retrieval = 0.0
        per = self.stats.extras["per_source"]
        pricing = [bool(getattr(s, "prices_rows", False)) for s in self.sources]
        # sources that price their rows propose last (they draw nothing from rng: the others draw as in list order)
        for i in [i for i, p in enumerate(pricing) if not p] + [i for i, p in enumerate(pricing) if p]:
            s = self.sources[i]
            before = s.stats.retrieval_ms
            t0 = self._now()
            s.depth_cap = self.depth_cap
            if pricing[i]:
                s.rows_before = self._rows_before([r for r in results if r is not None])
            try:
                results[i] = s.propose(committed, rng)
            finally:
                s.depth_cap = None
                if pricing[i]:
                    s.rows_before = frozenset()
            per[s.name]["proposal_ms"] += (self._now() - t0) * 1e3
            retrieval += s.stats.retrieval_ms - before
        nodes, counts = merge_proposals(
            results,
            max_nodes=self.budget.max_nodes,
            max_depth=self.round_max_depth(),  # the rows the round can commit share the node budget
            default_sources=[s.name for s in self.sources],
        )
        for s, c in zip(self.sources, counts):
            for key in ("offered", "new_rows", "shared"):
                per[s.name][key] += c[key]
        self.stats.extras["rounds"] += 1
        self.stats.retrieval_ms += retrieval
        self.stats.proposal_state_bytes = self.state_bytes()
        nonempty = [r for r in results if not r.empty]
        relations = {r.sampling_relation for r in nonempty}
        relation = (
            relations.pop()
            if len(relations) == 1
            else (nonempty[0].sampling_relation if nonempty else self.sampling_relation)
        )
        extras = {
            "retrieval_ms": retrieval,
            "sources": {
                s.name: {
                    "semantics": r.probability_semantics,
                    "relation": r.sampling_relation,
                    "nodes": len(r.nodes),
                    **c,
                }
                for s, r, c in zip(self.sources, results, counts)
            },
        }
        return ProposalResult(
            nodes=tuple(nodes),
            probability_semantics=self.semantics,  # type: ignore[arg-type]
            sampling_relation=relation,  # type: ignore[arg-type]
            topology="tree",
            manifest_hash=self.manifest_hash,
            source=self.name,
            state_handle=ProposalStateHandle(owner=self.name, committed_len=len(committed)),
            extras=extras,
        )
