"""From a composed config to the round's objects. Everything that can be checked without a
model (capabilities, negotiation, budgets) is checked here, before any model is loaded."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from harness.proposers.base import Budget, budget_topology
from harness.verifiers import Capabilities, Verifier, get_verifier, negotiate
from harness.verifiers.sampling import SamplingPolicy

#: proposer name -> (module, class). Imported lazily.
PROPOSERS = {
    "prompt_lookup": ("harness.proposers.prompt_lookup", "PromptLookupProposer"),
    "draft_model": ("harness.proposers.draft_model", "DraftModelProposer"),
    "rest": ("harness.proposers.rest", "RestProposer"),
}


class ConfigError(ValueError):
    pass


def sampling_policy(cfg: DictConfig) -> SamplingPolicy:
    g = cfg.generation
    return SamplingPolicy(temperature=float(g.temperature), top_p=float(g.top_p), top_k=int(g.top_k))


def budget_from_config(cfg: DictConfig) -> Budget:
    t = cfg.topology
    name = t.name
    if name in ("sequence", "sequences"):
        return Budget(shape=name, max_nodes=t.max_nodes, max_depth=t.max_depth)
    if name == "set":
        return Budget(shape="set", max_nodes=t.max_nodes, max_depth=1, widths=(t.max_nodes,))
    if name == "expansion":
        widths = tuple(int(w) for w in t.widths)
        if not widths:
            raise ConfigError("topology=expansion needs topology.widths, e.g. [2,2,1]")
        if len(widths) > t.max_depth:
            raise ConfigError(f"topology.widths has {len(widths)} levels, over topology.max_depth={t.max_depth}")
        return Budget(shape="expansion", max_nodes=t.max_nodes, max_depth=len(widths), widths=widths)
    raise ConfigError(f"unknown topology {name!r}; one of sequence, sequences, set, expansion")


def declared_capabilities(cfg: DictConfig, budget: Budget) -> Capabilities:
    """What the configured proposer will emit, known from config alone."""
    p = cfg.proposer
    if p.name not in PROPOSERS:
        raise ConfigError(f"unknown proposer {p.name!r}; one of {sorted(PROPOSERS)}")
    if p.name == "prompt_lookup":
        sem, rel = "score_only", "deterministic_lookup"
        if budget.shape not in ("sequence", "sequences"):
            raise ConfigError(f"proposer=prompt_lookup builds topology=sequence or sequences; got {budget.shape!r}")
    elif p.name == "rest":
        sem, rel = "frequency", "deterministic_lookup"
    else:
        rel = str(p.sampling)
        sem = "score_only" if rel == "beam" else "normalized_conditional"
        if budget.shape == "sequences":
            raise ConfigError("proposer=draft_model builds sequence, set or expansion topologies; got sequences")
    return Capabilities(name=p.name, probability_semantics=frozenset({sem}),
                        sampling_relations=frozenset({rel}), topology=budget_topology(budget))


@dataclass(frozen=True)
class Plan:
    policy: SamplingPolicy
    budget: Budget
    capabilities: Capabilities
    verifier: Verifier
    baseline_verifier: Verifier


def plan(cfg: DictConfig) -> Plan:
    """Negotiate proposer x topology x verifier x temperature; raise before any model work."""
    policy = sampling_policy(cfg)
    budget = budget_from_config(cfg)
    caps = declared_capabilities(cfg, budget)
    verifier = get_verifier(cfg.verifier.name)
    negotiate(caps, verifier, temperature=policy.temperature, exact_mode=bool(cfg.generation.exact))
    if int(cfg.generation.batch_size) != 1:
        raise ConfigError(
            f"generation.batch_size={cfg.generation.batch_size}: batched rounds are not implemented yet "
            "(only batch size 1)")
    baseline = get_verifier("greedy" if policy.greedy else "membership")
    return Plan(policy=policy, budget=budget, capabilities=caps, verifier=verifier, baseline_verifier=baseline)


def build_proposer(cfg: DictConfig, plan_: Plan, *, manifest_hash: str, draft_backend=None, tokenizer=None):
    import importlib

    p = cfg.proposer
    module, cls_name = PROPOSERS[p.name]
    cls = getattr(importlib.import_module(module), cls_name)
    opts = OmegaConf.to_container(p, resolve=True)
    opts.pop("name")
    common = dict(budget=plan_.budget, manifest_hash=manifest_hash, policy=plan_.policy)
    if p.name == "prompt_lookup":
        return cls(**common, **opts)
    if p.name == "draft_model":
        return cls(**common, backend=draft_backend, sampling=opts["sampling"])
    if p.name == "rest":
        return cls.from_config(**common, options=opts, tokenizer=tokenizer)
    raise ConfigError(f"unknown proposer {p.name!r}")
