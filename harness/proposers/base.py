"""Proposer interface: every draft source returns the common typed proposal result.

A proposer owns its provisional state (draft KV, retrieval cursor, head state) and returns typed
evidence for one round. It never publishes output and its state is never target state.

Lifecycle per request: ``start(prompt_ids)`` -> repeated ``propose(committed)`` /
(``observe_verify(rows, ms)`` when verified alone) / ``observe_commit(committed)`` -> ``finish()``.
``committed`` is every committed token id of the request so far, the pending bonus/correction token
last (the target has not yet computed its KV).
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import ClassVar

from harness.contracts import NO_STATE, Budget, Capabilities, ProposalResult, ProposalStateHandle, budget_topology
from harness.random_source import RandomSource


@dataclass
class ProposerStats:
    """Proposal-side counters a proposer reports into the record."""

    proposal_state_bytes: int = 0
    retrieval_ms: float = 0.0
    extras: dict = field(default_factory=dict)


class Proposer(ABC):
    name: ClassVar[str]
    probability_semantics: ClassVar[str]
    #: relation by topology shape, e.g. {"sequence": "iid", "expansion": "iid"}
    sampling_relation: ClassVar[str]
    shapes: ClassVar[frozenset[str]]
    #: the largest generation.batch_size this proposer serves (None: any); plan() refuses beyond it
    max_batch_size: ClassVar[int | None] = None
    batch_limit_reason: ClassVar[str] = ""
    #: a :class:`~harness.proposers.memo.FixedPrefixMemo` while the statistical gate proposes at
    #: one prefix; None (always, in a run): network calls run directly
    law_memo = None
    #: a :class:`~harness.proposers.memo.LawTable` while the statistical gate proposes in passes at
    #: one prefix (proposers that can compute many candidate prefixes' laws in one forward); None
    #: in a run
    law_table = None

    def __init__(self, *, budget: Budget, manifest_hash: str, policy=None) -> None:
        if budget.shape not in self.shapes:
            raise ValueError(
                f"proposer {self.name!r} cannot build topology {budget.shape!r}; it supports {sorted(self.shapes)}"
            )
        self.budget = budget
        self.manifest_hash = manifest_hash
        self.policy = policy
        self.stats = ProposerStats()

    @classmethod
    def declare(cls, options: dict, budget: Budget) -> Capabilities:
        """Capabilities known from config alone (negotiation runs before any model work).
        Subclasses whose semantics depend on options (e.g. ``sampling``) override this."""
        if budget.shape not in cls.shapes:
            raise ValueError(
                f"proposer {cls.name!r} cannot build topology {budget.shape!r}; it supports {sorted(cls.shapes)}"
            )
        return cls.capabilities_on(budget, {cls.probability_semantics}, {cls.sampling_relation})

    @classmethod
    def capabilities_on(cls, budget: Budget, semantics: Iterable[str], relations: Iterable[str]) -> Capabilities:
        """This proposer's capabilities on ``budget``'s topology with these probability semantics
        and sampling relations."""
        return Capabilities(
            name=cls.name,
            probability_semantics=frozenset(semantics),
            sampling_relations=frozenset(relations),
            topology=budget_topology(budget),
        )

    @classmethod
    def from_config(cls, *, options: dict, budget: Budget, manifest_hash: str, policy, context) -> Proposer:
        """Build from config options once models are loaded (``context``: engine.build.BuildContext)."""
        return cls(budget=budget, manifest_hash=manifest_hash, policy=policy, **options)

    @classmethod
    def batch_limit(cls, options: dict, budget: Budget) -> tuple[int | None, str]:
        """The largest ``generation.batch_size`` this proposer serves with these options (None: any),
        and why (:attr:`max_batch_size`, :attr:`batch_limit_reason`)."""
        return cls.max_batch_size, cls.batch_limit_reason

    def devices(self) -> set:
        """The accelerator or CPU devices this proposer's own work runs on (``torch.device``s): a
        caller timing it alone waits for their queued kernels first (none: its work is done when its
        calls return)."""
        return set()

    def capabilities(self) -> Capabilities:
        return self.capabilities_on(self.budget, {self.probability_semantics}, {self.sampling_relation})

    #: the deepest proposal the coming round can still commit, set by the round loop before
    #: :meth:`propose` when the request has fewer tokens left than the budget's depth (None: the
    #: budget's depth). The loop compiles the tree to this depth; a proposer may draft only that deep.
    depth_cap: int | None = None

    def round_max_depth(self) -> int:
        """The depth the coming round's tree is compiled to: the budget's, or :attr:`depth_cap`."""
        return self.budget.max_depth if self.depth_cap is None else min(self.budget.max_depth, self.depth_cap)

    def empty_proposal(self, handle: ProposalStateHandle = NO_STATE) -> ProposalResult:
        """A round with no candidate, in this proposer's probability semantics and sampling relation:
        the target's own token only (one token left in the request, a missing hidden row, ...)."""
        return ProposalResult.empty_result(
            source=self.name,
            manifest_hash=self.manifest_hash,
            probability_semantics=self.probability_semantics,
            sampling_relation=self.sampling_relation,
            state_handle=handle,
        )

    def check_workload(self, items: list, *, allow_leakage: bool = False) -> dict | None:
        """Proposal-quality governance for the evaluation workload (e.g. datastore leakage).
        Returns a gate entry (``{"status": ...}``, see :mod:`harness.gates.status`) or None when it
        does not apply; raises on a refused workload."""
        return None

    def start(self, prompt_ids: list[int]) -> None:
        """A new request begins (prompt ids, last token pending)."""

    @abstractmethod
    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult: ...

    def observe_commit(self, committed: list[int]) -> None:
        """The target committed; roll provisional state back to ``committed`` (pending last)."""

    def observe_verify(self, rows: int, ms: float) -> None:
        """The target's verify forward of this request's last proposal took ``ms`` for ``rows`` rows
        per request (the pending row included); called only when the batch was full (the run's batch
        size of requests shared the forward: at batch 1, the request alone), before
        :meth:`observe_commit` (or :meth:`finish`, after its last round)."""

    def finish(self) -> None:
        """Release per-request state."""

    def target_unhooked(self) -> AbstractContextManager[None]:
        """A context in which the target runs without whatever this proposer hooked onto it (the
        autoregressive arm decodes in it: a hooked model can leave its fast paths). Nothing by default."""
        return contextlib.nullcontext()

    def join(self, first: Proposer) -> None:
        """Share what this proposer keeps across requests with ``first``, another batch slot's
        proposer of the same configuration: a memory of earlier requests is the job's, not one
        slot's. Nothing by default."""

    def forget_requests(self) -> None:
        """Drop what this proposer remembers of the requests it served (after the warm-up, whose
        outputs are no part of the measured workload). Nothing by default."""

    #: the attributes holding what this proposer learns from the rounds it serves and keeps across
    #: requests (an adaptive budget's cost and acceptance models, an adaptive draft threshold)
    LEARNING: ClassVar[tuple[str, ...]] = ()

    def snapshot_learning(self) -> dict:
        """A copy of what this proposer has learned (:attr:`LEARNING`), for :meth:`restore_learning`:
        the warm-up's rounds are no part of the measured workload, and a measured request must not
        start from what the warm-up learned on its own first tokens."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self.LEARNING}

    def restore_learning(self, snapshot: dict) -> None:
        """Put back what :meth:`snapshot_learning` copied."""
        for name, value in snapshot.items():
            setattr(self, name, copy.deepcopy(value))

    def state_bytes(self) -> int:
        return 0

    def counters(self) -> dict:
        """The ``stats.extras`` counters as they start (a fresh dict each call): what
        :meth:`reset_counters` restores. Learned state, settings and an index's figures are no
        counters and are not listed."""
        return {}

    def reset_counters(self) -> None:
        """Restart the counters (:meth:`counters`, ``stats.retrieval_ms``): after the warm-up and a
        gate's rounds, so the record's proposer figures count the measured rounds only."""
        self.stats.retrieval_ms = 0.0
        self.stats.extras.update(self.counters())


class NullProposer(Proposer):
    """Proposes nothing: the round degenerates to one autoregressive target step. The AR baseline
    runs through the same round code with this proposer."""

    name: ClassVar[str] = "none"
    probability_semantics: ClassVar[str] = "absent"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"sequence"})

    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        return ProposalResult.empty_result(source=self.name, manifest_hash=self.manifest_hash)
