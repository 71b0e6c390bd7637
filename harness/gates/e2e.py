"""End-to-end exactness oracle: the real round on a real model, every draw enumerated.

The synthetic oracle (:mod:`harness.gates.oracle`) runs the verifiers on laws it builds itself.
This module runs the round a measured run runs — ``proposer.propose`` (every proposer through its
real class: a draft model, prompt lookup, REST over an in-memory datastore, Medusa / Hydra /
Clover heads, an EAGLE draft over the target's own features with its dynamic trees, early exit,
layer skip, merged sources; sampling through the injected source),
``compile_tree``, the target's verify forward
(:class:`~harness.target.backend.CausalLMBackend`), ``verifier.select_logits`` (``policy.probs`` then
``verifier.select``, or a verifier's direct equivalent) and
``backend.commit``, the proposal, packing, selection and emitted tokens through the step the measured
loop calls (:func:`~harness.engine.decode.propose_round`, :func:`~harness.engine.decode.compile_round`,
:func:`~harness.engine.decode.select_round`, :func:`~harness.engine.decode.round_tokens`) — on a
tiny model, with the oracle's enumerating source driving BOTH the
proposal draws and the verifier draws. It is therefore the one check that catches a proposer whose
recorded ``q`` differs from the law it actually sampled (multi-draft exactness holds only for the
law really sampled: SpecInfer's residual update, Sequoia's sampling without replacement).

The cases (:func:`e2e_cases`) cover every proposer with every sampling relation it declares,
at T = 0 and T > 0, on shapes small enough (vocabulary 5, depth <= 2) that a case enumerates in
about a second; :func:`gate_cases` picks those a run's oracle gate runs, and a run that drafts deeper
also enumerates one of them deepened (:func:`deepen`, up to :data:`DEEP_DEPTH`).

:func:`e2e_output_law` returns the exact law of the first ``length`` emitted tokens:

1. each proposal branch is produced by ``propose`` on a fork of the proposer's request state
   (models shared), compiled, and verified by one target forward over the request's cache;
2. each verifier branch (distinct :class:`~harness.contracts.Selection`) is committed into a copy
   of that cache, and decoding continues from the committed state: with another real round
   (``rounds``) or, once the round budget is spent, with the target's own continuation computed
   from the *committed cache* (one verify forward over a complete ``V``-ary tree), so a commit that
   keeps the wrong rows changes the law.

:func:`direct_target_joint` is the target's exact joint over the same tokens from plain forwards
of ``prompt + continuation`` for every continuation (``V ** k``), without any cache. A round is
exact iff the two agree within :data:`~harness.gates.oracle.MARGINAL_ATOL`.

Precision: the round code asks for float32 probabilities (``decode`` for the target, the draft
proposer for ``q``). Float32 rounding alone moves a marginal by about 1e-7, which a 1e-9 bound
cannot tell from a bias, so the oracle runs a float64 model under :class:`Float64Policy` — the same
temperature / top-k / top-p policy evaluated in float64 whatever dtype the caller asks for. The
float32 cases (``E2ECase.dtype = torch.float32``) run the path the runs use instead: the same
weights cast to float32, the round code's own float32 probabilities, compared against the exact
float64 joint of those cast weights within :data:`FLOAT32_ATOL` (see there).

Proposers that read target state outside their own attributes — the draft heads read the target's
hidden rows through a forward hook (:class:`~harness.heads.state.HiddenTap`) — see, in every
branch, the hook state a run would leave at that point: the enumeration snapshots each tap after
the forward that precedes a proposal (the prefill, then the branch's own verify forward) and
restores it before every forked ``propose``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from harness.contracts import Budget, Capabilities, ProposalResult, Selection
from harness.engine.decode import compile_round, propose_round, round_tokens, select_round
from harness.gates.oracle import (
    MARGINAL_ATOL,
    MAX_LEAVES,
    OracleError,
    enumerate_leaves,
    enumerate_marginal,
    fixed_candidates,
    max_abs_error,
    target_joint,
)
from harness.heads.checkpoint import target_fingerprint
from harness.heads.eagle import EagleDraft, spec_from_target
from harness.heads.early_exit import build_adapter
from harness.heads.models import DraftHeads, HeadSpec
from harness.heads.state import HiddenTap
from harness.proposers.base import Proposer
from harness.proposers.draft_model import DraftModelProposer
from harness.proposers.eagle import EagleProposer
from harness.proposers.heads import CloverProposer, HydraProposer, MedusaProposer
from harness.proposers.merged import MergedProposer, sub_budget
from harness.proposers.prompt_lookup import PromptLookupProposer
from harness.proposers.registry import proposer_class
from harness.proposers.rest import RestProposer
from harness.proposers.selfspec import EarlyExitProposer, LayerSkipProposer
from harness.random_source import RandomSource
from harness.target.backend import CacheState, CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.topology.compiler import CompiledTree, compile_tree, validate_candidate_graph, validate_commit
from harness.topology.dynamic import rerank_connected
from harness.verifiers.base import VERIFIERS, NegotiationError, Verifier, negotiate
from harness.verifiers.sampling import SamplingPolicy
from harness.workloads.datastore import Datastore, datastore_from_token_ids

#: tokens the end-to-end cases compare (the target joint over the next LENGTH tokens)
DEFAULT_LENGTH = 3
#: lm_head scale of the oracle's tiny models: random-init logits are nearly uniform over a
#: vocabulary of 5; scaled by 10 the laws range from ~0.04 to ~0.55, so a wrong q shows.
LOGIT_SCALE = 10.0
#: a prompt with repeated n-grams, so prompt lookup proposes (vocabulary 5)
E2E_PROMPT = (1, 2, 3, 4, 0, 1, 2, 3, 1, 2)


# --------------------------------------------------------------------------- the round's pieces


@dataclass(frozen=True)
class Float64Policy(SamplingPolicy):
    """:class:`SamplingPolicy` evaluated in float64 whatever ``dtype`` the caller requests.

    For the end-to-end oracle only (float64 model): the round code's float32 requests would add
    ~1e-7 of rounding to every law, hiding nothing but drowning the 1e-9 bound.
    """

    def probs(self, logits: torch.Tensor, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return super().probs(logits, dtype=torch.float64)


def propose_and_verify(
    *,
    target: CausalLMBackend,
    seq: CacheState,
    proposer: Proposer,
    policy: SamplingPolicy,
    committed: list[int],
    rng: RandomSource,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    validate: bool = True,
) -> tuple[ProposalResult, CompiledTree, torch.Tensor]:
    """Proposal -> packing -> target verify -> policy: the first half of a round, as ``decode``
    runs it. Appends the candidate rows to ``seq``. Returns the proposal, the compiled tree and
    the target distributions ``[1 + N, V]`` (row 0: the frontier)."""
    proposal, depth = propose_round(proposer, committed, rng, max_depth=max_depth)
    tree = compile_round(proposal, committed, max_nodes=max_nodes, depth=depth)
    if validate:
        validate_candidate_graph(tree)
    out = target.verify_one(seq, committed[-1], tree)
    return proposal, tree, policy.probs(out.logits)  # [1 + N, V]


def select_and_commit(
    *,
    target: CausalLMBackend,
    seq: CacheState,
    verifier: Verifier,
    tree: CompiledTree,
    target_probs: torch.Tensor,
    rng: RandomSource,
    validate: bool = True,
) -> tuple[Selection, tuple[int, ...]]:
    """Selection -> commit: the second half of a round. ``target_probs`` ``[1 + N, V]``.
    Returns the selection and the emitted tokens (accepted path, then the next token)."""
    sel = verifier.select(tree, target_probs, rng)
    if validate:
        validate_commit(tree, sel.accepted_rows)
    target.commit_one(seq, sel.accepted_rows)
    return sel, emitted_tokens(tree, sel)


def speculative_round(*, verifier: Verifier, **round_: Any) -> tuple[CompiledTree, Selection, tuple[int, ...]]:
    """One whole round (no timing): what each iteration of ``decode``'s loop does. ``round_``: the
    keyword arguments of :func:`propose_and_verify`; the commit uses its target, cache, generator
    and ``validate``."""
    _, tree, probs = propose_and_verify(**round_)
    sel, emitted = select_and_commit(
        target=round_["target"],
        seq=round_["seq"],
        verifier=verifier,
        tree=tree,
        target_probs=probs,
        rng=round_["rng"],
        validate=round_.get("validate", True),
    )
    return tree, sel, emitted


def emitted_tokens(tree: CompiledTree, sel: Selection) -> tuple[int, ...]:
    return tuple(round_tokens(tree, sel))


#: what a fork shares with the proposer it copies: weights, backends, the target's hidden-state
#: hooks and read-only indexes (everything else a proposer holds is per-request state)
SHARED_TYPES: tuple[type, ...] = (torch.nn.Module, CausalLMBackend, HiddenTap, Datastore)


def _composed(v: Any) -> list[Proposer]:
    """The proposers an attribute holds: itself, or the items of a list (``proposer=merged``)."""
    if isinstance(v, Proposer):
        return [v]
    if isinstance(v, (list, tuple)):
        return [item for item in v if isinstance(item, Proposer)]
    return []


def _shared_models(obj: Any, memo: dict[int, Any]) -> None:
    """Shared objects reachable from a proposer's attributes, through composed proposers. A module
    brings every submodule, parameter and buffer (a helper such as a partial layer path that keeps
    a submodule of the target shares it too)."""
    for v in vars(obj).values():
        if isinstance(v, torch.nn.Module):
            for m in v.modules():
                memo[id(m)] = m
            for t in (*v.parameters(), *v.buffers()):
                memo[id(t)] = t
        elif isinstance(v, SHARED_TYPES):
            memo[id(v)] = v
        else:
            for item in _composed(v):
                if id(item) not in memo:
                    _shared_models(item, memo)


def fork(obj: Any) -> Any:
    """A deep copy of a proposer's per-request state that shares its models and backends."""
    memo: dict[int, Any] = {}
    _shared_models(obj, memo)
    return copy.deepcopy(obj, memo)


