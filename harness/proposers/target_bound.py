"""Proposers built on the loaded target model plus an artifact made for it: draft heads and EAGLE
(:class:`HiddenRowProposer`: they read the target's hidden rows) and self-speculation (it runs part
of the target's own layers).

:class:`TargetBoundProposer` holds what they share: the sampling relation and the evidence it
gives, the target's device, dtype and LM head, the artifact's manifest and CPU-budget label,
negotiation (``declare``) and construction from config (``from_config``: the target model and
fingerprint, then the subclass's :meth:`~TargetBoundProposer.load_artifact`).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from harness.contracts import Budget, Capabilities, ProposalResult, ProposalStateHandle
from harness.heads.checkpoint import cpu_budget_label, target_fingerprint
from harness.heads.state import CapturedForward, HiddenTap, PrefixHashes
from harness.proposers.base import Proposer
from harness.proposers.sampling import QLevelFn, check_ranked_shape, sample_ranked_tree_proposal, sample_tree_proposal
from harness.random_source import RandomSource
from harness.target.options import apply_linear_kernel, linear_kernel_of
from harness.topology.compiler import CompiledTree, compile_tree

SAMPLINGS = ("beam", "iid", "without_replacement")


class TargetBoundProposer(Proposer):
    """Shared construction and negotiation; subclasses load their artifact and draft."""

    probability_semantics: ClassVar[str] = "score_only"
    sampling_relation: ClassVar[str] = "beam"
    #: the sampling relations this proposer draws with (``beam``: deterministic top-k, ``score_only``)
    samplings: ClassVar[tuple[str, ...]] = SAMPLINGS
    #: said after the relations when a sampling is refused (why this proposer offers fewer)
    samplings_note: ClassVar[str] = ""
    #: the refusal of a topology this proposer cannot build
    shape_refusal: ClassVar[str] = "proposer={name} builds {shapes}; got topology {shape!r}"

    def __init__(
        self,
        *,
        budget: Budget,
        manifest_hash: str,
        policy,
        model: torch.nn.Module,
        checkpoint: str,
        sampling: str = "beam",
        artifact_manifest: dict | None = None,
    ) -> None:
        super().__init__(budget=budget, manifest_hash=manifest_hash, policy=policy)
        self.probability_semantics = self.sampling_semantics(sampling)
        self.sampling = sampling
        self.sampling_relation = sampling
        if budget.shape == "choices":
            check_ranked_shape(budget.parents, budget.ranks, sampling)
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.lm_head = model.get_output_embeddings()
        self.checkpoint = checkpoint
        self.artifact_manifest = dict(artifact_manifest or {})
        #: read by the runner: from what the artifact recorded about its training (never the device)
        self.cpu_budget_artifact = cpu_budget_label(self.artifact_manifest)

    def run_like_target(self, network: torch.nn.Module) -> torch.nn.Module:
        """``network`` (a head bank, a draft network) with its linear layers on the target's linear
        kernel where the target runs one of the harness's (``model.linear_kernel``): its few-row
        products read each weight row once, as the target's do, instead of BLAS's few-row path. A
        forward that needs gradients (training) still takes autograd's own linear."""
        kernels = linear_kernel_of(self.model) - {"default"}
        if kernels:
            apply_linear_kernel(network, kernels.pop() if len(kernels) == 1 else "auto")
        return network

    @classmethod
    def sampling_semantics(cls, sampling: str) -> str:
        """The evidence a sampling relation gives: ``score_only`` for ``beam`` (ranks, no law),
        else ``normalized_conditional`` (each draw records its law); refuses one not offered."""
        if sampling not in cls.samplings:
            raise ValueError(
                f"proposer.sampling must be one of {list(cls.samplings)}{cls.samplings_note}; got {sampling!r}"
            )
        return "score_only" if sampling == "beam" else "normalized_conditional"

    # ------------------------------------------------------------------ config
    @classmethod
    def declare(cls, options: dict, budget: Budget) -> Capabilities:
        if budget.shape not in cls.shapes:
            raise ValueError(cls.shape_refusal.format(name=cls.name, shapes=sorted(cls.shapes), shape=budget.shape))
        sampling = str(options.get("sampling", "beam"))
        semantics = cls.sampling_semantics(sampling)
        if budget.shape == "choices":
            check_ranked_shape(budget.parents, budget.ranks, sampling)
        artifact = options.get("artifact")
        if artifact and Path(str(artifact)).expanduser().is_file():  # read as a missing folder before
            folder = Path(str(artifact)).expanduser().parent
            # the folder is suggested only where it looks like one (an artifact's manifest, a checkpoint's config)
            hint = (
                f"give the one that holds it (proposer.artifact={folder})"
                if any((folder / name).is_file() for name in ("manifest.json", "config.json"))
                else f"the folder holding it ({folder}) is no artifact or checkpoint either"
            )
            raise ValueError(
                f"proposer.artifact={artifact} is a file; an artifact or a published checkpoint is a folder: {hint}"
            )
        cls.check_options(options, budget)
        return cls.capabilities_on(budget, {semantics}, {sampling})

    @classmethod
    def check_options(cls, options: dict, budget: Budget) -> None:
        """Further config checks before any model work (default: none)."""

    @classmethod
    def from_config(cls, *, options: dict, budget: Budget, manifest_hash: str, policy, context):
        model = context.target_backend.model
        artifact = cls.load_artifact(options, model=model, tokenizer=context.tokenizer)
        return cls(
            budget=budget,
            manifest_hash=manifest_hash,
            policy=policy,
            model=model,
            checkpoint=target_fingerprint(model, context.tokenizer),
            sampling=str(options.get("sampling", "beam")),
            **artifact,
        )

    @classmethod
    def load_artifact(cls, options: dict, *, model: torch.nn.Module, tokenizer) -> dict:
        """The constructor's keywords that come from this proposer's artifact and own options
        (the draft network, its manifest, its settings)."""
        raise NotImplementedError


