"""EAGLE: feature-level dependent drafting (Li et al., 2024), with EAGLE-2's dynamic trees (Li et
al., 2024) and EAGLE-3 drafts read from published checkpoints (Li et al., 2025).

Every round the draft network (:mod:`harness.heads.eagle`) first catches up on the committed
path: each committed pair ``(f_j, x_{j+1})`` it has not seen — ``f_j`` the target's feature at
position ``j`` — is appended to its own KV cache in one forward, the last one being ``(f_{t-1},
x_t)`` with ``x_t`` the pending token. Its output ``g`` predicts ``f_t``; the target's LM head turns
it into the law of the first drafted token. Drafting deeper feeds the network its own prediction:
a node ``x̂`` at depth ``d`` is the pair ``(g_parent, x̂)`` at position ``t - 1 + d``, attending to
the committed pairs and its own ancestors only (a serial chain: one draft stage per depth, counted
in ``draft_stages`` and ``critical_path_stages_per_round``). After proposing, the cache is cut back
to the committed pairs: drafted rows carry predicted features, never the target's.

Target features come from the target's own forwards, observed through the shared
:class:`~harness.heads.state.HiddenTap` (the prompt prefill at ``start``; afterwards the verify
forward that follows each proposal, handed to this proposer by :meth:`HiddenTap.deliver_next`) and
admitted only through the ``may_reuse`` state check against the committed path (checkpoint,
feature boundary, token, position, ancestry hash, dtype, forward generation). No extra target
forward runs. A missing feature leaves a gap in the draft's context (``feature_gaps``); a missing
``f_{t-1}`` makes the round propose nothing (``hidden_misses``). EAGLE-1/2 read the final-norm
row; EAGLE-3 reads the residual stream entering three target layers, concatenated.

Topologies and sampling relations:

- ``sequence`` / ``set`` / ``expansion`` / ``cartesian`` and ``choices`` (EAGLE-1's static trees,
  given as a choice list, e.g. from a JSON file): level by level through
  :func:`~harness.proposers.sampling.sample_tree_proposal` (a choice list through
  :func:`~harness.proposers.sampling.sample_ranked_tree_proposal`, one draft stage per depth).
  ``sampling=beam`` takes the draft's deterministic top-k (``score_only``: greedy or membership verification);
  ``iid`` / ``without_replacement`` draw from the draft's law under the run's sampling policy and
  record it (``normalized_conditional``: specinfer / sequoia / rejection).
- ``dynamic`` with ``sampling=beam``: EAGLE-2's tree. The ``topk`` most likely tokens below the
  pending token, then at each depth the ``topk`` frontier nodes of highest joint draft
  confidence (the product of the draft's probabilities along the path) each expand their
  ``topk`` most likely children; every drafted node is reranked by joint confidence and the best
  ``max_nodes`` kept as a connected subtree (:func:`harness.topology.dynamic.rerank_connected`).
  Deterministic given the draft: ``score_only`` evidence, relation ``beam``, each node's score the
  draft's conditional probability (its joint log-confidence in ``extras["joint_logp"]``).
  Expansion stops early once no deeper node could enter the kept set (same tree, fewer stages).
- ``dynamic`` with ``sampling=without_replacement`` (or ``iid``): the same confidence-driven
  expansion with sampled children, each recording the law it was drawn from, and NO rerank:
  pruning a drawn node because of its own value would change the law the verifier relies on
  (the end-to-end oracle's negative control shows it). Which nodes expand, and how many children
  they draw, depends only on nodes drawn before them, so SpecInfer / Sequoia verification stays
  exact; the budget caps the count level by level instead.

Batch: one request per proposer and ``generation.batch_size = 1`` only (``max_batch_size``): the
hidden-state tap observes batch-1 forwards, and the draft cache holds one request's path.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch

from harness.contracts import (
    PREFIX_FRONTIER,
    Budget,
    ContractError,
    ProposalNode,
    ProposalResult,
    ProposalStateHandle,
)
from harness.heads.artifacts import ChecksTrainingLeakage, TrainingLeakage, load_configured_eagle
from harness.heads.checkpoint import ArtifactError
from harness.heads.eagle import DraftKV
from harness.heads.eagle_formats import published_config_problem
from harness.heads.models import vocab_projection
from harness.heads.state import CapturedForward, CommittedHidden, PrefixHashes
from harness.proposers.memo import LawTable, memo_call
from harness.proposers.sampling import beam_rows, sample_children, topology_of
from harness.proposers.target_bound import HiddenRowProposer
from harness.random_source import RandomSource
from harness.target.loading import looks_like_hub_id
from harness.target.paths import ROWS_PER_FORWARD, PathValues
from harness.topology.dynamic import confidence_order, deeper_nodes_cannot_enter, rerank_connected

SHAPES = frozenset({"sequence", "set", "expansion", "cartesian", "choices", "dynamic"})


def static_widths(budget: Budget) -> tuple[int, ...]:
    """Per-depth children counts of a fixed shape."""
    if budget.shape == "sequence":
        return (1,) * min(budget.max_depth, budget.max_nodes)
    if budget.shape == "set":
        return (budget.max_nodes,)
    if budget.shape == "choices":  # widths vary by node: the choice list shapes each level
        return (1,) * budget.max_depth
    return tuple(budget.widths) or (1,) * budget.max_depth


class EagleProposer(ChecksTrainingLeakage, HiddenRowProposer):
    name: ClassVar[str] = "eagle"
    shapes: ClassVar[frozenset[str]] = SHAPES
    batch_limit_reason: ClassVar[str] = (
        "EAGLE reads the target's features through a batch-1 forward hook (HiddenTap) and keeps one draft KV "
        "cache per request; in a batched forward it would find no row of its own request"
    )

    def __init__(self, *, draft: torch.nn.Module, training_leakage: TrainingLeakage | None = None, **common) -> None:
        """``draft``: the EAGLE draft network; ``training_leakage``: the workload check against the
        text the draft trained on (:meth:`check_workload`); ``common``: the keywords of
        :class:`TargetBoundProposer`."""
        super().__init__(**common)
        self.training_leakage = training_leakage
        self.draft = self.run_like_target(draft.to(device=self.device, dtype=self.dtype).eval())
        self.spec = draft.spec
        own = getattr(draft, "embed_tokens", None)
        self.embed = own if own is not None else self.model.get_input_embeddings()
        self.eagle3 = self.spec.version == "eagle3"
        if self.eagle3:
            self.tap.capture_layers(self.spec.aux_layers)
        boundary = "final_norm" if not self.eagle3 else "layer_inputs:" + ",".join(map(str, self.spec.aux_layers))
        self.store = CommittedHidden(checkpoint=self.checkpoint, dtype=str(self.dtype), keep=1, boundary=boundary)
        self.widths = static_widths(self.budget) if self.budget.shape != "dynamic" else ()
        draft_vocab = self.spec.draft_vocab_size
        if self.eagle3 and draft_vocab and draft_vocab < self.spec.vocab_size:
            need = max([*self.widths, int(self.budget.topk or 0), *(r + 1 for r in (self.budget.ranks or ()))])
            if need > draft_vocab:  # the rows past it would be filler, credited to the draft
                raise ContractError(
                    f"the topology asks for {need} children of one node but this EAGLE-3 draft proposes from its "
                    f"{draft_vocab}-token vocabulary (draft_vocab_size): narrow the tree"
                )
        #: an EAGLE manifest carries the label its trainer computed from the tokens it saw
        self.cpu_budget_artifact = bool(self.artifact_manifest.get("cpu_budget_artifact", False))
        self.cache = self.draft.new_cache()
        self.fed: list[tuple[int, int]] = []  # committed pairs in the draft cache: (position j, hash of x_0..x_{j+1})
        self.g_last: torch.Tensor | None = None  # draft output [H] of the last fed pair
        self.peak_state_bytes = 0
        self._start_capture: CapturedForward | None = None
        self._delivered: CapturedForward | None = None
        self.stats.extras.update(self.counters())

    # ------------------------------------------------------------------ config
    @classmethod
    def check_options(cls, options: dict, budget: Budget) -> None:
        artifact = options.get("artifact")
        if artifact and not Path(str(artifact)).expanduser().exists() and not looks_like_hub_id(str(artifact)):
            raise ValueError(
                f"proposer.artifact={artifact!r} does not exist and is not a hub id (owner/name); give an artifact "
                "directory, a published EAGLE checkpoint, or leave it unset to train or load one from the cache"
            )

    @classmethod
    def check_plan(cls, options: dict, budget: Budget, geometry) -> None:
        """Before any model work: a published draft in a local folder against the target's hidden
        size and vocabulary (its config.json; the weights are checked again when they load)."""
        problem = published_config_problem(options.get("artifact"), geometry)
        if problem:
            raise ArtifactError(problem)

    @classmethod
    def load_artifact(cls, options: dict, *, model: torch.nn.Module, tokenizer) -> dict:
        artifact = load_configured_eagle(options, model=model, tokenizer=tokenizer)
        leakage = TrainingLeakage(artifact.manifest, tokenizer=tokenizer, vocab_size=model.config.vocab_size)
        return {"draft": artifact.draft, "artifact_manifest": artifact.manifest, "training_leakage": leakage}

    # ------------------------------------------------------------------ lifecycle
    def counters(self) -> dict:
        return {
            "rounds": 0,
            "hidden_misses": 0,
            "feature_gaps": 0,
            "refused_reuse": 0,
            "pairs_fed": 0,
            "draft_stages": 0,
            "lm_head_rows": 0,
            "tree_rows_total": 0,
            "max_tree_rows": 0,
            "max_tree_depth": 0,
            "tree_rows_hist": [],
            "critical_path_stages_per_round": None,
            "mean_tree_rows": None,
        }

    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> None:
        """Keep the prefill's features and run the draft's own prompt forward over them now: prefill
        work, as a draft model's prompt forward is (the first round's proposal then drafts only)."""
        self._reset()
        last = self.tap.last
        # a one-token prompt runs no prefill: the tap's last forward is then another request's
        self._start_capture = last if last is not None and len(prompt_ids) >= 2 else None
        if self._start_capture is not None:
            self._ingest(prompt_ids)
            stages = self.stats.extras["draft_stages"]
            self._catch_up(prompt_ids)
            self.stats.extras["draft_stages"] = stages  # the prompt forward is no round's stage

    def finish(self) -> None:
        self._reset()
        ex = self.stats.extras
        if ex["rounds"]:
            ex["critical_path_stages_per_round"] = ex["draft_stages"] / ex["rounds"]
            ex["mean_tree_rows"] = ex["tree_rows_total"] / ex["rounds"]

    def _reset(self) -> None:
        self.store.reset()
        self.cache = self.draft.new_cache()
        self.fed = []
        self.g_last = None
        self._start_capture = self._delivered = None
        self._expect = None

    def state_bytes(self) -> int:
        return self.peak_state_bytes

    def _on_forward(self, captured: CapturedForward | None) -> None:
        """The target forward right after a proposal (its verify forward), handed over by the tap."""
        self._delivered = captured

    # ------------------------------------------------------------------ target features
    def _features(self, cap: CapturedForward) -> CapturedForward:
        """The capture with the rows this draft reads as its ``hidden``: final-norm rows, or
        EAGLE-3's three layer inputs concatenated ``[R, 3 H_t]``."""
        if not self.eagle3:
            return cap
        aux = cap.aux or {}
        if any(layer not in aux for layer in self.spec.aux_layers):
            return replace(cap, hidden=cap.hidden[:0])
        return replace(cap, hidden=torch.cat([aux[layer] for layer in self.spec.aux_layers], dim=-1))

    def _admit(self, cap: CapturedForward, index: int, ancestry: int, generation: int) -> None:
        if index < cap.hidden.shape[0]:
            self.store.admit(cap, index, ancestry_hash=ancestry, generation=generation)
        else:
            self.store.refused += 1

    def _ingest(self, committed: list[int]) -> None:
        """Admit the committed rows of the prefill and of the verify forward that followed the last
        proposal (each through the may_reuse check against the committed path)."""
        store = self.store
        store.prefix.sync(committed)
        before = store.refused
        if self._start_capture is not None:
            cap, self._start_capture = self._features(self._start_capture), None
            if self.is_prefill(cap):
                for j, h in self.prefill_hashes(cap):
                    if j < len(committed) - 1:
                        self._admit(cap, j, h, cap.serial)
        if self._expect is not None:
            cap, self._delivered = self._delivered, None
            verified = self._verified_tree(cap)
            path = tuple(committed[len(self._expect[1]) :])  # committed since the proposal
            self._expect = None
            if verified is not None:
                generation, base, tree = verified
                cap = self._features(cap)
                self._admit(cap, 0, base, generation)
                for r, prefix in enumerate(tree.full_prefixes):
                    if path[: len(prefix)] == prefix:  # on the committed path
                        self._admit(cap, 1 + r, PrefixHashes.extend(base, prefix), generation)
        self.stats.extras["refused_reuse"] += store.refused - before

    def _catch_up(self, committed: list[int]) -> bool:
        """Roll the draft cache back to pairs on the committed path, then feed every new committed
        pair whose feature is known, in one forward. True when ``g`` of the last pair
        ``(f_{n-2}, x_{n-1})`` is available."""
        n = len(committed)
        prefix = self.store.prefix
        keep = 0
        for pos, key in self.fed:
            if pos + 1 <= n - 1 and key == prefix.at(pos + 1):
                keep += 1
            else:
                break
        if keep < len(self.fed):
            self.g_last = None
        if self.g_last is None and keep:
            keep -= 1  # re-feed the last kept pair: its output g is needed
        if keep < len(self.fed):
            self.cache.crop(keep)
            self.fed = self.fed[:keep]
        start = self.fed[-1][0] + 1 if self.fed else 0
        rows = self.store.rows
        new = [p for p in range(start, n - 1) if p in rows]
        self.stats.extras["feature_gaps"] += (n - 1 - start) - len(new)
        if new:
            past = self.cache.length
            r = len(new)
            feats = torch.stack([rows[p] for p in new]).to(self.device, self.dtype)[None]  # [1, R, F]
            toks = torch.tensor([[committed[p + 1] for p in new]], device=self.device)  # [1, R]
            pos = torch.tensor([new], device=self.device)  # [1, R]
            mask = torch.ones(1, r, past + r, dtype=torch.bool, device=self.device)
            mask[0, :, past:] = torch.tril(torch.ones(r, r, dtype=torch.bool, device=self.device))
            g = self.draft(feats, self.embed(toks), pos, cache=self.cache, mask=mask, real=True)  # [1, R, H]
            self.fed.extend((p, prefix.at(p + 1)) for p in new)
            self.g_last = g[0, -1]
            self.stats.extras["pairs_fed"] += r
            self.stats.extras["draft_stages"] += 1
            self.store.prune(new[-1])  # rows before the last fed one are in the cache (the last may be re-fed)
        return bool(self.fed) and self.fed[-1][0] == n - 2 and self.g_last is not None

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits ``[n, V]`` of drafted features ``[n, H]``."""
        self.stats.extras["lm_head_rows"] += g.shape[0]
        if self.eagle3:
            return self.draft.logits(g)
        return vocab_projection(self.lm_head, g.to(self.dtype))

    # ------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        ex = self.stats.extras
        ex["rounds"] += 1
        table = self.law_table  # the statistical gate's passes: laws by candidate prefix
        if table is not None:
            table.check(committed)  # the prefix the table was opened at, caught up on then
        else:
            self._ingest(committed)
        handle = ProposalStateHandle(
            owner=self.name, committed_len=len(committed), generation=self.tap.serial, kv_bytes=self.cache.nbytes()
        )
        if table is None and self.round_max_depth() == 0:  # the round commits its bonus token only:
            result = self.empty_proposal(handle)  # no draft stage pays for it
            self._observe_tree(result)
        elif table is None and (len(committed) < 2 or not self._catch_up(committed)):
            result = self._no_proposal(handle)
        else:
            real_len = self.cache.length
            level = _TreeRows(self, committed, real_len)
            q_level = level.q_level(self._probs) if table is None else table.level
            if self.budget.shape == "dynamic" and self.sampling == "beam":
                result = self._dynamic_beam(level, handle)
            elif self.budget.shape == "dynamic":
                result = self._dynamic_sampled(q_level, rng, handle)
            else:
                result = self._fixed_tree(q_level, self.widths, rng, handle)
            self.peak_state_bytes = max(self.peak_state_bytes, self.cache.nbytes())
            self.cache.crop(real_len)  # drafted rows hold predicted features: never kept
            self._observe_tree(result)
        self._expect = (self.tap.serial, tuple(committed), result, self.round_max_depth())
        self.tap.deliver_next(self._on_forward)
        return result

    def open_law_table(self, committed: list[int]) -> LawTable | None:
        """A :class:`~harness.proposers.memo.LawTable` of the draft's laws below ``committed`` (the
        statistical gate's fixed prefix), each candidate prefix's row computed once, a depth's rows
        in one draft stage; None for the beam (one deterministic tree: nothing to share) or where
        the draft cannot catch up on the prefix (it proposes nothing there)."""
        if self.sampling == "beam" or len(committed) < 2:
            return None
        self._ingest(committed)
        if not self._catch_up(committed):
            return None
        return LawTable(_DraftPaths(self, committed), committed)

    def _observe_tree(self, result: ProposalResult) -> None:
        ex = self.stats.extras
        n = len(result.nodes)
        depth = [0] * n
        for i, node in enumerate(result.nodes):
            depth[i] = 1 if node.parent == PREFIX_FRONTIER else depth[node.parent] + 1
        hist = ex["tree_rows_hist"]
        while len(hist) <= n:
            hist.append(0)
        hist[n] += 1
        ex["tree_rows_total"] += n
        ex["max_tree_rows"] = max(ex["max_tree_rows"], n)
        ex["max_tree_depth"] = max(ex["max_tree_depth"], max(depth, default=0))

    # ------------------------------------------------------------------ EAGLE-2 dynamic trees
    def _dynamic_beam(self, level: _TreeRows, handle: ProposalStateHandle) -> ProposalResult:
        """EAGLE-2: confidence-ordered expansion, then the connected top-``max_nodes`` rerank."""
        k, max_nodes, max_depth = self.budget.topk, self.budget.max_nodes, self.round_max_depth()
        tok: list[int] = []
        par: list[int] = []
        joint: list[float] = []  # joint log-confidence of each pool node's path
        cond: list[float] = []  # the draft's conditional probability of the node's token
        prefix_of: list[tuple[int, ...]] = []

        def add(t: int, p: int, logp: float) -> int:
            tok.append(t)
            par.append(p)
            joint.append((joint[p] if p >= 0 else 0.0) + logp)
            cond.append(math.exp(logp))
            prefix_of.append((prefix_of[p] if p >= 0 else ()) + (t,))
            return len(tok) - 1

        logp = torch.log_softmax(level.root_logits().float(), dim=-1)  # [V]
        frontier = [add(t, PREFIX_FRONTIER, lp) for t, lp in beam_rows(logp[None], k)[0]]  # one read for the level
        for _ in range(2, max_depth + 1):
            if not frontier or deeper_nodes_cannot_enter(joint, max(joint[i] for i in frontier), max_nodes):
                break
            logps = torch.log_softmax(level.expand([prefix_of[i] for i in frontier]).float(), dim=-1)  # [F, V]
            candidates = []
            for f, row in zip(frontier, beam_rows(logps, k), strict=True):
                candidates.extend(add(t, f, lp) for t, lp in row)
            frontier = [candidates[i] for i in confidence_order([joint[c] for c in candidates])[:k]]
        kept = rerank_connected(par, joint, max_nodes)
        index = {old: new for new, old in enumerate(kept)}
        nodes = tuple(
            ProposalNode(
                token_id=tok[i],
                parent=PREFIX_FRONTIER if par[i] == PREFIX_FRONTIER else index[par[i]],
                score=cond[i],
                source=self.name,
            )
            for i in kept
        )
        return ProposalResult(
            nodes=nodes,
            probability_semantics="score_only",
            sampling_relation="beam",
            topology=topology_of(nodes),
            state_handle=handle,
            manifest_hash=self.manifest_hash,
            source=self.name,
            extras={"joint_logp": [joint[i] for i in kept], "pool_nodes": len(tok)},
        )

    def _dynamic_sampled(self, q_level, rng: RandomSource, handle: ProposalStateHandle) -> ProposalResult:
        """Confidence-driven expansion with sampled children and no value-dependent pruning;
        ``q_level(prefixes)``: the draft's law ``[len(prefixes), V]`` below each candidate prefix."""
        k, max_nodes, max_depth = self.budget.topk, self.budget.max_nodes, self.round_max_depth()
        nodes: list[ProposalNode] = []
        laws: list[torch.Tensor] = []
        joint: list[float] = []
        prefix_of: list[tuple[int, ...]] = []

        def draw(q: torch.Tensor, count: int, parent: int) -> list[int]:
            expandable, seen = [], set()
            for t, law in sample_children(q, count, relation=self.sampling, rng=rng):
                nodes.append(ProposalNode(token_id=t, parent=parent, q=float(law[t]), source=self.name))
                laws.append(law)
                joint.append((joint[parent] if parent >= 0 else 0.0) + float(torch.log(q[t])))
                prefix_of.append((prefix_of[parent] if parent >= 0 else ()) + (t,))
                if t not in seen:  # an i.i.d. duplicate shares its sibling's row; expanded once
                    seen.add(t)
                    expandable.append(len(nodes) - 1)
            return expandable

        frontier = draw(q_level([()])[0], min(k, max_nodes), PREFIX_FRONTIER)
        for _ in range(2, max_depth + 1):
            remaining = max_nodes - len(nodes)
            if remaining <= 0 or not frontier:
                break
            n_expand, per = (min(k, len(frontier), remaining // k), k) if remaining >= k else (1, remaining)
            chosen = [frontier[i] for i in confidence_order([joint[f] for f in frontier])[:n_expand]]
            qs = q_level([prefix_of[c] for c in chosen])  # [n_expand, V]
            frontier = [e for c, q in zip(chosen, qs) for e in draw(q, per, c)]
        return ProposalResult(
            nodes=tuple(nodes),
            probability_semantics="normalized_conditional",
            sampling_relation=self.sampling,
            topology=topology_of(nodes),
            state_handle=handle,
            manifest_hash=self.manifest_hash,
            q_dists=torch.stack(laws),
            source=self.name,
            extras={"joint_logp": joint},
        )


class _TreeRows:
    """One round's drafted rows in the draft cache: row ``prefix`` is the pair ``(g of its parent,
    its last token)`` at position ``t - 1 + len(prefix)``, attending to the committed pairs (the
    first ``real_len`` cache rows) and its ancestors' rows."""

    def __init__(self, proposer: EagleProposer, committed: list[int], real_len: int) -> None:
        self.p = proposer
        self.real_len = real_len
        self.last_pos = len(committed) - 2  # position of the last committed pair
        self.g_of: dict[tuple[int, ...], torch.Tensor] = {(): proposer.g_last}
        self.row_of: dict[tuple[int, ...], int] = {}

    def root_logits(self) -> torch.Tensor:
        return memo_call(self.p, "root", lambda: self.p._logits(self.g_of[()][None])[0])  # [V]

    def expand(self, prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        """One draft stage over the rows ``prefixes`` (each non-empty, parent already drafted) ->
        their logits ``[len(prefixes), V]`` (the law of each row's children)."""
        p = self.p
        cache = p.cache
        start, r = cache.length, len(prefixes)
        mask = torch.zeros(1, r, start + r, dtype=torch.bool)  # built on the host, moved once
        mask[0, :, : self.real_len] = True
        for j, prefix in enumerate(prefixes):
            for i in range(1, len(prefix)):
                mask[0, j, self.row_of[prefix[:i]]] = True
            mask[0, j, start + j] = True
        mask = mask.to(p.device)
        feats = torch.stack([self.g_of[prefix[:-1]] for prefix in prefixes])[None]  # [1, r, H]
        toks = torch.tensor([[prefix[-1] for prefix in prefixes]], device=p.device)
        pos = torch.tensor([[self.last_pos + len(prefix) for prefix in prefixes]], device=p.device)

        def stage() -> tuple[torch.Tensor, torch.Tensor]:
            g = p.draft(feats, p.embed(toks), pos, cache=cache, mask=mask, real=False)[0]  # [r, H]
            p.stats.extras["draft_stages"] += 1
            return g, p._logits(g)

        g, logits = memo_call(p, tuple(prefixes), stage, cache)
        for j, prefix in enumerate(prefixes):
            self.g_of[prefix] = g[j]
            self.row_of[prefix] = start + j
        return logits

    def q_level(self, probs):
        """The per-level law callback of :func:`sample_tree_proposal`."""

        def q_level(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
            if prefixes == [()]:
                return probs(self.root_logits()[None])
            return probs(self.expand(prefixes))

        return q_level


class _DraftPaths(PathValues):
    """The draft's laws by path below the committed pairs, for a :class:`LawTable`: the path
    ``(x_t, *p)`` holds the law below candidate prefix ``p`` (``x_t`` the pending token). Row ``p``
    is computed as in :class:`_TreeRows` (the pair ``(g of p's parent, p's last token)``, attending
    to the committed pairs and its ancestors' rows), once, a depth's missing rows together in one
    draft stage. The rows live in a cache of their own (a copy of the committed pairs, then every
    computed row), so a deeper row attends to its ancestors wherever they sit, through the mask."""

    def __init__(self, proposer: EagleProposer, committed: list[int]) -> None:
        super().__init__()
        p = proposer
        self.p = p
        self.cache = DraftKV(len(p.cache.keys))
        for layer, (k, v) in enumerate(zip(p.cache.keys, p.cache.values)):
            if k is not None:
                self.cache.append(layer, k.clone(), v.clone())
        self.real_len = self.cache.length
        self.last_pos = len(committed) - 2
        root = (int(committed[-1]),)
        self.g: dict[tuple[int, ...], torch.Tensor] = {root: p.g_last}
        self.values[root] = p._probs(p._logits(p.g_last[None]))[0]

    def nbytes(self) -> int:
        return self.values_nbytes() + self.cache.nbytes()

    @torch.inference_mode()
    def compute(self, paths) -> int:
        """Compute every path not computed yet (and any uncomputed ancestor); returns the rows."""
        todo = {
            tuple(path[:k]) for path in paths for k in range(2, len(path) + 1) if tuple(path[:k]) not in self.values
        }
        by_depth: dict[int, list[tuple[int, ...]]] = {}
        for path in todo:
            by_depth.setdefault(len(path), []).append(path)
        for depth in sorted(by_depth):  # a row's input is its parent's output: one depth per stage
            rows = sorted(by_depth[depth])
            for i in range(0, len(rows), ROWS_PER_FORWARD):
                self._stage(rows[i : i + ROWS_PER_FORWARD])
        return len(todo)

    def _stage(self, chunk: list[tuple[int, ...]]) -> None:
        p = self.p
        start, r = self.cache.length, len(chunk)
        mask = torch.zeros(1, r, start + r, dtype=torch.bool)  # built on the host, moved once
        mask[0, :, : self.real_len] = True
        for j, path in enumerate(chunk):
            for k in range(2, len(path)):
                mask[0, j, self.slot[path[:k]]] = True
            mask[0, j, start + j] = True
        mask = mask.to(p.device)
        feats = torch.stack([self.g[path[:-1]] for path in chunk])[None]  # [1, r, H]
        toks = torch.tensor([[path[-1] for path in chunk]], device=p.device)
        pos = torch.tensor([[self.last_pos + len(path) - 1 for path in chunk]], device=p.device)
        g = p.draft(feats, p.embed(toks), pos, cache=self.cache, mask=mask, real=False)[0]  # [r, H]
        laws = p._probs(p._logits(g))  # [r, V]
        for j, path in enumerate(chunk):
            self.g[path] = g[j]  # views: the stage's rows are kept, not copied again
            self.values[path] = laws[j]
            self.slot[path] = start + j
        self.forwards += 1
        self.rows_computed += r
