"""From a composed config to the round's objects. Everything that can be checked without a model
(capabilities, negotiation, budgets, batch limits) is checked by :func:`plan`, before any model is
loaded; :func:`build_proposer` builds a proposer once the models are loaded and the prepare stage
(:mod:`harness.prepare`) has made its artifacts.

The registries live with their rooms: proposers in :mod:`harness.proposers.registry`, topology
budgets in :mod:`harness.topology.budgets`, verifiers in :mod:`harness.verifiers.base`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.contracts import Budget, Capabilities, ConfigError, budget_topology
from harness.engine.checks import validate_config
from harness.proposers.merged import MergedProposer
from harness.proposers.registry import proposer_class
from harness.target.loading import model_geometry
from harness.topology.budgets import TOPOLOGY_SHAPES, budget_from_config
from harness.verifiers import NegotiationError, Verifier, get_verifier, negotiate
from harness.verifiers.sampling import SamplingPolicy


def proposer_options(cfg: DictConfig) -> dict:
    opts = OmegaConf.to_container(cfg.proposer, resolve=True)
    opts.pop("name", None)
    return opts


def declared_capabilities(cfg: DictConfig, budget: Budget) -> Capabilities:
    """What the configured proposer will emit, known from config alone."""
    cls = proposer_class(cfg.proposer.name)
    return cls.declare(proposer_options(cfg), budget)


@dataclass(frozen=True)
class Plan:
    policy: SamplingPolicy
    budget: Budget
    capabilities: Capabilities
    verifier: Verifier
    baseline_verifier: Verifier
    #: what the prepare stage resolved: ``proposer_options`` (merged into the proposer's config
    #: options, e.g. an artifact path or a measured verify cost), ``artifacts``, ``metrics``, ``t_profile``
    extras: dict = field(default_factory=dict)

    def with_budget(self, budget: Budget, **extras) -> Plan:
        return replace(self, budget=budget, extras={**self.extras, **extras})

    def with_extras(self, **extras) -> Plan:
        return replace(self, extras={**self.extras, **extras})


def sampling_policy(cfg: DictConfig) -> SamplingPolicy:
    g = cfg.generation
    return SamplingPolicy(temperature=float(g.temperature), top_p=float(g.top_p), top_k=int(g.top_k))


#: topologies whose tree is calibrated first, and the proposal shape that calibration drafts
#: (harness.prepare.calibrate.measure_ranks: a set of siblings below each parent node)
CALIBRATION_SHAPES = {"sequoia": "set"}


def sibling_sampling(policy) -> str:
    """How a draft fills a set of siblings under ``policy``: its ranked top tokens (``beam``) where the
    policy is deterministic (its law is one-hot, so sampling draws the argmax and then nothing of the
    draft's), else drawn without replacement (Sequoia, Chen et al., 2024)."""
    return "beam" if policy.deterministic else "without_replacement"


def branching_samplings(cfg: DictConfig, budget: Budget, caps: Capabilities) -> list[tuple[str, frozenset[str]]]:
    """The sampling relations of the drafts that draw several children below a parent under
    ``budget`` (a shape other than ``sequence``), each with the option that sets it: the proposer's
    own (``proposer.sampling``), or, under ``proposer=merged``, those of its sources that branch
    (``proposer.<source>.sampling``). A sampled draft given neither widths nor a tree shape draws
    one child per level (a draft model's width-less ``tree``, a head or EAGLE draft's ``sequence``),
    and a merged source's sub-budget (:func:`~harness.proposers.merged.sub_budget`) holds neither:
    at temperature 0 its ``iid`` chain is the argmax chain ``beam`` drafts, so it is not listed."""
    if cfg.proposer.name != "merged":
        return [("proposer.sampling", caps.sampling_relations)]
    out = []
    for name, sub_cls, sub, sub_b in MergedProposer._source_entries(proposer_options(cfg), budget):
        if not sub_b.widths and not sub_b.parents:
            continue  # a sampled draft draws one chain here
        out.append((f"proposer.{name}.sampling", sub_cls.declare(sub, sub_b).sampling_relations))
    return out


def plan(cfg: DictConfig) -> Plan:
    """Check every value (:func:`~harness.engine.checks.validate_config`), then negotiate proposer x
    topology x verifier x temperature; raise before any model work.

    A proposer class may define ``check_plan(options, budget, geometry)`` for checks that need the
    target's shape but no weights (``geometry()``: :func:`harness.target.loading.model_geometry`)."""
    validate_config(cfg)
    policy = sampling_policy(cfg)
    budget = budget_from_config(cfg)
    verifier = get_verifier(cfg.verifier.name)
    cls = proposer_class(cfg.proposer.name)
    if budget.shape not in cls.shapes:

        def fits_verifier(shape: str) -> bool:
            try:
                return budget_topology(replace(budget, shape=shape)) in verifier.topologies
            except ValueError:  # a shape this budget cannot describe (dynamic without topk): offered anyway
                return True  # (a fix offered is composed and planned first; one that is refused is dropped)

        fits = [
            name
            for name, shape in TOPOLOGY_SHAPES.items()
            if shape in cls.shapes and fits_verifier(shape) and CALIBRATION_SHAPES.get(name, shape) in cls.shapes
        ]
        raise NegotiationError(
            f"proposer={cfg.proposer.name} cannot build topology={cfg.topology.name} (shape {budget.shape!r}); "
            f"it builds {sorted(cls.shapes)}",
            suggestions=[(f"topology={name}",) for name in fits],
        )
    needs = CALIBRATION_SHAPES.get(str(cfg.topology.name))
    if needs is not None and needs not in cls.shapes:
        raise NegotiationError(
            f"proposer={cfg.proposer.name} cannot be calibrated for topology={cfg.topology.name}: the calibration "
            f"drafts a {needs} of sibling candidates below each parent to measure acceptance by sibling rank "
            f"(Sequoia, Chen et al., 2024), and proposer={cfg.proposer.name} builds only {sorted(cls.shapes)}",
            suggestions=[("proposer=draft_model", f"proposer.sampling={sibling_sampling(policy)}")],
        )
    caps = declared_capabilities(cfg, budget)
    negotiate(caps, verifier, temperature=policy.temperature, exact_mode=bool(cfg.generation.exact))
    if policy.deterministic and budget.shape != "sequence":
        when = "at temperature 0" if policy.greedy else "with generation.top_k=1"
        for key, relations in branching_samplings(cfg, budget, caps):
            if "iid" in relations:
                raise ConfigError(
                    f"{key}=iid {when} draws the draft's argmax for every child: a "
                    f"topology={cfg.topology.name} tree would collapse into one chain while its records named the tree",
                    suggestions=[(f"{key}=beam",)],
                )
            if "without_replacement" in relations:
                raise ConfigError(
                    f"{key}=without_replacement {when} draws the draft's argmax first and then, its law "
                    f"holding no other mass, tokens uniformly from the vocabulary: a topology={cfg.topology.name} "
                    "tree's siblings would be random tokens while its records named the tree (the draft's ranked "
                    f"top tokens are {key}=beam)",
                    suggestions=[(f"{key}=beam",)],
                )
    batch = int(cfg.generation.batch_size)
    check = getattr(cls, "check_plan", None)
    if check is not None:  # e.g. a published head checkpoint against the target's geometry
        check(proposer_options(cfg), budget, lambda: model_geometry(cfg.model))
    limit, why = cls.batch_limit(proposer_options(cfg), budget)
    if limit is not None and batch > limit:
        raise ConfigError(
            f"proposer={cfg.proposer.name} serves generation.batch_size <= {limit}; got {batch}: {why}",
            suggestions=[(f"generation.batch_size={limit}",)],
        )
    baseline = get_verifier("greedy" if policy.greedy else "membership")
    return Plan(policy=policy, budget=budget, capabilities=caps, verifier=verifier, baseline_verifier=baseline)


@dataclass
class BuildContext:
    """What a proposer (and a preparer) may need once models are loaded."""

    cfg: DictConfig
    target_backend: Any  # CausalLMBackend of the target
    tokenizer: Any
    draft_backend: Any = None  # CausalLMBackend of a separate draft model (proposer.model)
    items: list = field(default_factory=list)  # [(Prompt, token ids)] of the workload
    model_source: str = ""
    #: read-only objects the proposers of one run share (one per key), e.g. a REST datastore opened
    #: once for every batch slot rather than once per slot
    shared: dict = field(default_factory=dict)


def merge_options(options: dict, overrides: dict) -> dict:
    """``options`` with ``overrides`` merged in, nested dicts merged key by key."""
    out = dict(options)
    for k, v in overrides.items():
        out[k] = merge_options(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_proposer(cfg: DictConfig, plan_: Plan, *, manifest_hash: str, context: BuildContext):
    """The configured proposer, with what the prepare stage resolved merged into its options."""
    cls = proposer_class(cfg.proposer.name)
    return cls.from_config(
        options=merge_options(proposer_options(cfg), plan_.extras.get("proposer_options", {})),
        budget=plan_.budget,
        manifest_hash=manifest_hash,
        policy=plan_.policy,
        context=context,
    )
