"""Workloads: disjoint splits, JSONL and Spec-Bench validation naming the line, category selection."""

import json

import pytest
from helpers import SB_CATEGORIES, SB_MT_BENCH, spec_bench_questions, write_jsonl

from harness.workloads.prompts import SPLITS, WorkloadError, load_jsonl, load_workload


def test_humaneval_splits_are_disjoint_and_cover_everything():
    seen = {}
    for split in SPLITS:
        for p in load_workload(name="humaneval", split=split):
            assert p.prompt_id not in seen, f"{p.prompt_id} in {seen.get(p.prompt_id)} and {split}"
            seen[p.prompt_id] = split
    assert len(seen) == 164


def test_limit_and_reference():
    prompts = load_workload(name="humaneval", split="eval", limit=3)
    assert len(prompts) == 3 and all(p.reference and p.category == "code" for p in prompts)


def test_jsonl_malformed_line_is_named(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n')
    with pytest.raises(WorkloadError, match=r"w.jsonl:2: malformed JSON"):
        load_jsonl(str(f), "eval")


def test_a_prompt_file_under_the_home_folder_is_read_by_its_tilde_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "w.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    assert [p.prompt_id for p in load_workload(name="jsonl", split="eval", path="~/w.jsonl")] == ["a"]


def test_the_manifest_binds_the_prompt_file_content(tmp_path):
    """A sweep skips a job whose manifest hash it has seen: editing the question file in place must
    change it, or a relaunch keeps the records of the old questions."""
    import hashlib

    from harness.config import compose
    from harness.manifest import job_manifest_hash, manifest_extras

    path = tmp_path / "question.jsonl"
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]}\n')
    cfg = compose(["model=tiny", "workload=spec_bench", f"workload.path={path}"])
    first, first_hash = manifest_extras(cfg)["workload_file"], job_manifest_hash(cfg)
    assert first == {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["What is the capital of Spain?"]}\n')
    assert manifest_extras(cfg)["workload_file"]["sha256"] != first["sha256"]
    assert job_manifest_hash(cfg) != first_hash
    jsonl = compose(["model=tiny", "workload=jsonl", f"workload.path={path}"])
    assert manifest_extras(jsonl)["workload_file"]["path"] == str(path)
    assert "workload_file" not in manifest_extras(compose(["model=tiny"]))  # a packaged workload: its version


def test_jsonl_missing_fields_and_duplicates(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "a"}\n')
    with pytest.raises(WorkloadError, match=r"w.jsonl:1: neither a Spec-Bench question .* nor a harness prompt"):
        load_jsonl(str(f), "eval")
    f.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(WorkloadError, match=r"w.jsonl:2: duplicate id 'a' \(first on line 1\)"):
        load_jsonl(str(f), "eval")
    # a null or empty category became the category "None" or one with no name (a column without a header)
    for category in (None, "", "  "):
        f.write_text(json.dumps({"id": "a", "prompt": "x", "category": category}) + "\n")
        with pytest.raises(WorkloadError, match=r'w.jsonl:1: "category" of id \'a\' must be a non-empty string'):
            load_jsonl(str(f), "eval")
    # a misspelt key was ignored: the line measured under category "default" in the eval split
    f.write_text('{"id": "a", "prompt": "x", "categroy": "qa", "splt": "dev"}\n')
    with pytest.raises(
        WorkloadError, match=r"w.jsonl:1: unknown key 'categroy' in a harness prompt \(did you mean 'ca"
    ):
        load_jsonl(str(f), "eval")
    f.write_text('{"id": "a", "prompt": "x", "weight": 2}\n')
    with pytest.raises(WorkloadError, match=r"unknown key 'weight' in a harness prompt; its keys are id, prompt, mes"):
        load_jsonl(str(f), "eval")
    f.write_text('{"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}\n')
    with pytest.raises(WorkloadError, match=r'w.jsonl:1: id \'a\' has both "prompt" and "messages"; give one of them'):
        load_jsonl(str(f), "eval")
    # a misspelt split dropped the line from every split, and the refusal named the split asked for
    f.write_text('{"id": "a", "prompt": "x", "split": "evaluation"}\n')
    with pytest.raises(WorkloadError, match=r"""w.jsonl:1: "split" of id 'a' must be one of \['calibration', """):
        load_jsonl(str(f), "eval")
    f.write_text('{"question_id": 1, "category": "qa", "turns": ["hi"], "split": "evaluation"}\n')
    with pytest.raises(WorkloadError, match=r"""w.jsonl:1: "split" of id 1 must be one of"""):
        load_jsonl(str(f), "eval")
    f.write_text('{"id": "a", "messages": [{"role": "user", "content": " "}]}\n')  # as an empty prompt is
    with pytest.raises(WorkloadError, match=r'"messages" of id \'a\' are all empty: there is nothing to answer'):
        load_jsonl(str(f), "eval")
    # a role no chat template reads was rendered as it was spelt, under the template's default system prompt
    f.write_text('{"id": "a", "messages": [{"role": "wizard", "content": "hi"}]}\n')
    with pytest.raises(
        WorkloadError,
        match=r"""w.jsonl:1: "messages" of id 'a' has role 'wizard'; a chat template reads system, user, """
        r"assistant, tool",
    ):
        load_jsonl(str(f), "eval")
    # a list that ends with the assistant's (or only a system) message was answered as if nothing was asked
    for last in ("assistant", "system"):
        f.write_text(
            json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": last, "content": "x"}]})
        )
        with pytest.raises(
            WorkloadError,
            match=rf"""w.jsonl:1: "messages" of id 'a' end with a {last} message; the chat is rendered with the """
            r"template's generation prompt.*end the list with a message from user or tool",
        ):
            load_jsonl(str(f), "eval")
    f.write_text(
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4"}]})
    )
    assert [p.messages[-1]["role"] for p in load_jsonl(str(f), "eval")] == ["tool"]


