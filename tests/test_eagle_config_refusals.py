"""Published EAGLE drafts refused from their config.json in one line (exit 2), by the same rules at
plan and at load: EAGLE-3's fused layers against the target's depth before the target loads, what
counts as an EAGLE-3 draft, a speculators layer config that is not an object, and settings of the
wrong JSON type (never converted). Checkpoints are written by the tests (builders in test_eagle)."""

from __future__ import annotations

import json

import pytest
import torch
from test_eagle import eagle3_checkpoint, eagle12_state, llama_fields, write_published

from harness.config import compose
from harness.engine.build import plan
from harness.heads.artifacts import load_configured_eagle
from harness.heads.checkpoint import ArtifactError
from harness.target.loading import build_tiny_model, tiny_llama_config


@pytest.fixture(scope="module")
def targets():
    """The tiny target (2 layers, model=tiny) and 3- and 8-layer ones (model.tiny.num_layers=N)."""
    return {n: build_tiny_model(seed=0, num_layers=n) for n in (2, 3, 8)}


@pytest.fixture(autouse=True)
def _no_model_loads(monkeypatch):
    """A run these tests start never loads a target: a refusal at plan comes first."""
    import harness.runner as runner

    monkeypatch.setattr(runner, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))


def overrides(path, layers: int) -> list[str]:
    return ["model=tiny", f"model.tiny.num_layers={layers}", "proposer=eagle", f"proposer.artifact={path}"]


def plan_refusal(path, layers: int) -> str | None:
    """The message plan refuses the draft at ``path`` with on a tiny target of ``layers`` layers, or None."""
    try:
        plan(compose([*overrides(path, layers), "topology=sequence"]))
    except ArtifactError as exc:
        return str(exc)
    return None


def load_refusal(path, model) -> str | None:
    try:
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    except ArtifactError as exc:
        return str(exc)
    return None


def harness_run(path, layers: int, tmp_path, capsys) -> tuple[int, list[str]]:
    from harness.app import run_main

    run_dir = tmp_path / "run"
    code = run_main([*overrides(path, layers), "topology=sequence", f"output_dir={run_dir}"])
    assert not run_dir.exists() or not any(run_dir.iterdir())
    # the native kernels are compiled once per cache, with a line saying so, on a cache's first run
    err = capsys.readouterr().err.strip().splitlines()
    return code, [line for line in err if not line.startswith("harness: compiling the native decode kernels")]


def test_eagle3_fused_layers_outside_the_target_are_refused_at_plan_before_the_target_loads(targets, tmp_path, capsys):
    """Named layers past the target's depth, and EAGLE's default layers on a target too shallow for
    them, were refused only after the target's weights had loaded (minutes on a large target), the
    default ones as "fuses target layers [2, 1, -1]", layers the user never named."""
    config, state, _ = eagle3_checkpoint(targets[8].config, draft_vocab=40)
    named = write_published(tmp_path / "named", {**config, "eagle_aux_hidden_state_layer_ids": [2, 4, 40]}, state)
    said = "eagle3 draft fuses target layers [2, 4, 40]; the target has 8 decoder layers"
    assert plan_refusal(named, 8) == load_refusal(named, targets[8])
    assert plan_refusal(named, 8).startswith(f"proposer.artifact='{named}': {said}")
    code, err = harness_run(named, 8, tmp_path, capsys)
    assert code == 2 and err == [f"harness run: refused: {plan_refusal(named, 8)}"]

    default = write_published(tmp_path / "default", config, state, fmt="safetensors")
    assert plan_refusal(default, 8) is None
    refusal = plan_refusal(default, 2)
    assert refusal == load_refusal(default, targets[2])
    assert refusal == (
        f"proposer.artifact='{default}': eagle3 draft: config.json names no eagle_aux_hidden_state_layer_ids, and "
        "EAGLE-3's default fused layers 2, N // 2, N - 3 need a target of 3 or at least 7 decoder layers; this one "
        "has 2 (a draft serves the target it was trained for)"
    )
    code, err = harness_run(default, 2, tmp_path, capsys)
    assert code == 2 and err == [f"harness run: refused: {refusal}"]
    # on 3 layers the default is 2, 1, 0: three distinct layers, joined in layer order without a note
    # about a list the config never gave
    config3, state3, _ = eagle3_checkpoint(targets[3].config, draft_vocab=40)
    three = write_published(tmp_path / "three", config3, state3)
    assert plan_refusal(three, 3) is None
    art = load_configured_eagle({"artifact": str(three)}, model=targets[3], tokenizer=None)
    assert art.draft.spec.aux_layers == (0, 1, 2) and art.manifest["notes"] == []


