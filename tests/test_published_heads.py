"""Published head checkpoints: Medusa-1 / version-2 / Medusa-2 full-model and Hydra (mlp and
prefix-mlp, grounded and not) written by the tests in the published layouts (random weights), read
key for key, run with the published forward (checked against plain-tensor references written
here), refused when tampered, mis-shaped or built for another target, run end to end with their
provenance in the manifest, never trained, and labelled CPU-budget only by recorded training."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from checkpoint_fixtures import (
    best_first_choices,
    hydra_config,
    hydra_prefix_state,
    hydra_state,
    medusa_config,
    medusa_state,
    tiny_checkpoint,
    write_choices,
    write_hydra,
    write_medusa,
)

from harness.config import compose
from harness.contracts import Budget
from harness.engine.build import plan
from harness.heads.artifacts import load_configured_heads
from harness.heads.checkpoint import ArtifactError, cpu_budget_label
from harness.heads.published import check_target, inspect, is_published, load_published_heads
from harness.target.loading import build_tiny_model, model_geometry

H, V = 32, 96  # the tiny target's hidden size and vocabulary


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(seed=0)


def tiny_geometry():
    return model_geometry(compose(["model=tiny"]).model)


def silu(x):
    return x * torch.sigmoid(x)


# --------------------------------------------------------------------------- Medusa


def medusa_reference(state, k, layers, h, lm_head_weight=None):
    """Medusa head k: x <- x + SiLU(W x + b), L times, then its own projection (or the base's)."""
    x = h
    for j in range(layers):
        x = x + silu(x @ state[f"{k}.{j}.linear.weight"].T + state[f"{k}.{j}.linear.bias"])
    w = state.get(f"{k}.{layers}.weight", lm_head_weight)
    return x @ w.T


def medusa_logits(heads, target, k, h):
    """The loaded bank's logits for published head k (depth k + 1) from hidden row(s) h [n, d]."""
    emb = target.get_input_embeddings()(torch.tensor([[5]])).float()
    out = heads.depth(k + 1, h, emb.expand(h.shape[0], -1, -1))
    return heads.vocab_logits([k + 1] * h.shape[0], out, target.get_output_embeddings())


@pytest.mark.parametrize(
    "layers, fmt, share",
    [(1, "pt", True), (2, "pt", True), (2, "safetensors", True), (2, "pt", False)],
    ids=["L1-pt", "L2-shared-pt", "L2-shared-safetensors", "L2-distinct-pt"],
)
def test_medusa_heads_load_key_for_key_and_run_the_published_forward(tmp_path, target, layers, fmt, share):
    state = medusa_state(heads=3, layers=layers, hidden=H, vocab=V, seed=1, share=share)
    path = write_medusa(tmp_path / "medusa", state, config=medusa_config(3, layers), fmt=fmt)
    assert is_published(str(path))
    layout = inspect(str(path), "medusa")
    assert (layout.format, layout.num_heads, layout.num_layers, layout.hidden_size, layout.vocab_size) == (
        "medusa-heads",
        3,
        layers,
        H,
        V,
    )
    assert set(layout.expected_shapes()) == set(state)
    art = load_configured_heads("medusa", {"artifact": str(path)}, model=target, tokenizer=None)
    assert not art.heads.spec.dependent and art.heads.spec.num_heads == 3
    h = torch.randn(2, H)
    for k in range(3):
        got = medusa_logits(art.heads, target, k, h)
        torch.testing.assert_close(got, medusa_reference(state, k, layers, h), rtol=1e-5, atol=1e-5)
    assert art.manifest["source"] == "published" and art.manifest["cpu_budget_artifact"] is False
    name = "medusa_lm_head.pt" if fmt == "pt" else "medusa_lm_head.safetensors"
    assert art.manifest["files"] == {name: hashlib.sha256((path / name).read_bytes()).hexdigest()}


def test_medusa_heads_in_torch_save_s_legacy_format_and_in_float8_load_and_unreadable_dtypes_are_refused(
    tmp_path, target
):
    """A ``.pt`` written by torch.save's legacy (pre-zip) serialisation cannot be memory-mapped: it
    is read whole. float8 safetensors are recorded as float8 when planning and load cast; a dtype
    that holds no weights (U32) is refused when planning, naming the tensor, before any model work."""
    from safetensors.torch import save_file

    state = medusa_state(heads=2, layers=1, hidden=H, vocab=V, seed=4)
    legacy = tmp_path / "legacy"
    write_medusa(legacy, state, config=medusa_config(2, 1))
    torch.save(state, legacy / "medusa_lm_head.pt", _use_new_zipfile_serialization=False)
    art = load_configured_heads("medusa", {"artifact": str(legacy)}, model=target, tokenizer=None)
    h = torch.randn(2, H)
    torch.testing.assert_close(medusa_logits(art.heads, target, 1, h), medusa_reference(state, 1, 1, h))

    f8 = tmp_path / "f8"
    write_medusa(f8, state, config=medusa_config(2, 1), fmt="safetensors")
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in state.items()}, str(f8 / "medusa_lm_head.safetensors"))
    assert inspect(str(f8), "medusa").saved_dtypes == {"float8_e4m3fn": len(state)}
    art = load_configured_heads("medusa", {"artifact": str(f8)}, model=target, tokenizer=None)
    rounded = {k: v.to(torch.float8_e4m3fn).float() for k, v in state.items()}
    torch.testing.assert_close(medusa_logits(art.heads, target, 0, h), medusa_reference(rounded, 0, 1, h))

    u32 = tmp_path / "u32"
    write_medusa(u32, state, config=medusa_config(2, 1), fmt="safetensors")
    save_file({k: (v.abs() * 100).to(torch.uint32) for k, v in state.items()}, str(u32 / "medusa_lm_head.safetensors"))
    with pytest.raises(ArtifactError, match=r"is torch.uint32; weights must be floating point"):
        inspect(str(u32), "medusa")


def test_medusa_version_2_heads_project_with_the_target_lm_head(tmp_path, target, capsys):
    state = medusa_state(heads=2, layers=1, hidden=H, vocab=None, seed=2)
    path = write_medusa(tmp_path / "v2", state, config=medusa_config(2, 1, version="2"), fmt="safetensors")
    art = load_configured_heads("medusa", {"artifact": str(path)}, model=target, tokenizer=None)
    assert art.manifest["format"] == "medusa-heads-v2" and art.manifest["vocab_size"] is None
    assert capsys.readouterr().err == ""  # the config says version 2: nothing to say
    # no version and no projections: read as version 2, said on stderr as well as recorded (it was only recorded)
    unsaid = write_medusa(tmp_path / "unsaid", state, config=medusa_config(2, 1), fmt="safetensors")
    art = load_configured_heads("medusa", {"artifact": str(unsaid)}, model=target, tokenizer=None)
    assert (
        capsys.readouterr().err == (f"harness: note: the published medusa at {unsaid}: {art.manifest['notes'][0]}\n")
        and "read as version 2" in art.manifest["notes"][0]
    )
    h = torch.randn(3, H)
    lm = target.get_output_embeddings().weight
    for k in range(2):
        torch.testing.assert_close(
            medusa_logits(art.heads, target, k, h), medusa_reference(state, k, 1, h, lm), rtol=1e-5, atol=1e-5
        )


