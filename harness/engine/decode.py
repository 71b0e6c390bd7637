"""The speculative round: propose -> compile -> verify -> select -> commit, each stage timed.

One code path serves both arms: the autoregressive baseline is this loop with a
:class:`~harness.proposers.prompt_lookup.NullProposer` (an empty tree: one target step per
round), so the baseline is measured by the same timers, on the same prompts and seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.contracts import ContractError
from harness.measure.ledger import RoundLedger, StageClock
from harness.proposers.base import Proposer
from harness.random_source import RandomSource
from harness.target.backend import CausalLMBackend
from harness.topology.compiler import CompiledTree, compile_tree, validate_candidate_graph, validate_commit
from harness.verifiers.base import Verifier
from harness.verifiers.sampling import SamplingPolicy


@dataclass
class DecodeResult:
    tokens: list[int]  # generated token ids (EOS included when produced)
    prefill_ms: float
    ttft_ms: float  # prefill + first round
    decode_ms: float  # every round (first included), prefill excluded
    ledger: RoundLedger
    round_end_ms: list[float] = field(default_factory=list)  # time of each round's end since decode start
    round_tokens: list[int] = field(default_factory=list)  # tokens emitted by each round
    sources: dict[str, int] = field(default_factory=dict)  # accepted tokens attributed to each source
    finished_by: str = "max_new_tokens"


@dataclass
class RoundConfig:
    max_nodes: int
    max_depth: int
    validate_rounds: int = 1  # run the 0x0F assertions on the first k rounds of each request
    temp_kv_budget_bytes: int | None = None


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
    on_round=None,
) -> DecodeResult:
    clock = StageClock(target.device)
    ledger = RoundLedger(max_depth=round_cfg.max_depth)
    t_start = clock.now()
    seq = target.prefill(prompt_ids)
    proposer.start(list(prompt_ids))
    prefill_ms = (clock.now() - t_start) * 1e3
    committed = list(prompt_ids)
    generated: list[int] = []
    round_end_ms: list[float] = []
    round_tokens: list[int] = []
    sources: dict[str, int] = {}
    finished_by = "max_new_tokens"
    t_decode = clock.now()
    ttft_ms = None
    while len(generated) < max_new_tokens:
        retrieval_before = proposer.stats.retrieval_ms
        with clock.stage("proposal"):
            proposal = proposer.propose(committed, rng)
        retrieval = proposer.stats.retrieval_ms - retrieval_before
        with clock.stage("packing"):
            tree: CompiledTree = compile_tree(
                [proposal], prefix_len=len(committed), max_nodes=round_cfg.max_nodes, max_depth=round_cfg.max_depth
            )
            if ledger.rounds < round_cfg.validate_rounds:
                validate_candidate_graph(tree)
        with clock.stage("target_verify"):
            out = target.verify(seq, committed[-1], tree)
        with clock.stage("selection"):
            probs = policy.probs(out.logits)  # [1 + N, V]
            sel = verifier.select(tree, probs, rng)
        with clock.stage("temporary_state"):
            if ledger.rounds < round_cfg.validate_rounds:
                validate_commit(tree, sel.accepted_rows)
            target.commit(seq, sel.accepted_rows)
        stage_ms = clock.take()
        stage_ms["proposal"] -= retrieval
        stage_ms["retrieval"] = retrieval
        new = [int(tree.token_ids[r]) for r in sel.accepted_rows] + [sel.next_token]
        # EOS or the token budget inside the path truncates it; what follows is neither emitted nor counted
        room = max_new_tokens - len(generated)
        emitted = []
        for tok in new[:room]:
            emitted.append(tok)
            if tok in eos_token_ids:
                finished_by = "eos"
                break
        accepted_counted = min(len(sel.accepted_rows), len(emitted))
        for r in sel.accepted_rows[:accepted_counted]:
            for s in tree.sources[r]:
                sources[s] = sources.get(s, 0) + 1
        first_child = tree.children(-1)
        ledger.observe_round(
            tree_depth=int(tree.depths.max()) if tree.num_rows else 0,
            num_rows=tree.num_rows,
            accepted=accepted_counted,
            committed=len(emitted),
            first_child_hit=bool(sel.accepted_rows) and sel.accepted_rows[0] == (first_child[0] if first_child else -2),
            stage_ms=stage_ms,
            temp_kv_bytes=max(out.kv_bytes_added - target.bytes_per_token, 0),
        )
        generated.extend(emitted)
        committed.extend(emitted)
        now = (clock.now() - t_decode) * 1e3
        if ttft_ms is None:
            ttft_ms = prefill_ms + now
        round_end_ms.append(now)
        round_tokens.append(len(emitted))
        if on_round is not None:
            on_round(tree=tree, selection=sel, emitted=emitted, seq=seq)
        if finished_by == "eos":
            break
        proposer.observe_commit(committed)
    decode_ms = (clock.now() - t_decode) * 1e3
    proposer.finish()
    return DecodeResult(
        tokens=generated,
        prefill_ms=prefill_ms,
        ttft_ms=ttft_ms or prefill_ms,
        decode_ms=decode_ms,
        ledger=ledger,
        round_end_ms=round_end_ms,
        round_tokens=round_tokens,
        sources=sources,
        finished_by=finished_by,
    )


def check_temp_kv_budget(*, max_nodes: int, bytes_per_token: int, budget_bytes: int | None, batch_size: int = 1) -> int:
    """Refuse, before any model work, a topology whose candidate rows could exceed the budget.
    Returns the 0x09B formula value B * N * L * 2 * H_kv * d_h * b (B requests of N rows each)."""
    need = batch_size * max_nodes * bytes_per_token
    if budget_bytes is not None and need > budget_bytes:
        raise ContractError(
            f"topology.max_nodes={max_nodes} x generation.batch_size={batch_size} needs {need} bytes of temporary "
            f"KV ({bytes_per_token} bytes per candidate row), over generation.temp_kv_budget_bytes={budget_bytes}"
        )
    return need


def greedy_divergence(ar_tokens: list[int], spec_tokens: list[int]) -> int | None:
    """First position where two token lists differ (None if equal)."""
    for i, (a, b) in enumerate(zip(ar_tokens, spec_tokens)):
        if a != b:
            return i
    if len(ar_tokens) != len(spec_tokens):
        return min(len(ar_tokens), len(spec_tokens))
    return None


@torch.inference_mode()
def top2_margin(model: torch.nn.Module, token_ids: list[int]) -> float:
    """Target's top-1 minus top-2 logit at the position after ``token_ids``."""
    logits = model(input_ids=torch.tensor([token_ids], device=next(model.parameters()).device)).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])
