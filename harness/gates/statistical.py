"""The statistical gate: at temperature > 0, a chi-square test of the speculative round's first
token against the target's exact distribution (top-M tokens plus "other").

Each sample is one real round at the gate's prefix: the proposer proposes with the sample's random
source, the tree is compiled, the verifier selects with the same source (proposal draws first,
then verifier draws, as in a run). The network computations are shared across samples, since at
a fixed prefix they depend on a candidate's path alone, without changing any sample's result:

- the target side, by path (:func:`verify_by_path`): each distinct path's row is computed once,
  many per forward, and only when a verifier reads it; a sample whose verifier reaches a row not
  computed yet stops and is selected again from its random source's state once it is;
- the draft side of proposers with a law table (a draft model, EAGLE's sampled trees): proposals
  read their laws by candidate prefix from a :class:`~harness.proposers.memo.LawTable`, filled a
  depth per forward between passes over the samples (a stopped proposal is proposed again with
  its draws replayed by a :class:`~harness.proposers.memo.ReplayingSource`);
- the draft side of the others: the proposer runs under a
  :class:`~harness.proposers.memo.FixedPrefixMemo`: each distinct step (keyed by the proposal's
  steps before it) is computed once by the real code, later samples reaching it get its outputs
  and cache rows back.

The proposer and verifier code still run once per sample, through the round step the measured
loop runs (:func:`~harness.engine.decode.propose_round`, :func:`~harness.engine.decode.compile_round`,
:func:`~harness.engine.decode.select_round`, :func:`~harness.engine.decode.round_tokens`), with no
depth cap (a round far from the token budget): the verifier's ``select_logits`` on the target's
logits where it computes its selection from them itself, ``select`` on the policy's law of each row
it reads otherwise (what the default ``select_logits`` computes on the whole tensor), the policy
being the one the step hands the verifier.

The prefix: the first cut point at which the proposer proposes something, scanning the first
:data:`GATE_PROMPTS` prompts each from its full length back one token at a time
(:data:`SCAN_CUTS` cuts per prompt at most, never below :data:`MIN_PREFIX` tokens), one probe
proposal per cut with the first sample's random source; then each of them followed by the
tokens the target decodes greedily from it (up to :data:`CONTINUATION_TOKENS`, scanned from its
end back to the prompt), where a proposer copying from the text generated so far proposes as it
does in the run. A proposer that proposes nothing at any cut gets ``not_applicable``: the test
would only sample the target through an empty tree.

A test whose samples all took one way to their first token (every proposal accepted, or every
one rejected and the target's correction drawn), or all but fewer than :data:`MIN_WAY_SHARE` of
them, says (next to) nothing of the other way: a verifier that accepts too often is not caught
where nothing is accepted. The next candidate prefixes are then
piloted (:data:`MIXED_PREFIX_TRIES`, :data:`PILOT_SAMPLES` samples each) and the first whose
samples take both ways is tested instead; where none does, the entry keeps the first test and
says ``coverage: one_way``, which the run says on stderr.

Every test draws from random streams of its own (:func:`gate_stream`): the first test, each pilot
and each full test at a piloted prefix (and each one's confirmation) on ranges no other test of the
gate draws from, so a pilot adds samples the first test did not take, and the full test at the prefix
a pilot chose is independent of the samples that chose it.

A committed token the target's law gives no mass (outside its top-k / top-p) is proof, not noise:
whichever test saw it (the first, a confirmation, a pilot, a test at another prefix), the gate fails
with it, never rerun or replaced by another test.
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from scipy.stats import chisquare
from tqdm import tqdm

from harness.engine.decode import compile_round, propose_round, round_tokens, select_round
from harness.gates.oracle import overrides_select_logits
from harness.gates.status import not_applicable
from harness.proposers.memo import LawPending, ReplayingSource, fixed_prefix_memo, law_tables, members
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.paths import PathRows
from harness.topology.compiler import CompiledTree


def tree_key(tree: CompiledTree) -> tuple:
    """Trees with equal keys get equal target logits at a fixed prefix."""
    return (tuple(tree.token_ids.tolist()), tuple(tree.parents.tolist()))


@torch.inference_mode()
def verify_distinct(
    backend: CausalLMBackend, prompt_ids: list[int], trees: list[CompiledTree], *, batch: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(i, logits [1 + N, V])`` of each tree ``trees[i]`` over the cached ``prompt_ids``, in order,
    ``batch`` trees per forward (a caller keeps only what it needs: rows of thousands of distinct
    trees over a large vocabulary do not fit in memory at once)."""
    if not trees:
        return
    width = min(batch, len(trees))
    state = backend.prefill([list(prompt_ids)] * width)
    for i in range(0, len(trees), width):
        chunk = trees[i : i + width]
        padded = chunk + [None] * (width - len(chunk))  # a request without candidates: one pending row
        res = backend.verify(state, [prompt_ids[-1]] * width, padded)
        logits = [res.logits[k].clone() for k in range(len(chunk))]
        backend.rollback(state)
        for k, x in enumerate(logits):
            yield i + k, x


#: offset of the confirmation test's random streams: torch's CPU generator keeps only a seed's low
#: 32 bits, so the offset stays below 2**32, and a confirmation's streams are disjoint from every
#: test's of the gate while all of them (:func:`gate_stream`) span fewer than 2**31
CONFIRMATION_STREAM = 1 << 31
#: the first random stream of a seed's gate (its probes and its first test)
SEED_STREAMS = 7919

