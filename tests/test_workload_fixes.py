"""Workload prompts as the model reads them: a left cut of a ``messages`` prompt keeps every message
under its own header, ShareGPT's prompts are first questions, each once, JSON Lines files are read
alike by the workload, the exclusions and the files corpus, and a prompt file or chat template the
run cannot use is refused in one line before any model work."""

import json

import pytest
from helpers import word_chat_tokenizer, write_jsonl

from harness.workloads.conversations import TRUNCATE_LEFT, ContextLimit, PromptEncoder, chat_ids
from harness.workloads.prompts import Prompt, WorkloadError, load_workload

SYSTEM_BLOCK = "<s> <bot> w0 w1 w2 </s> "  # a default system block before the template's messages


def limit(positions, rule=TRUNCATE_LEFT, max_new=4, rows=2):
    return ContextLimit(positions, "the target (model=tiny)", max_new, rows, rule)


def words(first, last):
    return " ".join(f"w{i}" for i in range(first, last))


def chat_tokenizer():
    tok = word_chat_tokenizer()
    tok.chat_template = SYSTEM_BLOCK + tok.chat_template
    return tok


def newline_tokenizer():
    """A word-level tokenizer whose header ends in a newline and whose runs of newlines are one token:
    a text that opens with a blank line merges with the header's newline, as byte-level BPE merges
    ``user\\n`` and ``\\n\\nword`` into ``\\n\\n\\n``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "<bot>", "\n", "\n\n", "\n\n\n"] + [f"w{i}" for i in range(40)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(" +"), "removed"), pre_tokenizers.Split(Regex("\n+"), "isolated")]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<user>", "<bot>"],
    )
    tok.chat_template = (
        "<s> w0 w1 </s>{% for m in messages %}{% if m['role'] == 'user' %}<user>\n{{ m['content'] }}</s>"
        "{% else %}<bot>\n{{ m['content'] }}</s>{% endif %}{% endfor %}{% if add_generation_prompt %}<bot>\n{% endif %}"
    )
    return tok


# ---------------------------------------------------------------- workload.truncate=left of messages


def test_a_messages_prompt_loses_its_oldest_exchange_whole_not_an_answers_words_under_the_user_header():
    """A first turn of several messages whose first text was shorter than the cut kept the opening up to the
    first user header and then the tail of the conversation: the assistant's words were read as the user's."""
    tok = chat_tokenizer()
    prompt = Prompt(
        prompt_id="m",
        category="chat",
        messages=(
            {"role": "user", "content": "w3"},
            {"role": "assistant", "content": words(4, 31)},
            {"role": "user", "content": "say more"},
        ),
    )
    enc = PromptEncoder(tok, chat=True, limit=limit(20))  # room 14
    full = enc.raw(prompt)
    turn = enc.turn(prompt)
    last = chat_ids(tok, [{"role": "user", "content": "say more"}])
    assert turn.ids == last and len(turn.ids) <= 14
    assert turn.cut_tokens == len(full) - len(last) and turn.prompt_tokens == len(full)
    assert "w30" not in tok.convert_ids_to_tokens(turn.ids)  # no word of the answer is left under a header


def test_whole_messages_go_up_to_a_user_message_and_system_messages_stay():
    tok = chat_tokenizer()
    system = {"role": "system", "content": "w31 w32"}
    prompt = Prompt(
        prompt_id="s",
        category="chat",
        messages=(
            system,
            {"role": "user", "content": "w3"},
            {"role": "user", "content": "w4"},
            {"role": "assistant", "content": words(5, 25)},
            {"role": "user", "content": "say more"},
        ),
    )
    enc = PromptEncoder(tok, chat=True, limit=limit(22))  # room 16
    # dropping the first user message leaves the second with the answer (too long); the answer alone
    # cannot open what is left, so the next cut takes both: the system message and the last question stay
    assert enc.turn(prompt).ids == chat_ids(tok, [system, {"role": "user", "content": "say more"}])
    wide = PromptEncoder(tok, chat=True, limit=limit(44))  # room 38: the first user message alone goes
    kept = [system, *[dict(m) for m in prompt.messages[2:]]]
    assert len(enc.raw(prompt)) == 40 and len(chat_ids(tok, kept)) == 38
    assert wide.turn(prompt).ids == chat_ids(tok, kept)


def test_a_last_question_too_long_alone_is_cut_inside_keeping_the_opening_and_its_header():
    tok = chat_tokenizer()
    ids = tok.convert_tokens_to_ids
    question = {"role": "user", "content": words(11, 36)}
    prompt = Prompt(
        prompt_id="q",
        category="chat",
        messages=({"role": "user", "content": "w3"}, {"role": "assistant", "content": words(4, 11)}, question),
    )
    enc = PromptEncoder(tok, chat=True, limit=limit(20))  # room 14
    alone = chat_ids(tok, [question])
    opening = ids(["<s>", "<bot>", "w0", "w1", "w2", "</s>", "<user>"])
    turn = enc.turn(prompt)
    assert turn.ids == opening + alone[-7:] and turn.cut_tokens == len(enc.raw(prompt)) - 14
    assert tok.convert_ids_to_tokens(turn.ids[7:]) == ["w30", "w31", "w32", "w33", "w34", "w35", "<bot>"]


def test_a_small_room_drops_the_oldest_exchange_before_cutting_the_first_tokens():
    """Where the opening took more than half the room, the prompt's last tokens were kept whatever they
    were: a later turn started mid-answer with neither the system block nor a header, though the
    conversation without its first exchange fitted."""
    tok = chat_tokenizer()
    question = Prompt(prompt_id="q", category="qa", turns=(words(3, 23), "say more"))
    answer = tok.convert_tokens_to_ids(["hello", "world"]) + [2]
    enc = PromptEncoder(tok, chat=True, eos=frozenset({2}), limit=limit(16))  # room 10 < 2 x the opening's 7
    alone = enc.raw(Prompt(prompt_id="q2", category="qa", turns=("say more",)))
    assert len(alone) == 10
    second = enc.turn(question, [answer])
    assert second.ids == alone and second.cut_tokens == len(enc.raw(question, [answer])) - 10
    messages = Prompt(
        prompt_id="m",
        category="chat",
        messages=(
            {"role": "user", "content": words(3, 23)},
            {"role": "assistant", "content": "hello world"},
            {"role": "user", "content": "say more"},
        ),
    )
    assert enc.turn(messages).ids == alone
    assert (
        enc.turn(Prompt(prompt_id="t", category="qa", turns=(words(3, 23),))).ids
        == enc.raw(Prompt(prompt_id="t", category="qa", turns=(words(3, 23),)))[-10:]
    )  # one message, an opening over half the room: the first tokens go, as without a template


def test_a_text_opening_with_a_blank_line_keeps_the_headers_newline():
    """A text starting with newlines merged with the header's own newline into one token; the tokens the
    prompt shared with its emptied rendering stopped before it, and the cut removed the header's newline."""
    tok = newline_tokenizer()
    nl = tok.convert_tokens_to_ids("\n")
    prompt = Prompt(prompt_id="n", category="chat", messages=({"role": "user", "content": "\n\n" + words(3, 30)},))
    enc = PromptEncoder(tok, chat=True, limit=limit(20))  # room 14
    full = enc.raw(prompt)
    assert tok.convert_ids_to_tokens(full[4:6]) == ["<user>", "\n\n\n"]  # the header's newline merged
    assert enc.first_text(prompt, (), full) == (5, len(full) - 3)
    turn = enc.turn(prompt)
    assert turn.ids[:6] == full[:5] + [nl] and turn.cut_tokens == len(full) - 14  # the header whole
    assert tok.convert_ids_to_tokens(turn.ids[6:]) == ["w25", "w26", "w27", "w28", "w29", "</s>", "<bot>", "\n"]
    assert enc.text_span(prompt, (), full) == (full[:5] + [nl], 5, len(full) - 3)
    # where the kept text opens with that newline itself, it is not doubled: one newline after the header
    lines = Prompt(
        prompt_id="l",
        category="chat",
        messages=({"role": "user", "content": "\n\n" + "\n".join(words(3, 30).split())},),
    )
    for positions in (20, 21):
        kept = tok.convert_ids_to_tokens(PromptEncoder(tok, chat=True, limit=limit(positions)).turn(lines).ids)
        assert len(kept) <= positions - 6 and kept[4:6] == ["<user>", "\n"] and kept[6].startswith("w"), kept
        assert kept[-4:] == ["w29", "</s>", "<bot>", "\n"]


