"""Config groups are schema-backed: mistyped keys and wrong types fail at compose time."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from harness import config as _  # noqa: F401  (registers schemas)
from harness.config import CONF_DIR, compose
from harness.contracts import ConfigError, ContractError
from harness.engine.build import plan
from harness.engine.decode import check_temp_kv_budget
from harness.verifiers import NegotiationError


def cfg(*overrides):
    return compose(overrides)


def test_default_config_composes():
    c = cfg()
    assert c.model.name == "smollm2" and c.proposer.name == "prompt_lookup" and c.verifier.name == "greedy"


def test_experiment_default_composes():
    c = cfg("experiment=default")
    assert c.topology.name == "sequences" and c.workload.limit == 10 and c.experiment == "default"


@pytest.mark.parametrize("override", ["generation.max_new_tokenz=3", "proposer.max_ngramm=2", "topology.max_node=3"])
def test_mistyped_key_fails_at_compose(override):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        cfg(override)


@pytest.mark.parametrize(
    "override",
    [
        "generation.max_new_tokens=many",
        "topology.max_nodes=1.5",
        "generation.temperature=hot",
        "proposer.max_ngram=[1]",
    ],
)
def test_wrong_type_fails_at_compose(override):
    with pytest.raises((ConfigCompositionException, ValidationError)):
        cfg(override)


def test_every_group_option_composes():
    for group in ("model", "proposer", "topology", "verifier", "workload", "tracking"):
        for path in (CONF_DIR / group).glob("*.yaml"):
            overrides = [f"{group}={path.stem}"]
            if path.stem == "hf":
                overrides.append("model.name_or_path=/nonexistent")
            if path.stem == "jsonl":
                overrides.append("workload.path=/nonexistent.jsonl")
            cfg(*overrides)  # composes without error


@pytest.mark.parametrize(
    "overrides,match",
    [
        (("proposer=prompt_lookup", "verifier=rejection", "generation.temperature=0.7"), "score_only"),
        (("verifier=greedy", "generation.temperature=0.7"), "temperature 0 only"),
        (("proposer=draft_model", "verifier=specinfer", "generation.temperature=0"), "needs temperature > 0"),
        (
            (
                "proposer=draft_model",
                "proposer.sampling=without_replacement",
                "topology=expansion",
                "verifier=specinfer",
                "generation.temperature=0.7",
            ),
            "without_replacement",
        ),
        (
            ("proposer=draft_model", "topology=expansion", "verifier=rejection", "generation.temperature=0.7"),
            "topology 'tree'",
        ),
    ],
)
def test_negotiation_refusals_name_both_sides(overrides, match):
    with pytest.raises(NegotiationError, match=match) as info:
        plan(cfg(*overrides))
    assert "proposer" in str(info.value) or "verifier" in str(info.value)


def test_prompt_lookup_rejection_refused_at_any_temperature():
    with pytest.raises(NegotiationError):
        plan(cfg("proposer=prompt_lookup", "verifier=rejection"))


def test_topology_shape_refused_for_proposer():
    with pytest.raises((ConfigError, ValueError), match="expansion"):
        plan(cfg("proposer=prompt_lookup", "topology=expansion"))


def test_temp_kv_budget_refused_before_model_work():
    with pytest.raises(ContractError, match="temp_kv_budget_bytes"):
        check_temp_kv_budget(max_nodes=16, bytes_per_token=1000, budget_bytes=15_999)
    assert check_temp_kv_budget(max_nodes=16, bytes_per_token=1000, budget_bytes=16_000) == 16_000


def test_temp_kv_budget_counts_the_batch():
    with pytest.raises(ContractError, match="batch_size=4"):
        check_temp_kv_budget(max_nodes=16, bytes_per_token=1000, budget_bytes=32_000, batch_size=4)


@pytest.mark.parametrize(
    "overrides,target,draft",
    [
        (["proposer=draft_model"], "float32", "float32"),
        (["proposer=draft_model", "model.device=cuda"], "bfloat16", "bfloat16"),
        (["proposer=draft_model", "model.device=cuda:1"], "bfloat16", "bfloat16"),
        (["proposer=draft_model", "model.device=cuda", "model.dtype=float32"], "float32", "float32"),
        (["proposer=draft_model", "model.device=cuda", "proposer.model.dtype=float16"], "bfloat16", "float16"),
        (["model=tiny", "model.device=cuda", "proposer=draft_model"], "bfloat16", "bfloat16"),
    ],
)
def test_the_default_dtype_follows_the_device_and_an_explicit_dtype_wins(overrides, target, draft):
    cfg = compose(overrides)
    assert (cfg.model.dtype, cfg.proposer.model.dtype) == (target, draft)
