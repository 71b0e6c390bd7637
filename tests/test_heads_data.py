"""Cached target hidden states: segment-causal rows, packed addresses, cache round trip, and the
teacher logits recomputed from a cached row through the frozen LM head; the ShareGPT documents they
are made from (a run's turn order, strict chat templates, held-out text kept out, the streams' key)."""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import word_chat_tokenizer

from harness.heads import recipes
from harness.heads.recipes import DataRecipe
from harness.prepare.heads_data import (
    byte_ids,
    encode_stream,
    load_stream,
    save_stream,
    streams_key,
    streams_record,
    take_budget,
    training_data,
    training_streams,
)
from harness.target.loading import build_tiny_model
from harness.workloads import corpora


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


def test_a_residual_past_float16_is_refused_not_cached_as_infinity():
    """The early-exit rows (the residual stream after the exit layer) are cached in float16; a target
    whose residual holds a larger value cached infinity and trained on NaN."""
    big = build_tiny_model(seed=3)
    with torch.no_grad():
        big.model.embed_tokens.weight.mul_(1e6)  # the residual carries the embedding: |x| ~ 1e5 and more
    with pytest.raises(ValueError, match="residual stream after 1 decoder layers reach .*past float16"):
        encode_stream(big, DOCS[:1], progress=False, layers=(1,))
    with torch.no_grad():
        big.model.embed_tokens.weight[DOCS[0][0]] = float("inf")  # an infinity beside the large values
    with pytest.raises(ValueError, match="after 1 decoder layers hold NaN or infinity"):
        encode_stream(big, DOCS[:1], progress=False, layers=(1,))
    fine = encode_stream(build_tiny_model(seed=3), DOCS[:1], progress=False, layers=(1,))
    assert bool(torch.isfinite(fine.extra[1].float()).all()) and fine.extra[1].dtype == torch.float16


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


def cached_streams(tmp_path, monkeypatch, model):
    """The inline recipe, its documents, the streams :func:`training_streams` encoded and cached, and
    the training stream's file."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    recipe = DataRecipe(source="inline", token_budget=9, held_out_tokens=4, max_len=16)
    documents = (DOCS, DOCS[::-1])
    train, held = training_streams(model, None, recipe, target_hash="abc" * 8, documents=documents, progress=False)
    (path,) = (tmp_path / "heads" / "streams").glob("*-train.safetensors")
    return recipe, documents, train, path


def test_a_stream_edited_in_place_is_encoded_again_not_trained_on(tmp_path, monkeypatch, model, capsys):
    """A cached stream was read with no check: one whose tokens and rows were edited (its metadata
    kept) was trained on. It records a digest of its contents now; one that does not verify is
    encoded again under the streams' lock, with a warning naming it."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    recipe, documents, train, path = cached_streams(tmp_path, monkeypatch, model)
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
    assert set(header) == {"meta", "sha256"}
    save_file({**tensors, "tokens": torch.full_like(tensors["tokens"], 5)}, str(path), metadata=header)
    with pytest.raises(ValueError, match="changed since it was saved"):
        load_stream(path)
    capsys.readouterr()
    again, _ = training_streams(model, None, recipe, target_hash="abc" * 8, documents=documents, progress=False)
    assert again.tokens.tolist() == train.tokens.tolist() == DOCS[0] + DOCS[1]
    assert torch.equal(again.hidden, train.hidden)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("harness: warning: the cached training stream ") and str(path) in line
    assert "encoding it again" in line
    assert load_stream(path).tokens.tolist() == DOCS[0] + DOCS[1]  # the cache holds the encoded stream again


