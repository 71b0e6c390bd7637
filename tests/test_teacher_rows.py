"""Hydra teacher rows on packed toy streams: segment-aware, no wrap, no cross-document rows, the
label never an input, ``max(L - i - 1, 0)`` rows per head, and the edge cases (empty streams,
one-token segments, max_future=0)."""

import pytest
import torch

from harness.prepare.teacher_rows import (
    eligible_anchors,
    hydra_teacher_rows,
    max_head,
    run_lengths,
    supervised,
    teacher_row_index,
)


def brute_force(segment_ids, valid, max_future):
    """The teacher-row loop, written literally: (head, anchor) pairs."""
    n = len(segment_ids)
    out = []
    for t in range(1, n):
        for i in range(1, min(max_future, n - t - 1) + 1):
            if all(valid[j] and segment_ids[j] == segment_ids[t] for j in range(t - 1, t + i + 1)):
                out.append((i, t))
    return sorted(out)


def pairs(rows):
    return sorted((r.head, r.anchor) for r in rows)


# two documents packed back to back: A = tokens 0..4 (L=5), B = tokens 5..7 (L=3)
SEG = [0, 0, 0, 0, 0, 1, 1, 1]
VALID = [True] * 8


def test_packed_two_documents_exact_rows():
    rows = teacher_row_index(SEG, VALID, max_future=3)
    # doc A (L=5): head1 anchors 1,2,3; head2 anchors 1,2; head3 anchor 1
    # doc B (L=3): head1 anchor 6 only (not 5: its predecessor 4 is doc A's row)
    assert pairs(rows) == [(1, 1), (1, 2), (1, 3), (1, 6), (2, 1), (2, 2), (3, 1)]
    assert pairs(rows) == brute_force(SEG, VALID, 3)


def test_count_formula_per_segment():
    for length in range(0, 8):
        seg = [7] * length
        rows = teacher_row_index(seg, [True] * length, max_future=5)
        for i in range(1, 6):
            assert sum(r.head == i for r in rows) == max(length - i - 1, 0), (length, i)


def test_no_cross_document_row_and_no_wrap():
    rows = teacher_row_index(SEG, VALID, max_future=4)
    for r in rows:
        window = range(r.anchor - 1, r.label_pos + 1)
        assert len({SEG[j] for j in window}) == 1  # predecessor, inputs and label in one document
        assert r.anchor >= 1  # hidden[t - 1] never wraps to hidden[-1]
        assert SEG[r.anchor - 1] == SEG[r.anchor]  # the first token of a segment is never an anchor
    assert all(r.anchor not in (0, 5) for r in rows)  # segment starts: not [.., (1, 5)]


def test_label_never_an_input():
    for r in teacher_row_index(SEG, VALID, max_future=3):
        assert r.label_pos == r.anchor + r.head
        assert r.label_pos not in r.inputs
        assert r.inputs == tuple(range(r.anchor, r.anchor + r.head))  # last embedding at t + i - 1


def test_invalid_position_drops_spanning_rows_but_loss_mask_does_not():
    valid = [True, True, True, False, True, True, True, True]
    seg = [0] * 8
    rows = teacher_row_index(seg, valid, max_future=2)
    assert pairs(rows) == brute_force(seg, valid, 2)
    assert all(not (r.anchor - 1 <= 3 <= r.label_pos) for r in rows)  # nothing spans the gap
    assert pairs(rows) == [(1, 1), (1, 5), (1, 6), (2, 5)]
    # a loss-only mask on the labels removes supervision, not context: rows keep their inputs
    full = teacher_row_index(seg, [True] * 8, max_future=2)
    loss_mask = [True, True, False, True, True, True, True, True]
    kept = supervised(full, loss_mask)
    assert all(r.label_pos != 2 for r in kept)
    assert (2, 1) in pairs(kept)  # anchor 1 head 2 uses token 2 as an *input*: kept (label 3)
    assert (1, 1) not in pairs(kept)  # its label is position 2: dropped