#: the prefix scan: prompts scanned, cut points per prompt, shortest prefix probed
GATE_PROMPTS = 4
SCAN_CUTS = 32
MIN_PREFIX = 2
#: tokens the target decodes greedily after each gate prompt, whose cuts are scanned after the
#: prompts' (at most the run's max_new_tokens): a proposer that copies from the text generated so
#: far (prompt lookup over a prompt with no repeat) proposes there, as it does in the run
CONTINUATION_TOKENS = 32
#: when a test's samples all took one way to a first token (every proposal accepted, or none),
#: the next candidate prefixes are piloted, this many at most, with this many samples each; the
#: first whose pilot takes both ways is tested instead
MIXED_PREFIX_TRIES = 8
PILOT_SAMPLES = 64


def gate_stream(seed: int, samples: int, *, pilot: int | None = None, full: int | None = None) -> int:
    """The first random stream of one of the gate's tests (its sample ``s`` draws from this plus ``s``, its
    confirmation's from :data:`CONFIRMATION_STREAM` further on). From ``seed * SEED_STREAMS``: the first
    test's ``samples`` streams, then :data:`MIXED_PREFIX_TRIES` ranges of :data:`PILOT_SAMPLES`, the
    ``pilot``-th pilot's (from 0), then as many of ``samples``, the full test's at the prefix the
    ``full``-th pilot chose. No two tests draw from one stream."""
    if pilot is not None and full is not None:
        raise ValueError("a test is a pilot or a full test at a piloted prefix, not both")
    span = (MIXED_PREFIX_TRIES + 1) * samples + MIXED_PREFIX_TRIES * PILOT_SAMPLES
    if span > CONFIRMATION_STREAM:
        raise ValueError(f"statistical gate: {samples} samples per test do not fit its random streams")
    base = seed * SEED_STREAMS
    if pilot is not None:
        if not 0 <= pilot < MIXED_PREFIX_TRIES:
            raise ValueError(f"pilot {pilot} out of range")
        return base + samples + pilot * PILOT_SAMPLES
    if full is not None:
        if not 0 <= full < MIXED_PREFIX_TRIES:
            raise ValueError(f"full test {full} out of range")
        return base + samples + MIXED_PREFIX_TRIES * PILOT_SAMPLES + full * samples
    return base


def prefix_rule() -> dict:
    """The prefix-choice rule's parameters (recorded in the evidence and in the gate's cache key)."""
    return {
        "gate_prompts": GATE_PROMPTS,
        "scan_cuts": SCAN_CUTS,
        "min_prefix": MIN_PREFIX,
        "continuation_tokens": CONTINUATION_TOKENS,
        "mixed_prefix_tries": MIXED_PREFIX_TRIES,
        "pilot_samples": PILOT_SAMPLES,
    }


def _propose_once(backend, proposer, prefix: list[int], rng, *, max_nodes, max_depth) -> CompiledTree:
    backend.prefill_one(prefix)  # as in a run: proposers reading the target's hidden rows see the prefill
    proposer.start(list(prefix))
    try:
        proposal, depth = propose_round(proposer, list(prefix), rng, max_depth=max_depth)
    finally:
        proposer.observe_commit(list(prefix))
        proposer.finish()
    return compile_round(proposal, prefix, max_nodes=max_nodes, depth=depth)


@torch.inference_mode()
def target_continuation(backend: CausalLMBackend, prompt: list[int], tokens: int) -> list[int]:
    """``prompt`` followed by ``tokens`` tokens the target decodes greedily from it."""
    seq = list(prompt)
    state = backend.prefill_one(seq)
    for _ in range(tokens):
        out = backend.verify_one(state, seq[-1], None)
        backend.commit_one(state, [])
        seq.append(int(out.logits[-1].argmax()))
    return seq


@torch.inference_mode()
def proposing_prefixes(
    backend: CausalLMBackend,
    proposer,
    prompts: list[list[int]],
    *,
    stream: int,
    max_nodes: int | None,
    max_depth: int | None,
    continuation: int = 0,
    tally: dict | None = None,
) -> Iterator[tuple[list[int], dict]]:
    """The cut points at which the proposer proposes something, in the gate's order (see the
    module docstring): each of the first :data:`GATE_PROMPTS` prompts from its full length back
    one token at a time, then (``continuation`` > 0) each prompt followed by ``continuation``
    tokens the target decodes greedily, from its end back to the prompt. Yields ``(prefix, how
    it was found)``; ``tally`` counts the probes and the sequences scanned. Deterministic: the
    probes draw from random stream ``stream``."""
    tally = {} if tally is None else tally
    tally.update(probes=0, prompts_scanned=min(len(prompts), GATE_PROMPTS), continuations_scanned=0)
    sources = [("prompt", i, list(p), 0) for i, p in enumerate(prompts[:GATE_PROMPTS])]
    sources += [("continuation", i, None, len(p)) for i, p in enumerate(prompts[:GATE_PROMPTS]) if continuation > 0]
    for kind, i, seq, floor in sources:
        if seq is None:
            seq = target_continuation(backend, prompts[i], continuation)
            tally["continuations_scanned"] += 1
        low = max(len(seq) - SCAN_CUTS, MIN_PREFIX - 1, floor)
        for cut in range(len(seq), low, -1):
            tally["probes"] += 1
            prefix = seq[:cut]
            tree = _propose_once(
                backend, proposer, prefix, TorchRandomSource(stream), max_nodes=max_nodes, max_depth=max_depth
            )
            if tree.num_rows > 0:
                yield (
                    prefix,
                    {
                        "source": kind,
                        "prompt_index": i,
                        "prompt_len": len(prompts[i]),
                        "prefix_len": cut,
                        "probe_rows": tree.num_rows,
                        "probes": tally["probes"],
                        "rule": prefix_rule(),
                    },
                )