def hidden_taps(obj: Any) -> list[HiddenTap]:
    """The target hidden-state taps a proposer reads (through composed proposers), each once."""
    found: dict[int, HiddenTap] = {}
    for v in vars(obj).values():
        if isinstance(v, HiddenTap):
            found.setdefault(id(v), v)
        for item in _composed(v):
            for tap in hidden_taps(item):
                found.setdefault(id(tap), tap)
    return list(found.values())


#: a tap's state: (tap, serial, last captured forward)
TapState = tuple[tuple[HiddenTap, int, Any], ...]


def snapshot_taps(taps: Sequence[HiddenTap]) -> TapState:
    return tuple((tap, tap.serial, tap.last) for tap in taps)


def restore_taps(state: TapState) -> None:
    """Put each tap back as it was: the forwards of other branches never happened for this one."""
    for tap, serial, last in state:
        tap.serial, tap.last = serial, last


# --------------------------------------------------------------------------- target laws


def _complete_table(vocab: int, depth: int) -> dict[tuple[int, ...], list[int]]:
    """Every prefix shorter than ``depth`` -> all ``vocab`` tokens (a complete V-ary tree)."""
    table: dict[tuple[int, ...], list[int]] = {}
    level: list[tuple[int, ...]] = [()]
    for _ in range(depth):
        for prefix in level:
            table[prefix] = list(range(vocab))
        level = [p + (t,) for p in level for t in range(vocab)]
    return table


@torch.inference_mode()
def continuation_law(
    target: CausalLMBackend, seq: CacheState, committed: Sequence[int], policy: SamplingPolicy, length: int
) -> dict[tuple[int, ...], float]:
    """The target's joint over the next ``length`` tokens, from the request's cache ``seq``
    (every committed token but the pending one, ``committed[-1]``): one verify forward over a
    complete ``V``-ary tree of depth ``length - 1``. ``seq`` gets the rows appended."""
    if length < 1:
        return {(): 1.0}
    vocab = target.vocab_size
    if length == 1:
        proposal = ProposalResult.empty_result(source="e2e", manifest_hash="e2e")
    else:
        proposal = fixed_candidates(_complete_table(vocab, length - 1), source="e2e")
    tree = compile_tree([proposal], prefix_len=len(committed))
    probs = policy.probs(target.verify_one(seq, int(committed[-1]), tree).logits).to(torch.float64)  # [1 + N, V]
    row_of = {prefix: r + 1 for r, prefix in enumerate(tree.full_prefixes)}
    row_of[()] = 0
    return target_joint(lambda prefix: probs[row_of[prefix]], length)


@torch.inference_mode()
def direct_target_joint(
    model: torch.nn.Module, prompt_ids: Sequence[int], policy: SamplingPolicy, length: int
) -> dict[tuple[int, ...], float]:
    """The target's exact joint over the next ``length`` tokens from plain forwards of
    ``prompt + c`` for every continuation ``c`` shorter than ``length`` (no cache, no tree)."""
    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device
    laws: dict[tuple[int, ...], torch.Tensor] = {}
    level: list[tuple[int, ...]] = [()]
    for _ in range(length):
        ids = torch.tensor([list(prompt_ids) + list(c) for c in level], dtype=torch.long, device=device)  # [B, T]
        probs = policy.probs(model(input_ids=ids).logits[:, -1]).to(torch.float64).cpu()  # [B, V]
        laws.update(zip(level, probs))
        level = [c + (t,) for c in level for t in range(vocab)]
    return target_joint(lambda prefix: laws[prefix], length)


# --------------------------------------------------------------------------- enumeration


def e2e_output_law(
    *,
    target: CausalLMBackend,
    proposer: Proposer,
    verifier: Verifier,
    policy: SamplingPolicy,
    prompt_ids: Sequence[int],
    length: int = DEFAULT_LENGTH,
    rounds: int | None = 1,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    max_leaves: int = MAX_LEAVES,
    stats: dict | None = None,
) -> dict[tuple[int, ...], float]:
    """Exact law of the first ``length`` tokens emitted by speculative decoding of ``prompt_ids``.

    Real rounds (``rounds`` of them at most; ``None``: as many as it takes) run with every
    proposal and verifier draw enumerated, each proposed as the measured loop proposes with
    ``length`` as its ``max_new_tokens`` (a round whose tokens left are fewer than ``max_depth``
    plus its bonus token drafts under that depth cap); after the last real round the committed state is
    continued by the target's own law computed from the committed cache (see the module
    docstring). ``proposer`` is started on the prompt here and forked for every branch, so it is
    left as it was after ``start``. ``stats`` (if given) receives ``proposals``, ``selections``,
    ``leaves`` and ``empty_proposals`` (rounds that could draft whose proposal had no node) counts. Raises
    :class:`OracleError` past ``max_leaves`` selections.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1; got {length}")
    if rounds is not None and rounds < 1:
        raise ValueError(f"rounds must be >= 1 or None; got {rounds}")
    seq0 = target.prefill_one(list(prompt_ids))
    proposer.start(list(prompt_ids))
    taps = hidden_taps(proposer)
    out: dict[tuple[int, ...], float] = {}
    count = {"proposals": 0, "selections": 0, "leaves": 0, "empty_proposals": 0}

    def add(path: tuple[int, ...], prob: float) -> None:
        out[path] = out.get(path, 0.0) + prob
        count["leaves"] += 1

    def explore(
        seq: CacheState,
        prop: Proposer,
        committed: list[int],
        generated: tuple[int, ...],
        prob: float,
        rounds_left: int | None,
        tap_state: TapState,
    ) -> None:
        if len(generated) >= length:
            add(generated[:length], prob)
            return
        if rounds_left == 0:
            for cont, pc in continuation_law(
                target, copy.deepcopy(seq), committed, policy, length - len(generated)
            ).items():
                add(generated + cont, prob * pc)
            return

        def propose(rng: RandomSource) -> tuple[ProposalResult, int | None, Proposer]:
            restore_taps(tap_state)  # the hooks as this branch's last target forward left them
            branch = fork(prop)
            # as decode proposes, ``length`` standing for max_new_tokens: a round drafts no deeper than
            # the tokens left less its bonus token (a request's last rounds)
            tokens_left = length - len(generated)
            return *propose_round(branch, list(committed), rng, max_depth=max_depth, tokens_left=tokens_left), branch

        for (proposal, depth, after), p_prop in enumerate_leaves(propose, max_leaves=max_leaves):
            count["proposals"] += 1
            # a round with one token left (depth cap 0) commits its bonus token only, drafting nothing
            count["empty_proposals"] += proposal.empty and depth != 0
            tree = compile_round(proposal, committed, max_nodes=max_nodes, depth=depth)
            validate_candidate_graph(tree)
            seq_v = copy.deepcopy(seq)
            logits = target.verify_one(seq_v, committed[-1], tree).logits  # [1 + N, V]
            verified = snapshot_taps(taps)  # what the next round's proposer reads from the hooks

            def select(rng: RandomSource, tree: CompiledTree = tree, logits: torch.Tensor = logits) -> Selection:
                sel = select_round(verifier, tree, logits, policy, rng)  # as decode selects
                validate_commit(tree, sel.accepted_rows)
                return sel

            budget = max_leaves - count["selections"]
            if budget < 1:
                raise OracleError(f"end-to-end enumeration exceeds max_leaves={max_leaves}: shrink the case")
            for sel, p_sel in enumerate_marginal(select, max_leaves=budget).items():
                count["selections"] += 1
                seq_c = copy.deepcopy(seq_v)
                target.commit_one(seq_c, sel.accepted_rows)
                emitted = emitted_tokens(tree, sel)
                nxt = fork(after)
                now = committed + list(emitted)
                nxt.observe_commit(now)
                explore(
                    seq_c,
                    nxt,
                    now,
                    generated + emitted,
                    prob * p_prop * p_sel,
                    None if rounds_left is None else rounds_left - 1,
                    verified,
                )

    explore(seq0, proposer, list(prompt_ids), (), 1.0, rounds, snapshot_taps(taps))
    if stats is not None:
        stats.update(count)
    total = sum(out.values())
    if abs(total - 1.0) > 1e-6:  # a lost branch shows; float32 probabilities (~1e-8 off) do not
        raise OracleError(f"end-to-end output law sums to {total!r}, expected 1")
    return out


# --------------------------------------------------------------------------- cases


def oracle_model(
    *, seed: int, vocab: int = 5, num_layers: int = 2, logit_scale: float = LOGIT_SCALE
) -> torch.nn.Module:
    """A tiny float64 Llama with a peaked, prefix-dependent next-token law (lm_head scaled)."""

    model = build_tiny_model(seed=seed, dtype=torch.float64, vocab_size=vocab, num_layers=num_layers)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A fresh model of ``model``'s class and config holding its weights cast to ``dtype`` (built
    anew rather than deep-copied, so no forward hook of the original comes along)."""
    with torch.random.fork_rng(devices=[]):
        twin = type(model)(model.config)
    twin.load_state_dict(model.state_dict())
    twin = twin.to(dtype).eval()
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin


