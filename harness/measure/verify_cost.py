"""Measured verify cost t(n) over a real prefix, interpolated to every row count: what prompt
lookup's adaptive budget needs (no draft model involved, unlike the Sequoia hardware profile of
``harness.measure.profile``, whose timing trees it shares)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from harness.measure.profile import timing_tree


@torch.inference_mode()
def measure_verify_cost(
    backend,
    prompt_ids: Sequence[int],
    *,
    max_rows: int,
    reps: int = 5,
    points: Sequence[int] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
) -> dict:
    """Median verify time for ``n = 1 + rows`` at the given row counts, interpolated to every
    ``rows <= max_rows``. Returns ``{"t_ms": [t(1), ..., t(max_rows + 1)], "normalised": [...],
    "measured_rows": [...]}``."""
    ids = list(prompt_ids)
    pts = sorted({p for p in points if p <= max_rows} | {0, max_rows})
    med = []
    for rows in pts:
        tree = timing_tree(rows, prefix_len=len(ids), vocab=backend.vocab_size)
        seq = backend.prefill(ids)
        base = seq.cache_len
        samples = []
        for r in range(reps + 1):
            t0 = time.perf_counter()
            backend.verify(seq, ids[-1], tree)
            dt = time.perf_counter() - t0
            backend.truncate(seq, base)
            if r:  # the first forward of each shape is warm-up
                samples.append(dt * 1e3)
        med.append(statistics.median(samples))
    # cost never decreases with more rows: enforce monotonicity against timing noise
    envelope = np.maximum.accumulate(np.array(med))
    all_rows = np.arange(0, max_rows + 1)
    t_ms = np.interp(all_rows, pts, envelope)
    return {
        "t_ms": t_ms.tolist(),
        "normalised": (t_ms / t_ms[0]).tolist(),
        "measured_rows": pts,
        "measured_ms": med,
        "prefix_len": len(ids),
        "reps": reps,  # raw medians, before the envelope
        "t_profile": {"n": [1 + r for r in pts], "t": med},
    }
