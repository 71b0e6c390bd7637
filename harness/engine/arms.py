"""Both arms of a run and every decode metric of its record, defined once whatever the batch size.

The prompts run in consecutive batches of B (the last may be smaller; B = 1 is a batch of one): the
autoregressive arm (NullProposer slots, the baseline verifier) and the speculative arm (the
configured proposer slots and verifier) on the same batch composition. Which arm runs first
alternates with the batch and, within a batch, with the turn (batch ``j``'s turn ``t`` starts with
the baseline where ``j + t`` is even), so over a run's batches each turn is started as often by one
arm as by the other (alternating per step alone gave every two-turn conversation's first turn to the
baseline first and its second to the speculative arm); each turn's record names the arm that ran
first. A prompt may be a conversation of several turns: a batch of B conversations advances turn by
turn (one step per turn: the conversations that have that turn, both arms), and each arm's prompt
for turn k is built by ``follow_up`` from that arm's OWN answers to turns 1..k-1, so each arm is
timed on the conversation it produced. Request ``(i, turn)`` uses the seed
``seed * 1_000_003 + i + turn * 1_000_000_007`` in both arms, so its random stream is the same at
every batch size (turn 0: ``seed * 1_000_003 + i``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from harness.engine.decode import BatchDecodeResult, BatchLedger, DecodeResult, RoundConfig, batches, decode_batch
from harness.measure.ledger import RoundLedger
from harness.measure.memory import DevicePeak
from harness.proposers.base import Proposer
from harness.random_source import RandomSource
from harness.target.backend import CausalLMBackend
from harness.verifiers.base import Verifier
from harness.verifiers.sampling import SamplingPolicy

ARMS = ("ar", "spec")

#: what each decode metric means (written into every record)
METRIC_NOTES = {
    "time_per_committed_token_ms": (
        "batch wall decode time / committed tokens, summed over batches (prefill excluded; at batch 1 the batch "
        "is its one request, and its wall time that request's latency, per_prompt.spec_decode_ms, which harness "
        "compare reads): the round loop's cost per token; decode_speedup = the AR arm's / this"
    ),
    "end_to_end_time_per_token_ms": (
        "(prefill + decode) / committed tokens: prefill is the target's prompt forward plus every proposer's "
        "start (the prompt forward of a draft model, an EAGLE draft or a Hydra prefix layer, a head's state "
        "warm-up), so the speculative arm pays for its draft"
    ),
    "speedup": "AR end-to-end time per token / speculative end-to-end time per token, same prompts and batches",
    "speedup_ci95": (
        "95% paired-bootstrap interval over prompts of the end-to-end speedup, resampling the per-prompt times "
        "the speedup divides (decode_speedup_ci95 likewise); None below two prompts and at batch > 1"
    ),
    "ttft_ms": (
        "prefill (target and proposer start) + the request's first round, averaged over every request (each "
        "turn of a conversation is one); per_prompt.spec_ttft_ms is the conversation's first turn's, and "
        "per_prompt.turns[].spec_ttft_ms each turn's"
    ),
    "request_time_per_token_ms": "per request: its completion time since its batch's decode start / its tokens",
    "request_speedup": "AR mean request time per token / speculative mean, same batches",
    "mean_committed_per_round": "bonus/correction token included",
    "accepted_by_source": (
        "proposer=merged: accepted tokens by the source that proposed each accepted row; a row several sources "
        "proposed counts for each of them, so the counts can sum past the accepted tokens; a source none of "
        "whose rows was accepted is absent"
    ),
    "mean_accepted_per_round": "accepted candidate tokens only (bonus excluded)",
    "round_cost_ms": "per batch round (one target forward): proposal/packing/selection summed over live requests",
    "itl_ms": "each round's duration split evenly over the tokens it emitted",
    "temp_kv_bytes_peak": (
        "measured: what a verify forward appended to the cache past the pending rows, the B (R - 1) candidate "
        "slots with padding (temp_kv_bytes_formula: the same from the forwards' row counts); "
        "temp_kv_bytes_real_peak: the rows the requests proposed"
    ),
    "ragged_hole_bytes_peak": "masked stale slots below the shared physical cache length (0 at batch 1)",
    "per_prompt.spec_decode_ms": (
        "the request's latency inside its batch (not the batch wall time), summed over a conversation's turns"
    ),
    "per_prompt.turns": "one entry per turn of the conversation: the same fields for that turn's request",
    "per_prompt.spec_prefill_ms": (
        "the prefill the request waited for: at batch > 1 its batch's whole prefill, so summed over requests it "
        "counts a batch's prefill once per request (the *_prefill_ms_total metrics count it once)"
    ),
    "per_prompt.prompt_sha256": "16 hex digits of the prompt's text, messages and turns: pairs prompts across runs",
    "conversation_turns": "(prompt, turn) requests measured: a two-turn conversation counts 2",
    "batch_requests": (
        "requests of each batch step in order (a conversation's later turns are further steps of its batch, with the "
        "conversations that have that turn): the last batch holds fewer than batch_size when the prompts are not a "
        "multiple of it"
    ),
    "fallback_rate": "fraction of rounds with no candidate row (the round committed the target's token only)",
    "first_child_coverage": (
        "among rounds with candidates, the fraction whose accepted path starts at the root's first child "
        "(the proposer's top-ranked first token)"
    ),
    "mean_candidate_rows": (
        "candidate rows per request per round, mean over the requests' rounds (at batch size B one verify "
        "forward carries the rows of up to B requests)"
    ),
    "proposal_state_bytes": (
        "the proposers' state in bytes as each reports it (a draft's KV cache, head state: its peak), summed over "
        "the batch's slots: above batch 1 the sum of each slot's own peak, an upper bound on their simultaneous peak"
    ),
    "per_turn": "the decode metrics of the requests of each turn (1 = the first user turn)",
    "rounds_tried_by_depth": (
        "rounds that tried depth d (the walk reached depth d-1 and the tree had a row at d): the trials behind "
        "acceptance_by_depth[d]; rounds_accepted_by_depth: rounds that accepted a token at d (reach = that / rounds)"
    ),
    "cuda_peak_allocated_bytes": (
        "peak CUDA bytes allocated over the speculative arm's measured batches, counters reset before each batch; "
        "reserved: the caching allocator's pool at its peak over them, which keeps what the job's earlier work "
        "(the other arm, the gates) reserved (no cache is emptied inside a timed job), so it tells the arms apart "
        "only where one outgrows that pool; ar_cuda_peak_*: the AR arm's, whose allocated peak counts what stays "
        "resident while it runs (a draft's or heads' weights, which an AR deployment would not hold); each the sum "
        "of the peaks of every CUDA "
        "device the arms run on (the target's and a draft's on another GPU, the same devices for both arms); None "
        "where none is CUDA"
    ),
    "peak_rss_bytes": "this job's peak host resident set (peak_rss_method says how it was measured)",
    "context": (
        "the positions every turn's prompt had to fit (prompt + max_new_tokens + candidate rows) and the rule "
        "(refuse | left); truncated_turns counts the turns the left cut shortened in either arm, cut_tokens the "
        "tokens it removed from the speculative arm's prompts, ar_cut_tokens from the AR arm's (they differ only "
        "in later turns, built from each arm's own answers)"
    ),
    "timing_outliers": (
        "prompts whose decode time per round in one arm is 3x or more that arm's median over the run's prompts "
        "(three or more prompts): a stall, not the method; their speedups are suspect, and so is the run's if the "
        "list is long"
    ),
    "spec_bench_speedup": (
        "Spec-Bench's statistic (its evaluation/speed.py): mean over prompts of speculative tokens / wall s, "
        "over the same mean for AR; wall = each turn's prefill + decode, summed over turns (a ratio of means, "
        "unlike speedup's ratio of sums)"
    ),
    "spec_bench_speed_py_speedup": (
        "what Spec-Bench's evaluation/speed.py prints for this run's exported answer files: spec_bench_speedup "
        "with the baseline's tokens recounted from its answer text, minus one for a BOS (per turn: "
        "per_prompt.turns.ar_speed_py_tokens); it differs where the tokenizer adds no BOS or the text "
        "re-tokenizes otherwise; None without a tokenizer"
    ),
}


def itl_samples(res: DecodeResult) -> list[float]:
    """Inter-token latency per emitted token: each round's duration split evenly over its tokens."""
    out, prev = [], 0.0
    for end, n in zip(res.round_end_ms, res.round_tokens):
        if n:
            out.extend([(end - prev) / n] * n)
        prev = end
    return out


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return float(torch.quantile(torch.tensor(list(values), dtype=torch.float64), q))