def test_medusa_head_count_comes_from_the_weights_not_the_config(tmp_path):
    """A hub Medusa config says 2 heads where its weights hold 5; the weights win, and it is noted."""
    state = medusa_state(heads=4, layers=1, hidden=H, vocab=V)
    path = write_medusa(tmp_path / "quirk", state, config=medusa_config(2, 1))
    layout = inspect(str(path), "medusa")
    assert layout.num_heads == 4
    assert layout.provenance()["notes"] == [
        "config.json says medusa_num_heads=2; the weights hold 4 (read from the weights)"
    ]
    assert "index_sha256" not in layout.provenance()
    # a second heads file beside the one read: the record says which was read
    from safetensors.torch import save_file

    save_file(medusa_state(heads=3, layers=1, hidden=H, vocab=V), str(path / "medusa_lm_head.safetensors"))
    both = inspect(str(path), "medusa")
    assert both.num_heads == 3 and [f.name for f in both.files] == ["medusa_lm_head.safetensors"]
    assert both.notes[-1] == "medusa_lm_head.pt left unread: medusa_lm_head.safetensors is read first"


def test_medusa2_full_model_heads_are_read_from_the_weight_shards(tmp_path, target):
    from safetensors.torch import load_file, save_file

    ckpt = tiny_checkpoint(tmp_path / "medusa2")
    weights = load_file(str(ckpt / "model.safetensors"))
    heads = medusa_state(heads=2, layers=1, hidden=H, vocab=259, seed=3)
    weights.update({f"medusa_head.{k}": v.clone() for k, v in heads.items()})
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "medusa_num_heads": 2, "medusa_num_layers": 1}))
    layout = inspect(str(ckpt), "medusa")
    assert layout.format == "medusa-full-model" and layout.num_heads == 2 and layout.vocab_size == 259
    assert any(n.startswith("a Medusa-2 full model: only its medusa_head.* tensors are read") for n in layout.notes)
    base = build_tiny_model(seed=0, vocab_size=259)
    art = load_configured_heads("medusa", {"artifact": str(ckpt)}, model=base, tokenizer=None)
    h = torch.randn(1, H)
    torch.testing.assert_close(medusa_logits(art.heads, base, 1, h), medusa_reference(heads, 1, 1, h))


def test_a_medusa2_folder_with_both_weight_files_reads_the_safetensors_one_as_by_hub_id(tmp_path, target):
    from safetensors.torch import save_file

    folder = tmp_path / "medusa2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(medusa_config(2, 1)))
    current = medusa_state(heads=2, layers=1, hidden=H, vocab=V, seed=1)
    older = medusa_state(heads=2, layers=1, hidden=H, vocab=V, seed=2)
    save_file({f"medusa_head.{k}": v.clone() for k, v in current.items()}, str(folder / "model.safetensors"))
    torch.save({f"medusa_head.{k}": v.clone() for k, v in older.items()}, folder / "pytorch_model.bin")
    layout = inspect(str(folder), "medusa")
    assert [f.name for f in layout.files] == ["model.safetensors"]
    assert layout.notes[-1] == "pytorch_model.bin left unread: model.safetensors is read first"
    art = load_configured_heads("medusa", {"artifact": str(folder)}, model=target, tokenizer=None)
    assert sorted(art.manifest["files"]) == ["model.safetensors"]
    h = torch.randn(1, H)
    torch.testing.assert_close(medusa_logits(art.heads, target, 1, h), medusa_reference(current, 1, 1, h))
    assert not torch.equal(art.heads.blocks[0][0].linear.weight, older["0.0.linear.weight"])


