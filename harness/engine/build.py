"""From a composed config to the round's objects. Everything that can be checked without a
model (capabilities, negotiation, budgets) is checked here, before any model is loaded.

Two registries keep the rooms pluggable:

- ``PROPOSERS``: proposer name -> ``"module:Class"``. The class implements
  ``declare(options, budget) -> Capabilities`` (classmethod, no model work) and
  ``from_config(*, options, budget, manifest_hash, policy, context) -> Proposer`` (classmethod).
- ``TOPOLOGIES``: topology name -> ``"module:function"`` with ``function(topology_cfg) -> Budget``.
  ``TOPOLOGY_PREPARERS`` (optional, name -> ``"module:function"``) run after the models are loaded
  and before the gates, ``function(cfg, plan, context) -> Plan`` (e.g. Sequoia calibration).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.proposers.base import Budget
from harness.verifiers import Capabilities, Verifier, get_verifier, negotiate
from harness.verifiers.sampling import SamplingPolicy

PROPOSERS: dict[str, str] = {
    "prompt_lookup": "harness.proposers.prompt_lookup:PromptLookupProposer",
    "draft_model": "harness.proposers.draft_model:DraftModelProposer",
    "rest": "harness.proposers.rest:RestProposer",
    "merged": "harness.proposers.merged:MergedProposer",
    "medusa": "harness.proposers.heads:MedusaProposer",
    "hydra": "harness.proposers.heads:HydraProposer",
    "clover": "harness.proposers.heads:CloverProposer",
    "early_exit": "harness.proposers.selfspec:EarlyExitProposer",
    "layer_skip": "harness.proposers.selfspec:LayerSkipProposer",
}

TOPOLOGIES: dict[str, str] = {
    "sequence": "harness.engine.build:chain_budget",
    "sequences": "harness.engine.build:chain_budget",
    "set": "harness.engine.build:set_budget",
    "expansion": "harness.engine.build:expansion_budget",
    "merged": "harness.engine.build:chain_budget",  # a node/depth budget for proposer=merged
    "sequoia": "harness.topology.sequoia_artifact:placeholder_budget",
    "cartesian": "harness.heads.cartesian:cartesian_budget",
}

TOPOLOGY_PREPARERS: dict[str, str] = {
    "sequoia": "harness.topology.sequoia_artifact:prepare_sequoia",
}


class ConfigError(ValueError):
    pass


def resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


# --------------------------------------------------------------------------- topologies


def chain_budget(t: DictConfig) -> Budget:
    return Budget(shape=t.name, max_nodes=t.max_nodes, max_depth=t.max_depth)


def set_budget(t: DictConfig) -> Budget:
    return Budget(shape="set", max_nodes=t.max_nodes, max_depth=1, widths=(t.max_nodes,))


def expansion_budget(t: DictConfig) -> Budget:
    widths = tuple(int(w) for w in t.widths)
    if not widths:
        raise ConfigError("topology=expansion needs topology.widths, e.g. [2,2,1]")
    if len(widths) > t.max_depth:
        raise ConfigError(f"topology.widths has {len(widths)} levels, over topology.max_depth={t.max_depth}")
    return Budget(shape="expansion", max_nodes=t.max_nodes, max_depth=len(widths), widths=widths)


def budget_from_config(cfg: DictConfig) -> Budget:
    name = cfg.topology.name
    if name not in TOPOLOGIES:
        raise ConfigError(f"unknown topology {name!r}; one of {sorted(TOPOLOGIES)}")
    return resolve(TOPOLOGIES[name])(cfg.topology)


# --------------------------------------------------------------------------- proposers


def proposer_class(name: str):
    if name not in PROPOSERS:
        raise ConfigError(f"unknown proposer {name!r}; one of {sorted(PROPOSERS)}")
    return resolve(PROPOSERS[name])


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
    extras: dict = field(default_factory=dict)  # e.g. the tree artifact a preparer resolved

    def with_budget(self, budget: Budget, **extras) -> Plan:
        return replace(self, budget=budget, extras={**self.extras, **extras})


def sampling_policy(cfg: DictConfig) -> SamplingPolicy:
    g = cfg.generation
    return SamplingPolicy(temperature=float(g.temperature), top_p=float(g.top_p), top_k=int(g.top_k))


def plan(cfg: DictConfig) -> Plan:
    """Negotiate proposer x topology x verifier x temperature; raise before any model work."""
    policy = sampling_policy(cfg)
    budget = budget_from_config(cfg)
    caps = declared_capabilities(cfg, budget)
    verifier = get_verifier(cfg.verifier.name)
    negotiate(caps, verifier, temperature=policy.temperature, exact_mode=bool(cfg.generation.exact))
    batch = int(cfg.generation.batch_size)
    if batch < 1:  # B > 1 runs through harness/engine/batched.py
        raise ConfigError(f"generation.batch_size must be >= 1; got {cfg.generation.batch_size}")
    cls = proposer_class(cfg.proposer.name)
    if cls.max_batch_size is not None and batch > cls.max_batch_size:
        raise ConfigError(
            f"proposer={cfg.proposer.name} serves generation.batch_size <= {cls.max_batch_size}; "
            f"got {batch}: {cls.batch_limit_reason}"
        )
    baseline = get_verifier("greedy" if policy.greedy else "membership")
    return Plan(policy=policy, budget=budget, capabilities=caps, verifier=verifier, baseline_verifier=baseline)


@dataclass
class BuildContext:
    """What a proposer may need once models are loaded."""

    cfg: DictConfig
    target_backend: Any  # CausalLMBackend of the target
    tokenizer: Any
    draft_backend: Any = None  # CausalLMBackend of a separate draft model (proposer.model)
    items: list = field(default_factory=list)  # [(Prompt, token ids)] of the workload
    model_source: str = ""
    #: read-only objects the proposers of one run share (one per key), e.g. a REST datastore opened
    #: once for every batch slot rather than once per slot
    shared: dict = field(default_factory=dict)


def prepare(cfg: DictConfig, plan_: Plan, context: BuildContext) -> Plan:
    """Topology preparation that needs the models (calibration, profiles, artifacts)."""
    ref = TOPOLOGY_PREPARERS.get(cfg.topology.name)
    return resolve(ref)(cfg, plan_, context) if ref else plan_


def build_proposer(cfg: DictConfig, plan_: Plan, *, manifest_hash: str, context: BuildContext):
    cls = proposer_class(cfg.proposer.name)
    return cls.from_config(
        options=proposer_options(cfg),
        budget=plan_.budget,
        manifest_hash=manifest_hash,
        policy=plan_.policy,
        context=context,
    )
