"""Config groups are schema-backed: mistyped keys and wrong types fail at compose time."""

import dataclasses
import re

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


# --------------------------------------------------------------------------- names that select code


@pytest.mark.parametrize(
    "overrides,fragment,fix",
    [
        (
            ["proposer.name=rest"],
            "proposer.name=rest names another proposer than the options composed (proposer=prompt_lookup, "
            "schema PromptLookupConfig), which rest does not take",
            "proposer=rest",
        ),
        (
            ["proposer=draft_model", "proposer.name=prompt_lookup"],
            "(proposer=draft_model, schema DraftModelConfig)",
            "proposer=prompt_lookup",
        ),
        (["proposer.name=medusa"], "which medusa does not take", "proposer=medusa"),
        (["proposer=medusa", "proposer.name=eagle"], "(proposer=clover|hydra|medusa, schema HeadsConfig)", None),
        (
            ["proposer=draft_model", "topology=sequoia", "topology.name=sequence"],
            "topology.name=sequence names another topology than the options composed (topology=sequoia",
            "topology=sequence",
        ),
        (
            ["proposer.name=prompt_lookups"],
            "proposer.name=prompt_lookups is no proposer",
            "proposer.name=prompt_lookup",
        ),
    ],
)
def test_a_name_that_selects_other_code_than_the_composed_options_is_refused_before_model_work(
    overrides, fragment, fix
):
    """``proposer.name=rest`` over prompt lookup's options passed the checks and failed once planned
    (a bare OmegaConf error), or after the models loaded (``unexpected keyword argument 'sampling'``):
    a name is refused unless its packaged option has the node's schema, offering ``<group>=<name>``."""
    from harness.config import checked_plan
    from harness.engine.checks import check_selected_names
    from harness.runner import check_job

    c = cfg("model=tiny", *overrides)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_selected_names(c)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_job(c, None)  # the runner's checks, before anything reads the options by the name
    with pytest.raises(ConfigError) as info:
        checked_plan(["model=tiny", *overrides])
    if fix is not None:
        assert (fix,) in info.value.suggestions, str(info.value)
    else:  # eagle: the fix proposer=eagle is offered where the runner accepts it (the tiny target's geometry)
        assert all(s[0].startswith("proposer=") for s in info.value.suggestions), str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["proposer=medusa", "proposer.name=hydra"],  # one schema: hydra takes medusa's options
        ["proposer=draft_model", "topology.name=set", "topology.max_depth=1"],  # topology=sequence's schema
        ["proposer.name=prompt_lookup"],
    ],
)
def test_a_name_that_shares_the_composed_options_schema_is_accepted(overrides):
    plan(cfg("model=tiny", *overrides))


# --------------------------------------------------------------------------- inert options


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["tracking=wandb", "tracking.system_metrics=false", "tracking.system_metrics_interval_s=2"],
            "tracking.system_metrics_interval_s=2.0: tracking.system_metrics=false samples no system metrics",
        ),
        (
            ["gates.near_tie_max_fraction=0.5", "generation.temperature=0.7", "verifier=membership"],
            "gates.near_tie_max_fraction=0.5: the greedy-equality gate compares deterministic outputs",
        ),
        (
            ["generation.max_new_tokens=4", "generation.warmup_tokens=6"],
            "generation.warmup_tokens=6: the warm-up generates at most generation.max_new_tokens=4 tokens",
        ),
        (
            ["allow_leakage=true"],
            "allow_leakage=true: proposer=prompt_lookup searches no datastore, so no leakage check runs",
        ),
        (
            ["allow_leakage=true", "proposer=draft_model"],
            "allow_leakage=true: proposer=draft_model reads no datastore and runs no artifact trained here",
        ),
        (
            [
                "allow_leakage=true",
                "proposer=merged",
                "topology=merged",
                "proposer.sources=[draft_model,prompt_lookup]",
            ],
            "allow_leakage=true: no source of proposer.sources=[draft_model,prompt_lookup] has one",
        ),
    ],
)
def test_an_option_the_run_ignores_is_listed_as_inert(overrides, expected):
    from harness.runner import inert_options

    assert any(note.startswith(expected) for note in inert_options(cfg("model=tiny", *overrides))), expected


