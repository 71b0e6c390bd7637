"""A reader of Spec-Bench answer files that reproduces its evaluation/speed.py (written here from
the published field names and the computation, not copied): the tests check our exporter against it.

Spec-Bench's ``speed(method_file, baseline_file, tokenizer, task)``:

* rows of a task: every row (``overall``), the rows whose ``category`` is one of MT-bench's eight
  (``mt_bench``), else the rows whose ``category`` equals the task;
* method file: per question ``sum(new_tokens) / sum(wall_time)`` of ``choices[0]``; the accept
  lengths of every question pooled (step-weighted mean);
* baseline file: per question the tokens recounted from ``choices[0].turns`` text
  (``len(tokenizer(text).input_ids) - 1`` per turn: one BOS removed) over ``sum(wall_time)``;
* tokens per second = the unweighted mean over questions; speedup = mean(method) / mean(baseline)
  (a ratio of means).

Its command line always runs a hard-coded multi-run average (``--mean-report`` defaults to True);
``get_single_speedup(method_file, baseline_file, tokenizer)`` is the per-file entry point.
"""

from __future__ import annotations

import json
from pathlib import Path

MT_BENCH_LIST = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
TASKS = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "overall"]


def rows_of(jsonl_file: str | Path, task: str) -> list[dict]:
    rows = [json.loads(line) for line in Path(jsonl_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if task == "overall":
        return rows
    if task == "mt_bench":
        return [r for r in rows if r["category"] in MT_BENCH_LIST]
    return [r for r in rows if r["category"] == task]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def speed(jsonl_file, jsonl_file_base, tokenizer, task: str):
    """(tokens per second, baseline tokens per second, speedup ratio, pooled accept lengths)."""
    speeds, accept_lengths = [], []
    for row in rows_of(jsonl_file, task):
        choice = row["choices"][0]
        speeds.append(sum(choice["new_tokens"]) / sum(choice["wall_time"]))
        accept_lengths.extend(choice["accept_lengths"])
    speeds_base = []
    for row in rows_of(jsonl_file_base, task):
        choice = row["choices"][0]
        tokens = sum(len(tokenizer(text).input_ids) - 1 for text in choice["turns"])
        speeds_base.append(tokens / sum(choice["wall_time"]))
    tps, tps_base = mean(speeds), mean(speeds_base)
    return tps, tps_base, tps / tps_base, accept_lengths


def get_single_speedup(jsonl_file, jsonl_file_base, tokenizer) -> dict:
    """Every task's figures: {task: (tps, baseline tps, speedup, mean accepted tokens)}; a task with no
    rows is left out (Spec-Bench prints nan for it)."""
    out = {}
    for task in TASKS:
        if not rows_of(jsonl_file, task):
            continue
        tps, tps_base, ratio, accepted = speed(jsonl_file, jsonl_file_base, tokenizer, task)
        out[task] = (tps, tps_base, ratio, mean(accepted))
    return out


class WordTokenizer:
    """A tokenizer that adds one BOS and splits on whitespace (ids are the words themselves)."""

    class Encoding:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text: str):
        return self.Encoding(["<s>"] + text.split())
