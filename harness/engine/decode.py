"""The round loop: B requests (B = 1 included), each with its own candidate tree, ONE target forward.

A round of :func:`decode_batch`:

    for each live request b:  proposer_b.propose(committed_b, rng_b) -> compile_tree -> tree_b
    CausalLMBackend.verify(state, pending, [tree_b])     one forward, rows padded to 1 + max N_b
    for each live request b:  Verifier.select_logits(tree_b, logits_b, policy, rng_b)
                              (select on policy.probs(logits_b); greedy reads the argmax alone)
    CausalLMBackend.commit(state, [accepted_b])         per request, ragged lengths
    for each live request b:  emit (EOS / max_new_tokens truncate), RoundLedger.observe_round
    finished requests leave the batch (CausalLMBackend.drop)

Near the end of a request the tree is compiled no deeper than the round can commit (the tokens
left, less the bonus token): the proposer reads that depth as
:attr:`~harness.proposers.base.Proposer.depth_cap` before proposing, and may draft only so deep.

One code path serves both arms: the autoregressive baseline is this loop with
:class:`~harness.proposers.base.NullProposer` slots (an empty tree: one target step per round), so
the baseline is measured by the same clock, on the same prompts and seeds. :func:`decode` is a
batch of one. The batch-1 fast paths live in the backend (no mask for a chain, a crop for a
contiguous accepted path), chosen from what the round already knows.

Per-request state. Proposers keep per-request state (a draft cache, a lookup cursor), so the loop
takes one proposer per request (``proposers[k]`` serves prompt k) and one random source per
request. The verifier and the sampling policy run once per request on that request's real logit
rows only, so the verifiers' exactness (and the oracles) hold per request.

Exactness. At temperature 0 each request's tokens equal this loop run with NullProposer slots on
the same batch composition, and batch-1 decoding, except at near-ties: CPU matrix kernels are not
shape-invariant, so a forward's logits differ in the last bits with its batch and with its number
of rows (a pending row verified beside candidates, or alone).

Timing. One :class:`~harness.measure.ledger.StageClock` (device-synchronised) times the stages.
:class:`BatchLedger` holds the per-batch-round costs (proposal = every request's proposal,
target_verify = the one shared forward), rows, padding and temporary KV bytes; each request's
:class:`~harness.measure.ledger.RoundLedger` counts its own acceptance and carries its own
proposal/retrieval/packing/selection times plus the shared verify and commit times in full (it
waited for them). The stages cover the whole round, each round starting where the last one ended, so
the batch rounds' stages add up to the batch's decode time: proposal includes what a proposer learns
from the last commit and from the verify forward's time, and a finishing request's ``finish`` (an
index of its output); temporary state is the commit, the requests' tokens and counters, and the
cache's compaction when requests leave. The loop's own record of a round (the ledgers, the lists of
live and finished requests) falls in the next round's proposal stage, which starts at the round's
end, and the batch's decode time ends at its last round's end, so the identity is exact. A request's
``decode_ms`` is its completion time since the batch's decode start.
Temporary KV bytes per batch round: ``real`` = the candidate rows the requests proposed
(``sum_b N_b``), ``padded`` = what the forward appended for candidate slots (``B (R - 1)`` rows,
pending rows excluded; asserted against the measured cache growth); ``hole_bytes`` = masked stale
slots below the physical length (the ragged layout's cost, zero at B = 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from harness.contracts import Capabilities, ContractError, ProposalResult, Selection
from harness.measure.ledger import SHARED_ROUND_STAGES, STAGES, RoundLedger, StageClock
from harness.proposers.base import Proposer
from harness.random_source import RandomSource
from harness.target.backend import CausalLMBackend
from harness.topology.compiler import CompiledTree, compile_tree, validate_candidate_graph, validate_commit
from harness.verifiers.base import Verifier
from harness.verifiers.sampling import SamplingPolicy


@dataclass
class RoundConfig:
    max_nodes: int
    max_depth: int
    validate_rounds: int = 1  # the candidate-graph and commit assertions on each request's first k rounds (untimed)
    temp_kv_budget_bytes: int | None = None


@dataclass
class DecodeResult:
    """One request's result."""

    tokens: list[int]  # generated token ids (EOS included when produced)
    prefill_ms: float  # the batch's prefill: target prompt forward and every proposer's start()
    ttft_ms: float  # prefill + the request's first round
    decode_ms: float  # the request's completion time since the batch's decode start (prefill excluded)
    ledger: RoundLedger
    round_end_ms: list[float] = field(default_factory=list)  # each round's end since decode start
    round_tokens: list[int] = field(default_factory=list)  # tokens emitted by each round
    sources: dict[str, int] = field(default_factory=dict)  # accepted tokens attributed to each source
    finished_by: str = "max_new_tokens"
    # the end of the verify forward that gave the request's first tokens, since decode start (before
    # that round's selection and commit); None where it ran no round
    first_forward_end_ms: float | None = None


