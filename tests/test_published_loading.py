"""How a published draft's files are read: a shard index decides which shard each tensor comes from,
a weight file left unread is said, EAGLE-3's ``t2d`` is checked against ``d2t``, a draft naming
another verifier is warned about, a partly cached hub snapshot is refused as not cached, and a draft
by hub id loads at the snapshot the run manifest recorded (a local hub cache of two commits, read
offline). Checkpoints are written by the tests (builders in test_eagle and checkpoint_fixtures)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_fixtures import medusa_config, medusa_state, write_medusa
from safetensors.torch import save_file
from test_eagle import eagle3_checkpoint, eagle12_state, llama_fields, write_published

import harness.target.loading as loading
from harness.heads.artifacts import load_configured_eagle, load_configured_heads
from harness.heads.checkpoint import ArtifactError
from harness.target.loading import build_tiny_model


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=1)


@pytest.fixture(autouse=True)
def _fresh_pins(monkeypatch):
    """Each test binds hub ids in a registry of its own."""
    monkeypatch.setattr(loading, "_PINNED_SNAPSHOTS", {}, raising=False)


def two_drafts(model):
    emb = model.get_input_embeddings().weight.detach()
    return eagle12_state(model.config, embed=emb, seed=0), eagle12_state(model.config, embed=emb, seed=1)


def sharded(path, config: dict, shards: dict[str, dict], weight_map: dict[str, str], *, fmt="safetensors"):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    for name, part in shards.items():
        if fmt == "safetensors":
            save_file(part, str(path / name))
        else:
            torch.save(part, path / name)
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (path / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_sharded_draft_takes_each_tensor_from_the_shard_its_index_names(model, tmp_path, capsys, fmt):
    """Every tensor of every shard was merged, the last shard winning: a stray copy in another shard
    replaced the one the index names, and a tensor the index lists that no shard holds went unseen
    (an EAGLE-1/2 draft counts its layers from the weights found)."""
    a, b = two_drafts(model)
    ext = "safetensors" if fmt == "safetensors" else "bin"
    s1, s2 = f"model-00001-of-00002.{ext}", f"model-00002-of-00002.{ext}"
    keys = sorted(a)
    first, second = keys[: len(keys) // 2], keys[len(keys) // 2 :]
    assert "fc.weight" in first
    weight_map = {**{k: s1 for k in first}, **{k: s2 for k in second}}
    shards = {s1: {k: a[k] for k in first}, s2: {**{k: a[k] for k in second}, "fc.weight": b["fc.weight"]}}
    path = sharded(tmp_path / "dup", llama_fields(model.config), shards, weight_map, fmt=fmt)
    art = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    assert torch.equal(art.draft.state_dict()["fc.weight"], a["fc.weight"])
    assert sorted(art.manifest["files_sha256"]) == [s1, s2]
    note = next(n for n in art.manifest["notes"] if n.startswith(f"fc.weight in {s2} not read"))
    assert note in capsys.readouterr().err

    # the index lists a tensor its shard does not hold: refused naming both
    only = f"model-00001-of-00001.{ext}"
    weight_map = {**{k: only for k in a}, "layers.1.mlp.up_proj.weight": only}
    path = sharded(tmp_path / "lacking", llama_fields(model.config), {only: a}, weight_map, fmt=fmt)
    with pytest.raises(ArtifactError, match=rf"assigns layers\.1\.mlp\.up_proj\.weight to {only}, which does not hold"):
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)


def test_a_folder_with_both_weight_files_says_which_one_is_left_unread(model, tmp_path, capsys):
    """EAGLE's own loader reads pytorch_model.bin; the harness reads model.safetensors first, and
    said nothing of the other file."""
    a, b = two_drafts(model)
    path = write_published(tmp_path / "both", llama_fields(model.config), a, fmt="bin")
    save_file(b, str(path / "model.safetensors"))
    art = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    assert torch.equal(art.draft.state_dict()["fc.weight"], b["fc.weight"])
    assert list(art.manifest["files_sha256"]) == ["model.safetensors"]
    said = "pytorch_model.bin left unread: model.safetensors is read first"
    assert said in art.manifest["notes"] and said in capsys.readouterr().err


@pytest.fixture(scope="module")
def deep_target():
    return build_tiny_model(seed=3, num_layers=8)


def test_eagle3_t2d_must_mark_exactly_the_ids_d2t_maps_to(deep_target, tmp_path, capsys):
    """t2d was dropped unread: one sized for another vocabulary, or marking other ids than d2t maps
    the draft to (maps from two vocabularies), loaded without a word."""
    v = deep_target.config.vocab_size
    config, state, used = eagle3_checkpoint(deep_target.config, draft_vocab=40)
    ok = write_published(tmp_path / "ok", config, state, fmt="safetensors")
    load_configured_eagle({"artifact": str(ok)}, model=deep_target, tokenizer=None)  # EAGLE's own t2d: read
    as_ints = write_published(tmp_path / "ints", config, {**state, "t2d": state["t2d"].long()}, fmt="safetensors")
    load_configured_eagle({"artifact": str(as_ints)}, model=deep_target, tokenizer=None)  # 0/1 integers: a mask too

    wide = {**state, "t2d": torch.zeros(v + 1000, dtype=torch.bool)}
    path = write_published(tmp_path / "wide", config, wide, fmt="safetensors")
    with pytest.raises(ArtifactError, match=rf"t2d has shape \[{v + 1000}\]; expected \[{v}\]"):
        load_configured_eagle({"artifact": str(path)}, model=deep_target, tokenizer=None)

    other = torch.zeros(v, dtype=torch.bool)
    other[:40] = True
    assert set(torch.nonzero(other).flatten().tolist()) != used
    path = write_published(tmp_path / "other", config, {**state, "t2d": other}, fmt="safetensors")
    with pytest.raises(ArtifactError, match=r"^proposer.artifact=.*: eagle3 checkpoint: t2d disagrees with d2t: it "):
        load_configured_eagle({"artifact": str(path)}, model=deep_target, tokenizer=None)

    counts = state["t2d"].long() * 2
    path = write_published(tmp_path / "counts", config, {**state, "t2d": counts}, fmt="safetensors")
    with pytest.raises(ArtifactError, match=r"t2d holds values other than 0 and 1"):
        load_configured_eagle({"artifact": str(path)}, model=deep_target, tokenizer=None)


def test_a_t2d_beside_an_eagle12_draft_is_noted_as_unread(model, tmp_path, capsys):
    state = {**eagle12_state(model.config), "t2d": torch.zeros(123, dtype=torch.bool)}
    path = write_published(tmp_path / "e1", llama_fields(model.config), state)
    art = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    note = next(n for n in art.manifest["notes"] if n.startswith("t2d "))
    assert "not read" in note and note in capsys.readouterr().err


def test_a_speculators_draft_naming_another_verifier_is_warned_about(tmp_path, capsys):
    """Medusa's base_model_name_or_path was compared with the target's name; a speculators draft's
    verifier.name_or_path was recorded only."""
    target = build_tiny_model(seed=3, num_layers=8)
    target.config._name_or_path = str(tmp_path / "tiny-llama-8-layers")
    config, state, _ = eagle3_checkpoint(target.config, draft_vocab=40, speculators=True)
    same = write_published(tmp_path / "same", config, state, fmt="safetensors")
    load_configured_eagle({"artifact": str(same)}, model=target, tokenizer=None)
    assert "warning" not in capsys.readouterr().err  # it names the target (its folder's name)
    config["speculators_config"]["verifier"]["name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"
    other = write_published(tmp_path / "other", config, state, fmt="safetensors")
    art = load_configured_eagle({"artifact": str(other)}, model=target, tokenizer=None)
    err = capsys.readouterr().err
    assert f"harness: warning: the published EAGLE draft at {other} looks made for another base model" in err
    assert "it names meta-llama/Llama-3.1-8B-Instruct as its verifier" in err
    assert art.manifest["verifier"]["name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"


# --------------------------------------------------------------------------- hub ids


def hub_repo(hub, repo_id: str, commits: list[str], *, main: str):
    """A local hub cache's repository folder with a snapshot per commit and ``refs/main`` at ``main``."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    for commit in commits:
        (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(main)
    return repo


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A local hub cache under tmp_path, read while the hub cannot be reached."""
    from huggingface_hub import constants

    import harness.heads.eagle_formats as formats
    import harness.heads.published as published

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for module in (formats, published):
        monkeypatch.setattr(module, "hub_unreachable", lambda: "huggingface.co:443: Name or service not known")
    return tmp_path / "hub"


def test_a_partly_cached_hub_snapshot_is_refused_as_not_in_the_cache(model, offline_hub):
    """A snapshot folder holding config.json only (an interrupted download, a commit lookup that
    fetched the config alone) was read as a checkpoint whose weight files hold no tensors."""
    commit = "a" * 40
    repo = hub_repo(offline_hub, "someone/eagle-tiny", [commit], main=commit)
    snap = repo / "snapshots" / commit
    (snap / "config.json").write_text(json.dumps(llama_fields(model.config)))
    not_cached = (
        r"^proposer.artifact='someone/eagle-tiny' is not a local directory, not in the local hub cache, and the hub "
        r"cannot be reached \(huggingface.co:443: Name or service not known\)"
    )
    with pytest.raises(ArtifactError, match=not_cached):
        load_configured_eagle({"artifact": "someone/eagle-tiny"}, model=model, tokenizer=None)
    # an index whose shards were not all fetched
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "model-1.safetensors"}}))
    with pytest.raises(ArtifactError, match=not_cached):
        load_configured_eagle({"artifact": "someone/eagle-tiny"}, model=model, tokenizer=None)


def test_a_hub_snapshot_without_weights_is_refused_as_no_eagle_draft_while_online(model, tmp_path, monkeypatch):
    import huggingface_hub

    import harness.heads.eagle_formats as formats

    snap = tmp_path / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(llama_fields(model.config)))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: str(snap))
    monkeypatch.setattr(formats, "hub_unreachable", lambda: None)
    with pytest.raises(ArtifactError, match=rf"is neither a harness EAGLE artifact .* \(hub snapshot {'c' * 40}\)$"):
        load_configured_eagle({"artifact": "someone/eagle-tiny"}, model=model, tokenizer=None)


def test_an_eagle_draft_by_hub_id_loads_at_the_snapshot_its_manifest_recorded(model, offline_hub, monkeypatch):
    """The manifest recorded the snapshot the id resolved to when the run was planned; the load
    resolved the id again, so a repository that moved on in between ran other weights than those
    recorded."""
    import huggingface_hub

    from harness.config import compose
    from harness.manifest import job_manifest

    old, new = "a" * 40, "b" * 40
    repo = hub_repo(offline_hub, "someone/eagle-tiny", [old, new], main=old)
    drafts = dict(zip((old, new), two_drafts(model), strict=True))
    for commit, state in drafts.items():
        write_published(repo / "snapshots" / commit, llama_fields(model.config), state, fmt="safetensors")
    asked = []
    real = huggingface_hub.snapshot_download

    def recording(**kwargs):
        asked.append(kwargs.get("revision"))
        return real(**kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    cfg = compose(["model=tiny", "proposer=eagle", "proposer.artifact=someone/eagle-tiny", "topology=sequence"])
    assert job_manifest(cfg, versions={})["proposer_artifact"]["revision"] == old
    (repo / "refs" / "main").write_text(new)  # the repository moved on after the plan
    art = load_configured_eagle({"artifact": "someone/eagle-tiny"}, model=model, tokenizer=None)
    assert asked == [None, old]
    assert art.manifest["path"].endswith(old)
    assert torch.equal(art.draft.state_dict()["fc.weight"], drafts[old]["fc.weight"])
    # a revision given explicitly is the one read
    art = load_configured_eagle({"artifact": "someone/eagle-tiny"}, model=model, tokenizer=None, revision=new)
    assert asked[-1] == new and torch.equal(art.draft.state_dict()["fc.weight"], drafts[new]["fc.weight"])


def test_medusa_heads_by_hub_id_load_at_the_snapshot_their_manifest_recorded(model, offline_hub, monkeypatch):
    import huggingface_hub

    from harness.config import compose
    from harness.manifest import job_manifest

    old, new = "a" * 40, "b" * 40
    repo = hub_repo(offline_hub, "someone/medusa-tiny", [old, new], main=old)
    h, v = model.config.hidden_size, model.config.vocab_size
    for seed, commit in enumerate((old, new)):
        state = medusa_state(heads=2, layers=1, hidden=h, vocab=v, seed=seed)
        write_medusa(repo / "snapshots" / commit, state, config=medusa_config(2, 1), fmt="safetensors")
    asked = []
    real = huggingface_hub.hf_hub_download

    def recording(*args, **kwargs):
        asked.append(kwargs.get("revision"))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recording)
    cfg = compose(["model=tiny", "proposer=medusa", "proposer.artifact=someone/medusa-tiny", "topology=sequence"])
    assert job_manifest(cfg, versions={})["proposer_artifact"]["hub_snapshot"] == old
    (repo / "refs" / "main").write_text(new)
    asked.clear()
    art = load_configured_heads("medusa", {"artifact": "someone/medusa-tiny"}, model=model, tokenizer=None)
    assert asked and set(asked) == {old}
    assert art.path.name == old and art.manifest["hub_snapshot"] == old
