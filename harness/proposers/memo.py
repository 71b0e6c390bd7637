"""A memo of a draft network's computations at one fixed prefix (used by the statistical gate).

The statistical gate proposes thousands of times at one committed prefix, each sample with its own
random source. A draft's computation at a step of one proposal — its output law and the cache rows
the next step attends to — depends only on the prefix and on the steps before it in that proposal
(the drafted path or tree level so far). :class:`FixedPrefixMemo` keys each network call by that
history, the sequence of call keys since the proposal began: the first sample that reaches a
history runs the real code and stores its outputs and the cache rows it appended; a later sample
reaching the same history gets the stored outputs and the same rows appended to its cache
(bit-identical: the stored rows are the computed ones), so every later miss computes over exactly
the cache the real code would have built. The proposer's own code (drawing, tree building,
bookkeeping) still runs once per sample with the sample's random source.

Off (``proposer.law_memo is None``) the call sites run their computation directly: a real run is
unchanged. The gate turns it on around its samples (:meth:`FixedPrefixMemo.begin` before each
proposal, :meth:`FixedPrefixMemo.end` after) and refuses a proposal at another prefix.

A proposer whose law at a candidate prefix depends on that prefix alone, and which can compute
many prefixes' laws in one forward, serves the gate through a :class:`LawTable` instead: its
proposals read laws by candidate prefix from the table, a proposal reaching a prefix not computed
yet stops (:class:`LawPending`), and between passes over the samples the table computes every
prefix the stopped samples reached, many per forward (a draft model's through
:class:`~harness.target.paths.PathRows`). Each stopped sample is then proposed again from the start
with its draws replayed (:class:`ReplayingSource`), so it follows the same path one step further
each pass. The passes run the proposers'
per-sample code in lock step by depth without changing it.

Cache kinds whose rows are stored and replayed: the target backend's
:class:`~harness.target.backend.CacheState` (a draft model), EAGLE's
:class:`~harness.heads.eagle.DraftKV` and self-speculation's
:class:`~harness.heads.partial.ProvisionalKV`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import contextmanager
from typing import Any

import torch

from harness.heads.eagle import DraftKV
from harness.heads.partial import ProvisionalKV
from harness.target.backend import CacheState, cache_layers

#: stored outputs and rows beyond this many bytes are not memoised (later samples compute them
#: again, exactly as without the memo): bounds the memo of a draft whose paths rarely repeat
MEMO_MAX_BYTES = 2 << 30


def _kv_len(kv) -> int:
    if isinstance(kv, CacheState):
        return kv.cache_len
    if isinstance(kv, DraftKV):
        return kv.length
    if isinstance(kv, ProvisionalKV):
        return next((int(k.shape[-2]) for k in kv.keys.values()), 0)
    raise TypeError(f"no memo support for a cache of type {type(kv).__name__}")


@torch.inference_mode()
def _rows_since(kv, start: int):
    """Copies of the rows appended at and after ``start`` (and, for a backend state, their tokens)."""
    if isinstance(kv, CacheState):
        rows = [
            (layer.keys[:, :, start:].clone(), layer.values[:, :, start:].clone()) for layer in cache_layers(kv.cache)
        ]
        return rows, list(kv.cached_tokens[start:])
    if isinstance(kv, DraftKV):
        return [(k[:, :, start:].clone(), v[:, :, start:].clone()) for k, v in zip(kv.keys, kv.values) if k is not None]
    return {i: (kv.keys[i][..., start:, :].clone(), kv.values[i][..., start:, :].clone()) for i in kv.keys}


@torch.inference_mode()
def _append_rows(kv, stored) -> None:
    """Append stored rows as the computation that made them did (a concatenation along the rows)."""
    if isinstance(kv, CacheState):
        rows, tokens = stored
        layers = cache_layers(kv.cache)
        if len(layers) != len(rows):
            raise RuntimeError(f"memo rows for {len(rows)} layers, cache has {len(layers)}")
        for layer, (k, v) in zip(layers, rows):
            layer.keys = torch.cat([layer.keys, k], dim=-2)
            layer.values = torch.cat([layer.values, v], dim=-2)
        kv.tokens[0].extend(tokens)
        kv.lengths[0] += len(tokens)
        kv.phys_len = kv.lengths[0]
    elif isinstance(kv, DraftKV):
        for i, (k, v) in enumerate(stored):
            kv.append(i, k, v)
    else:
        for i, (k, v) in stored.items():
            kv.update(k, v, i)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


class FixedPrefixMemo:
    """Network outputs (and appended cache rows) by call history, for proposals at one prefix."""

    def __init__(self, max_bytes: int = MEMO_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.table: dict[tuple, tuple[Any, Any]] = {}
        self.prefix: tuple[int, ...] | None = None
        self.history: tuple | None = None  # None: no proposal under way (calls run directly)
        self.hits = 0
        self.misses = 0
        self.bytes = 0
        self.unstored = 0  # misses not stored (over max_bytes)

    def begin(self, committed: list[int]) -> None:
        """A proposal at ``committed`` begins (the first one fixes the prefix)."""
        key = tuple(committed)
        if self.prefix is None:
            self.prefix = key
        elif key != self.prefix:
            raise ValueError("a fixed-prefix memo serves proposals at one prefix only")
        self.history = ()

    def end(self) -> None:
        self.history = None

    def run(self, key: Hashable, compute: Callable[[], Any], kv=None) -> Any:
        """``compute()``'s result for this call, ``key`` naming the call's inputs within the
        proposal; ``kv``: the cache ``compute`` appends rows to (None: it appends none)."""
        if self.history is None:
            return compute()
        self.history = history = self.history + (key,)
        entry = self.table.get(history)
        if entry is not None:
            self.hits += 1
            out, rows = entry
            if kv is not None:
                _append_rows(kv, rows)
            return out
        self.misses += 1
        start = _kv_len(kv) if kv is not None else 0
        out = compute()
        rows = _rows_since(kv, start) if kv is not None else None
        size = _nbytes(out) + _nbytes(rows)
        if self.bytes + size <= self.max_bytes:
            self.table[history] = (out, rows)
            self.bytes += size
        else:
            self.unstored += 1
        return out

    def evidence(self) -> dict:
        return {
            "draft_calls": self.misses,
            "memo_hits": self.hits,
            "memo_unstored": self.unstored,
            "memo_mb": round(self.bytes / 2**20, 1),
        }


def memo_call(proposer, key: Hashable, compute: Callable[[], Any], kv=None) -> Any:
    """``compute()`` through the proposer's fixed-prefix memo when one is on, else directly."""
    memo = getattr(proposer, "law_memo", None)
    if memo is None:
        return compute()
    return memo.run(key, compute, kv)