def test_a_truncated_stream_is_encoded_again_not_a_raw_safetensors_error(tmp_path, monkeypatch, model, capsys):
    """A stream cut short raised safetensors' own error, naming no file, on every later run."""
    recipe, documents, train, path = cached_streams(tmp_path, monkeypatch, model)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{path.name}.* is not a readable stream file"):
        load_stream(path)
    capsys.readouterr()
    again, _ = training_streams(model, None, recipe, target_hash="abc" * 8, documents=documents, progress=False)
    assert torch.equal(again.tokens, train.tokens) and torch.equal(again.hidden, train.hidden)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert str(path) in line and "not a readable stream file" in line
    assert path.read_bytes() != data[: len(data) // 2] and torch.equal(load_stream(path).hidden, train.hidden)


def test_a_stream_saved_without_a_digest_is_encoded_again(tmp_path, monkeypatch, model, capsys):
    """A stream written before streams recorded a digest has nothing to verify it by: it is encoded
    again (once; the new one verifies), never trained on as it is."""
    from safetensors.torch import load_file, save_file

    recipe, documents, train, path = cached_streams(tmp_path, monkeypatch, model)
    old = load_file(str(path))
    old["hidden"] = torch.zeros_like(old["hidden"])
    save_file(old, str(path), metadata={"meta": json.dumps(train.meta, sort_keys=True)})  # the older layout
    with pytest.raises(ValueError, match="saved before streams recorded a digest"):
        load_stream(path)
    capsys.readouterr()
    again, _ = training_streams(model, None, recipe, target_hash="abc" * 8, documents=documents, progress=False)
    assert torch.equal(again.hidden, train.hidden)
    assert "saved before streams recorded a digest" in capsys.readouterr().err
    training_streams(model, None, recipe, target_hash="abc" * 8, documents=documents, progress=False)
    assert capsys.readouterr().err == ""  # read back, verified: not encoded a second time


def test_documents_are_refused_for_a_recipe_of_another_source(tmp_path, monkeypatch, model):
    """Documents given with the default data.source (sharegpt) were encoded and recorded as inline,
    and the artifact trained on them took the place of the ShareGPT recipe's."""
    from harness.heads.artifacts import refuse_documents

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="documents are given but data.source is 'sharegpt'"):
        training_streams(model, None, DataRecipe(), target_hash="abc" * 8, documents=(DOCS, DOCS), progress=False)
    assert not (tmp_path / "heads").exists()
    refuse_documents("inline", (DOCS, DOCS))
    refuse_documents("sharegpt", None)


def test_take_budget_and_byte_ids():
    assert take_budget([[1, 2, 3, 4], [5, 6], [7, 8, 9, 10], [11, 12, 13]], 10) == [[1, 2, 3, 4], [7, 8, 9, 10]]
    # [5, 6] and a 2-token cut of [11, 12, 13] are shorter than 3 tokens: dropped
    assert byte_ids("AB", vocab_size=96, max_len=8) == [3 + 65 % 93, 3 + 66 % 93]
    with pytest.raises(ValueError, match="token_budget >= 1"):
        DataRecipe(token_budget=0)


# --------------------------------------------------------------------------------------------
# ShareGPT documents: a run's turn order, strict chat templates, held-out text, the streams' key

#: Llama-2-chat's check (Mistral-Instruct and Gemma have the same), and a refusal of one word, the
#: stand-in for a conversation a template still refuses once its turns alternate
STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if 'w39' in m['content'] %}{{ raise_exception('w39 is refused') }}{% endif %}"
    "{% if m['role'] == 'user' %}<user> {{ m['content'] }} {% else %}<bot> {{ m['content'] }} </s> {% endif %}"
    "{% endfor %}"
)


def conv_id(split: str, n: int) -> str:
    """The ``n``-th id of the form ``c<k>`` that :func:`~harness.workloads.corpora.sharegpt_split` puts in ``split``."""
    ids = (f"c{k}" for k in range(10_000) if corpora.sharegpt_split(f"c{k}") == split)
    return next(i for k, i in enumerate(ids) if k == n)


def conversation(split: str, n: int, *turns: tuple[str, str]):
    return corpora.Conversation(conv_id(split, n), tuple(corpora.ChatTurn(role, text) for role, text in turns))


@pytest.fixture
def sharegpt(monkeypatch):
    """A function giving the conversations and the file hash the packaged ShareGPT file is read as
    (where the corpora and the REST exclusions read it, and the file the recipes hash)."""

    def set_data(conversations, sha="a" * 64):
        data = corpora.ShareGPTData(tuple(conversations), file_sha256=sha, file_bytes=0, truncated_at_char=None)
        monkeypatch.setattr(corpora, "load_sharegpt", lambda: data)
        monkeypatch.setattr(recipes, "file_sha256", lambda path: sha)  # the packaged file's hash, read as

    return set_data


def chat_streams(tmp_path, monkeypatch, tokenizer, **data):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    recipe = {"data": {"token_budget": 400, "held_out_tokens": 40, "max_len": 64, **data}}
    target = SimpleNamespace(model=build_tiny_model(seed=3), tokenizer=tokenizer, source="tiny")
    return training_data(target, recipe, progress=False)


def documents_of(stream) -> list[list[int]]:
    return [stream.tokens[stream.segment_ids == s].tolist() for s in stream.segment_ids.unique().tolist()]


