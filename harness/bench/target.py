"""The embedded model as the prompt-lookup benchmark sets it up on CPU by default, for the scripts
that time beside it (``scripts/lookup_ab.py``, ``scripts/lookup_replay.py``,
``scripts/verify_cost_regimes.py``, ``scripts/verify_roofline.py``): the linear kernel ``auto``, the
preallocated cache, and fused decoder layers where they apply. And SmolLM2's shape, which the
benchmark's ``--model tiny`` and the GPU check build with random weights where the embedded model
is not installed."""

from __future__ import annotations

import torch

from harness.target.backend import CausalLMBackend
from harness.target.fused_layers import apply_fused_layers
from harness.target.loading import LoadedModel, load_model
from harness.target.options import apply_linear_kernel, apply_static_cache, resolve_fused_layers, resolve_linear_kernel

#: SmolLM2-135M's shape in ``model=tiny``'s keys: the random model of the benchmark's ``--model tiny``
#: and of the GPU check (exactness does not depend on the weights, and timing depends on the shape)
SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "num_layers": 30,
    "num_heads": 9,
    "num_kv_heads": 3,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def apply_default_cpu_options(model: torch.nn.Module) -> torch.nn.Module:
    """The benchmark's default options on a CPU model, in its dtype: the linear kernel ``auto``, the
    preallocated cache, and fused decoder layers where they apply. A model on another device is
    refused (``ValueError``): these options resolve as they do on a CPU."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ValueError(f"the benchmark's default CPU options are for a CPU model; this one is on {param.device}")
    torch_dtype = param.dtype
    apply_linear_kernel(model, "auto")
    apply_static_cache(model, True)
    kernel = resolve_linear_kernel("auto", torch_dtype, "cpu")
    apply_fused_layers(
        model, resolve_fused_layers(None, torch_dtype, "cpu", linear_kernel=kernel, compiled=False, static_cache=True)
    )
    return model


def default_cpu_target(dtype: str = "float32") -> tuple[LoadedModel, CausalLMBackend]:
    """SmolLM2 in ``dtype`` on CPU with the benchmark's default options, and its backend."""
    loaded = load_model(name="smollm2", dtype=dtype, attn_implementation="sdpa")  # the benchmark's --attn default
    return loaded, CausalLMBackend(apply_default_cpu_options(loaded.model))
