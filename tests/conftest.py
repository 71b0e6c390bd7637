import os

import pytest
import torch

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)


@pytest.fixture
def tiny_model():
    from harness.target.loading import build_tiny_model

    return build_tiny_model(seed=0)


@pytest.fixture
def tiny_model64():
    from harness.target.loading import build_tiny_model

    return build_tiny_model(seed=0, dtype=torch.float64)
