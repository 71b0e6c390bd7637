"""End-to-end exactness oracle: the real round on a real model, every draw enumerated.

The synthetic oracle (:mod:`harness.gates.oracle`) runs the verifiers on laws it builds itself.
This module runs the round a measured run runs — ``proposer.propose`` (a draft model sampling
through the injected source, prompt lookup, or an EAGLE draft over the target's own features,
dynamic trees included), ``compile_tree``, the target's verify forward
(:class:`~harness.target.backend.CausalLMBackend`), ``policy.probs``, ``verifier.select`` and
``backend.commit`` — on a tiny model, with the oracle's enumerating source driving BOTH the
proposal draws and the verifier draws. It is therefore the one check that catches a proposer whose
recorded ``q`` differs from the law it actually sampled (multi-draft exactness holds only for the
law really sampled: SpecInfer's residual update, Sequoia's sampling without replacement).

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
temperature / top-k / top-p policy evaluated in float64 whatever dtype the caller asks for.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from harness.contracts import Budget, ProposalResult, Selection
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
from harness.heads.state import HiddenTap
from harness.proposers.base import Proposer
from harness.proposers.draft_model import DraftModelProposer
from harness.proposers.eagle import EagleProposer
from harness.proposers.merged import MergedProposer, sub_budget
from harness.proposers.prompt_lookup import PromptLookupProposer
from harness.proposers.registry import proposer_class
from harness.random_source import RandomSource
from harness.target.backend import CacheState, CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.topology.compiler import CompiledTree, compile_tree, validate_candidate_graph, validate_commit
from harness.topology.dynamic import rerank_connected
from harness.verifiers.base import VERIFIERS, NegotiationError, Verifier, negotiate
from harness.verifiers.sampling import SamplingPolicy

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
    proposal = proposer.propose(committed, rng)
    tree = compile_tree([proposal], prefix_len=len(committed), max_nodes=max_nodes, max_depth=max_depth)
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


def speculative_round(
    *,
    target: CausalLMBackend,
    seq: CacheState,
    proposer: Proposer,
    verifier: Verifier,
    policy: SamplingPolicy,
    committed: list[int],
    rng: RandomSource,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    validate: bool = True,
) -> tuple[CompiledTree, Selection, tuple[int, ...]]:
    """One whole round (no timing): what each iteration of ``decode``'s loop does."""
    _, tree, probs = propose_and_verify(
        target=target,
        seq=seq,
        proposer=proposer,
        policy=policy,
        committed=committed,
        rng=rng,
        max_nodes=max_nodes,
        max_depth=max_depth,
        validate=validate,
    )
    sel, emitted = select_and_commit(
        target=target, seq=seq, verifier=verifier, tree=tree, target_probs=probs, rng=rng, validate=validate
    )
    return tree, sel, emitted


def emitted_tokens(tree: CompiledTree, sel: Selection) -> tuple[int, ...]:
    return tuple(int(tree.token_ids[r]) for r in sel.accepted_rows) + (int(sel.next_token),)


def _shared_models(obj: Any, memo: dict[int, Any]) -> None:
    """Models, backends and hidden-state taps reachable from a proposer's attributes, through
    composed proposers (``proposer=merged`` keeps its sources in a list). A tap stays shared: it is
    the model's, and it hands each branch the verify forward that follows that branch's proposal."""
    for v in vars(obj).values():
        if isinstance(v, (torch.nn.Module, CausalLMBackend, HiddenTap)):
            memo[id(v)] = v
        elif isinstance(v, (list, tuple)):
            for item in v:
                if isinstance(item, Proposer) and id(item) not in memo:
                    _shared_models(item, memo)


