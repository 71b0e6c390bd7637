"""The prepare stage: what must exist before a run's gates and measurement and needs the loaded
models — trained or searched proposer artifacts, a measured verify cost, a calibrated Sequoia tree.

This room sits above the engine: it trains draft heads and the early-exit adapter, searches the
layer-skip vector, calibrates Sequoia's acceptance and profiles the hardware, running the real
round loop where a measurement needs it. Proposers below it only load what it made.

``TOPOLOGY_PREPARERS``: topology name -> ``"module:function"``, ``function(cfg, plan, context) -> Plan``.
``PROPOSER_PREPARERS``: proposer name -> ``"module:function"``, ``function(options, context) ->
Preparation`` (option overrides handed to the proposer's ``from_config``, and plan extras).
A merged proposer's sources are prepared one by one, their overrides nested under the source name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import OmegaConf

from harness.contracts import resolve_ref

TOPOLOGY_PREPARERS: dict[str, str] = {
    "sequoia": "harness.prepare.sequoia:prepare_sequoia",
}

PROPOSER_PREPARERS: dict[str, str] = {
    "prompt_lookup": "harness.prepare.verify_cost:prepare_prompt_lookup",
    "medusa": "harness.prepare.heads:prepare_medusa",
    "hydra": "harness.prepare.heads:prepare_hydra",
    "clover": "harness.prepare.heads:prepare_clover",
    "eagle": "harness.prepare.eagle:prepare_eagle",
    "early_exit": "harness.prepare.early_exit:prepare_early_exit",
    "layer_skip": "harness.prepare.skip_search:prepare_layer_skip",
    "merged": "harness.prepare:prepare_merged",
}


#: `harness train proposer=NAME`: name -> "module:function(cfg, *, target, force) -> manifest summary"
TRAINERS: dict[str, str] = {
    "medusa": "harness.prepare.heads:train_from_config",
    "hydra": "harness.prepare.heads:train_from_config",
    "clover": "harness.prepare.heads:train_from_config",
    "eagle": "harness.prepare.eagle:train_from_config",
    "early_exit": "harness.prepare.early_exit:train_from_config",
    "layer_skip": "harness.prepare.skip_search:train_from_config",
}


@dataclass(frozen=True)
class Preparation:
    options: dict = field(default_factory=dict)  # merged into the proposer's config options
    extras: dict = field(default_factory=dict)  # plan extras (e.g. the measured t(n) profile)


def prepare_proposer(name: str, options: dict, context) -> Preparation:
    ref = PROPOSER_PREPARERS.get(name)
    return resolve_ref(ref)(options, context) if ref else Preparation()


def prepare_merged(options: dict, context) -> Preparation:
    """Each source of a merged tree prepared as it would be alone."""
    nested, extras = {}, {}
    for source in options.get("sources") or []:
        prep = prepare_proposer(source, dict(options.get(source) or {}), context)
        if prep.options:
            nested[source] = prep.options
        extras.update(prep.extras)
    return Preparation(options=nested, extras=extras)


def prepare(cfg, plan, context):
    """The topology's preparer, then the proposer's: the plan the proposers are built from."""

    ref = TOPOLOGY_PREPARERS.get(cfg.topology.name)
    if ref:
        plan = resolve_ref(ref)(cfg, plan, context)
    options = OmegaConf.to_container(cfg.proposer, resolve=True)
    prep = prepare_proposer(options.pop("name"), options, context)
    if not prep.options and not prep.extras:
        return plan
    return plan.with_extras(proposer_options=prep.options, **prep.extras)
