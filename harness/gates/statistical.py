"""The statistical gate: at temperature > 0, a chi-square test of the speculative round's first
token against the target's exact distribution (top-M tokens plus "other").

Each sample is one real round at the gate's prefix: the proposer proposes with the sample's random
source, the tree is compiled, the verifier selects with the same source (proposal draws first,
then verifier draws, as in a run). The target's logits at a fixed prefix depend only on the
candidate tree, so the verify forwards are shared: samples whose trees are equal reuse one
forward, and the distinct trees are verified together, ``batch`` per forward (each tree as one
request over the same cached prefix). The proposer and verifier code still run once per sample.
"""

from __future__ import annotations

import sys
import time

import torch
from scipy.stats import chisquare
from tqdm import tqdm

from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.topology.compiler import CompiledTree, compile_tree


def tree_key(tree: CompiledTree) -> tuple:
    """Trees with equal keys get equal target logits at a fixed prefix."""
    return (tuple(tree.token_ids.tolist()), tuple(tree.parents.tolist()))


@torch.inference_mode()
def verify_distinct(
    backend: CausalLMBackend, prompt_ids: list[int], trees: list[CompiledTree], *, batch: int
) -> list[torch.Tensor]:
    """Logits ``[1 + N, V]`` of each tree over the cached ``prompt_ids``, ``batch`` trees per forward."""
    if not trees:
        return []
    width = min(batch, len(trees))
    state = backend.prefill([list(prompt_ids)] * width)
    out: list[torch.Tensor] = []
    for i in range(0, len(trees), width):
        chunk = trees[i : i + width]
        padded = chunk + [None] * (width - len(chunk))  # a request without candidates: one pending row
        res = backend.verify(state, [prompt_ids[-1]] * width, padded)
        out += [res.logits[k].clone() for k in range(len(chunk))]
        backend.rollback(state)
    return out


#: offset of the confirmation test's random streams: torch's CPU generator keeps only a seed's low
#: 32 bits, so the offset stays below 2**32 and the two tests' streams are disjoint for any
#: ``samples`` below 2**31
CONFIRMATION_STREAM = 1 << 31


@torch.inference_mode()
def statistical_gate(
    *,
    backend: CausalLMBackend,
    proposer,
    verifier,
    policy,
    prompt_ids: list[int],
    samples: int,
    top_m: int,
    alpha: float,
    seed: int,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    batch: int = 16,
    confirm: bool = True,
) -> dict:
    """Chi-square of the speculative first token against the exact target distribution. Returns the
    evidence (``status`` ``passed`` or ``failed``); a first rejection is confirmed on independent
    samples (``confirm``), and the gate fails only when the confirmation rejects too."""
    t0 = time.perf_counter()
    kw = dict(
        backend=backend,
        proposer=proposer,
        verifier=verifier,
        policy=policy,
        prompt_ids=prompt_ids,
        samples=samples,
        top_m=top_m,
        alpha=alpha,
        max_nodes=max_nodes,
        max_depth=max_depth,
        batch=batch,
    )
    first = chi_square_test(stream=seed * 7919, **kw)
    if first["status"] == "passed" or not confirm:
        return {**first, "seconds": time.perf_counter() - t0}
    second = chi_square_test(stream=seed * 7919 + CONFIRMATION_STREAM, **kw)
    keep = ("status", "statistic", "p_value", "observed", "expected", "distinct_trees")
    return {
        **first,
        "status": second["status"],
        "first_test": {k: first[k] for k in keep},
        "confirmation": {k: second[k] for k in keep},
        "seconds": time.perf_counter() - t0,
        "proposal_seconds": first["proposal_seconds"] + second["proposal_seconds"],
    }


def chi_square_test(
    *,
    backend: CausalLMBackend,
    proposer,
    verifier,
    policy,
    prompt_ids: list[int],
    samples: int,
    top_m: int,
    alpha: float,
    stream: int,
    max_nodes: int | None,
    max_depth: int | None,
    batch: int,
) -> dict:
    """One chi-square test over ``samples`` rounds, sample ``s`` drawing from random stream
    ``stream + s``."""
    t0 = time.perf_counter()
    committed = list(prompt_ids)
    backend.prefill_one(committed)  # as in a run: proposers reading the target's hidden rows see the prefill
    proposer.start(list(prompt_ids))
    drawn: list[tuple[TorchRandomSource, CompiledTree, tuple]] = []
    keys: dict[tuple, int] = {}
    distinct: list[CompiledTree] = []
    for s in tqdm(range(samples), desc="gate: chi-square proposals", unit="sample", file=sys.stderr, leave=False):
        rng = TorchRandomSource(stream + s)
        proposal = proposer.propose(committed, rng)
        tree = compile_tree([proposal], prefix_len=len(committed), max_nodes=max_nodes, max_depth=max_depth)
        proposer.observe_commit(committed)  # the round is not committed: roll the proposal state back
        key = tree_key(tree)
        if key not in keys:
            keys[key] = len(distinct)
            distinct.append(tree)
        drawn.append((rng, tree, key))
    proposer.finish()
    t_propose = time.perf_counter() - t0
    logits = verify_distinct(backend, committed, distinct, batch=batch)
    probs = [policy.probs(x) for x in logits]  # [1 + N, V] per distinct tree, as the round computes them
    p_exact = policy.probs(logits[0][0].double(), dtype=torch.float64)  # [V] the frontier law
    counts: dict[int, int] = {}
    for rng, tree, key in drawn:
        sel = verifier.select(tree, probs[keys[key]], rng)
        first = int(tree.token_ids[sel.accepted_rows[0]]) if sel.accepted_rows else sel.next_token
        counts[first] = counts.get(first, 0) + 1
    top = torch.topk(p_exact, min(top_m, int((p_exact > 0).sum()))).indices.tolist()
    expected = [float(p_exact[t]) * samples for t in top]
    observed = [counts.get(t, 0) for t in top]
    other_p = 1.0 - sum(float(p_exact[t]) for t in top)
    if other_p * samples >= 5.0:
        expected.append(other_p * samples)
        observed.append(samples - sum(observed))
    else:  # fold a tiny tail into the last bin so every expected count stays usable
        expected[-1] += other_p * samples
        observed[-1] += samples - sum(observed)
    stat, pvalue = chisquare(observed, f_exp=expected)
    return {
        "status": "passed" if pvalue >= alpha else "failed",
        "samples": samples,
        "bins": len(observed),
        "statistic": float(stat),
        "p_value": float(pvalue),
        "alpha": alpha,
        "observed": observed,
        "expected": [round(e, 3) for e in expected],
        "distinct_trees": len(distinct),
        "target_forwards": -(-len(distinct) // max(min(batch, len(distinct)), 1)),
        "seconds": time.perf_counter() - t0,
        "proposal_seconds": t_propose,
    }