class HiddenRowProposer(TargetBoundProposer):
    """A proposer that drafts from the target's hidden rows, observed through the shared
    :class:`~harness.heads.state.HiddenTap` (batch-1 forwards only) and admitted through the
    ``may_reuse`` state check; a round whose rows are missing proposes nothing."""

    max_batch_size: ClassVar[int | None] = 1

    def __init__(self, **common) -> None:
        super().__init__(**common)
        self.tap = HiddenTap.on(self.model)
        # (tap serial, committed, proposal, the depth the round loop compiles it to)
        self._expect: tuple[int, tuple[int, ...], ProposalResult, int] | None = None

    def target_unhooked(self):
        """The target without the shared tap's hooks (:meth:`HiddenTap.suspended`)."""
        return HiddenTap.suspended(self.model)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's law ``[n, V]`` of logits ``[n, V]``: its own softmax for ``beam`` (ranking
        only), else the run's sampling policy."""
        if self.sampling == "beam":
            return torch.softmax(logits.float(), dim=-1)
        return self.policy.probs(logits, dtype=torch.float32)

    def _no_proposal(self, handle: ProposalStateHandle) -> ProposalResult:
        """The empty round of a missing hidden row (counted in ``hidden_misses``)."""
        self.stats.extras["hidden_misses"] += 1
        return self.empty_proposal(handle)

    def _fixed_tree(
        self, q_level: QLevelFn, widths: tuple[int, ...], rng: RandomSource, handle: ProposalStateHandle
    ) -> ProposalResult:
        """A fixed-shape tree (``widths`` per depth, or the budget's choice list) drawn level by
        level from ``q_level``: the shape is cut to its first ``max_nodes`` nodes before anything
        is drawn, so no draft stage runs for a level the round cannot keep."""
        common = dict(
            relation=self.sampling,
            rng=rng,
            source=self.name,
            manifest_hash=self.manifest_hash,
            max_depth=self.depth_cap,
            max_nodes=self.budget.max_nodes,
        )
        if self.budget.shape == "choices":
            return sample_ranked_tree_proposal(
                q_level, parents=self.budget.parents, ranks=self.budget.ranks, state_handle=handle, **common
            )
        return sample_tree_proposal(q_level, widths=widths, state_handle=handle, **common)

    # ------------------------------------------------------------------ target rows
    @staticmethod
    def is_prefill(cap: CapturedForward) -> bool:
        """A plain causal forward from position 0 (the prefill): row ``j``'s ancestry is the
        forward's ids up to ``j``."""
        return not cap.custom_mask and cap.cache_len == 0 and cap.positions == tuple(range(len(cap.input_ids)))

    @staticmethod
    def prefill_hashes(cap: CapturedForward):
        """``(j, ancestry hash of ids[: j + 1])`` for each row of a prefill capture."""
        h = 0
        for j, tok in enumerate(cap.input_ids):
            h = PrefixHashes.extend(h, (tok,))
            yield j, h

    def _verified_tree(self, cap: CapturedForward | None) -> tuple[int, int, CompiledTree] | None:
        """``(generation, ancestry hash of the committed path, tree)`` when ``cap`` is the verify
        forward of the last proposal (the next forward, over the pending token and the proposed
        tree, on the proposing round's cache); None otherwise. Row ``0`` of the capture is the
        pending token, row ``1 + r`` the tree's row ``r``."""
        if cap is None or self._expect is None:
            return None
        serial, old, proposal, depth = self._expect
        if cap.serial != serial + 1 or cap.cache_len != len(old) - 1:
            return None
        tree = compile_tree([proposal], prefix_len=len(old), max_nodes=self.budget.max_nodes, max_depth=depth)
        if cap.input_ids != (old[-1],) + tuple(tree.token_ids.tolist()):
            return None
        return serial + 1, PrefixHashes.extend(0, old), tree
