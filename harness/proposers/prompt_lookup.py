"""Prompt lookup: copy what followed an earlier occurrence of the suffix n-gram.

``shape=sequence`` copies one continuation: that of the occurrence of the suffix n-gram (n from
``max_ngram`` down to ``min_ngram``) whose preceding context agrees with the current one the
longest, the most recent among equals. ``shape=sequences`` merges the continuations of up to
``max_matches`` occurrences, best first, into one prefix tree: several matches verified in one
forward.

An occurrence's *context length* is how many tokens before its continuation equal the tokens
before the current position, counted back from the matched n-gram (at least n, at most
``MAX_CONTEXT``). It is what predicts a copy: on held-out prompts (SmolLM2, dev split of HumanEval
and ShareGPT) a candidate whose context length is 1 was the target's next token 22% of the times it
was tried, 3-4 tokens 70%, 17 or more 97%.

``budget_policy=adaptive`` sizes each round's tree from the measured verify cost instead of a fixed
count: every candidate row gets an estimated reach probability (the product, along its path, of
the probability that a row is the target's next token given that its parent was, from
:class:`AcceptanceModel`), rows are taken in descending reach order (a prefix-closed set, since a
child never out-reaches its parent), and the round keeps the ``k`` rows that minimise
``t(1 + k) / (1 + sum of their reach)``, the predicted time per committed token (as a source of
``proposer=merged``, ``t(1 + m + k)``: the forward also carries the ``m`` rows the other sources
put in it, :attr:`PromptLookupProposer.rows_before`). t comes from
:class:`VerifyCostModel`: the verify-cost profile the run measured at its start, corrected by the
verify times of the rounds whose forward the run's full batch shared (at batch 1, every round of
the request), never decreasing in the row count.
The estimates are proposal-side statistics only: they change which candidates are verified, never
what is accepted, so exactness is untouched.

``history_tokens > 0`` adds a memory of the target's earlier outputs in this proposer's lifetime
(the requests it served before, up to that many tokens, the oldest dropped first), searched like
the current request: an occurrence there ranks below one in the current request of the same
context length, its context and its continuation stop at the boundaries between requests, and its
candidates share the acceptance model (with a feature that marks them). This is the cross-request
suffix search of SuffixDecoding (Oliaro et al., 2024, "SuffixDecoding: A Model-Free Approach to
Speeding Up Large Language Model Inference"): what a model said to earlier requests predicts what
it says next, boilerplate and idioms in code, recurring phrasing in chat. A request never reads the
outputs of an earlier request with the same prompt (a warm-up, a repeat or a gate's pass over the
same prompts would otherwise copy its own answer): the memory serves other requests only.

``rejected_tails`` adds, in the round after a rejection, the tails of the candidates the target
rejected by one token: a candidate that followed the committed tokens and then held another token
than the target's is a copy with one token edited (a renamed variable, a changed word), and what
followed its wrong token is proposed after the target's (:func:`rejected_tails`). The lookup itself
cannot find it then: the suffix n-gram now ends in the target's new token. The tails share the
acceptance model (with features that mark them and how far their copy had run). Off by default:
timed in one process on this project's CPU, the rows they add cost more than the 3-5% more tokens a
round they bring (docs/measurements.md, "Rejected tails as a candidate source").

``datastore`` adds the continuations a REST datastore (He et al., 2024, "REST: Retrieval-Based
Speculative Decoding") holds after the committed suffix, searched as ``proposer=rest`` searches it:
text the request and its history never held (idioms of the standard library for code,
phrasing of other conversations for chat). They join the lookup's candidates in the same tree, after
them and most frequent first (in the order of REST's trie,
:func:`~harness.proposers.rest.ranked_continuations`: the row limit drops the rarest), as rows with
their own support counts and a feature that marks them, and the adaptive budget keeps each only
where its estimated reach pays for its row. Measured against the same arm without
it on this project's CPU, ShareGPT's datastore made chat 7% (fp32) and 10% (bf16) faster per token,
and the standard library's left HumanEval where it was (0.98x and 1.02x, within the noise), so the
default experiment keeps none (docs/measurements.md, "Datastore continuations in the adaptive
tree"). The datastore's leakage gate runs as for ``proposer=rest``.

The match search runs as a native op where the harness's native kernels build (a C++ compiler
is installed), with the Python search as its reference and fallback; a proposer's stats say which
(``match_search``).

Candidates carry a ``score`` (the matched context length), never a ``q``.
"""

from __future__ import annotations

import functools
import hashlib
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from harness.contracts import Budget, ConfigError, ProposalNode, ProposalResult, ProposalStateHandle
from harness.proposers.base import Proposer
from harness.proposers.rest import LOOKUP_MIN_SUFFIX, RestProposer, ranked_continuations
from harness.random_source import RandomSource
from harness.topology.budgets import verified_rows

#: the longest context an occurrence's match is measured over (tokens)
MAX_CONTEXT = 32
#: the token id that separates requests in a history corpus (never a real token)
SEPARATOR = -1


