"""Self-speculation: draft with part of the target.

- ``proposer=early_exit`` (Kangaroo, Liu et al., 2024): the target's first ``l`` decoder layers
  (shared modules), a trained adapter (attention + two norms, no FFN) and the shared LM head.
  Drafting stops when the top-1 confidence ``max_v M_s`` falls to ``eta`` or below.
- ``proposer=layer_skip`` (Draft & Verify, Zhang et al., 2024): the target with the layers of a
  skip vector ``z`` bypassed (final norm and LM head kept). ``z`` comes from a Bayesian-optimisation
  search artifact (``harness train proposer=layer_skip``) or ``proposer.skip``. Drafting stops when
  the top-1 probability falls to ``gamma`` or below, which Draft & Verify's acceptance-EMA loop adapts.

Self-draft state contract: the draft path keeps its own
:class:`~harness.heads.partial.ProvisionalKV` (shallow / skipped-path rows only). It never reads or
writes the target backend's cache, so no skipped-path or adapter row can be published as target
KV. Its own rows for accepted tokens are reused next round only where the per-row tag passes
``may_reuse`` against the committed path (same checkpoint, layer boundary, token, position,
ancestry hash, dtype); everything after the first refused row is recomputed.

Chains only (``topology=sequence``); ``sampling=beam`` (greedy top-1, ``score_only``) or ``iid``
(each token drawn from the draft's policy distribution, which it carries as ``q``). The confidence
stop depends only on tokens already drawn, so the chain length is a stopping time of the draft
process and the p/q verifiers stay exact.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from harness.contracts import Budget, ConfigError, ProposalNode, ProposalResult, ProposalStateHandle
from harness.heads.artifacts import ChecksTrainingLeakage, TrainingLeakage, load_adapter, load_skip
from harness.heads.partial import PartialPath, ProvisionalKV, causal_rows_mask
from harness.heads.state import PrefixHashes
from harness.proposers.memo import memo_call
from harness.proposers.sampling import sample_children
from harness.proposers.target_bound import TargetBoundProposer
from harness.random_source import RandomSource

SAMPLINGS = ("beam", "iid")


class SelfSpecProposer(TargetBoundProposer):
    shapes: ClassVar[frozenset[str]] = frozenset({"sequence"})
    samplings: ClassVar[tuple[str, ...]] = SAMPLINGS
    samplings_note: ClassVar[str] = " (chains)"
    shape_refusal: ClassVar[str] = "proposer={name} drafts chains only (topology=sequence); got {shape!r}"
    boundary: str = "self"

    def __init__(self, **common) -> None:
        """``common``: the keywords of :class:`TargetBoundProposer`."""
        super().__init__(**common)
        self.depth = min(self.budget.max_depth, self.budget.max_nodes)
        self.kv = self._new_kv()
        self.hashes = PrefixHashes()
        self.peak_state_bytes = 0
        self._last: tuple[int, list[int]] | None = None
        self.stats.extras.update(self.counters())

    def counters(self) -> dict:
        return {
            "rounds": 0,
            "drafted": 0,
            "confidence_stops": 0,
            "reused_rows": 0,
            "recomputed_rows": 0,
            "draft_forwards": 0,
        }

    # ------------------------------------------------------------------ subclass hooks
    def _forward(
        self, ids: list[int], positions: list[int], mask: torch.Tensor, *, logits: bool = True
    ) -> torch.Tensor | None:
        """Run the draft path over new rows (appending their rows to ``self.kv``); the logits
        ``[1, V]`` of the last row, the only one a round reads (the LM head runs on that row alone),
        or None with ``logits=False`` (no LM head: the rows are only cached)."""
        raise NotImplementedError

    def threshold(self) -> float:
        raise NotImplementedError

    def observe_round(self, drafted: int, accepted: int) -> None:
        """Acceptance feedback of the previous round (default: none)."""

    # ------------------------------------------------------------------ lifecycle
    def _new_kv(self) -> ProvisionalKV:
        return ProvisionalKV(checkpoint=self.checkpoint, boundary=self.boundary, dtype=str(self.dtype))

    def start(self, prompt_ids: list[int]) -> None:
        self.kv = self._new_kv()
        self.hashes = PrefixHashes()
        self._last = None
        if len(prompt_ids) > 1:  # like a draft model: the prompt is processed with the prefill
            self.hashes.sync(prompt_ids)
            self._extend(list(prompt_ids[:-1]), 0, logits=False)  # its rows only: nothing reads their logits

    def finish(self) -> None:
        self.kv = self._new_kv()
        self._last = None

    def state_bytes(self) -> int:
        return self.peak_state_bytes

    def _extend(self, ids: list[int], start: int, *, logits: bool = True) -> torch.Tensor | None:
        """Append the draft path's rows of ``ids`` (at positions from ``start``); the last row's
        logits ``[1, V]``, or None with ``logits=False``."""
        positions = list(range(start, start + len(ids)))
        key = (start, tuple(ids)) if logits else (start, tuple(ids), "rows only")
        with torch.inference_mode():
            mask = causal_rows_mask(len(self.kv), len(ids))
            out = memo_call(self, key, lambda: self._forward(ids, positions, mask, logits=logits), self.kv)
        self.kv.tag_rows(ids, positions, [self.hashes.at(p) for p in positions])
        self.stats.extras["draft_forwards"] += 1
        return out

    # ------------------------------------------------------------------ proposing
    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        extras = self.stats.extras
        extras["rounds"] += 1
        self.hashes.sync(committed)
        if self._last is not None:
            old_len, drafted = self._last
            new = committed[old_len:]
            if new:  # the previous round committed (the statistical gate re-proposes in place)
                acc = 0
                while acc < min(len(drafted), len(new) - 1) and drafted[acc] == new[acc]:
                    acc += 1
                self.observe_round(len(drafted), acc)
        # roll the provisional cache back to the rows that pass may_reuse against the committed path
        keep = self.kv.reusable_prefix(committed, self.hashes, limit=len(committed) - 1)
        extras["recomputed_rows"] += max(len(self.kv) - keep, 0)
        extras["reused_rows"] += keep
        self.kv.keep(range(keep))
        nodes: list[ProposalNode] = []
        laws: list[torch.Tensor] = []
        threshold = self.threshold()
        depth = min(self.depth, self.round_max_depth())
        if depth:  # a round that commits its bonus token only pays no draft forward
            logits = self._extend(committed[keep:], keep)[-1]  # [V]: predicts the first draft token
        for j in range(depth):
            conf = torch.softmax(logits.float(), dim=-1)  # [V]
            top = float(conf.max())
            if top <= threshold:
                extras["confidence_stops"] += 1
                break
            if self.sampling == "beam":
                tok = sample_children(conf, 1, relation="beam", rng=rng)[0][0]
                nodes.append(ProposalNode(token_id=tok, parent=j - 1, score=top, source=self.name))
            else:
                q = self.policy.probs(logits[None], dtype=torch.float32)[0]  # [V]
                tok, law = sample_children(q, 1, relation="iid", rng=rng)[0]
                nodes.append(ProposalNode(token_id=tok, parent=j - 1, q=float(law[tok]), source=self.name))
                laws.append(law)
            if j + 1 < depth:  # the last draft token needs no forward: nothing follows it
                self.hashes.sync(committed + [n.token_id for n in nodes])
                logits = self._extend([tok], len(committed) + j)[-1]
        self.hashes.sync(committed)
        extras["drafted"] += len(nodes)
        self.peak_state_bytes = max(self.peak_state_bytes, self.kv.nbytes())
        self._last = (len(committed), [n.token_id for n in nodes])
        handle = ProposalStateHandle(
            owner=self.name, committed_len=len(committed), generation=self.kv.generation, kv_bytes=self.kv.nbytes()
        )
        return ProposalResult(
            nodes=tuple(nodes),
            probability_semantics=self.probability_semantics,
            sampling_relation=self.sampling_relation,
            topology="sequence",
            state_handle=handle,
            manifest_hash=self.manifest_hash,
            q_dists=torch.stack(laws) if laws else None,
            source=self.name,
        )


class EarlyExitProposer(ChecksTrainingLeakage, SelfSpecProposer):
    """Kangaroo: layers ``[0, l)`` + adapter + shared LM head; stop at confidence ``<= eta``."""

    name: ClassVar[str] = "early_exit"

    def __init__(
        self,
        *,
        checkpoint: str,
        adapter,
        exit_layer: int,
        eta: float = 0.5,
        artifact_manifest=None,
        training_leakage: TrainingLeakage | None = None,
        **common,
    ) -> None:
        """The adapter's artifact id joins the checkpoint its draft rows are tagged with;
        ``training_leakage``: the workload check against the text the adapter trained on
        (:meth:`check_workload`)."""
        if not 0.0 <= eta < 1.0:
            raise ValueError(f"proposer.eta must be in [0, 1); got {eta}")
        self.boundary = f"layers<{int(exit_layer)}+adapter"
        super().__init__(
            checkpoint=f"{checkpoint}+{(artifact_manifest or {}).get('artifact_id', 'untrained')}",
            artifact_manifest=artifact_manifest,
            **common,
        )
        self.path = PartialPath(self.model, range(int(exit_layer)))
        self.adapter = adapter.eval()
        self.exit_layer = int(exit_layer)
        self.eta = float(eta)
        self.training_leakage = training_leakage

    @classmethod
    def check_plan(cls, options: dict, budget: Budget, geometry) -> None:
        """Before any model work: the exit layer of an adapter trained here lies inside the target
        (``geometry()``: its layer count); a given artifact carries its own."""
        if options.get("artifact"):
            return
        layers = int(geometry()["num_hidden_layers"])
        exit_layer = int(options.get("exit_layer", 2))
        if not 1 <= exit_layer < layers:
            raise ConfigError(
                f"proposer.exit_layer must be in [1, {layers - 1}] for this {layers}-layer target; got {exit_layer}",
                suggestions=[(f"proposer.exit_layer={min(max(1, layers // 2), layers - 1)}",)] if layers > 1 else [],
            )

    @classmethod
    def load_artifact(cls, options: dict, *, model: torch.nn.Module, tokenizer) -> dict:
        art = load_adapter(options, model=model, tokenizer=tokenizer)
        return {
            "adapter": art.adapter,
            "exit_layer": int(art.manifest["recipe"]["exit_layer"]),
            "eta": float(options.get("eta", 0.5)),
            "artifact_manifest": art.manifest,
            "training_leakage": TrainingLeakage(art.manifest, tokenizer=tokenizer, vocab_size=model.config.vocab_size),
        }

    def threshold(self) -> float:
        return self.eta

    def _forward(self, ids, positions, mask, *, logits=True):
        h = self.path.run(self.path.embed(ids), positions, mask, self.kv)  # [1, R, d] shallow features F_l
        pos = torch.as_tensor(positions, dtype=torch.long, device=h.device)[None]
        rope = self.path.base.rotary_emb(h, position_ids=pos)
        # the adapter's attention runs over every row: it appends each row's keys and values to the cache
        y = self.adapter(h, rope=rope, mask=self.path.additive_mask(mask), cache=self.kv)  # [1, R, d]
        return self.lm_head(y[:, -1:])[0] if logits else None  # [1, V]


class LayerSkipProposer(SelfSpecProposer):
    """Draft & Verify: the target with the layers in ``skip`` bypassed; dynamic threshold ``gamma``."""

    name: ClassVar[str] = "layer_skip"

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        skip: list[int],
        gamma: float = 0.4,
        adaptive: bool = True,
        beta1: float = 0.5,
        beta2: float = 0.9,
        epsilon: float = 0.05,
        target_acceptance: float = 0.7,
        **common,
    ) -> None:
        layers = int(model.config.num_hidden_layers)
        skip = sorted({int(i) for i in skip})
        if any(not 0 <= i < layers for i in skip):
            raise ValueError(f"proposer.skip must list layer indices in [0, {layers}); got {skip}")
        if len(skip) == layers:
            raise ValueError(
                f"the skip vector {skip} bypasses all {layers} layers: the draft would run no decoder layer"
            )
        self.skip = skip
        self.boundary = "skip:" + ",".join(map(str, skip))
        super().__init__(model=model, **common)
        self.path = PartialPath(model, [i for i in range(layers) if i not in set(skip)])
        self.norm = model.base_model.norm
        # the bounds of SkipThresholdConfig: drafting stays possible and observe_round can move gamma both ways
        for name, v, ok, bounds in (
            ("gamma", gamma, 0.0 <= gamma < 1.0, "in [0, 1)"),
            ("target_acceptance", target_acceptance, 0.0 < target_acceptance < 1.0, "in (0, 1)"),
            ("beta1", beta1, 0.0 <= beta1 < 1.0, "in [0, 1)"),
            ("beta2", beta2, 0.0 <= beta2 < 1.0, "in [0, 1)"),
            ("epsilon", epsilon, 0.0 < epsilon <= 1.0, "in (0, 1]"),
        ):
            if not ok:
                raise ValueError(f"proposer.threshold.{name} must be {bounds}; got {v}")
        self.gamma = float(gamma)
        self.adaptive = bool(adaptive)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        self.target_acceptance = float(target_acceptance)
        self.acceptance_ema: float | None = None
        self.stats.extras.update({"skip": skip, "final_gamma": self.gamma})  # the threshold as it stands

    @classmethod
    def check_plan(cls, options: dict, budget: Budget, geometry) -> None:
        """Before any model work: ``proposer.skip`` and ``proposer.artifact`` each name the skip
        vector (one of them, not both), and an explicit vector lists each of the target's layers
        at most once (``geometry()``: its layer count)."""
        skip = options.get("skip")
        if skip is None:
            return
        if options.get("artifact"):
            raise ConfigError(
                f"proposer.skip={list(skip)} and proposer.artifact={options['artifact']} both name the skip vector: "
                "give one (the artifact's search result, or the layers to skip)",
                suggestions=[("proposer.artifact=null",), ("proposer.skip=null",)],
            )
        layers = int(geometry()["num_hidden_layers"])
        seen = [int(i) for i in skip]
        repeated = sorted({i for i in seen if seen.count(i) > 1})
        if repeated:
            unique = sorted(set(seen))
            raise ConfigError(
                f"proposer.skip lists layer(s) {repeated} more than once: list each layer once",
                suggestions=[(f"proposer.skip=[{','.join(map(str, unique))}]",)],
            )
        outside = [i for i in seen if not 0 <= i < layers]
        if outside:
            raise ConfigError(
                f"proposer.skip lists {outside}, outside this {layers}-layer target's layers [0, {layers - 1}]"
            )
        if len(set(seen)) == layers:
            raise ConfigError(
                f"proposer.skip lists all {layers} layers of the target: the draft would run no decoder layer "
                f"(embedding, final norm and LM head only); skip at most {layers - 1}"
            )

    @classmethod
    def load_artifact(cls, options: dict, *, model: torch.nn.Module, tokenizer) -> dict:
        skip, manifest = load_skip(options, model=model, tokenizer=tokenizer)
        return {"skip": skip, "artifact_manifest": manifest, **dict(options.get("threshold") or {})}

    LEARNING = ("gamma", "acceptance_ema")

    def restore_learning(self, snapshot: dict) -> None:
        super().restore_learning(snapshot)
        self.stats.extras["final_gamma"] = self.gamma

    def threshold(self) -> float:
        return self.gamma

    def observe_round(self, drafted: int, accepted: int) -> None:
        """Draft & Verify's loop: acceptance EMA -> threshold candidate -> smoothed gamma (heuristic).

        A round that drafted nothing rejected nothing and counts as acceptance 1, so a threshold
        set too high decays until drafting resumes (otherwise the loop would never see a draft)."""
        if not self.adaptive:
            return
        rate = accepted / drafted if drafted else 1.0
        ema = rate if self.acceptance_ema is None else self.beta1 * self.acceptance_ema + (1 - self.beta1) * rate
        self.acceptance_ema = ema
        candidate = self.gamma + self.epsilon if ema <= self.target_acceptance else self.gamma - self.epsilon
        self.gamma = min(max(self.beta2 * self.gamma + (1 - self.beta2) * candidate, 0.0), 1.0)
        self.stats.extras["final_gamma"] = self.gamma

    def _forward(self, ids, positions, mask, *, logits=True):
        h = self.path.run(self.path.embed(ids), positions, mask, self.kv)  # [1, R, d]
        return self.lm_head(self.norm(h[:, -1:]))[0] if logits else None  # [1, V]: final norm + LM head, last row
