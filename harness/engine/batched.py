"""Batched speculative rounds: B requests, each with its own candidate tree, ONE target forward.

A round of :func:`decode_batch`:

    for each live request b:  proposer_b.propose(committed_b, rng_b) -> compile_tree -> tree_b
    BatchedBackend.verify(state, pending, [tree_b])      one forward, rows padded to 1 + max N_b
    for each live request b:  Verifier.select(tree_b, policy.probs(logits_b), rng_b)
    BatchedBackend.commit(state, ..., [accepted_b])      per request, ragged lengths
    emit (EOS / max_new_tokens truncate per request); finished requests leave the batch

Per-request state. Proposers keep per-request state (a draft cache, a lookup cursor), so the loop
takes one proposer per batch slot (``proposers[k]`` serves the k-th request of the batch; build
them with ``engine.build.build_proposer``); each request has its own ``RandomSource``. The
verifier and the sampling policy are the batch-1 code, called once per request on that request's
real logit rows only, so the verifiers' exactness (and the oracles) hold per request unchanged.
Draft models still run one request at a time inside ``propose`` (batching the draft is future
work): their cost grows with B, and the proposal stage records it. Draft-head proposers (medusa,
hydra, clover) read the target's hidden rows through a batch-1 forward tap, which ignores batched
forwards: at B > 1 they propose nothing (``hidden_misses``), so their runs stay exact but degenerate
to batched autoregressive decoding until the batched verify hands them per-request hidden rows.

Exactness. At temperature 0 each request's tokens equal this same loop run with
:class:`~harness.proposers.prompt_lookup.NullProposer` slots (batched autoregressive decoding of the
same batch composition), and equal batch-1 decoding except at near-ties (CPU matrix kernels are not
shape-invariant: a batched forward's logits differ from batch 1 in the last bits; the gates' rule
``harness.runner.NEAR_TIE_LOGIT_TOL`` decides).

Early finish. A request that emits EOS or reaches ``max_new_tokens`` leaves the batch at the end of
that round (``BatchedBackend.drop`` removes its cache row; see the backend's docstring).

Timing and records. One :class:`~harness.measure.ledger.StageClock` times the batch round's
stages; :class:`BatchLedger` holds the per-batch-round costs (proposal = all requests' proposals,
target_verify = the one shared forward), rows, padding and temporary KV bytes. Each request also
gets a :class:`~harness.engine.decode.DecodeResult` whose ``RoundLedger`` counts its own acceptance
and carries its own proposal/retrieval/packing/selection times plus the shared verify and commit
times in full (the request waited for them); its ``decode_ms`` is its completion time since the
batch's decode start (its latency), and ``round_end_ms`` the batch rounds' ends while it was live.
Temporary KV bytes per batch round: ``real`` = the bytes of the candidate rows the requests
proposed (``sum_b N_b`` rows), ``padded`` = what the forward actually appended for candidate slots
(``B (R - 1)`` rows, padding included, pending rows excluded; asserted against the measured cache
growth). ``hole_bytes`` = masked stale slots below the physical length (the ragged layout's cost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from harness.engine.decode import DecodeResult, RoundConfig
from harness.measure.ledger import STAGES, RoundLedger, StageClock
from harness.proposers.base import Proposer
from harness.random_source import RandomSource
from harness.target.batched import BatchedBackend
from harness.topology.compiler import compile_tree, validate_candidate_graph, validate_commit
from harness.verifiers.base import Verifier
from harness.verifiers.sampling import SamplingPolicy


@dataclass
class BatchLedger:
    """Per-batch-round counters (one ``observe_round`` per target forward)."""

    rounds: int = 0
    live_total: int = 0  # sum over rounds of live requests
    real_rows_total: int = 0  # candidate rows proposed
    padded_rows_total: int = 0  # candidate slots computed (padding included)
    temp_kv_bytes_real_peak: int = 0
    temp_kv_bytes_padded_peak: int = 0
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
    ) -> None:
        self.rounds += 1
        self.live_total += live
        self.real_rows_total += real_rows
        self.padded_rows_total += padded_rows
        self.temp_kv_bytes_real_peak = max(self.temp_kv_bytes_real_peak, temp_kv_real_bytes)
        self.temp_kv_bytes_padded_peak = max(self.temp_kv_bytes_padded_peak, temp_kv_padded_bytes)
        self.hole_bytes_peak = max(self.hole_bytes_peak, hole_bytes)
        for k, v in stage_ms.items():
            self.stage_ms[k] = self.stage_ms.get(k, 0.0) + v
        self.round_ms.append(sum(stage_ms.values()))

    def merge(self, other: BatchLedger) -> None:
        for name in ("rounds", "live_total", "real_rows_total", "padded_rows_total"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("temp_kv_bytes_real_peak", "temp_kv_bytes_padded_peak", "hole_bytes_peak"):
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

    @property
    def throughput_tokens_per_s(self) -> float | None:
        return self.committed_tokens / (self.decode_ms / 1e3) if self.decode_ms > 0 else None


@dataclass
class _Live:
    """One live request's loop state."""

    index: int  # position in the batch's prompt list
    proposer: Proposer
    rng: RandomSource
    committed: list[int]
    generated: list[int] = field(default_factory=list)
    ledger: RoundLedger = None
    round_end_ms: list[float] = field(default_factory=list)
    round_tokens: list[int] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    finished_by: str | None = None
    ttft_ms: float | None = None
    done_ms: float | None = None


def decode_batch(
    *,
    target: BatchedBackend,
    proposers: Sequence[Proposer],
    verifier: Verifier,
    policy: SamplingPolicy,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    rngs: Sequence[RandomSource],
    round_cfg: RoundConfig,
    on_round: Callable | None = None,
) -> BatchDecodeResult:
    """Decode ``len(prompts)`` requests together; ``proposers[k]`` and ``rngs[k]`` serve prompt k."""
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
    clock = StageClock(target.device)
    bpt = target.bytes_per_token
    t_start = clock.now()
    state = target.prefill(prompts)
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
    while live:
        own: list[dict[str, float]] = []
        trees = []
        t_prop = clock.now()
        for req in live:  # proposal + packing, per request
            t0 = time.perf_counter()
            retrieval_before = req.proposer.stats.retrieval_ms
            proposal = req.proposer.propose(req.committed, req.rng)
            retrieval = req.proposer.stats.retrieval_ms - retrieval_before
            t1 = time.perf_counter()
            tree = compile_tree(
                [proposal], prefix_len=len(req.committed), max_nodes=round_cfg.max_nodes, max_depth=round_cfg.max_depth
            )
            if req.ledger.rounds < round_cfg.validate_rounds:
                validate_candidate_graph(tree)
            t2 = time.perf_counter()
            own.append({"proposal": (t1 - t0) * 1e3 - retrieval, "retrieval": retrieval, "packing": (t2 - t1) * 1e3})
            trees.append(tree)
        t_verify = clock.now()
        pending = [req.committed[-1] for req in live]
        holes = state.hole_slots() * bpt
        out = target.verify(state, pending, trees)
        t_select = clock.now()
        selections = []
        for k, req in enumerate(live):
            t0 = time.perf_counter()
            probs = policy.probs(out.logits[k])  # [1 + N_k, V] real rows only
            selections.append(verifier.select(trees[k], probs, req.rng))
            own[k]["selection"] = (time.perf_counter() - t0) * 1e3
        t_commit = clock.now()
        for k, req in enumerate(live):
            if req.ledger.rounds < round_cfg.validate_rounds:
                validate_commit(trees[k], selections[k].accepted_rows)
        target.commit(state, pending, trees, [s.accepted_rows for s in selections])
        t_end = clock.now()
        verify_ms, commit_ms = (t_select - t_verify) * 1e3, (t_end - t_commit) * 1e3
        expected_added = len(live) * out.rows * bpt
        if out.kv_bytes_added != expected_added:
            raise AssertionError(
                f"verify appended {out.kv_bytes_added} KV bytes, expected B*R*bytes_per_token = {expected_added}"
            )
        batch_ledger.observe_round(
            live=len(live),
            real_rows=out.real_candidate_rows,
            padded_rows=out.padded_candidate_rows,
            stage_ms={
                "proposal": (t_verify - t_prop) * 1e3 - sum(o["retrieval"] + o["packing"] for o in own),
                "retrieval": sum(o["retrieval"] for o in own),
                "packing": sum(o["packing"] for o in own),
                "target_verify": verify_ms,
                "selection": (t_commit - t_select) * 1e3,
                "temporary_state": commit_ms,
            },
            temp_kv_real_bytes=out.real_candidate_rows * bpt,
            temp_kv_padded_bytes=out.padded_candidate_rows * bpt,
            hole_bytes=holes,
        )
        now = (clock.now() - t_decode) * 1e3
        finished_rows = []
        for k, req in enumerate(live):
            tree, sel = trees[k], selections[k]
            new = [int(tree.token_ids[r]) for r in sel.accepted_rows] + [sel.next_token]
            room = max_new_tokens - len(req.generated)
            emitted = []
            for tok in new[:room]:
                emitted.append(tok)
                if tok in eos_token_ids:
                    req.finished_by = "eos"
                    break
            counted = min(len(sel.accepted_rows), len(emitted))
            for r in sel.accepted_rows[:counted]:
                for s in tree.sources[r]:
                    req.sources[s] = req.sources.get(s, 0) + 1
            first_child = tree.children(-1)
            req.ledger.observe_round(
                tree_depth=int(tree.depths.max()) if tree.num_rows else 0,
                num_rows=tree.num_rows,
                accepted=counted,
                committed=len(emitted),
                first_child_hit=bool(sel.accepted_rows)
                and sel.accepted_rows[0] == (first_child[0] if first_child else -2),
                stage_ms={**own[k], "target_verify": verify_ms, "temporary_state": commit_ms},
                temp_kv_bytes=tree.num_rows * bpt,
            )
            req.generated.extend(emitted)
            req.committed.extend(emitted)
            if req.ttft_ms is None:
                req.ttft_ms = prefill_ms + now
            req.round_end_ms.append(now)
            req.round_tokens.append(len(emitted))
            if req.finished_by is None and len(req.generated) >= max_new_tokens:
                req.finished_by = "max_new_tokens"
            if req.finished_by is not None:
                req.done_ms = now
                finished_rows.append(k)
        if on_round is not None:
            on_round(
                live=[req.index for req in live],
                trees=trees,
                selections=selections,
                output=out,
                state=state,
                finished=[live[k].index for k in finished_rows],
            )
        for k in finished_rows:
            live[k].proposer.finish()
            done.append(live[k])
        target.drop(state, finished_rows)
        live = [req for k, req in enumerate(live) if k not in set(finished_rows)]
        for req in live:
            req.proposer.observe_commit(req.committed)
    decode_ms = (clock.now() - t_decode) * 1e3
    done.sort(key=lambda r: r.index)
    results = [
        DecodeResult(
            tokens=r.generated,
            prefill_ms=prefill_ms,
            ttft_ms=r.ttft_ms or prefill_ms,
            decode_ms=r.done_ms,
            ledger=r.ledger,
            round_end_ms=r.round_end_ms,
            round_tokens=r.round_tokens,
            sources=r.sources,
            finished_by=r.finished_by,
        )
        for r in done
    ]
    return BatchDecodeResult(requests=results, prefill_ms=prefill_ms, decode_ms=decode_ms, ledger=batch_ledger)