@torch.inference_mode()
def choose_prefix(
    backend: CausalLMBackend,
    proposer,
    prompts: list[list[int]],
    *,
    stream: int,
    max_nodes: int | None,
    max_depth: int | None,
    continuation: int = 0,
) -> tuple[list[int] | None, dict]:
    """The gate's first prefix (:func:`proposing_prefixes`) and how it was found; ``None`` when no
    cut yields a proposal."""
    tally: dict = {}
    found = proposing_prefixes(
        backend,
        proposer,
        prompts,
        stream=stream,
        max_nodes=max_nodes,
        max_depth=max_depth,
        continuation=continuation,
        tally=tally,
    )
    first = next(found, None)
    if first is not None:
        return first
    return None, {**tally, "rule": prefix_rule()}


@torch.inference_mode()
def statistical_gate(
    *,
    backend: CausalLMBackend,
    proposer,
    verifier,
    policy,
    prompts: list[list[int]],
    samples: int,
    top_m: int,
    alpha: float,
    seed: int,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    batch: int = 16,
    confirm: bool = True,
    memo: bool = True,
    continuation: int = 0,
) -> dict:
    """Chi-square of the speculative first token against the exact target distribution at the prefix
    :func:`choose_prefix` finds in ``prompts``. Returns the evidence (``status`` ``passed`` or
    ``failed``, or ``not_applicable`` when the proposer proposes at no candidate prefix); a first
    chi-square rejection is confirmed on independent samples (``confirm``), and the gate fails only
    when the confirmation rejects too; the entry's top level is then the confirmation's
    (``decided_by``), with both tests under ``first_test`` and ``confirmation``. A committed token the
    target's law gives no mass, in any test the gate runs (the first, a confirmation, a pilot, a test
    at another prefix), fails the gate outright, with that test at the top level and where it was seen
    under ``impossible``. ``memo=False`` shares nothing but whole
    trees' verify forwards (``batch`` per forward) and computes every draft step of every sample
    (same result, slower: for tests)."""
    with _counters_restored(proposer):
        return _statistical_gate(
            backend=backend,
            proposer=proposer,
            verifier=verifier,
            policy=policy,
            prompts=prompts,
            samples=samples,
            top_m=top_m,
            alpha=alpha,
            seed=seed,
            max_nodes=max_nodes,
            max_depth=max_depth,
            batch=batch,
            confirm=confirm,
            memo=memo,
            continuation=continuation,
        )


@contextmanager
def _counters_restored(proposer):
    """The gate proposes on the proposer the run then measures: its counters (``stats``, the peak
    proposal state) are put back afterwards, so a record's proposal-side figures count the measured
    rounds only, whether the gate ran or came from the cache."""
    group = members(proposer)
    # one deepcopy for all: a merged proposer's record entry holds its sources' live counters
    saved = copy.deepcopy([m.stats for m in group])
    peaks = [getattr(m, "peak_state_bytes", None) for m in group]
    try:
        yield
    finally:
        for m, stats, peak in zip(group, saved, peaks):
            m.stats = stats
            if peak is not None:
                m.peak_state_bytes = peak


