"""The model-level equivalence gate, on the configured model: every tree row's logits equal its
root-to-node path decoded sequentially (the path-equivalence check), and the cache after committing
accepted paths over several rounds (non-contiguous, contiguous with a rejected row after them, empty)
equals the cache of sequentially decoding the committed tokens (the pending-token commit keeps
exactly the accepted path, and no rejected row)."""

from __future__ import annotations

import math
import sys

import torch
from tqdm import tqdm

from harness.contracts import ProposalResult
from harness.target.backend import CausalLMBackend
from harness.topology.compiler import compile_tree, validate_candidate_graph, validate_commit

#: absolute tolerance of the model-level equivalence gate, by dtype (for half precision, only where
#: there is no magnitude to count units in the last place at)
EQUIVALENCE_ATOL = {torch.float64: 1e-8, torch.float32: 2e-3, torch.bfloat16: 0.25, torch.float16: 0.05}
#: half precision: the tolerance in units in the last place at the reference's largest magnitude.
#: A tree forward and a sequential one reduce in different orders; on SmolLM2 (logits up to ~41)
#: they differ by up to ~2.4 ulps in bfloat16 and ~4 in float16, while a row that sees a sibling
#: moves a logit by ~18 and a position off by one by ~4.3 (72 and 17 bfloat16 ulps at 32..64).
EQUIVALENCE_ULPS = {torch.bfloat16: 8, torch.float16: 16}


def tolerance(dtype: torch.dtype, scale: float) -> float:
    """The gate's absolute tolerance for values of magnitude up to ``scale`` in ``dtype``: in half
    precision so many units in the last place at ``scale``, however small the scale (a fixed floor
    was most of a small-logit model's range: a tree-mask error moving its logits by 3% passed)."""
    atol = EQUIVALENCE_ATOL.get(dtype, 2e-3)
    ulps = EQUIVALENCE_ULPS.get(dtype)
    if ulps is None or not scale > 0 or not math.isfinite(scale):
        return atol
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(scale))
    return ulps * ulp


