"""How often a prompt-lookup candidate is the target's next token, by the context its match has.

For each workload of the prompt-lookup benchmark (code, chat, copy-heavy), the target's greedy
continuation of each prompt is decoded once (the harness's autoregressive round loop). The
continuation is then replayed round by round as a tree holding every candidate would verify it:
at each round the occurrences :func:`harness.proposers.prompt_lookup.find_continuations` finds
propose their continuations, every candidate token whose parent was the target's token is *tried*,
and it is *accepted* when it is the target's next token; the round then commits the longest
accepted path plus one token. Tries are tallied by effective context (the occurrence's context
length plus the candidate's depth below it, less one) and by buckets of it. The acceptance model
the adaptive budget uses (:class:`harness.proposers.prompt_lookup.AcceptanceModel`) is fitted by
``scripts/lookup_acceptance_fit.py`` with this and more of each row's features; this table is the
plain view of the strongest one. Writes ``lookup_context.md`` and ``lookup_context.json`` into
``--out``.

    .venv/bin/python scripts/lookup_context_calibration.py --split dev --limit 16 --out results/lookup_context
    .venv/bin/python scripts/lookup_context_calibration.py --model tiny --limit 2 --max-new-tokens 8 --out /tmp/lc
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from harness.bench.prompt_lookup_vs_hf import WORKLOADS, bench_items
from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.proposers.base import NullProposer
from harness.proposers.prompt_lookup import find_continuations
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import load_model
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy

#: upper bounds of the effective-context buckets of the table (the last one is open)
BUCKETS = (1, 2, 4, 8, 16)


def bucket_of(effective_context: int) -> int:
    """The index of the first bound of ``BUCKETS`` that ``effective_context`` does not exceed."""
    return sum(effective_context > bound for bound in BUCKETS)


def tally(prompt: list[int], output: list[int], *, max_ngram: int, max_depth: int, max_matches: int) -> dict:
    """``{effective context: [accepted, tried]}`` over the rounds of replaying ``output``."""
    counts: dict[int, list[int]] = {}
    committed, pos = list(prompt), 0
    while pos < len(output):
        best = 0
        matches = find_continuations(
            np.asarray(committed), max_ngram=max_ngram, min_ngram=1, max_depth=max_depth, max_matches=max_matches
        )
        for context, continuation, _ in matches:
            depth = 0
            for token, truth in zip(continuation.tolist(), output[pos:]):
                cell = counts.setdefault(context + depth, [0, 0])
                cell[1] += 1
                if token != truth:
                    break
                cell[0] += 1
                depth += 1
            best = max(best, depth)
        take = min(best + 1, len(output) - pos)
        committed += output[pos : pos + take]
        pos += take
    return counts


def prompts_of(workload: str, tokenizer, args) -> list[list[int]]:
    """The benchmark's prompts of ``workload``; for the tiny model (no tokenizer), synthetic ids
    with repeats in them (a smoke run)."""
    if tokenizer is None:
        return [[3 + (7 * i + k) % 40 for i in range(40)] for k in range(args.limit)]
    return [ids for _, ids in bench_items(workload, tokenizer, split=args.split, limit=args.limit)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--split", default="dev")
    ap.add_argument("--limit", type=int, default=16, help="prompts per workload")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ngram", type=int, default=2, help="max_ngram, as the default experiment")
    ap.add_argument("--max-depth", type=int, default=10)
    ap.add_argument("--max-matches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(name=args.model)
    backend = CausalLMBackend(loaded.model)
    tokenizer = loaded.tokenizer
    eos = frozenset() if tokenizer is None else frozenset({int(tokenizer.eos_token_id)})
    per: dict[str, dict[int, list[int]]] = {}
    for workload in args.workloads:
        counts: dict[int, list[int]] = {}
        for ids in tqdm(prompts_of(workload, tokenizer, args), desc=workload, file=sys.stderr):
            out = decode(
                target=backend,
                proposer=NullProposer(budget=Budget("sequence", 1, 1), manifest_hash="calibration"),
                verifier=get_verifier("greedy"),
                policy=SamplingPolicy(),
                prompt_ids=ids,
                max_new_tokens=args.max_new_tokens,
                eos_token_ids=eos,
                rng=TorchRandomSource(0),
                round_cfg=RoundConfig(max_nodes=1, max_depth=1),
            ).tokens
            got = tally(ids, out, max_ngram=args.ngram, max_depth=args.max_depth, max_matches=args.max_matches)
            for k, (a, t) in got.items():
                cell = counts.setdefault(k, [0, 0])
                cell[0] += a
                cell[1] += t
        per[workload] = counts
    pooled: dict[int, list[int]] = {}
    for counts in per.values():
        for k, (a, t) in counts.items():
            cell = pooled.setdefault(k, [0, 0])
            cell[0] += a
            cell[1] += t
    buckets: dict[int, list[int]] = {}
    for k, (a, t) in pooled.items():
        cell = buckets.setdefault(bucket_of(k), [0, 0])
        cell[0] += a
        cell[1] += t
    bounds = [1, *[b + 1 for b in BUCKETS]]
    labels = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in zip(bounds, [*BUCKETS, None]) if hi is not None] + [
        f"{bounds[-1]}+"
    ]
    result = {
        "model": args.model,
        "split": args.split,
        "prompts_per_workload": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "ngram": args.ngram,
        "by_effective_context": {w: {str(k): v for k, v in sorted(c.items())} for w, c in per.items()},
        "buckets": {labels[b]: {"accepted": a, "tried": t, "rate": a / t} for b, (a, t) in sorted(buckets.items())},
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lookup_context.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Prompt-lookup candidates accepted by effective context: {args.model}, {args.split} split, "
        f"{args.limit} prompts per workload, {args.max_new_tokens} tokens, max_ngram {args.ngram}",
        "",
        "| effective context | " + " | ".join(args.workloads) + " | pooled |",
        "|---|" + "---:|" * (len(args.workloads) + 1),
    ]
    for b, label in enumerate(labels):
        cells = []
        for counts in [*per.values(), pooled]:
            a = sum(v[0] for k, v in counts.items() if bucket_of(k) == b)
            t = sum(v[1] for k, v in counts.items() if bucket_of(k) == b)
            cells.append(f"{a / t:.2f} ({t})" if t else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out_dir / "lookup_context.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
