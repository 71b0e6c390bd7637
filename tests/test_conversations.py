"""Each turn's prompt ids: the arm's own answers fed back through the chat template (or the tiny
model's synthetic ids, never cut), and the context limit: refused with one line naming the prompt
and the numbers, or cut from the left and measured."""

import pytest
from helpers import word_chat_tokenizer

from harness.workloads.conversations import (
    TRUNCATE_LEFT,
    TRUNCATE_REFUSE,
    ContextLimit,
    PromptEncoder,
    context_limit,
    truncate_rule,
)
from harness.workloads.prompts import Prompt, WorkloadError

CONV = Prompt(prompt_id="81", category="writing", turns=("hello world", "say more"), source_id=81)


def limit(positions, rule=TRUNCATE_REFUSE, max_new=4, rows=2):
    return ContextLimit(positions, "the target (model=tiny)", max_new, rows, rule)


def test_synthetic_ids_are_one_per_byte_and_never_cut():
    enc = PromptEncoder(None, chat=False, vocab_size=96)
    long = Prompt(prompt_id="p", category="code", text="x" * 1000)
    assert len(enc.raw(long)) == 1000  # the old encoder kept 96 bytes
    assert enc.raw(Prompt(prompt_id="e", category="code", text="")) == [3]


def test_synthetic_conversation_carries_the_arms_own_answer_without_eos():
    enc = PromptEncoder(None, chat=True, vocab_size=96, eos=frozenset({2}))
    first = enc.raw(CONV)
    assert first == enc.synthetic("hello world")
    second = enc.raw(CONV, [[7, 8, 2]])
    assert second == enc.synthetic("hello world") + [7, 8] + enc.synthetic("say more")
    with pytest.raises(ValueError, match="has 2 turn"):
        enc.raw(CONV, [[7], [8]])
    assert enc.answer_text([7, 8, 2]) == "7 8 2"  # no tokenizer: every generated id, EOS included


def test_chat_template_turn_two_is_the_conversation_with_the_decoded_answer():
    tok = word_chat_tokenizer()
    enc = PromptEncoder(tok, chat=True, eos=frozenset({2}))
    first = enc.raw(CONV)
    assert tok.decode(first) == "<user> hello world <bot>"
    answer = tok.convert_tokens_to_ids(["w1", "w2", "</s>"])
    assert enc.answer_text(answer) == "w1 w2"  # special tokens removed, whitespace stripped
    second = enc.raw(CONV, [answer])
    assert tok.decode(second) == "<user> hello world <bot> w1 w2 </s> <user> say more <bot>"
    assert second[: len(first)] == first  # the conversation grows; every turn is a full prefill


def test_conversations_need_the_chat_template_with_a_tokenizer():
    enc = PromptEncoder(word_chat_tokenizer(), chat=False)
    with pytest.raises(WorkloadError, match=r"prompt '81' has 2 turns: .* set workload.chat=true"):
        enc.check([CONV])
    single = Prompt(prompt_id="q", category="qa", turns=("hello again",))
    enc.check([single])
    assert enc.raw(single) == word_chat_tokenizer().convert_tokens_to_ids(["hello", "again"])