def oracle_eagle_network(target: torch.nn.Module, *, seed: int = 202) -> EagleDraft:
    """A random EAGLE-1/2 draft shaped like one layer of ``target``, in the target's dtype."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = EagleDraft(spec_from_target(target.config))
    net = net.to(next(target.parameters()).dtype).eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


@dataclass
class E2ECase:
    """One end-to-end instance: which proposer, shape and policy; the verifier comes separately."""

    name: str
    proposer: str  # a key of PROPOSER_BUILDERS, or draft_model | prompt_lookup | merged
    budget: Budget
    policy: SamplingPolicy
    #: the proposer's ``sampling`` option (draft model, draft heads, self-speculation; merged: its draft)
    sampling: str = "iid"
    length: int = DEFAULT_LENGTH
    rounds: int | None = 1
    tags: dict = field(default_factory=dict)
    #: the proposer's other options, as a run's ``proposer.*`` (merged: ``sources`` and one dict per
    #: source); builders read what they need (a datastore's documents, a head bank's seed)
    options: dict = field(default_factory=dict)
    #: the models' dtype: float64 (exact arithmetic, bound MARGINAL_ATOL) or float32 (the runs' path,
    #: bound FLOAT32_ATOL)
    dtype: torch.dtype = torch.float64
    #: draft_model only: "padded" drafts with :attr:`E2EModels.padded`, whose embedding matrix and
    #: LM head have extra rows past the target's vocabulary (the proposer restricts q to the shared range);
    #: "short" with :attr:`E2EModels.short`, whose vocabulary ends before the target's (q is zero past it,
    #: and a draw can only expand ids the draft has)
    draft: str = "draft"
    #: the prompt the case decodes (default :data:`E2E_PROMPT`; a short draft's case keeps to its ids)
    prompt: tuple[int, ...] | None = None


def _as_float64(policy: SamplingPolicy) -> Float64Policy:
    return (
        policy
        if isinstance(policy, Float64Policy)
        else Float64Policy(temperature=policy.temperature, top_p=policy.top_p, top_k=policy.top_k)
    )


def _as_plain(policy: SamplingPolicy) -> SamplingPolicy:
    """The run's own policy (float32 probabilities for float32 logits, as ``decode`` asks)."""
    return SamplingPolicy(temperature=policy.temperature, top_p=policy.top_p, top_k=policy.top_k)


def case_policy(case: E2ECase) -> SamplingPolicy:
    """The policy a case runs under: float64 throughout for a float64 case; for a float32 case the
    policy the runs use, whose probabilities come in the logits' dtype."""
    return _as_float64(case.policy) if case.dtype == torch.float64 else _as_plain(case.policy)


#: ``builder(case, *, target, draft, policy) -> Proposer``: builds a case's proposer through its
#: real class, from the oracle's tiny models and the case's options
ProposerBuilder = Callable[..., Proposer]
#: case.proposer -> its builder (the draft model, prompt lookup and merged are built by make_proposer)
PROPOSER_BUILDERS: dict[str, ProposerBuilder] = {}


def proposer_builder(*names: str) -> Callable[[ProposerBuilder], ProposerBuilder]:
    """Register a builder for the end-to-end cases whose ``proposer`` is one of ``names``."""

    def register(fn: ProposerBuilder) -> ProposerBuilder:
        for name in names:
            if name in PROPOSER_BUILDERS and PROPOSER_BUILDERS[name] is not fn:
                raise ValueError(f"end-to-end proposer builder {name!r} registered twice")
            PROPOSER_BUILDERS[name] = fn
        return fn

    return register


def make_proposer(
    case: E2ECase,
    *,
    draft: CausalLMBackend | None = None,
    policy: SamplingPolicy,
    target: CausalLMBackend | None = None,
    target_vocab: int | None = None,
) -> Proposer:
    """The case's proposer, built through its real class on the oracle's models (``target`` for the
    proposers that read or run part of the target: draft heads, early exit, layer skip).
    ``target_vocab``: the target's vocabulary, the range a draft with a larger (padded) vocabulary
    proposes in, as the runner passes it."""
    builder = PROPOSER_BUILDERS.get(case.proposer)
    if builder is not None:
        return builder(case, target=target, draft=draft, policy=policy)
    if case.proposer == "draft_model":
        if draft is None:
            raise ValueError("an end-to-end draft_model case needs a draft backend")
        shared = min(draft.vocab_size, target_vocab) if target_vocab is not None else None
        return DraftModelProposer(
            budget=case.budget,
            manifest_hash="e2e",
            policy=policy,
            backend=draft,
            sampling=case.sampling,
            vocab_range=shared,
            target_vocab=target_vocab,
        )
    if case.proposer == "prompt_lookup":
        return PromptLookupProposer(budget=case.budget, manifest_hash="e2e", **case.options)
    if case.proposer == "merged":  # the sources a run builds, each with the round's budget
        sources = [
            make_proposer(
                replace(
                    case,
                    proposer=name,
                    budget=sub_budget(proposer_class(name), case.budget),
                    options=dict(case.options.get(name) or {}),
                ),
                draft=draft,
                policy=policy,
                target=target,
                target_vocab=target_vocab,
            )
            for name in merged_sources(case)
        ]
        return MergedProposer(budget=case.budget, manifest_hash="e2e", sources=sources, policy=policy)
    known = sorted({"draft_model", "prompt_lookup", "merged", *PROPOSER_BUILDERS})
    raise ValueError(f"unknown end-to-end proposer {case.proposer!r}; one of {', '.join(known)}")


#: the sources of the end-to-end merged cases unless a case names its own (options["sources"])
MERGED_SOURCES = ("draft_model", "prompt_lookup")


def merged_sources(case: E2ECase) -> tuple[str, ...]:
    return tuple(case.options.get("sources") or MERGED_SOURCES)


def _need_target(case: E2ECase, target: CausalLMBackend | None) -> torch.nn.Module:
    if target is None:
        raise ValueError(f"the end-to-end {case.proposer} case {case.name!r} needs the target backend")
    return target.model


def _on_target(
    cls: type[Proposer],
    case: E2ECase,
    *,
    policy: SamplingPolicy,
    model: torch.nn.Module,
    budget: Budget | None = None,
    manifest_hash: str = "e2e",
    **options,
) -> Proposer:
    """``cls`` built for ``case`` over the target ``model`` it reads or runs part of (its
    fingerprint as the checkpoint, the case's sampling); ``budget`` defaults to the case's."""
    return cls(
        budget=case.budget if budget is None else budget,
        manifest_hash=manifest_hash,
        policy=policy,
        model=model,
        checkpoint=target_fingerprint(model),
        sampling=case.sampling,
        **options,
    )