def test_medusa2_sharded_full_model_with_a_head_shard_absent_is_refused_naming_it(tmp_path, monkeypatch):
    """A sharded Medusa-2 checkpoint whose index puts the heads in a shard that is not there: a local
    directory lacking it, or a hub repository offline with that shard uncached, is refused in one line."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    from safetensors.torch import save_file

    import harness.heads.published as published

    folder = tmp_path / "medusa2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    heads = medusa_state(heads=2, layers=1, hidden=H, vocab=V, seed=3)
    save_file({"model.norm.weight": torch.ones(H)}, str(folder / "model-00001-of-00002.safetensors"))
    weight_map = {"model.norm.weight": "model-00001-of-00002.safetensors"}
    weight_map.update({f"medusa_head.{k}": "model-00002-of-00002.safetensors" for k in heads})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        ArtifactError,
        match=r"its weight index lists medusa_head\.\* tensors in model-00002-of-00002\.safetensors, which the "
        r"directory lacks",
    ):
        inspect(str(folder), "medusa")
    save_file({f"medusa_head.{k}": v for k, v in heads.items()}, str(folder / "model-00002-of-00002.safetensors"))
    assert inspect(str(folder), "medusa").num_heads == 2  # complete: read
    index_digest = hashlib.sha256((folder / "model.safetensors.index.json").read_bytes()).hexdigest()
    assert inspect(str(folder), "medusa").provenance()["index_sha256"] == index_digest  # it named the shards read

    (folder / "model-00002-of-00002.safetensors").unlink()

    def cached_only(repo, filename, local_files_only=False):
        if (folder / filename).is_file():
            return str(folder / filename)
        raise LocalEntryNotFoundError(f"{filename} is not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cached_only)
    monkeypatch.setattr(published, "hub_unreachable", lambda: "huggingface.co:443: Name or service not known")
    with pytest.raises(
        ArtifactError,
        match=r"^hub repository 'someone/medusa2': model\.safetensors\.index\.json lists medusa_head\.\* tensors in "
        r"model-00002-of-00002\.safetensors, not in the local hub cache and the hub cannot be reached "
        r"\(huggingface\.co:443: Name or service not known\): download the repository first",
    ):
        inspect("someone/medusa2", "medusa")


@pytest.mark.parametrize(
    "tamper, match",
    [
        (
            lambda s: s.update({"1.0.linear.weights": s.pop("1.0.linear.weight")}),
            r"missing tensor\(s\) \['1\.0\.linear\.weight'\]",
        ),
        (lambda s: s.update({"0.0.extra.weight": torch.zeros(2)}), r"unexpected tensor\(s\) \['0\.0\.extra\.weight'\]"),
        (
            lambda s: s.update({"2.1.weight": torch.zeros(V - 1, H)}),
            r"2\.1\.weight has shape \[95, 32\], expected \[96, 32\]",
        ),
        (
            lambda s: s.update({"1.0.linear.bias": torch.zeros(H + 1)}),
            r"1\.0\.linear\.bias has shape \[33\], expected \[32\]",
        ),
    ],
    ids=["renamed-key", "extra-key", "wrong-vocab-rows", "wrong-bias"],
)
def test_a_tampered_medusa_checkpoint_is_refused(tmp_path, tamper, match):
    state = medusa_state(heads=3, layers=1, hidden=H, vocab=V)
    tamper(state)
    path = write_medusa(tmp_path / "bad", state, config=medusa_config(3, 1))
    with pytest.raises(ArtifactError, match=match):
        inspect(str(path), "medusa")


def test_malformed_published_heads_are_refused_naming_file_key_or_field(tmp_path):
    """Each refusal is an ArtifactError (one line, exit 2), never a KeyError or a library error."""
    good = medusa_state(heads=3, layers=1, hidden=H, vocab=V)

    def written(name, state=None, config=None, fmt="pt"):
        return write_medusa(tmp_path / name, state or good, config=config or medusa_config(3, 1), fmt=fmt)

    as_int = {**good, "1.0.linear.weight": good["1.0.linear.weight"].to(torch.int64)}
    for fmt in ("pt", "safetensors"):  # the dtype is read from the header, before any weight
        with pytest.raises(ArtifactError, match=r"1\.0\.linear\.weight is torch\.int64; weights must be floating"):
            inspect(str(written(f"int-{fmt}", as_int, fmt=fmt)), "medusa")
    no_head0 = {k: v for k, v in good.items() if not k.startswith("0.")}
    with pytest.raises(ArtifactError, match=r"missing tensor\(s\) \['0\.0\.linear\.bias', '0\.0\.linear\.weight'"):
        inspect(str(written("no-head-0", no_head0)), "medusa")
    with pytest.raises(ArtifactError, match=r"medusa_num_heads='three' is not a whole number"):
        inspect(str(written("str-count", config=medusa_config(3, 1, medusa_num_heads="three"))), "medusa")
    skew = {**good, "0.0.linear.weight": torch.randn(H, H + 1)}
    with pytest.raises(ArtifactError, match=rf"0\.0\.linear\.weight has shape \[{H}, {H + 1}\]; a Medusa residual"):
        inspect(str(written("skew", skew)), "medusa")
    with pytest.raises(ArtifactError, match=r"config.json says version='9'; readable Medusa versions: 1 .* and 2 "):
        inspect(str(written("v9", config=medusa_config(3, 1, version="9"))), "medusa")
    # version 1 promises each head's own projection: without its key the file is truncated, not version 2
    no_proj = {k: v for k, v in good.items() if not k.endswith(".1.weight")}
    with pytest.raises(ArtifactError, match=r"says version 1 .* but the weights hold no 0\.1\.weight: the file is"):
        inspect(str(written("v1-cut", no_proj, config=medusa_config(3, 1, version="1"))), "medusa")
    unsaid = inspect(str(written("v-unsaid", no_proj)), "medusa")  # no version: read as 2, and said so
    assert unsaid.format == "medusa-heads-v2"
    assert unsaid.provenance()["notes"] == [
        "the weights hold no 0.1.weight and config.json names no version: read as version 2 (heads projecting "
        "with the target's LM head)"
    ]
    listed = written("list")
    (listed / "config.json").write_text("[3, 1]")
    with pytest.raises(ArtifactError, match=r"list/config.json' holds a JSON list, not an object"):
        inspect(str(listed), "medusa")
    zero = written("zero", fmt="safetensors")
    (zero / "medusa_lm_head.safetensors").write_bytes(b"")
    with pytest.raises(ArtifactError, match=r"cannot read '.*zero/medusa_lm_head.safetensors' as a safetensors file"):
        inspect(str(zero), "medusa")
    nan = {k: v.clone() for k, v in good.items()}
    nan["2.0.linear.weight"][1, 1] = float("inf")
    layout = inspect(str(written("inf", nan)), "medusa")  # shapes and dtypes pass; the values are read at load
    with pytest.raises(ArtifactError, match=r"inf'.*2\.0\.linear\.weight holds 1 non-finite value"):
        load_published_heads(layout, model=build_tiny_model(seed=0, vocab_size=V))


def test_heads_for_another_target_are_refused_with_expected_and_got(tmp_path):
    geo = tiny_geometry()
    wide = write_medusa(
        tmp_path / "wide", medusa_state(heads=3, layers=1, hidden=64, vocab=V), config=medusa_config(3, 1)
    )
    with pytest.raises(ArtifactError, match="has hidden size 64; the target's is 32"):
        check_target(inspect(str(wide), "medusa"), geo, depth=2)
    big = write_medusa(
        tmp_path / "big", medusa_state(heads=3, layers=1, hidden=H, vocab=128), config=medusa_config(3, 1)
    )
    with pytest.raises(ArtifactError, match="projects to 128 tokens; the target's vocabulary has 96"):
        check_target(inspect(str(big), "medusa"), geo, depth=2)
    ok = write_medusa(tmp_path / "ok", medusa_state(heads=3, layers=1, hidden=H, vocab=V), config=medusa_config(3, 1))
    with pytest.raises(ArtifactError, match="drafts 4 tokens deep but .* has 3 heads"):
        check_target(inspect(str(ok), "medusa"), geo, depth=4)


def test_a_mismatched_checkpoint_is_refused_before_any_model_work(tmp_path, monkeypatch, capsys):
    import harness.runner as runner
    from harness.app import run_main

    def no_models(cfg, **_):
        raise AssertionError("models were loaded")

    monkeypatch.setattr(runner, "load_models", no_models)
    wide = write_medusa(
        tmp_path / "wide", medusa_state(heads=3, layers=1, hidden=64, vocab=V), config=medusa_config(3, 1)
    )
    run_dir = tmp_path / "run"
    code = run_main(["model=tiny", "proposer=medusa", f"proposer.artifact={wide}", f"output_dir={run_dir}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "hidden size 64; the target's is 32" in err[0]
    assert not run_dir.exists() or not any(run_dir.iterdir())
    ok = write_medusa(tmp_path / "ok", medusa_state(heads=3, layers=1, hidden=H, vocab=V), config=medusa_config(3, 1))
    code = run_main(
        ["model=tiny", "proposer=medusa", f"proposer.artifact={ok}", "topology=choices"]
        + ["topology.choices=[[0],[0,0],[0,0,0],[0,0,0,0]]", f"output_dir={run_dir}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "drafts 4 tokens deep" in err[0]
    # a chain deeper than the bank drafts as deep as the bank reaches, as heads trained here do
    cfg = compose(["model=tiny", "proposer=medusa", f"proposer.artifact={ok}", "topology=sequence"])
    assert cfg.topology.max_depth > 3
    plan(cfg)


def test_a_hub_id_that_cannot_be_fetched_is_one_clear_refusal(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert is_published("nobody-here/medusa-heads-that-do-not-exist")
    with pytest.raises(ArtifactError, match="is not a local directory"):
        inspect("nobody-here/medusa-heads-that-do-not-exist", "medusa")


# --------------------------------------------------------------------------- Hydra


def hydra_reference(state, k, layers, ctx, embs, *, grounded, arch="mlp"):
    """Hydra head k: grounded input cat(ctx, E(x_t), ..., E(x_{t+k})); first block R(x) + SiLU(Wx+b),
    later blocks x + SiLU(Wx+b); biased vocabulary head."""
    step, first = (2, 1) if arch == "prefix-mlp" else (1, 0)
    x = torch.cat([ctx] + [embs[:, i] for i in range(k + 1)], dim=-1) if grounded else ctx
    for j in range(layers):
        key = f"hydra_mlp.{k}.{first + step * j}"
        lin = x @ state[f"{key}.linear.weight"].T + state[f"{key}.linear.bias"]
        res = (
            x @ state[f"{key}.res_connection.weight"].T + state[f"{key}.res_connection.bias"]
            if j == 0 and grounded
            else x
        )
        x = res + silu(lin)
    head = f"hydra_lm_head.{k}.1" if arch == "prefix-mlp" else f"hydra_lm_head.{k}"
    return x @ state[f"{head}.weight"].T + state[f"{head}.bias"]


def test_heads_made_for_another_base_model_are_warned_about_on_stderr(tmp_path, target, capsys):
    """The record kept the evidence (input_embed_matches_target, base_model_name_or_path) but
    nothing said so while the run went on with near-zero acceptance."""
    embed = target.get_input_embeddings().weight
    state = hydra_state(heads=3, layers=1, hidden=H, vocab=V, grounded=True, embed=embed + 1.0, seed=4)
    path = write_hydra(tmp_path / "hydra", state, config=hydra_config(3, 1, grounded=True))
    art = load_configured_heads("hydra", {"artifact": str(path)}, model=target, tokenizer=None)
    assert art.manifest["input_embed_matches_target"] is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"harness: warning: the published hydra at {path} looks made for another"
    )
    assert "their saved input embedding differs from the target's" in err[0]
    state = hydra_state(heads=3, layers=1, hidden=H, vocab=V, grounded=True, embed=embed, seed=4)
    same = write_hydra(tmp_path / "same", state, config=hydra_config(3, 1, grounded=True))
    load_configured_heads("hydra", {"artifact": str(same)}, model=target, tokenizer=None)
    assert capsys.readouterr().err == ""
    original = target.config._name_or_path
    target.config._name_or_path = "/models/vicuna-7b-v1.3"
    try:
        config = {**hydra_config(3, 1, grounded=True), "base_model_name_or_path": "lmsys/vicuna-13b-v1.3"}
        other = write_hydra(tmp_path / "other", state, config=config)
        load_configured_heads("hydra", {"artifact": str(other)}, model=target, tokenizer=None)
        assert "they name lmsys/vicuna-13b-v1.3 as their base model; the target is /models/vicuna-7b-v1.3" in (
            capsys.readouterr().err
        )
        config["base_model_name_or_path"] = "lmsys/vicuna-7b-v1.3"  # the same model by hub id and by path
        load_configured_heads(
            "hydra", {"artifact": str(write_hydra(tmp_path / "o2", state, config=config))}, model=target, tokenizer=None
        )
        assert capsys.readouterr().err == ""
        # the embedded SmolLM2 loads from a converted folder in the cache: heads naming its hub id are for it
        converted = tmp_path / "smollm2-0123456789abcdef"
        converted.mkdir()
        (converted / "harness_conversion.json").write_text("{}")
        target.config._name_or_path = str(converted)
        config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
        load_configured_heads(
            "hydra", {"artifact": str(write_hydra(tmp_path / "o3", state, config=config))}, model=target, tokenizer=None
        )
        assert capsys.readouterr().err == ""
        config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-360M-Instruct"
        load_configured_heads(
            "hydra", {"artifact": str(write_hydra(tmp_path / "o4", state, config=config))}, model=target, tokenizer=None
        )
        assert (
            f"the target is {converted} (converted from HuggingFaceTB/SmolLM2-135M-Instruct)" in capsys.readouterr().err
        )
    finally:
        target.config._name_or_path = original
    # heads saved in half precision hold the target's embedding rounded: that is the target's, not another's
    for dtype in (torch.float16, torch.bfloat16):
        state = hydra_state(heads=3, layers=1, hidden=H, vocab=V, grounded=True, embed=embed, seed=4)
        half = write_hydra(
            tmp_path / f"half-{dtype}",
            {k: v.to(dtype) for k, v in state.items()},
            config=hydra_config(3, 1, grounded=True),
        )
        art = load_configured_heads("hydra", {"artifact": str(half)}, model=target, tokenizer=None)
        assert art.manifest["input_embed_matches_target"] is True and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "grounded, layers", [(True, 1), (True, 3), (False, 2)], ids=["grounded-L1", "grounded-L3", "ungrounded-L2"]
)
def test_hydra_mlp_heads_run_the_published_forward(tmp_path, target, grounded, layers):
    embed = target.get_input_embeddings().weight
    state = hydra_state(heads=3, layers=layers, hidden=H, vocab=V, grounded=grounded, embed=embed, seed=4)
    path = write_hydra(tmp_path / "hydra", state, config=hydra_config(3, layers, grounded=grounded))
    art = load_configured_heads("hydra", {"artifact": str(path)}, model=target, tokenizer=None)
    assert art.heads.spec.dependent is grounded and art.manifest["format"] == "hydra-mlp"
    assert art.manifest["input_embed_matches_target"] is True
    ctx = torch.randn(2, H)
    embs = target.get_input_embeddings()(torch.tensor([[4, 9, 17, 3], [8, 2, 40, 41]])).float()  # [2, 4, d]
    for k in range(3):
        out = art.heads.depth(k + 1, ctx, embs)
        got = art.heads.vocab_logits([k + 1] * 2, out, target.get_output_embeddings())
        want = hydra_reference(state, k, layers, ctx, embs, grounded=grounded)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hydra_refuses_unread_architectures_and_offsets(tmp_path):
    state = hydra_state(heads=2, layers=1, hidden=H, vocab=V)
    path = write_hydra(tmp_path / "x", state, config=hydra_config(2, 1, arch="cross-attn"))
    with pytest.raises(ArtifactError, match="hydra_head_arch='cross-attn' is not read here"):
        inspect(str(path), "hydra")
    path = write_hydra(tmp_path / "y", state, config=hydra_config(2, 1, hidden_state_offset=1))
    with pytest.raises(ArtifactError, match="hidden_state_offset=1 is not read here"):
        inspect(str(path), "hydra")
    path = write_hydra(
        tmp_path / "z", {**state, "hydra_mlp.0.0.res_connection.weight": torch.zeros(H, H)}, config=hydra_config(2, 1)
    )
    with pytest.raises(ArtifactError, match="res_connection.weight has shape \\[32, 32\\], expected \\[32, 64\\]"):
        inspect(str(path), "hydra")


def rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def llama_layer_reference(state, x, config):
    """Hydra's one-layer prefix model on rows x [T, d] at positions 0..T-1, in plain tensors:
    pre-norm causal GQA attention with rotary embeddings, SwiGLU MLP, final RMSNorm."""
    p = "prefix_embeding_layer"
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    hd = config.hidden_size // nh
    eps = config.rms_norm_eps
    t = x.shape[0]
    inv = state[f"{p}.layers.0.self_attn.rotary_emb.inv_freq"]
    ang = torch.arange(t).float()[:, None] * inv[None]  # [T, hd/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(q):  # [heads, T, hd]
        half = torch.cat([-q[..., hd // 2 :], q[..., : hd // 2]], -1)
        return q * cos + half * sin

    h = rms(x, state[f"{p}.layers.0.input_layernorm.weight"], eps)
    q = (h @ state[f"{p}.layers.0.self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
    k = (h @ state[f"{p}.layers.0.self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
    v = (h @ state[f"{p}.layers.0.self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    o = (att @ v).transpose(0, 1).reshape(t, nh * hd) @ state[f"{p}.layers.0.self_attn.o_proj.weight"].T
    x = x + o
    m = rms(x, state[f"{p}.layers.0.post_attention_layernorm.weight"], eps)
    g = m @ state[f"{p}.layers.0.mlp.gate_proj.weight"].T
    u = m @ state[f"{p}.layers.0.mlp.up_proj.weight"].T
    x = x + (silu(g) * u) @ state[f"{p}.layers.0.mlp.down_proj.weight"].T
    return rms(x, state[f"{p}.norm.weight"], eps)


def prefix_hydra(tmp_path, target, *, layers=2):
    state = hydra_state(
        heads=3,
        layers=layers,
        hidden=H,
        vocab=V,
        arch="prefix-mlp",
        embed=target.get_input_embeddings().weight,
        prefix=hydra_prefix_state(target, seed=5),
        seed=6,
    )
    return state, write_hydra(tmp_path / "hydra-prefix", state, config=hydra_config(3, layers, arch="prefix-mlp"))


def test_hydra_prefix_layer_runs_incrementally_as_the_published_one_layer_llama(tmp_path, target):
    state, path = prefix_hydra(tmp_path, target)
    layout = inspect(str(path), "hydra")
    assert layout.format == "hydra-prefix-mlp" and layout.num_layers == 2
    check_target(layout, tiny_geometry(), depth=3)
    art = load_configured_heads("hydra", {"artifact": str(path)}, model=target, tokenizer=None)
    rows = torch.randn(7, H)
    want = llama_layer_reference(state, rows, target.config)  # [7, d]
    cache = art.heads.new_prefix_cache()
    first = art.heads.prefix_step(rows[:4], torch.arange(4), cache)
    second = art.heads.prefix_step(rows[4:], torch.arange(4, 7), cache)
    torch.testing.assert_close(torch.cat([first, second]), want, rtol=1e-4, atol=1e-5)
    embs = target.get_input_embeddings()(torch.tensor([[4, 9, 17]])).float()
    out = art.heads.depth(2, want[-1:], embs)
    got = art.heads.vocab_logits([2], out, target.get_output_embeddings())
    torch.testing.assert_close(got, hydra_reference(state, 1, 2, want[-1:], embs, grounded=True, arch="prefix-mlp"))


def test_the_prefix_layer_reads_the_prompt_at_the_requests_start_in_prefill(tmp_path, target):
    """The prefix layer's forward over the prompt's rows runs in ``start``, inside the prefill the
    arm times, as a draft model's prompt forward does: the first round feeds it no row, later rounds
    the rows they committed; the output stays the target's."""
    from harness.engine.decode import RoundConfig, decode
    from harness.heads.checkpoint import target_fingerprint
    from harness.proposers.base import NullProposer
    from harness.proposers.heads import HydraProposer
    from harness.random_source import TorchRandomSource
    from harness.target.backend import CausalLMBackend
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    _, path = prefix_hydra(tmp_path, target)
    art = load_configured_heads("hydra", {"artifact": str(path)}, model=target, tokenizer=None)
    budget = Budget(shape="sequence", max_nodes=3, max_depth=3)
    p = HydraProposer(
        budget=budget,
        manifest_hash="h",
        policy=SamplingPolicy(),
        model=target,
        heads=art.heads,
        checkpoint=target_fingerprint(target),
        artifact_manifest=art.manifest,
    )
    assert p.prefix_feed
    fed_before = []
    propose = p.propose

    def spy(committed, rng):
        fed_before.append((len(committed), p.stats.extras.get("prefix_rows_fed", 0)))
        return propose(committed, rng)

    p.propose = spy
    prompt = [3, 9, 14, 27, 5, 11, 30, 8, 19]

    def decode_with(proposer):
        return decode(
            target=CausalLMBackend(target),
            proposer=proposer,
            verifier=get_verifier("greedy"),
            policy=SamplingPolicy(),
            prompt_ids=prompt,
            max_new_tokens=10,
            eos_token_ids=frozenset(),
            rng=TorchRandomSource(0),
            round_cfg=RoundConfig(max_nodes=3, max_depth=3),
        )

    res = decode_with(p)
    assert fed_before[0] == (len(prompt), len(prompt) - 1)  # every prompt row but the pending one, before round 1
    # a later round feeds the rows the last one committed, inside its own proposal
    assert [fed for _, fed in fed_before[1:]] == [n - 1 for n, _ in fed_before[:-1]]
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    assert res.tokens == decode_with(null).tokens