def test_a_prompt_the_chat_template_refuses_is_refused_before_the_models_load_naming_it():
    """A template may raise on a message it does not take (a system role, roles that do not alternate): the
    run ended on the template's bare error, after the weights loaded, naming no prompt."""
    tok = word_chat_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    fine = Prompt(prompt_id="ok", category="qa", turns=("hello again",))
    system = Prompt(
        prompt_id="sys",
        category="qa",
        messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}),
    )
    PromptEncoder(tok, chat=True).check([fine])
    with pytest.raises(
        WorkloadError, match=r"^prompt 'sys': the chat template refuses it \(System role not supported\)"
    ):
        PromptEncoder(tok, chat=True).check([fine, system])
    # a template that takes no assistant message: a conversation's later turns would fail mid-run
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no assistant turns') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    PromptEncoder(tok, chat=True).check([fine])
    with pytest.raises(
        WorkloadError, match=r"^prompt '81': the chat template refuses its turn 2 \(.*no assistant turns\); give"
    ):
        PromptEncoder(tok, chat=True).check([fine, CONV])


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_fix_and_vicuna_is_spec_benchs_format(tmp_path):
    """A tokenizer with no chat template (Vicuna's, Spec-Bench's reference model) failed with transformers'
    own error. It is refused naming workload.chat_template; ``vicuna`` builds FastChat's Vicuna v1.1
    conversation, as Spec-Bench's scripts build every model's prompts; a Jinja file is read as it is."""
    from checkpoint_fixtures import byte_tokenizer

    from harness.workloads.conversations import VICUNA_SYSTEM, chat_template_of, set_chat_template

    tok = byte_tokenizer()
    assert not tok.chat_template
    with pytest.raises(WorkloadError, match=r"^the target's tokenizer has no chat template: set workload.chat_temp"):
        PromptEncoder(tok, chat=True).check([CONV])
    # workload.chat=false is offered only where it would tokenize the prompts as they are: single-turn text
    text = Prompt(prompt_id="t", category="qa", text="hello world")
    as_messages = Prompt(prompt_id="m", category="chat", messages=({"role": "user", "content": "hi"},))
    for enc, prompts, hint in (
        (PromptEncoder(tok, chat=True), [text], True),
        (PromptEncoder(tok, chat=True), [CONV], False),  # a conversation needs the template
        (PromptEncoder(tok, chat=False), [as_messages], False),  # messages go through it whatever chat says
    ):
        with pytest.raises(WorkloadError) as refused:
            enc.check(prompts)
        assert ("workload.chat=false" in str(refused.value)) is hint
    PromptEncoder(tok, chat=False).check([text])  # text as it is: no template needed
    set_chat_template(tok, "vicuna")
    enc = PromptEncoder(tok, chat=True, eos=frozenset({2}))
    enc.check([CONV])
    # the ids Spec-Bench feeds: FastChat's prompt text through tokenizer(text) (a BOS where it adds one)
    first_text = f"{VICUNA_SYSTEM} USER: hello world ASSISTANT:"
    assert enc.raw(CONV) == tok(first_text)["input_ids"]
    assert tok.decode(enc.raw(CONV)) == first_text  # this tokenizer adds no BOS: none rendered
    answer = tok.encode(" fine, thanks", add_special_tokens=False) + [2]
    second_text = f"{VICUNA_SYSTEM} USER: hello world ASSISTANT: fine, thanks</s>USER: say more ASSISTANT:"
    assert enc.raw(CONV, [answer]) == tok(second_text)["input_ids"]  # "</s>": the EOS here, as in Vicuna's
    # the up-front bound of the second turn counts the separators Vicuna writes around a real answer
    # (" " and "</s>", left out of an empty answer's "ASSISTANT:"): an answer of max_new_tokens fits it
    limit = ContextLimit(positions=10_000, limited_by="the target", max_new_tokens=12, tree_rows=0)
    bounded = PromptEncoder(tok, chat=True, eos=frozenset({2}), limit=limit)
    longest = tok.encode("b" * 12, add_special_tokens=False)
    assert len(longest) == 12 and len(bounded.raw(CONV, [longest])) == bounded.worst_case_tokens(CONV)
    with_bos = byte_tokenizer()
    from tokenizers import processors

    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", with_bos.bos_token_id)]
    )
    assert with_bos("x")["input_ids"][0] == with_bos.bos_token_id
    set_chat_template(with_bos, "vicuna")
    ids = PromptEncoder(with_bos, chat=True).raw(CONV)
    assert ids == with_bos(first_text)["input_ids"] and ids[0] == with_bos.bos_token_id and ids.count(1) == 1
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert chat_template_of(str(jinja)) == jinja.read_text()
    with pytest.raises(
        WorkloadError, match=r"^workload.chat_template=.*nope.jinja: no such file; give vicuna or a Jinja"
    ):
        chat_template_of(str(tmp_path / "nope.jinja"))
    set_chat_template(tok, None)  # none given: the tokenizer's own stays
    assert tok.chat_template


def fastchat_vicuna(system: str, messages: list[tuple[str, str | None]]) -> str:
    """FastChat's ``Conversation.get_prompt`` for ``SeparatorStyle.ADD_COLON_TWO`` (Vicuna v1.1: seps
    " " and "</s>"): a message is ``role + ": " + message + sep``, an empty (or None) one ``role + ":"``."""
    seps, out = (" ", "</s>"), system + " "
    for i, (role, message) in enumerate(messages):
        out += f"{role}: {message}{seps[i % 2]}" if message else f"{role}:"
    return out


@pytest.mark.parametrize("answer", ["Sure.", "", " "])
def test_the_vicuna_template_renders_an_empty_answer_as_fastchat_does(answer):
    """An empty earlier answer (the model stopped at once, or its text was cut at "</s>") was rendered
    "ASSISTANT: </s>"; FastChat writes "ASSISTANT:" alone for an empty message."""
    from jinja2 import Template

    from harness.workloads.conversations import VICUNA_SYSTEM, vicuna_template

    chat = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Q2"},
    ]
    got = Template(vicuna_template(bos=False)).render(messages=chat, add_generation_prompt=True)
    assert got == fastchat_vicuna(
        VICUNA_SYSTEM, [("USER", "Q1"), ("ASSISTANT", answer), ("USER", "Q2"), ("ASSISTANT", None)]
    )
    if not answer:
        assert got.endswith("USER: Q1 ASSISTANT:USER: Q2 ASSISTANT:")


