"""Loss positions of the drafts' training streams (``proposer.data.loss_tokens``): the assistant
tokens of a conversation rendered through a ChatML chat template, the streams and artifacts keyed by
the option, and the heads', EAGLE's and the early-exit adapter's losses counting only those labels
while every token still feeds the context."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_heads_data import conversation, sharegpt  # noqa: F401  (sharegpt: the fixture)

from harness.app import train_main
from harness.heads.artifacts import LabelledDocument, assistant_labels, heads_artifact_path, take_budget
from harness.heads.eagle import EagleDraft, spec_from_target
from harness.heads.recipes import DataRecipe, EagleTrainRecipe, TrainRecipe
from harness.prepare.eagle import documents_of as eagle_documents
from harness.prepare.eagle import eagle_loss, pair_batch, pair_labels
from harness.prepare.early_exit import documents_of as exit_documents
from harness.prepare.early_exit import row_labels
from harness.prepare.heads import ensure_heads
from harness.prepare.heads_data import PackedStream, UnverifiedStream, load_stream, training_data
from harness.prepare.heads_training import gather_batch, head_loss, labelled_anchors, train_heads
from harness.prepare.teacher_rows import max_head, run_lengths, supervised, teacher_row_index
from harness.prepare.trained import Target
from harness.target.loading import build_tiny_model

#: SmolLM2-Instruct's chat template, verbatim (ChatML; a default system prompt, no {% generation %})
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_tokenizer():
    """A word-level fast tokenizer with SmolLM2's chat template: <|im_end|> is its EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    words = "system user assistant You are a helpful AI named SmolLM , trained by Hugging Face".split()
    vocab = special + words + [f"w{i}" for i in range(40)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    tok.chat_template = SMOLLM2_TEMPLATE
    return tok


def _ids(tok, msgs):
    out = tok.apply_chat_template(msgs, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "input_ids") or isinstance(out, dict) else out)


def test_the_mask_marks_exactly_the_assistant_turns_and_their_end_of_turn_token():
    """Two exchanges through SmolLM2's template: the system prompt, the role markers, the user turns
    and the newline after each <|im_end|> are not labels; each answer and its <|im_end|> (the EOS the
    model emits to end its turn) are."""
    tok = chatml_tokenizer()
    msgs = [
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": "w3 w4"},
        {"role": "user", "content": "w5"},
        {"role": "assistant", "content": "w6 w7 w8"},
    ]
    ids = _ids(tok, msgs)
    labels = assistant_labels(tok, msgs, ids)
    pieces = tok.convert_ids_to_tokens(ids)
    assert [p for p, lab in zip(pieces, labels) if lab] == ["w3", "w4", "<|im_end|>", "w6", "w7", "w8", "<|im_end|>"]
    unlabelled = [p for p, lab in zip(pieces, labels) if not lab]
    assert unlabelled[:4] == ["<|im_start|>", "system", "You", "are"] and "w1" in unlabelled and "w5" in unlabelled
    assert unlabelled.count("assistant") == 3  # the system prompt's word and both role markers
    doc = LabelledDocument(ids, labels)
    cut = take_budget([doc], 12)[0]  # the budget cuts a document with its labels
    assert list(cut) == ids[:12] and cut.labels == labels[:12]


def _chat_streams(tmp_path, monkeypatch, **data):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    recipe = {"data": {"token_budget": 400, "held_out_tokens": 40, "max_len": 40, **data}}
    target = SimpleNamespace(model=build_tiny_model(seed=3), tokenizer=chatml_tokenizer(), source="tiny")
    return training_data(target, recipe, progress=False)


CONVERSATIONS = [
    conversation("train", 0, ("user", "w1 w2"), ("assistant", "w3 w4"), ("user", "w5"), ("assistant", "w6")),
    conversation("train", 1, ("user", " ".join(f"w{i}" for i in range(30))), ("assistant", "w31 w32")),
    conversation("train", 2, ("user", "w7"), ("assistant", "w8 w9 w10")),
    conversation("dev", 0, ("user", "w11"), ("assistant", "w12 w13")),
]


