"""Jobs that build the same cached artifact do not collide: each builder holds the artifact's lock
from "is it there?" to the rename into place, so a job that waited finds what the first built and
loads it; temporary names are unique.

Two processes race for real on a REST datastore; for the other artifacts, the lock is wrapped so
that the artifact appears while the job waits for it (what another job finishing looks like)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

import harness.prepare.trained as artifacts
from harness.files import artifact_lock, holds_lock, lock_path
from harness.prepare.trained import Target

REPO = Path(__file__).resolve().parents[1]


def arriving(monkeypatch, module, make):
    """Wrap ``module.artifact_lock`` so that ``make(path)`` runs just before the lock is taken."""
    real = module.artifact_lock
    asked: list[Path] = []

    @contextmanager
    def lock(path, purpose=""):
        asked.append(Path(path))
        make(Path(path))
        with real(path, purpose) as held:
            yield held

    monkeypatch.setattr(module, "artifact_lock", lock)
    return asked


def must_not_run(*args, **kwargs):
    raise AssertionError("built although another job had just built it")


# --------------------------------------------------------------------------------------------
# REST datastore: two processes race for real

RACE = """
import json, sys
sys.path.insert(0, "tests")
from test_rest_run import WORDS, word_tokenizer
from harness.proposers.rest import open_datastore
cfg = {"corpus": "stdlib", "path": None, "max_tokens": 3000, "context_len": 8, "continuation_len": 4,
       "max_matches": 16, "exclude": "none", "verify_corpus": False}