def fork(obj: Any) -> Any:
    """A deep copy of a proposer's per-request state that shares its models and backends."""
    memo: dict[int, Any] = {}
    _shared_models(obj, memo)
    return copy.deepcopy(obj, memo)


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
    proposal and verifier draw enumerated; after the last real round the committed state is
    continued by the target's own law computed from the committed cache (see the module
    docstring). ``proposer`` is started on the prompt here and forked for every branch, so it is
    left as it was after ``start``. ``stats`` (if given) receives ``proposals``, ``selections``
    and ``leaves`` counts. Raises :class:`OracleError` past ``max_leaves`` selections.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1; got {length}")
    if rounds is not None and rounds < 1:
        raise ValueError(f"rounds must be >= 1 or None; got {rounds}")
    seq0 = target.prefill_one(list(prompt_ids))
    proposer.start(list(prompt_ids))
    out: dict[tuple[int, ...], float] = {}
    count = {"proposals": 0, "selections": 0, "leaves": 0}

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

        def propose(rng: RandomSource) -> tuple[ProposalResult, Proposer]:
            branch = fork(prop)
            return branch.propose(list(committed), rng), branch

        for (proposal, after), p_prop in enumerate_leaves(propose, max_leaves=max_leaves):
            count["proposals"] += 1
            tree = compile_tree([proposal], prefix_len=len(committed), max_nodes=max_nodes, max_depth=max_depth)
            validate_candidate_graph(tree)
            seq_v = copy.deepcopy(seq)
            probs = policy.probs(target.verify_one(seq_v, committed[-1], tree).logits)  # [1 + N, V], as decode does

            def select(rng: RandomSource, tree: CompiledTree = tree, probs: torch.Tensor = probs) -> Selection:
                sel = verifier.select(tree, probs, rng)
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
                )

    explore(seq0, proposer, list(prompt_ids), (), 1.0, rounds)
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


@dataclass(frozen=True)
class EagleParts:
    """What an end-to-end EAGLE proposer needs: the target model (its features and LM head) and a
    draft network over them."""

    target: torch.nn.Module
    network: torch.nn.Module


