"""Replay recorded greedy outputs through prompt-lookup proposers and price each round with a
measured verify-cost curve: which candidates a proposer would verify, how many the target would
accept, and the time per token that predicts, without timing noise.

Greedy verification accepts the longest path of the tree that the target's own greedy output
follows, so once the output of every prompt is known (``collect``), any deterministic proposer can
be replayed against it exactly: its real code proposes, the replay accepts what greedy
verification would, and the round costs ``t(1 + rows)`` of the curve. transformers'
``prompt_lookup_num_tokens`` is replayed by its own rule (the first, leftmost occurrence of the
longest suffix n-gram, ``K`` tokens after it). The benchmark ``harness.bench.prompt_lookup_vs_hf``
stays the measurement; this is the design tool beside it (it predicted the benchmark's adaptive
against transformers' ratio within about 3% on code and chat). Beside them it prices a clairvoyant
lookup proposer (:func:`clairvoyant_replay`): every round the best continuation of any earlier
occurrence of the last token, and nothing else, verified. No lookup proposer over the same text
does better round by round, so its ratio to transformers is the ceiling of what choosing
candidates better could gain. The selection oracle (:func:`selection_oracle_replay`) is the same
ceiling for choosing among the candidates the default proposer builds. The ``remainder_*`` rows
(:func:`rejected_remainder_replay`) measure what an oracle could gain from the tail of a rejected
candidate, proposed after the target's correction, a source the default proposer leaves off
(``proposer.rejected_tails``; ``--rejected-tails true`` replays it on, rows ``adaptive_tails_*``).
``--baseline-rev`` replays another commit's proposer beside this checkout's (rows ``baseline_*``).

    # once: every prompt's greedy output (decoded by the benchmark's lookup arm, equal to AR)
    .venv/bin/python scripts/lookup_replay.py collect --workloads humaneval chat copy --splits dev eval \\
        --limit 16 --out results/replay/outputs.json
    # then, as often as wanted: t(n) from a benchmark JSON's t_of_n_ms
    .venv/bin/python scripts/lookup_replay.py replay results/replay/outputs.json \\
        --t-from docs/measurements/pld_s3_float32_humaneval.json --history-tokens 0 65536
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from harness.contracts import Budget, ProposalNode
from harness.proposers.prompt_lookup import (
    SEPARATOR,
    PromptLookupProposer,
    TokenCorpus,
    candidate_tree,
    find_continuations,
)
from harness.random_source import TorchRandomSource

#: the default experiment's candidate depth (topology.max_depth), which the replayed proposers use
DEPTH = 16


def accepted_along(nodes: Sequence[ProposalNode], truth: Sequence[int]) -> int:
    """Candidate tokens greedy verification accepts: the path from the root that ``truth`` follows."""
    children: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        children.setdefault(node.parent, []).append(i)
    at, accepted = -1, 0
    while accepted < len(truth):
        nxt = [c for c in children.get(at, ()) if nodes[c].token_id == truth[accepted]]
        if not nxt:
            break
        at, accepted = nxt[0], accepted + 1
    return accepted


def transformers_lookup(tokens: Sequence[int], *, num_tokens: int, ngram: int) -> list[int]:
    """transformers' prompt-lookup candidates: for n from ``ngram`` down to 1, the first (leftmost)
    occurrence of the suffix n-gram with a token after it gives up to ``num_tokens`` tokens."""
    total = len(tokens)
    for n in range(min(ngram, total - 1), 0, -1):
        suffix = list(tokens[total - n :])
        for i in range(total - n):
            if list(tokens[i : i + n]) == suffix and i + n < total:
                return list(tokens[i + n : min(i + n + num_tokens, total)])
    return []


def replay(
    records: Sequence[dict],
    t_ms: Sequence[float],
    *,
    proposer: PromptLookupProposer | None = None,
    propose: Callable[[list[int], list[int]], tuple[int, int]] | None = None,
    after_record: Callable[[dict], None] | None = None,
    on_round: Callable[[list[int], list[int], Sequence[ProposalNode], int], None] | None = None,
) -> dict:
    """Replay ``records`` (``{"prompt": ids, "out": greedy output ids}``) with one proposer for all
    of them (as a run keeps one per slot), or with ``propose(committed, truth) -> accepted, rows``
    (and ``after_record(record)`` once each record is done); ``on_round(committed, truth, nodes,
    accepted)`` sees each of ``proposer``'s rounds before its commit. The first output token is the
    prefill's (not counted, as the benchmark counts decode time only). Returns the predicted ms
    per token, tokens per round and the rows histogram."""
    t_ms = np.asarray(t_ms, dtype=np.float64)
    cost, tokens, rounds, rows_hist = 0.0, 0, 0, np.zeros(len(t_ms), dtype=np.int64)
    for rec in records:
        prompt, out = list(rec["prompt"]), list(rec["out"])
        if proposer is not None:
            proposer.start(list(prompt))
        committed, pos = prompt + out[:1], 1
        while pos < len(out):
            if proposer is not None:
                nodes = proposer.propose(committed, TorchRandomSource(0)).nodes
                rows, accepted = len(nodes), accepted_along(nodes, out[pos:])
                if on_round is not None:
                    on_round(committed, out[pos:], nodes, accepted)
            else:
                accepted, rows = propose(committed, out[pos:])
            rows = min(rows, len(t_ms) - 1)
            if proposer is not None:  # the round's verify time, as the round loop reports it
                proposer.observe_verify(1 + rows, float(t_ms[rows]))
            take = min(accepted + 1, len(out) - pos)
            committed += out[pos : pos + take]
            pos += take
            if proposer is not None:
                proposer.observe_commit(committed)
            cost += t_ms[rows]
            tokens += take
            rounds += 1
            rows_hist[rows] += 1
        if proposer is not None:
            proposer.finish()
        if after_record is not None:
            after_record(rec)
    return {
        "ms_per_token": float(cost / max(tokens, 1)),
        "tokens_per_round": tokens / max(rounds, 1),
        "rows_hist": rows_hist.tolist(),
    }


def transformers_replay(records, t_ms, *, num_tokens: int = 10, ngram: int = 2) -> dict:
    def propose(committed, truth):
        cand = transformers_lookup(committed, num_tokens=num_tokens, ngram=ngram)
        accepted = 0
        while accepted < min(len(cand), len(truth)) and cand[accepted] == truth[accepted]:
            accepted += 1
        return accepted, len(cand)

    return replay(records, t_ms, propose=propose)


def best_continuation(context: Sequence[int], truth: Sequence[int], *, depth: int) -> int:
    """The most tokens of ``truth`` (at most ``depth``) that the continuation after any earlier
    occurrence of ``context``'s last token matches. Every prompt-lookup candidate continues an
    occurrence of the suffix n-gram, so of that token, and a tree of them accepts one path: no such
    proposer reading ``context`` accepts more this round."""
    a = np.asarray(context, dtype=np.int64)
    want = np.asarray(truth[:depth], dtype=np.int64)
    best = 0
    for i in np.flatnonzero(a[:-1] == a[-1])[::-1]:
        cont = a[i + 1 : i + 1 + len(want)]
        agree = int(np.argmin(np.append(cont == want[: len(cont)], False)))
        best = max(best, agree)
        if best == len(want):
            break
    return best


def clairvoyant_replay(records, t_ms, *, depth: int = DEPTH, history: bool = False) -> dict:
    """A clairvoyant prompt-lookup proposer: each round it verifies exactly the best continuation
    (:func:`best_continuation` over the request, and with ``history`` the earlier records' outputs,
    which the default experiment's proposer also reads) and nothing else, priced at the lower
    envelope of ``t_ms`` (t'(n) = min over m >= n of t(m), so a noisy dip in the curve is not held
    against it). A ceiling for any lookup proposer over the same text, round by round: a real one
    verifies rows the target rejects and misses continuations it could not rank first. Over a whole
    output it is a ceiling where one round accepting k tokens costs less than rounds sharing them
    (t(1 + k) < 2 t(1): on this project's curves to 17 rows on the Xeon with AMX, but on a Zen 3 in
    float32 only to about 11); an output's last round may price one row more than the tokens it has
    left need."""
    t = np.minimum.accumulate(np.asarray(t_ms, dtype=np.float64)[::-1])[::-1]
    cost, tokens, rounds, earlier = 0.0, 0, 0, []
    for rec in records:
        prompt, out = list(rec["prompt"]), list(rec["out"])
        committed, pos = prompt + out[:1], 1
        while pos < len(out):
            context = (earlier if history else []) + committed
            accepted = min(best_continuation(context, out[pos:], depth=depth), len(t) - 1)
            take = min(accepted + 1, len(out) - pos)
            committed += out[pos : pos + take]
            pos += take
            cost += t[accepted]
            tokens += take
            rounds += 1
        earlier += [*out, -1]  # -1: no token id, so no match runs across two outputs
    return {"ms_per_token": float(cost / max(tokens, 1)), "tokens_per_round": tokens / max(rounds, 1)}


def default_candidates(committed, corpus, *, nodes, depth, matches, ngram):
    """The default proposer's candidate tree before its adaptive choice: :func:`candidate_tree` over
    its matches in ``committed`` and ``corpus`` (the earlier outputs, or None)."""
    found = find_continuations(
        np.asarray(committed, dtype=np.int64),
        max_ngram=ngram,
        min_ngram=1,
        max_depth=depth,
        max_matches=matches,
        corpus=corpus,
    )
    return candidate_tree(found, limit=4 * nodes)


def selection_oracle_replay(records, t_ms, *, nodes=16, depth=DEPTH, matches=8, ngram=2, history=True) -> dict:
    """The candidates the default experiment's proposer builds (:func:`candidate_tree` over its
    matches, in the request and, with ``history``, the earlier records' outputs), of which an oracle
    verifies exactly the accepted path and nothing else (at most ``nodes`` rows), priced on ``t_ms``
    as it is. A ceiling for any choice among these candidates; the clairvoyant ceiling is one for any
    candidates at all."""
    earlier: list[int] = []
    corpus: list[TokenCorpus | None] = [None]

    def propose(committed, truth):
        tree = default_candidates(committed, corpus[0], nodes=nodes, depth=depth, matches=matches, ngram=ngram)
        best = max((len(p) for p in tree.prefixes if tuple(truth[: len(p)]) == p), default=0)
        best = min(best, nodes)
        return best, best

    def remember(rec):
        if history:
            earlier.extend([*rec["out"], SEPARATOR])
            corpus[0] = TokenCorpus(np.asarray(earlier, dtype=np.int64))

    got = replay(records, t_ms, propose=propose, after_record=remember)
    return {"ms_per_token": got["ms_per_token"], "tokens_per_round": got["tokens_per_round"]}


def rejected_remainder_replay(records, t_ms, *, nodes=16, depth=DEPTH, matches=8, ngram=2) -> dict:
    """How often the tail of a rejected candidate would have continued the output past the target's
    correction: after a round in which the default arm (history on) accepted ``m`` tokens, every row
    of that round's candidate tree (:func:`candidate_tree` over its matches, before the adaptive
    choice) that followed the accepted path for ``m`` tokens and then differed is a substitution
    guess: skip its token at depth ``m + 1`` (the target wrote another) and propose the rest after
    the target's token. Per round of the arm: ``available`` (some such tail exists), ``hits`` (one
    predicts at least the next token), ``beats_proposal`` (one predicts more tokens than the arm
    accepts that round) and ``oracle_extra_tokens_per_round`` (the tokens a choice that always knew
    when to take a tail would add). A measure of a candidate source, not of a proposer."""
    earlier: list[int] = []
    corpus: list[TokenCorpus | None] = [None]
    last: list = [None]  # (candidate prefixes, accepted tokens) of the request's previous round
    counts = {"rounds": 0, "available": 0, "hits": 0, "beats_proposal": 0, "extra_tokens": 0}

    def on_round(committed, truth, _nodes, accepted):
        if last[0] is not None:
            prefixes, path = last[0]
            m, best, available = len(path), 0, False
            written = committed[-1]  # the target's token at depth m + 1 (the round's correction)
            for prefix in prefixes:
                if len(prefix) >= m + 2 and prefix[:m] == path and prefix[m] != written:
                    available = True
                    tail = prefix[m + 1 :]
                    k = 0
                    while k < min(len(tail), len(truth)) and tail[k] == truth[k]:
                        k += 1
                    best = max(best, k)
            counts["available"] += available
            counts["hits"] += best > 0
            counts["beats_proposal"] += best > accepted
            counts["extra_tokens"] += max(best - accepted, 0)
        tree = default_candidates(committed, corpus[0], nodes=nodes, depth=depth, matches=matches, ngram=ngram)
        last[0] = (tree.prefixes, tuple(truth[:accepted]))
        counts["rounds"] += 1

    def remember(rec):
        last[0] = None  # a new request: no previous round
        earlier.extend([*rec["out"], SEPARATOR])
        corpus[0] = TokenCorpus(np.asarray(earlier, dtype=np.int64))

    proposer = adaptive_proposer(t_ms, nodes=nodes, depth=depth, matches=matches, ngram=ngram, history_tokens=65536)
    replay(records, t_ms, proposer=proposer, on_round=on_round, after_record=remember)
    r = max(counts["rounds"], 1)
    return {
        "available": counts["available"] / r,
        "hits": counts["hits"] / r,
        "beats_proposal": counts["beats_proposal"] / r,
        "oracle_extra_tokens_per_round": counts["extra_tokens"] / r,
    }


def adaptive_proposer(
    t_ms,
    *,
    nodes=16,
    depth=DEPTH,
    matches=8,
    ngram=2,
    history_tokens=0,
    rejected_tails=False,
    datastore=None,
    cls=PromptLookupProposer,
) -> PromptLookupProposer:
    """The default experiment's proposer (``cls``: this checkout's, or another commit's class), with
    ``datastore`` (a directory) searched as ``proposer.datastore`` searches one."""
    t = np.asarray(t_ms, dtype=np.float64)
    return cls(
        budget=Budget("sequences", nodes, depth),
        manifest_hash="replay",
        max_ngram=ngram,
        max_matches=matches,
        budget_policy="adaptive",
        verify_cost=(t / t[0])[: nodes + 1].tolist(),
        **({"history_tokens": history_tokens} if history_tokens else {}),
        **({"rejected_tails": True} if rejected_tails else {}),
        **({"retriever": datastore_retriever(datastore, nodes=nodes, depth=depth)} if datastore else {}),
    )


def datastore_retriever(path, *, nodes: int, depth: int):
    """The retrieval a run's ``proposer.datastore`` makes of the datastore directory ``path`` (REST's
    search, suffixes of at least 2 tokens); its corpus and tokenizer are not checked again."""
    from harness.proposers.rest import RestProposer
    from harness.workloads.datastore import load_datastore

    ds = load_datastore(Path(path).expanduser(), tokenizer=None, verify_corpus=False)
    return RestProposer(budget=Budget("tree", nodes, depth), manifest_hash="replay", datastore=ds, min_suffix=2)


def collect(args) -> int:
    import torch

    from harness.bench.prompt_lookup_vs_hf import bench_items
    from harness.bench.target import default_cpu_target
    from harness.engine.decode import RoundConfig, decode
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    torch.set_num_threads(args.threads)
    loaded, backend = default_cpu_target(args.dtype)
    tok = loaded.tokenizer
    eos = frozenset({int(tok.eos_token_id)})
    out: dict[str, list[dict]] = {}
    for workload in args.workloads:
        for split in args.splits:
            lookup = PromptLookupProposer(budget=Budget("sequence", 10, 10), manifest_hash="replay", max_ngram=2)
            rows = []
            for prompt, ids in bench_items(workload, tok, split=split, limit=args.limit):
                res = decode(
                    target=backend,
                    proposer=lookup,
                    verifier=get_verifier("greedy"),
                    policy=SamplingPolicy(),
                    prompt_ids=ids,
                    max_new_tokens=args.max_new_tokens,
                    eos_token_ids=eos,
                    rng=TorchRandomSource(0),
                    round_cfg=RoundConfig(max_nodes=10, max_depth=10),
                )
                rows.append({"id": prompt.prompt_id, "prompt": list(ids), "out": list(res.tokens)})
            out[f"{workload}/{split}"] = rows
            print(f"{workload}/{split}: {len(rows)} prompts", file=sys.stderr)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "sets": out}))
    return 0


def replay_cmd(args) -> int:
    sets = json.loads(Path(args.outputs).read_text())["sets"]
    t_ms = json.loads(Path(args.t_from).read_text())["t_of_n_ms"]
    datastores = dict(item.split("=", 1) for item in args.datastores)
    baseline = None
    if args.baseline_rev:
        spec = importlib.util.spec_from_file_location("lookup_ab", Path(__file__).with_name("lookup_ab.py"))
        lookup_ab = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(lookup_ab)
        baseline = lookup_ab.baseline_module(args.baseline_rev).PromptLookupProposer
    table = {}
    for name, records in sets.items():
        hf = transformers_replay(records, t_ms, num_tokens=args.num_tokens, ngram=args.ngram)
        row = {"transformers_ms_per_token": hf["ms_per_token"], "transformers_tokens_per_round": hf["tokens_per_round"]}
        for history in (False, True):
            ceiling = clairvoyant_replay(records, t_ms, depth=args.clairvoyant_depth, history=history)
            key = f"clairvoyant_{'history' if history else 'request'}"
            row[f"{key}_tokens_per_round"] = ceiling["tokens_per_round"]
            row[f"{key}_vs_transformers"] = hf["ms_per_token"] / ceiling["ms_per_token"]
        oracle = selection_oracle_replay(records, t_ms, ngram=args.ngram)
        row["selection_oracle_tokens_per_round"] = oracle["tokens_per_round"]
        row["selection_oracle_vs_transformers"] = hf["ms_per_token"] / oracle["ms_per_token"]
        for key, value in rejected_remainder_replay(records, t_ms, ngram=args.ngram).items():
            row[f"remainder_{key}"] = value
        arms = [
            ("adaptive_tails" if tails == "true" else "adaptive", PromptLookupProposer, tails == "true", None)
            for tails in dict.fromkeys(args.rejected_tails)
        ] + ([("baseline", baseline, False, None)] if baseline is not None else [])
        store = datastores.get(name.split("/")[0])
        if store is not None:
            arms.append(("adaptive_datastore", PromptLookupProposer, False, store))
        for arm, cls, tails, ds in arms:
            for h in args.history_tokens:
                proposer = adaptive_proposer(
                    t_ms, ngram=args.ngram, history_tokens=h, rejected_tails=tails, datastore=ds, cls=cls
                )
                ours = replay(records, t_ms, proposer=proposer)
                row[f"{arm}_history_{h}_ms_per_token"] = ours["ms_per_token"]
                row[f"{arm}_history_{h}_tokens_per_round"] = ours["tokens_per_round"]
                row[f"{arm}_history_{h}_vs_transformers"] = hf["ms_per_token"] / ours["ms_per_token"]
        table[name] = row
        print(name, {k: round(float(v), 3) for k, v in row.items()})
    if args.out:
        Path(args.out).write_text(
            json.dumps({"t_of_n_ms": t_ms, "baseline_rev": args.baseline_rev, "table": table}, indent=2)
        )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="decode every prompt greedily and store prompt and output ids")
    c.add_argument("--workloads", nargs="+", default=["humaneval", "chat", "copy"])
    c.add_argument("--splits", nargs="+", default=["dev", "eval"])
    c.add_argument("--limit", type=int, default=16)
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--out", required=True)
    r = sub.add_parser("replay", help="price each proposer's rounds with a measured t(n)")
    r.add_argument("outputs")
    r.add_argument("--t-from", required=True, help="a benchmark JSON with t_of_n_ms")
    r.add_argument("--num-tokens", type=int, default=10)
    r.add_argument("--ngram", type=int, default=2)
    r.add_argument("--history-tokens", type=int, nargs="+", default=[0, 65536])
    r.add_argument(
        "--rejected-tails",
        nargs="+",
        default=["false"],
        choices=["true", "false"],
        help="this checkout's proposer's rejected_tails (false: rows adaptive_*, as the default experiment; "
        "true: rows adaptive_tails_*)",
    )
    r.add_argument(
        "--clairvoyant-depth", type=int, default=DEPTH, help="the longest chain the clairvoyant ceiling verifies"
    )
    r.add_argument(
        "--datastores",
        nargs="+",
        default=[],
        metavar="WORKLOAD=DIR",
        help="also replay the default proposer with this datastore directory for the sets of this workload "
        "(rows adaptive_datastore_*), e.g. humaneval=~/.cache/harness/datastores/stdlib-smollm2",
    )
    r.add_argument(
        "--baseline-rev",
        help="also replay the proposer of this git revision (rows baseline_*), as scripts/lookup_ab.py loads it",
    )
    r.add_argument("--out")
    args = ap.parse_args(argv)
    if args.cmd == "replay":
        for item in args.datastores:
            name, _, path = item.partition("=")
            if not name or not path or not (Path(path).expanduser() / "manifest.json").is_file():
                ap.error(f"--datastores {item!r}: give WORKLOAD=DIR, DIR a datastore directory (with manifest.json)")
    return collect(args) if args.cmd == "collect" else replay_cmd(args)


if __name__ == "__main__":
    sys.exit(main())
