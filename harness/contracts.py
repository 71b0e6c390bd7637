"""Typed contracts shared by every room of the harness: the common proposal-system interface.

A proposer returns a :class:`ProposalResult`: typed evidence, never output. Its five field
classes are the probability semantics, the sampling relation, the topology, the proposal-state
handle and the manifest hash. Nodes keep the proposal probability ``q`` and the ranking ``score``
in separate optional fields so that a score can never be cast into a ``q`` by accident.

Invalid values are rejected at construction (``__post_init__``), with the expected and the
actual value in the message.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

ProbabilitySemantics = Literal["normalized_conditional", "score_only", "frequency", "absent"]
SamplingRelation = Literal["iid", "without_replacement", "beam", "deterministic_lookup"]
ProposalTopology = Literal["sequence", "set", "tree", "metadata_graph"]

PROBABILITY_SEMANTICS: tuple[str, ...] = get_args(ProbabilitySemantics)
SAMPLING_RELATIONS: tuple[str, ...] = get_args(SamplingRelation)
PROPOSAL_TOPOLOGIES: tuple[str, ...] = get_args(ProposalTopology)

#: ``parent`` / ``predictor_row`` value meaning "the already processed prefix frontier".
PREFIX_FRONTIER = -1

#: absolute tolerance used when checking that a probability vector sums to one.
PROB_SUM_ATOL = 1e-5


class ContractError(ValueError):
    """A value violates a typed contract of the harness."""


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ContractError(f"{name} must be one of {list(allowed)}; got {value!r}")


def check_probability_vector(p: torch.Tensor, *, name: str = "probability vector") -> None:
    """Refuse anything that is not a finite, non-negative vector summing to one.

    Works on ``[V]`` or batched ``[..., V]`` tensors.
    """
    if not torch.is_floating_point(p):
        raise ContractError(f"{name} must be floating point; got dtype {p.dtype}")
    # one pass for the common case: a finite sum means every entry is finite, a non-negative
    # minimum means none is negative; anything else is diagnosed entry by entry below
    tol = PROB_SUM_ATOL * max(1.0, p.shape[-1] ** 0.5)
    if p.dim() == 1 and p.numel():
        total, low = float(p.sum()), float(p.amin())
        if math.isfinite(total) and low >= 0.0 and abs(total - 1.0) <= tol:
            return
    sums = p.sum(dim=-1)
    if p.numel() and bool(torch.isfinite(sums).all()) and bool((p.amin(dim=-1) >= 0).all()):
        if bool(((sums - 1.0).abs() <= tol).all()):
            return
    if not bool(torch.isfinite(p).all()):
        raise ContractError(f"{name} has non-finite entries")
    if bool((p < 0).any()):
        raise ContractError(f"{name} has negative entries (min {float(p.min())})")
    bad = (sums - 1.0).abs() > tol
    if bool(bad.any()):
        raise ContractError(f"{name} must sum to 1; got sums {sums[bad].tolist()[:4]}")


@dataclass(frozen=True)
class ProposalNode:
    """One proposed token.

    ``parent`` indexes an earlier node of the same :class:`ProposalResult` (``-1``: the node is a
    first-token candidate, scored by the prefix frontier). ``q`` is the probability of ``token_id``
    under the distribution it was actually drawn from (``ProposalResult.q_dists[i]``); ``score``
    is a ranking score or frequency with no probability meaning.
    """

    token_id: int
    parent: int = PREFIX_FRONTIER
    q: float | None = None
    score: float | None = None
    source: str = "unknown"

    def __post_init__(self) -> None:
        if not isinstance(self.token_id, int) or isinstance(self.token_id, bool) or self.token_id < 0:
            raise ContractError(f"token_id must be a non-negative int; got {self.token_id!r}")
        if not isinstance(self.parent, int) or self.parent < PREFIX_FRONTIER:
            raise ContractError(f"parent must be an int >= -1; got {self.parent!r}")
        if self.q is not None and not (math.isfinite(self.q) and 0.0 <= self.q <= 1.0):
            raise ContractError(f"q must be a probability in [0, 1]; got {self.q!r}")
        if self.score is not None and not math.isfinite(self.score):
            raise ContractError(f"score must be finite; got {self.score!r}")


@dataclass(frozen=True)
class ProposalStateHandle:
    """Who owns provisional proposal-side state and at which committed length it is valid.

    The handle is metadata: the engine uses it to check that proposal state is never published
    as target state (the self-draft state contract; only target-computed rows are committed).
    """

    owner: str
    committed_len: int = 0
    generation: int = 0
    kv_bytes: int = 0

    def __post_init__(self) -> None:
        if self.committed_len < 0 or self.generation < 0 or self.kv_bytes < 0:
            raise ContractError(f"state handle counters must be non-negative; got {self}")


NO_STATE = ProposalStateHandle(owner="none")


@dataclass(frozen=True)
class ProposalResult:
    """Typed evidence from one proposer for one round.

    ``q_dists[i]`` (``[N, V]``) is the full distribution node ``i`` was drawn from; it is
    required when ``probability_semantics == "normalized_conditional"`` and forbidden otherwise.
    Nodes are in topological order (a parent precedes its children). Duplicate draws under one
    parent are allowed (i.i.d. sampling); the topology compiler merges them into one row while
    keeping the draw multiset for the verifier.
    """

    nodes: tuple[ProposalNode, ...]
    probability_semantics: ProbabilitySemantics
    sampling_relation: SamplingRelation
    topology: ProposalTopology
    state_handle: ProposalStateHandle
    manifest_hash: str
    q_dists: torch.Tensor | None = None
    source: str = "unknown"
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("probability_semantics", self.probability_semantics, PROBABILITY_SEMANTICS)
        _check_choice("sampling_relation", self.sampling_relation, SAMPLING_RELATIONS)
        _check_choice("topology", self.topology, PROPOSAL_TOPOLOGIES)
        if not isinstance(self.manifest_hash, str) or not self.manifest_hash:
            raise ContractError(f"manifest_hash must be a non-empty string; got {self.manifest_hash!r}")
        if not isinstance(self.nodes, tuple):
            object.__setattr__(self, "nodes", tuple(self.nodes))
        for i, node in enumerate(self.nodes):
            if not isinstance(node, ProposalNode):
                raise ContractError(f"node {i} must be a ProposalNode; got {type(node).__name__}")
            if node.parent >= i:
                raise ContractError(f"node {i} has parent {node.parent}: parents must precede children")
        has_q = any(n.q is not None for n in self.nodes)
        if self.probability_semantics == "normalized_conditional":
            if self.nodes and self.q_dists is None:
                raise ContractError("normalized_conditional proposals must carry q_dists (the law sampled)")
            if self.q_dists is not None:
                if self.q_dists.dim() != 2 or self.q_dists.shape[0] != len(self.nodes):
                    raise ContractError(
                        f"q_dists must have shape [N={len(self.nodes)}, V]; got {tuple(self.q_dists.shape)}"
                    )
                check_probability_vector(self.q_dists, name="q_dists")
                for i, node in enumerate(self.nodes):
                    qd = float(self.q_dists[i, node.token_id])
                    if node.q is None or abs(node.q - qd) > 1e-6:
                        raise ContractError(
                            f"node {i}: q={node.q!r} disagrees with q_dists[{i}, {node.token_id}]={qd!r}"
                        )
                    if qd <= 0.0:
                        raise ContractError(
                            f"node {i}: token {node.token_id} has zero mass in the law it was drawn from"
                        )
        else:
            if has_q or self.q_dists is not None:
                raise ContractError(
                    f"probability_semantics={self.probability_semantics!r} carries no q; "
                    "a score or frequency must go in `score`, never in `q`"
                )
        if self.topology == "sequence":
            for i, node in enumerate(self.nodes):
                if node.parent != i - 1:
                    raise ContractError(f"topology='sequence' requires a chain; node {i} has parent {node.parent}")
        if self.topology == "set":
            if any(n.parent != PREFIX_FRONTIER for n in self.nodes):
                raise ContractError("topology='set' requires every node at the first position (parent -1)")

    @property
    def empty(self) -> bool:
        return len(self.nodes) == 0

    @classmethod
    def from_paths(
        cls,
        paths,
        *,
        source: str = "paths",
        manifest_hash: str = "paths",
        probability_semantics: ProbabilitySemantics = "score_only",
        sampling_relation: SamplingRelation = "deterministic_lookup",
    ) -> ProposalResult:
        """Deterministic score-only evidence from token paths, merged by full prefix (for gates,
        tests and timing trees). Nodes come in first-insertion order."""
        nodes: list[ProposalNode] = []
        index: dict[tuple[int, ...], int] = {}
        for path in paths:
            parent, prefix = PREFIX_FRONTIER, ()
            for tok in path:
                prefix += (int(tok),)
                if prefix not in index:
                    index[prefix] = len(nodes)
                    nodes.append(ProposalNode(token_id=int(tok), parent=parent, score=1.0, source=source))
                parent = index[prefix]
        chain = all(n.parent == i - 1 for i, n in enumerate(nodes))
        return cls(
            nodes=tuple(nodes),
            probability_semantics=probability_semantics,
            sampling_relation=sampling_relation,
            topology="sequence" if chain else "tree",
            state_handle=NO_STATE,
            manifest_hash=manifest_hash,
            source=source,
        )

    @classmethod
    def empty_result(
        cls,
        *,
        source: str,
        manifest_hash: str,
        probability_semantics: ProbabilitySemantics = "absent",
        sampling_relation: SamplingRelation = "deterministic_lookup",
        state_handle: ProposalStateHandle = NO_STATE,
    ) -> ProposalResult:
        return cls(
            nodes=(),
            probability_semantics=probability_semantics,
            sampling_relation=sampling_relation,
            topology="sequence",
            state_handle=state_handle,
            manifest_hash=manifest_hash,
            source=source,
        )


@dataclass(frozen=True)
class Selection:
    """What a verifier selected in one round.

    ``accepted_rows``: candidate rows on one root-to-node path, root first (may be empty).
    ``next_token``: the bonus token (all of the path accepted and sampled below its last node) or
    the correction token; it is emitted and becomes the pending token of the next round (its KV is
    computed by the next verify forward: the pending-token commit).
    """

    accepted_rows: tuple[int, ...]
    next_token: int

    def __post_init__(self) -> None:
        if self.next_token < 0:
            raise ContractError(f"next_token must be a token id; got {self.next_token}")


# --------------------------------------------------------------------------- config-time contracts


def format_override(key: str, value: Any) -> str:
    """``key=value`` as a Hydra override (lists in brackets, None as null, booleans lower case)."""
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, (list, tuple)):
        return f"{key}=[{','.join(str(v) for v in value)}]"
    return f"{key}={value}"


class ConfigError(ValueError):
    """A configuration refused before model work.

    ``suggestions`` are candidate fixes of this refusal, each a tuple of Hydra overrides replacing
    the user's overrides of the same keys. A candidate fixes this one problem and may leave
    another, so the message carries none until they are ``offered``: the command layer
    (:func:`harness.config.offer`) composes and plans each, keeps those the runner accepts (extending
    a candidate by the suggestions of the refusal it meets next) and raises an offered copy, whose
    message ends with them. ``replaces``: the user's override the fixes stand in for (a mistyped
    key), when they do not simply override the same keys.
    """

    def __init__(
        self,
        message: str,
        *,
        suggestions: Sequence[Sequence[str]] = (),
        offered: bool = False,
        replaces: str | None = None,
    ) -> None:
        self.reason = message
        self.suggestions: tuple[tuple[str, ...], ...] = tuple(tuple(s) for s in suggestions if s)
        self.offered = offered
        self.replaces = replaces
        if offered and self.suggestions:
            message = f"{message}; try " + " or ".join(" ".join(s) for s in self.suggestions)
        super().__init__(message)


@dataclass(frozen=True)
class Range:
    """The valid values of a config option, declared beside it in its schema (``field`` metadata)
    and checked before any model work. ``None`` passes (an Optional option left unset); a float
    must be finite. ``each``: the bounds apply to every item of a list or value of a dict, nested
    lists walked (``choices=[[0], [0, 1]]``)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    each: bool = False

    def admits(self, value: Any) -> bool:
        if value is None:
            return True
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self) -> str:
        if self.choices:
            return f"one of {list(self.choices)}"
        lo = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        hi = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f">= {lo[1:]}" if lo[0] == "[" else f"> {lo[1:]}"
        if hi:
            return f"<= {hi[:-1]}" if hi[-1] == "]" else f"< {hi[:-1]}"
        return "any finite number"

    def check(self, key: str, value: Any) -> None:
        """Raise :class:`ConfigError` naming the key, the value and the range unless admitted."""
        if self.each:
            for k, v in _leaves(value):
                if not self.admits(v):
                    raise ConfigError(
                        f"{format_override(key, value)}: {key}{k}={v} is out of range; each must be {self.describe()}"
                    )
            return
        if not self.admits(value):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{format_override(key, value)} is not a finite number: it must be {self.describe()}")
            raise ConfigError(f"{format_override(key, value)} is out of range: it must be {self.describe()}")


