"""The proposer registry: proposer name -> ``"module:Class"``.

A class implements ``declare(options, budget) -> Capabilities`` (classmethod, no model work) and
``from_config(*, options, budget, manifest_hash, policy, context) -> Proposer`` (classmethod, loads
what it needs: a draft model's backend, a datastore, an artifact; it never trains). A proposer
whose artifact is trained, searched or measured first has a preparer in :mod:`harness.prepare`.
Entries are resolved on use, so naming a proposer does not import its dependencies.
"""

from __future__ import annotations

from harness.contracts import ConfigError, resolve_ref

PROPOSERS: dict[str, str] = {
    "prompt_lookup": "harness.proposers.prompt_lookup:PromptLookupProposer",
    "draft_model": "harness.proposers.draft_model:DraftModelProposer",
    "rest": "harness.proposers.rest:RestProposer",
    "merged": "harness.proposers.merged:MergedProposer",
    "medusa": "harness.proposers.heads:MedusaProposer",
    "hydra": "harness.proposers.heads:HydraProposer",
    "clover": "harness.proposers.heads:CloverProposer",
    "eagle": "harness.proposers.eagle:EagleProposer",
    "early_exit": "harness.proposers.selfspec:EarlyExitProposer",
    "layer_skip": "harness.proposers.selfspec:LayerSkipProposer",
}


def proposer_class(name: str):
    if name not in PROPOSERS:
        raise ConfigError(f"unknown proposer {name!r}; one of {sorted(PROPOSERS)}")
    return resolve_ref(PROPOSERS[name])
