"""Verifier interface, registry and capability negotiation (a proposal's probability semantics,
sampling relation and topology must be ones the verifier is proved for).

A verifier is a pure function of the compiled tree, the target distributions and an injected
:class:`~harness.random_source.RandomSource`. ``target_probs`` is ``[1 + N, V]``: row 0 is the
frontier distribution (the pending token's logits under the sampling policy), row ``1 + r`` the
distribution at candidate row ``r`` (predicting its children).

Each verifier declares what it supports; :func:`negotiate` refuses an incompatible combination
before any model work, naming both sides and the reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from harness.contracts import Capabilities, ConfigError, Selection
from harness.random_source import RandomSource
from harness.topology.compiler import CompiledTree
from harness.verifiers.sampling import SamplingPolicy


class NegotiationError(ConfigError):
    """Proposer/topology/verifier/temperature combination refused before model work (a proposer
    that cannot build the topology, a verifier that does not take the proposal); its suggestions
    are the topologies the proposer builds, or the registered verifiers that accept the same
    proposal at the same temperature."""


class Verifier(ABC):
    name: ClassVar[str]
    #: exact verifiers reproduce the target marginal and are covered by the oracles;
    #: heuristic ones are refused in exact mode.
    exact: ClassVar[bool] = True
    probability_semantics: ClassVar[frozenset[str]]
    sampling_relations: ClassVar[frozenset[str]]
    topologies: ClassVar[frozenset[str]] = frozenset({"sequence", "set", "tree"})
    #: "zero" (temperature 0 only), "positive" (> 0 only) or "any"
    temperatures: ClassVar[str] = "any"
    #: registered only for tests (a deliberately broken verifier); hidden from `harness oracles`
    test_only: ClassVar[bool] = False

    @abstractmethod
    def select(self, tree: CompiledTree, target_probs: torch.Tensor, rng: RandomSource) -> Selection: ...

    def select_logits(
        self, tree: CompiledTree, logits: torch.Tensor, policy: SamplingPolicy, rng: RandomSource
    ) -> Selection:
        """:meth:`select` on ``policy.probs(logits)`` (``logits`` ``[1 + N, V]``): what a round calls. A
        verifier may compute the same selection more directly from the logits (greedy reads only the
        argmax), and must then select exactly what :meth:`select` selects on the policy's law."""
        return self.select(tree, policy.probs(logits), rng)


VERIFIERS: dict[str, type[Verifier]] = {}


def register(cls: type[Verifier]) -> type[Verifier]:
    if cls.name in VERIFIERS and VERIFIERS[cls.name] is not cls:
        raise ValueError(f"verifier {cls.name!r} registered twice")
    VERIFIERS[cls.name] = cls
    return cls


def get_verifier(name: str) -> Verifier:

    if name not in VERIFIERS:
        offered = sorted(n for n, cls in VERIFIERS.items() if not cls.test_only)
        raise NegotiationError(f"unknown verifier {name!r}; registered: {offered}")
    return VERIFIERS[name]()


#: sampling relations a proposer's ``proposer.sampling`` option selects
RELATION_OPTIONS = ("iid", "without_replacement")


def negotiate(proposer: Capabilities, verifier: Verifier, *, temperature: float, exact_mode: bool = True) -> None:
    """Refuse an incompatible proposer x topology x verifier x temperature combination, naming both
    sides and suggesting the verifiers that accept it."""
    reason = refusal(proposer, verifier, temperature=temperature, exact_mode=exact_mode)
    if reason is None:
        return
    accepting = accepting_verifiers(proposer, temperature=temperature, exact_mode=exact_mode)
    suggestions = [(f"verifier={name}",) for name in accepting]
    if "score_only" in proposer.probability_semantics - verifier.probability_semantics and temperature > 0:
        # a draft that ranks its top-k (beam) records scores; drawing its children records their law q
        # (the command offers these only where the configured proposer takes the option)
        suggestions += [("proposer.sampling=iid",), ("proposer.sampling=without_replacement",)]
    # a verifier proved for another sampling relation the proposer can draw with: that relation keeps the
    # verifier asked for, so it comes first (the command offers it only where the proposer plans with it)
    if proposer.sampling_relations - verifier.sampling_relations and temperature > 0:  # the relation is refused
        relations = [(f"proposer.sampling={r}",) for r in sorted(verifier.sampling_relations) if r in RELATION_OPTIONS]
        suggestions = [*[r for r in relations if r not in suggestions], *suggestions]
    if (
        exact_mode
        and not verifier.exact
        and refusal(proposer, verifier, temperature=temperature, exact_mode=False) is None
    ):
        suggestions.insert(0, ("generation.exact=false",))
    if not suggestions:
        reason += f"; no registered verifier accepts proposer {proposer.name!r} at temperature {temperature}"
    raise NegotiationError(reason, suggestions=suggestions)


def accepting_verifiers(proposer: Capabilities, *, temperature: float, exact_mode: bool = True) -> list[str]:
    """Names of the registered verifiers (test-only ones aside) that accept ``proposer`` at ``temperature``."""
    return [
        name
        for name, cls in sorted(VERIFIERS.items())
        if not cls.test_only and refusal(proposer, cls(), temperature=temperature, exact_mode=exact_mode) is None
    ]


def refusal(proposer: Capabilities, verifier: Verifier, *, temperature: float, exact_mode: bool = True) -> str | None:
    """Why ``verifier`` cannot verify what ``proposer`` emits at ``temperature``; None when it can."""
    v = verifier
    if exact_mode and not v.exact:
        return (
            f"verifier {v.name!r} is heuristic (not exact); exact mode refuses it "
            "(generation.exact=false runs it explicitly; its records then say exact: false)"
        )
    if v.temperatures == "zero" and temperature != 0.0:
        return f"verifier {v.name!r} supports temperature 0 only; got generation.temperature={temperature}"
    if v.temperatures == "positive" and temperature == 0.0:
        return f"verifier {v.name!r} needs temperature > 0; got generation.temperature=0"
    bad_sem = proposer.probability_semantics - v.probability_semantics
    if bad_sem:
        return (
            f"proposer {proposer.name!r} provides probability semantics {sorted(bad_sem)}, but verifier "
            f"{v.name!r} requires one of {sorted(v.probability_semantics)}: a score or frequency cannot "
            "stand in for q"
        )
    bad_rel = proposer.sampling_relations - v.sampling_relations
    if bad_rel:
        return (
            f"proposer {proposer.name!r} samples with relation {sorted(bad_rel)}, but verifier {v.name!r} "
            f"is proved for {sorted(v.sampling_relations)} only (a sampling law change needs its own "
            "verifier)"
        )
    if proposer.topology not in v.topologies:
        return (
            f"topology {proposer.topology!r} from proposer {proposer.name!r} is not supported by verifier "
            f"{v.name!r} (supports {sorted(v.topologies)})"
        )
    return None


def walk_children(tree: CompiledTree, node: int, token: int) -> int | None:
    """The child row of ``node`` (``-1``: frontier) carrying ``token``, or None."""
    prefixes = tree.full_prefixes  # a row's last prefix token is its token (a tuple: no tensor reads)
    for child in tree.children(node):
        if prefixes[child][-1] == token:
            return child
    return None