def _stable_order(codes: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(codes, kind="stable")`` for non-negative ``codes`` below ``bound``: the positions
    folded into the keys (code * n + position, all distinct) sort in the same order with NumPy's
    unstable sort, about a quarter of the time of its stable one on int64 (a history's index is
    made again each time a request finishes)."""
    n = len(codes)
    if bound * max(n, 1) >= 2**62:  # the folded keys would not fit: the stable sort itself
        return np.argsort(codes, kind="stable")
    return np.argsort(codes * n + np.arange(n, dtype=np.int64))


class TokenCorpus:
    """Earlier sequences, each followed by ``SEPARATOR``, indexed for n-gram search: the positions
    of every token and of every bigram, sorted by value, so the occurrences of an n-gram are found
    by binary search instead of a scan (a history of 65,536 tokens is searched in microseconds, a
    scan took ~4 ms here). Built once per change of the sequences it holds."""

    #: occurrences of one n-gram considered per search, the most recent (bounds a search's cost
    #: where a common token occurs thousands of times)
    MAX_HITS = 1024

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)
        shifted = self.tokens + 1  # the separator becomes 0: every code is non-negative
        self._base = int(shifted.max(initial=0)) + 1
        self._uni_order = _stable_order(shifted, self._base)
        self._uni = shifted[self._uni_order]
        codes = shifted[:-1] * self._base + shifted[1:]
        self._bi_order = _stable_order(codes, self._base * self._base)
        self._bi = codes[self._bi_order]

    def __len__(self) -> int:
        return len(self.tokens)

    def native_arrays(self) -> tuple[torch.Tensor, ...]:
        """The tokens and the sorted unigram and bigram codes with their positions, as tensors sharing
        these arrays' memory (what the native search reads; made per search, so a copied corpus
        never holds a second copy)."""
        arrays = (self.tokens, self._uni, self._uni_order, self._bi, self._bi_order)
        return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.tokens, self._uni_order, self._uni, self._bi_order, self._bi))

    def occurrences(self, gram: np.ndarray) -> np.ndarray:
        """Ascending positions ``i`` with ``tokens[i:i+n] == gram`` and a token after them (at most
        the last ``MAX_HITS``)."""
        g = np.asarray(gram, dtype=np.int64) + 1
        n = len(g)
        if ((g[:2] < 0) | (g[:2] >= self._base)).any():  # a token the history never holds: its code
            return np.empty(0, dtype=np.int64)  # would be another bigram's
        if n == 1:
            sorted_, order, code = self._uni, self._uni_order, int(g[0])
        else:
            sorted_, order, code = self._bi, self._bi_order, int(g[0]) * self._base + int(g[1])
        lo, hi = np.searchsorted(sorted_, code, side="left"), np.searchsorted(sorted_, code, side="right")
        if n <= 2:  # only the last n positions lack a following token: the last MAX_HITS + n suffice
            lo = max(lo, hi - self.MAX_HITS - n)
        pos = order[lo:hi]  # ascending: a stable sort keeps equal codes in position order
        pos = pos[pos + n < len(self.tokens)]
        if n > 2 and len(pos):
            rest = self.tokens[np.minimum(pos[:, None] + np.arange(2, n)[None, :], len(self.tokens) - 1)]
            pos = pos[(rest == gram[2:][None, :]).all(axis=1)]
        return pos[-self.MAX_HITS :]


def _context_lengths(seq: np.ndarray, hits: np.ndarray, n: int, tokens: np.ndarray) -> np.ndarray:
    """How many tokens before each occurrence ``seq[hits:hits+n]`` of the suffix n-gram of ``tokens``
    equal the tokens before that suffix, counting the n-gram (at most ``MAX_CONTEXT``, never from
    before ``tokens[1]``; a separator ends a run)."""
    total = len(tokens)
    reach = min(MAX_CONTEXT, total - 1) - n  # further tokens a match may extend over
    context = np.full(len(hits), n)
    if reach > 0 and len(hits):
        # most occurrences of a short n-gram differ at the first token before it: the run is measured
        # for the others only (a common token has hundreds of occurrences in a long history)
        first = hits - 1
        extends = np.flatnonzero((first >= 0) & (seq[np.maximum(first, 0)] == tokens[total - n - 1]))
        if len(extends):
            back = np.arange(1, reach + 1)  # [E]
            before = hits[extends, None] - back[None, :]  # [H', E] positions before each such occurrence
            same = (before >= 0) & (seq[np.maximum(before, 0)] == tokens[total - n - back][None, :])
            context[extends] += np.cumprod(same, axis=1).sum(axis=1)  # leading run of equal tokens
    return context


def find_continuations(
    tokens: np.ndarray,
    *,
    max_ngram: int,
    min_ngram: int,
    max_depth: int,
    max_matches: int,
    corpus: TokenCorpus | None = None,
    skip: np.ndarray | None = None,
) -> list[tuple[int, np.ndarray, bool]]:
    """``[(context_len, continuation, in_corpus)]`` for earlier occurrences of the suffix, best first.

    tokens: ``[T]`` int. An occurrence at ``i`` matches ``tokens[i:i+n] == tokens[T-n:]`` with
    ``i + n < T`` (it has at least one following token, so it is not the suffix itself), for the
    longest ``n`` in ``[min_ngram, max_ngram]`` that matches there. Its context length extends the
    n-gram backwards while ``tokens[i-k] == tokens[T-n-k]`` (up to ``MAX_CONTEXT`` tokens in all,
    and never further back than the start of ``tokens``). Occurrences are ranked by context length,
    then the more recent first.

    corpus: earlier sequences, searched as if they came before ``tokens`` (their occurrences are
    the less recent), contexts and continuations cut at the separators between them; ``skip``
    (``[len(corpus)]`` bool) marks corpus positions no occurrence may start in.

    The search runs as the native op ``torch.ops.harness.lookup_matches`` where the harness's native
    kernels build and load (the same matches in the same order, integer work only), else as the
    Python reference :func:`find_continuations_python`; :func:`match_search` says which.
    """
    search = _native_search()
    if search is None:
        return find_continuations_python(
            tokens,
            max_ngram=max_ngram,
            min_ngram=min_ngram,
            max_depth=max_depth,
            max_matches=max_matches,
            corpus=corpus,
            skip=skip,
        )
    if corpus is not None and len(corpus):
        history, uni, uni_order, bi, bi_order = corpus.native_arrays()
        base, max_hits = corpus._base, corpus.MAX_HITS
    else:
        history = uni = uni_order = bi = bi_order = _NO_HISTORY
        base, max_hits = 1, 1
    context, in_history, conts, lengths = search(
        torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)),
        history,
        uni,
        uni_order,
        bi,
        bi_order,
        base,
        None if skip is None or history is _NO_HISTORY else torch.from_numpy(np.ascontiguousarray(skip, dtype=bool)),
        max_ngram,
        min_ngram,
        max_depth,
        max_matches,
        max_hits,
        MAX_CONTEXT,
    )
    rows = conts.numpy()
    return [
        (c, rows[i, :n], h)
        for i, (c, h, n) in enumerate(zip(context.tolist(), in_history.tolist(), lengths.tolist(), strict=True))
    ]


#: the native search's arrays where there is no history
_NO_HISTORY = torch.empty(0, dtype=torch.long)


@functools.cache
def _native_search():
    """``torch.ops.harness.lookup_matches`` where the native kernels build and load here, else None
    (no compiler, a failed build, a cache folder that cannot be written: the Python search serves)."""
    from harness.target.native import native_kernels_problem

    try:
        return None if native_kernels_problem() is not None else torch.ops.harness.lookup_matches
    except Exception:  # the fallback exists for whatever stops the build
        return None


def match_search() -> str:
    """``native`` or ``python``: which implementation :func:`find_continuations` runs here."""
    return "native" if _native_search() is not None else "python"


def find_continuations_python(
    tokens: np.ndarray,
    *,
    max_ngram: int,
    min_ngram: int,
    max_depth: int,
    max_matches: int,
    corpus: TokenCorpus | None = None,
    skip: np.ndarray | None = None,
) -> list[tuple[int, np.ndarray, bool]]:
    """:func:`find_continuations` in Python and NumPy: the reference the native op must equal."""
    total = len(tokens)
    offset = len(corpus) if corpus is not None else 0  # current positions rank after the corpus's
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rank position, context, source)
    seen = np.zeros(total + 1, dtype=bool)  # continuation starts already taken by a longer n-gram
    seen_corpus = np.zeros(offset + 1, dtype=bool)
    for n in range(min(max_ngram, total if offset else total - 1), min_ngram - 1, -1):
        suffix = tokens[total - n :]
        hits = np.empty(0, dtype=np.int64)
        if n < total:
            same = tokens[: total - n] == suffix[0]  # window starts i (tokens[i:i+n]), continuation at i + n
            for j in range(1, n):
                same &= tokens[j : total - n + j] == suffix[j]
            hits = np.flatnonzero(same)
            hits = hits[~seen[hits + n]]
        if len(hits):
            seen[hits + n] = True
            found.append((hits + n + offset, _context_lengths(tokens, hits, n, tokens), np.zeros(len(hits), bool)))
        if corpus is not None and offset:
            hits = corpus.occurrences(suffix)
            if skip is not None:
                hits = hits[~skip[hits]]
            hits = hits[~seen_corpus[hits + n]]
            if len(hits):
                seen_corpus[hits + n] = True
                found.append((hits + n, _context_lengths(corpus.tokens, hits, n, tokens), np.ones(len(hits), bool)))
    if not found:
        return []
    start, context, in_corpus = (np.concatenate(x) for x in zip(*found))
    order = np.lexsort((-start, -context))  # longest context, then most recent
    out = []
    for k in order:
        if in_corpus[k]:
            cont = corpus.tokens[start[k] : start[k] + max_depth]
            cut = np.flatnonzero(cont == SEPARATOR)
            cont = cont[: cut[0]] if len(cut) else cont
        else:
            cont = tokens[start[k] - offset : start[k] - offset + max_depth]
        if len(cont):
            out.append((int(context[k]), cont, bool(in_corpus[k])))
            if len(out) == max_matches:
                break
    return out


@dataclass(frozen=True)
class CandidateTree:
    """The continuations of several matches merged into one prefix tree, in the order rows were
    first made (a parent before its children). Per row ``i``: ``prefixes[i]`` (the tokens from the
    root to it), ``parents[i]`` (-1 below the root), ``depth`` (1 = a continuation's first token),
    ``context`` (the context length of the best match that made it), ``rank`` (its place among its
    siblings, in the order the matches reached them), ``history`` (made by a match in the history of
    earlier requests), ``support`` (how many matches' continuations pass through it; for a row a
    tail made, how many tails'), ``parent_support`` (its parent's support; below the root, the
    number of matches, or for a row a tail made the number of tails),
    ``tail`` (made by the tail of a candidate the target rejected last round, see
    :func:`rejected_tails`), ``tail_run`` (for such a row, how many tokens that candidate had run
    along the output before the substitution; 0 for the others) and ``datastore`` (made by a
    continuation retrieved from a datastore, see ``PromptLookupProposer``'s ``datastore``; its
    ``context`` is the length of the suffix the datastore matched)."""

    prefixes: tuple[tuple[int, ...], ...]
    parents: np.ndarray
    depth: np.ndarray
    context: np.ndarray
    rank: np.ndarray
    history: np.ndarray
    support: np.ndarray
    parent_support: np.ndarray
    tail: np.ndarray
    tail_run: np.ndarray
    datastore: np.ndarray

    def __len__(self) -> int:
        return len(self.prefixes)


def candidate_tree(
    matches: list[tuple[int, np.ndarray, bool]],
    *,
    limit: int,
    tails: Sequence[tuple[int, tuple[int, ...], bool, int]] = (),
    retrieved: Sequence[tuple[int, Sequence[int]]] = (),
    max_depth: int | None = None,
) -> CandidateTree:
    """Merge ``matches`` (:func:`find_continuations`' output, best first), ``tails``
    (:func:`rejected_tails`' output) and ``retrieved`` (``(matched suffix length, continuation)``
    from a datastore, best first) into one prefix tree of at most ``limit`` rows, in that order; a
    continuation that runs past the limit still counts towards the support of the rows it passes
    through. Each kind of source counts towards the support of the rows its own kind made only,
    and below the root a row's parent support is the number of continuations of its kind: every
    row a match made has the features it would have without the tails and the retrieved
    continuations. ``max_depth``: no row deeper (each continuation read to that many tokens), so
    the ``limit`` rows are all rows a round of that depth verifies."""
    prefixes: list[tuple[int, ...]] = []
    parents: list[int] = []
    depth: list[int] = []
    context_of: list[int] = []
    rank: list[int] = []  # a row's place among its siblings
    history: list[bool] = []
    kind_of: list[int] = []  # 0: a match made the row, 1: a tail, 2: a retrieved continuation
    run_of: list[int] = []
    support: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent row, token) -> row
    children: dict[int, int] = {}  # parent row -> its children so far
    sources = [(c, cont, h, 0, 0) for c, cont, h in matches] + [(c, t, h, 1, r) for c, t, h, r in tails]
    sources += [(c, cont, False, 2, 0) for c, cont in retrieved]
    for context, cont, in_history, kind, run in sources:
        parent = -1
        tokens = cont.tolist() if isinstance(cont, np.ndarray) else list(cont)
        for d, tok in enumerate(tokens if max_depth is None else tokens[: max(max_depth, 0)], start=1):
            node = child.get((parent, tok))
            if node is None:
                if len(prefixes) >= limit:
                    break
                node = child[parent, tok] = len(prefixes)
                sibling = children.get(parent, 0)
                children[parent] = sibling + 1
                prefixes.append(prefixes[parent] + (tok,) if parent >= 0 else (tok,))
                parents.append(parent)
                depth.append(d)
                context_of.append(context)
                rank.append(sibling)
                history.append(in_history)
                kind_of.append(kind)
                run_of.append(run)
                support.append(1)
            elif kind_of[node] == kind:
                support[node] += 1
            parent = node
    parent_arr = np.asarray(parents, dtype=np.int64)
    support_arr = np.asarray(support, dtype=np.int64)
    kind = np.asarray(kind_of, dtype=np.int64)
    roots = np.asarray([len(matches), len(tails), len(retrieved)], dtype=np.int64)
    return CandidateTree(
        prefixes=tuple(prefixes),
        parents=parent_arr,
        depth=np.asarray(depth, dtype=np.int64),
        context=np.asarray(context_of, dtype=np.int64),
        rank=np.asarray(rank, dtype=np.int64),
        history=np.asarray(history, dtype=bool),
        support=support_arr,
        parent_support=np.where(parent_arr >= 0, support_arr[np.maximum(parent_arr, 0)], roots[kind]),
        tail=kind == 1,
        tail_run=np.asarray(run_of, dtype=np.int64),
        datastore=kind == 2,
    )


def rejected_tails(tree: CandidateTree, continuation: Sequence[int]) -> list[tuple[int, tuple[int, ...], bool, int]]:
    """The tails of ``tree``'s candidates that the target rejected by one substitution: the round
    committed ``continuation`` (its accepted tokens, ``m`` of them, then the target's own token);
    every leaf whose path followed the accepted tokens for ``m`` tokens and then held another token
    than the target's, and has tokens after that, gives ``(context, tail, history, m)``: the tokens
    after the substituted one, to propose after the target's token, as if the copy resumed past a
    one-token edit (a renamed variable, a changed word). ``context`` is the leaf's match context and
    ``history`` whether its match was in the history; ``m``, how far the copy had run, is a feature
    of its own. One tail per distinct token sequence, in the tree's row order."""
    m = len(continuation) - 1
    if m < 0 or not len(tree):
        return []
    path, written = tuple(continuation[:m]), continuation[m]
    has_child = np.zeros(len(tree), dtype=bool)
    has_child[tree.parents[tree.parents >= 0]] = True
    out, seen = [], set()
    for i in np.flatnonzero(~has_child & (tree.depth >= m + 2)).tolist():
        prefix = tree.prefixes[i]
        if prefix[m] != written and prefix[:m] == path:
            tail = prefix[m + 1 :]
            if tail not in seen:
                seen.add(tail)
                out.append((int(tree.context[i]), tail, bool(tree.history[i]), m))
    return out


def tried_rows(prefixes: tuple[tuple[int, ...], ...], continuation: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a tree that the committed ``continuation`` tells about: those whose parent was
    the target's token (the root's children, and the children of each accepted row) with a
    committed token at their depth. Returns (row indices, whether each was the target's token)."""
    rows, accepted = [], []
    for i, prefix in enumerate(prefixes):
        if len(continuation) >= len(prefix) and continuation[: len(prefix) - 1] == prefix[:-1]:
            rows.append(i)
            accepted.append(continuation[len(prefix) - 1] == prefix[-1])
    return np.asarray(rows, dtype=np.int64), np.asarray(accepted, dtype=bool)


class AcceptanceModel:
    """The probability that a candidate row is the target's next token, given that its parent was:
    a logistic model over the row's features (:meth:`features`), fitted offline on held-out dev
    prompts and updated online, one gradient step on the log-loss of each round's tried rows, so a
    run starts from what the dev prompts say and learns its own target and workload from there.

    What predicts a copy: the context the match has (its context length plus the row's depth below
    it, less one), whether the row is its parent's first or second child, whether the match is in
    the history of earlier requests, and how many of the matches agree on the row (its support and
    the fraction of its parent's support it carries), whether the row comes from a rejected tail
    and how many tokens its copy had run before the substitution, and whether a datastore gave it.
    The constants are SmolLM2's on the dev splits of HumanEval, ShareGPT and the copy-heavy prompts
    (``scripts/lookup_acceptance_fit.py``, which prints them), with ``max_ngram`` 2, 8 matches,
    depth 10 and trees of up to 64 rows before the choice (the default experiment's settings but its
    depth, 16: rows deeper than 10 are scored through their effective context by constants fitted
    without them; refitted at depth 16, the held-out log-loss moved by less than 0.001): the
    first seven at every output position; the two tail terms, unstandardised, on every round of
    the proposer with rejected tails on, replayed on a measured t(n), the first seven held
    (``--t-from ... --only tail log_tail_run``), so a row that is not a tail has the probability it
    had before tails existed. The support features' scale depends on the number of matches. The
    datastore term, unstandardised, was fitted the same way on the rounds of the proposer with a
    datastore (``--datastores humaneval=<stdlib's> chat=<sharegpt's> --only datastore``, dev splits,
    bf16 verify costs): a datastore row otherwise shares the lookup's terms, its context being the
    suffix length the datastore matched. Fitting four more terms of a datastore row's own (its context,
    agreement, support and rank) lowered the log-loss of those rows from 0.24 to 0.20 on HumanEval's
    held-out split and from 0.38 to 0.32 on chat's, but moved the replayed ratio by -0.7% to +0.7%:
    the simpler model stays. Another target, workload or setting starts from them and moves them by
    the online steps."""

    #: the columns of :meth:`features`
    FEATURES: ClassVar[tuple[str, ...]] = (
        "log_effective_context",
        "first_sibling",
        "second_sibling",
        "history",
        "agreement",
        "log_support",
        "log_parent_support",
        "tail",
        "log_tail_run",
        "datastore",
    )
    #: each feature's mean and standard deviation on the fitting set (features are standardised; the
    #: tail and datastore terms, each fitted alone with every other constant held, are not)
    # fmt: off
    MEAN: ClassVar[tuple[float, ...]] = (1.7025, 0.6295, 0.1414, 0.1663, 0.6270, 0.3133, 1.0774, 0.0, 0.0, 0.0)
    SCALE: ClassVar[tuple[float, ...]] = (1.3199, 0.4829, 0.3485, 0.3723, 0.3854, 0.5479, 0.8941, 1.0, 1.0, 1.0)
    #: the fitted weights of the (standardised) features, and the bias
    WEIGHTS: ClassVar[tuple[float, ...]] = (
        1.2529, 0.9530, -0.0134, -0.3133, 0.8208, 0.2880, 0.1259, -0.6948, 0.0075, -1.2581,
    )
    # fmt: on
    BIAS: ClassVar[float] = 0.1137

    def __init__(self, *, learning_rate: float = 0.02) -> None:
        if not (learning_rate >= 0 and np.isfinite(learning_rate)):
            raise ValueError(f"learning_rate must be >= 0 and finite; got {learning_rate}")
        self.learning_rate = learning_rate
        self.weights = np.asarray(self.WEIGHTS, dtype=np.float64)
        self.bias = float(self.BIAS)
        self.rows_learned = 0

    @classmethod
    def features(cls, tree: CandidateTree) -> np.ndarray:
        """``[rows, len(FEATURES)]``, standardised."""
        return (cls.raw_features(tree) - np.asarray(cls.MEAN)) / np.asarray(cls.SCALE)

    @staticmethod
    def raw_features(tree: CandidateTree) -> np.ndarray:
        """``[rows, len(FEATURES)]`` as measured, before standardising."""
        return np.stack(
            [
                np.log(np.maximum(tree.context + tree.depth - 1, 1)),
                tree.rank == 0,
                tree.rank == 1,
                tree.history,
                tree.support / np.maximum(tree.parent_support, 1),
                np.log(np.maximum(tree.support, 1)),
                np.log(np.maximum(tree.parent_support, 1)),
                tree.tail,
                np.log1p(tree.tail_run),
                tree.datastore,
            ],
            axis=1,
        ).astype(np.float64)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(x @ self.weights + self.bias)))

    def update(self, x: np.ndarray, accepted: np.ndarray) -> None:
        """One gradient step on the mean log-loss of rows ``x`` with outcomes ``accepted``."""
        if not len(x):
            return
        grad = self.predict(x) - accepted.astype(np.float64)
        self.weights -= self.learning_rate * (x * grad[:, None]).mean(axis=0)
        self.bias -= self.learning_rate * float(grad.mean())
        self.rows_learned += len(x)


class VerifyCostModel:
    """t(n), a verify forward's cost for n rows (pending included), as the adaptive budget prices a
    round: the profile a run measured at its start (normalised), corrected online by the rounds' own
    verify times. Two things are learned apart: the machine's speed (a scale on the whole profile,
    averaged over the last ``SCALE_WINDOW`` or so rounds of any size), and each row count's shape
    correction (its times relative to the scaled profile, over its last ``WINDOW`` or so rounds,
    weighed against ``PRIOR_WEIGHT`` pseudo-observations of no correction). Every residual, in logs,
    is clipped to ``CLIP``, so one slow round (a warm-up, a compile, the OS) moves a count by a few
    percent at most and a drifting machine moves every count together. Costs are proposal-side
    statistics, like the acceptance estimates."""

    #: pseudo-observations of "no correction" in each row count's shape estimate
    PRIOR_WEIGHT: ClassVar[float] = 5.0
    #: observations a row count's own correction averages over (beyond, older ones decay)
    WINDOW: ClassVar[int] = 20
    #: observations the machine's speed (the profile's scale) averages over
    SCALE_WINDOW: ClassVar[int] = 50
    #: the largest residual (natural log) one observation contributes: a factor of 1.5
    CLIP: ClassVar[float] = float(np.log(1.5))
    #: rounds whose median sets the units before anything else is learned
    SCALE_START: ClassVar[int] = 5

    def __init__(self, profile: np.ndarray) -> None:
        self.profile = np.asarray(profile, dtype=np.float64)
        self.log_profile = np.log(self.profile)
        self.correction = np.zeros(len(self.profile))
        self.count = np.zeros(len(self.profile), dtype=np.int64)
        self.log_scale = 0.0
        self.observed = 0
        self._start: list[float] = []

    def observe(self, rows: int, ms: float) -> None:
        """One verify forward of ``rows`` rows took ``ms``; row counts beyond the profile and
        non-positive times are ignored. The first ``SCALE_START`` rounds only set the units (their
        median, so a slow first round does not); shape corrections are learned after them."""
        # scalar arithmetic in Python floats: this runs every round, where NumPy's scalar calls cost more
        if not (1 <= rows <= len(self.profile)) or not (ms > 0 and math.isfinite(ms)):
            return
        i = rows - 1
        rel = math.log(ms) - float(self.log_profile[i])
        self.observed += 1
        if self.observed <= self.SCALE_START:
            self._start.append(rel)
            if self.observed == self.SCALE_START:
                self.log_scale = statistics.median(self._start)
            return
        clip = self.CLIP
        step = min(max(rel - self.log_scale - float(self.correction[i]), -clip), clip)
        self.log_scale += step / min(self.observed, self.SCALE_WINDOW)
        count = int(self.count[i]) + 1
        self.count[i] = count
        residual = min(max(rel - self.log_scale, -clip), clip)
        correction = float(self.correction[i])
        self.correction[i] = correction + (residual - correction) / min(count, self.WINDOW)

    def cost(self, n: int) -> np.ndarray:
        """Estimated t(1..n), in the profile's units until the units are set and in ms after; never
        decreasing in the row count (:func:`non_decreasing`, each count weighed by its
        pseudo-observations and observations): a verify forward of more rows does not cost less,
        and a count last seen in a slow minute would otherwise price more rows below fewer and lead
        the choice of rows to chase the noise."""
        if self.observed < self.SCALE_START:
            return np.exp(non_decreasing(self.log_profile, np.ones(len(self.profile))))[:n]
        own = np.minimum(self.count, self.WINDOW)
        shape = own * self.correction / (self.PRIOR_WEIGHT + own)
        log_t = non_decreasing(self.log_profile + shape, self.PRIOR_WEIGHT + own)
        return np.exp(self.log_scale + log_t[:n])


def non_decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest ``values`` in weighted least squares (pool adjacent
    violators: a run that decreases is replaced by its weighted mean)."""
    means: list[float] = []
    sizes: list[float] = []
    counts: list[int] = []
    for v, w in zip(values.tolist(), np.asarray(weights, dtype=np.float64).tolist()):
        means.append(v)
        sizes.append(w)
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            w2 = sizes[-2] + sizes[-1]
            means[-2] = (means[-2] * sizes[-2] + means[-1] * sizes[-1]) / w2
            sizes[-2] = w2
            counts[-2] += counts[-1]
            del means[-1], sizes[-1], counts[-1]
    return np.repeat(np.asarray(means), counts)


class _HistoryShelf:
    """Earlier requests' outputs, oldest first, with their index (a new corpus per added output, so
    a request that started earlier keeps searching the one it started with)."""

    def __init__(self) -> None:
        self.history: list[tuple[bytes, np.ndarray]] = []  # (prompt key, output tokens)
        self.corpus: TokenCorpus | None = None

    def add(self, key: bytes, output: np.ndarray, limit: int) -> None:
        """Keep ``output`` (dropping the oldest beyond ``limit`` tokens) and index the history anew."""
        self.history.append((key, output))
        total = sum(len(o) for _, o in self.history)
        while total > limit:
            total -= len(self.history.pop(0)[1])
        self.corpus = TokenCorpus(np.concatenate([p for _, o in self.history for p in (o, np.array([SEPARATOR]))]))


class PromptLookupProposer(Proposer):
    name: ClassVar[str] = "prompt_lookup"
    probability_semantics: ClassVar[str] = "score_only"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"sequence", "sequences"})

    def __init__(
        self,
        *,
        budget: Budget,
        manifest_hash: str,
        policy=None,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_matches: int = 8,
        budget_policy: str = "fixed",
        verify_cost: list[float] | None = None,
        history_tokens: int = 0,
        rejected_tails: bool = False,
        retriever: RestProposer | None = None,
    ) -> None:
        super().__init__(budget=budget, manifest_hash=manifest_hash, policy=policy)
        #: the datastore's retrieval (a :class:`~harness.proposers.rest.RestProposer`), or None
        self.retriever = retriever
        if history_tokens < 0:
            raise ValueError(f"proposer.history_tokens must be >= 0; got {history_tokens}")
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        self.check_plan({"rejected_tails": rejected_tails, "datastore": retriever}, budget, None)
        if budget_policy not in ("fixed", "adaptive"):
            raise ValueError(f"proposer.budget_policy must be fixed or adaptive; got {budget_policy!r}")
        #: the most candidate rows a round verifies (a chain's max_depth when that is below max_nodes)
        self.max_rows = verified_rows(budget)[0]
        if budget_policy == "adaptive":
            if not verify_cost or len(verify_cost) < self.max_rows + 1:
                raise ValueError(
                    f"budget_policy=adaptive needs verify_cost t(1..{self.max_rows + 1}) (normalised verify "
                    f"cost per row count; a run's prepare stage measures it); got {verify_cost!r}"
                )
            if any(not np.isfinite(c) or c <= 0 for c in verify_cost):
                raise ValueError(f"verify_cost must be positive and finite; got {verify_cost}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = 1 if budget.shape == "sequence" else max_matches
        self.budget_policy = budget_policy
        self.cost_model = VerifyCostModel(np.asarray(verify_cost)) if budget_policy == "adaptive" else None
        #: the rows (their token paths from the committed frontier) that other sources already put in this
        #: round's verify forward: ``proposer=merged`` sets them for one proposal, and the adaptive budget
        #: prices its own rows after them (:meth:`_choose_rows`); empty otherwise
        self.rows_before: frozenset[tuple[int, ...]] = frozenset()
        self.acceptance = AcceptanceModel()
        #: (committed length, tree, its rows' features under the adaptive budget) of the last proposal
        self._last: tuple[int, CandidateTree, np.ndarray | None] | None = None
        self.rejected_tails = bool(rejected_tails)
        #: (committed length they follow, tails) from the last round's commit
        self._tails: tuple[int, list[tuple[int, tuple[int, ...], bool, int]]] = (-1, [])
        self.stats.extras.update({"rows_proposed": 0, "rows_kept": 0})
        if self.rejected_tails:
            self.stats.extras["rows_kept_from_tails"] = 0
        # which search implementation the proposals are timed with (resolving it builds the native
        # kernels on first use: here, before any timed region)
        self.stats.extras["match_search"] = match_search()
        self.history_tokens = int(history_tokens)
        if self.history_tokens:
            self.stats.extras["rows_kept_from_history"] = 0
        self._shelf = _HistoryShelf()  # earlier requests' outputs; shared by the job's batch slots (join)
        self._owns_shelf = True
        self._corpus: TokenCorpus | None = None  # the history as this request started, indexed
        self._skip: np.ndarray | None = None  # history positions the current request may not read
        self._request: tuple[bytes, int] | None = None  # (prompt key, prompt length) of the current request
        self._committed: list[int] | None = None
        if retriever is not None:
            self.stats.extras["rows_kept_from_datastore"] = 0
            self.stats.extras["datastore"] = retriever.stats.extras

    def counters(self) -> dict:
        kept = ("rows_kept_from_tails", "rows_kept_from_history", "rows_kept_from_datastore")
        return {"rows_proposed": 0, "rows_kept": 0, **{k: 0 for k in kept if k in self.stats.extras}}

    def reset_counters(self) -> None:
        super().reset_counters()
        if self.retriever is not None:
            self.retriever.reset_counters()

    @classmethod
    def check_plan(cls, options: dict, budget: Budget, geometry) -> None:
        """Before any model work: rejected tails branch off the lookup's candidates, and a
        datastore's continuations join them, so both need a tree of several continuations
        (``shape=sequences``)."""
        if options.get("rejected_tails") and budget.shape != "sequences":
            raise ConfigError(
                f"proposer.rejected_tails=true needs topology=sequences (the tails branch off the lookup's "
                f"candidates); this topology's shape is {budget.shape!r}",
                suggestions=[("topology=sequences",), ("proposer.rejected_tails=false",)],
            )
        if options.get("datastore") is not None and budget.shape != "sequences":
            raise ConfigError(
                f"proposer.datastore needs topology=sequences (its continuations join the lookup's in one "
                f"tree); this topology's shape is {budget.shape!r}",
                suggestions=[("topology=sequences",), ("proposer.datastore=null",)],
            )

    @classmethod
    def from_config(cls, *, options: dict, budget: Budget, manifest_hash: str, policy, context) -> Proposer:
        """With ``datastore``, open it as ``proposer=rest`` does (built on first use, refused when
        it does not fit the target's tokenizer) and search it with REST's settings (the committed
        suffix of at most the release's context length, at least ``LOOKUP_MIN_SUFFIX`` (2) tokens, down
        to the first length with matches; up to 64 continuations of the release's length); the
        proposals carry the manifest hash folded with its release id. A run refuses a release whose
        context length is below 2 before any model work
        (:func:`~harness.proposers.rest.check_lookup_release`)."""
        opts = dict(options)
        ds_cfg = opts.pop("datastore", None)
        if ds_cfg is None:
            return cls(budget=budget, manifest_hash=manifest_hash, policy=policy, **opts)
        retriever = RestProposer.from_config(
            options={"datastore": ds_cfg, "min_suffix": LOOKUP_MIN_SUFFIX},
            budget=Budget("tree", budget.max_nodes, budget.max_depth),
            manifest_hash=manifest_hash,
            policy=policy,
            context=context,
        )
        return cls(budget=budget, manifest_hash=retriever.manifest_hash, policy=policy, retriever=retriever, **opts)

    def check_workload(self, items: list, *, allow_leakage: bool = False) -> dict | None:
        """The datastore's evaluation-leakage gate (:meth:`RestProposer.check_workload`), where
        there is a datastore."""
        if self.retriever is None:
            return None
        entry = self.retriever.check_workload(items, allow_leakage=allow_leakage)
        self.reset_counters()
        return entry

    def manifest_extra(self) -> dict:
        return self.retriever.manifest_extra() if self.retriever is not None else {}

    # ------------------------------------------------------------------ history across requests
    @staticmethod
    def _prompt_key(prompt_ids: list[int]) -> bytes:
        return hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=16).digest()

    def join(self, first: Proposer) -> None:
        """Search the same history as ``first`` (another batch slot's lookup): every finished request
        of the job, whichever slot served it. Its bytes are counted once, by ``first``."""
        if isinstance(first, PromptLookupProposer):
            self._shelf = first._shelf
            self._owns_shelf = False

    LEARNING = ("cost_model", "acceptance")

    def forget_requests(self) -> None:
        """Empty the history (the shelf every slot shares): the warm-up's outputs are not searched."""
        self._shelf.history.clear()
        self._shelf.corpus = None

    def start(self, prompt_ids: list[int]) -> None:
        self._request = (self._prompt_key(prompt_ids), len(prompt_ids)) if self.history_tokens else None
        self._committed = None
        self._last, self._tails = None, (-1, [])
        self._skip = None
        history = self._shelf.history
        # the history as this request starts: requests that finish while it runs are not searched by it
        self._corpus = self._shelf.corpus if self._request is not None else None
        if self._request is not None and any(key == self._request[0] for key, _ in history):
            owners = np.concatenate([np.full(len(o) + 1, key == self._request[0]) for key, o in history])
            self._skip = owners  # the positions of earlier answers to this same prompt

    def finish(self) -> None:
        """Keep the finished request's output (the tokens after its prompt) in the history: the last
        committed sequence seen (the round loop extends its list in place, so that is the final one;
        a caller passing copies loses at most the last round's tokens)."""
        if self._request is not None and self._committed is not None:
            key, prompt_len = self._request
            output = np.asarray(self._committed[prompt_len:], dtype=np.int64)[-self.history_tokens :]
            if len(output):
                self._shelf.add(key, output, self.history_tokens)
        self._request = self._committed = self._skip = None
        if self.cost_model is not None:
            self.stats.extras["adaptive_budget"] = self.learned_state()

    def learned_state(self) -> dict | None:
        """What the adaptive budget has learned so far (None under the fixed budget): the verify cost
        t(1..) in ms as it prices rows now (None until the first rounds have set its units), the
        rounds it has observed in all and, after those first rounds, per row count (pending row
        included: index 0 is one row), and the acceptance model's rows learned, weights
        (standardised features) and bias. A run's record carries it as it stood after the last
        request (``metrics.retrieval.adaptive_budget``, the first batch slot's)."""
        cm = self.cost_model
        if cm is None:
            return None
        units = cm.observed >= cm.SCALE_START
        return {
            "verify_cost_ms": cm.cost(len(cm.profile)).tolist() if units else None,
            "verify_rounds_observed": int(cm.observed),
            "verify_rounds_by_rows": cm.count.tolist(),
            "acceptance_rows_learned": int(self.acceptance.rows_learned),
            "acceptance_weights": dict(zip(AcceptanceModel.FEATURES, self.acceptance.weights.tolist(), strict=True)),
            "acceptance_bias": float(self.acceptance.bias),
        }

    def state_bytes(self) -> int:
        """The history's bytes (counted by the slot that owns the shelf: 0 for slots sharing it) and
        a datastore's."""
        shelf = self._shelf
        history = sum(o.nbytes for _, o in shelf.history) + (shelf.corpus.nbytes if shelf.corpus is not None else 0)
        history = history if self._owns_shelf else 0
        return history + (self.retriever.state_bytes() if self.retriever is not None else 0)

    # ------------------------------------------------------------------ proposing
    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        self._committed = committed
        tokens = np.asarray(committed, dtype=np.int64)
        depth = (
            self.budget.max_depth
            if self.budget.shape != "sequence"
            else min(self.budget.max_depth, self.budget.max_nodes)
        )
        # a request's last rounds verify fewer levels: the matches and the datastore's continuations are
        # read only as deep as those levels (at least one token, which the statistics of a match need)
        depth = max(1, min(depth, self.round_max_depth()))
        matches = find_continuations(
            tokens,
            max_ngram=self.max_ngram,
            min_ngram=self.min_ngram,
            max_depth=depth,
            max_matches=self.max_matches,
            corpus=self._corpus,
            skip=self._skip,
        )
        retrieved = ()
        if self.retriever is not None:
            t0 = time.perf_counter()
            self.retriever.depth_cap = self.depth_cap  # the round's cap, for this retrieval only
            try:
                suffix, continuations = self.retriever.retrieve(committed)
            finally:
                self.retriever.depth_cap = None
            ms = (time.perf_counter() - t0) * 1e3
            self.stats.retrieval_ms += ms  # the round loop reports it as the round's retrieval stage
            self.retriever.note_retrieval(suffix, len(continuations), ms)
            # best first, as REST's trie ranks them: the row limit keeps the most frequent continuations
            # (whatever their place in the corpus), and every continuation still counts towards support
            retrieved = [(suffix, c) for c in ranked_continuations(continuations)]
        limit = self.budget.max_nodes if self.budget_policy == "fixed" else 4 * self.budget.max_nodes
        after, tails = self._tails
        # a request's last rounds are compiled to fewer levels (depth_cap): the tree holds only rows
        # those levels verify, so its row limit and the adaptive choice go to rows that can be verified
        tree = candidate_tree(
            matches,
            limit=limit,
            tails=tails if after == len(committed) else (),
            retrieved=retrieved,
            max_depth=self.round_max_depth(),
        )
        x = AcceptanceModel.features(tree) if self.budget_policy == "adaptive" else None
        keep = list(range(len(tree)))
        if x is not None and keep:
            keep = self._choose_rows(tree.parents, self.acceptance.predict(x), tree.prefixes)
        remap = {old: new for new, old in enumerate(keep)}
        nodes = tuple(
            ProposalNode(
                token_id=tree.prefixes[i][-1],
                parent=remap[int(tree.parents[i])] if tree.parents[i] >= 0 else -1,
                score=float(tree.context[i]),
                source=self.name,
            )
            for i in keep
        )
        self.stats.extras["rows_proposed"] += len(tree)
        self.stats.extras["rows_kept"] += len(keep)
        if self.history_tokens:
            self.stats.extras["rows_kept_from_history"] += int(tree.history[keep].sum())
        if self.rejected_tails:
            self.stats.extras["rows_kept_from_tails"] += int(tree.tail[keep].sum())
        if self.retriever is not None:
            self.stats.extras["rows_kept_from_datastore"] += int(tree.datastore[keep].sum())
        self._last = (len(committed), tree, x) if (x is not None or self.rejected_tails) else None
        topology = "sequence" if all(nd.parent == i - 1 for i, nd in enumerate(nodes)) else "tree"
        return ProposalResult(
            nodes=nodes,
            probability_semantics="score_only",
            sampling_relation="deterministic_lookup",
            topology=topology,
            state_handle=ProposalStateHandle(owner=self.name, committed_len=len(committed)),
            manifest_hash=self.manifest_hash,
            source=self.name,
        )

    @property
    def last_candidates(self) -> CandidateTree | None:
        """The candidate tree of the last proposal before any choice among its rows, until its
        commit is observed; None under the fixed budget without rejected tails (nothing keeps it)."""
        return self._last[1] if self._last is not None else None

    @property
    def prices_rows(self) -> bool:
        """Whether a proposal chooses its rows by their verify cost (the adaptive budget): a
        ``proposer=merged`` round then proposes it after its other sources and sets :attr:`rows_before`."""
        return self.cost_model is not None

    def _choose_rows(
        self, parents: np.ndarray, rate: np.ndarray, prefixes: Sequence[tuple[int, ...]] = ()
    ) -> list[int]:
        """Rows in descending reach order; the count minimising predicted time per token.

        The forward also carries the pending row and :attr:`rows_before` (``m`` rows of other
        sources), so ``k`` rows cost ``t(1 + m + k')``, ``k'`` counting only those of the ``k`` whose
        prefix (``prefixes``, by row) is not already among them (a row another source proposed is
        verified once, for both); the forward holds at most ``max_rows`` rows (a merged round keeps
        no more, sharing them among its sources), so ``1 + m + k'`` is capped at ``1 + max_rows``.
        The other rows' expected accepted tokens are unknown here and taken as none: the predicted
        tokens are ``1 +`` the kept rows' own reach, as alone. Where the others' rows are often
        accepted, that values this proposer's rows above their share of the round's tokens and keeps
        somewhat more of them than the best count would."""
        reach_of: list[float] = []  # in Python floats: a loop over NumPy scalars costs more
        for p, r in zip(parents.tolist(), rate.tolist(), strict=True):
            reach_of.append(r if p < 0 else reach_of[p] * r)
        reach = np.asarray(reach_of, dtype=np.float64)
        order = np.argsort(-reach, kind="stable")  # a parent (earlier, reach >=) precedes its children
        cap = min(len(order), self.max_rows)
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(reach[order[:cap]])])  # k = 0..cap
        before = self.rows_before
        if before:
            new = [prefixes[i] not in before for i in order[:cap].tolist()]
            added = np.concatenate([[0], np.cumsum(new, dtype=np.int64)])  # k' for k = 0..cap
            rows = np.minimum(len(before) + added, self.max_rows)
        else:
            rows = np.arange(cap + 1)
        cost = self.cost_model.cost(self.max_rows + 1)[rows]  # t(1 + m + k')
        k = int(np.argmin(cost / expected))
        return sorted(order[:k].tolist())

    def observe_verify(self, rows: int, ms: float) -> None:
        """The adaptive budget's cost model learns the round's verify time."""
        if self.cost_model is not None:
            self.cost_model.observe(rows, ms)

    def observe_commit(self, committed: list[int]) -> None:
        """Teach the acceptance model what the target said about the last proposal's rows: every
        row whose parent the committed continuation followed (kept for verification or not); with
        ``rejected_tails``, keep the tails of the candidates the target rejected for the next
        proposal (:func:`rejected_tails`)."""
        self._committed = committed
        if self._last is None:
            return
        start, tree, x = self._last
        self._last = None
        continuation = tuple(committed[start:])
        if self.rejected_tails:
            self._tails = (len(committed), rejected_tails(tree, continuation))
        if x is None:
            return
        rows, accepted = tried_rows(tree.prefixes, continuation)
        if len(rows):
            self.acceptance.update(x[rows], accepted)