ds, info = open_datastore(cfg, tokenizer=word_tokenizer(WORDS), model="toy")
print(json.dumps({"built_now": info["built_now"], "release_id": ds.release_id}))
"""


def test_two_jobs_opening_an_absent_rest_datastore_build_it_once(tmp_path):
    env = {**os.environ, "HARNESS_CACHE": str(tmp_path), "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["built_now"] for r in results) == [False, True]
    assert results[0]["release_id"] == results[1]["release_id"]
    folder = tmp_path / "datastores"
    names = sorted(p.name for p in folder.iterdir())  # the folder is named by the non-default build options
    assert len(names) == 2 and names[0] == f".{names[1]}.lock" and names[1].startswith("stdlib-build-")
    assert names[1].endswith("-toy")  # no temporary left


# --------------------------------------------------------------------------------------------
# the converted SmolLM2 copy


def test_smollm2_conversion_waits_then_uses_the_copy_another_job_made(tmp_path, monkeypatch):
    import harness.target.loading as loading

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / loading.SMOLLM2_GGUF).write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(loading, "smollm2_package_dir", lambda: pkg)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))

    def convert(gguf, out):
        assert holds_lock(lock_path(out))  # converting under the lock
        out.mkdir(parents=True)
        (out / "harness_conversion.json").write_text("{}")
        converted.append(out)

    converted: list[Path] = []
    monkeypatch.setattr(loading, "_convert_smollm2", convert)
    out = loading.smollm2_converted_dir()
    assert converted == [out]
    assert loading.smollm2_converted_dir() == out and converted == [out]  # cached: no lock, no conversion

    # another job converts while this one waits for the lock: this one converts nothing
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(loading, "_convert_smollm2", must_not_run)

    def other_job(lock_for):
        lock_for.mkdir(parents=True)
        (lock_for / "harness_conversion.json").write_text("{}")

    asked = arriving(monkeypatch, loading, other_job)
    out2 = loading.smollm2_converted_dir()
    assert asked == [out2] and (out2 / "harness_conversion.json").is_file()


# --------------------------------------------------------------------------------------------
# heads, early-exit adapter, layer-skip vector, training streams


def _manifest_arrives(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text("{}")


def test_head_training_waits_then_loads_the_heads_another_job_trained(tmp_path, monkeypatch):
    import harness.prepare.heads as heads

    path = tmp_path / "artifacts" / "hydra-x"
    monkeypatch.setattr(heads, "heads_artifact_path", lambda kind, options, **k: ({"r": 1}, path))
    monkeypatch.setattr(heads, "load_heads", lambda kind, recipe, **k: ("loaded", k["path"]))
    monkeypatch.setattr(heads, "train_artifact", must_not_run)
    asked = arriving(monkeypatch, artifacts, _manifest_arrives)
    got = heads.ensure_heads("hydra", {}, Target(None, None, "t"), progress=False)
    assert got == ("loaded", path) and asked == [path]

    # nobody else: this job trains, under the lock
    path2 = tmp_path / "artifacts" / "hydra-y"
    monkeypatch.setattr(heads, "heads_artifact_path", lambda kind, options, **k: ({"r": 1}, path2))
    monkeypatch.setattr(artifacts, "artifact_lock", artifact_lock)
    trained = []
    monkeypatch.setattr(heads, "train_artifact", lambda *a, **k: trained.append(holds_lock(lock_path(k["out_dir"]))))
    heads.ensure_heads("hydra", {}, Target(None, None, "t"), progress=False)
    assert trained == [True]


def test_eagle_training_waits_then_loads_the_draft_another_job_trained(tmp_path, monkeypatch):
    import harness.prepare.eagle as eagle

    path = tmp_path / "artifacts" / "eagle-x"
    monkeypatch.setattr(eagle, "eagle_artifact_path", lambda options, **k: ({"r": 1}, path))
    monkeypatch.setattr(eagle, "load_eagle", lambda recipe, **k: ("loaded", k["path"]))
    monkeypatch.setattr(eagle, "train_eagle_artifact", must_not_run)
    asked = arriving(monkeypatch, artifacts, _manifest_arrives)
    got = eagle.ensure_eagle({}, Target(None, None, "t"), progress=False)
    assert got == ("loaded", path) and asked == [path]

    # nobody else: this job trains, under the lock
    path2 = tmp_path / "artifacts" / "eagle-y"
    monkeypatch.setattr(eagle, "eagle_artifact_path", lambda options, **k: ({"r": 1}, path2))
    monkeypatch.setattr(artifacts, "artifact_lock", artifact_lock)
    trained = []
    monkeypatch.setattr(
        eagle, "train_eagle_artifact", lambda *a, **k: trained.append(holds_lock(lock_path(k["out_dir"])))
    )
    eagle.ensure_eagle({}, Target(None, None, "t"), progress=False)
    assert trained == [True]


def test_a_job_that_may_not_train_waits_then_loads_what_another_job_trained(tmp_path, monkeypatch):
    """``proposer.auto_train=false`` refuses only once the lock is held and the artifact is still
    absent: a draft another job was training meanwhile is loaded, not refused."""
    import harness.prepare.eagle as eagle
    from harness.heads.checkpoint import ArtifactError

    path = tmp_path / "artifacts" / "eagle-x"
    monkeypatch.setattr(eagle, "eagle_artifact_path", lambda options, **k: ({"r": 1}, path))
    monkeypatch.setattr(eagle, "load_eagle", lambda recipe, **k: ("loaded", k["path"]))
    monkeypatch.setattr(eagle, "train_eagle_artifact", must_not_run)
    arriving(monkeypatch, artifacts, _manifest_arrives)
    assert eagle.ensure_eagle({"auto_train": False}, Target(None, None, "t")) == ("loaded", path)

    monkeypatch.setattr(artifacts, "artifact_lock", artifact_lock)  # nobody else: refused, nothing trained
    monkeypatch.setattr(eagle, "eagle_artifact_path", lambda options, **k: ({"r": 1}, tmp_path / "eagle-y"))
    with pytest.raises(ArtifactError, match="proposer.auto_train=false"):
        eagle.ensure_eagle({"auto_train": False}, Target(None, None, "t"))


def test_adapter_distillation_waits_then_loads_the_adapter_another_job_made(tmp_path, monkeypatch):
    import harness.prepare.early_exit as early_exit

    path = tmp_path / "artifacts" / "early_exit-x"
    monkeypatch.setattr(early_exit, "adapter_artifact_path", lambda options, **k: ({"r": 1}, path))
    monkeypatch.setattr(early_exit, "load_adapter", lambda options, **k: ("loaded", k["path"]))
    monkeypatch.setattr(early_exit, "distill_adapter_artifact", must_not_run)
    asked = arriving(monkeypatch, artifacts, _manifest_arrives)
    assert early_exit.ensure_adapter({}, Target(None, None, "t")) == ("loaded", path)
    assert asked == [path]


def test_skip_search_waits_then_loads_the_vector_another_job_found(tmp_path, monkeypatch):
    import harness.prepare.skip_search as skip_search

    path = tmp_path / "artifacts" / "layer_skip-x"
    monkeypatch.setattr(skip_search, "skip_artifact_path", lambda options, **k: ({"r": 1}, path))
    monkeypatch.setattr(skip_search, "load_skip", lambda options, **k: ("loaded", options["artifact"]))
    monkeypatch.setattr(skip_search, "_search_absent", must_not_run)
    asked = arriving(monkeypatch, artifacts, _manifest_arrives)
    backend = SimpleNamespace(model=None)
    got = skip_search.ensure_skip({}, backend=backend, tokenizer=None, target_source="t")
    assert got == ("loaded", str(path)) and asked == [path]


def test_training_streams_wait_then_load_the_streams_another_job_encoded(tmp_path, monkeypatch):
    import harness.prepare.heads_data as heads_data
    from harness.heads.recipes import DataRecipe

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    monkeypatch.setattr(heads_data, "_encode_streams", must_not_run)
    monkeypatch.setattr(heads_data, "load_stream", lambda path: path.name)

    def streams_arrive(base):
        base.parent.mkdir(parents=True, exist_ok=True)
        for suffix in ("-train.safetensors", "-heldout.safetensors"):
            base.with_name(base.name + suffix).write_bytes(b"")

    asked = arriving(monkeypatch, heads_data, streams_arrive)
    recipe = DataRecipe(source="inline", token_budget=9, held_out_tokens=4, max_len=16)
    train, held = heads_data.training_streams(
        None, None, recipe, target_hash="abc" * 8, documents=([[1, 2, 3]], [[4, 5, 6]]), progress=False
    )
    assert train.endswith("-train.safetensors") and held.endswith("-heldout.safetensors")
    assert len(asked) == 1 and asked[0].parent == tmp_path / "heads" / "streams"


# --------------------------------------------------------------------------------------------
# Sequoia calibration, profile and tree


@pytest.fixture(scope="module")
def sequoia_cache(tmp_path_factory):
    """The Sequoia artifacts of one tiny `topology=sequoia` run, measured from an empty cache."""
    from test_sequoia_topology import RUN, compose

    from harness.runner import run_job

    tmp = tmp_path_factory.mktemp("sequoia_shared")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", str(tmp / "cache"))
        record = run_job(compose(RUN), run_dir=tmp / "run")
    return tmp / "cache" / "sequoia", record


def test_sequoia_calibration_and_profile_that_arrive_while_waiting_are_loaded_and_the_tree_built_under_its_lock(
    sequoia_cache, tmp_path, monkeypatch
):
    from test_sequoia_topology import RUN, compose

    import harness.prepare.sequoia as sequoia
    from harness.runner import run_job

    first, record = sequoia_cache
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sequoia, "run_calibration", must_not_run)
    monkeypatch.setattr(sequoia, "measure_profile", must_not_run)

    def other_job(path):
        if path.name.startswith(("calibration-", "profile-")):  # finished by another job meanwhile
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes((first / path.name).read_bytes())

    asked = arriving(monkeypatch, sequoia, other_job)
    real_write = sequoia.write_artifact
    written = []

    def write(artifact, path):
        written.append((Path(path).name.split("-")[0], holds_lock(lock_path(path))))
        return real_write(artifact, path)

    monkeypatch.setattr(sequoia, "write_artifact", write)
    again = run_job(compose(RUN), run_dir=tmp_path / "run")
    assert again["metrics"]["sequoia_stages"] == {
        "calibration": "loaded (cache)",
        "profile": "loaded (cache)",
        "tree": "built",
    }
    assert [p.name.split("-")[0] for p in asked] == ["calibration", "profile", "tree"]
    assert written == [("tree", True)]
    leftovers = [p.name for p in (tmp_path / "cache" / "sequoia").iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []
