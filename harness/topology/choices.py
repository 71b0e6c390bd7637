"""Trees given as choice lists: rank paths, the way Medusa (Cai et al., 2024), Hydra (Ankner et
al., 2024) and EAGLE-1 (Li et al., 2024) publish their static trees.

A choice list is a list of paths of child ranks. Path ``[a]`` is the rank-``a`` first token; path
``[a, b]`` is the rank-``b`` child of node ``[a]``; and so on. Rank ``r`` below a node means the
``r``-th child in the order the proposer ranks that node's children: for deterministic (beam)
proposals the ``r``-th most probable token under the node's own law, for sampled proposals the
``r``-th draw. Every proper prefix of a path must be a path of the list (a node's parent is in the
tree), and no path may repeat.

Nodes are numbered as Medusa numbers them: paths sorted by ``(len(path), path)``, so breadth-first
by depth and lexicographic within a depth; ``parents[i]`` is node ``i``'s parent (``-1``: the prefix
frontier) and ``ranks[i]`` its rank below that parent. :func:`choice_tree` validates a list and
returns that form; the proposal side is
:func:`harness.proposers.sampling.sample_ranked_tree_proposal`.

A list is given on the command line (``topology.choices=[[0],[0,0],[1]]``) or as a JSON file of
paths (``topology.choices_file=PATH``), e.g. a published tree such as Medusa's ``mc_sim_7b_63`` saved
from its authors' repository. No published list ships here: a tree tuned for another model's heads
says little about this one's, and ``topology=sequoia`` builds one from this target's measured
acceptance.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class ChoicesError(ValueError):
    """A choice list that does not describe a tree."""


@dataclass(frozen=True)
class ChoiceTree:
    """A validated choice list in node order (sorted by ``(len(path), path)``)."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]  # [N], -1 = the prefix frontier
    ranks: tuple[int, ...]  # [N], the node's rank below its parent

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def nodes_per_depth(self) -> list[int]:
        counts = [0] * self.depth
        for p in self.paths:
            counts[len(p) - 1] += 1
        return counts

    def leaves(self) -> list[tuple[int, ...]]:
        """Paths that are no other path's parent (Medusa's retrieval rows)."""
        has_child = {self.parents[i] for i in range(self.num_nodes)}
        return [p for i, p in enumerate(self.paths) if i not in has_child]

    def rank_gap(self) -> tuple[tuple[int, ...], int] | None:
        """The first node whose children skip a rank, as ``(parent path, missing rank)``, or None
        when every node's children are ranks ``0 .. n - 1``."""
        gap = first_rank_gap(self.parents, self.ranks)
        if gap is None:
            return None
        parent, rank = gap
        return (() if parent == -1 else self.paths[parent], rank)


def first_rank_gap(parents: Sequence[int], ranks: Sequence[int]) -> tuple[int, int] | None:
    """The first parent (node index, ``-1``: the frontier) whose children skip a rank, with the
    rank skipped; None when every node's children are ranks ``0 .. n - 1``."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(int(p), []).append(int(ranks[i]))
    for parent, got in sorted(children.items()):
        for want, rank in enumerate(sorted(got)):
            if want != rank:
                return parent, want
    return None


def choices_path(parents: Sequence[int], ranks: Sequence[int], node: int) -> tuple[int, ...]:
    """The rank path of ``node`` (``-1``: the empty path of the frontier)."""
    path: list[int] = []
    while node != -1:
        path.append(int(ranks[node]))
        node = int(parents[node])
    return tuple(reversed(path))


def choice_tree(choices: Sequence[Sequence[int]]) -> ChoiceTree:
    """Validate a choice list and number its nodes; raises :class:`ChoicesError` naming the path."""
    if choices is None or len(choices) == 0:
        raise ChoicesError("a choice list needs at least one path, e.g. [[0], [0, 0], [1]]")
    paths: list[tuple[int, ...]] = []
    for raw in choices:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) == 0:
            raise ChoicesError(f"each choice must be a non-empty list of ranks; got {raw!r}")
        path = []
        for r in raw:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ChoicesError(f"ranks must be ints >= 0; got {r!r} in {list(raw)}")
            path.append(int(r))
        paths.append(tuple(path))
    seen: set[tuple[int, ...]] = set()
    for p in paths:
        if p in seen:
            raise ChoicesError(f"path {list(p)} appears twice")
        seen.add(p)
    for p in paths:
        for k in range(1, len(p)):
            if p[:k] not in seen:
                raise ChoicesError(f"path {list(p)} needs its parent {list(p[:k])} in the list")
    ordered = sorted(paths, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    parents = tuple(-1 if len(p) == 1 else index[p[:-1]] for p in ordered)
    ranks = tuple(p[-1] for p in ordered)
    return ChoiceTree(paths=tuple(ordered), parents=parents, ranks=ranks)


def resolve_choices(choices, choices_file: str | None) -> ChoiceTree:
    """The tree of ``topology.choices`` or ``topology.choices_file`` (exactly one of them)."""
    if (choices is None) == (choices_file is None):
        raise ChoicesError(
            "give exactly one of topology.choices=[[0],[0,0],[1],...] and topology.choices_file=<JSON file of paths>"
        )
    if choices_file is not None:
        return choice_tree(read_choices_file(choices_file))
    return choice_tree([list(p) for p in choices])


def read_choices_file(path: str | Path) -> list[list[int]]:
    """The rank paths of a JSON file holding one list of paths (``[[0], [0, 0], [1], ...]``)."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ChoicesError(f"topology.choices_file={str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ChoicesError(f"topology.choices_file={str(path)!r}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ChoicesError(f"topology.choices_file={str(path)!r} is not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, list) or not all(isinstance(x, list) for x in data):
        raise ChoicesError(
            f"topology.choices_file={str(path)!r} must hold one JSON list of paths, e.g. [[0], [0, 0], [1]]"
        )
    return data
