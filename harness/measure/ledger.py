"""Round-cost ledger and counters: one typed dataclass, one ``observe_round`` method, rates
computed in one place. ``mean_committed_per_round`` counts the bonus/correction token;
``mean_accepted_per_round`` does not (they differ by exactly 1 on rounds that run to completion).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from harness.record_schema import ROUND_COST_STAGES as STAGES
from harness.record_schema import SHARED_ROUND_STAGES  # noqa: F401  (the decode loop reads them here)


def device_synchronizer(device: torch.device):
    """A call that waits for ``device``'s queued work (that device, not the current one), or None on
    a CPU, whose work is done when its calls return."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize  # one MPS device
    if device.type == "xpu":
        return lambda: torch.xpu.synchronize(device)
    if device.type == "cpu":
        return None
    raise ValueError(f"no way to wait for {device.type} work; devices: cpu, cuda, mps, xpu")


class StageClock:
    """Wall-clock stage timer. On an accelerator (CUDA, Apple's MPS, Intel's XPU) it synchronises
    the device at each stage boundary so a stage's time includes the kernels it launched (CUDA events
    would need the same sync to read); on a CPU the work is done when the call returns.
    ``also``: further devices whose work the stages launch (a draft model on another GPU than the
    target's), each waited for at every read too. Time spent inside :meth:`unclocked` is left out of
    every later reading, so no span that encloses it counts it."""

    def __init__(self, device: torch.device | str = "cpu", also: Iterable[torch.device | str] = ()) -> None:
        self.device = torch.device(device)
        devices = dict.fromkeys([self.device, *(torch.device(d) for d in also)])
        self.syncs = [f for f in map(device_synchronizer, devices) if f is not None]
        self.times: dict[str, float] = {}
        self.excluded = 0.0  # seconds spent in unclocked() so far

    def now(self) -> float:
        for sync in self.syncs:
            sync()
        return time.perf_counter() - self.excluded

    @contextmanager
    def unclocked(self):
        """Work that is no cost of the method measured (the round loop's own correctness checks):
        its time is taken out of every span that encloses it."""
        t0 = self.now()
        try:
            yield
        finally:
            self.excluded += self.now() - t0

    @contextmanager
    def stage(self, name: str):
        t0 = self.now()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + (self.now() - t0) * 1e3

    def take(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


@dataclass
class RoundLedger:
    max_depth: int = 0
    rounds: int = 0
    committed_tokens: int = 0
    accepted_tokens: int = 0
    empty_proposals: int = 0
    first_child_hits: int = 0
    rounds_with_candidates: int = 0
    candidate_rows_total: int = 0
    temp_kv_bytes_peak: int = 0
    stage_ms: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    reached: list[int] = field(default_factory=list)  # rounds whose tree had depth >= d and reached d-1
    accepted_at: list[int] = field(default_factory=list)  # rounds that accepted a token at depth d
    accepted_length_hist: list[int] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)
    # the per-round series (one entry per round, in order): accepted candidate tokens, committed
    # tokens (bonus/correction included), candidate rows, tree depth and the stage times
    round_accepted: list[int] = field(default_factory=list)
    round_committed: list[int] = field(default_factory=list)
    round_rows: list[int] = field(default_factory=list)
    round_depth: list[int] = field(default_factory=list)
    round_stage_ms: list[dict[str, float]] = field(default_factory=list)

    def observe_round(
        self,
        *,
        tree_depth: int,
        num_rows: int,
        accepted: int,
        committed: int,
        first_child_hit: bool,
        stage_ms: dict[str, float],
        temp_kv_bytes: int,
        depth_tried: int | None = None,
    ) -> None:
        """``tree_depth``: the verified tree's depth (the round series shows it); ``depth_tried``:
        how deep acceptance by depth counts the round when that is less: the depth of the first
        level tried and rejected below the accepted path, or the accepted path's where the walk
        ended at a leaf of a shallower branch, or cut by EOS or the token budget (the depths past the
        cut were accepted, not tried and rejected)."""
        counted_depth = tree_depth if depth_tried is None else min(depth_tried, tree_depth)
        self.rounds += 1
        self.committed_tokens += committed
        self.accepted_tokens += accepted
        self.candidate_rows_total += num_rows
        if num_rows == 0:
            self.empty_proposals += 1
        else:
            self.rounds_with_candidates += 1
            self.first_child_hits += int(first_child_hit)
        need = max(tree_depth, accepted)  # every depth a tree offered is listed (tried by no round: 0)
        while len(self.reached) < need:
            self.reached.append(0)
            self.accepted_at.append(0)
        for d in range(1, counted_depth + 1):
            if accepted >= d - 1:  # the walk reached depth d-1, so depth d was tried
                self.reached[d - 1] += 1
                if accepted >= d:
                    self.accepted_at[d - 1] += 1
        while len(self.accepted_length_hist) <= accepted:
            self.accepted_length_hist.append(0)
        self.accepted_length_hist[accepted] += 1
        for k, v in stage_ms.items():
            self.stage_ms[k] = self.stage_ms.get(k, 0.0) + v
        self.round_ms.append(sum(stage_ms.values()))
        self.round_accepted.append(int(accepted))
        self.round_committed.append(int(committed))
        self.round_rows.append(int(num_rows))
        self.round_depth.append(int(tree_depth))
        self.round_stage_ms.append(dict(stage_ms))
        self.temp_kv_bytes_peak = max(self.temp_kv_bytes_peak, temp_kv_bytes)

    def rounds_table(self) -> list[dict]:
        """One row per round, in order: ``round`` (0-based), ``accepted``, ``committed``,
        ``candidate_rows``, ``tree_depth``, ``ms`` (the round's total) and ``<stage>_ms``."""
        return [
            {
                "round": i,
                "accepted": a,
                "committed": c,
                "candidate_rows": n,
                "tree_depth": d,
                "ms": ms,
                **{f"{k}_ms": v for k, v in stage.items()},
            }
            for i, (a, c, n, d, ms, stage) in enumerate(
                zip(
                    self.round_accepted,
                    self.round_committed,
                    self.round_rows,
                    self.round_depth,
                    self.round_ms,
                    self.round_stage_ms,
                )
            )
        ]

    def merge(self, other: RoundLedger) -> None:
        for name in (
            "rounds",
            "committed_tokens",
            "accepted_tokens",
            "empty_proposals",
            "first_child_hits",
            "rounds_with_candidates",
            "candidate_rows_total",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.temp_kv_bytes_peak = max(self.temp_kv_bytes_peak, other.temp_kv_bytes_peak)
        for k, v in other.stage_ms.items():
            self.stage_ms[k] = self.stage_ms.get(k, 0.0) + v
        for mine, theirs in (
            (self.reached, other.reached),
            (self.accepted_at, other.accepted_at),
            (self.accepted_length_hist, other.accepted_length_hist),
        ):
            while len(mine) < len(theirs):
                mine.append(0)
            for i, v in enumerate(theirs):
                mine[i] += v
        self.round_ms.extend(other.round_ms)
        self.round_accepted.extend(other.round_accepted)
        self.round_committed.extend(other.round_committed)
        self.round_rows.extend(other.round_rows)
        self.round_depth.extend(other.round_depth)
        self.round_stage_ms.extend(other.round_stage_ms)

    # ------------------------------------------------------------------ rates (one place)
    def summary(self) -> dict:
        r = max(self.rounds, 1)
        return {
            "rounds": self.rounds,
            "mean_committed_per_round": self.committed_tokens / r if self.rounds else None,
            "mean_accepted_per_round": self.accepted_tokens / r if self.rounds else None,
            "acceptance_by_depth": [a / n if n else None for a, n in zip(self.accepted_at, self.reached)],
            "reach_by_depth": [a / r for a in self.accepted_at] if self.rounds else [],
            # the counts behind both rates (for intervals): rounds that tried depth d (reached
            # depth d-1 with a candidate at d) and rounds that accepted a token at depth d
            "rounds_tried_by_depth": list(self.reached),
            "rounds_accepted_by_depth": list(self.accepted_at),
            "accepted_length_hist": list(self.accepted_length_hist),
            "first_child_coverage": (
                self.first_child_hits / self.rounds_with_candidates if self.rounds_with_candidates else None
            ),
            "fallback_rate": self.empty_proposals / r if self.rounds else None,
            "mean_candidate_rows": self.candidate_rows_total / r if self.rounds else None,
            "round_cost_ms": {k: v / r for k, v in self.stage_ms.items()},
            "round_cost_total_ms": {k: v for k, v in self.stage_ms.items()},
            "temp_kv_bytes_peak": self.temp_kv_bytes_peak,
        }