def _statistical_gate(
    *,
    backend,
    proposer,
    verifier,
    policy,
    prompts,
    samples,
    top_m,
    alpha,
    seed,
    max_nodes,
    max_depth,
    batch,
    confirm,
    memo,
    continuation,
) -> dict:
    t0 = time.perf_counter()
    tally: dict = {}
    candidates = proposing_prefixes(
        backend,
        proposer,
        prompts,
        stream=gate_stream(seed, samples),
        max_nodes=max_nodes,
        max_depth=max_depth,
        continuation=continuation,
        tally=tally,
    )
    first = next(candidates, None)
    if first is None:
        scanned = f"the first {tally['prompts_scanned']} prompt(s)" + (
            f" and of the {continuation} tokens the target decodes after each" if continuation else ""
        )
        return {
            **not_applicable(
                f"proposer proposed nothing at the {tally['probes']} candidate prefixes of {scanned}: the test "
                "would only sample the target"
            ),
            "prefix": {**tally, "rule": prefix_rule()},
            "seconds": time.perf_counter() - t0,
        }
    kw = dict(
        backend=backend,
        proposer=proposer,
        verifier=verifier,
        policy=policy,
        top_m=top_m,
        alpha=alpha,
        max_nodes=max_nodes,
        max_depth=max_depth,
        batch=batch,
        memo=memo,
    )
    prompt_ids, prefix = first
    prefix["seconds"] = round(time.perf_counter() - t0, 3)
    result = _decide(prompt_ids, prefix, samples=samples, stream=gate_stream(seed, samples), confirm=confirm, **kw)
    if result["status"] != "passed" or "paths_note" not in result:
        return {**result, "seconds": time.perf_counter() - t0}
    # every sample took one way to its first token: the other was not tested here. Pilot the next
    # candidate prefixes and test the first whose samples take both ways
    one_way = {
        "prefix_len": prefix["prefix_len"],
        "source": prefix["source"],
        "paths_note": result["paths_note"],
        "way": way_of(result),
        **{k: result[k] for k in ("status", "decided_by", "p_value", "impossible_samples") if k in result},
    }
    pilots = []
    for k, (prompt_ids, how) in enumerate(itertools.islice(candidates, MIXED_PREFIX_TRIES)):
        stream = gate_stream(seed, samples, pilot=k)
        pilot = chi_square_test(prompt_ids=prompt_ids, samples=PILOT_SAMPLES, stream=stream, **kw)
        pilots.append(
            {
                "prefix_len": how["prefix_len"],
                "source": how["source"],
                "stream": stream,
                "samples": pilot["samples"],
                "accepted": pilot["first_token_accepted"],
                "way": way_of(pilot),
                "impossible_samples": pilot.get("impossible_samples", 0),
            }
        )
        if saw_impossible(pilot):  # a pilot's samples are real rounds: an impossible token among them is proof
            return {
                **pilot,
                "status": "failed",
                "prefix": how,
                "decided_by": "pilot",
                "impossible": impossible_evidence(pilot, how, test="pilot"),
                "one_way_prefix": one_way,
                "pilots": pilots,
                "seconds": time.perf_counter() - t0,
            }
        if "paths_note" not in pilot:  # on streams of its own: the pilot's samples chose the prefix
            stream = gate_stream(seed, samples, full=k)
            mixed = _decide(prompt_ids, how, samples=samples, stream=stream, confirm=confirm, **kw)
            if "paths_note" in mixed and mixed["status"] == "passed":  # the full test took one way after all
                pilots[-1]["full_test"] = {
                    "stream": stream,
                    "samples": mixed["samples"],
                    "accepted": mixed["first_token_accepted"],
                    "way": way_of(mixed),
                    "paths_note": mixed["paths_note"],
                    **{key: mixed[key] for key in ("decided_by", "p_value") if key in mixed},
                }
                continue
            return {
                **mixed,
                "one_way_prefix": one_way,
                "pilots": pilots,
                "seconds": time.perf_counter() - t0,
            }
    return {
        **result,
        "coverage": "one_way",
        "way": one_way["way"],
        "pilots": pilots,
        "seconds": time.perf_counter() - t0,
    }


def saw_impossible(test: dict) -> bool:
    """Whether a test's samples committed a token the target's law gives no mass (outside its top-k /
    top-p): a single such sample proves the round wrong, so the test that saw it fails the gate
    outright; it is neither rerun nor replaced by a test at another prefix."""
    return test.get("impossible_samples", 0) > 0


def impossible_evidence(result: dict, prefix: dict, *, test: str) -> dict:
    """Where ``result`` (a test that :func:`saw_impossible`) saw the impossible tokens: the test
    (``first_test``, ``confirmation``, ``pilot``), its prefix, its samples, how many committed a
    token of no mass, and those tokens with their counts."""
    return {
        "test": test,
        "prefix_len": prefix.get("prefix_len", result.get("prefix_len")),
        "source": prefix.get("source"),
        "samples": result.get("samples"),
        "impossible_samples": result["impossible_samples"],
        "tokens": result.get("impossible_tokens", []),
        "why": "the verifier committed a token the target's law gives no mass: one such sample is proof, and the "
        "gate fails on it with no rerun",
    }


def _decide(prompt_ids, prefix, *, samples, stream, confirm, **kw) -> dict:
    """The test at ``prompt_ids``; a first chi-square rejection confirmed on independent samples
    (``confirm``). A test that :func:`saw_impossible` fails the gate, with its evidence under
    ``impossible``: the first without a confirmation, the confirmation whatever the first said."""
    first = chi_square_test(prompt_ids=prompt_ids, samples=samples, stream=stream, **kw)
    if saw_impossible(first):
        return {
            **first,
            "status": "failed",
            "prefix": prefix,
            "decided_by": "first_test",
            "impossible": impossible_evidence(first, prefix, test="first_test"),
        }
    if first["status"] == "passed" or not confirm:
        return {**first, "prefix": prefix}
    second = chi_square_test(prompt_ids=prompt_ids, samples=samples, stream=stream + CONFIRMATION_STREAM, **kw)
    keep = (
        "status",
        "stream",
        "statistic",
        "p_value",
        "observed",
        "expected",
        "impossible_samples",
        "impossible_tokens",
        "distinct_trees",
        "draft_calls",
        "memo_hits",
        "first_token_accepted",
        "proposed",
        "paths_note",
    )
    entry = {  # the top level is the deciding test's, so a status never sits beside another test's p-value
        **{k: v for k, v in first.items() if k not in keep},
        **{k: second[k] for k in keep if k in second},
        "prefix": prefix,
        "decided_by": "confirmation",
        "first_test": {k: first[k] for k in keep if k in first},
        "confirmation": {k: second[k] for k in keep if k in second},
        "proposal_seconds": first["proposal_seconds"] + second["proposal_seconds"],
    }
    if saw_impossible(second):
        entry["status"] = "failed"
        entry["impossible"] = impossible_evidence(second, prefix, test="confirmation")
    return entry


