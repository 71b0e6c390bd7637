"""Exactness oracle: enumerate every random branch of the real code with its exact probability.

Verifiers and proposal sampling draw all their randomness through a
:class:`~harness.random_source.RandomSource` (``bernoulli``, ``categorical``). The oracle passes a
source that, instead of drawing, *chooses* a branch, multiplies the branch probability into the
leaf probability (float64) and records the alternatives. A depth-first search then re-runs the
same function from the start with the next untried branch (replay of the draw sequence), until
every branch with nonzero probability has been visited. Zero-probability branches are pruned, so
each leaf is a possible outcome and the leaf probabilities sum to one.

The result is the exact output marginal of the code the runs use, not of a re-implementation
(multiple drafts need their own exactness derivation, e.g. SpecInfer's residual update):
:func:`verifier_output_marginal` covers proposal sampling, the topology
compiler and ``Verifier.select`` and returns the law of the committed path (accepted tokens and
the bonus/correction token). :func:`complete_to_length` extends each committed path with the
target's own continuation so it can be compared with :func:`target_joint`, the target's exact
joint over the same number of tokens: a round is exact iff the two agree.

Cases (:func:`verifier_cases`) are generated from what each registered verifier declares, so a
new exact verifier is covered without new oracle code. Every case stays under ``max_leaves``
(asserted; default one million).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.contracts import NO_STATE, ProposalNode, ProposalResult
from harness.proposers.sampling import sample_tree_proposal
from harness.random_source import RandomSource, TorchRandomSource
from harness.topology.compiler import CompiledTree, compile_tree, validate_candidate_graph, validate_commit
from harness.verifiers.base import VERIFIERS, Verifier
from harness.verifiers.sampling import SamplingPolicy

#: the exactness bound on the absolute error of any marginal entry
MARGINAL_ATOL = 1e-9
#: default cap on enumerated leaves per case
MAX_LEAVES = 1_000_000

#: target conditional: prefix below the frontier -> target distribution ``[V]`` (float64)
TargetFn = Callable[[tuple[int, ...]], torch.Tensor]
#: proposal sampling through the injected source -> one or several proposals
ProposalBuilder = Callable[[RandomSource], "ProposalResult | Sequence[ProposalResult]"]


class OracleError(AssertionError):
    """The enumeration could not be carried out (leaf cap, non-replayable code, bad input)."""


# --------------------------------------------------------------------------- the enumerating source


class _ReplaySource:
    """Follows ``script`` (branch indices) for the first draws, then takes branch 0 and records."""

    def __init__(self, script: list[int], expected: list[tuple[float, ...]]) -> None:
        self.script = script
        self.expected = expected  # branch probabilities seen at each scripted position
        self.choices: list[int] = []
        self.options: list[tuple[float, ...]] = []
        self.prob = 1.0

    def _choose(self, probs: tuple[float, ...]) -> int:
        """Index into the nonzero branches ``probs``; multiplies the leaf probability."""
        pos = len(self.choices)
        if pos < len(self.script):
            if len(probs) != len(self.expected[pos]) or any(
                abs(a - b) > 1e-12 for a, b in zip(probs, self.expected[pos])
            ):
                raise OracleError(
                    f"draw {pos} changed on replay: expected branch probabilities {self.expected[pos]}, got "
                    f"{probs}; the code under enumeration uses randomness or state outside its RandomSource"
                )
            idx = self.script[pos]
        else:
            idx = 0
        self.choices.append(idx)
        self.options.append(probs)
        self.prob *= probs[idx]
        return idx

    def bernoulli(self, p: float) -> bool:
        p = float(p)
        if math.isnan(p):
            raise OracleError("bernoulli(nan): the acceptance ratio is not a number")
        p = min(1.0, max(0.0, p))
        if p >= 1.0:
            return True
        if p <= 0.0:
            return False
        return (True, False)[self._choose((p, 1.0 - p))]

    def categorical(self, probs: torch.Tensor) -> int:
        vals = probs.detach().to(device="cpu", dtype=torch.float64).reshape(-1).tolist()
        if any((not math.isfinite(v)) or v < 0.0 for v in vals):
            raise OracleError(f"categorical over a vector with negative or non-finite entries: {vals}")
        total = math.fsum(vals)
        if not total > 0.0:
            raise OracleError("categorical draw from a vector with no mass")
        support = [i for i, v in enumerate(vals) if v > 0.0]
        if len(support) == 1:
            return support[0]
        return support[self._choose(tuple(vals[i] / total for i in support))]


def enumerate_leaves(fn: Callable[[RandomSource], Any], *, max_leaves: int = MAX_LEAVES) -> Iterator[tuple[Any, float]]:
    """Yield ``(output, probability)`` for every branch of ``fn`` with nonzero probability.

    ``fn`` is re-run from the start for each leaf (DFS over its draw sequence), so it must be a
    deterministic function of its draws. Raises :class:`OracleError` past ``max_leaves``.
    """
    script: list[int] = []
    expected: list[tuple[float, ...]] = []
    leaves = 0
    while True:
        leaves += 1
        if leaves > max_leaves:
            raise OracleError(f"enumeration exceeds max_leaves={max_leaves}: shrink the case")
        src = _ReplaySource(script, expected)
        out = fn(src)
        yield out, src.prob
        # next leaf: advance the deepest draw that still has an untried branch
        j = len(src.choices) - 1
        while j >= 0 and src.choices[j] + 1 >= len(src.options[j]):
            j -= 1
        if j < 0:
            return
        script = src.choices[:j] + [src.choices[j] + 1]
        expected = src.options[: j + 1]


def enumerate_marginal(
    fn: Callable[[RandomSource], Hashable], *, max_leaves: int = MAX_LEAVES
) -> dict[Hashable, float]:
    """The exact law of ``fn(rng)`` over its outputs, by enumerating every branch."""
    out: dict[Hashable, float] = {}
    for value, prob in enumerate_leaves(fn, max_leaves=max_leaves):
        out[value] = out.get(value, 0.0) + prob
    total = math.fsum(out.values())
    if abs(total - 1.0) > 1e-9:
        raise OracleError(f"enumerated leaf probabilities sum to {total!r}, expected 1")
    return out


# --------------------------------------------------------------------------- rounds and targets


def _as_proposals(built: ProposalResult | Sequence[ProposalResult]) -> list[ProposalResult]:
    return [built] if isinstance(built, ProposalResult) else list(built)


def target_rows(tree: CompiledTree, target_fn: TargetFn) -> torch.Tensor:
    """``[1 + N, V]`` float64: row 0 the frontier law, row ``1 + r`` the law below row ``r``."""
    rows = [target_fn(())] + [target_fn(prefix) for prefix in tree.full_prefixes]
    return torch.stack([r.to(torch.float64) for r in rows])


def round_output(
    verifier: Verifier, tree: CompiledTree, target_probs: torch.Tensor, rng: RandomSource
) -> tuple[int, ...]:
    """One ``select`` call checked by ``validate_commit``; the committed tokens, bonus last."""
    sel = verifier.select(tree, target_probs, rng)
    validate_commit(tree, sel.accepted_rows)
    return tuple(int(tree.token_ids[r]) for r in sel.accepted_rows) + (int(sel.next_token),)


def verifier_output_marginal(
    verifier: Verifier,
    proposal_builder: ProposalBuilder,
    target_probs_fn: TargetFn,
    *,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    max_leaves: int = MAX_LEAVES,
    stats: dict | None = None,
) -> dict[tuple[int, ...], float]:
    """Exact law of the committed path of one round: proposal sampling + ``compile_tree`` +
    ``verifier.select``, every draw enumerated.

    The proposal draws come before the verifier's, so the search is nested: each proposal leaf
    is compiled once and its verifier branches are enumerated below it (the same DFS, with the
    compile shared by the leaves below one proposal). ``stats`` (if given) receives ``leaves``.
    """
    out: dict[tuple[int, ...], float] = {}
    leaves = 0
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def target_cached(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            cache[prefix] = target_probs_fn(prefix)
        return cache[prefix]

    def build(rng: RandomSource) -> CompiledTree:
        tree = compile_tree(_as_proposals(proposal_builder(rng)), 1, max_nodes=max_nodes, max_depth=max_depth)
        validate_candidate_graph(tree)
        return tree

    for tree, p_tree in enumerate_leaves(build, max_leaves=max_leaves):
        probs = target_rows(tree, target_cached)  # [1 + N, V]
        budget = max_leaves - leaves

        def select(rng: RandomSource, tree: CompiledTree = tree, probs: torch.Tensor = probs) -> tuple[int, ...]:
            return round_output(verifier, tree, probs, rng)

        for path, p_sel in enumerate_leaves(select, max_leaves=budget):
            leaves += 1
            out[path] = out.get(path, 0.0) + p_tree * p_sel
    if stats is not None:
        stats["leaves"] = leaves
    total = math.fsum(out.values())
    if abs(total - 1.0) > 1e-9:
        raise OracleError(f"output marginal sums to {total!r}, expected 1")
    return out


def complete_to_length(
    marginal: dict[tuple[int, ...], float], target_probs_fn: TargetFn, length: int
) -> dict[tuple[int, ...], float]:
    """Law of the first ``length`` tokens when each committed path is continued by the target.

    Decoding continues from the committed path with the target's own law, so the round is exact
    iff this equals :func:`target_joint` over ``length`` tokens. Longer paths are truncated.
    """
    out: dict[tuple[int, ...], float] = {}
    stack = [(path[:length], prob) for path, prob in marginal.items()]
    while stack:
        path, prob = stack.pop()
        if len(path) >= length:
            out[path] = out.get(path, 0.0) + prob
            continue
        p = target_probs_fn(path).to(torch.float64).tolist()
        for tok, pt in enumerate(p):
            if pt > 0.0:
                stack.append((path + (tok,), prob * pt))
    return out


def target_joint(target_probs_fn: TargetFn, length: int) -> dict[tuple[int, ...], float]:
    """The target's exact joint over the next ``length`` tokens (product of conditionals)."""
    return complete_to_length({(): 1.0}, target_probs_fn, length)