def test_ungrounded_prefix_mlp_heads_say_they_read_the_prefix_layer_as_trained(tmp_path, target):
    """Hydra's ungrounded generation passes its heads the target's hidden state, skipping the prefix layer
    its training forward runs them after; the heads here read the prefix layer's output, and a loaded bank
    says so (a grounded one, read as Hydra generates with it, says nothing)."""
    note = (
        "ungrounded prefix-mlp heads read the prefix layer's output, as Hydra's training forward does; Hydra's "
        "own ungrounded generation passes them the target's hidden state instead"
    )
    _, grounded = prefix_hydra(tmp_path, target)
    assert note not in inspect(str(grounded), "hydra").notes
    state = hydra_state(
        heads=3,
        layers=2,
        hidden=H,
        vocab=V,
        arch="prefix-mlp",
        grounded=False,
        prefix=hydra_prefix_state(target, seed=5),
        seed=6,
    )
    path = write_hydra(tmp_path / "ungrounded", state, config=hydra_config(3, 2, arch="prefix-mlp", grounded=False))
    assert note in inspect(str(path), "hydra").notes
    art = load_configured_heads("hydra", {"artifact": str(path)}, model=target, tokenizer=None)
    assert note in art.manifest["notes"]


def test_prefix_mlp_weights_under_a_config_without_their_arch_are_refused_naming_it(tmp_path, target):
    """A prefix-mlp bank whose config names no hydra_head_arch (so mlp) was refused for a missing
    hydra_lm_head.0.weight, pointing at the weights rather than the config's one missing key."""
    state, _ = prefix_hydra(tmp_path, target)
    for name, config in (
        ("unsaid", {k: v for k, v in hydra_config(3, 2).items() if k != "hydra_head_arch"}),
        ("mlp", hydra_config(3, 2, arch="mlp")),
    ):
        path = write_hydra(tmp_path / name, state, config=config)
        with pytest.raises(ArtifactError) as err:
            inspect(str(path), "hydra")
        said = "names no hydra_head_arch (mlp)" if name == "unsaid" else "says hydra_head_arch=mlp"
        assert str(err.value).endswith(
            f"the weights are a prefix-mlp Hydra bank (hydra_lm_head.0.1.*, prefix_embeding_layer.*) but config.json "
            f'{said}: set "hydra_head_arch": "prefix-mlp" in it'
        )