def _perturb(module: torch.nn.Module, *, seed: int, scale: float) -> torch.nn.Module:
    """Add ``scale`` x standard normal noise to every parameter (a seeded generator, so the global
    RNG is untouched): zero-initialised blocks would otherwise hide their inputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
            p.requires_grad_(False)
    return module.eval()


# REST: a token-id datastore in memory. After E2E_PROMPT's suffix (3, 1, 2) three documents continue
# with (4, 0), (4, 1) and (2, 0): a frequency trie 4 (count 2) -> {0, 1}, 2 (count 1) -> {0}.
REST_DOCUMENTS = ((0, 3, 1, 2, 4, 0), (3, 1, 2, 4, 1, 3), (2, 3, 1, 2, 2, 0), (1, 2, 0, 4, 4))
REST_OPTIONS = {
    "documents": REST_DOCUMENTS,
    "release": {"context_len": 4, "continuation_len": 2, "max_matches": 8},
    "max_suffix": 3,
    "min_suffix": 1,
}


@proposer_builder("rest")
def build_rest(case: E2ECase, *, target, draft, policy) -> Proposer:
    """REST over an in-memory datastore of ``options["documents"]`` (``release``: its context and
    continuation lengths and match cap); the other options are the proposer's own."""
    opts = {**REST_OPTIONS, **case.options}
    docs = opts.pop("documents")
    release = dict(opts.pop("release"))
    datastore = datastore_from_token_ids([list(d) for d in docs], **release)
    return RestProposer(budget=case.budget, manifest_hash="e2e", datastore=datastore, policy=policy, **opts)


#: head kind -> proposer class
HEAD_PROPOSERS = {"medusa": MedusaProposer, "hydra": HydraProposer, "clover": CloverProposer}


def random_heads(
    kind: str, model: torch.nn.Module, *, num_heads: int = 2, seed: int = 0, scale: float = 0.3, **spec
) -> DraftHeads:
    """An untrained head bank for ``model`` with every parameter perturbed. Exactness needs no
    training: the heads only have to propose something other than the target's law."""
    cfg = model.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = DraftHeads(
            HeadSpec(
                kind=kind,
                num_heads=num_heads,
                hidden_size=int(cfg.hidden_size),
                embed_size=int(cfg.hidden_size),
                **spec,
            )
        )
    return _perturb(heads, seed=seed + 1, scale=scale)


@proposer_builder(*HEAD_PROPOSERS)
def build_heads(case: E2ECase, *, target, draft, policy) -> Proposer:
    """A draft-head proposer (``case.proposer`` names the kind) with :func:`random_heads`
    (options: ``num_heads``, ``seed``, ``scale`` and HeadSpec fields such as ``prefix_attention``).
    It reads the target's hidden rows through the target model's forward hook."""
    model = _need_target(case, target)
    opts = {"num_heads": 2, **case.options}
    heads = random_heads(case.proposer, model, **opts)
    return _on_target(HEAD_PROPOSERS[case.proposer], case, policy=policy, model=model, heads=heads)


@proposer_builder("early_exit")
def build_early_exit(case: E2ECase, *, target, draft, policy) -> Proposer:
    """Early exit after ``exit_layer`` (default 1) of the target's layers with a random adapter
    (``seed``, ``scale``); ``eta`` is the confidence stop."""
    model = _need_target(case, target)
    opts = {"exit_layer": 1, "seed": 0, "scale": 0.1, **case.options}
    seed, scale = opts.pop("seed"), opts.pop("scale")
    adapter = _perturb(build_adapter(model, seed=seed), seed=seed + 1, scale=scale)
    return _on_target(EarlyExitProposer, case, policy=policy, model=model, adapter=adapter, **opts)


@proposer_builder("layer_skip")
def build_layer_skip(case: E2ECase, *, target, draft, policy) -> Proposer:
    """The target with the layers of ``skip`` (default [1]) bypassed; ``gamma`` / ``adaptive``
    as the proposer's threshold options."""
    model = _need_target(case, target)
    opts = {"skip": [1], **case.options}
    return _on_target(LayerSkipProposer, case, policy=policy, model=model, **opts)


@proposer_builder("eagle")
def build_eagle(case: E2ECase, *, target, draft, policy) -> Proposer:
    """EAGLE over the target's own features with a random draft network
    (:func:`oracle_eagle_network`); it reads the features through the target model's hidden-state
    tap, which hands each branch the verify forward that follows its proposal."""
    model = _need_target(case, target)
    return _on_target(EagleProposer, case, policy=policy, model=model, draft=oracle_eagle_network(model))


def misrecord_q(result: ProposalResult, q_temperature: float) -> ProposalResult:
    """``result`` with every recorded law replaced by ``q ** (1 / q_temperature)`` renormalised: a
    valid law that is not the one the tokens were drawn from. A result without q is unchanged."""
    if result.q_dists is None or not result.nodes:
        return result
    q_rec = result.q_dists.pow(1.0 / q_temperature)  # [N, V]
    q_rec = q_rec / q_rec.sum(dim=-1, keepdim=True)
    nodes = tuple(replace(n, q=float(q_rec[i, n.token_id])) for i, n in enumerate(result.nodes))
    return replace(result, nodes=nodes, q_dists=q_rec)


class MisrecordedQ(Proposer):
    """NEGATIVE CONTROL (test-only): any sampling proposer whose recorded ``q`` is not the law it
    sampled (:func:`misrecord_q`), the bug of a proposer whose policy and recorded law drift apart.
    Every contract check passes; only the end-to-end oracle sees it."""

    name: ClassVar[str] = "misrecorded_q"
    probability_semantics: ClassVar[str] = "normalized_conditional"
    sampling_relation: ClassVar[str] = "iid"
    shapes: ClassVar[frozenset[str]] = frozenset(
        {"sequence", "sequences", "set", "expansion", "cartesian", "tree", "merged"}
    )

    def __init__(self, inner: Proposer, *, q_temperature: float = 0.5) -> None:
        # its proposals are the inner proposer's, bound to its manifest
        super().__init__(budget=inner.budget, manifest_hash=inner.manifest_hash, policy=inner.policy)
        self.inner = inner
        self.q_temperature = q_temperature

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def start(self, prompt_ids: list[int]) -> None:
        self.inner.start(prompt_ids)

    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        return misrecord_q(self.inner.propose(committed, rng), self.q_temperature)

    def observe_commit(self, committed: list[int]) -> None:
        self.inner.observe_commit(committed)

    def finish(self) -> None:
        self.inner.finish()


def misrecorded_q_proposer(
    *,
    budget: Budget,
    policy: SamplingPolicy,
    backend: CausalLMBackend,
    sampling: str = "iid",
    q_temperature: float = 0.5,
) -> Proposer:
    """NEGATIVE CONTROL (test-only): a draft proposer that samples from the draft's law but
    records ``q`` with an extra temperature applied to q only (``q_rec ∝ q ** (1 / q_temperature)``).
    Every contract check passes (``q_rec`` is a valid law, node ``q`` agrees with it); only the
    end-to-end oracle sees it."""
    inner = DraftModelProposer(budget=budget, manifest_hash="e2e", policy=policy, backend=backend, sampling=sampling)
    return MisrecordedQ(inner, q_temperature=q_temperature)


def pruned_sampled_dynamic_proposer(case: E2ECase, *, policy: SamplingPolicy, target: CausalLMBackend) -> Proposer:
    """NEGATIVE CONTROL (test-only): a sampled dynamic tree pruned by its own confidences, as
    EAGLE-2 prunes its deterministic tree: children are drawn without replacement (or i.i.d.)
    under a budget twice ``max_nodes``, then only the ``max_nodes`` nodes of highest joint
    confidence are kept. Every kept node still records the law it was drawn from and every
    contract check passes, but whether a draw survives depends on its own value, so the verifier
    no longer sees draws from those laws; the end-to-end oracle sees the bias."""
    wide = replace(case.budget, max_nodes=2 * case.budget.max_nodes)

    class PrunedSampledDynamic(EagleProposer):
        def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
            result = super().propose(committed, rng)
            if not result.nodes:
                return result
            kept = rerank_connected(
                [n.parent for n in result.nodes], result.extras["joint_logp"], case.budget.max_nodes
            )
            index = {old: new for new, old in enumerate(kept)}
            nodes = tuple(
                replace(result.nodes[i], parent=-1 if result.nodes[i].parent < 0 else index[result.nodes[i].parent])
                for i in kept
            )
            pruned = replace(
                result, nodes=nodes, q_dists=result.q_dists[kept], topology="tree", extras={"pruned_from": len(kept)}
            )
            self._expect = (self._expect[0], self._expect[1], pruned)  # what the verify forward will carry
            return pruned

    model = _need_target(case, target)
    return _on_target(
        PrunedSampledDynamic,
        case,
        policy=policy,
        model=model,
        budget=wide,
        manifest_hash="e2e-negative-control",
        draft=oracle_eagle_network(model),
    )


