"""Config groups are schema-backed: mistyped keys and wrong types fail at compose time."""

import dataclasses

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from harness import config as _  # noqa: F401  (registers schemas)
from harness.config import CONF_DIR, TinyConfig, compose
from harness.contracts import ConfigError, ContractError
from harness.engine.build import plan
from harness.engine.decode import check_temp_kv_budget
from harness.runner import check_models
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


#: a value other than the default for every field of a tiny model's config
TINY_TARGET = {
    "vocab_size": 64,
    "hidden_size": 48,
    "num_layers": 3,
    "num_heads": 6,
    "num_kv_heads": 3,
    "intermediate_size": 80,
    "max_position_embeddings": 256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("draft", ["proposer.model", "proposer.draft_model.model"])
def test_a_tiny_draft_follows_every_field_of_the_target_s_tiny_config(draft):
    """A separate tiny draft kept its own rope_theta, rms_norm_eps and tie_word_embeddings defaults
    (10000.0, 1e-6, false) under a target with others, where its config says each field follows the target's."""
    proposer = "proposer=draft_model" if draft == "proposer.model" else "proposer=merged"
    overrides = [proposer, "model=tiny", f"{draft}.name=tiny", *(f"model.tiny.{k}={v}" for k, v in TINY_TARGET.items())]
    c = cfg(*overrides)
    assert set(TINY_TARGET) == {f.name for f in dataclasses.fields(TinyConfig)}
    tiny = OmegaConf.to_container(OmegaConf.select(c, f"{draft}.tiny"), resolve=True)
    assert tiny == OmegaConf.to_container(c.model.tiny, resolve=True) == TINY_TARGET
    # set for the draft alone, a field changes the draft only
    c = cfg(*overrides, f"{draft}.tiny.rope_theta=10000.0")
    assert OmegaConf.select(c, f"{draft}.tiny.rope_theta") == 10000.0 and c.model.tiny.rope_theta == 500000.0


def test_a_derived_draft_of_a_tiny_target_with_its_own_rope_and_norm_is_accepted():
    """A derived draft's tiny fields must equal the target's: rope_theta, rms_norm_eps and
    tie_word_embeddings kept their defaults, so a target setting them was refused as if the draft had."""
    c = cfg(
        "proposer=draft_model",
        "model=tiny",
        "model.tiny.rope_theta=500000.0",
        "model.tiny.rms_norm_eps=1e-5",
        "model.tiny.tie_word_embeddings=true",
    )
    check_models(c)  # raises when a draft field differs from the target's
