"""A separate draft causal LM with its own KV cache (a parametric draft source; trees by
SpecInfer-style width-by-depth expansion, Miao et al., 2024).

The draft cache mirrors the committed prefix. Each round it is rolled back to the longest common
prefix of what it holds and the committed tokens (``CausalLMBackend.keep_rows``), then fed only
the tokens it has not seen — the accepted ones and the pending token — in one forward: it is never
re-prefilled. Drafting then expands ``topology.widths`` (a chain when every width is 1) one level
per forward, each level's rows attending to the committed prefix and their own ancestors only.
A chain's drafted rows stay cached (the accepted part is reused next round); a branching tree's
rows are dropped after proposing, since sibling rows sit at positions a committed path cannot use.

Draft KV is proposal-side state: it never becomes target KV (only target-computed rows are
committed). The draft must share the target's tokenizer (checked by the runner before any model
work).

An explicit tree shape (``Budget(shape="tree", parents=...)``, e.g. a Sequoia tree) is sampled by
:func:`~harness.proposers.sampling.sample_shaped_tree_proposal`, and a choice list
(``topology=choices``) by :func:`~harness.proposers.sampling.sample_ranked_tree_proposal`, one
level per forward as well.

Vocabularies: the draft proposes only ids in ``vocab_range``, the range its tokenizer shares with
the target's (checkpoints of one family pad their embedding matrices to different sizes). Its law
is the policy applied to its logits over that range alone, so q is a proper distribution over ids
the target can score, written into the target's vocabulary width (zero beyond the range) on the
target's device. A committed id the draft's embedding has no row for (the target sampled one of its
own padding ids) is fed to the draft as a stand-in id (its config's ``pad_token_id`` where that is
in range, else 0): the draft's view of that position is then approximate, its proposals may be
weaker after it, and the verifier keeps the output exact. A note on stderr says when that happened.

Sampling: ``sampling=iid`` (SpecInfer), ``without_replacement`` (Sequoia) or ``beam``
(deterministic top-k of the draft's own softmax, score-only evidence). q is the draft's
distribution under the same temperature / top-p / top-k policy as the target, and each node
carries the law it was drawn from.
"""

from __future__ import annotations

import sys
import weakref
from typing import ClassVar

import torch

from harness.contracts import Budget, ConfigError, ProposalResult, ProposalStateHandle
from harness.proposers.base import Proposer
from harness.proposers.memo import LawTable, memo_call
from harness.proposers.sampling import (
    check_ranked_shape,
    check_shape_parents,
    sample_ranked_tree_proposal,
    sample_shaped_tree_proposal,
    sample_tree_proposal,
    widths_parents,
)
from harness.random_source import RandomSource
from harness.target.backend import CacheState, CausalLMBackend, cache_bytes
from harness.target.loading import shared_vocab_size
from harness.target.paths import PathRows
from harness.verifiers.sampling import SamplingPolicy

#: draft models whose stand-in note has been printed
_STAND_IN_NOTED: weakref.WeakSet = weakref.WeakSet()