def oracle_eagle_network(target: torch.nn.Module, *, seed: int) -> EagleDraft:
    """A random float64 EAGLE-1/2 draft shaped like one layer of ``target``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = EagleDraft(spec_from_target(target.config))
    net = net.to(torch.float64).eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


@dataclass
class E2ECase:
    """One end-to-end instance: which proposer, shape and policy; the verifier comes separately."""

    name: str
    proposer: str  # "draft_model" | "prompt_lookup" | "merged" (draft model + prompt lookup) | "eagle"
    budget: Budget
    policy: SamplingPolicy
    sampling: str = "iid"  # draft_model and eagle
    length: int = DEFAULT_LENGTH
    rounds: int | None = 1
    tags: dict = field(default_factory=dict)


def _as_float64(policy: SamplingPolicy) -> Float64Policy:
    return (
        policy
        if isinstance(policy, Float64Policy)
        else Float64Policy(temperature=policy.temperature, top_p=policy.top_p, top_k=policy.top_k)
    )


def make_proposer(
    case: E2ECase, *, draft: CausalLMBackend | None, policy: SamplingPolicy, eagle: EagleParts | None = None
) -> Proposer:
    if case.proposer == "eagle":
        if eagle is None:
            raise ValueError("an end-to-end eagle case needs the target model and an EAGLE draft network")
        return EagleProposer(
            budget=case.budget,
            manifest_hash="e2e",
            policy=policy,
            model=eagle.target,
            draft=eagle.network,
            checkpoint=target_fingerprint(eagle.target),
            sampling=case.sampling,
        )
    if case.proposer == "draft_model":
        if draft is None:
            raise ValueError("an end-to-end draft_model case needs a draft backend")
        return DraftModelProposer(
            budget=case.budget, manifest_hash="e2e", policy=policy, backend=draft, sampling=case.sampling
        )
    if case.proposer == "prompt_lookup":
        return PromptLookupProposer(budget=case.budget, manifest_hash="e2e")
    if case.proposer == "merged":  # the sources a run builds: a draft chain and prompt lookup
        sources = [
            make_proposer(
                replace(case, proposer=name, budget=sub_budget(proposer_class(name), case.budget)),
                draft=draft,
                policy=policy,
            )
            for name in MERGED_SOURCES
        ]
        return MergedProposer(budget=case.budget, manifest_hash="e2e", sources=sources, policy=policy)
    raise ValueError(f"unknown end-to-end proposer {case.proposer!r}; one of draft_model, prompt_lookup, merged, eagle")


#: the sources of the end-to-end merged cases
MERGED_SOURCES = ("draft_model", "prompt_lookup")


def misrecorded_q_proposer(
    *,
    budget: Budget,
    policy: SamplingPolicy,
    backend: CausalLMBackend,
    sampling: str = "iid",
    q_temperature: float = 0.5,
) -> Proposer:
    """NEGATIVE CONTROL (test-only): a draft proposer that samples from the draft's law but
    records ``q`` with an extra temperature applied to q only (``q_rec ∝ q ** (1 / q_temperature)``),
    the bug of a proposer whose policy and recorded law drift apart. Every contract check passes
    (``q_rec`` is a valid law, node ``q`` agrees with it); only the end-to-end oracle sees it."""

    class MisrecordedQProposer(DraftModelProposer):
        def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
            result = super().propose(committed, rng)
            if result.q_dists is None or not result.nodes:
                return result
            q_rec = result.q_dists.pow(1.0 / q_temperature)  # [N, V]
            q_rec = q_rec / q_rec.sum(dim=-1, keepdim=True)
            nodes = tuple(replace(n, q=float(q_rec[i, n.token_id])) for i, n in enumerate(result.nodes))
            return replace(result, nodes=nodes, q_dists=q_rec)

    return MisrecordedQProposer(
        budget=budget, manifest_hash="e2e-negative-control", policy=policy, backend=backend, sampling=sampling
    )


def pruned_sampled_dynamic_proposer(case: E2ECase, *, policy: SamplingPolicy, eagle: EagleParts) -> Proposer:
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

    return PrunedSampledDynamic(
        budget=wide,
        manifest_hash="e2e-negative-control",
        policy=policy,
        model=eagle.target,
        draft=eagle.network,
        checkpoint=target_fingerprint(eagle.target),
        sampling=case.sampling,
    )


def case_capabilities(case: E2ECase):

    options = {"sampling": case.sampling} if case.proposer in ("draft_model", "eagle") else {}
    if case.proposer == "merged":
        options = {"sources": list(MERGED_SOURCES), "draft_model": {"sampling": case.sampling}, "prompt_lookup": {}}
    return proposer_class(case.proposer).declare(options, case.budget)


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
    merged = Budget(shape="merged", max_nodes=6, max_depth=2)
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
        E2ECase("merged/draft+lookup/T1", "merged", merged, t1, "iid"),
        E2ECase("merged/draft+lookup/T0", "merged", merged, greedy, "iid"),
        E2ECase("eagle/beam/dynamic/T0/2-rounds", "eagle", dynamic, greedy, "beam", rounds=2),
        E2ECase("eagle/beam/dynamic/T1", "eagle", dynamic, t1, "beam"),
        E2ECase("eagle/wor/dynamic/T0.8-topk3-topp0.9", "eagle", dynamic, trunc, "without_replacement"),
        E2ECase("eagle/iid/dynamic/T0.8-topk3-topp0.9", "eagle", dynamic, trunc, "iid"),
        E2ECase("eagle/iid/seq1/T1/2-rounds", "eagle", seq1, t1, "iid", length=2, rounds=2),
    ]


def applicable(case: E2ECase, verifier: Verifier) -> bool:
    """Whether a run would negotiate this proposer x topology x verifier x temperature."""

    try:
        negotiate(case_capabilities(case), verifier, temperature=case.policy.temperature)
    except NegotiationError:
        return False
    return True


@dataclass
class E2EModels:
    target: CausalLMBackend
    draft: CausalLMBackend
    eagle: EagleParts | None = None

    @classmethod
    def build(cls, *, seed: int = 0, vocab: int = 5) -> E2EModels:
        """Target: 2 layers; draft: a different 1-layer model (so q differs from p); an EAGLE draft
        network over the target's features."""
        target = oracle_model(seed=seed, vocab=vocab)
        return cls(
            target=CausalLMBackend(target),
            draft=CausalLMBackend(oracle_model(seed=seed + 101, vocab=vocab, num_layers=1)),
            eagle=EagleParts(target=target, network=oracle_eagle_network(target, seed=seed + 202)),
        )