class RowPending(Exception):
    """A verifier read the target's row at a path not computed yet."""

    def __init__(self, path: tuple[int, ...]) -> None:
        super().__init__(path)
        self.path = path


class AllRowsNeeded(Exception):
    """A verifier used the target rows other than one row at a time."""


class LazyRows:
    """A tree's rows ``[1 + N, V]`` for a verifier (the target's logits, or their laws: :meth:`mapped`),
    served row by row from the rows computed so far: ``rows[i]`` is row ``i`` (0: the frontier), or
    raises :class:`RowPending` for a row not computed yet. Any other use (a slice, a tensor method, a torch
    function) raises :class:`AllRowsNeeded`, and the sample is retried with every row of its tree."""

    def __init__(self, paths: list[tuple[int, ...]], probs_of) -> None:
        self._paths = paths
        self._probs_of = probs_of

    def __len__(self) -> int:
        return len(self._paths)

    def __getitem__(self, i):
        if isinstance(i, bool) or not isinstance(i, int):
            raise AllRowsNeeded(f"index {type(i).__name__}")
        n = len(self._paths)
        if not -n <= i < n:
            raise IndexError(i)
        path = self._paths[i % n]
        probs = self._probs_of(path)
        if probs is None:
            raise RowPending(path)
        return probs

    def mapped(self, fn) -> LazyRows:
        """The same rows through ``fn(path)`` (a row's law from its logits), pending where ``fn`` returns None."""
        return LazyRows(self._paths, fn)

    def __getattr__(self, name: str):
        raise AllRowsNeeded(name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise AllRowsNeeded(getattr(func, "__name__", str(func)))


#: the chi-square approximation wants at least this many expected samples in every bin (Cochran)
MIN_EXPECTED = 5.0

#: the tail (the tokens outside the top M) is split by rank into at most this many bins of about equal
#: expected count: a high-entropy law, whose top tokens each expect too few samples for a bin of their
#: own, is still tested (likelier against rarer tokens) instead of pooled into one bin that tests nothing
TAIL_BINS = 4


def chi2_bins(
    top: list[int], p_exact: torch.Tensor, counts: dict[int, int], samples: int
) -> tuple[list[list[int | str]], list[float], list[int]]:
    """The chi-square bins of the first committed token: ``top`` (the likeliest tokens, most likely
    first) each in a bin of its own while its expected count reaches :data:`MIN_EXPECTED`, rarer ones
    pooled in order until theirs does; the rest of the vocabulary (with any pooled remainder of the
    top) is ``"other"``, split by rank into up to :data:`TAIL_BINS` bins of about equal expected count
    when it expects enough samples (labelled ``"rank a-b"``, ``"rank a"`` and ``"rank a+"``, ranks counted from the
    likeliest token, the top first; the last holds every token of zero mass too); a remainder below
    the minimum joins the last bin. Fixed by the law alone, before any count is read. Returns (tokens
    of each bin, expected counts, observed counts)."""
    bins: list[list[int | str]] = []
    expected: list[float] = []
    observed: list[int] = []
    toks: list[int | str] = []
    exp, obs = 0.0, 0
    for t in top:
        toks, exp, obs = [*toks, t], exp + float(p_exact[t]) * samples, obs + counts.get(t, 0)
        if exp >= MIN_EXPECTED:
            bins.append(toks)
            expected.append(exp)
            observed.append(obs)
            toks, exp, obs = [], 0.0, 0
    rest_p = max(1.0 - sum(float(p_exact[t]) for t in top), 0.0)
    tail_total = exp + rest_p * samples
    groups = min(TAIL_BINS, int(tail_total / MIN_EXPECTED + 1e-9))  # a sum a hair short still counts
    tail = _tail_groups(top, p_exact, counts, samples, carried=exp, groups=groups) if groups > 1 else []
    if len(tail) > 1:
        rank = len(top) + 1  # the tail's first token (the pooled remainder of the top joins its first bin)
        for i, (n, texp, tobs) in enumerate(tail):
            label = f"rank {rank}+" if i == len(tail) - 1 else f"rank {rank}" + (f"-{rank + n - 1}" if n > 1 else "")
            bins.append([*toks, label] if i == 0 else [label])
            expected.append(texp + (exp if i == 0 else 0.0))
            observed.append(tobs + (obs if i == 0 else 0))
            rank += n
        return bins, expected, observed
    toks, exp = [*toks, "other"], exp + rest_p * samples
    obs += samples - sum(counts.get(t, 0) for t in top)
    if exp >= MIN_EXPECTED or not bins:
        bins.append(toks)
        expected.append(exp)
        observed.append(obs)
    else:  # too little for a bin of its own: pooled with the last one
        bins[-1] = [*bins[-1], *toks]
        expected[-1] += exp
        observed[-1] += obs
    return bins, expected, observed


def _tail_groups(
    top: list[int], p_exact: torch.Tensor, counts: dict[int, int], samples: int, *, carried: float, groups: int
) -> list[tuple[int, float, int]]:
    """The tail's tokens of positive mass outside ``top``, likeliest first (ties by id), cut into at most
    ``groups`` consecutive runs, each closed once its expected count (the first counting ``carried``,
    the top's pooled remainder) reaches an equal share; a last run below :data:`MIN_EXPECTED` joins the
    one before. Returns (tokens, expected, observed) per run, the last observing every zero-mass token."""
    p_exact = p_exact.detach().to("cpu")  # the law may sit on the model's device; the cut is host-side
    outside = torch.ones_like(p_exact, dtype=torch.bool)
    outside[list(top)] = False
    ids = torch.nonzero(outside & (p_exact > 0)).flatten()
    if ids.numel() == 0:
        return []
    probs = p_exact[ids].double()
    order = torch.sort(probs, descending=True, stable=True).indices
    ids, probs = ids[order], probs[order]
    cum = torch.cumsum(probs, 0) * samples + carried  # expected count through each tail token
    total = float(cum[-1])
    share = total / groups
    ends: list[int] = []  # exclusive end of each run in the tail
    start_exp = 0.0
    while len(ends) < groups - 1:
        reach = (start_exp + share) * (1 - 1e-9)  # an equal share summed in floating point may fall a hair short
        end = int(torch.searchsorted(cum, torch.tensor(reach, dtype=cum.dtype))) + 1
        if end >= len(ids):
            break
        ends.append(end)
        start_exp = float(cum[end - 1])
    ends.append(len(ids))
    if len(ends) > 1 and total - float(cum[ends[-2] - 1]) < MIN_EXPECTED:
        ends.pop(-2)
    position = {int(t): i for i, t in enumerate(ids.tolist()) if int(t) in counts}
    top_set = set(top)
    runs, begin = [], 0
    for k, end in enumerate(ends):
        last = k == len(ends) - 1
        exp = float(cum[end - 1]) - (float(cum[begin - 1]) if begin else carried)
        obs = sum(
            n for t, n in counts.items() if t not in top_set and (begin <= position[t] < end if t in position else last)
        )
        runs.append((end - begin, exp, obs))
        begin = end
    return runs


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
    memo: bool = True,
) -> dict:
    """One chi-square test over ``samples`` rounds at ``prompt_ids``, sample ``s`` drawing from
    random stream ``stream + s``; the draft side through a fixed-prefix memo (and the law tables
    of proposers that have one) unless ``memo=False``, the target side by path (see
    :func:`verify_by_path`) unless ``memo=False`` too (then every distinct tree is verified whole,
    ``batch`` per forward)."""
    t0 = time.perf_counter()
    committed = list(prompt_ids)
    backend.prefill_one(committed)  # as in a run: proposers reading the target's hidden rows see the prefill
    proposer.start(list(prompt_ids))
    rngs: list[TorchRandomSource | None] = [None] * samples
    replay: list[ReplayingSource | None] = [None] * samples
    tree_of: list[int] = [0] * samples
    keys: dict[tuple, int] = {}
    distinct: list[CompiledTree] = []
    passes = 0
    with (
        fixed_prefix_memo(proposer) if memo else nullcontext() as law_memo,
        law_tables(proposer, committed) if memo else nullcontext([]) as tables,
        tqdm(total=samples, desc="gate: chi-square proposals", unit="sample", file=sys.stderr, leave=False) as bar,
    ):
        pending = list(range(samples))
        while pending:  # one pass per depth a stopped proposal reaches (one pass without tables)
            passes += 1
            stopped = []
            for s in pending:
                if replay[s] is None:
                    replay[s] = ReplayingSource(TorchRandomSource(stream + s))
                rng = replay[s]
                rng.rewind()
                if law_memo is not None:
                    law_memo.begin(committed)
                try:
                    proposal, depth = propose_round(proposer, committed, rng, max_depth=max_depth)
                except LawPending:
                    stopped.append(s)
                    continue
                finally:
                    if law_memo is not None:
                        law_memo.end()
                    proposer.observe_commit(committed)  # the round is not committed: roll the proposal state back
                tree = compile_round(proposal, committed, max_nodes=max_nodes, depth=depth)
                key = tree_key(tree)
                if key not in keys:
                    keys[key] = len(distinct)
                    distinct.append(tree)
                rngs[s], tree_of[s] = rng.source, keys[key]  # the verifier draws next from the source itself
                replay[s] = None
                bar.update(1)
            computed = sum(table.fill() for table in tables)
            if stopped and not computed:
                raise RuntimeError("statistical gate: proposals stopped for laws that the tables did not compute")
            pending = stopped
        memo_evidence = law_memo.evidence() if law_memo is not None else {"memo": False}
        for table in tables:
            for k, v in table.evidence().items():
                memo_evidence[k] = memo_evidence.get(k, 0) + v
    proposer.finish()
    t_propose = time.perf_counter() - t0
    if memo:
        counts, p_exact, target = verify_by_path(backend, committed, distinct, tree_of, rngs, verifier, policy)
    else:
        counts, p_exact, target = verify_by_tree(backend, committed, distinct, tree_of, rngs, verifier, policy, batch)
    t_verify = time.perf_counter() - t0 - t_propose
    # a committed token the target's law gives no mass (outside top-k / top-p) fails outright: no
    # bin may hide it
    impossible_tokens = sorted([t, n] for t, n in counts.items() if float(p_exact[t]) <= 0.0)
    impossible = sum(n for _, n in impossible_tokens)
    top = torch.topk(p_exact, min(top_m, int((p_exact > 0).sum()))).indices.tolist()
    bin_tokens, expected, observed = chi2_bins(top, p_exact, counts, samples)
    if len(observed) > 1:
        stat, pvalue = chisquare(observed, f_exp=expected)
        passed = bool(pvalue >= alpha) and impossible == 0
        test = {"statistic": float(stat), "p_value": float(pvalue)}
    else:  # one token holds (nearly) all the mass (top_k=1, a tiny top_p or temperature): no test, a count
        passed = impossible == 0
        test = {
            "statistic": None,
            "p_value": None,
            "note": f"the target's law leaves one bin of {MIN_EXPECTED:g}+ expected samples: every sample must be "
            "a token it gives mass",
        }
    proposed = sum(1 for i in tree_of if distinct[i].num_rows > 0)  # samples whose tree had a candidate
    note = paths_note(int(target["first_token_accepted"]), samples, proposed=proposed)
    return {
        "status": "passed" if passed else "failed",
        "samples": samples,
        "stream": stream,
        "proposed": proposed,
        **({"paths_note": note} if note else {}),
        "bins": len(observed),
        "impossible_samples": impossible,
        **({"impossible_tokens": impossible_tokens} if impossible else {}),  # [token, samples] each
        **test,
        "alpha": alpha,
        "observed": observed,
        "expected": [round(e, 3) for e in expected],
        "bin_tokens": bin_tokens,
        "prefix_len": len(committed),
        "distinct_trees": len(distinct),
        "proposal_passes": passes,
        **memo_evidence,
        **target,
        "seconds": time.perf_counter() - t0,
        "proposal_seconds": t_propose,
        "verify_select_seconds": t_verify,
    }