class LawPending(Exception):
    """A proposal under a :class:`LawTable` reached candidate prefixes whose law is not computed."""


class ReplayingSource:
    """A sample's random source across the gate's passes. A proposal stopped by a missing law is
    proposed again from the start: the draws it made before stopping are replayed in order (each
    checked against the law it is drawn from again), and the draws after them come from the
    source, which had made exactly those draws. So the results equal, draw for draw, those of
    proposing again from a fresh source of the same seed, without repeating the draws' work."""

    def __init__(self, source) -> None:
        self.source = source
        self.log: list[tuple[str, object, object]] = []
        self.pos = 0

    def rewind(self) -> None:
        self.pos = 0

    def _replay(self, kind: str, check):
        logged_kind, value, logged_check = self.log[self.pos]
        if logged_kind != kind or logged_check != check:
            raise RuntimeError(f"a proposal proposed again drew differently ({kind} at draw {self.pos})")
        self.pos += 1
        return value

    def bernoulli(self, p: float) -> bool:
        if self.pos < len(self.log):
            return self._replay("bernoulli", float(p))
        value = self.source.bernoulli(p)
        self.log.append(("bernoulli", value, float(p)))
        self.pos += 1
        return value

    def categorical(self, probs: torch.Tensor) -> int:
        if self.pos < len(self.log):
            _, value, _ = self.log[self.pos]
            return self._replay("categorical", (int(probs.shape[-1]), float(probs.reshape(-1)[value])))
        value = self.source.categorical(probs)
        self.log.append(("categorical", value, (int(probs.shape[-1]), float(probs.reshape(-1)[value]))))
        self.pos += 1
        return value


class LawTable:
    """Proposal laws by candidate prefix at one committed prefix, computed between the gate's passes.

    ``rows`` holds (and computes) the laws by path below the committed prefix's last token
    ``root``: the law at candidate prefix ``p`` is ``rows[(root, *p)]``.
    """

    def __init__(self, rows, committed: list[int]) -> None:
        if not committed:
            raise ValueError("a law table needs a non-empty committed prefix")
        self.rows = rows
        self.prefix = tuple(int(t) for t in committed)
        self.root = self.prefix[-1]
        self.missing: set[tuple[int, ...]] = set()
        self.hits = 0

    def check(self, committed: list[int]) -> None:
        if tuple(committed) != self.prefix:
            raise ValueError("a law table serves proposals at one prefix only")

    def level(self, prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        """``[len(prefixes), V]``: the law at each candidate prefix; raises :class:`LawPending`
        (noting what is missing) when one is not computed yet."""
        keys = [(self.root, *p) for p in prefixes]
        missing = [k for k in keys if k not in self.rows]
        if missing:
            self.missing.update(missing)
            raise LawPending(len(missing))
        self.hits += len(keys)
        if len(keys) == 1:
            return self.rows[keys[0]].unsqueeze(0)  # a view: a chain's level needs no copy
        return torch.stack([self.rows[k] for k in keys])

    def fill(self) -> int:
        """Compute every law a stopped proposal reached; returns the rows computed."""
        n = self.rows.compute(self.missing) if self.missing else 0
        self.missing.clear()
        return n

    def evidence(self) -> dict:
        return {
            "law_rows": self.rows.rows_computed,
            "law_forwards": self.rows.forwards,
            "law_hits": self.hits,
            "law_mb": round(self.rows.nbytes() / 2**20, 1),
        }


def members(proposer) -> list:
    """The proposer and, for a merged one, its sources (which share its memo: their calls run in a
    fixed order within each proposal, so one history keys them all)."""
    out = [proposer]
    for source in getattr(proposer, "sources", None) or []:
        if hasattr(source, "propose"):
            out += members(source)
    return out


@contextmanager
def law_tables(proposer, committed: list[int]):
    """Open a :class:`LawTable` at ``committed`` for every member of ``proposer`` that can serve
    from one (``open_law_table``, which may decline with None); yields them, closes them on exit."""
    opened = []
    try:
        for m in members(proposer):
            table = m.open_law_table(list(committed)) if hasattr(m, "open_law_table") else None
            if table is not None:
                m.law_table = table
                opened.append(table)
        yield opened
    finally:
        for m in members(proposer):
            m.law_table = None


@contextmanager
def fixed_prefix_memo(proposer, max_bytes: int = MEMO_MAX_BYTES):
    """Turn a memo on for ``proposer`` and its sources (off again on exit); yields it."""
    memo = FixedPrefixMemo(max_bytes)
    group = members(proposer)
    for m in group:
        m.law_memo = memo
    try:
        yield memo
    finally:
        for m in group:
            m.law_memo = None