@pytest.mark.parametrize("last", ["user", "tool"])
def test_a_messages_list_whose_last_message_is_empty_is_refused(tmp_path, last):
    """Only a list of empty messages was refused: a system message, or an earlier exchange, before an
    empty last one let the model answer nothing, as if asked nothing."""
    f = tmp_path / "w.jsonl"
    for earlier in (
        [{"role": "system", "content": "Be nice"}],
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}],
    ):
        f.write_text(json.dumps({"id": "a", "messages": [*earlier, {"role": last, "content": " \n "}]}) + "\n")
        with pytest.raises(WorkloadError) as err:
            load_jsonl(str(f), "eval")
        assert str(err.value) == (
            f"""{f}:1: "messages" of id 'a': the last {last} message is empty: there is nothing to answer"""
        )
    f.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": ""}, {"role": last, "content": "x"}]}))
    assert [len(p.messages) for p in load_jsonl(str(f), "eval")] == [2]  # an empty earlier one is read


def test_jsonl_messages_and_split_field(tmp_path):
    f = tmp_path / "w.jsonl"
    rows = [
        {"id": "1", "messages": [{"role": "user", "content": "hi"}], "category": "chat", "split": "dev"},
        {"id": "2", "prompt": "def f():", "category": "code"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dev = load_workload(name="jsonl", split="dev", path=str(f))
    assert [p.prompt_id for p in dev] == ["1", "2"]
    assert [p.prompt_id for p in load_workload(name="jsonl", split="eval", path=str(f))] == ["2"]
    with pytest.raises(WorkloadError, match="split"):
        load_workload(name="jsonl", split="test", path=str(f))


def test_prompt_lines_through_the_chat_template_are_said_once(tmp_path):
    """A "prompt" line went to the model as a user message (workload.chat is true by default) without a
    word: code meant to be continued was answered as a request."""
    from harness.config import compose
    from harness.runner import templated_text_note

    f = tmp_path / "w.jsonl"
    rows = [{"id": "1", "messages": [{"role": "user", "content": "hi"}]}, {"id": "2", "prompt": "def f():"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_workload(name="jsonl", split="eval", path=str(f))
    cfg = compose(["model=smollm2", "workload=jsonl", f"workload.path={f}"])
    assert templated_text_note(cfg, prompts) == (
        f'1 "prompt" line(s) of {f} go to the model as a user message through its chat template '
        "(workload.chat=true); workload.chat=false gives their text as it is, to be continued"
    )
    assert (
        templated_text_note(
            compose(["model=smollm2", "workload=jsonl", f"workload.path={f}", "workload.chat=false"]), prompts
        )
        is None
    )
    assert templated_text_note(cfg, prompts[:1]) is None  # messages only: the template is what they ask for
    assert templated_text_note(compose(["model=tiny", "workload=jsonl", f"workload.path={f}"]), prompts) is None


def test_a_proposer_trained_on_text_formatted_otherwise_than_the_prompts_is_said():
    """Heads trained on chat-formatted ShareGPT and measured on raw HumanEval prompts (the defaults of
    proposer=medusa with workload=humaneval) measure the transfer as much as the heads: said once;
    nothing is said where the formats agree, where an artifact is given, or for a tiny model."""
    from harness.config import compose
    from harness.runner import training_text_note

    raw = compose(["model=smollm2", "workload=humaneval", "proposer=medusa"])
    assert training_text_note(raw) == (
        "proposer=medusa trains on sharegpt text through the chat template (proposer.data.chat=true) and "
        "measures prompts as plain text (workload.chat=false); proposer.data.chat=false trains on text "
        "formatted as the prompts"
    )
    for kind in ("hydra", "clover", "eagle", "early_exit"):
        assert f"proposer={kind} trains" in training_text_note(
            compose(["model=smollm2", "workload=humaneval", f"proposer={kind}"])
        )
    assert training_text_note(compose(["model=smollm2", "workload=sharegpt", "proposer=medusa"])) is None
    assert (
        training_text_note(
            compose(["model=smollm2", "workload=humaneval", "proposer=medusa", "proposer.data.chat=false"])
        )
        is None
    )
    assert (
        training_text_note(compose(["model=smollm2", "workload=humaneval", "proposer=medusa", "proposer.artifact=/x"]))
        is None
    )
    assert training_text_note(compose(["model=tiny", "workload=humaneval", "proposer=medusa"])) is None
    assert training_text_note(compose(["model=smollm2", "workload=humaneval", "proposer=prompt_lookup"])) is None

    skip = training_text_note(compose(["model=smollm2", "workload=humaneval", "proposer=layer_skip"]))
    assert skip.startswith("proposer=layer_skip searches its skip vector on sharegpt prompts through the chat template")
    assert skip.endswith(
        "proposer.search.workload=humaneval proposer.search.chat=false searches on the measured kind of prompt"
    )
    assert training_text_note(compose(["model=smollm2", "workload=sharegpt", "proposer=layer_skip"])) is None
    assert (
        training_text_note(compose(["model=smollm2", "workload=humaneval", "proposer=layer_skip", "proposer.skip=[1]"]))
        is None
    )


# ------------------------------------------------------------------------------ Spec-Bench questions


def test_spec_bench_file_reads_every_category_with_its_turns(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", spec_bench_questions(3))
    prompts = load_workload(name="spec_bench", split="eval", path=path)
    assert [p.category for p in prompts[::3]] == list(SB_CATEGORIES)
    assert len(prompts) == 39
    for p in prompts:
        assert p.n_turns == (2 if p.category in SB_MT_BENCH else 1) and p.turns[0].startswith(p.category)
        assert p.prompt_id == str(p.source_id) and isinstance(p.source_id, int)
    by_cat = {p.category: p for p in reversed(prompts)}  # the first of each category
    assert by_cat["rag"].reference == "answer 0\nanother answer 0"  # [[str, ...]] flattened
    assert by_cat["math"].reference == "first turn reference"  # empty elements dropped
    assert by_cat["writing"].reference is None and by_cat["qa"].reference is None
    # workload=jsonl reads the same file (a Spec-Bench question file is one of its two formats)
    assert load_workload(name="jsonl", split="eval", path=path) == prompts


def test_categories_select_and_mt_bench_names_the_eight(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", spec_bench_questions(3))
    two = load_workload(name="spec_bench", split="eval", path=path, categories=["summarization", "qa"])
    assert [p.category for p in two] == ["summarization"] * 3 + ["qa"] * 3
    mt = load_workload(name="spec_bench", split="eval", path=path, categories=["mt_bench", "rag"])
    assert {p.category for p in mt} == {*SB_MT_BENCH, "rag"} and len(mt) == 27
    per = load_workload(name="spec_bench", split="eval", path=path, per_category=1, limit=5)
    assert [p.category for p in per] == ["writing", "translation", "summarization", "qa", "math_reasoning"]
    with pytest.raises(WorkloadError, match=r"workload.categories: 'sumarization' is not a category of .*question"):
        load_workload(name="spec_bench", split="eval", path=path, categories=["sumarization"])
    with pytest.raises(WorkloadError, match="per_category must be >= 1"):
        load_workload(name="spec_bench", split="eval", path=path, per_category=0)
    # categories work on every workload: HumanEval is all "code"
    assert len(load_workload(name="humaneval", split="eval", categories=["code"], limit=2)) == 2


def test_per_category_counts_spec_bench_tasks_so_mt_bench_weighs_as_one(tmp_path):
    """MT-bench's eight categories are one Spec-Bench task (80 questions, as each other task):
    per_category=N took N of each of the eight, so MT-bench outweighed every other task eight to one."""
    path = write_jsonl(tmp_path / "question.jsonl", spec_bench_questions(3))
    per = load_workload(name="spec_bench", split="eval", path=path, per_category=3)
    mt = [p.category for p in per if p.category in SB_MT_BENCH]
    assert mt == ["writing", "roleplay", "reasoning"]  # one of each category in turn, in file order
    assert len(per) == 3 + 5 * 3
    ten = load_workload(name="spec_bench", split="eval", path=path, per_category=10)
    assert sum(p.category in SB_MT_BENCH for p in ten) == 10 and len(ten) == 10 + 5 * 3
    taken = [p.category for p in ten if p.category in SB_MT_BENCH]  # kept in file order
    assert {c: taken.count(c) for c in SB_MT_BENCH} == {
        c: 2 if c in ("writing", "roleplay") else 1 for c in SB_MT_BENCH
    }
    # MT-bench categories named themselves count on their own: none named is left out for another
    named = load_workload(
        name="spec_bench", split="eval", path=path, categories=["writing", "roleplay", "stem"], per_category=2
    )
    assert [p.category for p in named] == ["writing"] * 2 + ["roleplay"] * 2 + ["stem"] * 2
    mixed = load_workload(name="spec_bench", split="eval", path=path, categories=["mt_bench", "stem"], per_category=3)
    assert sum(p.category == "stem" for p in mixed) == 3 and sum(p.category != "stem" for p in mixed) == 3
    # workload=jsonl counts each category (a file of the user's own categories)
    assert (
        sum(p.category in SB_MT_BENCH for p in load_workload(name="jsonl", split="eval", path=path, per_category=3))
        == 24
    )


@pytest.mark.parametrize(
    "category, said",
    [
        ("poetry", r"question 1 has category 'poetry', not one of Spec-Bench's \[.*\] \(workload=jsonl reads"),
        ("math-reasoning", r"has category 'math-reasoning', not one of .*; did you mean 'math_reasoning'\?"),
        ("QA", r"has category 'QA', not one of .*; did you mean 'qa'\?"),
        ("mt_bench", r"mt_bench names the group of MT-bench's eight; a question has one of them"),
    ],
)
def test_spec_bench_refuses_a_category_outside_its_thirteen(tmp_path, category, said):
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({"question_id": 1, "category": category, "turns": ["a"]}) + "\n")
    with pytest.raises(WorkloadError, match=said):
        load_workload(name="spec_bench", split="eval", path=str(f))
    assert len(load_workload(name="jsonl", split="eval", path=str(f))) == 1  # its own categories


def test_a_byte_order_mark_is_read_and_a_folder_or_a_bad_split_is_named(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps({"question_id": 1, "category": "qa", "turns": ["a"]}).encode() + b"\n")
    assert [p.prompt_id for p in load_workload(name="spec_bench", split="eval", path=str(f))] == ["1"]
    (tmp_path / "adir.jsonl").mkdir()
    with pytest.raises(WorkloadError, match=r"workload.path='.*adir.jsonl' is a folder; give a .jsonl file"):
        load_workload(name="spec_bench", split="eval", path=str(tmp_path / "adir.jsonl"))
    f.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["a"], "split": 5}) + "\n")
    with pytest.raises(WorkloadError, match=r':1: "split" must be a string; got 5'):
        load_workload(name="spec_bench", split="eval", path=str(f))
    f.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": None}) + "\n")
    with pytest.raises(WorkloadError, match=r'"turns" must be a list of user messages; got null$'):
        load_workload(name="spec_bench", split="eval", path=str(f))


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"question_id": 1, "category": "qa", "turns": ["a"]}', '{"foo": 1}'], r":2: neither a Spec-Bench"),
        (['{"question_id": 1, "category": "qa", "turns": []}'], r":1: question 1 has empty \"turns\""),
        (['{"question_id": 1, "category": "qa", "turns": ["a", "  "]}'], r":1: turn 2 of question 1 is empty"),
        (
            ['{"question_id": 1, "category": "qa", "turns": "a"}'],
            r":1: question 1: \"turns\" must be a list of user messages",
        ),
        (['{"question_id": 1, "turns": ["a"]}'], r":1: question 1 needs a non-empty \"category\""),
        (['{"question_id": true, "category": "qa", "turns": ["a"]}'], r":1: \"question_id\" must be"),
        (
            [
                '{"question_id": 7, "category": "qa", "turns": ["a"]}',
                "",
                '{"question_id": 7, "category": "rag", "turns": ["b"]}',
            ],
            r":3: duplicate question_id 7 \(first on line 1\)",
        ),
        (
            ['{"question_id": 1, "category": "qa", "turns": ["a"]}', '{"id": "x", "prompt": "y"}'],
            r":2: workload=spec_bench reads Spec-Bench questions; this line is a harness prompt",
        ),
        (["[1, 2]"], r":1: neither a Spec-Bench question"),
    ],
)
def test_bad_spec_bench_lines_are_refused_naming_the_line(tmp_path, lines, message):
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(WorkloadError, match=message) as err:
        load_workload(name="spec_bench", split="eval", path=str(f))
    assert "\n" not in str(err.value)  # one line


