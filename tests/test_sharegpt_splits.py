"""ShareGPT asks one question under several conversation ids, spelt with other whitespace or case and
answered otherwise. Texts equal by ``prompt_key`` are one prompt: in one split of the workload only, a
train conversation opening with a held-out one is no REST datastore text, and no heads' training text."""

import pytest

from harness.heads.artifacts import held_out_prompts, sharegpt_documents
from harness.workloads import corpora, prompts
from harness.workloads.corpora import ChatTurn, Conversation, ShareGPTCorpus, prompt_key, sharegpt_split
from harness.workloads.datastore import (
    DatastoreError,
    build_datastore,
    load_datastore,
    sharegpt_heldout_exclusions,
)


def conv_id(split: str, n: int) -> str:
    """The ``n``-th id ``g<k>_0`` that the split hash puts in ``split``."""
    ids = (f"g{k}_0" for k in range(10_000) if sharegpt_split(f"g{k}_0") == split)
    return next(i for k, i in enumerate(ids) if k == n)


def conversation(split: str, n: int, *turns: tuple[str, str], part: int = 0) -> Conversation:
    cid = conv_id(split, n).removesuffix("_0") + f"_{part}"
    return Conversation(cid, tuple(ChatTurn(role, text) for role, text in turns))


@pytest.fixture
def sharegpt(monkeypatch):
    """Gives the conversations the packaged ShareGPT file is read as (by the prompts, the corpus, the
    REST exclusions and the heads' documents alike)."""

    def set_data(conversations):
        data = corpora.ShareGPTData(tuple(conversations), file_sha256="a" * 64, file_bytes=0, truncated_at_char=None)
        monkeypatch.setattr(corpora, "load_sharegpt", lambda: data)

    return set_data


QUESTION = "Explain quantum computing in simple terms"
EVAL_ANSWER = "qubits hold superpositions " * 20
OTHER_ANSWER = "a quantum computer computes with amplitudes " * 20


def test_prompt_key_collapses_whitespace_strips_and_casefolds():
    assert prompt_key("  What is the\n\nmeaning of life ") == "what is the meaning of life"
    assert prompt_key("line one\n\nline two") == prompt_key("line one\nline two") == "line one line two"
    assert prompt_key("HI") == prompt_key("hi") == prompt_key("Hi\t") == "hi"
    assert prompt_key("Straße") == prompt_key("STRASSE")  # casefold, not lower
    assert prompt_key("a b") != prompt_key("ab")


def test_prompts_equal_but_for_whitespace_and_case_land_in_one_split(sharegpt):
    """ "What is the meaning of life" (eval) and "what is the meaning of life" (train), or "hi" and "Hi",
    or one question with a blank line and with a line break, were prompts of two splits."""
    sharegpt(
        [
            conversation("eval", 0, ("user", "What is the meaning of life"), ("assistant", "42")),
            conversation("eval", 1, ("user", "hi"), ("assistant", "hello")),
            conversation("eval", 2, ("user", "hello there"), ("assistant", "hi")),
            conversation("eval", 3, ("user", "Hello  there"), ("assistant", "hey")),
            conversation("eval", 4, ("user", "Fix this:\n\nprint(x)"), ("assistant", "ok")),
            conversation("dev", 0, ("user", "WHAT IS THE MEANING OF LIFE "), ("assistant", "none")),
            conversation("dev", 1, ("user", "a dev question"), ("assistant", "a")),
            conversation("calibration", 0, ("user", "Hi"), ("assistant", "yo")),
            conversation("calibration", 1, ("user", "A dev question"), ("assistant", "b")),
            conversation("train", 0, ("user", "what is the meaning of life"), ("assistant", "nothing")),
            conversation("train", 1, ("user", "HI"), ("assistant", "hey")),
            conversation("train", 2, ("user", "fix this:\nprint(x)"), ("assistant", "done")),
            conversation("train", 3, ("user", "a train question"), ("assistant", "c")),
        ]
    )
    got = {s: [p.messages[0]["content"] for p in prompts.load_sharegpt(s)] for s in corpora.SPLITS}
    assert got == {
        "eval": ["What is the meaning of life", "hi", "hello there", "Fix this:\n\nprint(x)"],
        "dev": ["a dev question"],
        "calibration": [],
        "train": ["a train question"],
    }
    assert (
        prompts.SHAREGPT_PROMPT_RULE.startswith("sharegpt-prompts-v4:") and "prompt_key" in prompts.SHAREGPT_PROMPT_RULE
    )
    # the corpus's held-out prompts are the workload's, by the same key
    held = prompts.sharegpt_prompt_keys(corpora.HELD_OUT_SPLITS)
    assert corpora.sharegpt_held_out_keys() == held
    assert held == {"what is the meaning of life", "hi", "hello there", "fix this: print(x)", "a dev question"}