@pytest.mark.parametrize("layer", [["hidden_size", 32], "hidden_size=32", 32], ids=["list", "string", "number"])
def test_a_speculators_layer_config_that_is_not_an_object_is_one_refusal(targets, tmp_path, capsys, layer):
    """A transformer_layer_config that is not an object raised a TypeError (exit 1) at plan and at load."""
    config, state, _ = eagle3_checkpoint(targets[8].config, draft_vocab=40, speculators=True)
    path = write_published(tmp_path / "spec", {**config, "transformer_layer_config": layer}, state, fmt="safetensors")
    said = (
        f"proposer.artifact='{path}': speculators config.json: transformer_layer_config is {layer!r}; expected an "
        "object holding the decoder layer's settings"
    )
    assert plan_refusal(path, 8) == said and load_refusal(path, targets[8]) == said
    code, err = harness_run(path, 8, tmp_path, capsys)
    assert code == 2 and err == [f"harness run: refused: {said}"]


def test_plan_and_load_read_one_rule_for_what_is_an_eagle3_draft(targets, tmp_path):
    """A draft wider than its target (target_hidden_size, no draft_vocab_size) loaded but was refused at
    plan, read there as an EAGLE-1/2 draft of hidden size 48; a draft that says neither, known as EAGLE-3
    by its midlayer.* weights, had its fused layers checked only at load."""
    deep = targets[8]
    config, state, _ = eagle3_checkpoint(tiny_llama_config(hidden_size=48, num_layers=8), draft_vocab=96)
    gen = torch.Generator().manual_seed(0)
    state["fc.weight"] = torch.randn(48, 3 * 32, generator=gen) * 0.1  # reads the 32-wide target's features
    state["embed_tokens.weight"] = torch.randn(96, 48, generator=gen)
    del state["d2t"], state["t2d"], config["draft_vocab_size"]
    wide = write_published(tmp_path / "wide", {**config, "target_hidden_size": 32}, state, fmt="safetensors")
    assert plan_refusal(wide, 8) is None
    art = load_configured_eagle({"artifact": str(wide)}, model=deep, tokenizer=None)
    assert art.draft.spec.hidden_size == 48 and art.draft.spec.target_hidden_size == 32
    other = write_published(tmp_path / "other", {**config, "target_hidden_size": 64}, state, fmt="safetensors")
    assert plan_refusal(other, 8) == (
        f"proposer.artifact='{other}' (EAGLE-3 draft) reads features of hidden size 64; the target's is 32: a draft "
        "serves the model it was trained for"
    )
    # the whole vocabulary, the target's width: only the weights' names say EAGLE-3 (read from the
    # safetensors header at plan, without the tensors)
    plain, state, _ = eagle3_checkpoint(deep.config, draft_vocab=96)
    del plain["draft_vocab_size"]
    unsaid = {**plain, "eagle_aux_hidden_state_layer_ids": [2, 4, 40]}
    for fmt in ("safetensors", "sharded"):
        path = write_published(tmp_path / fmt, unsaid, state, fmt="safetensors")
        if fmt == "sharded":  # a shard index names the weights too
            (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
            index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in state}}
            (path / "model.safetensors.index.json").write_text(json.dumps(index))
        said = f"proposer.artifact='{path}': eagle3 draft fuses target layers [2, 4, 40]; the target has 8"
        assert plan_refusal(path, 8).startswith(said)
        assert load_refusal(path, deep).startswith(said)
    fits = write_published(tmp_path / "fits", plain, state, fmt="safetensors")
    assert plan_refusal(fits, 8) is None
    assert load_configured_eagle({"artifact": str(fits)}, model=deep, tokenizer=None).manifest["format"] == "eagle3"