def test_jsonl_refuses_a_file_mixing_the_two_formats(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "x", "prompt": "y"}\n{"question_id": 1, "category": "qa", "turns": ["a"]}\n')
    with pytest.raises(WorkloadError, match=r"w.jsonl:2: a Spec-Bench question .*, but line 1 is a harness prompt"):
        load_workload(name="jsonl", split="eval", path=str(f))


def test_spec_bench_workload_refuses_a_harness_prompt_file(tmp_path):
    f = write_jsonl(tmp_path / "w.jsonl", [{"id": "a", "prompt": "x"}])
    with pytest.raises(WorkloadError, match=r"w.jsonl:1: workload=spec_bench reads Spec-Bench questions"):
        load_workload(name="spec_bench", split="eval", path=f)
    with pytest.raises(WorkloadError, match="workload=spec_bench needs workload.path"):
        load_workload(name="spec_bench", split="eval")


@pytest.mark.parametrize("category", ["all", "Overall"])
def test_a_category_named_like_the_reports_aggregate_is_refused(tmp_path, category):
    """compare's aggregate row is "all" and the leaderboard's aggregate column "overall": a
    category of either name would be merged into (or hidden by) the aggregate."""
    from harness.tracking.compare import ALL
    from harness.tracking.spec_bench import OVERALL
    from harness.workloads.prompts import RESERVED_CATEGORIES

    assert set(RESERVED_CATEGORIES) == {ALL, OVERALL}
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt": "x", "category": category}) + "\n")
    with pytest.raises(WorkloadError, match=rf"w.jsonl:1: prompt 'a' has category '{category}', the name of the"):
        load_jsonl(str(f), "eval")
    f.write_text(json.dumps({"question_id": 7, "category": category, "turns": ["x"]}) + "\n")
    with pytest.raises(WorkloadError, match=r"are reserved\): rename it"):
        load_jsonl(str(f), "eval")


