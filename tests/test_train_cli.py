"""`harness train`: the command line (its usage, the run options it refuses) and what it trains: an
absent artifact whatever `proposer.auto_train` says, and, where an existing artifact does not load,
a refusal that says force=true retrains it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.app import TRAIN_UNREAD, train_main, unread_options

#: a medusa head bank on the tiny model, trained in seconds
MEDUSA = [
    "proposer=medusa",
    "model=tiny",
    "threads=1",
    "proposer.data.token_budget=300",
    "proposer.data.held_out_tokens=100",
    "proposer.data.max_len=50",
]


def test_help_is_read_anywhere_on_the_line(capsys):
    """`harness train proposer=medusa --help` was refused as a flag, while calibrate reads --help anywhere."""
    for argv in (["proposer=medusa", "--help"], ["model=tiny", "-h", "proposer=medusa"], ["--help"]):
        assert train_main(argv) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("usage: harness train proposer=<") and captured.err == ""
    assert train_main(["proposer=medusa", "--bogus"]) == 2  # another flag is still refused
    assert "takes key=value overrides, not flags" in capsys.readouterr().err


def test_jobs_beside_train_are_refused_before_any_model(tmp_path, monkeypatch, capsys):
    """concurrent_jobs=2 was said to have no effect, yet a layer-skip search recorded it, and a run
    alone then searched the vector again; train is one job, timed alone."""
    from harness import app

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    monkeypatch.setattr(app, "load_models", lambda cfg: pytest.fail("train loaded the models"))
    for proposer in ("proposer=medusa", "proposer=layer_skip"):
        assert train_main([proposer, "model=tiny", "concurrent_jobs=2"]) == 2
        assert capsys.readouterr().err == (
            "harness train: refused: concurrent_jobs=2 is a sweep option (how many of a multirun's jobs run at once); "
            "harness train is one job, timed alone: drop it\n"
        )
    assert unread_options(["concurrent_jobs=2"], TRAIN_UNREAD) == []
    assert not any(tmp_path.iterdir())


def test_train_trains_an_absent_artifact_whatever_auto_train_and_offers_force_for_one_that_does_not_load(
    tmp_path, monkeypatch, capsys
):
    """`harness train` takes a run's config: one with proposer.auto_train=false refused to train
    ("run `harness train ...` first"). It trains the absent artifact, the one a run of either setting
    loads. An artifact of another recipe given by path is refused with the overrides that match it and
    force=true, which retrains it there."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    assert train_main([*MEDUSA, "proposer.auto_train=false"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["reused"] is False and (Path(trained["path"]) / "manifest.json").is_file()
    assert train_main(MEDUSA) == 0  # auto_train is no part of the recipe: the same artifact
    assert json.loads(capsys.readouterr().out) | {"reused": False} == trained

    other = [*MEDUSA, "proposer.data.token_budget=200", f"proposer.artifact={trained['path']}"]
    assert train_main(other) == 2
    err = capsys.readouterr().err.strip()
    assert "to use it, set proposer.data.token_budget=300" in err, err
    assert err.endswith("; or force=true retrains it there for the configured target and recipe"), err
    assert train_main([*other, "force=true"]) == 0
    retrained = json.loads(capsys.readouterr().out)
    assert retrained["path"] == trained["path"] and retrained["token_budget"] == 200