# ---------------------------------------------------------------- ShareGPT prompts


def test_sharegpt_prompts_are_each_conversations_first_question_once(monkeypatch):
    """Every part ``<base>_k`` of a ShareGPT conversation was a prompt: a later part opens mid-conversation
    ("explain more", its context in the part before), parts of one chat were separate correlated prompts,
    and a text shared twice was two prompts."""
    from harness.workloads import prompts
    from harness.workloads.corpora import ChatTurn, Conversation

    def conv(cid, *turns):
        return Conversation(cid, tuple(ChatTurn(role, text) for role, text in turns))

    convs = [
        conv("aaa_0", ("user", "hello"), ("assistant", "hi")),
        conv("aaa_1", ("user", "explain more"), ("assistant", "more")),
        conv("bbb_0", ("system", "shared from a site"), ("user", "How to cook?"), ("assistant", "Like so")),
        conv("ccc_0", ("user", "hello"), ("assistant", "hello again")),
        conv("ddd_0", ("assistant", "\u200b"), ("user", "a question after an answer")),
        conv("eee_3", ("user", "and the fourth part"), ("assistant", "x")),
        conv("eee_0", ("user", "Write a poem"), ("assistant", "A poem")),
        conv("fff_0", ("user", "  "), ("assistant", "y"), ("user", "a follow-up")),
    ]
    monkeypatch.setattr(prompts, "sharegpt_conversations", lambda split: convs)
    got = prompts.load_sharegpt("eval")
    assert [(p.prompt_id, p.messages[0]["content"], p.reference) for p in got] == [
        ("aaa_0", "hello", "hi"),
        ("bbb_0", "How to cook?", "Like so"),
        ("eee_0", "Write a poem", "A poem"),
    ]
    assert "one prompt per conversation" in prompts.SHAREGPT_PROMPT_RULE