def test_the_streams_carry_the_mask_and_are_keyed_by_it(tmp_path, monkeypatch, sharegpt):  # noqa: F811
    """The same tokens either way; with assistant the stream's mask marks the answers (none in the
    conversation whose user turn fills max_len, which the budget counts all the same), with all there
    is none, and the two streams are cached apart (the option is in their key). The mask is saved with
    the stream under its digest: a stream whose mask was changed is not read."""
    sharegpt(CONVERSATIONS)
    tok = chatml_tokenizer()
    masked = _chat_streams(tmp_path, monkeypatch)
    every = _chat_streams(tmp_path, monkeypatch, loss_tokens="all")
    assert torch.equal(masked.train.tokens, every.train.tokens) and masked.stream != every.stream
    assert every.train.loss_mask is None and every.train.meta["loss_tokens"] == "all"
    mask = masked.train.loss_mask
    assert mask is not None and masked.train.meta["loss_tokens"] == "assistant"
    marked = tok.convert_ids_to_tokens(masked.train.tokens[mask].tolist())
    assert marked == ["w3", "w4", "<|im_end|>", "w6", "<|im_end|>", "w8", "w9", "w10", "<|im_end|>"]
    assert masked.train.meta["loss_positions"] == len(marked) and masked.train.num_documents == 3
    assert not bool(mask[masked.train.segment_ids == 1].any())  # the user turn filled its 40 tokens
    assert tok.convert_ids_to_tokens(masked.held.tokens[masked.held.loss_mask].tolist()) == ["w12", "w13", "<|im_end|>"]

    path = tmp_path / "heads" / "streams" / masked.stream
    assert torch.equal(load_stream(path).loss_mask, mask)  # cached with the stream, under its digest
    tensors, meta = load_file(str(path)), safe_open(str(path), framework="pt").metadata()
    tensors["loss_mask"] = torch.ones_like(tensors["loss_mask"])
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(UnverifiedStream, match="changed since it was saved"):
        load_stream(path)


def test_a_plain_text_document_labels_every_token_with_a_note(tmp_path, monkeypatch, sharegpt, capsys):  # noqa: F811
    """data.chat=false joins the turns as plain text: no turns to find, every token a label, said once
    on stderr and kept in the stream's meta (the artifact's manifest records it)."""
    sharegpt(CONVERSATIONS)
    streams = _chat_streams(tmp_path, monkeypatch, chat=False)
    assert streams.train.loss_mask is None and streams.train.meta["loss_tokens"] == "all"
    assert "data.chat=false joins the turns as plain text" in streams.train.meta["loss_note"]
    assert "harness: note: data.loss_tokens=assistant: data.chat=false" in capsys.readouterr().err


def test_the_recipe_and_the_artifact_key_differ_between_assistant_and_all():
    model = build_tiny_model(seed=3)
    tok = chatml_tokenizer()
    paths = {}
    for mode in ("assistant", "all"):
        recipe, path = heads_artifact_path(
            "medusa", {"num_heads": 2, "data": {"loss_tokens": mode}}, model=model, tokenizer=tok
        )
        assert recipe["data"]["loss_tokens"] == mode
        paths[mode] = path
    assert paths["assistant"] != paths["all"]
    with pytest.raises(ValueError, match="data.loss_tokens must be one of"):
        DataRecipe(loss_tokens="user")


def _stream(lengths, mask):
    """A packed stream of documents of ``lengths`` (token ``100 + position``, row ``position``)."""
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    n = len(seg)
    return PackedStream(
        tokens=torch.arange(n) + 100,
        segment_ids=seg,
        valid=torch.ones(n, dtype=torch.bool),
        hidden=torch.arange(n).float()[:, None].repeat(1, 4).half(),
        meta={},
        loss_mask=None if mask is None else torch.tensor(mask, dtype=torch.bool),
    )


#: two documents, 0..5 and 6..9: labels at 3, 4 and 8
MASK = [False, False, False, True, True, False, False, False, True, False]


def test_the_heads_batch_keeps_only_rows_whose_label_is_an_assistant_token():
    """Head i at anchor t keeps its row only where tokens[t + i] is a label; every head's inputs and
    the context window are unchanged; an anchor with no labelled head is not trained on; the loss
    does not see the unlabelled labels."""
    s = _stream([6, 4], MASK)
    k = 2
    heads = max_head(s.segment_ids, s.valid, max_future=k)
    run = run_lengths(s.segment_ids, s.valid)
    anchors = labelled_anchors(s, heads, num_heads=k)
    assert anchors.tolist() == [1, 2, 3, 7]  # 1: head 2 -> 3; 2: 3, 4; 3: 4; 7: 8 (anchor 6 has no row)
    b = gather_batch(s, anchors, heads=heads, run=run, num_heads=k, window=2)
    assert b.head_mask.tolist() == [[False, True], [True, True], [True, False], [True, False]]
    assert (b.labels - 100).tolist() == [[2, 3], [3, 4], [4, 5], [8, 9]]  # labels as they are; masked rows ignored
    assert (b.path - 100).tolist() == [[1, 2], [2, 3], [3, 4], [7, 8]]  # inputs: every token
    kept = {(int(t), i + 1) for t, row in zip(anchors, b.head_mask.tolist()) for i, m in enumerate(row) if m}
    reference = supervised(teacher_row_index(s.segment_ids.tolist(), [True] * 10, max_future=k), MASK)
    assert kept == {(r.anchor, r.head) for r in reference}  # the rows the reference helper keeps
    unmasked = gather_batch(_stream([6, 4], None), anchors, heads=heads, run=run, num_heads=k, window=2)
    assert torch.equal(b.ctx_window, unmasked.ctx_window) and unmasked.head_mask.tolist()[2] == [True, True]
    logits = torch.randn(4, k, 120)
    recipe = TrainRecipe()
    other = gather_batch(s, anchors, heads=heads, run=run, num_heads=k, window=2)
    other.labels[~other.head_mask] = 0  # the unlabelled positions' tokens changed: the same loss
    assert torch.equal(
        head_loss(logits, b, recipe=recipe, lm_head=None), head_loss(logits, other, recipe=recipe, lm_head=None)
    )
    assert (
        labelled_anchors(_stream([6, 4], None), heads, num_heads=k).tolist() == torch.nonzero(heads).flatten().tolist()
    )
    with pytest.raises(ValueError, match="no teacher rows with an assistant-token label"):
        heads_of = SimpleNamespace(spec=SimpleNamespace(num_heads=k, kind="medusa"))
        embed, lm_head = torch.nn.Embedding(120, 4), torch.nn.Linear(4, 120)
        train_heads(heads_of, _stream([6, 4], [False] * 10), recipe=recipe, embed=embed, lm_head=lm_head)


