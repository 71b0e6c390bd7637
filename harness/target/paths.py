"""A causal LM's rows at many candidate paths below one fixed cached prefix, each path computed once.

At a fixed prefix, the logits of a candidate row depend only on its path: the tokens from the
frontier down to it (tree attention: a row sees the prefix, its ancestors and itself). A caller
that needs the rows of thousands of sampled trees at one prefix (the statistical gate) asks for
the distinct paths instead of the trees: :class:`PathRows` computes each path once, many paths per
forward (one request, a tree mask over the prefix, the stored rows of their ancestors and the new
rows), and keeps each computed row in the cache, so that a deeper path asked for later attends to its
ancestors' rows there instead of computing them again.

A path here is a tuple of tokens ``(s_1, ..., s_k)``, ``k >= 1``: row ``s_k`` at position
``base + k - 1`` over a cache holding the ``base`` tokens before it. A verify forward's frontier
row (the pending token) is the path ``(pending,)``; a candidate below it is ``(pending, t_1, ...)``.
Rows computed in different forwards differ from a per-tree forward's only by floating-point
rounding (different batch shapes), never by what they attend to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from harness.target.backend import CacheState, CausalLMBackend

#: rows (new ones) per forward: bounds the mask and the logits a forward holds at once
ROWS_PER_FORWARD = 256


class PathValues:
    """What a table of rows by path holds and answers: ``values[path]`` (one row's output),
    ``slot[path]`` (its row in the cache that holds it), and how many forwards computed how many
    rows. Subclasses compute the rows (``compute(paths)``) and say what they hold (``nbytes``)."""

    def __init__(self) -> None:
        self.values: dict[tuple[int, ...], torch.Tensor] = {}
        self.slot: dict[tuple[int, ...], int] = {}
        self.forwards = 0
        self.rows_computed = 0

    def __contains__(self, path: tuple[int, ...]) -> bool:
        return path in self.values

    def __getitem__(self, path: tuple[int, ...]) -> torch.Tensor:
        return self.values[path]

    def values_nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values.values())


class PathRows(PathValues):
    """Rows at paths below ``state``'s cached prefix (``base`` tokens), computed on demand.

    Every computed row stays in ``state`` (so it holds the prefix, then the computed rows in the
    order they were computed): a later forward's rows attend, through the mask, to the prefix and
    to their ancestors wherever those sit, and nothing is copied or computed twice.
    ``transform`` maps a forward's logits ``[R, V]`` to what is stored per path (e.g. a sampling
    policy's probabilities); the logits as they are when None.
    """

    def __init__(
        self,
        backend: CausalLMBackend,
        state: CacheState,
        *,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        rows_per_forward: int = ROWS_PER_FORWARD,
    ) -> None:
        if rows_per_forward < 1:
            raise ValueError(f"rows_per_forward must be >= 1; got {rows_per_forward}")
        super().__init__()
        self.backend = backend
        self.state = state
        self.base = state.cache_len
        self.transform = transform
        self.rows_per_forward = rows_per_forward

    def nbytes(self) -> int:
        """Bytes held: the stored values (``transform`` of each row's logits) and the rows' cache."""
        return self.values_nbytes() + self.backend.bytes_per_token * len(self.slot)

    @torch.inference_mode()
    def compute(self, paths: Iterable[tuple[int, ...]]) -> int:
        """Compute every path in ``paths`` not computed yet, and any uncomputed ancestor of one.
        Returns how many rows were computed."""
        todo: set[tuple[int, ...]] = set()
        for path in paths:
            path = tuple(int(t) for t in path)
            if not path:
                raise ValueError("a path holds at least its own token")
            for k in range(1, len(path) + 1):
                if path[:k] not in self.values:
                    todo.add(path[:k])
        ordered = sorted(todo, key=lambda p: (len(p), p))  # parents before children
        for i in range(0, len(ordered), self.rows_per_forward):
            self._forward(ordered[i : i + self.rows_per_forward])
        return len(ordered)

    def _forward(self, chunk: list[tuple[int, ...]]) -> None:
        state, base = self.state, self.base
        start, r = state.cache_len, len(chunk)
        for j, path in enumerate(chunk):  # an ancestor in the same chunk sits at its row there
            self.slot[path] = start + j
        mask = torch.zeros((r, start + r), dtype=torch.bool)  # [R, cache + R]
        mask[:, :base] = True
        for j, path in enumerate(chunk):
            for k in range(1, len(path) + 1):
                mask[j, self.slot[path[:k]]] = True
        ids = [p[-1] for p in chunk]
        pos = [base + len(p) - 1 for p in chunk]
        out = self.backend.forward_rows(state, ids, pos, mask)
        values = out.logits if self.transform is None else self.transform(out.logits)
        for j, path in enumerate(chunk):
            self.values[path] = values[j]  # a view: the forward's rows are kept, not copied again
        self.forwards += 1
        self.rows_computed += r

    def evidence(self) -> dict:
        return {"forwards": self.forwards, "rows": self.rows_computed}