def stand_in_id(backend: CausalLMBackend) -> int:
    """The id a draft reads in place of a committed id past its embedding: its config's
    ``pad_token_id`` where that is one of its ids, else 0."""
    pad = getattr(getattr(backend.model, "config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < backend.vocab_size else 0


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer(Proposer):
    name: ClassVar[str] = "draft_model"
    shapes: ClassVar[frozenset[str]] = frozenset({"sequence", "set", "expansion", "tree", "choices"})

    def __init__(
        self,
        *,
        budget: Budget,
        manifest_hash: str,
        policy: SamplingPolicy,
        backend: CausalLMBackend,
        sampling: str = "iid",
        vocab_range: int | None = None,
        target_vocab: int | None = None,
        target_device: torch.device | str | None = None,
    ) -> None:
        super().__init__(budget=budget, manifest_hash=manifest_hash, policy=policy)
        if sampling not in ("iid", "without_replacement", "beam"):
            raise ValueError(f"proposer.sampling must be iid, without_replacement or beam; got {sampling!r}")
        self.backend = backend
        self.sampling = sampling
        self.sampling_relation = sampling
        self.probability_semantics = "score_only" if sampling == "beam" else "normalized_conditional"
        if budget.shape == "sequence":
            self.widths = (1,) * min(budget.max_depth, budget.max_nodes)
        else:
            self.widths = budget.widths or (1,) * budget.max_depth
        # an explicit tree shape (Budget(shape="tree", parents=...), e.g. a Sequoia tree)
        self.shape_parents: tuple[int, ...] = ()
        if budget.shape == "tree" and budget.parents:
            self.shape_parents = tuple(check_shape_parents(budget.parents))
            if len(self.shape_parents) > budget.max_nodes:
                raise ValueError(
                    f"the tree shape has {len(self.shape_parents)} candidate rows, over max_nodes={budget.max_nodes}"
                )
        if budget.shape == "choices":
            check_ranked_shape(budget.parents, budget.ranks, sampling)
        self.vocab_range = int(vocab_range) if vocab_range is not None else backend.vocab_size
        self.target_vocab = int(target_vocab) if target_vocab is not None else self.vocab_range
        if not 1 <= self.vocab_range <= min(backend.vocab_size, self.target_vocab):
            raise ValueError(
                f"vocab_range={self.vocab_range} must be in [1, min(draft vocabulary {backend.vocab_size}, "
                f"target vocabulary {self.target_vocab})]"
            )
        self._check_ranks_fit()
        self.target_device = torch.device(target_device) if target_device is not None else None
        self.stand_in = stand_in_id(backend)
        self.seq: CacheState | None = None
        self.peak_state_bytes = 0

    def _check_ranks_fit(self) -> None:
        """Refuse a shape that ranks or draws without replacement more children below one node than
        the draft has ids in :attr:`vocab_range` (only those are ids it can propose and expand)."""
        if self.sampling == "iid":  # i.i.d. draws may repeat: any width fits
            return
        n = self.budget.max_nodes
        if self.budget.shape == "choices":
            parents, ranks = list(self.budget.parents)[:n], [int(r) for r in list(self.budget.ranks)[:n]]
        else:
            parents = list(self.shape_parents[:n]) if self.shape_parents else widths_parents(self.widths, n)
            ranks = []
            seen: dict[int, int] = {}
            for p in parents:
                ranks.append(seen.get(p, 0))
                seen[p] = ranks[-1] + 1
        if ranks and max(ranks) >= self.vocab_range:
            top = max(ranks)
            what = f"choice rank {top}" if self.budget.shape == "choices" else f"width {top + 1}"
            raise ConfigError(
                f"sampling={self.sampling} needs {top + 1} distinct ids below one node ({what}), but the draft "
                f"proposes from only {self.vocab_range} ids (the vocabulary it shares with the target)"
            )

    def devices(self) -> set:
        return {torch.device(self.backend.device), *([self.target_device] if self.target_device is not None else [])}

    @classmethod
    def declare(cls, options: dict, budget: Budget):

        if budget.shape not in cls.shapes:
            raise ValueError(f"proposer=draft_model builds {sorted(cls.shapes)}; got topology {budget.shape!r}")
        rel = str(options.get("sampling", "iid"))
        if budget.shape == "choices":
            check_ranked_shape(budget.parents, budget.ranks, rel)
        sem = "score_only" if rel == "beam" else "normalized_conditional"
        return cls.capabilities_on(budget, {sem}, {rel})

    @classmethod
    def from_config(cls, *, options: dict, budget: Budget, manifest_hash: str, policy, context):
        if context.draft_backend is None:
            raise ValueError("proposer=draft_model needs a loaded draft model (proposer.model)")
        target = context.target_backend
        shared = shared_vocab_size(context.tokenizer, target.vocab_size, context.draft_backend.vocab_size)
        if context.draft_backend.vocab_size != target.vocab_size:  # checkpoints of one family pad differently
            print(
                f"harness: note: the draft's embedding holds {context.draft_backend.vocab_size} ids and the "
                f"target's {target.vocab_size}: the draft proposes from the {shared} ids their tokenizer shares",
                file=sys.stderr,
            )
        return cls(
            budget=budget,
            manifest_hash=manifest_hash,
            policy=policy,
            backend=context.draft_backend,
            sampling=options.get("sampling", "iid"),
            vocab_range=shared,
            target_vocab=target.vocab_size,
            target_device=target.device,
        )

    def law(self, logits: torch.Tensor) -> torch.Tensor:
        """The proposal law ``[n, V_target]`` of draft logits ``[n, V_draft]``: the policy over the
        shared id range, zero beyond it, on the target's device. ``sampling=beam`` draws nothing and
        only ranks: its scores are the draft's own softmax, so the rank-``r`` child is the draft's
        ``r``-th most probable token at any temperature (the policy's law is one-hot at T = 0)."""
        shared = logits[..., : self.vocab_range]
        if self.sampling == "beam":
            probs = torch.softmax(shared.float(), dim=-1)  # [n, vocab_range]
        else:
            probs = self.policy.probs(shared)  # [n, vocab_range]
        if self.target_vocab > self.vocab_range:
            probs = torch.nn.functional.pad(probs, (0, self.target_vocab - self.vocab_range))
        if self.target_device is not None and probs.device != self.target_device:
            probs = probs.to(self.target_device)
        return probs

    # ------------------------------------------------------------------ lifecycle
    def start(self, prompt_ids: list[int]) -> None:
        self.seq = self.backend.prefill_one(self.draft_ids(prompt_ids))

    def draft_ids(self, tokens: list[int]) -> list[int]:
        """``tokens`` as the draft reads them: ids past its embedding become :attr:`stand_in`."""
        if self.target_vocab <= self.backend.vocab_size:
            return tokens
        limit = self.backend.vocab_size
        out = [t if t < limit else self.stand_in for t in tokens]
        if self.backend.model not in _STAND_IN_NOTED and any(t >= limit for t in tokens):
            _STAND_IN_NOTED.add(self.backend.model)  # once per draft model, forks and requests included
            print(
                f"harness: note: the target committed id {max(tokens)}, past the draft's {limit}-id "
                f"embedding: the draft reads such ids as id {self.stand_in} (its proposals may be weaker "
                "after them; the verifier keeps the output exact)",
                file=sys.stderr,
            )
        return out

    def finish(self) -> None:
        self.seq = None

    def state_bytes(self) -> int:
        return self.peak_state_bytes

    # ------------------------------------------------------------------ proposing
    def open_law_table(self, committed: list[int]) -> LawTable:
        """A :class:`~harness.proposers.memo.LawTable` of this draft's laws below ``committed``
        (the statistical gate's fixed prefix): its own cache of the prefix, laws by path computed
        many per forward, exactly :meth:`law` of the draft's logits at each candidate prefix."""
        cache = self.backend.prefill_one(self.draft_ids(committed))
        return LawTable(PathRows(self.backend, cache, transform=self.law), committed)

    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        if self.law_table is not None:  # the statistical gate's passes: laws by candidate prefix
            self.law_table.check(committed)
            generation = self.seq.cache_generation if self.seq is not None else 0
            handle = ProposalStateHandle(owner=self.name, committed_len=len(committed), generation=generation)
            return self._sample(self.law_table.level, rng, handle)
        if self.seq is None:
            self.start(committed)
        seq = self.seq
        if self.round_max_depth() == 0:  # the round commits its bonus token only: no draft forward pays
            handle = ProposalStateHandle(owner=self.name, committed_len=len(committed), generation=seq.cache_generation)
            return self.empty_proposal(handle)
        backend = self.backend
        # roll back to the committed path, then feed what the draft has not seen (pending included)
        seen = self.draft_ids(committed)
        keep = min(common_prefix_len(seq.cached_tokens, seen), len(committed) - 1)
        backend.truncate(seq, keep)
        feed = seen[keep:]
        frontier = memo_call(  # [V]
            self,
            ("feed", keep, tuple(feed)),
            lambda: backend.forward_rows(seq, feed, range(keep, keep + len(feed)), None).logits[-1],
            seq,
        )
        base = seq.cache_len  # committed prefix length inside the draft cache
        row_of: dict[tuple[int, ...], int] = {}  # candidate prefix -> absolute draft cache row

        def q_level(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
            if prefixes == [()]:
                return memo_call(self, "root", lambda: self.law(frontier.unsqueeze(0)))
            start = seq.cache_len
            r = len(prefixes)
            chain = (
                r == 1
                and start == base + len(prefixes[0]) - 1
                and all(row_of.get(prefixes[0][:i]) == base + i - 1 for i in range(1, len(prefixes[0])))
            )
            mask = None
            if not chain:
                mask = torch.zeros((r, start + r), dtype=torch.bool)
                mask[:, :base] = True
                for j, prefix in enumerate(prefixes):
                    for i in range(1, len(prefix)):
                        mask[j, row_of[prefix[:i]]] = True
                    mask[j, start + j] = True
            ids = [p[-1] for p in prefixes]
            pos = [base + len(p) - 1 for p in prefixes]
            law = memo_call(  # [r, V]
                self, tuple(prefixes), lambda: self.law(backend.forward_rows(seq, ids, pos, mask).logits), seq
            )
            for j, prefix in enumerate(prefixes):
                row_of[prefix] = start + j
            return law

        handle = ProposalStateHandle(owner=self.name, committed_len=len(committed), generation=seq.cache_generation)
        result = self._sample(q_level, rng, handle)
        self.peak_state_bytes = max(self.peak_state_bytes, cache_bytes(seq.cache))
        if result.topology != "sequence":
            backend.truncate(seq, base)  # sibling rows can never be reused by a committed path
        return result

    def _sample(self, q_level, rng: RandomSource, handle: ProposalStateHandle) -> ProposalResult:
        """Draw the proposal of the configured shape, ``q_level(prefixes)`` giving each level's
        laws: the shape is cut to its first ``max_nodes`` nodes (breadth first for ``widths``,
        list order for a tree shape or choice list) before anything is drawn, so no draft forward
        is spent on a level the round cannot keep."""
        if self.budget.shape == "choices":
            return sample_ranked_tree_proposal(
                q_level,
                parents=self.budget.parents,
                ranks=self.budget.ranks,
                relation=self.sampling,
                rng=rng,
                source=self.name,
                manifest_hash=self.manifest_hash,
                state_handle=handle,
                max_depth=self.depth_cap,
                max_nodes=self.budget.max_nodes,
                domain=self.vocab_range,
            )
        if self.shape_parents:
            return sample_shaped_tree_proposal(
                q_level,
                parents=self.shape_parents,
                relation=self.sampling,
                rng=rng,
                source=self.name,
                manifest_hash=self.manifest_hash,
                state_handle=handle,
                max_depth=self.depth_cap,
                max_nodes=self.budget.max_nodes,
                domain=self.vocab_range,
            )
        return sample_tree_proposal(
            q_level,
            widths=self.widths,
            relation=self.sampling,
            rng=rng,
            source=self.name,
            manifest_hash=self.manifest_hash,
            state_handle=handle,
            max_depth=self.depth_cap,
            max_nodes=self.budget.max_nodes,
            domain=self.vocab_range,
        )