def _leaves(value: Any, at: str = "") -> list[tuple[str, Any]]:
    """``("[i][j]", item)`` for every item of a list or dict, nested lists and dicts walked."""
    if isinstance(value, Mapping):
        pairs: Any = value.items()
    elif isinstance(value, Sequence) and not isinstance(value, str):
        pairs = enumerate(value)
    else:
        return [(at, value)]
    return [leaf for k, v in pairs for leaf in _leaves(v, f"{at}[{k}]")]


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Budget:
    """Topology parameters a proposer shapes its candidates to (candidate rows, root excluded)."""

    shape: (
        str  # sequence | sequences | set | expansion | cartesian | tree (a parent array) | choices | merged | dynamic
    )
    max_nodes: int
    max_depth: int
    widths: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()  # explicit tree shape (e.g. a Sequoia tree), -1 = frontier
    #: shape="choices": each node's child rank below its parent (same length as ``parents``)
    ranks: tuple[int, ...] = ()
    topk: int = 0  # shape "dynamic": children per expanded node and frontier nodes per depth (0: unused)

    def __post_init__(self) -> None:
        if self.max_nodes < 1 or self.max_depth < 1:
            raise ValueError(f"max_nodes and max_depth must be >= 1; got {self.max_nodes}, {self.max_depth}")
        if any(w < 1 for w in self.widths):
            raise ValueError(f"widths must be >= 1; got {list(self.widths)}")
        if self.ranks and len(self.ranks) != len(self.parents):
            raise ValueError(
                f"ranks ({len(self.ranks)}) and parents ({len(self.parents)}) must have one entry per node"
            )
        if self.topk < 0 or (self.shape == "dynamic" and self.topk < 1):
            raise ValueError(f"topk must be >= 1 for a dynamic tree (>= 0 otherwise); got {self.topk}")


def budget_topology(budget: Budget) -> str:
    """The proposal topology (contract vocabulary) a budget shape produces."""
    if budget.shape == "sequence":
        return "sequence"
    if budget.shape == "set":
        return "set"
    return "tree"


@dataclass(frozen=True)
class Capabilities:
    """What a proposal source declares before any model work."""

    name: str
    probability_semantics: frozenset[str]
    sampling_relations: frozenset[str]
    topology: str  # "sequence" | "set" | "tree"


def resolve_ref(ref: str) -> Any:
    """The object a registry entry ``"module:attr"`` names (imported on use, so a registry names
    rooms without importing them)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
