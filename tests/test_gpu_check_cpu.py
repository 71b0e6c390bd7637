"""The GPU check's pieces run on CPU too (the check itself needs CUDA for its event timers)."""

import torch

from harness.gpu_check import equivalence, smollm2_shaped


def test_gpu_check_equivalence_runs_on_a_smollm2_shaped_model():
    model = smollm2_shaped(torch.float32, "cpu", layers=2)
    assert model.config.num_key_value_heads == 3 and model.config.vocab_size == 49152
    result = equivalence(model, "cpu")
    assert result["status"] == "passed", result
    assert result["tree_max_abs_logit_diff"] < 1e-3


def test_gpu_check_runs_the_real_runner(tmp_path, monkeypatch):
    """The runner part of the GPU check on CPU with a small shape: gates, greedy equality, a record."""
    from harness.gpu_check import SMOLLM2_SHAPE, runner

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    shape = {**SMOLLM2_SHAPE, "num_layers": 2, "vocab_size": 512, "hidden_size": 72, "intermediate_size": 96}
    out = runner(
        "cpu", "float32", tmp_path / "run", shape=shape, extra=["workload.limit=1", "generation.max_new_tokens=8"]
    )
    assert out["gated"] is True and out["equivalence"]["status"] == "passed"
    assert out["metrics"]["greedy_identical"] is True and (tmp_path / "run" / "record.json").exists()
