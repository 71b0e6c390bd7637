"""Draft-head proposers: ``medusa`` (independent heads), ``hydra`` (heads conditioned on earlier
drafted embeddings, with the Hydra++ switches) and ``clover`` (a regressive cell carrying one state
from depth to depth, after an augmenting block over the committed rows): Medusa (Cai et al., 2024),
Hydra (Ankner et al., 2024), Clover-2 (Xiao et al., 2024, "Clover-2: Accurate Inference for
Regressive Lightweight Speculative Decoding"; :mod:`harness.heads.models`).

Each round the heads read ``h_{t-1}``: the target's final-norm hidden row of the token before the
pending token. It comes from the target's own forwards (the prompt prefill, then each verify
forward's pending row and accepted path), observed through :class:`~harness.heads.state.HiddenTap`
and admitted into a proposal-side store only through the ``may_reuse`` state check against the
committed path (checkpoint, layer boundary, token, position, ancestry hash, dtype, forward
generation). No extra target forward runs; if the row is missing (a forward the proposer did not
expect, or the first round of a one-token prompt, which has no row before its pending token) the
round proposes nothing and ``hidden_misses`` counts it. A one-token prompt runs no prefill forward,
and its first verify forward (the pending token alone, on an empty cache) is admitted as a verify
forward: it supplies ``h_0``, so only that first round misses. Hydra++'s prefix layer and
Clover-2's augmenting block read every committed row once, in order, through their own cache: after
a missing row they propose nothing for the rest of the request, each such round counted in
``hidden_misses`` (the output stays exact; the round loop makes no forward the tap does not see).

Proposed engine change (not made here): ``decode()`` could ask ``target.verify(...,
output_hidden=True)`` when ``proposer.needs_target_hidden`` and pass the accepted rows' hidden
states to ``observe_commit``; the tap would then be unnecessary.

Published checkpoints: ``proposer.artifact`` naming a Medusa or Hydra checkpoint in its authors'
layout (a directory or a hub id; :mod:`harness.heads.published`) runs those heads with their
published forward: Medusa head ``k`` reads ``h_{t-1}`` alone and projects with its own vocabulary
head (or the target's, in the version-2 layout); grounded Hydra head ``k`` reads ``h_{t-1}`` (or
the prefix layer's output over every committed row, ``prefix-mlp``) and the embeddings of the
pending and drafted tokens, and projects with its own biased head. Their architecture comes from
the checkpoint (``proposer.num_heads`` and the Hydra++ switches are ignored); they need no
training, and their provenance (files and hashes) goes into the manifest.

Topologies: ``sequence`` (chain, depth ``min(max_depth, max_nodes, K)``), ``set`` (top-``k`` of head
1), ``expansion`` / ``cartesian`` (``widths[d]`` children per node at depth ``d``; a Cartesian
future-head tree), ``choices`` (a rank-path list such as Medusa's published ``mc_sim_7b_63``: the
rank-``r`` child of a node is the node's ``r``-th most probable token under its head, which for
Medusa's independent heads is the same list at every node of a depth). ``sampling=beam``:
deterministic top-``b_i`` per head (``score_only``; greedy or membership verification).
``sampling=iid`` / ``without_replacement``: children drawn from the head's distribution under the
run's sampling policy, each node carrying the law it was drawn from (``normalized_conditional``;
specinfer / sequoia / rejection).

Clover-2: its augmenting block is fed every committed row once, through its own KV cache, as
Hydra's published prefix layer is (the prompt's rows at the request's start, inside the prefill;
each later round the rows committed since, with the tokens after them). A round keeps a dict
prefix -> carried state: depth 1 reads ``s0``, and each deeper tree level runs one batched cell
step on ``[n, d]`` from its nodes' parents' states.

Critical path (the independent vs dependent heads latency trade-off): Medusa computes every depth in
one stage; Hydra and Clover need one stage per depth. ``stats.extras["head_stages"]`` counts the
sequential stages run. Clover also counts ``augment_passes`` (augmenting passes run in rounds; a
round's pass runs in its depth-1 stage, nothing being drafted between them; the prompt's pass is
prefill work), ``prefix_rows_fed`` (rows through the augmenting block, the prompt's included),
``cell_steps`` (batched cell steps: one per tree level below depth 1) and ``cell_rows`` (states
stepped).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from harness.contracts import Budget, ProposalResult, ProposalStateHandle
from harness.heads.artifacts import ChecksTrainingLeakage, TrainingLeakage, load_configured_heads
from harness.heads.checkpoint import ArtifactError
from harness.heads.models import vocab_projection
from harness.heads.published import check_target, inspect, is_published
from harness.heads.state import CommittedHidden, PrefixHashes
from harness.proposers.memo import memo_call
from harness.proposers.target_bound import HiddenRowProposer
from harness.random_source import RandomSource
from harness.target.backend import cache_bytes

SHAPES = frozenset({"sequence", "set", "expansion", "cartesian", "choices"})
#: the store keeps every committed row for a published prefix-mlp Hydra (its prefix layer reads them all)
EVERY_ROW = 1 << 30

__all__ = ["vocab_projection", "draft_widths", "HeadsProposer", "MedusaProposer", "HydraProposer", "CloverProposer"]


def draft_widths(budget: Budget, num_heads: int) -> tuple[int, ...]:
    """Per-depth children counts for a budget (one entry per drafted depth; a choices tree's
    widths vary by node, so only its depth is given, as ones); refuses a tree deeper than the head bank."""
    if budget.shape == "choices":
        if budget.max_depth > num_heads:
            raise ValueError(
                f"the choice list is {budget.max_depth} deep but the head bank has {num_heads} heads "
                "(one per depth); raise proposer.num_heads or use a shallower list"
            )
        return (1,) * budget.max_depth
    if budget.shape == "sequence":
        return (1,) * min(budget.max_depth, budget.max_nodes, num_heads)
    if budget.shape == "set":
        return (budget.max_nodes,)
    widths = tuple(budget.widths) or (1,) * budget.max_depth
    if len(widths) > num_heads:
        raise ValueError(
            f"topology asks for {len(widths)} draft depths (widths {list(widths)}) but the head bank "
            f"has num_heads={num_heads}; raise proposer.num_heads or shorten topology.widths"
        )
    return widths


class HeadsProposer(ChecksTrainingLeakage, HiddenRowProposer):
    """Shared machinery; subclasses only name the head kind."""

    kind: ClassVar[str] = "heads"
    shapes: ClassVar[frozenset[str]] = SHAPES
    batch_limit_reason: ClassVar[str] = (
        "the heads read the target's hidden rows through a batch-1 forward hook (HiddenTap); in a batched "
        "forward they would find no row of their own request and propose nothing"
    )

    def __init__(self, *, heads, training_leakage: TrainingLeakage | None = None, **common) -> None:
        """``heads``: the head bank; ``training_leakage``: the workload check against the text the
        heads trained on (:meth:`check_workload`); ``common``: the keywords of :class:`TargetBoundProposer`."""
        super().__init__(**common)
        self.training_leakage = training_leakage
        if heads.spec.kind != self.kind:
            raise ValueError(f"proposer {self.name!r} got a {heads.spec.kind!r} head bank")
        self.heads = heads.eval()
        if next(heads.parameters()).device != self.device:
            self.heads = heads.to(self.device)
        self.run_like_target(self.heads)
        self.spec = heads.spec
        self.widths = draft_widths(self.budget, heads.spec.num_heads)
        self.embed = self.model.get_input_embeddings()
        #: Hydra's published prefix layer or Clover-2's augmenting block: fed every committed row once,
        #: with its own KV cache
        self.prefix_feed = (
            getattr(heads, "prefix_model", None) is not None or getattr(heads, "augment", None) is not None
        )
        if self.prefix_feed:
            self.window = EVERY_ROW
        else:
            self.window = heads.spec.prefix_window if heads.spec.prefix_attention else 1
        self.store = CommittedHidden(checkpoint=self.checkpoint, dtype=str(self.dtype), keep=self.window)
        self._start_serial = -1
        self._ingested = -1
        self._prefix_cache = None
        self._prefix_fed = 0  # committed positions the prefix layer has seen
        self._prefix_out: torch.Tensor | None = None
        self._tokens: list[int] = []  # the committed tokens of the proposal under way (or the prompt at start)
        #: the most state bytes held at once (:meth:`held_state_bytes`, after each start and proposal)
        self.peak_state_bytes = 0
        self.stats.extras.update(self.counters())

    # ------------------------------------------------------------------ config
    @classmethod
    def check_options(cls, options: dict, budget: Budget) -> None:
        if not is_published(options.get("artifact")):  # a published bank's depth is checked by check_plan
            draft_widths(budget, int(options.get("num_heads", 3)))

    @classmethod
    def load_artifact(cls, options: dict, *, model: torch.nn.Module, tokenizer) -> dict:
        artifact = load_configured_heads(cls.kind, options, model=model, tokenizer=tokenizer)
        leakage = TrainingLeakage(artifact.manifest, tokenizer=tokenizer, vocab_size=model.config.vocab_size)
        return {"heads": artifact.heads, "artifact_manifest": artifact.manifest, "training_leakage": leakage}

    @classmethod
    def check_plan(cls, options: dict, budget: Budget, geometry) -> None:
        """Before any model work: a published checkpoint's layout (key for key, shape for shape),
        its fit to the target (``geometry()``: hidden size, vocabulary, attention heads) and a head
        per drafted depth. Heads trained here are checked against the target when they load."""
        ref = options.get("artifact")
        if not is_published(ref):
            return
        if cls.kind not in ("medusa", "hydra"):
            raise ArtifactError(
                f"proposer={cls.name} loads artifacts trained here only; published layouts: medusa, hydra"
            )
        switched = [k for k in ("distill", "prefix_attention") if options.get(k)]
        if switched:
            raise ArtifactError(
                f"proposer.{switched[0]}=true trains Hydra++ heads here; proposer.artifact={ref!r} is a published "
                f"bank, run as its checkpoint defines it: drop proposer.{switched[0]}"
            )
        layout = inspect(str(ref), cls.kind)
        # a chain drafts as deep as the bank reaches (as for heads trained here); other shapes name their depth
        depth = len(draft_widths(budget, layout.num_heads if budget.shape == "sequence" else 1 << 30))
        check_target(layout, geometry(), depth=depth)

    # ------------------------------------------------------------------ lifecycle
    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> None:
        """Forget the last request; a bank with a prefix layer feeds it the prompt's rows now (prefill
        work, as a draft model's prompt forward is: the first round's proposal then feeds one row)."""
        self.store.reset()
        # the prefill forward ran just before; a one-token prompt runs none, and the tap's last forward
        # (another request's, or any other caller's) is then no prefill of this request
        self._start_serial = self.tap.serial if len(prompt_ids) >= 2 else -1
        self._ingested = -1
        self._expect = None
        self._reset_prefix()
        if self.prefix_feed and len(prompt_ids) >= 2:
            self._ingest(prompt_ids)
            self._tokens = prompt_ids
            self._prefix_context(len(prompt_ids) - 2)
        self._note_state()

    def counters(self) -> dict:
        fed = {"prefix_rows_fed": 0} if "prefix_rows_fed" in self.stats.extras else {}
        return {
            "rounds": 0,
            "hidden_misses": 0,
            "head_stages": 0,
            "lm_head_rows": 0,
            "refused_reuse": 0,
            "critical_path_stages_per_round": None,
            **fed,
        }

    def finish(self) -> None:
        self.store.reset()
        self._expect = None
        self._reset_prefix()
        rounds = self.stats.extras["rounds"]
        if rounds:
            self.stats.extras["critical_path_stages_per_round"] = self.stats.extras["head_stages"] / rounds

    def state_bytes(self) -> int:
        """The peak of :meth:`held_state_bytes` over the requests so far (as a draft model reports its
        KV cache's peak): the prefix layer's cache is dropped when a request finishes."""
        return self.peak_state_bytes

    def _note_state(self) -> None:
        self.peak_state_bytes = max(self.peak_state_bytes, self.held_state_bytes())

    def held_state_bytes(self) -> int:
        """The state held now: the committed rows the heads read (their window), or a prefix layer's
        KV cache (every committed row fed so far) and the newest row."""
        d = self.spec.hidden_size
        if self.prefix_feed:  # the prefix layer's KV cache (every committed row) and the newest row
            kv = cache_bytes(self._prefix_cache) if self._prefix_cache is not None else 0
            return kv + d * torch.tensor([], dtype=self.dtype).element_size()
        return self.window * d * torch.tensor([], dtype=self.dtype).element_size()

    def _reset_prefix(self) -> None:
        self._prefix_cache = None
        self._prefix_fed = 0
        self._prefix_out = None

    # ------------------------------------------------------------------ target hidden rows
    def _ingest(self, committed: list[int]) -> None:
        """Admit the last captured target forward's rows that lie on the committed path."""

        store = self.store
        store.prefix.sync(committed)
        cap = self.tap.last
        if cap is None or cap.serial == self._ingested:
            return
        self._ingested = cap.serial
        lo = len(committed) - 1 - self.window  # only rows lo .. len - 2 (the newest `window`) matter
        before = store.refused
        # the prefill is the forward that ran just before ``start``; any later forward, even one shaped
        # like a prefill (a one-token prompt's first verify forward: the pending token alone, on an
        # empty cache), is admitted only as the verify forward of the last proposal
        if cap.serial == self._start_serial:
            if not self.is_prefill(cap):
                return
            for j, h in self.prefill_hashes(cap):
                if j >= lo:
                    store.admit(cap, j, ancestry_hash=h, generation=self._start_serial)
        elif self._expect is not None:
            verified = self._verified_tree(cap)
            if verified is None:
                return
            generation, base, tree = verified
            path = tuple(committed[len(self._expect[1]) :])  # committed since the proposal
            store.admit(cap, 0, ancestry_hash=base, generation=generation)
            for r, prefix in enumerate(tree.full_prefixes):
                # only rows on the committed path: another row's state is never asked for, and offering
                # it counted every rejected row as a refused reuse
                if int(tree.position_ids[r]) >= lo and path[: len(prefix)] == prefix:
                    store.admit(cap, 1 + r, ancestry_hash=PrefixHashes.extend(base, prefix), generation=generation)
        self.stats.extras["refused_reuse"] += store.refused - before
        store.prune(len(committed) - 2)

    # ------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        self._ingest(committed)
        self.stats.extras["rounds"] += 1
        pos = len(committed) - 2
        self._tokens = committed
        handle = ProposalStateHandle(
            owner=self.name, committed_len=len(committed), generation=self.tap.serial, kv_bytes=0
        )
        capped = self.round_max_depth() == 0  # the round commits its bonus token only: no head runs for it
        ctx = memo_call(self, "context", lambda: self._round_context(pos)) if pos >= 0 and not capped else None
        if capped:
            result = self.empty_proposal(handle)
        elif ctx is None:
            result = self._no_proposal(handle)
        else:
            result = self._fixed_tree(self._q_level(ctx, committed[-1]), self.widths, rng, handle)
        self._expect = (self.tap.serial, tuple(committed), result, self.round_max_depth())
        self._note_state()
        return result

    def _round_context(self, pos: int) -> torch.Tensor | None:
        """The heads' round context ``[1, d]`` at committed position ``pos`` (the row before the
        pending token), or None when the rows it needs are missing."""
        if self.prefix_feed:
            return self._prefix_context(pos)
        win = self.store.window(pos, self.window)
        if win is None:
            return None
        rows, mask = win
        return self.heads.context(rows[None].float(), mask[None])  # [1, d]

    def _prefix_context(self, pos: int) -> torch.Tensor | None:
        """Hydra's prefix layer (or Clover-2's augmenting block) at ``pos``: the committed rows it has
        not seen yet are fed once, in order, through its own KV cache (as Hydra's decoding does); a
        missing row stops it."""
        if pos == self._prefix_fed - 1:
            return self._prefix_out
        rows = self.store.rows
        need = range(self._prefix_fed, pos + 1)
        if pos < self._prefix_fed or any(p not in rows for p in need):
            return None
        x = torch.stack([rows[p] for p in need])  # [n, d]
        if self._prefix_cache is None:
            self._prefix_cache = self.heads.new_prefix_cache()
        out = self._feed_prefix(x, torch.arange(self._prefix_fed, pos + 1))  # [n, d]
        self._prefix_fed = pos + 1
        self._prefix_out = out[-1:]
        for p in [p for p in rows if p < pos]:  # fed: the store keeps only the newest row
            del rows[p]
        self.stats.extras["prefix_rows_fed"] = self.stats.extras.get("prefix_rows_fed", 0) + len(need)
        return self._prefix_out

    def _feed_prefix(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Committed rows ``[n, d]`` at ``positions`` through the prefix layer's cache -> ``[n, d]``."""
        return self.heads.prefix_step(rows, positions, self._prefix_cache)

    def _q_level(self, ctx: torch.Tensor, pending: int):
        """The per-level law callback for the tree samplers."""
        heads, embed, lm_head = self.heads, self.embed, self.lm_head
        extras = self.stats.extras
        cached: dict[int, torch.Tensor] = {}
        device = embed.weight.device
        probs = self._probs  # [n, V] -> [n, V]

        def q_level(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
            depth = len(prefixes[0]) + 1
            n = len(prefixes)
            if not heads.spec.dependent:
                if not cached:  # one stage: every depth from the round context at once
                    cached.update(memo_call(self, "independent", independent_stage))
                return cached[depth].expand(n, -1)

            def dependent_stage() -> torch.Tensor:
                ids = torch.tensor([(pending,) + p for p in prefixes], device=device)  # [n, depth]
                emb = embed(ids).float()  # [n, depth, d_e]
                out = heads.depth(depth, ctx.expand(n, -1), emb)  # [n, d]
                extras["head_stages"] += 1
                extras["lm_head_rows"] += n
                return probs(heads.vocab_logits([depth] * n, out, lm_head))

            return memo_call(self, tuple(prefixes), dependent_stage)

        def independent_stage() -> dict[int, torch.Tensor]:
            emb = embed(torch.tensor([[pending]], device=device)).float()  # [1, 1, d_e]
            k = min(len(self.widths), self.round_max_depth())  # the levels the round's tree is compiled to
            out = torch.cat([heads.depth(i, ctx, emb) for i in range(1, k + 1)])  # [K, d]
            logits = heads.vocab_logits(list(range(1, k + 1)), out, lm_head)  # [K, V]
            extras["head_stages"] += 1
            extras["lm_head_rows"] += k
            return {i + 1: probs(logits[i : i + 1]) for i in range(k)}

        return q_level


class MedusaProposer(HeadsProposer):
    name: ClassVar[str] = "medusa"
    kind: ClassVar[str] = "medusa"
    probability_semantics: ClassVar[str] = "score_only"
    sampling_relation: ClassVar[str] = "beam"


class HydraProposer(HeadsProposer):
    name: ClassVar[str] = "hydra"
    kind: ClassVar[str] = "hydra"
    probability_semantics: ClassVar[str] = "score_only"
    sampling_relation: ClassVar[str] = "beam"


class CloverProposer(HeadsProposer):
    """Clover-2 heads: the augmenting block's ``s0`` over the committed rows, then one cell step per
    tree level below depth 1, each node's state carried from its parent's."""

    name: ClassVar[str] = "clover"
    kind: ClassVar[str] = "clover"
    probability_semantics: ClassVar[str] = "score_only"
    sampling_relation: ClassVar[str] = "beam"

    @classmethod
    def check_options(cls, options: dict, budget: Budget) -> None:
        """Before any model work: the Hydra++ switches Clover-2 does not have are refused."""
        super().check_options(options, budget)
        switched = []
        if int(options.get("mlp_layers", 1)) != 1:
            switched.append(f"proposer.mlp_layers={options['mlp_layers']}")
        if options.get("prefix_attention"):
            switched.append("proposer.prefix_attention=true")
        if switched:
            raise ValueError(
                f"{' and '.join(switched)}: clover heads have no per-depth MLP blocks and no Hydra++ prefix layer "
                "(their augmenting block reads every committed row); these switches are Hydra's"
            )

    def counters(self) -> dict:
        return {**super().counters(), "prefix_rows_fed": 0, "augment_passes": 0, "cell_steps": 0, "cell_rows": 0}

    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> None:
        """As :meth:`HeadsProposer.start`: the prompt's rows go through the augmenting block now
        (prefill work: that pass is no round's)."""
        passes = self.stats.extras["augment_passes"]
        super().start(prompt_ids)
        self.stats.extras["augment_passes"] = passes

    def held_state_bytes(self) -> int:
        """The augmenting block's KV cache (every committed row fed so far) and the newest row."""
        kv = self._prefix_cache.nbytes() if self._prefix_cache is not None else 0
        return kv + self.spec.hidden_size * torch.tensor([], dtype=self.dtype).element_size()

    def _feed_prefix(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows ``h_p`` ``[n, d]`` with ``E(x_{p+1})``, the committed token after each (of the tokens
        the round proposes after, or the prompt's), through the augmenting block's cache -> ``s0``
        ``[n, d]``."""
        device = self.embed.weight.device
        nxt = torch.tensor([self._tokens[p + 1] for p in positions.tolist()], device=device)
        out = self.heads.prefix_step(rows.float(), positions, self._prefix_cache, self.embed(nxt).float())
        self.stats.extras["augment_passes"] += 1
        return out

    def _q_level(self, ctx: torch.Tensor, pending: int):
        """The per-level law callback: depth 1 from ``s0 = ctx`` (which has read the pending token),
        each deeper level one batched cell step from its nodes' parents' carried states."""
        heads, embed, lm_head = self.heads, self.embed, self.lm_head
        extras = self.stats.extras
        states: dict[tuple[int, ...], torch.Tensor] = {(): ctx}  # this round's prefix -> carried state [1, d]
        device = embed.weight.device
        probs = self._probs  # [n, V] -> [n, V]

        def q_level(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
            depth = len(prefixes[0]) + 1
            n = len(prefixes)

            def stage() -> tuple[torch.Tensor, dict[tuple[int, ...], torch.Tensor]]:
                if depth == 1:
                    out, new = heads.first_output(torch.cat([states[p] for p in prefixes])), {}  # [n, d]
                else:
                    missing = [p for p in prefixes if p[:-1] not in states]
                    if missing:
                        raise RuntimeError(f"clover: no carried state for the parent of {missing[0]}")
                    parent = torch.cat([states[p[:-1]] for p in prefixes])  # [n, d]
                    emb = embed(torch.tensor([p[-1] for p in prefixes], device=device)).float()  # [n, d_e]
                    s = heads.step(parent, emb)  # one batched cell step
                    out = heads.deeper_output(s, emb)
                    new = {p: s[r : r + 1] for r, p in enumerate(prefixes)}
                    extras["cell_steps"] += 1
                    extras["cell_rows"] += n
                extras["head_stages"] += 1
                extras["lm_head_rows"] += n
                return probs(heads.vocab_logits([depth] * n, out, lm_head)), new

            law, new = memo_call(self, tuple(prefixes), stage)
            states.update(new)
            return law

        return q_level