def max_abs_error(a: dict[Hashable, float], b: dict[Hashable, float]) -> float:
    """``max_x |a(x) - b(x)|`` over the union of supports; NaN where any difference is NaN (Python's
    ``max`` keeps a NaN only when it comes first, and a NaN error must fail every ``err <= bound``)."""
    keys = set(a) | set(b)
    errors = [abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys]
    if any(math.isnan(e) for e in errors):
        return math.nan
    return max(errors, default=0.0)


def first_token_marginal(marginal: dict[tuple[int, ...], float], vocab: int) -> torch.Tensor:
    """``[V]`` float64: the law of the first committed token."""
    out = torch.zeros(vocab, dtype=torch.float64)
    for path, prob in marginal.items():
        out[path[0]] += prob
    return out


def first_token_tv(
    verifier: Verifier, proposal_builder: ProposalBuilder, target_probs_fn: TargetFn, *, max_leaves: int = MAX_LEAVES
) -> float:
    """Exact total-variation distance between the first committed token's law and the target's.

    Zero for an exact verifier; for a heuristic one (``typical``) it measures how far one
    emitted token drifts from the target distribution.
    """
    p = target_probs_fn(()).to(torch.float64)  # [V]
    marg = verifier_output_marginal(verifier, proposal_builder, target_probs_fn, max_leaves=max_leaves)
    return 0.5 * float((first_token_marginal(marg, p.shape[0]) - p).abs().sum())