def test_hydra_prefix_layer_with_other_rotary_frequencies_is_refused(tmp_path, target):
    state, path = prefix_hydra(tmp_path, target)
    state["prefix_embeding_layer.layers.0.self_attn.rotary_emb.inv_freq"] *= 2.0
    bad = write_hydra(tmp_path / "bad-rope", state, config=hydra_config(3, 2, arch="prefix-mlp"))
    with pytest.raises(ArtifactError, match="rotary frequencies differ"):
        load_configured_heads("hydra", {"artifact": str(bad)}, model=target, tokenizer=None)
    state, _ = prefix_hydra(tmp_path, target)
    del state["prefix_embeding_layer.norm.weight"]
    bad = write_hydra(tmp_path / "no-norm", state, config=hydra_config(3, 2, arch="prefix-mlp"))
    with pytest.raises(ArtifactError, match=r"missing tensor\(s\) \['prefix_embeding_layer.norm.weight'\]"):
        inspect(str(bad), "hydra")


@pytest.mark.parametrize("gate", [torch.tensor(1.0), torch.ones(64 * H)], ids=["0-d", "1-d"])
def test_a_prefix_layer_gate_that_is_not_a_matrix_is_refused_in_one_line(tmp_path, target, capsys, gate):
    """A 0-dimensional gate_proj weight, whose rows give the prefix layer's intermediate size, raised
    an IndexError (exit 1) where `harness run` plans; a 1-dimensional one was held to a shape derived
    from its own length."""
    from harness.app import run_main

    state, _ = prefix_hydra(tmp_path, target)
    state["prefix_embeding_layer.layers.0.mlp.gate_proj.weight"] = gate
    bad = write_hydra(tmp_path / "gate", state, config=hydra_config(3, 2, arch="prefix-mlp"))
    said = (
        f"proposer.artifact='{bad}' (hydra-prefix-mlp): prefix_embeding_layer.layers.0.mlp.gate_proj.weight has "
        f"shape {list(gate.shape)}, expected [intermediate, {H}]"
    )
    with pytest.raises(ArtifactError) as err:
        inspect(str(bad), "hydra")
    assert str(err.value) == said
    run_dir = tmp_path / "run"
    code = run_main(["model=tiny", "proposer=hydra", f"proposer.artifact={bad}", f"output_dir={run_dir}"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "compiling the native" not in line]
    assert code == 2 and err == [f"harness run: refused: {said}"]


@pytest.mark.parametrize("saved", [torch.float16, torch.bfloat16])
def test_hydra_prefix_bank_saved_in_half_precision_loads_and_keeps_float32_rotary(tmp_path, target, saved):
    """Hydra casts its heads, the prefix layer's rotary buffer included, to the base model's dtype
    before saving: the frequencies are compared at the saved precision, and the loaded heads keep
    float32 ones under any later cast, so their RoPE angles are the target's at long positions."""
    state, _ = prefix_hydra(tmp_path, target)
    half = {k: v.to(saved) for k, v in state.items()}
    path = write_hydra(tmp_path / f"hydra-{saved}", half, config=hydra_config(3, 2, arch="prefix-mlp"))
    art = load_configured_heads("hydra", {"artifact": str(path)}, model=target, tokenizer=None)
    want = target.model.rotary_emb.inv_freq.float()
    for heads in (art.heads, art.heads.to(torch.bfloat16)):
        inv = heads.prefix_model.rotary_emb.inv_freq
        assert inv.dtype == torch.float32
        torch.testing.assert_close(inv, want, rtol=0, atol=0)
    assert art.heads.to(torch.bfloat16).blocks[0][0].linear.weight.dtype == torch.bfloat16
    half["prefix_embeding_layer.layers.0.self_attn.rotary_emb.inv_freq"] *= 1.05  # another theta, still refused
    bad = write_hydra(tmp_path / f"bad-{saved}", half, config=hydra_config(3, 2, arch="prefix-mlp"))
    with pytest.raises(ArtifactError, match="rotary frequencies differ"):
        load_configured_heads("hydra", {"artifact": str(bad)}, model=target, tokenizer=None)


# --------------------------------------------------------------------------- end to end


def run_published(tmp_path, monkeypatch, kind, path, *extra):
    import harness.prepare.heads as prepare_heads
    from harness.runner import run_job

    def no_training(*a, **k):
        raise AssertionError("a published checkpoint was trained")

    monkeypatch.setattr(prepare_heads, "train_artifact", no_training)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        ["model=tiny", f"proposer={kind}", f"proposer.artifact={path}", "workload.limit=2"]
        + ["generation.max_new_tokens=16", "gates.oracle=false", *extra]
    )
    return run_job(cfg, run_dir=tmp_path / "run")