def test_the_packaged_sharegpt_eval_prompts_hold_no_later_part_and_no_repeated_text():
    from harness.workloads.corpora import prompt_key, sharegpt_base_id

    got = load_workload(name="sharegpt", split="eval")
    assert all(p.prompt_id.endswith("_0") for p in got)
    assert len({sharegpt_base_id(p.prompt_id) for p in got}) == len(got)
    assert len({prompt_key(p.messages[0]["content"]) for p in got}) == len(got)
    assert len(got) == 493


# ---------------------------------------------------------------- JSON Lines read alike


@pytest.mark.parametrize("content", ["x\u2028y", "x\u2029y", "x\x85y"])
def test_exclusions_and_the_files_corpus_read_a_line_as_the_workload_reads_it(tmp_path, content):
    """JSON allows U+2028, U+2029 and U+0085 raw inside a string; the exclusions and the files corpus split
    the decoded text at them (``str.splitlines``) and refused the file the workload had read, and neither
    dropped a byte-order mark: ``exclude=<workload>.jsonl``, which the leakage refusal offers, failed."""
    from harness.workloads.corpora import FilesCorpus
    from harness.workloads.datastore import exclusions_for

    path = tmp_path / "w.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + json.dumps({"id": "a", "prompt": content}, ensure_ascii=False).encode()
        + b"\r\n"
        + json.dumps({"id": "b", "prompt": "second"}).encode()
        + b"\n"
    )
    assert [p.text for p in load_workload(name="jsonl", split="eval", path=str(path))] == [content, "second"]
    assert [(i.item_id, i.text) for i in exclusions_for(str(path))] == [("a/prompt", content), ("b/prompt", "second")]
    docs = tmp_path / "docs.jsonl"
    docs.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": content}, ensure_ascii=False).encode() + b"\n")
    assert [(d.doc_id, d.segments) for d in FilesCorpus(path=str(docs)).documents()] == [("docs.jsonl:1", (content,))]