#: the share of the samples with a proposal that must take each of the verifier's two ways to a first
#: token (a proposed token accepted; every one rejected, the correction sampled) for the test to count
#: as exercising both: 5 rejections in 2,000 samples left the correction all but untested
MIN_WAY_SHARE = 0.02


def way_taken(accepted: int, samples: int, *, proposed: int | None = None) -> str | None:
    """The one way to a first token that a test's samples took, all of them or all but fewer than
    :data:`MIN_WAY_SHARE` of those with a proposal: ``"accepted"`` (a proposed token accepted) or
    ``"rejected"`` (every proposed token rejected, the target's correction drawn); None when both were
    exercised, or no sample had a proposal. ``proposed``: the samples whose tree had a candidate
    (default: all)."""
    proposed = samples if proposed is None else proposed
    if samples and accepted == samples:
        return "accepted"
    if not proposed:
        return None
    if accepted == 0:
        return "rejected"
    least = max(1, math.ceil(MIN_WAY_SHARE * proposed))
    if proposed - accepted < least:
        return "accepted"
    if accepted < least:
        return "rejected"
    return None


def way_of(test: dict) -> str | None:
    """:func:`way_taken` of a test's entry (its ``first_token_accepted``, ``samples`` and ``proposed``)."""
    return way_taken(int(test["first_token_accepted"]), int(test["samples"]), proposed=test.get("proposed"))


