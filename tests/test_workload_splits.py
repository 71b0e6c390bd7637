"""The splits of a workload hold no prompt twice: ShareGPT's prompt texts are unique across its splits
(the evaluated set first, unchanged), a Sequoia run whose calibration split overlaps the evaluated one
is refused before any model work, and a category found only in another split names that split."""

import hashlib

import pytest
from helpers import write_jsonl

from harness.app import with_sequoia
from harness.config import compose
from harness.runner import check_job
from harness.workloads import prompts
from harness.workloads.corpora import SPLITS, ChatTurn, Conversation, prompt_key, sharegpt_split
from harness.workloads.prompts import WorkloadError, load_workload

TINY_SEQUOIA = [
    "model=tiny",
    "proposer=draft_model",
    "proposer.sampling=without_replacement",
    "verifier=sequoia",
    "generation.temperature=0.7",
    "threads=1",
]


def conv_id(split: str, n: int) -> str:
    """The ``n``-th id ``s<k>_0`` that the split hash puts in ``split``."""
    ids = (f"s{k}_0" for k in range(10_000) if sharegpt_split(f"s{k}_0") == split)
    return next(i for k, i in enumerate(ids) if k == n)


def test_a_sharegpt_text_held_by_several_splits_is_kept_in_the_first_of_eval_dev_calibration_train(monkeypatch):
    """ShareGPT repeats a question under other conversation ids, in other splits: the calibration, dev
    (layer-skip search) and train prompts held evaluated ones. Each text now stays in one split only."""
    texts = {
        "eval": ["hi", "eval only"],
        "dev": ["hi", "dev only", "eval only"],
        "calibration": ["dev only", "calibration only", "hi"],
        "train": ["calibration only", "train only", "eval only", "dev only"],
    }
    convs = {
        split: [
            Conversation(conv_id(split, n), (ChatTurn("user", t), ChatTurn("assistant", "ok")))
            for n, t in enumerate(ts)
        ]
        for split, ts in texts.items()
    }
    monkeypatch.setattr(prompts, "sharegpt_conversations", lambda split: convs[split])
    got = {s: [p.messages[0]["content"] for p in prompts.load_sharegpt(s)] for s in SPLITS}
    assert got == {
        "eval": ["hi", "eval only"],
        "dev": ["dev only"],
        "calibration": ["calibration only"],
        "train": ["train only"],
    }
    assert prompts.SHAREGPT_PROMPT_RULE.startswith("sharegpt-prompts-v4:")


def test_the_packaged_sharegpt_splits_share_no_prompt_text_and_the_eval_prompts_are_unchanged():
    """The packaged file: eval and calibration shared 3 texts, eval and train 44; the eval prompts are
    those of the rule before, less one text met twice but for case (494 then, 493: JwhRo1F_0's
    "Hello there" after a0yA6XR_0's "hello there"). Texts are compared by prompt_key."""
    by_split = {s: load_workload(name="sharegpt", split=s) for s in SPLITS}
    texts = {s: {prompt_key(p.messages[0]["content"]) for p in ps} for s, ps in by_split.items()}
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1 :]:
            assert not texts[a] & texts[b], (a, b)
    ev = by_split["eval"]
    assert len(ev) == len(texts["eval"]) == 493
    assert "JwhRo1F_0" not in {p.prompt_id for p in ev} and "a0yA6XR_0" in {p.prompt_id for p in ev}
    pin = hashlib.sha256("\n".join(f"{p.prompt_id}:{p.fingerprint}" for p in ev).encode()).hexdigest()[:16]
    assert pin == "71f0b3a63c3dbfca"


def test_sequoia_on_sharegpt_passes_the_check_before_model_work():
    """topology=sequoia with workload=sharegpt was refused after the models loaded: three calibration
    prompts had an eval prompt's text."""
    checked = check_job(compose(with_sequoia([*TINY_SEQUOIA, "workload=sharegpt"])), None)
    assert len(checked.prompts) == 493


def test_sequoia_on_a_question_file_without_splits_is_refused_before_any_model_work(tmp_path):
    """Without "split" fields every line is in every split: the calibration prompts are the evaluated
    ones, which the calibration stage refused only after the models had loaded."""
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a haiku about tea."]},
        {"question_id": 2, "category": "qa", "turns": ["What is the capital of France?"]},
    ]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    cfg = compose(with_sequoia([*TINY_SEQUOIA, "workload=spec_bench", f"workload.path={path}"]))
    with pytest.raises(WorkloadError) as err:
        check_job(cfg, None)
    assert str(err.value) == (
        f"topology=sequoia calibrates on split 'calibration' of workload.path={path} and evaluates split 'eval': "
        "calibration prompt '1' is also an evaluation prompt: the calibration split must be disjoint from the "
        'evaluated one (a jsonl workload needs a "split" field per line)'
    )
    # the same text under another id is refused as well
    rows[0]["split"], rows[1]["split"] = "eval", "eval"
    rows.append(
        {"question_id": 3, "category": "writing", "turns": ["Write a haiku about tea."], "split": "calibration"}
    )
    write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(WorkloadError, match=r"calibration prompt '3' is also an evaluation prompt"):
        check_job(cfg, None)
    rows[2]["turns"] = ["Write a limerick about coffee."]
    write_jsonl(tmp_path / "q.jsonl", rows)
    assert [p.prompt_id for p in check_job(cfg, None).prompts] == ["1", "2"]
    # another topology reads no calibration split
    assert check_job(compose(["model=tiny", "workload=spec_bench", f"workload.path={path}"]), None).prompts


def test_a_category_only_another_split_has_names_that_split(tmp_path):
    """It was refused as "not a category of <file>", as if the file had none."""
    path = write_jsonl(
        tmp_path / "w.jsonl",
        [
            {"id": "a", "prompt": "x", "category": "qa", "split": "eval"},
            {"id": "b", "prompt": "y", "category": "code", "split": "dev"},
            {"id": "c", "prompt": "z", "category": "code", "split": "train"},
        ],
    )
    with pytest.raises(WorkloadError) as err:
        load_workload(name="jsonl", split="eval", path=path, categories=["code"])
    assert str(err.value) == (
        f"workload.categories: {path} has no prompts of category 'code' in split 'eval' (workload.split=eval); "
        "splits 'dev' and 'train' have some"
    )
    assert err.value.suggestions == (("workload.split=dev",), ("workload.split=train",))
    with pytest.raises(WorkloadError, match=r"'chat' is not a category of .*w.jsonl; its categories: \['qa'\]"):
        load_workload(name="jsonl", split="eval", path=path, categories=["chat"])