def check_e2e_case(
    verifier: Verifier,
    case: E2ECase,
    models: E2EModels,
    *,
    prompt_ids: Sequence[int] = E2E_PROMPT,
    proposer_factory: Callable[[E2ECase, CausalLMBackend | None, SamplingPolicy], Proposer] | None = None,
    max_leaves: int = MAX_LEAVES,
) -> dict:
    """Run one end-to-end case; a row like :func:`harness.gates.oracle.check_case`'s."""
    t0 = time.perf_counter()
    policy = _as_float64(case.policy)
    factory = proposer_factory or (lambda c, d, p: make_proposer(c, draft=d, policy=p, eagle=models.eagle))
    proposer = factory(case, models.draft, policy)
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
    joint = direct_target_joint(models.target.model, prompt_ids, policy, case.length)
    err = max_abs_error(law, joint)
    return {
        "verifier": verifier.name,
        "case": f"e2e/{case.name}",
        "kind": "end_to_end",
        "max_abs_error": err,
        "bound": MARGINAL_ATOL,
        "passed": err <= MARGINAL_ATOL,
        "leaves": stats.get("selections", 0),
        "proposals": stats.get("proposals", 0),
        "relation": sorted(case_capabilities(case).sampling_relations)[0],
        "seconds": time.perf_counter() - t0,
    }


def run_e2e_suite(
    verifier_names: Sequence[str], *, models: E2EModels | None = None, cases: Sequence[E2ECase] | None = None
) -> list[dict]:
    """Every standard end-to-end case each named verifier negotiates; one row per case."""

    models = models or E2EModels.build()
    rows = []
    for name in verifier_names:
        verifier = VERIFIERS[name]()
        if not verifier.exact:
            raise ValueError(f"verifier {name!r} is heuristic (exact=False): the oracle does not apply")
        for case in cases if cases is not None else standard_cases():
            if applicable(case, verifier):
                rows.append(check_e2e_case(verifier, case, models))
    return rows


#: (verifier, standard case) pairs the end-to-end negative control runs with a misrecorded q
NEGATIVE_CONTROL_CASES = (("specinfer", "draft/iid/set2/T1"), ("rejection", "draft/iid/seq2/T1"))


def negative_control_rows(models: E2EModels | None = None) -> list[dict]:
    """The end-to-end negative control: :func:`misrecorded_q_proposer` under exact verifiers.
    Each row is EXPECTED to fail (``passed`` False); ``negative_control`` marks them."""

    models = models or E2EModels.build()
    by_name = {c.name: c for c in standard_cases()}
    rows = []
    for verifier_name, case_name in NEGATIVE_CONTROL_CASES:
        case = by_name[case_name]
        row = check_e2e_case(
            VERIFIERS[verifier_name](),
            case,
            models,
            proposer_factory=lambda c, d, p: misrecorded_q_proposer(
                budget=c.budget, policy=p, backend=d, sampling=c.sampling
            ),
        )
        row["case"] = f"e2e-negative/misrecorded-q/{case_name}"
        row["negative_control"] = True
        rows.append(row)
    return rows


__all__ = [
    "DEFAULT_LENGTH",
    "E2ECase",
    "E2EModels",
    "EagleParts",
    "E2E_PROMPT",
    "Float64Policy",
    "LOGIT_SCALE",
    "applicable",
    "check_e2e_case",
    "continuation_law",
    "direct_target_joint",
    "e2e_output_law",
    "emitted_tokens",
    "fork",
    "make_proposer",
    "misrecorded_q_proposer",
    "negative_control_rows",
    "oracle_eagle_network",
    "oracle_model",
    "pruned_sampled_dynamic_proposer",
    "propose_and_verify",
    "run_e2e_suite",
    "select_and_commit",
    "speculative_round",
    "standard_cases",
]
