"""The GPU check's pieces run on CPU too (the check itself needs CUDA for its event timers)."""

import torch

from harness.gpu_check import equivalence, smollm2_shaped


def test_gpu_check_equivalence_runs_on_a_smollm2_shaped_model():
    model = smollm2_shaped(torch.float32, "cpu", layers=2)
    assert model.config.num_key_value_heads == 3 and model.config.vocab_size == 49152
    result = equivalence(model, "cpu")
    assert result["status"] == "passed", result
    assert result["tree_max_abs_logit_diff"] < 1e-3