@pytest.mark.parametrize(
    "kind, topology",
    [
        ("medusa", ["topology=choices", "topology.choices_file={tree63}"]),
        ("medusa", ["topology=cartesian", "topology.widths=[3,2,2]"]),
        ("hydra", ["topology=choices", "topology.choices=[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]"]),
        ("hydra-prefix", ["topology=sequence", "topology.max_nodes=3", "topology.max_depth=3"]),
    ],
    ids=["medusa-choices-file-63", "medusa-cartesian", "hydra-choices", "hydra-prefix-chain"],
)
def test_published_heads_run_end_to_end_with_provenance(tmp_path, monkeypatch, target, kind, topology):
    tree63 = write_choices(tmp_path / "tree63.json", best_first_choices(63))  # Medusa's kind of tree, built here
    topology = [o.format(tree63=tree63) for o in topology]
    if kind == "medusa":
        state = medusa_state(heads=4, layers=1, hidden=H, vocab=V)
        path = write_medusa(tmp_path / "heads", state, config=medusa_config(4, 1))
    elif kind == "hydra":
        state = hydra_state(heads=3, layers=1, hidden=H, vocab=V, embed=target.get_input_embeddings().weight)
        path = write_hydra(tmp_path / "heads", state, config=hydra_config(3, 1))
    else:
        _, path = prefix_hydra(tmp_path, target)
    record = run_published(tmp_path, monkeypatch, kind.split("-")[0], path, *topology)
    m = record["metrics"]
    assert m["greedy_identical"] is True and m["cpu_budget_artifact"] is False
    assert m["rounds"] > 0 and m["mean_candidate_rows"] > 0
    prov = record["manifest"]["proposer_artifact"]
    assert prov["source"] == "published" and prov["ref"] == str(path) and prov["base_model_name_or_path"] == "tiny"
    for name, digest in prov["files"].items():
        assert digest == hashlib.sha256((path / name).read_bytes()).hexdigest()
    assert record["artifacts"]["proposer_artifact"]["files"] == prov["files"]
    # the manifest's proposer options are the shape that ran: the bank's, not the configured defaults
    ran = record["manifest"]["proposer"]
    assert (ran["num_heads"], ran["mlp_layers"]) == (prov["num_heads"], prov["num_layers"])
    assert "overridden_by_checkpoint" not in ran and record["inert_options"] == []  # no shape option was set
    extras = m["retrieval"]
    assert extras["hidden_misses"] == 0 and extras["head_stages"] > 0
    if kind == "hydra-prefix":  # the prefix layer saw every committed row before the last, once
        assert m["proposal_state_bytes"] > 0 and extras["prefix_rows_fed"] > 0


