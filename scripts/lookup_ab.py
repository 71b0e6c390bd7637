"""Prompt lookup of another commit against this checkout's, interleaved in one process.

Loads ``harness/proposers/prompt_lookup.py`` as it was at ``--baseline-rev`` (``git show``) beside
the current module and runs, per prompt and in an order alternating per prompt: the harness's
autoregressive arm, the baseline's adaptive tree, the current adaptive tree (at each
``--depths``), and transformers' ``generate(prompt_lookup_num_tokens=K)``. Every arm shares the one
model, set up as the benchmark sets it up on this device by default (the linear kernel ``auto``,
the preallocated cache, fused layers where they apply), its cache layout and the one t(n) profile
measured at the start, and each of our arms keeps one proposer for all prompts (as a run does),
with the default experiment's memory of earlier outputs (``--history-tokens``). Decode time only;
every output must equal the autoregressive one. Comparing commits in one process keeps this
machine's drift between sittings (10-20% here) out of the comparison. Writes ``--out`` (JSON): time
per token per arm, 95% paired-bootstrap intervals over prompts of each current arm against the
baseline and against transformers' lookup, per-prompt times, and per arm of ours its tokens, rows
and stage times per round, the verify forward's median time by candidate rows, and the learned
verify cost at the end (with ``--round-series``, every round's candidate rows and verify time in
order: how the machine's state moved the forward's cost during the run). ``--rejected-tails false
true`` adds the current proposer with ``rejected_tails`` on (arm ``current_d<depth>_tails``). Two
runs of one comparison on a shared machine can differ by more than either's interval: the interval
covers prompts, not sittings.

    .venv/bin/python scripts/lookup_ab.py --baseline-rev e22fade --workload chat --limit 30 --out results/ab_chat.json

A baseline from before the proposer had a history of earlier outputs needs ``--history-tokens 0``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from harness.bench.prompt_lookup_vs_hf import WORKLOADS, bench_items, fit_to_context, ratio_estimates
from harness.bench.target import default_cpu_target
from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.proposers.base import NullProposer
from harness.proposers.prompt_lookup import PromptLookupProposer
from harness.random_source import TorchRandomSource
from harness.target.kv_cache import new_cache
from harness.target.loading import config_position_limit
from harness.target.options import (
    static_cache_of,
)
from harness.target.timing import verify_cost_curve
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy
from harness.workloads.prompts import WorkloadError

REPO = Path(__file__).resolve().parents[1]


def baseline_module(rev: str):
    """``harness.proposers.prompt_lookup`` as it was at ``rev``, imported as a module of its own
    (from a copy written to a temporary folder; its imports resolve against this checkout)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:harness/proposers/prompt_lookup.py"], cwd=REPO, capture_output=True, text=True
    )
    if source.returncode != 0:
        raise SystemExit(f"lookup_ab: cannot read prompt_lookup.py at {rev}: {source.stderr.strip()}")
    name = "baseline_prompt_lookup_" + "".join(c if c.isalnum() else "_" for c in rev)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.py"
        path.write_text(source.stdout)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their annotations through the module's entry
        spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", required=True, help="a git revision of this repository")
    ap.add_argument("--workload", default="humaneval", choices=WORKLOADS)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--split", default="eval")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument(
        "--depths",
        nargs="+",
        type=int,
        default=[16],
        help="the current proposer's max depths (the default experiment's: 16)",
    )
    ap.add_argument("--baseline-depth", type=int, default=16, help="the baseline proposer's max depth")
    ap.add_argument("--num-tokens", type=int, default=10, help="K of transformers' lookup")
    ap.add_argument("--ngram", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--history-tokens", type=int, default=65536, help="proposer.history_tokens of our arms")
    ap.add_argument(
        "--rejected-tails",
        nargs="+",
        default=["false"],
        choices=["true", "false"],
        help="the current proposer's rejected_tails (the default experiment's: false); both values: one current arm "
        "each (a suffix _tails on true)",
    )
    ap.add_argument(
        "--round-series",
        action="store_true",
        help="also store every round's candidate rows and verify ms, in order, per arm of ours (round_series)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.history_tokens < 0 or args.limit < 1 or args.max_new_tokens < 2:
        ap.error("--history-tokens must be >= 0, --limit >= 1 and --max-new-tokens >= 2")
    baseline = baseline_module(args.baseline_rev)
    if args.history_tokens and "history_tokens" not in inspect.signature(baseline.PromptLookupProposer).parameters:
        ap.error(f"the proposer at {args.baseline_rev} has no history of earlier outputs; pass --history-tokens 0")
    torch.set_num_threads(args.threads)
    loaded, backend = default_cpu_target("float32")
    model, tok = loaded.model, loaded.tokenizer
    try:
        items, _ = fit_to_context(  # an over-long prompt keeps its last tokens, as the benchmark's --truncate left
            bench_items(args.workload, tok, split=args.split, limit=args.limit),
            positions=config_position_limit(model.config),
            max_new_tokens=args.max_new_tokens,
            verify_rows=max(args.nodes, args.num_tokens) + 1,
            rule="left",
        )
    except WorkloadError as exc:
        print(f"lookup_ab: {exc}", file=sys.stderr)
        return 2
    eos = frozenset({int(tok.eos_token_id)})
    cost = verify_cost_curve(backend, items[0][1], max_rows=args.nodes)["normalised"][: args.nodes + 1]

    def adaptive(cls, depth, **options):
        return cls(
            budget=Budget("sequences", args.nodes, depth),
            manifest_hash="ab",
            max_ngram=args.ngram,
            max_matches=8,
            budget_policy="adaptive",
            verify_cost=cost,
            **({"history_tokens": args.history_tokens} if args.history_tokens else {}),
            **options,
        )

    proposers = {
        "ours_ar": NullProposer(budget=Budget("sequence", 1, 1), manifest_hash="ab"),
        "baseline": adaptive(baseline.PromptLookupProposer, args.baseline_depth),
        **{
            f"current_d{d}{'_tails' if tails == 'true' else ''}": adaptive(
                PromptLookupProposer, d, rejected_tails=tails == "true"
            )
            for d in args.depths
            for tails in dict.fromkeys(args.rejected_tails)
        },
    }

    def ours(name, ids, new):
        p = proposers[name]
        res = decode(
            target=backend,
            proposer=p,
            verifier=get_verifier("greedy"),
            policy=SamplingPolicy(),
            prompt_ids=ids,
            max_new_tokens=new,
            eos_token_ids=eos,
            rng=TorchRandomSource(0),
            round_cfg=RoundConfig(max_nodes=p.budget.max_nodes, max_depth=p.budget.max_depth),
        )
        led = res.ledger
        tally = rounds_of[name]
        tally["rounds"] += led.rounds
        tally["committed_tokens"] += led.committed_tokens
        tally["candidate_rows"] += led.candidate_rows_total
        for stage, ms in led.stage_ms.items():
            tally["stage_ms"][stage] = tally["stage_ms"].get(stage, 0.0) + ms
        for rows, stages in zip(led.round_rows, led.round_stage_ms):
            tally["verify_ms"].setdefault(rows, []).append(stages["target_verify"])
            if args.round_series:
                tally["series"].append([int(rows), round(stages["target_verify"], 3)])
        return res.tokens, res.decode_ms

    def hf_pld(ids, new):
        inp = torch.tensor([ids])
        cache = new_cache(model.config, preallocated=static_cache_of(model), reserve=new + args.num_tokens + 1)
        cache_kw = {backend.cache_kw: cache}
        before = model.config._attn_implementation  # the arms' own, put back after transformers' generate
        model.set_attn_implementation("sdpa")
        try:
            t0 = time.perf_counter()
            out = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
                **cache_kw,
                prompt_lookup_num_tokens=args.num_tokens,
                max_matching_ngram_size=args.ngram,
            )
            ms = (time.perf_counter() - t0) * 1e3
        finally:
            model.set_attn_implementation(before)
        return out[0, len(ids) :].tolist(), ms

    arms = [*proposers, "hf_pld"]

    def fresh_tallies():
        return {
            name: {
                "rounds": 0,
                "committed_tokens": 0,
                "candidate_rows": 0,
                "stage_ms": {},
                "verify_ms": {},
                "series": [],
            }
            for name in proposers
        }

    rounds_of = fresh_tallies()
    for name in proposers:  # warm-up (excluded), proposers kept
        ours(name, items[0][1], 8)
    rounds_of = fresh_tallies()
    hf_pld(items[0][1], 8)
    totals = {a: [0.0, 0] for a in arms}
    per_prompt = []
    identical = True
    for i, (_, ids) in enumerate(tqdm(items, desc=args.workload, file=sys.stderr)):
        outs, timed = {}, {}
        for a in arms if i % 2 == 0 else arms[::-1]:
            if a == "hf_pld":
                toks, ms = hf_pld(ids, args.max_new_tokens)
                _, first = hf_pld(ids, 1)  # prefill and the first token: decode time only
                ms, n = ms - first, len(toks) - 1
            else:
                toks, ms = ours(a, ids, args.max_new_tokens)
                n = len(toks)
            totals[a][0] += ms
            totals[a][1] += n
            timed[a] = {"decode_ms": ms, "tokens": n}
            outs[a] = toks
        per_prompt.append({"arms": timed})
        identical &= all(outs[a] == outs["ours_ar"] for a in arms)
    per_token = {a: ms / max(n, 1) for a, (ms, n) in totals.items()}
    result = {
        "baseline_rev": args.baseline_rev,
        "baseline_commit": subprocess.run(
            ["git", "rev-parse", args.baseline_rev], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "baseline_depth": args.baseline_depth,
        "depths": args.depths,
        "K": args.num_tokens,
        "history_tokens": args.history_tokens,
        "rejected_tails": args.rejected_tails,
        "workload": args.workload,
        "split": args.split,
        "prompts": len(items),
        "max_new_tokens": args.max_new_tokens,
        "verify_cost": cost,
        "time_per_token_ms": per_token,
        "vs_hf_pld": {a: per_token["hf_pld"] / per_token[a] for a in arms},
        # 95% paired-bootstrap intervals over prompts: each current arm against the baseline and
        # against transformers' lookup (this machine's noise between arms is several percent)
        "ratio_ci95": ratio_estimates(
            per_prompt,
            pairs=[(a, b) for a in proposers if a.startswith("current") for b in ("baseline", "hf_pld")]
            + [("baseline", "hf_pld")],
        ),
        "per_prompt": per_prompt,
        # per arm of ours: tokens and candidate rows per round, and each stage's ms per round
        "rounds": {
            a: {
                "tokens_per_round": t["committed_tokens"] / max(t["rounds"], 1),
                "rows_per_round": t["candidate_rows"] / max(t["rounds"], 1),
                "stage_ms_per_round": {k: v / max(t["rounds"], 1) for k, v in t["stage_ms"].items()},
                # the verify forward's median ms and count by candidate rows, as the run measured it
                "verify_ms_by_candidate_rows": {
                    rows: {"median": statistics.median(ms), "rounds": len(ms)}
                    for rows, ms in sorted(t["verify_ms"].items())
                },
            }
            for a, t in rounds_of.items()
        },
        # the adaptive arms' verify cost t(1..), in ms, as each had learned it by the end (the start
        # profile scaled and corrected by the rounds' own verify times)
        "learned_verify_cost_ms": {
            a: p.cost_model.cost(args.nodes + 1).tolist()
            for a, p in proposers.items()
            if getattr(p, "cost_model", None) is not None
        },
        "learned_verify_cost_observations": {
            a: p.cost_model.count[: args.nodes + 1].tolist()
            for a, p in proposers.items()
            if getattr(p, "cost_model", None) is not None
        },
        "outputs_identical": identical,
    }
    if args.round_series:  # per arm of ours: [candidate rows, verify ms] of every measured round, in order
        result["round_series"] = {a: t["series"] for a, t in rounds_of.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("time_per_token_ms", "ratio_ci95", "outputs_identical")}, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