def paths_note(accepted: int, samples: int, *, proposed: int | None = None) -> str | None:
    """What the test did not exercise, when its samples took one of the verifier's two ways to a
    first token (:func:`way_taken`), or None. ``proposed``: the samples whose tree had a candidate
    (default: all); one without is neither. The evidence stays valid for the proposer as configured
    (a draft that proposes what the target samples is never rejected in the run either), but says
    less."""
    way = way_taken(accepted, samples, proposed=proposed)
    proposed = samples if proposed is None else proposed
    if way == "accepted" and accepted == samples:
        return (
            "every sample's first token was an accepted proposed token: the correction after a rejection "
            "was not exercised at this prefix"
        )
    if way == "accepted":
        return (
            f"only {proposed - accepted} of the {proposed} samples with a proposal rejected every proposed token "
            f"(fewer than {MIN_WAY_SHARE:.0%}): the correction after a rejection was barely exercised at this prefix"
        )
    if way == "rejected" and accepted == 0:
        return "no sample accepted a proposed token: only the correction after a rejection was exercised at this prefix"
    if way == "rejected":
        return (
            f"only {accepted} of the {proposed} samples with a proposal accepted a proposed token (fewer than "
            f"{MIN_WAY_SHARE:.0%}): acceptance was barely exercised at this prefix"
        )
    return None


def _first_token(tree: CompiledTree, sel) -> int:
    return round_tokens(tree, sel)[0]


def frontier_law(policy, logits: torch.Tensor) -> torch.Tensor:
    """The law the test's samples follow at the frontier, ``[V]`` in float64: the policy on the
    logits in the precision the round computes it (a top-p set decided in float64 may keep a token
    the run's float32 set drops, and a correct round would fail on it), then widened and summed to
    one again in float64 (the chi-square's expected counts must add up to the samples)."""
    law = policy.probs(logits).to(torch.float64)
    return law / law.sum()