def nan_max(*values: float) -> float:
    """The largest of ``values``, or NaN where any is NaN (``max`` keeps whichever comes first where a
    NaN compares false, so a NaN difference would vanish behind a finite one and no check see it)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _rows_bar(desc: str) -> tqdm:
    """A progress bar over the rows checked against a sequential forward each (minutes on a large
    model on a CPU)."""
    return tqdm(desc=desc, unit="row", file=sys.stderr, leave=False)


def _paths_from(ids: list[int], vocab_size: int) -> list[list[int]]:
    """A branching tree (A B {C,D,E}, A F, X B) of seven distinct tokens, the latest distinct ones of
    ``ids`` first (then the lowest ids it lacks): eight rows with siblings, a shared token under two
    parents, and a non-contiguous deepest path, whatever the text (a tail of one repeated token
    would otherwise fold the tree into a chain, leaving nothing for the tree attention to leak)."""
    tokens: list[int] = []
    for t in reversed(ids):
        if t not in tokens:
            tokens.append(t)
    tokens += [t for t in range(min(vocab_size, 7 + len(tokens))) if t not in tokens]
    a, b, c, d, e, f, x = (tokens[i % len(tokens)] for i in range(7))  # fewer than seven ids: the tree folds
    return [[a, b, c], [a, b, d], [a, b, e], [a, f], [x, b]]


#: the rows of :func:`_paths_from`'s tree
GATE_TREE_ROWS = 8
#: the prompt tokens a gate keeps at most
GATE_PROMPT_TOKENS = 48
#: positions one gate round adds past the committed tokens at most: a path of three and its bonus token
ROUND_POSITIONS = 4
#: the rows of the gates' chain round (:func:`chain_round`): a chain of three tokens, inside one round's positions
CHAIN_ROWS = 3


def fit_to_positions(positions: int | None, keep: int, rounds: int) -> tuple[int, int]:
    """``(prompt tokens kept, rounds)`` so that every forward of the gate stays inside the run's
    ``positions`` (its context limit: the target's positions, a sliding window, a longrope switch),
    as the run's own forwards do; ``positions`` None: no limit."""
    if positions is None:
        return keep, rounds
    rounds = max(1, min(rounds, (positions - 2) // ROUND_POSITIONS))
    return max(2, min(keep, positions - ROUND_POSITIONS * rounds)), rounds


def _deepest_path(tree) -> list[int]:
    """The path to the last-inserted row at the greatest depth: in :func:`_paths_from`'s tree a
    non-contiguous one (its rows skip the siblings inserted before it)."""
    return list(tree.path_to(max(range(tree.num_rows), key=lambda x: (int(tree.depths[x]), x))))


def _contiguous_path(tree) -> list[int]:
    """The deepest path whose rows are the tree's first rows (0, 1, ..., d - 1) with a row after it:
    the commit keeps rows already in place and must still drop the rejected row that follows them."""
    best = [0]
    for x in range(tree.num_rows - 1):
        path = list(tree.path_to(x))
        if path == list(range(len(path))) and len(path) > len(best):
            best = path
    return best


#: what the commit of each round keeps, by round (then ``deep`` again): a non-contiguous path, a
#: contiguous one with a rejected row after it, nothing (the pending token alone)
COMMIT_KINDS = ("deep", "contiguous", "empty")


def chain_tree(sequence: list[int], vocab_size: int):
    """A chain of :data:`CHAIN_ROWS` tokens (the latest distinct ones of ``sequence``, as
    :func:`_paths_from` picks them) compiled after ``sequence``: topology ``sequence``, the tree a
    verify over a cache without holes runs with no attention mask (the forward of every
    topology=sequence run), where every branching tree runs with one."""
    chain = _paths_from(sequence[-7:], vocab_size)[0]
    tree = compile_tree(
        [ProposalResult.from_paths([chain], source="gate", manifest_hash="gate")], prefix_len=len(sequence)
    )
    validate_candidate_graph(tree)
    if tree.topology != "sequence" or tree.num_rows != CHAIN_ROWS:
        raise AssertionError(f"the gate's chain compiled to a {tree.topology} of {tree.num_rows} rows")
    return tree


def chain_round(backend: CausalLMBackend, sequences: list[list[int]], check) -> list[list[int]]:
    """The gates' chain round on a fresh cache of ``sequences`` (all of one length, so that the cache
    has no holes): one verify forward over a chain of :data:`CHAIN_ROWS` rows per request
    (:func:`chain_tree`), which runs with no attention mask as every topology=sequence run's verify
    does (a branching tree's runs with one); ``check(logits, sequence)`` gets each row with the
    sequence it must equal decoded alone. Then every request commits the same contiguous path (the
    chain but its last row, rejected after it: still no holes) and its next row, the pending token's
    over the committed cache, is checked too. Returns the committed sequences (with that pending
    token)."""
    if len({len(s) for s in sequences}) != 1:
        raise ValueError(f"the chain round needs sequences of one length; got {sorted({len(s) for s in sequences})}")
    state = backend.prefill(sequences, reserve=CHAIN_ROWS + 2)
    trees = [chain_tree(s, backend.vocab_size) for s in sequences]
    out = backend.verify(state, [s[-1] for s in sequences], trees)
    keep = list(range(CHAIN_ROWS - 1))
    committed = []
    for k, tree in enumerate(trees):
        tokens = [int(t) for t in tree.token_ids]
        for row in range(-1, tree.num_rows):
            check(out.logits[k][row + 1], sequences[k] + tokens[: row + 1])
        validate_commit(tree, keep)
        committed.append(sequences[k] + tokens[: len(keep)] + [int(out.logits[k][len(keep)].argmax())])
    backend.commit(state, [keep] * len(trees))
    after = backend.verify(state, [c[-1] for c in committed], [None] * len(committed))
    for k, sequence in enumerate(committed):
        check(after.logits[k][0], sequence)
    return committed


def commit_rows(tree, kind: str) -> list[int]:
    """The rows a gate round commits: ``deep`` (:func:`_deepest_path`), ``contiguous``
    (:func:`_contiguous_path`) or ``empty``."""
    if kind == "empty":
        return []
    return _contiguous_path(tree) if kind == "contiguous" else _deepest_path(tree)


@torch.inference_mode()
def equivalence_gate(
    backend: CausalLMBackend, prompt_ids: list[int], *, rounds: int = 5, positions: int | None = None
) -> dict:
    """Tree-attention and commit equivalence on ``backend``'s model, every forward inside
    ``positions`` (:func:`fit_to_positions`). Round ``r`` commits ``COMMIT_KINDS[r]`` (a
    non-contiguous path, a contiguous path with a rejected row after it, the empty path; later rounds
    non-contiguous paths), and the forward after each commit (the next round's tree, then one over
    the pending token alone) must equal the committed sequence decoded sequentially. A chain round
    (:func:`chain_round`) over a cache of the prompt checks the same of the forward without an
    attention mask that every topology=sequence run's verify takes (every tree above is masked).
    Returns the evidence (its ``status`` is ``passed`` or ``failed``)."""
    keep, rounds = fit_to_positions(positions, GATE_PROMPT_TOKENS, rounds)
    ids = list(prompt_ids[-keep:]) if len(prompt_ids) > keep else list(prompt_ids)
    if len(ids) < 2:
        ids = ids + ids
    seq = backend.prefill_one(ids)
    committed = list(ids)
    vocab = backend.vocab_size
    worst_tree, worst_cache = 0.0, 0.0
    tree_scale, cache_scale = 0.0, 0.0
    commits: list[str] = []
    # closed on every way out: a failure's one line is printed on the line the bar cleared
    with _rows_bar("gate: path equivalence") as bar:

        def compare(got: torch.Tensor, sequence: list[int]) -> None:
            nonlocal worst_tree, tree_scale
            ref = backend.forward_rows(backend.new_state(), sequence, list(range(len(sequence))), None).logits[-1]
            diff = float((got.float() - ref.float()).abs().max())
            worst_tree = nan_max(worst_tree, diff)
            tree_scale = nan_max(tree_scale, float(ref.float().abs().max()))
            bar.update()

        for r in range(rounds):
            paths = _paths_from(committed[-(7 + r) :], vocab)
            tree = compile_tree(
                [ProposalResult.from_paths(paths, source="gate", manifest_hash="gate")], prefix_len=len(committed)
            )
            validate_candidate_graph(tree)
            out = backend.verify_one(seq, committed[-1], tree)
            # each row equals its root-to-node path decoded sequentially: one causal forward over the
            # whole sequence, on a fresh cache of the kind the runs use (so the forward is the one the
            # runs compute, native layers included, and only the tree attention differs)
            for row in range(-1, tree.num_rows):
                path = [] if row < 0 else [int(tree.token_ids[x]) for x in tree.path_to(row)]
                compare(out.logits[row + 1], committed + path)
            kind = COMMIT_KINDS[r] if r < len(COMMIT_KINDS) else "deep"
            path_rows = commit_rows(tree, kind)
            validate_commit(tree, path_rows)
            backend.commit_one(seq, path_rows)
            commits.append(kind)
            bonus = int(out.logits[1 + path_rows[-1] if path_rows else 0].argmax())
            committed += [int(tree.token_ids[x]) for x in path_rows] + [bonus]
        chained = chain_round(backend, [ids], compare)[0]  # its forwards reach no further than the first round's
        ref_seq = backend.prefill_one(committed)
        for a, b in zip(seq.cache.layers, ref_seq.cache.layers):
            worst_cache = nan_max(
                worst_cache, float((a.keys - b.keys).abs().max()), float((a.values - b.values).abs().max())
            )
            cache_scale = nan_max(cache_scale, float(b.keys.abs().max()), float(b.values.abs().max()))
        cached = list(seq.cached_tokens)
        # the forward after the last commit: the pending token's row over the committed cache
        compare(backend.verify(seq, [committed[-1]], [None]).logits[0][0], committed)
    # a NaN or inf anywhere (an overflowing half-precision model) fails the gate: nothing compares to it
    finite = all(math.isfinite(x) for x in (worst_tree, worst_cache, tree_scale, cache_scale))
    atol = tolerance(backend.dtype, tree_scale if finite else 0.0)
    cache_atol = tolerance(backend.dtype, cache_scale if finite else 0.0)
    ok = finite and worst_tree <= atol and worst_cache <= cache_atol and cached == committed[:-1]
    return {
        "status": "passed" if ok else "failed",
        "tree_max_abs_logit_diff": worst_tree,
        "commit_max_abs_kv_diff": worst_cache,
        "tolerance": atol,
        "cache_tolerance": cache_atol,
        "max_abs_logit": tree_scale,
        "rounds": rounds,
        "commits": commits,  # what each round's commit kept (COMMIT_KINDS)
        "prompt_tokens": len(ids),
        "last_position": max(len(committed), len(chained)) - 1,  # the last position a forward of the gate computed
        "tree_rows": tree.num_rows,  # each round's tree: siblings, a token under two parents
        "chain_rows": CHAIN_ROWS,  # the chain round's (topology sequence, verified unmasked)
        "dtype": str(backend.dtype),
    }


def batched_commit_kind(r: int, k: int) -> str:
    """What request ``k`` (its index in the batch of round ``r``) commits in round ``r`` of the batched
    gate: in the first three rounds the empty path where ``r + k`` is a multiple of three, else a
    non-contiguous path; from the fourth round on the empty path, a contiguous path with a rejected
    row after it and a non-contiguous path in turn, so that the requests that stay in the batch after
    the first one leaves commit each kind and are verified again after it."""
    if r < 3:
        return "empty" if (r + k) % 3 == 0 else "deep"
    return ("empty", "contiguous", "deep")[(r - 3 + k) % 3]


@torch.inference_mode()
def batched_equivalence_gate(
    backend: CausalLMBackend, prompts: list[list[int]], *, rounds: int = 5, positions: int | None = None
) -> dict:
    """The same equivalence over one batch, as a batched run verifies and commits: requests of
    different prompt lengths (a ragged batch), each round a different tree per request (fewer rows
    padded to the widest), different paths committed (:func:`batched_commit_kind`: a non-contiguous
    path, the empty path, a contiguous path with a rejected row after it; ragged holes), each
    followed by a forward of the request that committed it.
    Every request's rows must equal its root-to-node paths decoded alone, and after the last commit
    each request's next row must equal its committed sequence decoded alone (what its cache holds).
    After the first round the batch's first request leaves it (:meth:`~CausalLMBackend.drop`, as a
    finished request leaves a run's batch: the cache compacts) and the others go on.
    A chain round (:func:`chain_round`) over every request's prompt cut to the shortest's length (a
    batch without holes, each request with a chain of the same rows) checks the same of the forward
    without an attention mask that a topology=sequence batched run's verify takes while its requests'
    lengths agree.
    Returns the evidence (``status`` ``passed`` or ``failed``)."""
    b = len(prompts)
    committed, dropped = [], False
    commits: list[list[str]] = []
    for k, p in enumerate(prompts):
        keep, rounds = fit_to_positions(positions, max(2, GATE_PROMPT_TOKENS - 5 * k), rounds)
        ids = list(p[-keep:]) if len(p) > keep else list(p)
        committed.append(ids if len(ids) >= 2 else ids + ids)
    state = backend.prefill(committed, reserve=rounds * 4 + 2)
    worst, scale = 0.0, 0.0
    vocab = backend.vocab_size

    def alone(sequence: list[int]) -> torch.Tensor:
        return backend.forward_rows(backend.new_state(), sequence, list(range(len(sequence))), None).logits[-1]

    # closed on every way out: a failure's one line is printed on the line the bar cleared
    with _rows_bar(f"gate: path equivalence, batch of {b}") as bar:

        def compare(got: torch.Tensor, ref: torch.Tensor) -> None:
            nonlocal worst, scale
            diff = float((got.float() - ref.float()).abs().max())
            worst = nan_max(worst, diff)
            scale = nan_max(scale, float(ref.float().abs().max()))
            bar.update()

        shortest = min(len(c) for c in committed)  # its forwards reach no further than the first round's
        chained = chain_round(backend, [c[:shortest] for c in committed], lambda got, s: compare(got, alone(s)))
        for r in range(rounds):
            trees = []
            for k in range(b):
                paths = _paths_from(committed[k][-(7 + r + k) :], vocab)
                paths = paths[: 1 + (r + k) % len(paths)]  # another row count per request and round
                tree = compile_tree(
                    [ProposalResult.from_paths(paths, source="gate", manifest_hash="gate")],
                    prefix_len=len(committed[k]),
                )
                validate_candidate_graph(tree)
                trees.append(tree)
            out = backend.verify(state, [c[-1] for c in committed], trees)
            for k, tree in enumerate(trees):
                for row in range(-1, tree.num_rows):
                    path = [] if row < 0 else [int(tree.token_ids[x]) for x in tree.path_to(row)]
                    compare(out.logits[k][row + 1], alone(committed[k] + path))
            accepted = []
            for k, tree in enumerate(trees):
                rows = commit_rows(tree, batched_commit_kind(r, k))
                validate_commit(tree, rows)
                accepted.append(rows)
            commits.append([batched_commit_kind(r, k) for k in range(b)])
            backend.commit(state, accepted)
            for k, rows in enumerate(accepted):
                bonus = int(out.logits[k][1 + rows[-1] if rows else 0].argmax())
                committed[k] += [int(trees[k].token_ids[x]) for x in rows] + [bonus]
            if r == 0 and b > 1:  # a request finishes: it leaves the batch, the cache compacts around the others
                backend.drop(state, [0])
                committed, b, dropped = committed[1:], b - 1, True
        out = backend.verify(state, [c[-1] for c in committed], [None] * b)
        for k in range(b):
            compare(out.logits[k][0], alone(committed[k]))
    finite = math.isfinite(worst) and math.isfinite(scale)
    atol = tolerance(backend.dtype, scale if finite else 0.0)
    return {
        "status": "passed" if finite and worst <= atol else "failed",
        "batch_size": len(prompts),
        "dropped_after_round_1": 1 if dropped else 0,
        "commits": commits,  # per round, what each request in the batch committed
        "max_abs_logit_diff": worst,
        "tolerance": atol,
        "max_abs_logit": scale,
        "rounds": rounds,
        "prompt_tokens": [len(p) for p in prompts],
        "last_position": max(len(c) for c in committed + chained) - 1,
        "chain_rows": CHAIN_ROWS,  # the chain round's, per request (topology sequence, verified unmasked)
        "dtype": str(backend.dtype),
    }