#: extras that are a slot's state or the index it shares, not counters: the first slot's
SLOT_STATE = frozenset({"adaptive_budget", "leakage", "datastore_tokens", "datastore_release_id", "datastore_path"})


def merged_proposer_extras(proposers: Sequence[Proposer]) -> dict:
    """Slot proposers' ``stats.extras`` merged into one record entry (:func:`merge_extras`)."""
    return merge_extras([p.stats.extras for p in proposers])


def merge_extras(slots: Sequence[Mapping]) -> dict:
    """Per-slot extras merged: counters (numbers) summed; ``max_*`` maxed; ``mean_*``, ``*_rate`` and
    ``*_per_round`` averaged weighted by each slot's ``rounds`` (plain mean without it; None when no
    slot has a value); ``final_*`` (a slot's state at its end, an adaptive threshold) averaged over
    the slots; ``*_hist`` (lists of counts by index) summed index by index; nested dicts (per
    source, a datastore's counters) merged by the same rules, key by key; ``last_*``,
    :data:`SLOT_STATE` and other values from the first slot."""

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    out: dict = {}
    for key in dict.fromkeys(k for ex in slots for k in ex):
        having = [ex for ex in slots if key in ex]
        values = [ex[key] for ex in having]
        nums = [(v, ex.get("rounds", 1)) for v, ex in zip(values, having) if number(v)]
        nested = values and all(isinstance(v, Mapping) for v in values)
        if nested and not key.startswith("last_") and key not in SLOT_STATE:
            out[key] = merge_extras(values)
        elif (
            key.endswith("_hist") and values and all(isinstance(v, list) and all(number(c) for c in v) for v in values)
        ):
            out[key] = [sum(v[i] for v in values if i < len(v)) for i in range(max(map(len, values)))]
        elif (
            key in SLOT_STATE
            or key.startswith("last_")
            or not nums
            or len(nums) != len([v for v in values if v is not None])
        ):
            out[key] = copy.deepcopy(values[0])  # a copy: the live list or dict goes on counting
        elif key.startswith("max_"):
            out[key] = max(v for v, _ in nums)
        elif key.startswith("final_"):
            out[key] = sum(v for v, _ in nums) / len(nums)
        elif key.startswith("mean_") or key.endswith(("_rate", "_per_round")):
            w = sum(r for _, r in nums if number(r))
            out[key] = (sum(v * r for v, r in nums) / w) if w else sum(v for v, _ in nums) / len(nums)
        else:
            out[key] = sum(v for v, _ in nums)
    return out


