"""The one injectable random source for verifiers and proposal sampling.

Verifier and proposer code draws *all* its randomness through a :class:`RandomSource`, whose
vocabulary is deliberately small: ``bernoulli(p)`` and ``categorical(probs)``. Runs use
:class:`TorchRandomSource` (a seeded ``torch.Generator``); the exactness oracle
(``harness.gates.oracle``) substitutes a source that enumerates every branch with its exact
probability and re-runs the same code. Verifier and proposer modules must not touch
``torch.rand``/``torch.multinomial``/``random``/global generators themselves (a test scans them).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RandomSource(Protocol):
    def bernoulli(self, p: float) -> bool:
        """True with probability ``p`` (clamped to [0, 1])."""
        ...

    def categorical(self, probs: torch.Tensor) -> int:
        """An index drawn from the (non-negative, sum-one) vector ``probs`` ``[V]``."""
        ...


class TorchRandomSource:
    """Seeded source for real runs. Inverse-CDF sampling in float64 so that the law sampled is
    exactly the vector passed (up to float64 rounding), whatever its dtype."""

    def __init__(self, seed: int | None = None, *, generator: torch.Generator | None = None) -> None:
        if generator is None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(0 if seed is None else int(seed))
        self.generator = generator

    def _uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def bernoulli(self, p: float) -> bool:
        p = float(p)
        if math.isnan(p):
            raise ValueError("bernoulli(nan): the probability is not a number")
        if p >= 1.0:
            return True
        if p <= 0.0:
            return False
        return self._uniform() < p

    def categorical(self, probs: torch.Tensor) -> int:
        probs = probs.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        cdf = torch.cumsum(probs, dim=0)
        total = float(cdf[-1])
        if not total > 0.0:
            raise ValueError("categorical draw from a vector with no mass")
        u = self._uniform() * total
        idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
        idx = min(idx, probs.numel() - 1)
        # never return a zero-mass index (possible only through float edge cases)
        while float(probs[idx]) <= 0.0 and idx > 0:
            idx -= 1
        return idx