@pytest.mark.parametrize(
    "key,overrides",
    [
        ("tracking.system_metrics_interval_s", ["tracking=wandb", "tracking.system_metrics_interval_s=2"]),
        ("gates.near_tie_max_fraction", ["gates.near_tie_max_fraction=0.5"]),  # temperature 0: the greedy gate
        (  # top_k=1 keeps the argmax: deterministic outputs, compared by the greedy gate
            "gates.near_tie_max_fraction",
            ["gates.near_tie_max_fraction=0.5", "generation.temperature=0.7", "generation.top_k=1"],
        ),
        ("generation.warmup_tokens", ["generation.max_new_tokens=4", "generation.warmup_tokens=3"]),
        ("allow_leakage", ["allow_leakage=true", "proposer=rest"]),  # its datastore's leakage gate
        ("allow_leakage", ["allow_leakage=true", "proposer=medusa"]),  # heads trained here: their text's gate
        ("allow_leakage", ["allow_leakage=true", "proposer=merged", "topology=merged"]),  # a rest source
        ("allow_leakage", ["allow_leakage=true", "+datastore@proposer.datastore=stdlib", "topology=sequences"]),
    ],
)
def test_an_option_the_run_reads_is_not_listed_as_inert(key, overrides):
    from harness.runner import inert_options

    noted = [n for n in inert_options(cfg("model=tiny", *overrides)) if n.split("=", 1)[0] == key]
    assert noted == [], noted


def test_allow_leakage_where_the_leakage_gate_did_not_apply_is_listed_once_the_gates_ran():
    """An artifact trained here has a leakage gate, unless its training text cannot be had: known when
    it loads, so the gates' entry decides (the config alone lists the proposers that have no gate)."""
    from harness.runner import gate_inert_options

    c = cfg("model=tiny", "proposer=early_exit", "proposer.exit_layer=1", "allow_leakage=true")
    missing = {"workload_governance": {"status": "not_applicable", "why": "its training text is gone"}}
    assert gate_inert_options(c, missing) == [
        "allow_leakage=true: the leakage check does not apply (its training text is gone)"
    ]
    assert gate_inert_options(c, {"workload_governance": {"status": "passed"}}) == []
    assert gate_inert_options(cfg("model=tiny", "proposer=early_exit", "proposer.exit_layer=1"), missing) == []
    # listed from the config already: not twice
    assert gate_inert_options(cfg("model=tiny", "proposer=draft_model", "allow_leakage=true"), missing) == []


def test_compile_tree_refuses_a_proposal_outside_the_negotiated_capabilities():
    """Given the negotiated capabilities, the compiler refuses a proposal whose sampling relation or
    probability semantics the proposer did not declare; an empty proposal carries neither."""
    import torch

    from harness.contracts import Capabilities, ProposalResult
    from harness.proposers.sampling import sample_tree_proposal
    from harness.random_source import TorchRandomSource
    from harness.topology.compiler import compile_tree

    def laws(prefixes):
        return torch.full((len(prefixes), 4), 0.25, dtype=torch.float64)

    def sampled(relation):
        return sample_tree_proposal(
            laws, widths=(2, 1), relation=relation, rng=TorchRandomSource(0), source="d", manifest_hash="m"
        )

    iid_caps = Capabilities(
        name="draft",
        probability_semantics=frozenset({"normalized_conditional"}),
        sampling_relations=frozenset({"iid"}),
        topology="tree",
    )
    tree = compile_tree([sampled("iid")], 1, capabilities=iid_caps)
    assert tree.sampling_relations == frozenset({"iid"}) and tree.num_rows >= 2
    with pytest.raises(ContractError, match=r"sampling_relation='without_replacement'.*'draft'"):
        compile_tree([sampled("without_replacement")], 1, capabilities=iid_caps)
    with pytest.raises(ContractError, match=r"probability_semantics='score_only'.*sampling_relation='beam'"):
        compile_tree([sampled("beam")], 1, capabilities=iid_caps)
    lookup = ProposalResult.from_paths([[1, 2]], probability_semantics="frequency")
    lookup_caps = Capabilities(
        name="rest",
        probability_semantics=frozenset({"absent"}),
        sampling_relations=frozenset({"deterministic_lookup"}),
        topology="tree",
    )
    with pytest.raises(ContractError, match=r"probability_semantics='frequency'") as err:
        compile_tree([lookup], 1, capabilities=lookup_caps)
    assert "sampling_relation" not in str(err.value)
    empty = ProposalResult.empty_result(source="d", manifest_hash="m")  # absent / deterministic_lookup
    assert compile_tree([empty], 1, capabilities=iid_caps).num_rows == 0
    assert compile_tree([sampled("without_replacement")], 1).num_rows >= 2  # no capabilities: unchecked
