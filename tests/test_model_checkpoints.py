"""On the embedded SmolLM2 (``make test-slow``): an HF-format copy given by path loads whole as a
target and as a draft, a draft identical to the target accepts every candidate at every depth
(T = 0 greedy; T = 0.7 rejection and SpecInfer), and SmolLM2-sized Medusa and Hydra checkpoints in
their published layouts (random weights) load and run with greedy equality."""

from __future__ import annotations

import pytest
import torch
from checkpoint_fixtures import (
    best_first_choices,
    hydra_config,
    hydra_state,
    medusa_config,
    medusa_state,
    write_choices,
    write_hydra,
    write_medusa,
)

from harness.config import compose

pytestmark = pytest.mark.model

SMOLLM2_HIDDEN, SMOLLM2_VOCAB = 576, 49152
COMMON = ["workload.limit=1", "generation.max_new_tokens=24", "gates.oracle=false", "gates.statistical=false"]


@pytest.fixture(scope="module")
def smollm2_copy(tmp_path_factory):
    """The cached converted SmolLM2 saved again with ``save_pretrained`` (weights, config,
    tokenizer): a checkpoint directory as a user would give it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.target.loading import smollm2_converted_dir

    src = smollm2_converted_dir()
    out = tmp_path_factory.mktemp("smollm2-hf")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def test_the_hf_copy_loads_whole_as_target_and_draft(smollm2_copy):
    from harness.runner import load_models

    cfg = compose(
        ["model=hf", f"model.name_or_path={smollm2_copy}", "proposer=draft_model", "proposer.model.name=hf"]
        + [f"proposer.model.name_or_path={smollm2_copy}"]
    )
    target, draft = load_models(cfg)
    assert target.load_report["layers"] == draft.load_report["layers"] == 30
    assert len(draft.model.model.layers) == 30 and draft.load_report["missing_keys"] == []


@pytest.mark.parametrize(
    "extra",
    [
        ["verifier=greedy"],
        ["verifier=rejection", "generation.temperature=0.7"],
        ["verifier=specinfer", "generation.temperature=0.7", "topology=expansion", "topology.widths=[2,1,1]"],
    ],
    ids=["T0-greedy", "T0.7-rejection", "T0.7-specinfer"],
)
def test_smollm2_as_its_own_draft_accepts_every_candidate(smollm2_copy, tmp_path, extra):
    from harness.runner import run_job

    topology = [] if any(e.startswith("topology=") for e in extra) else ["topology=sequence", "topology.max_nodes=4"]
    cfg = compose(
        [
            "model=smollm2",
            "proposer=draft_model",
            "proposer.model.name=hf",
            f"proposer.model.name_or_path={smollm2_copy}",
        ]
        + ["topology.max_depth=4", *topology, *extra, *COMMON]
    )
    record = run_job(cfg, run_dir=tmp_path / "run")
    acc = [a for a in record["metrics"]["acceptance_by_depth"] if a is not None]
    assert len(acc) >= 3 and min(acc) >= 0.99, record["metrics"]["acceptance_by_depth"]


def test_smollm2_sized_published_medusa_and_hydra_heads_run(tmp_path):
    """Random weights in the published layouts at SmolLM2's shapes: the mechanics (load key for
    key, run, greedy equality); acceptance is near zero by construction."""
    from harness.runner import run_job
    from harness.target.loading import load_model

    embed = load_model(name="smollm2").model.get_input_embeddings().weight.detach()
    medusa = write_medusa(
        tmp_path / "medusa",
        medusa_state(heads=4, layers=1, hidden=SMOLLM2_HIDDEN, vocab=SMOLLM2_VOCAB),
        config=medusa_config(4, 1),
    )
    hydra = write_hydra(
        tmp_path / "hydra",
        hydra_state(heads=3, layers=1, hidden=SMOLLM2_HIDDEN, vocab=SMOLLM2_VOCAB, embed=embed),
        config=hydra_config(3, 1),
    )
    runs = {
        "medusa": [
            "proposer=medusa",
            f"proposer.artifact={medusa}",
            "topology=choices",
            f"topology.choices_file={write_choices(tmp_path / 'tree63.json', best_first_choices(63))}",
        ],
        "hydra": ["proposer=hydra", f"proposer.artifact={hydra}", "topology=cartesian", "topology.widths=[3,2,2]"],
    }
    for name, overrides in runs.items():
        record = run_job(compose(["model=smollm2", *overrides, *COMMON]), run_dir=tmp_path / f"run-{name}")
        m = record["metrics"]
        assert m["greedy_identical"] is True and m["cpu_budget_artifact"] is False, name
        assert m["retrieval"]["hidden_misses"] == 0 and m["mean_candidate_rows"] > 0, name
        assert record["manifest"]["proposer_artifact"]["source"] == "published", name