def batches(n: int, batch_size: int) -> list[list[int]]:
    """Consecutive item indices in groups of ``batch_size`` (the last group may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def merged_proposer_extras(proposers: Sequence[Proposer]) -> dict:
    """Slot proposers' ``stats.extras`` merged into one record entry: counters (numbers) summed;
    ``max_*`` maxed; ``mean_*`` and ``*_rate`` averaged weighted by each slot's ``rounds`` (plain
    mean without it; None when no slot has a value); ``last_*`` and non-numbers from the first slot."""

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    out: dict = {}
    for key in dict.fromkeys(k for p in proposers for k in p.stats.extras):
        slots = [p.stats.extras for p in proposers if key in p.stats.extras]
        values = [ex[key] for ex in slots]
        nums = [(v, ex.get("rounds", 1)) for v, ex in zip(values, slots) if number(v)]
        if key.startswith("last_") or not nums or len(nums) != len([v for v in values if v is not None]):
            out[key] = values[0]
        elif key.startswith("max_"):
            out[key] = max(v for v, _ in nums)
        elif key.startswith("mean_") or key.endswith("_rate"):
            w = sum(r for _, r in nums if number(r))
            out[key] = (sum(v * r for v, r in nums) / w) if w else sum(v for v, _ in nums) / len(nums)
        else:
            out[key] = sum(v for v, _ in nums)
    return out


# --------------------------------------------------------------------------- the runner's two arms


class BatchedArms:
    """Both arms of a run at ``batch_size = B``: the prompts in consecutive batches of B (the last may
    be smaller), the autoregressive arm (NullProposer slots, the baseline verifier) and the
    speculative arm (the configured proposer slots and verifier) on the same batch composition, the
    order alternating per batch. Request ``i`` uses the seed ``seed * 1_000_003 + i`` in both arms
    (the batch-1 runner's seed), so its random stream is the same at every batch size."""

    def __init__(
        self,
        *,
        target: BatchedBackend,
        spec_proposers: Sequence[Proposer],
        null_proposers: Sequence[Proposer],
        spec_verifier: Verifier,
        ar_verifier: Verifier,
        policy: SamplingPolicy,
        prompts: Sequence[list[int]],
        seed: int,
        batch_size: int,
        max_new_tokens: int,
        eos_token_ids: frozenset[int],
        round_cfg: RoundConfig,
        rng_factory: Callable[[int], RandomSource],
    ) -> None:
        if batch_size < 1 or len(spec_proposers) < batch_size or len(null_proposers) < batch_size:
            raise ValueError(
                f"batch_size={batch_size} needs that many proposer slots per arm; got "
                f"{len(spec_proposers)} and {len(null_proposers)}"
            )
        self.target, self.policy, self.round_cfg = target, policy, round_cfg
        self.arms = {"ar": (list(null_proposers), ar_verifier), "spec": (list(spec_proposers), spec_verifier)}
        self.prompts, self.seed, self.batch_size = list(prompts), int(seed), batch_size
        self.max_new_tokens, self.eos = max_new_tokens, eos_token_ids
        self.rng_factory = rng_factory
        self.results: dict[str, list[BatchDecodeResult]] = {"ar": [], "spec": []}
        self.batch_of: dict[int, int] = {}

    def _run(self, arm: str, idx: list[int], max_new_tokens: int) -> BatchDecodeResult:
        proposers, verifier = self.arms[arm]
        return decode_batch(
            target=self.target,
            proposers=proposers[: len(idx)],
            verifier=verifier,
            policy=self.policy,
            prompts=[self.prompts[i] for i in idx],
            max_new_tokens=max_new_tokens,
            eos_token_ids=self.eos,
            rngs=[self.rng_factory(self.seed * 1_000_003 + i) for i in idx],
            round_cfg=self.round_cfg,
        )

    def warmup(self, tokens: int) -> None:
        idx = list(range(min(self.batch_size, len(self.prompts))))
        for arm in ("ar", "spec"):
            self._run(arm, idx, max(int(tokens), 1))

    def pairs(self):
        """Yield ``(ar, spec)`` DecodeResults in prompt order, running one batch (both arms) at a time."""
        for j, idx in enumerate(batches(len(self.prompts), self.batch_size)):
            out = {}
            for arm in ("ar", "spec") if j % 2 == 0 else ("spec", "ar"):
                out[arm] = self._run(arm, idx, self.max_new_tokens)
                self.results[arm].append(out[arm])
            for k, i in enumerate(idx):
                self.batch_of[i] = j
                yield out["ar"].requests[k], out["spec"].requests[k]

    def prompt_fields(self, i: int) -> dict:
        """Extra per-prompt record fields: the batch the prompt ran in and its wall times."""
        j = self.batch_of[i]
        return {
            "batch_index": j,
            "batch_requests": len(self.results["spec"][j].requests),
            "spec_batch_decode_ms": self.results["spec"][j].decode_ms,
            "ar_batch_decode_ms": self.results["ar"][j].decode_ms,
        }

    def metrics(self, *, bytes_per_token: int, max_nodes: int) -> dict:
        """Batch-level metrics; ``time_per_committed_token_ms``, ``speedup``, throughputs, round costs
        and temporary KV bytes replace the per-request forms of the batch-1 runner."""
        out: dict = {"batches": len(self.results["spec"])}  # the batch size itself is an axis
        for arm, prefix in (("spec", ""), ("ar", "ar_")):
            res = self.results[arm]
            ms = sum(r.decode_ms for r in res)
            tok = sum(r.committed_tokens for r in res)
            per_req = [r.decode_ms / len(r.tokens) for b in res for r in b.requests if r.tokens]
            out[f"{prefix}throughput_tokens_per_s"] = tok / (ms / 1e3) if ms else None
            out[f"{prefix}batch_time_per_token_ms"] = ms / tok if tok else None
            out[f"{prefix}request_time_per_token_ms_mean"] = sum(per_req) / len(per_req) if per_req else None
            out[f"{prefix}request_time_per_token_ms_p95"] = _quantile(per_req, 0.95)
            ledger = BatchLedger()
            for r in res:
                ledger.merge(r.ledger)
            s = ledger.summary()
            if arm == "spec":
                out.update(s)
                cost = s["batch_round_cost_ms"]
                total = sum(cost.values())
                out["round_cost_ms"] = cost
                out["round_cost_non_verify_share"] = (1.0 - cost["target_verify"] / total) if total else None
                out["temp_kv_bytes_peak"] = s["temp_kv_bytes_padded_peak"]
                out["temp_kv_bytes_formula"] = s["temp_kv_bytes_padded_peak"]  # B (R - 1) rows x bytes per token
            else:
                out["ar_round_cost_ms"] = s["batch_round_cost_ms"]
                out["ar_batch_rounds"] = s["batch_rounds"]
        out["time_per_committed_token_ms"] = out["batch_time_per_token_ms"]
        out["ar_time_per_token_ms"] = out["ar_batch_time_per_token_ms"]
        tpt, ar_tpt = out["time_per_committed_token_ms"], out["ar_time_per_token_ms"]
        out["speedup"] = ar_tpt / tpt if (tpt and ar_tpt) else None
        rt, ar_rt = out["request_time_per_token_ms_mean"], out["ar_request_time_per_token_ms_mean"]
        out["request_speedup"] = ar_rt / rt if (rt and ar_rt) else None
        spec_slots = self.arms["spec"][0][: self.batch_size]
        out["proposal_state_bytes"] = sum(p.state_bytes() for p in spec_slots)
        out["retrieval"] = merged_proposer_extras(spec_slots)
        out["temp_kv_bytes_budget_formula_batch"] = self.batch_size * max_nodes * bytes_per_token
        out["batch_metric_notes"] = {
            "time_per_committed_token_ms": "batch wall decode time / committed tokens, summed over batches "
            "(1000 / throughput); speedup = the AR arm's / this, same batches",
            "request_time_per_token_ms": "per request: its completion time since the batch's decode start / its tokens",
            "request_speedup": "AR mean request time per token / speculative mean, same batches",
            "round_cost_ms": "per batch round (one target forward): proposal/packing/selection summed over requests",
            "temp_kv_bytes_peak": "padded: B (R - 1) candidate slots the verify forward appended (pending rows "
            "excluded); temp_kv_bytes_real_peak: the rows the requests proposed",
            "ragged_hole_bytes_peak": "masked stale slots below the shared physical cache length",
            "per_prompt.spec_decode_ms": "the request's latency inside its batch (not the batch wall time)",
        }
        return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import torch

    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))
