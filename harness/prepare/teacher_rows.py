"""Hydra-style teacher rows for draft heads over packed streams.

A packed stream keeps every array at its original address: ``tokens[j]``, ``hidden[j]`` (the
target state *after* ``tokens[j]``, computed segment-causally), ``segment_ids[j]`` (the document
occurrence) and ``valid[j]`` (input availability, not a loss mask).

Head ``i`` (1-based) anchored at ``t`` predicts ``tokens[t + i]`` from
``hidden[t - 1], E(tokens[t]), ..., E(tokens[t + i - 1])``. The row exists only when the
predecessor ``t - 1``, every embedded token and the label ``t + i`` lie in one active run
(same segment, all valid): the first token of a segment is skipped rather than given an invented
initial state, nothing wraps to ``hidden[-1]`` or borrows a previous document's row, and the label
is never an input (the last embedding is at ``t + i - 1``). A fully valid segment of length ``L``
gives head ``i`` exactly ``max(L - i - 1, 0)`` rows.

Vectorised form used by training: ``run_len[j]`` counts the consecutive positions ending at ``j``
that are valid and in ``j``'s segment. The window ``[t - 1, t + i]`` (``i + 2`` positions) lies in
one run exactly when ``run_len[t + i] >= i + 2``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def _check_stream(
    n_tokens: int, *, hidden_len: int, segment_ids: Sequence, valid: Sequence, max_future: object
) -> None:
    if not (hidden_len == len(segment_ids) == len(valid) == n_tokens):
        raise ValueError(
            f"unaligned packed inputs: tokens {n_tokens}, hidden {hidden_len}, segment_ids {len(segment_ids)}, "
            f"valid {len(valid)}"
        )
    if type(max_future) is not int or max_future < 0:
        raise ValueError(f"max_future must be a nonnegative integer; got {max_future!r}")


def _bool_list(valid) -> list[bool]:
    if isinstance(valid, torch.Tensor):
        if valid.dtype != torch.bool:
            raise ValueError(f"valid must contain booleans; got a {valid.dtype} tensor")
        return [bool(v) for v in valid.tolist()]
    if any(type(flag) is not bool for flag in valid):
        bad = next(flag for flag in valid if type(flag) is not bool)
        raise ValueError(f"valid must contain booleans; got {bad!r}")
    return list(valid)


def run_lengths(segment_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[N]`` long: consecutive valid same-segment positions ending at each position (0 if invalid).

    segment_ids: ``[N]`` int; valid: ``[N]`` bool.
    """
    if segment_ids.shape != valid.shape or segment_ids.dim() != 1:
        raise ValueError(
            f"segment_ids and valid must be aligned vectors; got {tuple(segment_ids.shape)} and {tuple(valid.shape)}"
        )
    n = segment_ids.numel()
    out = torch.zeros(n, dtype=torch.long)
    if n == 0:
        return out
    seg = segment_ids.tolist()
    ok = valid.tolist()
    run = 0
    prev = None
    for j in range(n):
        if not ok[j]:
            run = 0
        elif run > 0 and seg[j] == prev:
            run += 1
        else:
            run = 1
        prev = seg[j]
        out[j] = run
    return out


def eligible_anchors(segment_ids: torch.Tensor, valid: torch.Tensor, *, max_future: int) -> dict[int, torch.Tensor]:
    """Head ``i`` -> anchors ``t`` ``[R_i]`` (ascending) with a complete teacher row.

    segment_ids: ``[N]`` int; valid: ``[N]`` bool.
    """
    _check_stream(
        segment_ids.numel(), hidden_len=segment_ids.numel(), segment_ids=segment_ids, valid=valid, max_future=max_future
    )
    _bool_list(valid)
    run = run_lengths(segment_ids, valid)  # [N]
    n = run.numel()
    out: dict[int, torch.Tensor] = {}
    for i in range(1, max_future + 1):
        if n < i + 2:
            out[i] = torch.zeros(0, dtype=torch.long)
            continue
        label_pos = torch.arange(i + 1, n)  # t + i for t >= 1
        ok = run[label_pos] >= i + 2
        out[i] = label_pos[ok] - i
    return out


def max_head(segment_ids: torch.Tensor, valid: torch.Tensor, *, max_future: int) -> torch.Tensor:
    """``[N]`` long: the deepest head with a row anchored at each position (0: no row).

    Eligibility is prefix-closed: a row for head ``i`` implies rows for heads ``1..i-1``.
    """
    run = run_lengths(segment_ids, valid)  # [N]
    n = run.numel()
    out = torch.zeros(n, dtype=torch.long)
    for i in range(1, max_future + 1):
        if n < i + 2:
            break
        t = torch.arange(1, n - i)  # anchors with a label inside the stream
        ok = run[t + i] >= i + 2
        out[t[ok]] = i
    return out


@dataclass(frozen=True)
class TeacherRow:
    head: int  # i >= 1
    anchor: int  # t: position of the first embedded token; hidden row t - 1
    inputs: tuple[int, ...]  # token positions embedded, t .. t + i - 1
    label_pos: int  # t + i (never among ``inputs``)


def teacher_row_index(segment_ids: Sequence[int], valid: Sequence[bool], *, max_future: int) -> list[TeacherRow]:
    """Every teacher row of a packed stream, head-major within each anchor (Hydra teacher forcing)."""
    n = len(segment_ids)
    _check_stream(n, hidden_len=n, segment_ids=segment_ids, valid=valid, max_future=max_future)
    flags = _bool_list(valid)
    seg = torch.as_tensor(list(segment_ids), dtype=torch.long)
    heads = max_head(seg, torch.tensor(flags, dtype=torch.bool), max_future=max_future)  # [N]
    rows = []
    for t in range(1, n):
        for i in range(1, int(heads[t]) + 1):
            rows.append(TeacherRow(head=i, anchor=t, inputs=tuple(range(t, t + i)), label_pos=t + i))
    return rows


def hydra_teacher_rows(
    tokens: Sequence[int],
    hidden: torch.Tensor,
    max_future: int,
    *,
    segment_ids: Sequence[int],
    valid: Sequence[bool],
    embed: Callable[[torch.Tensor], torch.Tensor],
) -> list[tuple[int, torch.Tensor, int]]:
    """``[(i, concat(hidden[t-1], E(tokens[t]), ..., E(tokens[t+i-1])), tokens[t+i])]``.

    tokens: ``[N]``; hidden: ``[N, d]``; ``embed`` maps ``[k]`` ids to ``[k, d_e]``. The
    materialised concatenation ``[d + i * d_e]`` is for inspection and tests; training gathers
    the same addresses without building it.
    """
    n = len(tokens)
    _check_stream(n, hidden_len=len(hidden), segment_ids=segment_ids, valid=valid, max_future=max_future)
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    out = []
    for row in teacher_row_index(segment_ids, valid, max_future=max_future):
        emb = embed(ids[list(row.inputs)])  # [i, d_e]
        cond = torch.cat([hidden[row.anchor - 1].reshape(-1), emb.reshape(-1)])  # [d + i * d_e]
        out.append((row.head, cond, int(ids[row.label_pos])))
    return out


def supervised(rows: Sequence[TeacherRow], loss_mask: Sequence[bool]) -> list[TeacherRow]:
    """Keep rows whose *label* is supervised. A loss-only mask never removes input context."""
    return [r for r in rows if bool(loss_mask[r.label_pos])]