@dataclass
class BatchLedger:
    """Per-batch-round counters (one ``observe_round`` per target forward)."""

    rounds: int = 0
    live_total: int = 0  # sum over rounds of live requests
    real_rows_total: int = 0  # candidate rows proposed
    padded_rows_total: int = 0  # candidate slots computed (padding included)
    temp_kv_bytes_real_peak: int = 0
    temp_kv_bytes_padded_peak: int = 0
    temp_kv_bytes_measured_peak: int = 0  # what the verify forwards appended to the cache past the pending rows
    hole_bytes_peak: int = 0
    stage_ms: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    round_ms: list[float] = field(default_factory=list)

    def observe_round(
        self,
        *,
        live: int,
        real_rows: int,
        padded_rows: int,
        stage_ms: dict[str, float],
        temp_kv_real_bytes: int,
        temp_kv_padded_bytes: int,
        hole_bytes: int,
        temp_kv_measured_bytes: int = 0,
    ) -> None:
        self.rounds += 1
        self.live_total += live
        self.real_rows_total += real_rows
        self.padded_rows_total += padded_rows
        self.temp_kv_bytes_real_peak = max(self.temp_kv_bytes_real_peak, temp_kv_real_bytes)
        self.temp_kv_bytes_padded_peak = max(self.temp_kv_bytes_padded_peak, temp_kv_padded_bytes)
        self.temp_kv_bytes_measured_peak = max(self.temp_kv_bytes_measured_peak, temp_kv_measured_bytes)
        self.hole_bytes_peak = max(self.hole_bytes_peak, hole_bytes)
        for k, v in stage_ms.items():
            self.stage_ms[k] = self.stage_ms.get(k, 0.0) + v
        self.round_ms.append(sum(stage_ms.values()))

    def merge(self, other: BatchLedger) -> None:
        for name in ("rounds", "live_total", "real_rows_total", "padded_rows_total"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in (
            "temp_kv_bytes_real_peak",
            "temp_kv_bytes_padded_peak",
            "temp_kv_bytes_measured_peak",
            "hole_bytes_peak",
        ):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))
        for k, v in other.stage_ms.items():
            self.stage_ms[k] = self.stage_ms.get(k, 0.0) + v
        self.round_ms.extend(other.round_ms)

    def summary(self) -> dict:
        r = max(self.rounds, 1)
        return {
            "batch_rounds": self.rounds,
            "target_forwards": self.rounds,
            "mean_live_requests": self.live_total / r if self.rounds else None,
            "batch_round_cost_ms": {k: v / r for k, v in self.stage_ms.items()},
            "padded_row_fraction": (
                1.0 - self.real_rows_total / self.padded_rows_total if self.padded_rows_total else None
            ),
            "temp_kv_bytes_real_peak": self.temp_kv_bytes_real_peak,
            "temp_kv_bytes_padded_peak": self.temp_kv_bytes_padded_peak,
            "temp_kv_bytes_measured_peak": self.temp_kv_bytes_measured_peak,
            "ragged_hole_bytes_peak": self.hole_bytes_peak,
        }


@dataclass
class BatchDecodeResult:
    requests: list[DecodeResult]  # in the order of the prompts
    prefill_ms: float
    decode_ms: float  # batch wall time, every round, prefill excluded
    ledger: BatchLedger

    @property
    def committed_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)