def case_capabilities(case: E2ECase) -> Capabilities:
    """What the case's proposer declares from its options, as negotiation sees it in a run."""
    if case.proposer == "merged":
        options: dict = {"sources": list(merged_sources(case))}
        for name in merged_sources(case):
            options[name] = {"sampling": case.sampling, **(case.options.get(name) or {})}
    else:
        options = {"sampling": case.sampling, **case.options}
    return proposer_class(case.proposer).declare(options, case.budget)


def case_relations(case: E2ECase) -> tuple[str, ...]:
    """The case's declared sampling relations, sorted (a merged proposer declares several)."""
    return tuple(sorted(case_capabilities(case).sampling_relations))


# --------------------------------------------------------------------------- the case list

T1 = SamplingPolicy(temperature=1.0)
TRUNC = SamplingPolicy(temperature=0.8, top_k=3, top_p=0.9)
GREEDY = SamplingPolicy(temperature=0.0)
SEQ2 = Budget(shape="sequence", max_nodes=2, max_depth=2)
EXP21 = Budget(shape="expansion", max_nodes=4, max_depth=2, widths=(2, 1))
#: a Sequoia-shaped tree (Chen et al., 2024): two draws below the frontier, one below the first
SEQUOIA3 = Budget(shape="tree", max_nodes=3, max_depth=2, parents=(-1, -1, 0))


#: the standard cases; each verifier runs those it negotiates (declarations decide, as in a run)
def standard_cases() -> list[E2ECase]:
    t1 = SamplingPolicy(temperature=1.0)
    trunc = SamplingPolicy(temperature=0.8, top_k=3, top_p=0.9)
    greedy = SamplingPolicy(temperature=0.0)
    seq1 = Budget(shape="sequence", max_nodes=1, max_depth=1)
    seq2 = Budget(shape="sequence", max_nodes=2, max_depth=2)
    set2 = Budget(shape="set", max_nodes=2, max_depth=1, widths=(2,))
    exp21 = Budget(shape="expansion", max_nodes=4, max_depth=2, widths=(2, 1))
    lookup = Budget(shape="sequences", max_nodes=6, max_depth=2)
    tails = {"rejected_tails": True}
    merged = Budget(shape="merged", max_nodes=6, max_depth=2)
    # topology=choices [[0], [1], [0, 0]]: two first tokens, the first of them extended
    choices = Budget(shape="choices", max_nodes=3, max_depth=2, parents=(-1, -1, 0), ranks=(0, 1, 0))
    # EAGLE-2's dynamic tree: 2 + 4 drafted nodes, the best 3 kept, so the verified shape (a chain, a
    # fork, or a root with two children) follows the draft's confidences
    dynamic = Budget(shape="dynamic", max_nodes=3, max_depth=2, topk=2)
    return [
        E2ECase("draft/iid/seq2/T1", "draft_model", seq2, t1, "iid"),
        E2ECase("draft/iid/set2/T1", "draft_model", set2, t1, "iid"),
        E2ECase("draft/iid/exp21/T0.8-topk3-topp0.9", "draft_model", exp21, trunc, "iid"),
        E2ECase("draft/iid/seq2/T0.8-topk3-topp0.9", "draft_model", seq2, trunc, "iid"),
        E2ECase("draft/wor/set2/T1", "draft_model", set2, t1, "without_replacement"),
        E2ECase("draft/wor/exp21/T0.8-topk3-topp0.9", "draft_model", exp21, trunc, "without_replacement"),
        E2ECase("lookup/sequences/T1", "prompt_lookup", lookup, t1),
        E2ECase("lookup/sequences/T0.8-topk3-topp0.9", "prompt_lookup", lookup, trunc),
        E2ECase("draft/iid/exp21/T0", "draft_model", exp21, greedy, "iid"),
        E2ECase("draft/beam/exp21/T0", "draft_model", exp21, greedy, "beam"),
        E2ECase("lookup/sequences/T0", "prompt_lookup", lookup, greedy),
        # the tails of the first round's rejected candidates join the second round's tree
        E2ECase("lookup/sequences-tails/T1/2-rounds", "prompt_lookup", lookup, t1, rounds=2, options=tails),
        E2ECase("lookup/sequences-tails/T0/2-rounds", "prompt_lookup", lookup, greedy, rounds=2, options=tails),
        E2ECase("merged/draft+lookup/T1", "merged", merged, t1, "iid"),
        E2ECase("merged/draft+lookup/T0", "merged", merged, greedy, "iid"),
        # the draft source's siblings drawn without replacement, merged with lookup's chains (membership)
        E2ECase(
            "merged/draft-wor+lookup/T1",
            "merged",
            Budget(shape="merged", max_nodes=4, max_depth=2),
            t1,
            "without_replacement",
        ),
        E2ECase("merged/draft-beam+lookup/T1", "merged", merged, t1, "beam"),
        # the draft's ranked top tokens at T > 0 (score-only: membership)
        E2ECase("draft/beam/exp21/T1", "draft_model", exp21, t1, "beam"),
        E2ECase("draft-padded/iid/seq2/T1", "draft_model", seq2, t1, "iid", draft="padded"),
        E2ECase(
            "draft-padded/wor/set2/T0.8-topk3-topp0.9",
            "draft_model",
            set2,
            trunc,
            "without_replacement",
            draft="padded",
        ),
        E2ECase("draft-padded/beam/exp21/T0", "draft_model", exp21, greedy, "beam", draft="padded"),
        # a draft whose vocabulary ends before the target's: three siblings from a top-2 law, so the
        # third falls back past q's mass every round and is expanded by the draft
        E2ECase(
            "draft-short/wor/exp31/T1-topk2",
            "draft_model",
            Budget(shape="expansion", max_nodes=6, max_depth=2, widths=(3, 1)),
            SamplingPolicy(temperature=1.0, top_k=2),
            "without_replacement",
            draft="short",
            prompt=(1, 2, 0, 1, 2, 0, 1, 2),
        ),
        # a second round after the target committed an id the short draft has no embedding row for:
        # the draft reads it as its stand-in id and the output stays exact
        E2ECase(
            "draft-short/wor/exp31/T1-topk2/2-rounds",
            "draft_model",
            Budget(shape="expansion", max_nodes=6, max_depth=2, widths=(3, 1)),
            SamplingPolicy(temperature=1.0, top_k=2),
            "without_replacement",
            length=3,
            rounds=2,
            draft="short",
            prompt=(1, 2, 0, 1, 2, 0, 1, 2),
        ),
        E2ECase("draft/iid/choices/T0.8-topk3-topp0.9", "draft_model", choices, trunc, "iid"),
        E2ECase("draft/beam/choices/T0", "draft_model", choices, greedy, "beam"),
        E2ECase("eagle/beam/dynamic/T0/2-rounds", "eagle", dynamic, greedy, "beam", rounds=2),
        E2ECase("eagle/beam/dynamic/T1", "eagle", dynamic, t1, "beam"),
        E2ECase("eagle/wor/dynamic/T0.8-topk3-topp0.9", "eagle", dynamic, trunc, "without_replacement"),
        E2ECase("eagle/iid/dynamic/T0.8-topk3-topp0.9", "eagle", dynamic, trunc, "iid"),
        E2ECase("eagle/iid/seq1/T1/2-rounds", "eagle", seq1, t1, "iid", length=2, rounds=2),
        E2ECase("eagle/beam/choices/T0", "eagle", choices, greedy, "beam"),
        E2ECase("eagle/iid/choices/T0.8-topk3-topp0.9", "eagle", choices, trunc, "iid"),
    ]


def sequoia_cases() -> list[E2ECase]:
    """Sequoia's shaped trees: a draft model sampling an explicit parent array (``topology=sequoia``
    gives the draft model ``Budget(shape="tree", parents=...)``) without replacement, verified by
    the ``sequoia`` verifier; the same shape sampled i.i.d. (duplicates kept as draws, not expanded)."""
    return [
        E2ECase("draft/wor/sequoia3/T0.8-topk3-topp0.9", "draft_model", SEQUOIA3, TRUNC, "without_replacement"),
        E2ECase("draft/iid/sequoia3/T0.8-topk3-topp0.9", "draft_model", SEQUOIA3, TRUNC, "iid"),
        E2ECase("draft/beam/sequoia3/T0", "draft_model", SEQUOIA3, GREEDY, "beam"),
    ]