def test_hydra_plus_plus_switches_on_a_published_bank_are_refused_and_its_shape_options_listed_as_inert(
    tmp_path, target
):
    """A bank's heads, layers and prefix layer are its files': the options that would shape heads
    trained here are listed as having no effect and leave the manifest (and so a sweep's reuse of a
    record) as without them."""
    from harness.manifest import job_manifest
    from harness.runner import inert_options

    state = hydra_state(heads=3, layers=1, hidden=H, vocab=V, embed=target.get_input_embeddings().weight)
    path = write_hydra(tmp_path / "heads", state, config=hydra_config(3, 1))
    base = ["model=tiny", "proposer=hydra", f"proposer.artifact={path}", "topology=sequence", "topology.max_depth=3"]
    for switch in ("distill", "prefix_attention"):
        with pytest.raises(ArtifactError, match=rf"^proposer.{switch}=true trains Hydra\+\+ heads here; "):
            plan(compose([*base, f"proposer.{switch}=true"]))
    stringly = hydra_config(3, 1)
    stringly["grounded_heads"] = "false"  # a string: read as a truth value it would flip the head layout
    odd = write_hydra(tmp_path / "stringly", state, config=stringly)
    with pytest.raises(ArtifactError, match=r"config.json: grounded_heads='false' must be true or false"):
        inspect(str(odd), "hydra")
    shaped = [
        *base,
        "proposer.num_heads=9",
        "proposer.mlp_layers=4",
        "proposer.prefix_window=4",
        "proposer.attn_heads=2",
    ]
    manifest = job_manifest(compose(shaped), versions={})
    assert manifest["proposer"]["num_heads"] == 3 and manifest["proposer"]["mlp_layers"] == 1
    assert manifest == job_manifest(compose(base), versions={})
    why = f"proposer.artifact={path} is a published checkpoint, read as its authors ship it (its shape is read from"
    # a chain deeper than the bank: it drafts one depth per head (a trained bank: proposer.num_heads)
    assert inert_options(compose([*base[:-1], "topology.max_depth=6"])) == [
        "topology.max_depth=6: the hydra bank has 3 heads, one per depth, so the chain drafts 3 deep"
    ]
    assert inert_options(compose(["model=tiny", "proposer=medusa", "topology=sequence", "topology.max_depth=5"])) == [
        "topology.max_depth=5: the medusa bank has 3 heads, one per depth, so the chain drafts 3 deep"
    ]
    assert inert_options(compose(shaped)) == [
        f"proposer.{o}: {why} its files)" for o in ("num_heads=9", "mlp_layers=4", "prefix_window=4", "attn_heads=2")
    ]


def test_training_a_published_checkpoint_is_refused(tmp_path, target):
    from harness.prepare.heads import ensure_heads
    from harness.prepare.trained import Target

    path = write_medusa(tmp_path / "m", medusa_state(heads=3, layers=1, hidden=H, vocab=V), config=medusa_config(3, 1))
    with pytest.raises(ArtifactError, match="is a published medusa checkpoint"):
        ensure_heads("medusa", {"artifact": str(path)}, Target(target, None, "tiny"), force=True)


def test_published_checkpoints_are_read_for_medusa_and_hydra_only(tmp_path):
    from harness.proposers.heads import CloverProposer

    path = write_medusa(tmp_path / "m", medusa_state(heads=3, layers=1, hidden=H, vocab=V), config=medusa_config(3, 1))
    budget = Budget(shape="sequence", max_nodes=2, max_depth=2)
    with pytest.raises(ArtifactError, match="proposer=clover loads artifacts trained here only"):
        CloverProposer.check_plan({"artifact": str(path)}, budget, tiny_geometry)
    with pytest.raises(ArtifactError, match="holds neither a hydra heads file"):
        inspect(str(path), "hydra")


# --------------------------------------------------------------------------- the CPU-budget label


def test_the_cpu_budget_label_follows_recorded_training_not_the_device():
    trained_here = {"kind": "hydra", "tokens_seen": 40_000, "training": {"device": "cuda:0"}}
    assert cpu_budget_label(trained_here) is True
    assert cpu_budget_label({**trained_here, "cpu_budget_artifact": False}) is True  # the record, not the flag
    assert cpu_budget_label({"kind": "hydra", "tokens_seen": 50_000_000, "training": {"device": "cpu"}}) is False
    assert cpu_budget_label({"kind": "layer_skip", "token_budget": 1152}) is True
    assert cpu_budget_label({"source": "published", "format": "medusa-heads"}) is False
    assert cpu_budget_label({"source": "proposer.skip"}) is False