def test_a_line_nested_too_deep_is_refused_naming_it(tmp_path):
    """A line of arrays nested thousands deep raised RecursionError (exit 1, no line named); one nested a
    few hundred deep passed json.loads and ran the reference's reader out of stack."""
    from harness.workloads.datastore import DatastoreError, jsonl_exclusions

    for depth in (200_000, 900):
        path = tmp_path / "q.jsonl"
        path.write_text(
            '{"question_id": 1, "category": "qa", "turns": ["x"]}\n'
            + '{"question_id": 2, "category": "qa", "turns": ["x"], "reference": '
            + "[" * depth
            + '"r"'
            + "]" * depth
            + "}\n"
        )
        with pytest.raises(WorkloadError, match=r"q.jsonl:2: arrays or objects nested more than 64 deep") as err:
            load_workload(name="spec_bench", split="eval", path=str(path))
        assert "\n" not in str(err.value)
        with pytest.raises(DatastoreError, match=r"q.jsonl:2: arrays or objects nested more than 64 deep"):
            jsonl_exclusions(path)
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["x"], "reference": [["a", "b"], ["c"]]}\n')
    assert load_workload(name="spec_bench", split="eval", path=str(path))[0].reference == "a\nb\nc"


# ---------------------------------------------------------------- refused before any model work


def test_a_category_of_another_split_is_refused_as_an_empty_split_naming_the_split_that_has_it(tmp_path):
    """A file whose lines are all in another split was refused as lacking the category, listing none."""
    path = write_jsonl(tmp_path / "w.jsonl", [{"id": "a", "prompt": "x", "split": "dev", "category": "qa"}])
    with pytest.raises(WorkloadError) as err:
        load_workload(name="jsonl", split="eval", path=path, categories=["qa"])
    assert str(err.value) == f"{path} has no prompts in split 'eval' (workload.split=eval)"
    assert err.value.suggestions == (("workload.split=dev",),)
    assert [p.prompt_id for p in load_workload(name="jsonl", split="dev", path=path, categories=["qa"])] == ["a"]
    with pytest.raises(WorkloadError, match=r"'chat' is not a category of .*w.jsonl; its categories: \['qa'\]"):
        load_workload(name="jsonl", split="dev", path=path, categories=["chat"])


def test_a_prompt_the_chat_template_renders_as_nothing_is_refused_naming_it_and_the_template(tmp_path):
    """A template that writes only some roles' messages rendered a prompt as no token: the run stopped after
    the weights loaded with 'prompt 0 is empty', naming neither the prompt nor the template."""
    from harness.workloads.conversations import set_chat_template

    template = tmp_path / "assistant_only.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    tok = word_chat_tokenizer()
    set_chat_template(tok, str(template))
    fine = Prompt(prompt_id="ok", category="chat", messages=({"role": "assistant", "content": "hello"},))
    empty = Prompt(prompt_id="b", category="chat", text="hello world")
    PromptEncoder(tok, chat=True).check([fine])
    with pytest.raises(WorkloadError) as err:
        PromptEncoder(tok, chat=True).check([fine, empty])
    assert str(err.value) == (
        f"prompt 'b': the chat template workload.chat_template={template} renders its messages (user) as no token "
        "at all: there is nothing to prefill; give workload.chat_template a template that writes them"
    )
    own = word_chat_tokenizer()
    own.chat_template = template.read_text()
    with pytest.raises(WorkloadError, match=r"^prompt 'b': the tokenizer's own chat template renders"):
        PromptEncoder(own, chat=True).check([empty])