def rest_cases() -> list[E2ECase]:
    """REST's frequency-scored trie (membership at T > 0; greedy and membership at T = 0, every
    round real) and the default merged proposer, REST + prompt lookup."""
    tree4 = Budget(shape="tree", max_nodes=4, max_depth=2)
    merged = Budget(shape="merged", max_nodes=6, max_depth=2)
    rest_lookup = {"sources": ("rest", "prompt_lookup"), "rest": {}, "prompt_lookup": {}}
    return [
        E2ECase("rest/tree4/T1", "rest", tree4, T1),
        E2ECase("rest/tree4/T0.8-topk3-topp0.9", "rest", tree4, TRUNC),
        E2ECase("rest/sequence2/T1", "rest", SEQ2, T1),
        E2ECase("rest/tree4/T0", "rest", tree4, GREEDY, rounds=None),
        E2ECase("merged/rest+lookup/T1", "merged", merged, T1, options=rest_lookup),
        E2ECase("merged/rest+lookup/T0", "merged", merged, GREEDY, options=rest_lookup),
    ]


def heads_cases() -> list[E2ECase]:
    """Every head kind with every sampling relation it declares, at T = 0 (every round real, so the
    heads read the hidden rows of the branch's own verify forwards) and T > 0: beam (score-only:
    greedy / membership), iid and without replacement (q recorded: rejection, SpecInfer, Sequoia)."""
    cases = []
    for kind in HEAD_PROPOSERS:
        # a bank that does not draft the target's whole greedy continuation at once, so the T = 0
        # cases run several real rounds (seed 0's clover bank drafts all three tokens in its first)
        bank = {"num_heads": 2, **({"seed": 2} if kind == "clover" else {})}
        cases += [
            E2ECase(f"{kind}/beam/exp21/T0", kind, EXP21, GREEDY, "beam", rounds=None, options=bank),
            E2ECase(f"{kind}/iid/exp21/T0", kind, EXP21, GREEDY, "iid", rounds=None, options=bank),
            E2ECase(f"{kind}/wor/exp21/T0", kind, EXP21, GREEDY, "without_replacement", options=bank),
            E2ECase(f"{kind}/beam/exp21/T1", kind, EXP21, T1, "beam", options=bank),
            E2ECase(f"{kind}/iid/seq2/T1", kind, SEQ2, T1, "iid", options=bank),
            E2ECase(f"{kind}/wor/exp21/T0.8-topk3-topp0.9", kind, EXP21, TRUNC, "without_replacement", options=bank),
        ]
    return cases


def selfspec_cases() -> list[E2ECase]:
    """Early exit and layer skip: sampled chains at T > 0 whose length is a stopping time (the
    confidence stop falls inside the enumeration), layer skip over two rounds so its adaptive
    threshold moves between them, and the beam chains."""
    # On E2E_PROMPT the first draft's top-1 confidence is 0.420 (early exit) / 0.377 (layer skip);
    # after the first drafted token it is 0.37-0.54 depending on that token, so these thresholds
    # draft the first token always and the second after some first tokens only.
    exit_opts = {"eta": 0.41}
    skip_opts = {"gamma": 0.37}
    return [
        E2ECase("early_exit/iid/seq2/T1", "early_exit", SEQ2, T1, "iid", options=exit_opts),
        E2ECase("early_exit/iid/seq2/T0.8-topk3-topp0.9", "early_exit", SEQ2, TRUNC, "iid", options=exit_opts),
        E2ECase("early_exit/beam/seq2/T1", "early_exit", SEQ2, T1, "beam", options=exit_opts),
        E2ECase("early_exit/beam/seq2/T0", "early_exit", SEQ2, GREEDY, "beam", rounds=None, options=exit_opts),
        E2ECase("layer_skip/iid/seq2/T1", "layer_skip", SEQ2, T1, "iid", options=skip_opts),
        E2ECase(
            "layer_skip/iid/seq1/T0.8-topk3-topp0.9/2rounds",
            "layer_skip",
            Budget(shape="sequence", max_nodes=1, max_depth=1),
            TRUNC,
            "iid",
            rounds=2,
            options=skip_opts,
        ),
        E2ECase("layer_skip/beam/seq2/T0", "layer_skip", SEQ2, GREEDY, "beam", rounds=None, options=skip_opts),
        E2ECase("layer_skip/beam/seq2/T1", "layer_skip", SEQ2, T1, "beam", options=skip_opts),
    ]


def float32_cases() -> list[E2ECase]:
    """The float32 path the runs use (bound FLOAT32_ATOL): a draft chain and a sampled head tree."""
    return [
        E2ECase("draft/iid/seq2/T1/float32", "draft_model", SEQ2, T1, "iid", dtype=torch.float32),
        E2ECase("hydra/iid/seq2/T1/float32", "hydra", SEQ2, T1, "iid", options={"num_heads": 2}, dtype=torch.float32),
    ]


#: the depth a run's end-to-end gate enumerates at most (:func:`deepen`): a round wrong only past the
#: depth its cases reach would pass them, so a run drafting deeper than its cases gets them deepened
#: to ``min(run depth, DEEP_DEPTH)``; each level multiplies the enumeration by up to ``V``
DEEP_DEPTH = 3