def test_a_strict_chat_template_gets_the_turns_in_a_runs_order_and_a_refused_conversation_is_skipped(
    tmp_path, monkeypatch, sharegpt
):
    """A conversation opening with the assistant (a later part of a split one), two user turns in a
    row once an empty answer is dropped, and one the template refuses whatever the order: the first
    two start at a user turn (the second cut before the repeat), the third is skipped and counted, and
    the artifact's manifest keeps the count with the ShareGPT file's and the template's hashes."""
    tok = word_chat_tokenizer()
    tok.chat_template = STRICT_TEMPLATE
    sharegpt(
        [
            conversation("train", 0, ("assistant", "w0 w1"), ("user", "w2 w3"), ("assistant", "w4 w5")),
            conversation("train", 1, ("user", "w6 w7"), ("assistant", " "), ("user", "w8"), ("assistant", "w9")),
            conversation("train", 2, ("user", "w10 w11"), ("assistant", "w39 w12")),
            conversation("train", 3, ("user", "w13 w14"), ("assistant", "w15 w16")),
            conversation("dev", 0, ("user", "w17 w18"), ("assistant", "w19 w20")),
        ]
    )
    streams = chat_streams(tmp_path, monkeypatch, tok)
    user, bot = tok.convert_tokens_to_ids(["<user>", "<bot>"])
    w = {f"w{i}": tok.convert_tokens_to_ids(f"w{i}") for i in range(40)}
    docs = documents_of(streams.train)
    assert docs == [
        [user, w["w2"], w["w3"], bot, w["w4"], w["w5"], tok.eos_token_id],
        [user, w["w6"], w["w7"]],
        [user, w["w13"], w["w14"], bot, w["w15"], w["w16"], tok.eos_token_id],
    ]
    meta = streams.train.meta
    assert (meta["conversations_read"], meta["conversations_reordered"], meta["template_refused"]) == (4, 2, 1)
    assert meta["template_refusal"] == "w39 is refused" and meta["held_out_overlap"] == 0
    record = streams_record(streams)["train"]
    assert record["template_refused"] == 1 and record["sharegpt_sha256"] == "a" * 64
    assert len(record["chat_template"]) == 16 and record["document_rule"]


def test_a_template_refusing_every_conversation_is_one_clear_error(tmp_path, monkeypatch, sharegpt):
    """Nothing to train on: one line naming the template's refusal and the ways out."""
    tok = word_chat_tokenizer()
    tok.chat_template = "{{ raise_exception('System role not supported') }}"
    sharegpt([conversation("train", k, ("user", f"w{k} w1"), ("assistant", "w2 w3")) for k in range(3)])
    with pytest.raises(ValueError, match=r"^the tokenizer's chat template refused all 3 ShareGPT 'train' conv") as e:
        chat_streams(tmp_path, monkeypatch, tok)
    assert "System role not supported" in str(e.value) and "\n" not in str(e.value)


def test_a_held_out_prompt_repeated_in_train_is_dropped(tmp_path, monkeypatch, sharegpt):
    """ShareGPT repeats conversations under other ids: an evaluation prompt (and a calibration
    answer) found in training conversations drops them, as a REST datastore's build does; a held-out
    text shorter than the window (a "hello") drops nothing."""
    tok = word_chat_tokenizer()
    prompt = " ".join(f"w{i}" for i in range(36))  # 36 tokens: longer than the 32-token window
    answer = " ".join(f"w{i}" for i in range(39, 3, -1))
    sharegpt(
        [
            conversation("eval", 0, ("user", prompt), ("assistant", "hello")),
            conversation("calibration", 0, ("user", "hello"), ("assistant", answer)),
            conversation("train", 0, ("user", "say more"), ("assistant", "hello world")),
            conversation("train", 1, ("user", prompt), ("assistant", "again")),
            conversation("train", 2, ("user", "hello"), ("assistant", "say " + answer)),
            conversation("train", 3, ("user", "hello again"), ("assistant", "hello")),
            conversation("dev", 0, ("user", "w17 w18"), ("assistant", "w19 w20")),
        ]
    )
    streams = chat_streams(tmp_path, monkeypatch, tok)
    say, more, world, again, hello = tok.convert_tokens_to_ids(["say", "more", "world", "again", "hello"])
    assert [[t for t in d if t in (say, more, world, again, hello)] for d in documents_of(streams.train)] == [
        [say, more, hello, world],
        [hello, again, hello],
    ]
    assert streams.train.meta["held_out_overlap"] == 2 and streams.train.meta["conversations_read"] == 4