def test_a_train_conversation_asking_a_held_out_question_with_another_answer_is_no_datastore_document(
    sharegpt, monkeypatch
):
    """The held-out exclusion drops a document sharing a 32-token window with a held-out first user or
    assistant turn: a train conversation asking an evaluated question (a short one, however spelt) and
    answering it otherwise shared none, and the datastore held an answer to the evaluated prompt."""
    sharegpt(
        [
            conversation("eval", 0, ("user", QUESTION), ("assistant", EVAL_ANSWER)),
            conversation("dev", 0, ("system", "shared"), ("user", "Hi"), ("assistant", "hello")),
            conversation(
                "train", 0, ("user", "explain  quantum computing in simple terms\n"), ("assistant", OTHER_ANSWER)
            ),
            conversation("train", 1, ("user", "Tell me a joke"), ("assistant", "a joke " * 5)),
            # a later part whose first user turn is the question, after an assistant turn
            conversation(
                "train", 2, ("assistant", "as I said"), ("user", QUESTION.upper()), ("assistant", "more"), part=1
            ),
            conversation("train", 3, ("user", "HI"), ("assistant", "hey there")),
            conversation("train", 4, ("user", "hi, explain quantum computing"), ("assistant", "sure")),
        ]
    )
    corpus = ShareGPTCorpus(split="train")
    docs = list(corpus.documents())
    assert [d.doc_id for d in docs] == [conv_id("train", 1), conv_id("train", 4)]
    snap = corpus.snapshot()
    assert snap["held_out_rule"] == corpora.SHAREGPT_TRAIN_RULE and snap["held_out_conversations"] == 3
    assert ShareGPTCorpus(split="train", roles=("user", "assistant")).snapshot()["held_out_conversations"] == 3
    # every conversation of another split is read as it is
    assert [d.doc_id for d in ShareGPTCorpus(split="eval").documents()] == [conv_id("eval", 0)]
    assert ShareGPTCorpus(split="eval").snapshot()["held_out_rule"] is None

    # the datastore built with the default exclusion holds none of the other answer
    tok = word_tokenizer(
        [QUESTION, EVAL_ANSWER, OTHER_ANSWER, "Tell me a joke a joke hi, explain quantum computing sure"]
    )
    ds = build_datastore(
        corpus,
        tokenizer=tok,
        target_family="toy",
        exclude=sharegpt_heldout_exclusions(),
        exclude_spec="sharegpt_heldout",
        progress=False,
    )
    other = tok(OTHER_ANSWER, add_special_tokens=False)["input_ids"][:8]
    assert ds.count(other) == 0 and ds.count(tok("a joke", add_special_tokens=False)["input_ids"]) == 5
    assert ds.manifest["corpus"]["documents_seen"] == 2


def test_a_datastore_built_by_another_held_out_rule_is_refused_when_verified(sharegpt, monkeypatch, tmp_path):
    """A cached ShareGPT datastore built before the rule held the evaluated questions' other answers: its
    snapshot names the rule, so one built by another rule is refused, naming it, and rebuilt."""
    sharegpt(
        [
            conversation("eval", 0, ("user", QUESTION), ("assistant", EVAL_ANSWER)),
            conversation("train", 0, ("user", "Tell me a joke"), ("assistant", "a joke " * 5)),
        ]
    )
    tok = word_tokenizer(["Tell me a joke a joke"])
    monkeypatch.setattr(corpora, "SHAREGPT_TRAIN_RULE", "sharegpt-train-v0: none left out")
    build_datastore(ShareGPTCorpus(), tokenizer=tok, target_family="toy", out_dir=tmp_path / "ds", progress=False)
    monkeypatch.undo()
    sharegpt(
        [
            conversation("eval", 0, ("user", QUESTION), ("assistant", EVAL_ANSWER)),
            conversation("train", 0, ("user", "Tell me a joke"), ("assistant", "a joke " * 5)),
        ]
    )
    with pytest.raises(DatastoreError, match=r"changed since the build \(fields \['held_out_rule'\].*rebuild it"):
        load_datastore(tmp_path / "ds", tokenizer=tok)


def test_heads_training_text_drops_a_train_conversation_opening_with_a_held_out_prompt_however_spelt(sharegpt):
    """held_out_prompts compared the stripped text: "HI", "what is the meaning of life" and a question with
    its blank line written as a line break went into heads' training data beside eval's "hi", "What is the
    meaning of life" and the question as eval spells it."""
    sharegpt(
        [
            conversation("eval", 0, ("user", "hi"), ("assistant", "hello")),
            conversation("eval", 1, ("user", "What is the meaning of life"), ("assistant", "42")),
            conversation("eval", 2, ("user", "Fix this:\n\nprint(x)"), ("assistant", "ok")),
            conversation("train", 0, ("user", "HI"), ("assistant", "hey there")),
            conversation("train", 1, ("user", "what is the meaning of life "), ("assistant", "nothing at all")),
            conversation("train", 2, ("user", "fix this:\nprint(x)"), ("assistant", "done it")),
            conversation("train", 3, ("user", "a train question"), ("assistant", "an answer")),
        ]
    )
    held = held_out_prompts("train")
    assert held == {"hi", "what is the meaning of life", "fix this: print(x)"}
    assert all(prompt_key(t) in held for t in ("HI", "Hi", "what is the meaning of life ", "fix this:\nprint(x)"))
    docs = list(
        sharegpt_documents("train", tokenizer=None, vocab_size=259, max_len=200, chat=False, exclude_prompts=held)
    )
    assert [bytes(i - 3 for i in d).decode() for d in docs] == ["a train question\nan answer"]  # byte ids: byte + 3


def word_tokenizer(texts):
    """A tiny HF fast tokenizer over the whitespace-split words of ``texts`` (one id each, [UNK] = 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = dict.fromkeys(w for t in texts for w in t.split())
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