def _extend_parents(parents: tuple[int, ...], ranks: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An explicit tree one level deeper: a child (rank 0) below its last node of greatest depth."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    deepest = max(range(len(parents)), key=lambda i: (depth[i], i))
    return parents + (deepest,), (ranks + (0,) if ranks else ())


def _tree_depth(parents: tuple[int, ...]) -> int:
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


def budget_depth(budget: Budget) -> int:
    """The deepest node a round under ``budget`` can draft: an explicit tree's depth, else its depth
    cap as far as its node budget reaches (a node ``d`` deep needs ``d`` nodes)."""
    if budget.parents:
        return _tree_depth(tuple(budget.parents))
    if budget.shape == "set":
        return 1
    return min(budget.max_depth, budget.max_nodes)


def deep_budget(budget: Budget, depth: int) -> Budget | None:
    """``budget`` in its own shape, at least ``depth`` deep: a chain lengthened, an expansion's widths
    extended by ones, an explicit tree (a parent array, a choice list) given a chain below its
    deepest node, a depth-capped shape (sequences, merged, dynamic, a trie) its cap raised. None for a
    set (one level deep by definition)."""
    if budget.shape == "set":
        return None
    if budget.parents:
        parents, ranks = tuple(budget.parents), tuple(budget.ranks)
        while _tree_depth(parents) < depth:
            parents, ranks = _extend_parents(parents, ranks)
        nodes = max(budget.max_nodes, len(parents))
        return replace(budget, parents=parents, ranks=ranks, max_nodes=nodes, max_depth=max(budget.max_depth, depth))
    if budget_depth(budget) >= depth:
        return budget
    if budget.shape in ("expansion", "cartesian"):
        widths = tuple(budget.widths) + (1,) * (depth - len(budget.widths))
        nodes, level = 0, 1
        for w in widths:
            level *= w
            nodes += level
        return replace(budget, widths=widths, max_nodes=max(budget.max_nodes, nodes), max_depth=depth)
    return replace(budget, max_nodes=max(budget.max_nodes, depth), max_depth=depth)


def _rest_deeper(options: dict, depth: int) -> dict:
    """REST options whose datastore keeps continuations ``depth`` tokens long."""
    release = {**REST_OPTIONS["release"], **(options.get("release") or {})}
    release["continuation_len"] = max(int(release["continuation_len"]), depth)
    return {**options, "release": release}


def deepen(case: E2ECase, depth: int) -> E2ECase | None:
    """``case`` drafting ``depth`` deep (:func:`deep_budget`), its enumeration ``depth + 1`` tokens
    long so that the deepest node's acceptance and the token after it are in the law compared; a head
    bank gets a head per depth, a REST datastore continuations that long; a sampled case runs one real
    round. None where the shape cannot deepen (a set)."""
    budget = deep_budget(case.budget, depth)
    if budget is None:
        return None
    options = dict(case.options)
    if case.proposer in HEAD_PROPOSERS:
        options["num_heads"] = max(int(options.get("num_heads", 2)), depth)
    elif case.proposer == "rest":
        options = _rest_deeper(options, depth)
    elif case.proposer == "merged" and "rest" in merged_sources(case):
        options["rest"] = _rest_deeper(dict(options.get("rest") or {}), depth)
    # one real round when sampled: a second would multiply the draws (the shallow case runs it)
    rounds = 1 if case.policy.temperature > 0 else case.rounds
    return replace(
        case,
        name=f"{case.name}/depth{depth}",
        budget=budget,
        length=max(case.length, depth + 1),
        rounds=rounds,
        options=options,
    )


#: the selections a deepened case may enumerate (the largest deepened standard case takes ~3,600)
DEEP_MAX_LEAVES = 5000


def deep_candidates(cases: Sequence[E2ECase], depth: int, *, truncated: bool = False) -> list[E2ECase]:
    """The gate's cases that draft less than ``depth`` deep, deepened (:func:`deepen`), in the
    order a gate tries them: those whose policy truncates the law as the run's does (``truncated``)
    first, then the others, each group in the order of ``cases``."""
    deep = [d for c in cases if budget_depth(c.budget) < depth and (d := deepen(c, depth)) is not None]
    return sorted(deep, key=lambda c: c.policy.truncated != truncated)


def e2e_cases() -> list[E2ECase]:
    """Every end-to-end case: the standard draft model / prompt lookup / merged cases, then Sequoia's
    shaped trees, REST, the draft heads, self-speculation and the float32 cases. ``harness oracles``
    runs them all (each verifier those it negotiates); a run's gate runs :func:`gate_cases`."""
    return standard_cases() + sequoia_cases() + rest_cases() + heads_cases() + selfspec_cases() + float32_cases()


def applicable(case: E2ECase, verifier: Verifier) -> bool:
    """Whether a run would negotiate this proposer x topology x verifier x temperature."""

    try:
        negotiate(case_capabilities(case), verifier, temperature=case.policy.temperature)
    except NegotiationError:
        return False
    return True


def gate_cases(
    proposer: str,
    relations: Iterable[str],
    verifier: str | Verifier,
    *,
    greedy: bool,
    shape: str | None = None,
    cases: Sequence[E2ECase] | None = None,
) -> list[E2ECase]:
    """The end-to-end cases a run's oracle gate enumerates, in :func:`e2e_cases` order.

    ``proposer``: the run's proposer name (``Capabilities.name``); ``relations``: the sampling
    relations it declares (``Capabilities.sampling_relations``, any iterable); ``verifier``: its
    name or instance; ``greedy``: whether the run's temperature is 0; ``shape``: the run's
    ``Budget.shape`` (e.g. ``"tree"`` for a Sequoia tree), or None. Only cases the verifier
    negotiates at a temperature of the run's kind (zero or positive) are candidates. The first
    non-empty tier wins:

    1. the run's proposer with exactly the run's relations and the run's topology shape;
    2. the run's proposer with exactly the run's relations, any shape;
    3. the run's proposer with any of the run's relations (a merged proposer with other sources);
    4. any proposer with any of the run's relations (no case of the run's proposer has any of them
       at this kind of temperature under this verifier, though it may have cases of other relations
       or at the other kind of temperature).

    An empty list: nothing of the run's kind is covered (a heuristic verifier, say). The result does
    not depend on Python's hash seed (relations are sorted; the case order is fixed).
    """
    return gate_tier(proposer, relations, verifier, greedy=greedy, shape=shape, cases=cases)[1]


#: what each tier of :func:`gate_cases` proves about the run, as its gate entry says it
GATE_TIERS = {
    1: "the run's proposer with its sampling relations and topology shape",
    2: "the run's proposer with its sampling relations, in another topology shape (none of the run's shape)",
    3: "the run's proposer with some of its sampling relations (none with all of them)",
    4: (
        "another proposer with the run's sampling relations (no case of this proposer has any of them at this kind of "
        "temperature, zero or positive, under this verifier, or, where the run cuts its law to top-k / top-p, none "
        "that cuts it)"
    ),
}


def _tiers(
    proposer: str, relations: Iterable[str], verifier: str | Verifier, pool: Sequence[E2ECase], *, shape=None
) -> tuple[list[E2ECase], ...]:
    """The four tiers of :func:`gate_cases` drawn from ``pool`` (cases the verifier negotiates only)."""
    if isinstance(verifier, str):
        if verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {verifier!r}; registered: {sorted(VERIFIERS)}")
        verifier = VERIFIERS[verifier]()
    wanted = tuple(sorted(set(relations)))
    pool = [c for c in pool if applicable(c, verifier)]
    own = [c for c in pool if c.proposer == proposer]
    same = [c for c in own if case_relations(c) == wanted]
    return (
        [c for c in same if shape is not None and c.budget.shape == shape],
        same,
        [c for c in own if set(case_relations(c)) & set(wanted)],
        [c for c in pool if set(case_relations(c)) & set(wanted)],
    )


def gate_tier(
    proposer: str,
    relations: Iterable[str],
    verifier: str | Verifier,
    *,
    greedy: bool,
    shape: str | None = None,
    cases: Sequence[E2ECase] | None = None,
) -> tuple[int | None, list[E2ECase]]:
    """:func:`gate_cases` with the tier (1-4, :data:`GATE_TIERS`) its cases came from; None with no case."""
    pool = [c for c in (e2e_cases() if cases is None else cases) if (c.policy.temperature == 0.0) == greedy]
    tiers = _tiers(proposer, relations, verifier, pool, shape=shape)
    return next(((k, list(tier)) for k, tier in enumerate(tiers, start=1) if tier), (None, []))


def truncating_case(
    proposer: str,
    relations: Iterable[str],
    verifier: str | Verifier,
    *,
    shape: str | None = None,
    cases: Sequence[E2ECase] | None = None,
) -> tuple[int | None, E2ECase | None]:
    """For a sampled run that cuts its law to a top-k / top-p set: the first case under such a
    policy, searched through the tiers of :func:`gate_tier` in their order, with the tier it came
    from; ``(None, None)`` where no case of the run's relations truncates."""
    pool = [c for c in (e2e_cases() if cases is None else cases) if c.policy.truncated]
    return next(
        (
            (k, tier[0])
            for k, tier in enumerate(_tiers(proposer, relations, verifier, pool, shape=shape), start=1)
            if tier
        ),
        (None, None),
    )


# --------------------------------------------------------------------------- running cases

#: the float32 cases' bound on any marginal's absolute error. Float32 carries a unit roundoff of
#: 6e-8; the tree forward and the cache it commits round differently from plain forwards, the
#: verifier's ratios and residuals are float32, and a marginal multiplies a few conditionals and
#: sums at most a few hundred leaves, so honest rounding moves it by ~1e-8..1e-7 (measured: at
#: most 2.4e-8 on the float32 cases with every verifier that negotiates them). A recorded q that is
#: not the law sampled misses by 1.6e-2 on the same float32 case (the float32 negative control),
#: and by more than 3e-3 on every negative control: 1e-5 keeps two orders of magnitude on each side.
FLOAT32_ATOL = 1e-5
#: the bound of a case by its models' dtype
E2E_ATOL = {torch.float64: MARGINAL_ATOL, torch.float32: FLOAT32_ATOL}


#: rows the padded draft's embedding matrix and LM head have past the target's vocabulary
PADDED_EXTRA_ROWS = 3


def padded_draft(model: torch.nn.Module, extra: int = PADDED_EXTRA_ROWS) -> torch.nn.Module:
    """A copy of ``model`` with ``extra`` more vocabulary rows, as checkpoints of one family pad
    their embedding matrices: LM-head row ``V + i`` is twice row ``i``, so the padding takes a
    large share of the unrestricted mass and a proposer that did not restrict q to the shared range
    would show."""
    padded = copy.deepcopy(model)
    vocab = int(model.config.vocab_size)
    padded.resize_token_embeddings(vocab + extra, mean_resizing=False)
    with torch.no_grad():
        w = padded.get_output_embeddings().weight  # [V + extra, d]
        for i in range(extra):
            w[vocab + i] = 2.0 * w[i % vocab]
    for p in padded.parameters():
        p.requires_grad_(False)
    return padded.eval()


#: ids the short draft's vocabulary lacks at the end of the target's
SHORT_MISSING_ROWS = 2


def short_draft(model: torch.nn.Module, missing: int = SHORT_MISSING_ROWS) -> torch.nn.Module:
    """A copy of ``model`` whose vocabulary stops ``missing`` ids short of the target's, as a family's
    smaller checkpoints can: its embedding matrix and LM head lose their last rows."""
    short = copy.deepcopy(model)
    short.resize_token_embeddings(int(model.config.vocab_size) - missing, mean_resizing=False)
    for p in short.parameters():
        p.requires_grad_(False)
    return short.eval()


@dataclass
class E2EModels:
    target: CausalLMBackend
    draft: CausalLMBackend
    padded: CausalLMBackend | None = None  # the draft with a padded vocabulary (same law on the shared range)
    short: CausalLMBackend | None = None  # the draft with its vocabulary's last ids cut off
    #: a float64 model holding exactly the target's weights (the exact joint is computed with it);
    #: None: the target's own model (float64 already)
    reference: torch.nn.Module | None = None
    _casts: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, *, seed: int = 0, vocab: int = 5) -> E2EModels:
        """Target: 2 layers; draft: a different 1-layer model (so q differs from p), and the same
        draft with a padded vocabulary and with a short one."""
        draft = oracle_model(seed=seed + 101, vocab=vocab, num_layers=1)
        return cls(
            target=CausalLMBackend(oracle_model(seed=seed, vocab=vocab)),
            draft=CausalLMBackend(draft),
            padded=CausalLMBackend(padded_draft(draft)),
            short=CausalLMBackend(short_draft(draft)),
        )

    def draft_for(self, case: E2ECase) -> CausalLMBackend:
        if case.draft in ("padded", "short"):
            backend = getattr(self, case.draft)
            if backend is None:
                raise ValueError(f"case {case.name!r} needs the {case.draft} draft (E2EModels.build makes it)")
            return backend
        return self.draft

    def at_dtype(self, dtype: torch.dtype) -> E2EModels:
        """The same weights cast to ``dtype`` (built once, then cached), with a float64 reference
        holding exactly the cast weights: the comparison then sees only the round's arithmetic."""
        if dtype == self.target.dtype:
            return self
        hit = self._casts.get(dtype)
        if hit is None:
            target = cast_model(self.target.model, dtype)
            hit = self._casts[dtype] = E2EModels(
                target=CausalLMBackend(target),
                draft=CausalLMBackend(cast_model(self.draft.model, dtype)),
                padded=None if self.padded is None else CausalLMBackend(cast_model(self.padded.model, dtype)),
                short=None if self.short is None else CausalLMBackend(cast_model(self.short.model, dtype)),
                reference=cast_model(target, torch.float64),
            )
        return hit