_WRONG_TYPES = [
    ("eagle", "hidden_size", 32.7, " is not a whole number (a JSON integer)"),
    ("eagle", "intermediate_size", "64", " is not a whole number (a JSON integer)"),
    ("eagle", "max_position_embeddings", 512.0, " is not a whole number (a JSON integer)"),
    ("eagle", "num_key_value_heads", True, " is not a whole number (a JSON integer)"),
    ("eagle", "num_key_value_heads", 0, "; expected at least 1"),
    ("eagle", "rms_norm_eps", "1e-6", " is not a positive number (a JSON number)"),
    ("eagle", "rope_theta", None, " is not a positive number (a JSON number)"),
    ("eagle", "rope_scaling", "linear", " is not an object of RoPE settings (or null)"),
    ("eagle", "bias", "false", " is not true or false (a JSON boolean)"),
    ("eagle", "qkv_bias", "true", " is not true or false (a JSON boolean)"),
    ("eagle", "attention_bias", 0, " is not true or false (a JSON boolean)"),
    ("eagle", "mlp_bias", None, " is not true or false (a JSON boolean)"),
    ("eagle3", "eagle_aux_hidden_state_layer_ids", "245", " is not a list of layer indices (JSON integers)"),
    ("eagle3", "eagle_aux_hidden_state_layer_ids", [2.7, 4.2, 5.9], " is not a list of layer indices (JSON integers)"),
    ("eagle3", "eagle_aux_hidden_state_layer_ids", [True, 4, 5], " is not a list of layer indices (JSON integers)"),
    ("eagle3", "draft_vocab_size", "40", " is not a whole number (a JSON integer)"),
    ("eagle3", "target_hidden_size", 32.0, " is not a whole number (a JSON integer)"),
    ("eagle3", "norm_before_residual", "false", " is not true or false (a JSON boolean)"),
]


@pytest.mark.parametrize("kind,field,value,why", _WRONG_TYPES, ids=[f"{k}-{f}-{v!r}" for k, f, v, _ in _WRONG_TYPES])
def test_a_setting_of_the_wrong_json_type_is_refused_naming_field_and_value(targets, tmp_path, kind, field, value, why):
    """Settings were converted: layer ids "245" read as (2, 4, 5), [2.7, 4.2, 5.9] truncated, a hidden
    size of 32.7 loaded as 32, an epsilon given as a string accepted, and bias "false" read as true."""
    if kind == "eagle":
        model = targets[2]
        config = llama_fields(model.config)
        state = eagle12_state(model.config, embed=model.get_input_embeddings().weight)
    else:
        model = targets[8]
        config, state, _ = eagle3_checkpoint(model.config, draft_vocab=40)
    path = write_published(tmp_path / "ckpt", {**config, field: value}, state)
    said = f"proposer.artifact='{path}': EAGLE checkpoint config.json: {field}={value!r}{why}"
    assert plan_refusal(path, model.config.num_hidden_layers) == said
    assert load_refusal(path, model) == said


def test_a_boolean_d2t_is_refused(targets, tmp_path):
    """d2t holds each draft token's offset to its target id: a boolean one was read as offsets 0 and 1."""
    model = targets[8]
    config, state, _ = eagle3_checkpoint(model.config, draft_vocab=40)
    path = write_published(tmp_path / "bool", config, {**state, "d2t": torch.ones(40, dtype=torch.bool)})
    assert load_refusal(path, model) == (
        f"proposer.artifact='{path}': eagle3 checkpoint: d2t is torch.bool; it holds each draft token's offset to "
        "its target id (integers)"
    )
