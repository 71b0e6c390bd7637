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

from harness.contracts import Capabilities, Selection
from harness.random_source import RandomSource
from harness.topology.compiler import CompiledTree


class NegotiationError(ValueError):
    """Proposer/topology/verifier/temperature combination refused before model work."""


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


VERIFIERS: dict[str, type[Verifier]] = {}


def register(cls: type[Verifier]) -> type[Verifier]:
    if cls.name in VERIFIERS and VERIFIERS[cls.name] is not cls:
        raise ValueError(f"verifier {cls.name!r} registered twice")
    VERIFIERS[cls.name] = cls
    return cls


def get_verifier(name: str) -> Verifier:

    if name not in VERIFIERS:
        raise NegotiationError(f"unknown verifier {name!r}; registered: {sorted(VERIFIERS)}")
    return VERIFIERS[name]()


def negotiate(proposer: Capabilities, verifier: Verifier, *, temperature: float, exact_mode: bool = True) -> None:
    """Refuse an incompatible proposer x topology x verifier x temperature combination."""
    v = verifier
    if exact_mode and not v.exact:
        raise NegotiationError(
            f"verifier {v.name!r} is heuristic (not exact); exact mode refuses it. "
            "Set generation.exact=false to run it explicitly; its records then say exact: false."
        )
    if v.temperatures == "zero" and temperature != 0.0:
        raise NegotiationError(
            f"verifier {v.name!r} supports temperature 0 only; got generation.temperature={temperature}. "
            "Use verifier=membership (or a p/q verifier with a proposer that provides q) for sampling."
        )
    if v.temperatures == "positive" and temperature == 0.0:
        raise NegotiationError(f"verifier {v.name!r} needs temperature > 0; got 0 (use verifier=greedy)")
    bad_sem = proposer.probability_semantics - v.probability_semantics
    if bad_sem:
        raise NegotiationError(
            f"proposer {proposer.name!r} provides probability semantics {sorted(bad_sem)}, but verifier "
            f"{v.name!r} requires one of {sorted(v.probability_semantics)}: a score or frequency cannot "
            "stand in for q. Use verifier=membership or verifier=greedy."
        )
    bad_rel = proposer.sampling_relations - v.sampling_relations
    if bad_rel:
        raise NegotiationError(
            f"proposer {proposer.name!r} samples with relation {sorted(bad_rel)}, but verifier {v.name!r} "
            f"is proved for {sorted(v.sampling_relations)} only (a sampling law change needs its own "
            "verifier)"
        )
    if proposer.topology not in v.topologies:
        raise NegotiationError(
            f"topology {proposer.topology!r} from proposer {proposer.name!r} is not supported by verifier "
            f"{v.name!r} (supports {sorted(v.topologies)})"
        )


def walk_children(tree: CompiledTree, node: int, token: int) -> int | None:
    """The child row of ``node`` (``-1``: frontier) carrying ``token``, or None."""
    for child in tree.children(node):
        if int(tree.token_ids[child]) == token:
            return child
    return None
