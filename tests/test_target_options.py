"""Target options and the weight-streaming floor: what a decode step must read, and how fast."""

from __future__ import annotations

import math

import torch

from harness.target.loading import build_tiny_model
from harness.target.timing import read_bandwidth_gbs, streamed_weight_bytes, weight_stream_floor_ms


def test_streamed_weight_bytes_leaves_out_an_untied_embedding_table():
    model = build_tiny_model()  # tie_word_embeddings=False
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    assert streamed_weight_bytes(model) == total - emb.numel() * emb.element_size()


def test_streamed_weight_bytes_counts_a_tied_matrix_once_as_the_lm_head():
    model = build_tiny_model()
    model.lm_head.weight = model.get_input_embeddings().weight  # tie: one matrix, read by the LM head
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() lists it once
    assert streamed_weight_bytes(model) == total
    bf16 = build_tiny_model(dtype=torch.bfloat16)
    assert streamed_weight_bytes(bf16) * 2 == streamed_weight_bytes(build_tiny_model())


def test_floor_is_bytes_over_bandwidth():
    model = build_tiny_model()
    assert math.isclose(weight_stream_floor_ms(model, 2.0), streamed_weight_bytes(model) / 2e9 * 1e3)
    bw = read_bandwidth_gbs(nbytes=1 << 20, repeats=3)
    assert math.isfinite(bw) and bw > 0
