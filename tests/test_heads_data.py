"""Cached target hidden states: segment-causal rows, packed addresses, cache round trip, and the
teacher logits recomputed from a cached row through the frozen LM head."""

import pytest
import torch

from harness.heads.recipes import DataRecipe
from harness.prepare.heads_data import byte_ids, encode_stream, load_stream, save_stream, take_budget, training_streams
from harness.target.loading import build_tiny_model


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=3)


DOCS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]


def test_stream_rows_are_segment_causal(model):
    s = encode_stream(model, DOCS, progress=False)
    assert s.tokens.tolist() == [t for d in DOCS for t in d]
    assert s.segment_ids.tolist() == [0] * 5 + [1] * 3 + [2] * 4
    assert bool(s.valid.all()) and s.hidden.dtype == torch.float16 and s.hidden.shape == (12, 32)
    with torch.no_grad():
        alone = model.base_model(input_ids=torch.tensor([DOCS[1]])).last_hidden_state[0]
        packed = model.base_model(input_ids=torch.tensor([DOCS[0] + DOCS[1]])).last_hidden_state[0, 5:]
    assert torch.allclose(s.hidden[5:8].float(), alone, atol=2e-3)
    # the row a packed (non segment-causal) forward would give differs: no contamination here
    assert not torch.allclose(s.hidden[5:8].float(), packed, atol=2e-3)


def test_teacher_logits_recomputed_from_cached_rows(model):
    s = encode_stream(model, DOCS[:1], progress=False)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([DOCS[0]])).logits[0]  # [5, V]
        got = model.get_output_embeddings()(s.hidden.float())  # [5, V] from the fp16 cache
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() < 0.05


def test_cache_round_trip(tmp_path, model):
    s = encode_stream(model, DOCS, progress=False)
    path = tmp_path / "s.safetensors"
    save_stream(s, path)
    back = load_stream(path)
    assert torch.equal(back.tokens, s.tokens) and torch.equal(back.segment_ids, s.segment_ids)
    assert torch.equal(back.valid, s.valid) and torch.equal(back.hidden, s.hidden)
    assert back.meta == s.meta


def test_training_streams_budget_and_cache(tmp_path, monkeypatch, model):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    recipe = DataRecipe(source="inline", token_budget=9, held_out_tokens=4, max_len=16)
    train, held = training_streams(
        model, None, recipe, target_hash="abc" * 8, documents=(DOCS, DOCS[::-1]), progress=False
    )
    assert train.tokens.tolist() == DOCS[0] + DOCS[1]  # whole documents; a 1-token cut of the third is dropped
    assert held.tokens.tolist() == DOCS[2]
    files = sorted(p.name for p in (tmp_path / "heads" / "streams").iterdir() if not p.name.startswith("."))
    assert len(files) == 2 and files[0].endswith("-heldout.safetensors")  # and a hidden lock file
    again, _ = training_streams(
        model, None, recipe, target_hash="abc" * 8, documents=(DOCS, DOCS[::-1]), progress=False
    )
    assert torch.equal(again.hidden, train.hidden)


def test_take_budget_and_byte_ids():
    assert take_budget([[1, 2, 3, 4], [5, 6], [7, 8, 9, 10], [11, 12, 13]], 10) == [[1, 2, 3, 4], [7, 8, 9, 10]]
    # [5, 6] and a 2-token cut of [11, 12, 13] are shorter than 3 tokens: dropped
    assert byte_ids("AB", vocab_size=96, max_len=8) == [3 + 65 % 93, 3 + 66 % 93]
    with pytest.raises(ValueError, match="token_budget >= 1"):
        DataRecipe(token_budget=0)