@dataclass
class _Live:
    """One live request's loop state."""

    index: int  # position in the batch's prompt list
    proposer: Proposer
    rng: RandomSource
    committed: list[int]
    ledger: RoundLedger
    generated: list[int] = field(default_factory=list)
    round_end_ms: list[float] = field(default_factory=list)
    round_tokens: list[int] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    finished_by: str | None = None
    ttft_ms: float | None = None
    first_forward_end_ms: float | None = None
    done_ms: float | None = None
    commit_unobserved: bool = False  # the proposer has not yet been told of the last round's commit
    # what the proposer declared (its probability semantics and sampling relations): every proposal is held to it
    capabilities: Capabilities | None = None

    def __post_init__(self) -> None:
        if self.capabilities is None:
            self.capabilities = self.proposer.capabilities()

    def emit(self, tree: CompiledTree, sel: Selection, *, max_new_tokens: int, eos):
        """The round's tokens (:func:`round_tokens`), cut at EOS or the token budget (what follows is
        neither emitted nor counted). Returns (emitted, accepted tokens counted)."""
        accepted_rows = sel.accepted_rows
        new = round_tokens(tree, sel)
        emitted = []
        for tok in new[: max_new_tokens - len(self.generated)]:
            emitted.append(tok)
            if tok in eos:
                self.finished_by = "eos"
                break
        counted = min(len(accepted_rows), len(emitted))
        for r in accepted_rows[:counted]:
            for s in tree.sources[r]:
                self.sources[s] = self.sources.get(s, 0) + 1
        self.generated.extend(emitted)
        self.committed.extend(emitted)
        if self.finished_by is None and len(self.generated) >= max_new_tokens:
            self.finished_by = "max_new_tokens"
        return emitted, counted


# --------------------------------------------------------------------------- one request's round step
# What a round does for one request, apart from the target's forward and commit that the batch shares.
# The statistical gate and the end-to-end oracle call these same functions for their rounds, so what
# they test at temperature > 0 is the step the measured loop runs (its compile arguments, the policy
# and random source it hands the verifier, the tokens it emits); the end-to-end oracle's rounds also
# draft under the depth cap of a request's last rounds, its output length standing for max_new_tokens.


def propose_round(
    proposer: Proposer,
    committed: list[int],
    rng: RandomSource,
    *,
    max_depth: int | None,
    tokens_left: int | None = None,
) -> tuple[ProposalResult, int | None]:
    """One request's proposal for a round: ``proposer.propose(committed, rng)``, with the depth the
    round may commit (the tokens left less the bonus token, where ``tokens_left`` is given and that is
    below ``max_depth``) set as the proposer's :attr:`~harness.proposers.base.Proposer.depth_cap`
    while it proposes. Returns the proposal and the depth to compile it to (:func:`compile_round`).
    Raises :class:`~harness.contracts.ContractError` for a proposal bound to another manifest."""
    depth = max_depth
    if tokens_left is not None:  # a round commits at most the tokens left: the accepted rows and the bonus token
        depth = tokens_left - 1 if max_depth is None else min(max_depth, tokens_left - 1)
    proposer.depth_cap = depth if depth != max_depth else None
    try:
        proposal = proposer.propose(committed, rng)
    finally:  # the cap is this round's: a gate or the next request proposes uncapped
        proposer.depth_cap = None
    if proposal.manifest_hash != proposer.manifest_hash:
        raise ContractError(
            f"proposer {proposer.name!r} returned a proposal bound to manifest "
            f"{proposal.manifest_hash!r}, not its own {proposer.manifest_hash!r}: a stale proposal, "
            "index or cache would feed this round"
        )
    return proposal, depth


def compile_round(
    proposal: ProposalResult,
    committed: list[int],
    *,
    max_nodes: int | None,
    depth: int | None,
    capabilities: Capabilities | None = None,
):
    """The round's candidate tree: ``proposal`` compiled after ``committed``, at most ``max_nodes``
    rows, no deeper than ``depth`` (what :func:`propose_round` returned); given the proposer's
    ``capabilities``, a proposal of other probability semantics or sampling relation is refused (the
    verifier was negotiated for the declared ones)."""
    return compile_tree(
        [proposal], prefix_len=len(committed), max_nodes=max_nodes, max_depth=depth, capabilities=capabilities
    )


def select_round(
    verifier: Verifier, tree: CompiledTree, logits: torch.Tensor, policy: SamplingPolicy, rng: RandomSource
) -> Selection:
    """The round's selection on the target's ``logits`` ``[1 + N, V]`` for ``tree`` (row 0: the
    frontier): ``policy.probs`` then ``verifier.select``, or what the verifier computes equally from
    the logits (:meth:`~harness.verifiers.base.Verifier.select_logits`), drawing from ``rng`` after
    the proposal's draws."""
    return verifier.select_logits(tree, logits, policy, rng)