def test_a_training_conversation_opening_with_a_held_out_prompt_is_dropped_however_short(
    tmp_path, monkeypatch, sharegpt
):
    """A train conversation whose first user turn is an evaluation (or calibration, dev) prompt's text was
    kept when the text was shorter than the 32-token window: the heads trained on evaluated questions."""
    from harness.prepare import heads_data

    tok = word_chat_tokenizer()
    sharegpt(
        [
            conversation("eval", 0, ("user", "hello"), ("assistant", "w1 w2")),
            conversation("calibration", 0, ("user", "w30 w31"), ("assistant", "w3")),
            conversation("train", 0, ("user", "hello"), ("assistant", "w4 w5")),
            conversation("train", 1, ("user", " hello "), ("assistant", "w6 w7")),
            conversation("train", 2, ("user", "hello again"), ("assistant", "w8 w9")),
            conversation("train", 3, ("assistant", "w10"), ("user", "w30 w31"), ("assistant", "w11 w12")),
            conversation("train", 4, ("user", "w13"), ("assistant", "hello")),
            conversation("dev", 0, ("user", "w17 w18"), ("assistant", "w19 w20")),
        ]
    )
    assert heads_data.held_out_prompts("train") == {"hello", "w30 w31", "w17 w18"}
    streams = chat_streams(tmp_path, monkeypatch, tok)
    hello, again, w13 = tok.convert_tokens_to_ids(["hello", "again", "w13"])
    assert [[t for t in d if t in (hello, again, w13)] for d in documents_of(streams.train)] == [
        [hello, again],
        [w13, hello],
    ]
    meta = streams.train.meta
    assert (meta["held_out_prompt"], meta["held_out_overlap"], meta["conversations_read"]) == (3, 0, 5)
    assert "however short" in streams_record(streams)["train"]["document_rule"]
    assert len(documents_of(streams.held)) == 1  # the held-out stream is dev's own conversation


def test_the_streams_and_artifact_keys_name_the_held_out_prompt_rule(sharegpt, monkeypatch):
    """Streams encoded, and heads trained, before training conversations opening with a held-out prompt
    were dropped hold them: the document rule names that rule and the ShareGPT prompt rule inside it,
    and a new one makes other streams and another artifact key."""
    from harness.heads import recipes

    tok = word_chat_tokenizer()
    sharegpt([])
    assert "however short" in recipes.DOCUMENT_RULE and "sharegpt-prompts-v4" in recipes.DOCUMENT_RULE
    first = streams_key(tok, DataRecipe(), target_hash="t" * 16)
    sources = recipes.data_sources_key(DataRecipe(), tok)
    inline = streams_key(tok, DataRecipe(source="inline"), target_hash="t" * 16, documents=(DOCS, DOCS))
    monkeypatch.setattr(recipes, "DOCUMENT_RULE", recipes.DOCUMENT_RULE + "-next")
    assert streams_key(tok, DataRecipe(), target_hash="t" * 16) != first
    assert recipes.data_sources_key(DataRecipe(), tok) != sources  # the artifacts' key part
    # inline documents are keyed by their own ids
    assert streams_key(tok, DataRecipe(source="inline"), target_hash="t" * 16, documents=(DOCS, DOCS)) == inline


def test_the_streams_key_holds_the_sharegpt_file_and_the_chat_template_the_tokenizer_applies(sharegpt):
    """A new ShareGPT file or another chat template of the tokenizer (one the target's fingerprint
    leaves out) makes other streams; the template does not matter with chat formatting off."""
    tok = word_chat_tokenizer()

    def key(**data) -> str:
        return streams_key(tok, DataRecipe(**data), target_hash="t" * 16)

    sharegpt([], sha="a" * 64)
    first, plain = key(), key(chat=False)
    sharegpt([], sha="b" * 64)
    assert key() != first
    sharegpt([], sha="a" * 64)
    assert key() == first
    tok.chat_template = STRICT_TEMPLATE
    assert key() != first and key(chat=False) == plain
    inline = streams_key(tok, DataRecipe(source="inline"), target_hash="t" * 16, documents=(DOCS, DOCS))
    sharegpt([], sha="b" * 64)
    assert streams_key(tok, DataRecipe(source="inline"), target_hash="t" * 16, documents=(DOCS, DOCS)) == inline