#: how each request's random source is seeded (:meth:`Arms.seed_of`), as the manifest states it
SEED_RULE = (
    "one TorchRandomSource per request, the same in both arms, seeded seed * 1000003 + prompt index "
    "+ turn * 1000000007 (turn 0 the first user turn; prompt index in the workload's order)"
)


@dataclass
class ArmsResult:
    """What the two arms measured: per arm, one BatchDecodeResult per step (a batch's turn), in order."""

    batch_size: int
    batches: dict[str, list[BatchDecodeResult]] = field(default_factory=lambda: {a: [] for a in ARMS})
    batch_of: dict[int, int] = field(default_factory=dict)  # prompt index -> batch index
    #: (prompt index, turn) -> (step index, position in that step's requests)
    slot: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    step_turn: list[int] = field(default_factory=list)  # turn of each step
    step_first: list[str] = field(default_factory=list)  # the arm that ran first in each step
    turns_of: dict[int, int] = field(default_factory=dict)  # prompt index -> turns run
    # per arm: peak CUDA (allocated, reserved) bytes over its measured steps; (None, None) off CUDA
    device_peak: dict[str, tuple[int | None, int | None]] = field(
        default_factory=lambda: {a: (None, None) for a in ARMS}
    )

    def add_step(self, turn: int, idx: Sequence[int], results: dict[str, BatchDecodeResult]) -> None:
        """Record one step's results; ``results`` holds the arms in the order they ran."""
        k = len(self.step_turn)
        self.step_turn.append(turn)
        self.step_first.append(next(iter(results)))
        for arm in ARMS:
            self.batches[arm].append(results[arm])
        for pos, i in enumerate(idx):
            self.slot[(i, turn)] = (k, pos)
            self.turns_of[i] = max(self.turns_of.get(i, 0), turn + 1)

    def request(self, arm: str, i: int, turn: int = 0) -> DecodeResult:
        k, pos = self.slot[(i, turn)]
        return self.batches[arm][k].requests[pos]

    def requests(self, arm: str) -> list[DecodeResult]:
        return [r for b in self.batches[arm] for r in b.requests]

    def turn_fields(self, i: int, turn: int) -> dict:
        """One turn's request fields: both arms' times, tokens and rounds, and the step it ran in."""
        ar, spec = self.request("ar", i, turn), self.request("spec", i, turn)
        k, _ = self.slot[(i, turn)]
        return {
            "turn": turn + 1,
            "spec_decode_ms": spec.decode_ms,
            "spec_tokens": len(spec.tokens),
            "ar_decode_ms": ar.decode_ms,
            "ar_tokens": len(ar.tokens),
            "spec_prefill_ms": spec.prefill_ms,
            "ar_prefill_ms": ar.prefill_ms,
            "spec_ttft_ms": spec.ttft_ms,
            "ar_ttft_ms": ar.ttft_ms,
            "spec_rounds": spec.ledger.rounds,
            "ar_rounds": ar.ledger.rounds,
            "batch_requests": len(self.batches["spec"][k].requests),
            "first_arm": self.step_first[k],
            "spec_batch_decode_ms": self.batches["spec"][k].decode_ms,
            "ar_batch_decode_ms": self.batches["ar"][k].decode_ms,
        }

    def prompt_fields(self, i: int) -> dict:
        """Per-prompt record fields: both arms' times, tokens and rounds summed over the prompt's turns
        (TTFT: the first turn's), the batch it ran in, and every turn's own fields under ``turns``."""
        turns = [self.turn_fields(i, t) for t in range(self.turns_of[i])]
        summed = (
            "spec_decode_ms",
            "spec_tokens",
            "ar_decode_ms",
            "ar_tokens",
            "spec_prefill_ms",
            "ar_prefill_ms",
            "spec_rounds",
            "ar_rounds",
            "spec_batch_decode_ms",
            "ar_batch_decode_ms",
        )
        return {
            **{key: sum(t[key] for t in turns) for key in summed},
            "spec_ttft_ms": turns[0]["spec_ttft_ms"],
            "ar_ttft_ms": turns[0]["ar_ttft_ms"],
            "batch_index": self.batch_of[i],
            "batch_requests": turns[0]["batch_requests"],
            "turns": turns,
        }

    def round_series(self, arm: str = "spec") -> list[dict]:
        """Every round of ``arm``, request by request in prompt and turn order: ``prompt_index``,
        ``turn`` (1 = the first user turn, as in the record), ``batch_index`` and the round's row of
        :meth:`RoundLedger.rounds_table` (at B > 1 a request's stage times include the shared verify
        and commit in full)."""
        rows = []
        for i in sorted(self.batch_of):
            for turn in range(self.turns_of[i]):
                for row in self.request(arm, i, turn).ledger.rounds_table():
                    rows.append({"prompt_index": i, "turn": turn + 1, "batch_index": self.batch_of[i], **row})
        return rows

    def observe_device_peak(self, arm: str, peak: tuple[int | None, int | None]) -> None:
        old = self.device_peak[arm]
        self.device_peak[arm] = tuple(  # type: ignore[assignment]
            None if new is None else max(new, prev or 0) for new, prev in zip(peak, old)
        )

    def spec_bench_speedup(self) -> float | None:
        """Spec-Bench's speedup statistic over the prompts (see METRIC_NOTES)."""
        rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for i, n in sorted(self.turns_of.items()):
            for arm in ARMS:
                reqs = [self.request(arm, i, t) for t in range(n)]
                wall_ms = sum(r.prefill_ms + r.decode_ms for r in reqs)
                if wall_ms <= 0:
                    return None
                rates[arm].append(sum(len(r.tokens) for r in reqs) / (wall_ms / 1e3))
        if not rates["spec"] or not sum(rates["ar"]):
            return None
        return (sum(rates["spec"]) / len(rates["spec"])) / (sum(rates["ar"]) / len(rates["ar"]))

    def turn_metrics(self) -> dict[str, dict]:
        """Per turn (``"1"``, ``"2"``, ...): the requests, tokens, decode time per token and decode
        speedup of that turn."""
        out: dict[str, dict] = {}
        for turn in sorted(set(self.step_turn)):
            steps = [k for k, t in enumerate(self.step_turn) if t == turn]
            entry: dict = {"requests": sum(len(self.batches["spec"][k].requests) for k in steps)}
            for arm in ("spec", "ar"):
                res = [self.batches[arm][k] for k in steps]
                ms = sum(r.decode_ms for r in res)
                tok = sum(r.committed_tokens for r in res)
                rounds = sum(q.ledger.rounds for r in res for q in r.requests)
                entry["committed_tokens" if arm == "spec" else "ar_tokens"] = tok
                entry["time_per_committed_token_ms" if arm == "spec" else "ar_time_per_token_ms"] = (
                    ms / tok if tok else None
                )
                if arm == "spec":
                    entry["rounds"] = rounds
                    entry["mean_committed_per_round"] = tok / rounds if rounds else None
            tpt, ar_tpt = entry["time_per_committed_token_ms"], entry["ar_time_per_token_ms"]
            entry["decode_speedup"] = ar_tpt / tpt if (tpt and ar_tpt) else None  # decode time only
            out[str(turn + 1)] = entry
        return out

    def metrics(self) -> dict:
        """Every decode metric of the record (proposal-side state and artifacts are the runner's)."""
        out: dict = {
            "batches": len(set(self.batch_of.values())),
            "batch_requests": [len(b.requests) for b in self.batches["spec"]],
            "conversation_turns": len(self.slot),
            "per_turn": self.turn_metrics(),
            "spec_bench_speedup": self.spec_bench_speedup(),
        }
        for arm, prefix in (("spec", ""), ("ar", "ar_")):
            allocated, reserved = self.device_peak[arm]
            out[f"{prefix}cuda_peak_allocated_bytes"] = allocated
            out[f"{prefix}cuda_peak_reserved_bytes"] = reserved
        for arm, prefix in (("spec", ""), ("ar", "ar_")):
            res = self.batches[arm]
            reqs = self.requests(arm)
            ms = sum(r.decode_ms for r in res)
            prefill_ms = sum(r.prefill_ms for r in res)  # the target's prompt forward and every proposer's start
            tok = sum(r.committed_tokens for r in res)
            per_req = [r.decode_ms / len(r.tokens) for r in reqs if r.tokens]
            itl = [x for r in reqs for x in itl_samples(r)]
            out[f"{prefix}throughput_tokens_per_s"] = tok / (ms / 1e3) if ms else None
            out[f"{prefix}request_time_per_token_ms_mean"] = sum(per_req) / len(per_req) if per_req else None
            out[f"{prefix}request_time_per_token_ms_p95"] = quantile(per_req, 0.95)
            out[f"{prefix}ttft_ms"] = sum(r.ttft_ms for r in reqs) / len(reqs) if reqs else None
            out[f"{prefix}itl_ms_p50"] = quantile(itl, 0.5)
            out[f"{prefix}itl_ms_p95"] = quantile(itl, 0.95)
            out["committed_tokens" if arm == "spec" else "ar_tokens"] = tok
            out["time_per_committed_token_ms" if arm == "spec" else "ar_time_per_token_ms"] = ms / tok if tok else None
            out[f"{prefix}end_to_end_time_per_token_ms"] = (ms + prefill_ms) / tok if tok else None
            out[f"{prefix}prefill_ms_total"] = prefill_ms
            batch_ledger = BatchLedger()
            for r in res:
                batch_ledger.merge(r.ledger)
            s = batch_ledger.summary()
            cost = s["batch_round_cost_ms"]
            if arm == "ar":
                out["ar_round_cost_ms"] = cost
                out["ar_batch_rounds"] = s["batch_rounds"]
                continue
            out.update({k: v for k, v in s.items() if k != "batch_round_cost_ms"})
            total = sum(cost.values())
            out["round_cost_ms"] = cost
            out["round_cost_non_verify_share"] = (1.0 - cost["target_verify"] / total) if total else None
            out["temp_kv_bytes_peak"] = s["temp_kv_bytes_measured_peak"]
            ledger = RoundLedger()
            sources: dict[str, int] = {}
            for r in reqs:
                ledger.merge(r.ledger)
                for k, v in r.sources.items():
                    sources[k] = sources.get(k, 0) + v
            summary = ledger.summary()
            for key in (
                "rounds",
                "mean_committed_per_round",
                "mean_accepted_per_round",
                "acceptance_by_depth",
                "reach_by_depth",
                "accepted_length_hist",
                "rounds_tried_by_depth",
                "rounds_accepted_by_depth",
                "first_child_coverage",
                "fallback_rate",
                "mean_candidate_rows",
            ):
                out[key] = summary[key]
            out["accepted_by_source"] = sources
        tpt, ar_tpt = out["time_per_committed_token_ms"], out["ar_time_per_token_ms"]
        out["decode_speedup"] = ar_tpt / tpt if (tpt and ar_tpt) else None
        e2e, ar_e2e = out["end_to_end_time_per_token_ms"], out["ar_end_to_end_time_per_token_ms"]
        out["speedup"] = ar_e2e / e2e if (e2e and ar_e2e) else None
        rt, ar_rt = out["request_time_per_token_ms_mean"], out["ar_request_time_per_token_ms_mean"]
        out["request_speedup"] = ar_rt / rt if (rt and ar_rt) else None
        return out