def test_a_cached_hub_repository_with_only_a_pt_heads_file_loads_while_the_hub_is_unreachable(tmp_path, monkeypatch):
    """Offline, a file missing from the cache is a name to skip (the layout's other names are
    tried), not a refusal: a cached Medusa-1 repository ships medusa_lm_head.pt only."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    import harness.heads.published as published

    snapshot = write_medusa(
        tmp_path / "snap", medusa_state(heads=3, layers=1, hidden=H, vocab=V), config=medusa_config(3, 1)
    )
    asked = []

    def cached_only(repo, filename, local_files_only=False):
        asked.append((filename, local_files_only))
        if (snapshot / filename).is_file():
            return str(snapshot / filename)
        raise LocalEntryNotFoundError(f"{filename} is not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cached_only)
    monkeypatch.setattr(published, "hub_unreachable", lambda: "huggingface.co:443: Name or service not known")
    layout = inspect("someone/medusa-heads", "medusa")
    assert layout.files == (snapshot / "medusa_lm_head.pt",) and all(offline for _, offline in asked)
    # the manifest names the snapshot read, not this machine's cache folder (one manifest everywhere)
    provenance = layout.provenance()
    assert provenance["hub_snapshot"] == snapshot.name and "directory" not in provenance
    assert str(tmp_path) not in json.dumps(provenance, default=str)
    monkeypatch.setattr(
        huggingface_hub, "hf_hub_download", lambda *a, **k: (_ for _ in ()).throw(LocalEntryNotFoundError("x"))
    )
    with pytest.raises(ArtifactError, match=r"not in the local hub cache, and the hub cannot be reached \(huggingface"):
        inspect("someone/medusa-heads", "medusa")


def test_a_hydra_grounded_heads_flag_that_disagrees_with_the_weights_is_named(tmp_path, target):
    """The refusal listed res_connection tensors without saying that the config's flag decides
    whether the heads are grounded."""
    embed = target.get_input_embeddings().weight
    grounded = hydra_state(heads=3, layers=1, hidden=H, vocab=V, grounded=True, embed=embed, seed=4)
    config = hydra_config(3, 1, grounded=True)
    del config["grounded_heads"]
    path = write_hydra(tmp_path / "noflag", grounded, config=config)
    with pytest.raises(
        ArtifactError,
        match=r"unexpected tensor\(s\) .*res_connection.* \(config.json has no "
        r"grounded_heads, read as false; the weights hold the grounded heads' res_connection",
    ):
        load_configured_heads("hydra", {"artifact": str(path)}, model=target, tokenizer=None)
    plain = hydra_state(heads=3, layers=1, hidden=H, vocab=V, grounded=False, embed=embed, seed=4)
    path = write_hydra(tmp_path / "wrongflag", plain, config=hydra_config(3, 1, grounded=True))
    with pytest.raises(
        ArtifactError,
        match=r"missing tensor\(s\) .*res_connection.* \(config.json says "
        r"grounded_heads=True; the weights lack",
    ):
        load_configured_heads("hydra", {"artifact": str(path)}, model=target, tokenizer=None)


def test_a_weight_file_holding_a_pickled_module_is_refused_in_one_short_line(tmp_path):
    """torch's own refusal is hundreds of characters with colour codes and advice to unpickle
    unsafely; the harness says what the file is and what to save instead."""
    from harness.heads.eagle_formats import read_weights
    from harness.heads.published import _read_tensors

    torch.save(torch.nn.Linear(2, 2), tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ArtifactError) as err:
        _read_tensors([tmp_path / "medusa_lm_head.pt"], data=True)
    message = str(err.value)
    assert "holds pickled Python objects, not only tensors" in message and "save its state_dict" in message
    assert "\n" not in message and "\x1b" not in message and "weights_only=False" not in message
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text("{}")
    torch.save(torch.nn.Linear(2, 2), eagle / "pytorch_model.bin")
    with pytest.raises(ArtifactError, match="holds pickled Python objects"):
        read_weights(eagle)
    (eagle / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match=r"^cannot read .*pytorch_model.bin' as a tensor file: \w+: .{1,200}$"):
        read_weights(eagle)


def test_a_saved_embedding_is_the_target_s_up_to_rounding_or_quantisation_and_another_model_s_is_not():
    """The embedded SmolLM2's embedding is read from a Q8_0 GGUF: a draft saving the original
    model's embedding (or a bf16 copy of it) differs by the quantisation, not by another model."""
    from harness.heads.published import same_embedding

    gen = torch.Generator().manual_seed(0)
    original = torch.randn(1000, 64, generator=gen) * 0.05
    blocks = original.reshape(-1, 32)  # Q8_0: blocks of 32 values, one scale each, int8 codes
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    q8 = (torch.round(blocks / scale) * scale).reshape(original.shape)
    assert same_embedding(original.to(torch.bfloat16), q8, rows=300)[0]
    assert same_embedding(original, original)[0] and same_embedding(original, original)[1] == 0.0
    other = torch.randn(1000, 64, generator=gen) * 0.05
    same, largest = same_embedding(other, q8, rows=300)
    assert not same and largest > 0.1
    assert not same_embedding(original + 0.01, original)[0]  # a shifted copy is no copy


def test_a_stray_tensor_of_a_head_past_the_last_is_named_as_such(tmp_path):
    """Three complete Medusa heads and one tensor of a fourth were refused for the fourth head's
    missing bias, which reads as a broken head; the refusal says the first three are complete and
    what the fourth holds."""
    state = medusa_state(heads=3, layers=1, hidden=H, vocab=V)
    state["3.0.linear.weight"] = torch.zeros(H, H)
    path = write_medusa(tmp_path / "stray", state, config=medusa_config(3, 1))
    with pytest.raises(
        ArtifactError,
        match=r"missing tensor\(s\) \['3\.0\.linear\.bias', '3\.1\.weight'\] \(heads 0 to 2 complete; head 3 holds "
        r"only \['3\.0\.linear\.weight'\]: a truncated file, or a stray tensor of a head that does not exist, read "
        r"as 4 heads\)",
    ):
        inspect(str(path), "medusa")
    # a head missing in the middle is no such case: the plain list of what is missing
    gap = {k: v for k, v in medusa_state(heads=3, layers=1, hidden=H, vocab=V).items() if k != "1.0.linear.bias"}
    with pytest.raises(ArtifactError, match=r"missing tensor\(s\) \['1\.0\.linear\.bias'\]$"):
        inspect(str(write_medusa(tmp_path / "gap", gap, config=medusa_config(3, 1))), "medusa")


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_the_precision_published_heads_were_stored_in_is_recorded(tmp_path, target, fmt):
    """Heads shipped in bf16 run in the target's dtype; their provenance says what the files held."""
    state = medusa_state(heads=3, layers=1, hidden=H, vocab=V)
    state = {k: v.to(torch.bfloat16) if k.endswith("weight") else v for k, v in state.items()}
    path = write_medusa(tmp_path / "bf16", state, config=medusa_config(3, 1), fmt=fmt)
    prov = inspect(str(path), "medusa").provenance()
    assert prov["saved_dtypes"] == {"bfloat16": 6, "float32": 3}  # 3 square weights + 3 projections; 3 biases
    art = load_configured_heads("medusa", {"artifact": str(path)}, model=target, tokenizer=None)
    assert art.manifest["saved_dtypes"] == prov["saved_dtypes"]
    assert next(art.heads.parameters()).dtype == next(target.parameters()).dtype == torch.float32