def check_e2e_case(
    verifier: Verifier,
    case: E2ECase,
    models: E2EModels,
    *,
    prompt_ids: Sequence[int] | None = None,
    proposer_factory: Callable[[E2ECase, CausalLMBackend | None, SamplingPolicy], Proposer] | None = None,
    wrap: Callable[[Proposer], Proposer] | None = None,
    max_leaves: int = MAX_LEAVES,
) -> dict:
    """Run one end-to-end case; a row like :func:`harness.gates.oracle.check_case`'s.

    ``prompt_ids`` (default: the case's prompt, else :data:`E2E_PROMPT`): what the round decodes.

    ``proposer_factory(case, draft, policy)`` replaces :func:`make_proposer`; ``wrap`` is applied to
    the proposer built (a negative control wraps the real proposer). The case's models are
    ``models.at_dtype(case.dtype)``; its bound :data:`E2E_ATOL` of that dtype.
    """
    t0 = time.perf_counter()
    if prompt_ids is None:
        prompt_ids = case.prompt or E2E_PROMPT
    models = models.at_dtype(case.dtype)
    policy = case_policy(case)
    if proposer_factory is None:
        proposer = make_proposer(
            case,
            draft=models.draft_for(case),
            policy=policy,
            target=models.target,
            target_vocab=models.target.vocab_size,
        )
    else:
        proposer = proposer_factory(case, models.draft_for(case), policy)
    if wrap is not None:
        proposer = wrap(proposer)
    stats: dict = {}
    law = e2e_output_law(
        target=models.target,
        proposer=proposer,
        verifier=verifier,
        policy=policy,
        prompt_ids=prompt_ids,
        length=case.length,
        rounds=case.rounds,
        max_nodes=case.budget.max_nodes,
        max_depth=case.budget.max_depth,
        max_leaves=max_leaves,
        stats=stats,
    )
    reference = models.reference if models.reference is not None else models.target.model
    joint = direct_target_joint(reference, prompt_ids, _as_float64(case.policy), case.length)
    err = max_abs_error(law, joint)
    bound = E2E_ATOL[case.dtype]
    relations = case_relations(case)
    return {
        "verifier": verifier.name,
        "case": f"e2e/{case.name}",
        "kind": "end_to_end",
        "proposer": case.proposer,
        "dtype": str(case.dtype).removeprefix("torch."),
        "max_abs_error": err,
        "bound": bound,
        "passed": err <= bound,
        "leaves": stats.get("selections", 0),
        "proposals": stats.get("proposals", 0),
        "empty_proposals": stats.get("empty_proposals", 0),
        "relation": relations[0],
        "relations": list(relations),
        "seconds": time.perf_counter() - t0,
    }


def run_e2e_suite(
    verifier_names: Sequence[str],
    *,
    models: E2EModels | None = None,
    cases: Sequence[E2ECase] | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Every end-to-end case (:func:`e2e_cases`) each named verifier negotiates; one row per case
    (``on_row`` is called with each as it is done)."""

    models = models or E2EModels.build()
    rows = []
    for name in verifier_names:
        verifier = VERIFIERS[name]()
        if not verifier.exact:
            raise ValueError(f"verifier {name!r} is heuristic (exact=False): the oracle does not apply")
        for case in cases if cases is not None else e2e_cases():
            if applicable(case, verifier):
                rows.append(check_e2e_case(verifier, case, models))
                if on_row is not None:
                    on_row(rows[-1])
    return rows


#: (verifier, standard case) pairs the end-to-end negative control runs with a misrecorded q
#: (:class:`MisrecordedQ` around the case's real proposer)
NEGATIVE_CONTROL_CASES = (
    ("specinfer", "draft/iid/set2/T1"),
    ("rejection", "draft/iid/seq2/T1"),
    ("sequoia", "draft/wor/sequoia3/T0.8-topk3-topp0.9"),
    ("specinfer", "hydra/iid/seq2/T1"),
    ("sequoia", "medusa/wor/exp21/T0.8-topk3-topp0.9"),
    ("rejection", "early_exit/iid/seq2/T1"),
    ("rejection", "draft/iid/seq2/T1/float32"),
)


def negative_control_rows(models: E2EModels | None = None, *, verifiers: Iterable[str] | None = None) -> list[dict]:
    """The end-to-end negative control: :class:`MisrecordedQ` around each case's proposer under an
    exact verifier (only the pairs of ``verifiers`` when given). Each row is EXPECTED to fail
    (``passed`` False); ``negative_control`` marks them."""

    models = models or E2EModels.build()
    by_name = {c.name: c for c in e2e_cases()}
    keep = None if verifiers is None else set(verifiers)
    rows = []
    for verifier_name, case_name in NEGATIVE_CONTROL_CASES:
        if keep is not None and verifier_name not in keep:
            continue
        row = check_e2e_case(VERIFIERS[verifier_name](), by_name[case_name], models, wrap=MisrecordedQ)
        row["case"] = f"e2e-negative/misrecorded-q/{case_name}"
        row["negative_control"] = True
        rows.append(row)
    return rows


__all__ = [
    "DEEP_DEPTH",
    "DEEP_MAX_LEAVES",
    "DEFAULT_LENGTH",
    "E2E_ATOL",
    "E2ECase",
    "E2EModels",
    "E2E_PROMPT",
    "FLOAT32_ATOL",
    "Float64Policy",
    "LOGIT_SCALE",
    "MisrecordedQ",
    "PROPOSER_BUILDERS",
    "applicable",
    "budget_depth",
    "case_capabilities",
    "case_relations",
    "check_e2e_case",
    "continuation_law",
    "deep_budget",
    "deep_candidates",
    "deepen",
    "direct_target_joint",
    "e2e_output_law",
    "emitted_tokens",
    "fork",
    "gate_cases",
    "hidden_taps",
    "make_proposer",
    "misrecord_q",
    "misrecorded_q_proposer",
    "negative_control_rows",
    "oracle_eagle_network",
    "oracle_model",
    "pruned_sampled_dynamic_proposer",
    "propose_and_verify",
    "proposer_builder",
    "run_e2e_suite",
    "select_and_commit",
    "speculative_round",
    "standard_cases",
    "e2e_cases",
]
