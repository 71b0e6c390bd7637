"""Workloads: disjoint splits, JSONL validation naming the line, prompt encoding."""

import json

import pytest

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


def test_jsonl_missing_fields_and_duplicates(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "a"}\n')
    with pytest.raises(WorkloadError, match=r":1: each line needs"):
        load_jsonl(str(f), "eval")
    f.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(WorkloadError, match="duplicate"):
        load_jsonl(str(f), "eval")


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