def round_tokens(tree: CompiledTree, sel: Selection) -> list[int]:
    """The tokens a round commits before any EOS or token-budget cut: the accepted path's tokens,
    then the bonus or correction token."""
    return [int(tree.token_ids[r]) for r in sel.accepted_rows] + [int(sel.next_token)]


# the stages one forward or one commit serves for every request of a batch round, as the loop fills them
if SHARED_ROUND_STAGES != ("target_verify", "temporary_state"):
    raise ImportError(
        f"the decode loop fills the shared stages target_verify and temporary_state, not {SHARED_ROUND_STAGES}"
    )


def decode_batch(
    *,
    target: CausalLMBackend,
    proposers: Sequence[Proposer],
    verifier: Verifier,
    policy: SamplingPolicy,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    rngs: Sequence[RandomSource],
    round_cfg: RoundConfig,
    on_round: Callable | None = None,
    full_batch: int | None = None,
) -> BatchDecodeResult:
    """Decode ``len(prompts)`` requests together; ``proposers[k]`` and ``rngs[k]`` serve prompt k.

    ``full_batch`` (default ``len(prompts)``): the run's batch size. A round's verify time reaches
    the live proposers' cost models (:meth:`Proposer.observe_verify`) only when that many requests
    shared the forward, the batch size their measured t(n) was taken at.

    ``on_round`` (optional) is called after each batch round's commit with ``live`` (request
    indices), ``trees``, ``selections``, ``emitted`` (per live request), ``output`` (the verify
    output), ``state`` and ``finished`` (request indices leaving the batch)."""
    b = len(prompts)
    if b < 1:
        raise ValueError("decode_batch needs at least one prompt")
    if len(proposers) < b or len(rngs) != b:
        raise ValueError(
            f"need >= {b} proposers (one per batch slot) and {b} random sources; got {len(proposers)}, {len(rngs)}"
        )
    if len({id(p) for p in proposers[:b]}) != b:
        raise ValueError("each batch slot needs its own proposer instance (proposers keep per-request state)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    # the proposers' devices too (a draft on another GPU): a stage's time holds the kernels it launched
    clock = StageClock(target.device, also=set().union(*(p.devices() for p in proposers[:b])))
    bpt = target.bytes_per_token
    t_start = clock.now()
    # the slots decoding can append: every new token, plus the last round's unaccepted rows
    state = target.prefill(prompts, reserve=max_new_tokens + round_cfg.max_nodes + 1)
    live = [
        _Live(
            index=k,
            proposer=proposers[k],
            rng=rngs[k],
            committed=list(prompts[k]),
            ledger=RoundLedger(max_depth=round_cfg.max_depth),
        )
        for k in range(b)
    ]
    for req in live:
        req.proposer.start(list(req.committed))
    prefill_ms = (clock.now() - t_start) * 1e3
    done: list[_Live] = []
    batch_ledger = BatchLedger()
    t_decode = clock.now()
    t_prop = t_decode
    while live:
        own: list[dict[str, float]] = []
        trees = []
        for req in live:  # proposal + packing, per request
            t0 = clock.now()
            if req.commit_unobserved:  # what the proposer learns from the last round is proposal work
                req.proposer.observe_commit(req.committed)
                req.commit_unobserved = False
            retrieval_before = req.proposer.stats.retrieval_ms
            proposal, depth = propose_round(
                req.proposer,
                req.committed,
                req.rng,
                max_depth=round_cfg.max_depth,
                tokens_left=max_new_tokens - len(req.generated),
            )
            retrieval = req.proposer.stats.retrieval_ms - retrieval_before
            t1 = clock.now()
            tree = compile_round(
                proposal, req.committed, max_nodes=round_cfg.max_nodes, depth=depth, capabilities=req.capabilities
            )
            if req.ledger.rounds < round_cfg.validate_rounds:  # a check of the loop, not a cost of the method
                with clock.unclocked():
                    validate_candidate_graph(tree)
            t2 = clock.now()
            own.append({"proposal": (t1 - t0) * 1e3 - retrieval, "retrieval": retrieval, "packing": (t2 - t1) * 1e3})
            trees.append(tree)
        t_verify = clock.now()
        pending = [req.committed[-1] for req in live]
        holes = state.hole_slots() * bpt
        out = target.verify(state, pending, trees)
        t_select = clock.now()
        selections = []
        for k, req in enumerate(live):
            t0 = clock.now()
            selections.append(select_round(verifier, trees[k], out.logits[k], policy, req.rng))  # [1 + N_k, V]
            own[k]["selection"] = (clock.now() - t0) * 1e3
        t_commit = clock.now()
        if any(req.ledger.rounds < round_cfg.validate_rounds for req in live):
            with clock.unclocked():
                for k, req in enumerate(live):
                    if req.ledger.rounds < round_cfg.validate_rounds:
                        validate_commit(trees[k], selections[k].accepted_rows)
        target.commit(state, [s.accepted_rows for s in selections])
        t_end = clock.now()
        verify_ms = (t_select - t_verify) * 1e3
        if out.kv_bytes_added != len(live) * out.rows * bpt:
            raise ContractError(
                f"verify appended {out.kv_bytes_added} KV bytes, expected B*R*bytes_per_token "
                f"= {len(live) * out.rows * bpt}"
            )
        if len(live) == (b if full_batch is None else full_batch):  # the forward their t(n) curve prices
            for k, req in enumerate(live):  # what a proposer learns from the forward's time is its own work
                t0 = clock.now()
                req.proposer.observe_verify(out.rows, verify_ms)
                own[k]["proposal"] += (clock.now() - t0) * 1e3
        t_observed = clock.now()
        now = (t_observed - t_decode) * 1e3
        finished_rows, emitted_all, observations = [], [], []
        for k, req in enumerate(live):
            tree, sel = trees[k], selections[k]
            emitted, counted = req.emit(tree, sel, max_new_tokens=max_new_tokens, eos=eos_token_ids)
            emitted_all.append(emitted)
            first_child = tree.children(-1)
            depth = int(tree.depths.max()) if tree.num_rows else 0
            # how deep the round tried: one level past the accepted path where the node it stopped at
            # has children (they were tried and rejected), the accepted path alone where it stopped at a
            # leaf (a shallower branch of a deeper tree: nothing was offered below it), and where EOS or
            # the token budget cut the round, the depths up to the cut (those past it were accepted, not
            # tried and rejected); the round series keeps the tree's depth
            cut = counted < len(sel.accepted_rows)
            stop = sel.accepted_rows[counted - 1] if counted else -1
            tried = counted if cut else counted + (1 if tree.children(stop) else 0)
            observations.append(
                dict(
                    tree_depth=depth,
                    depth_tried=tried,
                    num_rows=tree.num_rows,
                    accepted=counted,
                    committed=len(emitted),
                    first_child_hit=bool(sel.accepted_rows)
                    and sel.accepted_rows[0] == (first_child[0] if first_child else -2),
                    temp_kv_bytes=tree.num_rows * bpt,
                )
            )
            if req.ttft_ms is None:
                req.ttft_ms = prefill_ms + now
                req.first_forward_end_ms = (t_select - t_decode) * 1e3
            req.round_end_ms.append(now)
            req.round_tokens.append(len(emitted))
            if req.finished_by is not None:
                finished_rows.append(k)
        if on_round is not None:
            on_round(
                live=[req.index for req in live],
                trees=trees,
                selections=selections,
                emitted=emitted_all,
                output=out,
                state=state,
                finished=[live[k].index for k in finished_rows],
            )
        finish_ms = 0.0
        for k in finished_rows:  # a finishing request's proposer indexes its output: its own proposal work
            t0 = clock.now()
            live[k].proposer.finish()
            took = (clock.now() - t0) * 1e3
            own[k]["proposal"] += took
            finish_ms += took
        target.drop(state, finished_rows)  # the cache compacts the requests left: the round's temporary state
        t_round_end = clock.now()
        # the round's time, t_prop to t_round_end, in its stages: proposal (the proposals, what the
        # proposers learn from the forward's time, a finishing request's index of its output), target
        # verify, selection, and temporary state (the commit, the requests' tokens and counters, and
        # the cache's compaction when requests leave)
        retrieval_ms = sum(o["retrieval"] for o in own)
        packing_ms = sum(o["packing"] for o in own)
        proposal_ms = (t_verify - t_prop + t_observed - t_end) * 1e3 + finish_ms - retrieval_ms - packing_ms
        selection_ms = (t_commit - t_select) * 1e3
        commit_ms = (t_end - t_commit + t_round_end - t_observed) * 1e3 - finish_ms
        # the loops' own time around each request's timed span (clock reads, the depth cap, the
        # lists) is the round's too: shared evenly, so the requests' rows add up to the round's
        for stage, total in (("proposal", proposal_ms), ("selection", selection_ms)):
            share = (total - sum(o[stage] for o in own)) / len(own)
            for o in own:
                o[stage] += share
        shared = {"target_verify": verify_ms, "temporary_state": commit_ms}  # SHARED_ROUND_STAGES
        # the ledgers' records and the lists of requests are timed with the next round's proposal (its
        # stage starts at this round's end); the batch's decode time ends at the last round's end
        batch_ledger.observe_round(
            live=len(live),
            real_rows=out.real_candidate_rows,
            padded_rows=out.padded_candidate_rows,
            stage_ms={
                "proposal": proposal_ms,
                "retrieval": retrieval_ms,
                "packing": packing_ms,
                "selection": selection_ms,
                **shared,
            },
            temp_kv_real_bytes=out.real_candidate_rows * bpt,
            temp_kv_padded_bytes=out.padded_candidate_rows * bpt,
            hole_bytes=holes,
            temp_kv_measured_bytes=out.kv_bytes_added - len(live) * bpt,  # the cache's growth, pending rows aside
        )
        for k, req in enumerate(live):
            req.ledger.observe_round(stage_ms={**own[k], **shared}, **observations[k])
        if finished_rows:  # a request's time includes its proposer's finish and its drop
            for k in finished_rows:
                live[k].done_ms = (t_round_end - t_decode) * 1e3
                live[k].round_end_ms[-1] = live[k].done_ms  # its last round ends there too: the ITLs sum to it
                done.append(live[k])
        gone = set(finished_rows)
        live = [req for k, req in enumerate(live) if k not in gone]
        for req in live:
            req.commit_unobserved = True
        t_prop = t_round_end  # the next round starts where this one ends: the stages add up to the wall
    decode_ms = (t_prop - t_decode) * 1e3  # the last round's end: the batch rounds add up to it
    done.sort(key=lambda r: r.index)
    results = [
        DecodeResult(
            tokens=r.generated,
            prefill_ms=prefill_ms,
            ttft_ms=r.ttft_ms if r.ttft_ms is not None else prefill_ms,
            decode_ms=r.done_ms,
            ledger=r.ledger,
            round_end_ms=r.round_end_ms,
            round_tokens=r.round_tokens,
            sources=r.sources,
            finished_by=r.finished_by,
            first_forward_end_ms=r.first_forward_end_ms,
        )
        for r in done
    ]
    return BatchDecodeResult(requests=results, prefill_ms=prefill_ms, decode_ms=decode_ms, ledger=batch_ledger)


def decode(
    *,
    target: CausalLMBackend,
    proposer: Proposer,
    verifier: Verifier,
    policy: SamplingPolicy,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    rng: RandomSource,
    round_cfg: RoundConfig,
    on_round: Callable | None = None,
) -> DecodeResult:
    """One request: :func:`decode_batch` on a batch of one."""
    return decode_batch(
        target=target,
        proposers=[proposer],
        verifier=verifier,
        policy=policy,
        prompts=[list(prompt_ids)],
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        rngs=[rng],
        round_cfg=round_cfg,
        on_round=on_round,
    ).requests[0]


def check_temp_kv_budget(*, max_nodes: int, bytes_per_token: int, budget_bytes: int | None, batch_size: int = 1) -> int:
    """Refuse, before any model work, a topology whose candidate rows could exceed the budget.
    Returns the temporary-KV formula value B * N * L * 2 * H_kv * d_h * b (B requests of N rows)."""
    need = batch_size * max_nodes * bytes_per_token
    if budget_bytes is not None and need > budget_bytes:
        raise ContractError(
            f"topology.max_nodes={max_nodes} x generation.batch_size={batch_size} needs {need} bytes of temporary "
            f"KV ({bytes_per_token} bytes per candidate row), over generation.temp_kv_budget_bytes={budget_bytes}"
        )
    return need


def batches(n: int, batch_size: int) -> list[list[int]]:
    """Consecutive item indices in groups of ``batch_size`` (the last group may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