def test_categories_spelt_two_ways_are_refused_naming_their_lines(tmp_path):
    """ "qa", "qa " and "QA" were three categories: workload.categories=[qa] dropped the other two
    prompts without a word."""
    rows = [
        {"id": "q1", "prompt": "What is 2+2?", "category": "qa"},
        {"id": "q2", "prompt": "Capital of France?", "category": "qa "},
        {"id": "q3", "prompt": "Name a color", "category": "QA"},
    ]
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    with pytest.raises(WorkloadError) as err:
        load_workload(name="jsonl", split="eval", path=path, categories=["qa"])
    assert str(err.value) == (
        f"{path}:2: prompt 'q2' has category 'qa ', with whitespace around it: a category is matched as written; "
        "write 'qa'"
    )
    rows[1]["category"] = "qa"
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    with pytest.raises(WorkloadError) as err:
        load_workload(name="jsonl", split="eval", path=path, categories=["qa"])
    assert str(err.value) == (
        f"{path}:3: category 'QA' of id 'q3' and category 'qa' on line 1 differ only in case: a category is "
        "matched as written, so they would be two; spell them alike or rename one"
    )
    # in another split, and in a Spec-Bench-shaped file read as jsonl, alike
    rows[2].update(category="Qa", split="dev")
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    with pytest.raises(WorkloadError, match=r"w.jsonl:3: category 'Qa' of id 'q3' and category 'qa' on line 1"):
        load_workload(name="jsonl", split="eval", path=path)
    questions = [
        {"question_id": 1, "category": "Writing", "turns": ["a"]},
        {"question_id": 2, "category": "writing", "turns": ["b"]},
    ]
    with pytest.raises(WorkloadError, match=r"q.jsonl:2: category 'writing' of question_id 2 and category 'Writing'"):
        load_workload(name="jsonl", split="eval", path=write_jsonl(tmp_path / "q.jsonl", questions))
    questions[0]["category"] = " writing"
    for workload in ("jsonl", "spec_bench"):
        with pytest.raises(WorkloadError, match=r"q.jsonl:1: prompt 1 has category ' writing', with whitespace around"):
            load_workload(name=workload, split="eval", path=write_jsonl(tmp_path / "q.jsonl", questions))
    # one spelling is read as written
    rows[2]["category"] = "qa"
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    assert [p.prompt_id for p in load_workload(name="jsonl", split="eval", path=path, categories=["qa"])] == [
        "q1",
        "q2",
    ]