def test_eagle_pairs_count_only_where_the_drafted_token_is_an_assistant_token():
    """Pair j (feature f_j, token x_{j+1}) drafts x_{j+2}: it counts only where that is a label; every
    pair stays valid (the draft attends to all of them). Without a mask every pair counts."""
    docs = eagle_documents(_stream([6, 4], MASK))
    assert [pair_labels(d).tolist() for d in docs] == [[False, True, True, False, False], [True, False, False]]
    feats, tokens, targets, positions, valid, labelled = pair_batch(docs)
    assert valid.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert labelled.tolist() == [[False, True, True, False, False], [True, False, False, False, False]]
    assert (tokens[0] - 100).tolist() == [1, 2, 3, 4, 5]
    plain = pair_batch(eagle_documents(_stream([6, 4], None)))
    assert torch.equal(plain[5], plain[4])

    model = build_tiny_model(seed=3)
    draft = EagleDraft(spec_from_target(model.config)).eval()
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    d = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(10, d, generator=gen).half()
    masked = _stream([6, 4], MASK)
    masked.hidden, masked.tokens = rows, masked.tokens % model.config.vocab_size
    batch = pair_batch(eagle_documents(masked))
    moved = list(batch)
    moved[2] = batch[2] + 5 * (~batch[5])[..., None]  # the targets of the pairs that do not count
    recipe = EagleTrainRecipe()
    with torch.no_grad():
        same = eagle_loss(draft, embed, lm_head, batch, recipe), eagle_loss(draft, embed, lm_head, tuple(moved), recipe)
        moved[2] = batch[2] + 5 * batch[5][..., None]  # those of the pairs that count
        changed = eagle_loss(draft, embed, lm_head, tuple(moved), recipe)
    assert torch.equal(*same) and not torch.equal(same[0], changed)


def test_the_adapter_counts_the_rows_before_an_assistant_token():
    s = _stream([6, 4], MASK)
    assert [row_labels(s, sl).tolist() for sl in exit_documents(s)] == [
        [False, False, True, True, False, False],
        [False, True, False, False],
    ]
    assert row_labels(_stream([6, 4], None), slice(0, 6)).all()


def test_heads_trained_on_a_chat_template_count_assistant_labels_only(tmp_path, monkeypatch, sharegpt):  # noqa: F811
    """End to end on the tiny target with a ChatML tokenizer: the manifest records the recipe's
    loss_tokens and the stream's labels, and held-out agreement counts head 1's assistant labels only."""
    sharegpt(CONVERSATIONS)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    target = Target(build_tiny_model(seed=3), chatml_tokenizer(), "tiny")
    options = {"num_heads": 2, "data": {"token_budget": 400, "held_out_tokens": 40, "max_len": 40}}
    art = ensure_heads("medusa", options, target, progress=False)
    m = art.manifest
    assert m["recipe"]["data"]["loss_tokens"] == "assistant" and m["streams"]["train"]["loss_tokens"] == "assistant"
    assert m["streams"]["train"]["loss_positions"] == 9 < m["tokens_seen"]
    assert m["held_out"]["rows"][0] == 3  # the dev answer's w12, w13, <|im_end|>
    every = ensure_heads(
        "medusa", {**options, "data": {**options["data"], "loss_tokens": "all"}}, target, progress=False
    )
    assert every.path != art.path and every.manifest["held_out"]["rows"][0] > 3


def test_train_on_the_tiny_model_labels_every_byte_by_default(tmp_path, monkeypatch, capsys):
    """`harness train proposer=medusa model=tiny`: the tiny model's byte-id documents have no chat
    template, so the default loss_tokens=assistant labels every token; the manifest says why."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    argv = ["proposer=medusa", "model=tiny", "threads=1", "proposer.data.token_budget=300"]
    argv += ["proposer.data.held_out_tokens=100", "proposer.data.max_len=50"]
    assert train_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    m = json.loads((Path(out["path"]) / "manifest.json").read_text())
    assert m["recipe"]["data"]["loss_tokens"] == "assistant"
    assert m["streams"]["train"]["loss_tokens"] == "all" and "byte ids" in m["streams"]["train"]["loss_note"]
    assert m["streams"]["train"]["loss_positions"] == m["tokens_seen"] == 300