@pytest.mark.parametrize(
    "seg,valid,k",
    [
        ([], [], 3),  # empty stream
        ([0, 1, 2, 3], [True] * 4, 3),  # one-token segments
        ([0, 0, 0, 0], [True] * 4, 0),  # max_future = 0
    ],
)
def test_edge_cases_yield_no_rows(seg, valid, k):
    assert teacher_row_index(seg, valid, max_future=k) == []
    assert all(
        v.numel() == 0
        for v in eligible_anchors(
            torch.tensor(seg, dtype=torch.long), torch.tensor(valid, dtype=torch.bool), max_future=k
        ).values()
    )


def test_boundary_errors():
    with pytest.raises(ValueError, match="unaligned"):
        teacher_row_index([0, 0, 0], [True, True], max_future=1)
    with pytest.raises(ValueError, match="nonnegative integer; got -1"):
        teacher_row_index([0, 0], [True, True], max_future=-1)
    with pytest.raises(ValueError, match="nonnegative integer; got 2.0"):
        teacher_row_index([0, 0], [True, True], max_future=2.0)
    with pytest.raises(ValueError, match="booleans; got 1"):
        teacher_row_index([0, 0], [1, 1], max_future=1)
    with pytest.raises(ValueError, match="unaligned"):
        hydra_teacher_rows(
            [1, 2, 3],
            torch.zeros(2, 4),
            1,
            segment_ids=[0, 0, 0],
            valid=[True] * 3,
            embed=lambda ids: torch.zeros(len(ids), 4),
        )


def test_random_packed_streams_match_the_literal_loop():
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        n = int(torch.randint(0, 30, (1,), generator=gen))
        seg, sid = [], 0
        while len(seg) < n:
            length = int(torch.randint(1, 8, (1,), generator=gen))
            seg.extend([sid] * length)
            sid += 1
        seg = seg[:n]
        valid = [bool(v) for v in (torch.rand(n, generator=gen) > 0.1).tolist()]
        k = int(torch.randint(0, 5, (1,), generator=gen))
        want = brute_force(seg, valid, k)
        assert pairs(teacher_row_index(seg, valid, max_future=k)) == want
        anchors = eligible_anchors(
            torch.tensor(seg, dtype=torch.long), torch.tensor(valid, dtype=torch.bool), max_future=k
        )
        assert sorted((i, int(t)) for i, ts in anchors.items() for t in ts) == want
        # prefix closure: a head-i row at t implies rows for every shallower head at t
        mh = max_head(torch.tensor(seg, dtype=torch.long), torch.tensor(valid, dtype=torch.bool), max_future=k)
        assert sorted((i, t) for t in range(n) for i in range(1, int(mh[t]) + 1)) == want


def test_materialised_rows_concatenate_hidden_then_embeddings():
    tokens = [10, 11, 12, 13, 20, 21, 22]
    seg = [0, 0, 0, 0, 1, 1, 1]
    hidden = torch.arange(7, dtype=torch.float32)[:, None].repeat(1, 2)  # hidden[j] = [j, j]
    embed = lambda ids: ids.float()[:, None] * 100  # noqa: E731  E(tok) = [100 tok]
    rows = hydra_teacher_rows(tokens, hidden, 2, segment_ids=seg, valid=[True] * 7, embed=embed)
    got = [(i, cond.tolist(), label) for i, cond, label in rows]
    assert got == [
        (1, [0.0, 0.0, 1100.0], 12),
        (2, [0.0, 0.0, 1100.0, 1200.0], 13),
        (1, [1.0, 1.0, 1200.0], 13),
        (1, [4.0, 4.0, 2100.0], 22),  # doc 2 anchors at its second token with hidden[4] (not hidden[3])
    ]


def test_run_lengths():
    seg = torch.tensor([0, 0, 0, 1, 1, 1])
    valid = torch.tensor([True, True, False, True, True, True])
    assert run_lengths(seg, valid).tolist() == [1, 2, 0, 1, 2, 3]