@pytest.mark.parametrize(
    ("rows", "said"),
    [
        ([{"id": "q1", "prompt": "a"}, {"id": "q1 ", "prompt": "b"}], "w.jsonl:2: \"id\" 'q1 ' has whitespace"),
        ([{"id": "\tq1", "prompt": "a"}], "w.jsonl:1: \"id\" '\\\\tq1' has whitespace around it"),
        ([{"question_id": " 7", "category": "qa", "turns": ["a"]}], "w.jsonl:1: \"question_id\" ' 7' has whitespace"),
    ],
)
def test_an_id_with_whitespace_around_it_is_refused(tmp_path, rows, said):
    """ "q1" and "q1 " were two prompts, shown alike in every record and report."""
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    with pytest.raises(WorkloadError, match=said):
        load_jsonl(path, "eval")


def test_a_compiled_forward_over_packed_weights_is_said_once_per_model():
    """streaming_panels named beside model.compile=true breaks the compiled graph at every linear
    layer (74 breaks on the tiny model, the compiles falling into timed rounds) with no word."""
    from harness.config import compose
    from harness.runner import compiled_panels_notes

    both = compiled_panels_notes(
        compose(
            [
                "model=tiny",
                "model.compile=true",
                "model.linear_kernel=streaming_panels",
                "proposer=draft_model",
                "proposer.model.compile=true",
                "proposer.model.linear_kernel=streaming_panels",
            ]
        )
    )
    assert [n.split(":")[0] for n in both] == [
        "model.linear_kernel=streaming_panels with model.compile=true",
        "proposer.model.linear_kernel=streaming_panels with proposer.model.compile=true",
    ]
    assert "a graph break at every linear layer" in both[0]
    assert compiled_panels_notes(compose(["model=tiny", "model.compile=true"])) == []  # auto: streaming
    assert compiled_panels_notes(compose(["model=tiny", "model.linear_kernel=streaming_panels"])) == []


def test_a_derived_draft_of_the_whole_target_is_said_once():
    """On the tiny target the derived draft's default is both of its layers: the draft was the target
    itself (6 tokens a round) with no word."""
    from harness.config import compose
    from harness.runner import whole_target_draft_note

    assert whole_target_draft_note(compose(["model=tiny", "proposer=draft_model"])) == (
        "proposer.model.num_layers=2: the derived draft is the whole 2-layer target, proposing the target's own "
        "tokens at the target's cost (a check of the machinery, not a draft's speedup)"
    )
    assert (
        whole_target_draft_note(compose(["model=tiny", "proposer=draft_model", "proposer.model.num_layers=1"])) is None
    )
    assert whole_target_draft_note(compose(["model=tiny", "proposer=prompt_lookup"])) is None
