import logging
import os

import pytest
import torch

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_log_handler_on_a_closed_stream():
    """A run in this process configures logging (Hydra's job logging) onto the stream the test
    captured then; once that stream is closed, any later log line prints a "Logging error" traceback
    into the stderr of whichever test emits it. Such handlers are dropped before each test."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", ())):
            if getattr(getattr(handler, "stream", None), "closed", False):
                logger.removeHandler(handler)


@pytest.fixture
def tiny_model():
    from harness.target.loading import build_tiny_model

    return build_tiny_model(seed=0)


@pytest.fixture
def tiny_model64():
    from harness.target.loading import build_tiny_model

    return build_tiny_model(seed=0, dtype=torch.float64)