# --------------------------------------------------------------------------- synthetic instances


def random_law(gen: torch.Generator, vocab: int, *, zeros: int = 0) -> torch.Tensor:
    """A random distribution ``[V]`` (float64) with ``zeros`` entries forced to zero."""
    w = torch.rand(vocab, generator=gen, dtype=torch.float64) + 0.05
    if zeros:
        idx = torch.randperm(vocab, generator=gen)[: min(zeros, vocab - 1)]
        w[idx] = 0.0
    return w / w.sum()


def one_hot(vocab: int, token: int) -> torch.Tensor:
    out = torch.zeros(vocab, dtype=torch.float64)
    out[token] = 1.0
    return out


def _prefix_seed(seed: int, prefix: tuple[int, ...]) -> int:
    """A reproducible seed for ``(seed, prefix)`` (independent of PYTHONHASHSEED)."""
    h = 1469598103934665603 ^ seed
    for t in (len(prefix),) + prefix:
        h = ((h ^ (t + 1)) * 1099511628211) & 0xFFFFFFFFFFFF
    return h


class PrefixLaws:
    """A family of conditional laws, one per prefix, drawn lazily and reproducibly.

    ``laws(prefix)`` is ``[V]`` float64; the same prefix always gives the same law (seeded from
    the prefix), so a tree's children are conditional on their own prefix.
    """

    def __init__(
        self,
        *,
        vocab: int,
        seed: int,
        kind: str = "dense",
        zeros: int = 0,
        policy: SamplingPolicy | None = None,
        fixed: dict[tuple[int, ...], torch.Tensor] | None = None,
    ) -> None:
        if kind not in {"dense", "one_hot", "logits"}:
            raise ValueError(f"kind must be dense, one_hot or logits; got {kind!r}")
        self.vocab, self.seed, self.kind, self.zeros, self.policy = vocab, seed, kind, zeros, policy
        self.fixed = dict(fixed or {})
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix in self.fixed:
            return self.fixed[prefix]
        if prefix not in self._cache:
            gen = torch.Generator().manual_seed(_prefix_seed(self.seed, prefix))
            if self.kind == "one_hot":
                law = one_hot(self.vocab, int(torch.randint(self.vocab, (1,), generator=gen)))
            elif self.kind == "logits":
                logits = torch.randn(self.vocab, generator=gen, dtype=torch.float64) * 1.5
                law = (self.policy or SamplingPolicy(temperature=1.0)).probs(logits, dtype=torch.float64)
            else:
                law = random_law(gen, self.vocab, zeros=self.zeros)
            self._cache[prefix] = law
        return self._cache[prefix]

    def level(self, prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        """``[len(prefixes), V]`` for :func:`sample_tree_proposal`."""
        return torch.stack([self(p) for p in prefixes])


def fixed_candidates(
    tokens_by_prefix: dict[tuple[int, ...], Sequence[int]], *, semantics: str = "absent", source: str = "lookup"
) -> ProposalResult:
    """A deterministic (``deterministic_lookup``) proposal: ``tokens_by_prefix[prefix]`` are the
    children below ``prefix``; no draw, no ``q``."""
    nodes: list[ProposalNode] = []
    index: dict[tuple[int, ...], int] = {(): -1}
    for prefix in sorted(tokens_by_prefix, key=len):
        if prefix not in index:
            raise ValueError(f"prefix {prefix} has no parent node in the candidate table")
        for tok in tokens_by_prefix[prefix]:
            nodes.append(
                ProposalNode(
                    token_id=int(tok),
                    parent=index[prefix],
                    source=source,
                    score=1.0 if semantics == "frequency" else None,
                )
            )
            index[prefix + (int(tok),)] = len(nodes) - 1
    parents = [n.parent for n in nodes]
    if all(p == i - 1 for i, p in enumerate(parents)):
        topology = "sequence"
    elif all(p == -1 for p in parents):
        topology = "set"
    else:
        topology = "tree"
    return ProposalResult(
        nodes=tuple(nodes),
        probability_semantics=semantics,  # type: ignore[arg-type]
        sampling_relation="deterministic_lookup",
        topology=topology,  # type: ignore[arg-type]
        state_handle=NO_STATE,
        manifest_hash="oracle",
        source=source,
    )


# --------------------------------------------------------------------------- cases


@dataclass
class OracleCase:
    """One round instance: a proposal builder, a target family and the length compared."""

    name: str
    proposal_builder: ProposalBuilder
    target: TargetFn
    length: int  # tokens compared: 1 + the deepest candidate
    max_nodes: int | None = None
    max_depth: int | None = None
    tags: dict[str, Any] = field(default_factory=dict)


def check_case(verifier: Verifier, case: OracleCase, *, max_leaves: int = MAX_LEAVES) -> dict:
    """Run one case; a dict with ``max_abs_error``, ``passed``, ``leaves`` and ``seconds``."""
    t0 = time.perf_counter()
    stats: dict = {}
    marg = verifier_output_marginal(
        verifier,
        case.proposal_builder,
        case.target,
        max_nodes=case.max_nodes,
        max_depth=case.max_depth,
        max_leaves=max_leaves,
        stats=stats,
    )
    err = max_abs_error(complete_to_length(marg, case.target, case.length), target_joint(case.target, case.length))
    return {
        "verifier": verifier.name,
        "case": case.name,
        "kind": "marginal",
        "max_abs_error": err,
        "bound": MARGINAL_ATOL,
        "passed": err <= MARGINAL_ATOL,
        "leaves": stats.get("leaves", 0),
        "seconds": time.perf_counter() - t0,
    }


#: the sampling policies a verifier's own ``select_logits`` is compared with ``select`` under: plain and
#: truncated laws (top-k, top-p, both), and temperature 0
FAST_PATH_POLICIES = (
    SamplingPolicy(temperature=0.0),
    SamplingPolicy(temperature=1.0),
    SamplingPolicy(temperature=0.7, top_k=2),
    SamplingPolicy(temperature=1.3, top_p=0.6),
    SamplingPolicy(temperature=0.8, top_k=3, top_p=0.8),
)


def overrides_select_logits(verifier: Verifier) -> bool:
    """Whether ``verifier`` computes its selection from the logits itself (:meth:`Verifier.select_logits`
    overridden), a path the runs take and the marginal cases (which call ``select``) do not."""
    return type(verifier).select_logits is not Verifier.select_logits


def check_fast_path(verifier: Verifier, case: OracleCase, *, draws: int = 64, seed: int = 0) -> dict:
    """The run's path against the oracle's: on trees the case's proposal builds and random logits, the
    verifier's ``select_logits`` under each policy it takes (:data:`FAST_PATH_POLICIES`) must select
    exactly what ``select`` selects on the policy's law, from the same random stream. ``max_abs_error``
    is the share of draws that differ (bound 0)."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    policies = [
        pol
        for pol in FAST_PATH_POLICIES
        if verifier.temperatures == "any" or (verifier.temperatures == "zero") == (pol.temperature == 0.0)
    ]
    differ = total = 0
    for k in range(draws):
        tree = compile_tree(_as_proposals(case.proposal_builder(TorchRandomSource(seed * 7919 + k))), 1)
        vocab = int(case.target(()).shape[-1])
        logits = torch.randn(1 + tree.num_rows, vocab, generator=gen, dtype=torch.float32) * 2.0  # [1 + N, V]
        for pol in policies:
            state = torch.Generator().manual_seed(seed * 104729 + k).get_state()
            a, b = TorchRandomSource(), TorchRandomSource()
            a.generator.set_state(state)
            b.generator.set_state(state)
            run = verifier.select_logits(tree, logits, pol, a)
            oracle = verifier.select(tree, pol.probs(logits), b)
            total += 1
            differ += (tuple(run.accepted_rows), int(run.next_token)) != (
                tuple(oracle.accepted_rows),
                int(oracle.next_token),
            )
    share = differ / total if total else 0.0
    return {
        "verifier": verifier.name,
        "case": f"{case.name}/select_logits",
        "kind": "fast_path",
        "max_abs_error": share,
        "bound": 0.0,
        "passed": differ == 0,
        "leaves": total,
        "seconds": time.perf_counter() - t0,
    }


def sampled_builder(laws: PrefixLaws, widths: Sequence[int], relation: str) -> ProposalBuilder:
    """A proposal builder sampling a ``widths``-by-depth tree from ``laws`` (conditional on each
    node's own prefix) with ``relation``, through the injected source."""

    def build(rng: RandomSource) -> ProposalResult:
        return sample_tree_proposal(
            laws.level, widths=widths, relation=relation, rng=rng, source="oracle", manifest_hash="oracle"
        )

    return build


def _fixed(proposal: ProposalResult) -> ProposalBuilder:
    return lambda rng: proposal


#: the residual-update toy instance (also the finite transport instance): p = (0.5, 0.3, 0.2),
#: q = (0.4, 0.4, 0.2)
TOY_P = (0.5, 0.3, 0.2)
TOY_Q = (0.4, 0.4, 0.2)


def _const(vec: Sequence[float]) -> TargetFn:
    t = torch.tensor(list(vec), dtype=torch.float64)
    return lambda prefix: t


#: shapes by declared topology: (label, widths by depth)
_SHAPES: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {
    "sequence": (("seq1", (1,)), ("seq3", (1, 1, 1))),
    "set": (("set2", (2,)), ("set4", (4,))),
    "tree": (("tree21", (2, 1)), ("tree12", (1, 2)), ("tree211", (2, 1, 1))),
}


def _target_kinds(verifier: Verifier) -> list[str]:
    """One-hot targets at temperature 0, dense targets at temperature > 0."""
    kinds = []
    if verifier.temperatures in {"zero", "any"}:
        kinds.append("one_hot")
    if verifier.temperatures in {"positive", "any"}:
        kinds.append("dense")
    return kinds


def _relations(verifier: Verifier) -> list[tuple[str, str]]:
    """``(sampling relation, probability semantics)`` pairs the verifier declares it accepts."""
    sem, rel = verifier.probability_semantics, verifier.sampling_relations
    out: list[tuple[str, str]] = []
    for r in ("iid", "without_replacement"):
        if r in rel and "normalized_conditional" in sem:
            out.append((r, "normalized_conditional"))
    if "beam" in rel and "score_only" in sem:
        out.append(("beam", "score_only"))
    if "deterministic_lookup" in rel:
        for s in ("absent", "frequency"):
            if s in sem:
                out.append(("deterministic_lookup", s))
                break
    return out


def _make_case(
    name: str,
    *,
    relation: str,
    semantics: str,
    widths: Sequence[int],
    vocab: int,
    target_kind: str,
    seed: int,
    target_zeros: int,
    q_zeros: int,
) -> OracleCase:
    target = PrefixLaws(vocab=vocab, seed=1000 + seed, kind=target_kind, zeros=target_zeros)
    if relation in {"iid", "without_replacement", "beam"}:
        q = PrefixLaws(vocab=vocab, seed=2000 + seed, kind="dense", zeros=q_zeros if relation != "beam" else 0)
        builder = sampled_builder(q, widths, relation)
    else:
        builder = _fixed(_lookup_tree(widths, vocab=vocab, seed=seed, semantics=semantics))
    return OracleCase(
        name=name,
        proposal_builder=builder,
        target=target,
        length=len(widths) + 1,
        tags={
            "relation": relation,
            "semantics": semantics,
            "widths": tuple(widths),
            "vocab": vocab,
            "target_kind": target_kind,
        },
    )


def verifier_cases(
    verifier: Verifier,
    *,
    seeds: Sequence[int] = (0, 1),
    vocab: int = 3,
    random_count: int = 0,
    random_seed: int = 0,
    random_max_proposal_leaves: int = 1500,
) -> list[OracleCase]:
    """Every case the oracle runs for ``verifier``, derived from what it declares.

    Targets: one-hot at temperature 0 (``temperatures`` "zero" or "any"), dense at temperature
    > 0 ("positive" or "any"), with zero entries on odd seeds. Proposals: for each declared
    sampling relation and topology, trees whose child laws are conditional on their own prefix:
    sampled (``iid``/``without_replacement`` with ``normalized_conditional``, with a zero in
    ``q`` on even seeds), a beam (``score_only``) or fixed candidates (``deterministic_lookup``).
    Relations whose semantics the verifier does not accept are skipped. Then ``random_count``
    random instances (:func:`random_cases`; at least one per sampling relation and target kind) and
    the named fixed cases (:func:`_fixed_cases`).
    """
    cases: list[OracleCase] = []
    for kind in _target_kinds(verifier):
        for relation, semantics in _relations(verifier):
            for t in ("sequence", "set", "tree"):
                if t not in verifier.topologies:
                    continue
                for label, widths in _SHAPES[t]:
                    if relation != "iid" and max(widths) > vocab:
                        continue
                    for seed in seeds:
                        cases.append(
                            _make_case(
                                f"{kind}/{relation}/{label}/s{seed}",
                                relation=relation,
                                semantics=semantics,
                                widths=widths,
                                vocab=vocab,
                                target_kind=kind,
                                seed=seed,
                                target_zeros=seed % 2,
                                q_zeros=1 - seed % 2,
                            )
                        )
    if random_count:
        cases.extend(
            random_cases(verifier, count=random_count, seed=random_seed, max_proposal_leaves=random_max_proposal_leaves)
        )
    cases.extend(_fixed_cases(verifier))
    return cases


def proposal_leaf_bound(widths: Sequence[int], *, relation: str, vocab: int, support: int) -> int:
    """Upper bound on the proposal branches of a widths-by-depth expansion (every draw distinct).

    Per parent: ``support ** w`` draws i.i.d.; without replacement ``w`` draws from at most
    ``vocab - i`` tokens each (the uniform fallback reaches outside ``q``'s support).
    """
    if relation == "iid":
        per_parent = [support**w for w in widths]
    elif relation == "without_replacement":
        per_parent = [math.prod(vocab - i for i in range(w)) for w in widths]
    else:
        return 1
    total, parents = 1, 1
    for w, branches in zip(widths, per_parent):
        total *= branches**parents
        parents *= w
    return total


def random_cases(
    verifier: Verifier, *, count: int, seed: int = 0, max_vocab: int = 6, max_proposal_leaves: int = 1500
) -> list[OracleCase]:
    """Random small instances within the verifier's declarations: vocabulary 2 to ``max_vocab``,
    one to four first-level candidates, depth 1 to 3, child laws conditional on their own prefix,
    zeros in targets and drafts. Shapes whose proposal enumeration could exceed
    ``max_proposal_leaves`` are redrawn (smaller), so the suite stays fast.

    The cases cycle over every ``(sampling relation, target kind)`` pair the verifier accepts, so
    a caller that keeps only one relation's cases still gets both temperature regimes; ``count``
    (when nonzero) is raised to the number of pairs, so every pair has a case. Where the verifier
    takes trees (else sets), the first case of each relation has a branching shape (a node with
    two or more children; a tree at least two deep)."""
    if count <= 0:
        return []
    relations = _relations(verifier)
    kinds = _target_kinds(verifier)
    topologies = [t for t in ("sequence", "set", "tree") if t in verifier.topologies]
    if not relations or not kinds or not topologies:
        return []
    pairs = list(itertools.product(relations, kinds))
    branching = "tree" if "tree" in topologies else ("set" if "set" in topologies else None)
    gen = torch.Generator().manual_seed(7919 + seed)

    def pick(options: Sequence[Any]) -> Any:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    def randint(lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    cases: list[OracleCase] = []
    seen: set[str] = set()
    for i in range(max(count, len(pairs))):
        (relation, semantics), kind = pairs[i % len(pairs)]
        forced = branching if relation not in seen else None
        seen.add(relation)
        for _attempt in range(1000):
            vocab = randint(2, max_vocab)
            t = forced or pick(topologies)
            if t == "sequence":
                widths: tuple[int, ...] = (1,) * randint(1, 3)
            elif t == "set":
                widths = (randint(2, 4),)
            else:
                widths = (randint(1, 4),) + tuple(randint(1, 2) for _ in range(randint(1, 2)))
                if all(w == 1 for w in widths):
                    widths = (2,) + widths[1:]
            if relation != "iid" and max(widths) > vocab:
                continue
            q_zeros = randint(0, max(0, vocab - 2))
            bound = proposal_leaf_bound(widths, relation=relation, vocab=vocab, support=vocab - q_zeros)
            if bound > max_proposal_leaves:
                continue
            break
        else:
            raise OracleError(f"could not draw a small enough random case for {verifier.name!r}")
        case_seed = 10_000 + 97 * seed + i
        cases.append(
            _make_case(
                f"random/{kind}/{relation}/v{vocab}/w{'-'.join(map(str, widths))}/r{seed}.{i}",
                relation=relation,
                semantics=semantics,
                widths=widths,
                vocab=vocab,
                target_kind=kind,
                seed=case_seed,
                target_zeros=randint(0, vocab - 1) // 2,
                q_zeros=q_zeros,
            )
        )
    return cases


def _lookup_tree(widths: Sequence[int], *, vocab: int, seed: int, semantics: str) -> ProposalResult:
    gen = torch.Generator().manual_seed(3000 + seed)
    table: dict[tuple[int, ...], list[int]] = {}
    level: list[tuple[int, ...]] = [()]
    for w in widths:
        nxt = []
        for prefix in level:
            toks = torch.randperm(vocab, generator=gen)[: min(w, vocab)].tolist()
            table[prefix] = toks
            nxt.extend(prefix + (t,) for t in toks)
        level = nxt
    return fixed_candidates(table, semantics=semantics)


def _fixed_cases(verifier: Verifier) -> list[OracleCase]:
    """Named cases: the residual-update toy, the duplicated-mass case (one-draft acceptance repeated
    over k identical drafts is wrong), top-p/top-k truncation, the uniform fallback."""
    out: list[OracleCase] = []
    sem, rel, topo, temps = (
        verifier.probability_semantics,
        verifier.sampling_relations,
        verifier.topologies,
        verifier.temperatures,
    )
    positive = temps in {"positive", "any"}
    if not positive or "normalized_conditional" not in sem:
        return out
    q_ref = PrefixLaws(vocab=3, seed=0, fixed={(): torch.tensor(TOY_Q, dtype=torch.float64)})
    if "iid" in rel and "set" in topo:
        # two i.i.d. candidates from q; SpecInfer's residual update reproduces p
        out.append(
            OracleCase(
                name="toy/p.5.3.2-q.4.4.2-iid2",
                proposal_builder=sampled_builder(q_ref, (2,), "iid"),
                target=_const(TOY_P),
                length=1,
                tags={"relation": "iid"},
            )
        )
        # duplicated mass: every draft is token 1, the target is Bernoulli(1/2)
        q_b = PrefixLaws(vocab=2, seed=0, fixed={(): torch.tensor([0.0, 1.0], dtype=torch.float64)})
        out.append(
            OracleCase(
                name="duplicated-mass/bernoulli-half-k3",
                proposal_builder=sampled_builder(q_b, (3,), "iid"),
                target=_const((0.5, 0.5)),
                length=1,
                tags={"relation": "iid"},
            )
        )
    if "without_replacement" in rel and "set" in topo:
        # draft mass exhausted after one draw: the second and third draws use the uniform fallback
        q_w = PrefixLaws(vocab=4, seed=0, fixed={(): torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)})
        out.append(
            OracleCase(
                name="fallback/uniform-after-exhaustion-k3",
                proposal_builder=sampled_builder(q_w, (3,), "without_replacement"),
                target=_const((0.1, 0.2, 0.3, 0.4)),
                length=1,
                tags={"relation": "without_replacement"},
            )
        )
        # q with a zero: exhausted after two draws
        q_w2 = PrefixLaws(vocab=3, seed=0, fixed={(): torch.tensor([0.7, 0.3, 0.0], dtype=torch.float64)})
        out.append(
            OracleCase(
                name="fallback/uniform-third-draw-k3",
                proposal_builder=sampled_builder(q_w2, (3,), "without_replacement"),
                target=_const((0.2, 0.2, 0.6)),
                length=1,
                tags={"relation": "without_replacement"},
            )
        )
    # top-p / top-k truncation applied to both the target and q (one policy, two logit families)
    for policy, label in (
        (SamplingPolicy(temperature=0.8, top_p=0.7), "top_p0.7"),
        (SamplingPolicy(temperature=1.2, top_k=2), "top_k2"),
    ):
        target = PrefixLaws(vocab=5, seed=4100, kind="logits", policy=policy)
        q = PrefixLaws(vocab=5, seed=4200, kind="logits", policy=policy)
        for r in ("iid", "without_replacement"):
            if r not in rel:
                continue
            if r == "without_replacement":
                shapes = [("set3", (3,))] if "set" in topo else []
            elif "tree" in topo:
                shapes = [("tree21", (2, 1))]
            elif "set" in topo:
                shapes = [("set2", (2,))]
            else:
                shapes = [("seq2", (1, 1))]
            for shape_label, widths in shapes:
                out.append(
                    OracleCase(
                        name=f"truncation/{label}/{r}/{shape_label}",
                        proposal_builder=sampled_builder(q, widths, r),
                        target=target,
                        length=len(widths) + 1,
                        tags={"relation": r},
                    )
                )
    return out


def run_verifier_cases(name: str, *, seeds: Sequence[int] = (0, 1), max_leaves: int = MAX_LEAVES) -> list[dict]:
    """All marginal cases of the registered verifier ``name``, and where it selects from the logits
    itself, its fast path against ``select`` on each case's trees (:func:`check_fast_path`); one result
    dict per check."""
    verifier = VERIFIERS[name]()
    rows = []
    for case in verifier_cases(verifier, seeds=seeds):
        rows.append(check_case(verifier, case, max_leaves=max_leaves))
        if overrides_select_logits(verifier):
            rows.append(check_fast_path(verifier, case))
    return rows


def exact_verifier_names(*, include_test_only: bool = False) -> list[str]:
    """Registered verifiers declared exact (test-only entries hidden unless asked)."""

    return sorted(n for n, cls in VERIFIERS.items() if cls.exact and (include_test_only or not cls.test_only))


__all__ = [
    "MARGINAL_ATOL",
    "MAX_LEAVES",
    "OracleError",
    "OracleCase",
    "PrefixLaws",
    "TOY_P",
    "TOY_Q",
    "check_case",
    "complete_to_length",
    "enumerate_leaves",
    "enumerate_marginal",
    "exact_verifier_names",
    "first_token_marginal",
    "first_token_tv",
    "fixed_candidates",
    "max_abs_error",
    "one_hot",
    "random_cases",
    "proposal_leaf_bound",
    "random_law",
    "round_output",
    "run_verifier_cases",
    "sampled_builder",
    "target_joint",
    "target_rows",
    "verifier_cases",
    "verifier_output_marginal",
]