#: builds turn ``turn`` (>= 1) of prompt ``i`` for ``arm`` from that arm's answers to turns 0..turn-1
FollowUp = Callable[[int, int, str, list[list[int]]], list[int]]


class Arms:
    """Runs both arms batch by batch, a conversation's turns in order (see the module docstring)."""

    def __init__(
        self,
        *,
        target: CausalLMBackend,
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
        turns: Sequence[int] | None = None,
        follow_up: FollowUp | None = None,
    ) -> None:
        if batch_size < 1 or len(spec_proposers) < batch_size or len(null_proposers) < batch_size:
            raise ValueError(
                f"batch_size={batch_size} needs that many proposer slots per arm; got "
                f"{len(spec_proposers)} and {len(null_proposers)}"
            )
        turns = [1] * len(prompts) if turns is None else [int(n) for n in turns]
        if len(turns) != len(prompts) or any(n < 1 for n in turns):
            raise ValueError(f"turns needs one count >= 1 per prompt; got {turns} for {len(prompts)} prompts")
        if max(turns, default=1) > 1 and follow_up is None:
            raise ValueError("conversations of several turns need follow_up to build each later turn's prompt")
        self.target, self.policy, self.round_cfg = target, policy, round_cfg
        self.slots = {"ar": (list(null_proposers), ar_verifier), "spec": (list(spec_proposers), spec_verifier)}
        #: what each slot's proposer had learned before any round of this job (the warm-up's are put
        #: back to it; work after the measurement that must start where it started reads it too)
        self.learned_at_start = {arm: [p.snapshot_learning() for p in self.slots[arm][0]] for arm in ARMS}
        self.prompts, self.seed, self.batch_size = list(prompts), int(seed), batch_size
        self.turns, self.follow_up = turns, follow_up
        self.max_new_tokens, self.eos = max_new_tokens, eos_token_ids
        self.rng_factory = rng_factory
        self.result = ArmsResult(batch_size=batch_size)
        # every device the arms' work runs on (a draft on another GPU): both arms read the same devices
        others = {d for arm in ARMS for p in self.slots[arm][0] for d in p.devices()}
        self.device_peak = DevicePeak(target.device, also=tuple(sorted(others, key=str)))

    def seed_of(self, i: int, turn: int) -> int:
        """The seed of prompt ``i``'s request at ``turn`` (0-based), in both arms: :data:`SEED_RULE`."""
        return self.seed * 1_000_003 + i + turn * 1_000_000_007

    def _run(self, arm: str, idx: list[int], prompts: list[list[int]], turn: int, max_new_tokens: int):
        proposers, verifier = self.slots[arm]
        # the autoregressive arm runs the target as it runs with no proposer built on it: the hooks
        # through which proposers read its hidden rows would slow its forwards (a hooked model takes
        # transformers' own path) and make the speculative arm look faster than it is
        with contextlib.ExitStack() as unhooked:
            if arm == "ar":
                for proposer in self.slots["spec"][0]:
                    unhooked.enter_context(proposer.target_unhooked())
            return decode_batch(
                target=self.target,
                proposers=proposers[: len(idx)],
                verifier=verifier,
                policy=self.policy,
                prompts=prompts,
                max_new_tokens=max_new_tokens,
                eos_token_ids=self.eos,
                rngs=[self.rng_factory(self.seed_of(i, turn)) for i in idx],
                round_cfg=self.round_cfg,
                full_batch=self.batch_size,
            )

    def warmup(self, tokens: int) -> None:
        """Both arms on the first batch's first turn (excluded from every metric: the proposers'
        counters restart after it, so their figures in the record count measured rounds only, they
        forget its requests, so no measured request searches the warm-up's outputs, and what they
        learned from its rounds is put back as it was, so the first measured request does not start
        from what they learned on its own first tokens). ``tokens`` 0: no warm-up, the first measured
        request pays every first-call cost."""
        if int(tokens) <= 0:
            return
        idx = list(range(min(self.batch_size, len(self.prompts))))
        for arm in ARMS:
            self._run(arm, idx, [self.prompts[i] for i in idx], 0, int(tokens))
        for arm in ARMS:
            for proposer, snapshot in zip(self.slots[arm][0], self.learned_at_start[arm], strict=True):
                proposer.reset_counters()
                proposer.forget_requests()
                proposer.restore_learning(snapshot)

    def run(self) -> Iterator[int]:
        """Run one batch at a time, turn by turn (both arms per turn, batch ``j``'s turn ``t`` started
        by the baseline where ``j + t`` is even); yield its prompt indices in order once all their
        turns are done."""
        for j, idx in enumerate(batches(len(self.prompts), self.batch_size)):
            answers: dict[str, dict[int, list[list[int]]]] = {arm: {i: [] for i in idx} for arm in ARMS}
            for turn in range(max(self.turns[i] for i in idx)):
                live = [i for i in idx if self.turns[i] > turn]
                results = {}
                for arm in ARMS if (j + turn) % 2 == 0 else tuple(reversed(ARMS)):
                    if turn == 0:
                        prompts = [self.prompts[i] for i in live]
                    else:
                        prompts = [list(self.follow_up(i, turn, arm, answers[arm][i])) for i in live]
                    self.device_peak.measure()
                    results[arm] = self._run(arm, live, prompts, turn, self.max_new_tokens)
                    self.result.observe_device_peak(arm, self.device_peak.read())
                    for i, req in zip(live, results[arm].requests, strict=True):
                        answers[arm][i].append(list(req.tokens))
                self.result.add_step(turn, live, results)
            for i in idx:
                self.result.batch_of[i] = j
                yield i