def verify_by_tree(backend, committed, distinct, tree_of, rngs, verifier, policy, batch):
    """Every distinct tree verified whole, ``batch`` trees per forward; each sample selected on its
    tree's rows. Returns (first-token counts, the frontier law in float64, evidence)."""
    samples_of: list[list[int]] = [[] for _ in distinct]
    for s, i in enumerate(tree_of):
        samples_of[i].append(s)
    counts: dict[int, int] = {}
    accepted = 0  # samples whose first token is a proposed row the verifier accepted
    p_exact = None
    for i, logits in verify_distinct(backend, committed, distinct, batch=batch):
        if p_exact is None:
            p_exact = frontier_law(policy, logits[0])  # [V]
        tree = distinct[i]
        for s in samples_of[i]:
            sel = select_round(verifier, tree, logits, policy, rngs[s])  # the round's step on the tree's rows
            first = _first_token(tree, sel)
            counts[first] = counts.get(first, 0) + 1
            accepted += bool(sel.accepted_rows)
    forwards = -(-len(distinct) // max(min(batch, len(distinct)), 1))
    rows = sum(1 + tree.num_rows for tree in distinct)
    return counts, p_exact, {"target_forwards": forwards, "target_rows": rows, "first_token_accepted": accepted}


class _LawByRow:
    """``verifier`` selecting as the default ``select_logits`` does (``select`` on ``policy.probs`` of
    the logits) on logits served one row at a time (:class:`LazyRows`): ``policy.probs`` is row-wise,
    so each row's law is computed from that row's logits alone, under the policy the round step hands
    over (``law_of(policy, path)``), and only for the rows the verifier reads."""

    def __init__(self, verifier, law_of) -> None:
        self.verifier = verifier
        self._law_of = law_of

    def select_logits(self, tree, logits, policy, rng):
        return self.verifier.select(tree, logits.mapped(lambda path: self._law_of(policy, path)), rng)


def _select(verifier, tree, rng, state, paths, rows_of, policy, *, whole: bool, law_of=None):
    """The round step's selection (:func:`~harness.engine.decode.select_round`) from the random
    source's ``state``, on the tree's logit rows: all of them stacked (``whole``) or served one at a
    time. ``law_of`` (a verifier without its own ``select_logits``): served one at a time, the
    verifier selects on each row's law under the step's policy (:class:`_LawByRow`)."""
    rng.generator.set_state(state)
    if whole:
        return select_round(verifier, tree, torch.stack([rows_of(p) for p in paths]), policy, rng)
    by_row = verifier if law_of is None else _LawByRow(verifier, law_of)
    return select_round(by_row, tree, LazyRows(paths, rows_of), policy, rng)


def verify_by_path(backend, committed, distinct, tree_of, rngs, verifier, policy):
    """Each sample selected by the real verifier on its own tree, the target's rows computed by
    path (:class:`~harness.target.paths.PathRows`) as the verifiers reach them: a pass selects
    every remaining sample on the rows computed so far, a sample that reads a row not computed yet
    stops (:class:`RowPending`) and is retried from its random source's state after the proposal
    once the rows the stopped samples reached are computed, many per forward. Rows no verifier
    reads (below a rejection) are never computed. Returns (first-token counts, the frontier law
    in float64, evidence)."""
    root = (committed[-1],)
    rows = PathRows(backend, backend.prefill_one(committed))
    rows.compute([root])
    laws: dict[tuple, torch.Tensor] = {}

    def law_of(law_policy, path):
        """The law of the row at ``path`` under ``law_policy`` (the one the round step hands over), or
        None while the row is not computed."""
        key = (law_policy, path)
        if key not in laws:
            if path not in rows:
                return None
            laws[key] = law_policy.probs(rows[path])  # [V] as the round computes it
        return laws[key]

    def rows_of(path):
        return rows[path] if path in rows else None

    by_row = None if overrides_select_logits(verifier) else law_of  # the verifier's own path from the logits, or not

    paths = [[root] + [root + p for p in tree.full_prefixes] for tree in distinct]
    whole: set[int] = set()  # trees a verifier needs whole (it used the rows other than one at a time)
    counts: dict[int, int] = {}
    accepted = 0  # samples whose first token is a proposed row the verifier accepted
    pending = [(s, rngs[s].generator.get_state()) for s in range(len(tree_of))]
    passes = 0
    while pending:
        passes += 1
        stopped, reached = [], set()
        for s, state in pending:
            i = tree_of[s]
            tree, rng = distinct[i], rngs[s]
            try:
                sel = _select(verifier, tree, rng, state, paths[i], rows_of, policy, whole=i in whole, law_of=by_row)
            except AllRowsNeeded:
                whole.add(i)
                if all(p in rows for p in paths[i]):
                    sel = _select(verifier, tree, rng, state, paths[i], rows_of, policy, whole=True)
                else:
                    stopped.append((s, state))
                    reached.update(paths[i])
                    continue
            except RowPending as pend:
                stopped.append((s, state))
                reached.add(pend.path)
                continue
            first = _first_token(tree, sel)
            counts[first] = counts.get(first, 0) + 1
            accepted += bool(sel.accepted_rows)
        computed = rows.compute(reached)
        if stopped and not computed:
            raise RuntimeError("statistical gate: a verifier stopped for rows that are already computed")
        pending = stopped
    p_exact = frontier_law(policy, rows[root])  # [V]
    return (
        counts,
        p_exact,
        {
            "target_forwards": rows.forwards,
            "target_rows": rows.rows_computed,
            "verify_passes": passes,
            "first_token_accepted": accepted,
        },
    )