def im_end_tokenizer():
    """A byte-level tokenizer whose EOS is ``<|im_end|>`` (as SmolLM2's): ``</s>`` is plain text to it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<|im_end|>": 2}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = 3 + i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>")


def test_vicuna_answers_are_cut_at_their_first_stop_string_before_they_are_fed_back():
    """Spec-Bench's eval.py sets FastChat's stop string "</s>" on the Vicuna conversation and cuts each
    answer at its first one before storing it and feeding it back; for a tokenizer whose EOS is not
    "</s>" (SmolLM2's) the text past a literal "</s>" went back into the conversation."""
    from harness.workloads.conversations import set_chat_template

    tok = im_end_tokenizer()
    words = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    set_chat_template(tok, "vicuna")
    enc = PromptEncoder(tok, chat=True, eos=frozenset({2}))
    answer = words(" fine, thanks</s>USER: and you? ASSISTANT: well") + [2]
    second = tok.decode(enc.raw(CONV, [answer]))
    assert second.endswith("ASSISTANT: fine, thanks</s>USER: say more ASSISTANT:") and "and you?" not in second
    assert enc.answer_text(answer) == "fine, thanks"  # what is fed back and exported
    assert enc.answer(answer) == ("fine, thanks", True) and enc.stop_str == "</s>"
    # FastChat's rule: a stop string at the answer's very start cuts nothing; an answer without one is whole
    assert enc.answer(words("</s> hi") + [2]) == ("</s> hi", False)
    assert enc.answer(words(" </s> hi")) == ("", True)
    assert enc.answer(words(" no stop here ") + [2]) == ("no stop here", False)
    # the tokenizer's own template (no workload.chat_template) has no stop string: the whole text goes back
    own = PromptEncoder(word_chat_tokenizer(), chat=True, eos=frozenset({2}))
    assert own.answer(word_chat_tokenizer().convert_tokens_to_ids(["w1", "</s>", "w2"])) == ("w1 w2", False)
    plain = im_end_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert PromptEncoder(plain, chat=True).answer(answer) == ("fine, thanks</s>USER: and you? ASSISTANT: well", False)
    assert PromptEncoder(None, chat=True).answer([7, 8, 2]) == ("7 8 2", False)


@pytest.mark.parametrize(
    "value, rule",
    [("left", TRUNCATE_LEFT), ("LEFT", TRUNCATE_LEFT), (False, TRUNCATE_REFUSE), ("False", TRUNCATE_REFUSE)],
)
def test_truncate_rule(value, rule):
    assert truncate_rule(value) == rule


def test_truncate_rule_refuses_other_values():
    with pytest.raises(WorkloadError, match="workload.truncate must be left or false; got 'right'"):
        truncate_rule("right")
    # YAML's true reaches the rule as a bool: it is named as typed, not as Python's True
    with pytest.raises(WorkloadError, match="workload.truncate must be left or false; got true$"):
        truncate_rule(True)


def test_the_tightest_model_limits_and_a_budget_without_room_is_refused():
    lim = context_limit(
        limits=[("the target (model=tiny)", 512), ("the draft model (model=tiny)", 256)],
        max_new_tokens=64,
        tree_rows=8,
        rule=TRUNCATE_REFUSE,
    )
    assert (lim.positions, lim.limited_by, lim.max_prompt_tokens) == (256, "the draft model (model=tiny)", 184)
    unknown = context_limit(limits=[("the target (model=hf)", None)], max_new_tokens=8, tree_rows=1, rule="left")
    assert unknown.max_prompt_tokens is None and "unknown" in unknown.limited_by
    with pytest.raises(WorkloadError, match=r"max_new_tokens=60 \+ 8 candidate rows .* no room .* 64 positions"):
        ContextLimit(64, "the target (model=tiny)", 60, 8).check_config()


def test_refusal_names_the_prompt_and_the_numbers():
    enc = PromptEncoder(None, chat=False, limit=limit(20))  # room: 20 - 4 - 2 = 14
    long = Prompt(prompt_id="HumanEval/1", category="code", text="y" * 15)
    with pytest.raises(WorkloadError) as err:
        enc.check([Prompt(prompt_id="ok", category="code", text="y" * 14), long])
    msg = str(err.value)
    assert msg == (
        "prompt 'HumanEval/1' turn 1: 15 prompt tokens + generation.max_new_tokens=4 + 2 candidate rows "
        "(the most a round verifies) = 21 > 20 positions of the target (model=tiny); workload.truncate=left cuts "
        "the oldest text, keeping a chat template's opening (recorded per prompt)"
    )


def test_a_conversation_is_refused_on_its_bounded_last_turn():
    # turn 1 fits (11 ids); turn 2 is bounded by 11 + 8 question bytes + one answer of max_new_tokens=4
    enc = PromptEncoder(None, chat=True, limit=limit(24))  # room 18
    assert enc.worst_case_tokens(CONV) == 11 + 8 + 4
    with pytest.raises(WorkloadError, match=r"prompt '81' turn 2: 23 prompt tokens \(each earlier answer counted"):
        enc.check([CONV])
    PromptEncoder(None, chat=True, limit=limit(29)).check([CONV])  # room 23: fits


def test_left_truncation_keeps_the_last_tokens_and_says_how_many_were_cut():
    enc = PromptEncoder(None, chat=True, eos=frozenset({2}), limit=limit(16, TRUNCATE_LEFT))  # room 10
    enc.check([CONV])  # truncation: nothing refused
    first = enc.turn(CONV)
    full = enc.raw(CONV)
    assert first.ids == full[-10:] and first.prompt_tokens == 11 and first.cut_tokens == 1
    second = enc.turn(CONV, [[9, 9, 9, 2]])
    assert second.prompt_tokens == 11 + 3 + 8 and second.cut_tokens == 12 and len(second.ids) == 10
    assert second.ids == enc.raw(CONV, [[9, 9, 9, 2]])[-10:]
    fits = enc.turn(Prompt(prompt_id="s", category="qa", turns=("hi",)))
    assert fits.cut_tokens == 0 and fits.ids == enc.synthetic("hi")


def test_left_truncation_through_a_chat_template_keeps_its_opening_and_cuts_the_oldest_text():
    """The template's system block and first header stay: the model still reads a conversation,
    and what goes is the start of the first message's text (here of a second turn: the first
    question's), not the template around it."""
    tok = word_chat_tokenizer()
    tok.chat_template = "<s> <bot> w0 w1 w2 </s> " + tok.chat_template  # a default system block
    ids = tok.convert_tokens_to_ids
    question = Prompt(prompt_id="q", category="qa", turns=(" ".join(f"w{i}" for i in range(3, 23)), "say more"))
    enc = PromptEncoder(tok, chat=True, eos=frozenset({2}), limit=limit(20, TRUNCATE_LEFT))  # room 14
    full = enc.raw(question)
    opening = ids(["<s>", "<bot>", "w0", "w1", "w2", "</s>", "<user>"])
    assert full[:7] == opening and enc.first_text(question, (), full) == (7, 27)
    first = enc.turn(question)
    assert first.ids == opening + full[-7:] and first.cut_tokens == len(full) - 14
    assert first.ids[-1] == ids("<bot>") and tok.convert_ids_to_tokens(first.ids[7]) == "w17"
    answer = ids(["hello", "world"]) + [2]
    second = enc.turn(question, [answer])
    # more than the first question's text to cut: the oldest exchange goes whole (cutting into it left the
    # answer's words under the first user header), and the rest is the template's own rendering
    alone = enc.raw(Prompt(prompt_id="q2", category="qa", turns=("say more",)))
    assert second.ids == alone and second.ids[:7] == opening and len(second.ids) <= 14
    assert second.cut_tokens == len(enc.raw(question, [answer])) - len(alone)
    assert "hello" not in tok.convert_ids_to_tokens(second.ids)
    # a third turn: only the oldest exchange goes, the second stays with its labels
    three = Prompt(prompt_id="t", category="qa", turns=(question.turns[0], "say more", "and again"))
    answers = [answer, ids(["world"]) + [2]]
    from harness.workloads.conversations import chat_ids

    wide = PromptEncoder(tok, chat=True, eos=frozenset({2}), limit=limit(26, TRUNCATE_LEFT))  # room 20
    third = wide.turn(three, answers)
    assert third.ids == chat_ids(tok, wide.messages(three, answers)[2:]) and len(third.ids) <= 20
    assert tok.convert_ids_to_tokens(third.ids).count("<user>") == 2
    # an opening that would take more than half the room: the first tokens go, as without a template
    tight = PromptEncoder(tok, chat=True, limit=limit(16, TRUNCATE_LEFT))  # room 10 < 2 x 7
    assert tight.turn(question).ids == full[-10:]
    # without a template (chat=false) the plain left cut
    plain = PromptEncoder(tok, chat=False, limit=limit(12, TRUNCATE_LEFT))
    single = Prompt(prompt_id="s", category="qa", text=question.turns[0])
    assert plain.first_text(single, (), plain.raw(single)) == (0, 0)
    assert plain.turn(single).ids == plain.raw(single)[-6:]


def test_a_system_message_stays_with_the_opening_and_the_user_text_is_what_is_cut():
    """A prompt whose messages open with a system message: emptying that one made its header alone
    the opening, and the user's words ended up inside the system block."""
    tok = word_chat_tokenizer()
    tok.chat_template = "<s> <bot> w0 w1 w2 </s> " + tok.chat_template
    words = " ".join(f"w{i}" for i in range(3, 23))
    prompt = Prompt(
        prompt_id="m",
        category="chat",
        messages=({"role": "system", "content": "w30 w31"}, {"role": "user", "content": words}),
    )
    enc = PromptEncoder(tok, chat=True, limit=limit(28, TRUNCATE_LEFT))  # room 22
    full = enc.raw(prompt)
    assert enc.first_text(prompt, (), full) == (11, 31)  # opening, system block and the user header
    turn = enc.turn(prompt)
    assert len(turn.ids) == 22 and turn.ids[:11] == full[:11] and turn.ids[11:] == full[21:]
    assert tok.convert_ids_to_tokens(turn.ids[7:12]) == ["w30", "w31", "</s>", "<user>", "w13"]


def test_a_text_prompt_gets_the_bos_the_tokenizer_adds_and_a_left_cut_keeps_it():
    """A completion prompt (``chat=false``: HumanEval, a JSONL ``prompt``) was tokenized with
    ``add_special_tokens=False``: a model that starts every sequence with a BOS (Llama, Mistral)
    never saw one, unlike ``generate`` after ``tokenizer(text)``. It gets the tokenizer's own special
    tokens now, and a left cut keeps the BOS as a template's opening is kept."""
    from tokenizers import processors

    from harness.workloads.conversations import encode_prompt

    tok = word_chat_tokenizer()
    text = Prompt(prompt_id="t", category="code", text=" ".join(f"w{i}" for i in range(12)))
    plain = encode_prompt(text, tok, chat=False)
    assert plain[0] != tok.bos_token_id and len(plain) == 12  # a tokenizer that adds nothing: as before
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    with_bos = encode_prompt(text, tok, chat=False)
    assert with_bos == [tok.bos_token_id, *plain]
    enc = PromptEncoder(tok, chat=False, limit=limit(12, TRUNCATE_LEFT))  # room 6
    cut = enc.turn(text)
    assert cut.ids == [tok.bos_token_id, *plain[-5:]] and cut.cut_tokens == 7


def test_an_artifact_trained_on_chats_is_keyed_by_the_chat_template_the_run_gave_its_tokenizer():
    """Heads, EAGLE drafts and the early-exit adapter train on ShareGPT chats put through the tokenizer's
    template; with workload.chat_template another format, but the same artifact folder and recipe: one
    trained on one format was taken for the other. The template the option gave is in the recipe now,
    as is a tokenizer's own (the layer-skip search's text: the option's only)."""
    from checkpoint_fixtures import byte_tokenizer

    from harness.heads.artifacts import heads_artifact_path, skip_artifact_path
    from harness.target.loading import build_tiny_model, chat_template_hash, chat_template_key
    from harness.workloads.conversations import set_chat_template

    model = build_tiny_model(vocab_size=259)
    own, vicuna = byte_tokenizer(), byte_tokenizer()
    own.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    set_chat_template(vicuna, "vicuna")
    assert chat_template_key(own) == {} and set(chat_template_key(vicuna)) == {"chat_template"}
    options = {"num_heads": 2}
    recipe_own, path_own = heads_artifact_path("medusa", options, model=model, tokenizer=own)
    recipe_vicuna, path_vicuna = heads_artifact_path("medusa", options, model=model, tokenizer=vicuna)
    assert recipe_vicuna["chat_template"] == chat_template_key(vicuna)["chat_template"]
    # the tokenizer's own template keys the heads' text too: a checkpoint revision that changes only its
    # template trains anew (the tokenizer's fingerprint leaves the template out)
    assert recipe_own["chat_template"] == chat_template_hash(own) != recipe_vicuna["chat_template"]
    assert path_own != path_vicuna
    assert (
        skip_artifact_path({}, model=model, tokenizer=own)[1]
        != skip_artifact_path({}, model=model, tokenizer=vicuna)[1]
    )
    # and the encoded training streams the artifacts train on: the new folder would otherwise train on the
    # other format's cached streams
    from harness.heads.recipes import DataRecipe
    from harness.prepare.heads_data import streams_key

    keys = {name: streams_key(tok, DataRecipe(), target_hash="t" * 16) for name, tok in (("own", own), ("v", vicuna))}
    assert keys["own"] != keys["v"]
    same = byte_tokenizer()
    same.chat_template = own.chat_template
    assert keys["own"] == streams_key(same, DataRecipe(), target_hash="t" * 16)  # the same template, the same streams
    from harness.heads.checkpoint import recipe_differences

    # shown as a derived field: workload.chat_template takes vicuna or a Jinja file, never the hash
    assert recipe_differences({}, {"chat_template": "ab"}) == [("(chat_template)", None, "ab")]
