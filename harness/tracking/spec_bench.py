"""Spec-Bench's answer format (Xia et al., 2024): `harness export spec-bench RUN_DIR OUT.jsonl`.

    harness export spec-bench RUN_DIR OUT.jsonl [baseline=BASE.jsonl] [model_id=NAME]

Writes one line per question for the speculative arm to ``OUT.jsonl`` and, separately, one line per
question for the autoregressive baseline (default ``<OUT stem>-baseline.jsonl`` beside it), in
the format Spec-Bench's inference scripts write and its ``evaluation/speed.py`` reads::

    {"question_id", "category", "answer_id", "model_id",
     "choices": [{"index": 0, "turns": [text per turn], "decoding_steps": [rounds per turn],
                  "new_tokens": [tokens per turn], "wall_time": [seconds per turn],
                  "accept_lengths": [tokens per round, every round of every turn, flat]}],
     "tstamp"}

What each field holds here:

* ``turns``: the answer text of each turn, special tokens removed and whitespace stripped, under
  ``workload.chat_template=vicuna`` cut at its first ``</s>`` as Spec-Bench's eval.py cuts it (the
  text fed back into the conversation; Spec-Bench recounts the baseline's tokens from it). A model
  without a tokenizer (``model=tiny``) writes every generated id as a decimal word.
* ``new_tokens``: tokens generated in the turn, EOS included where one was generated.
* ``decoding_steps``: target forwards (rounds) in the turn.
* ``wall_time``: the turn's prefill plus its decode, in seconds (Spec-Bench times the whole
  generate call, prefill included). At ``generation.batch_size`` > 1 it is the request's latency
  inside its batch.
* ``accept_lengths``: tokens committed per round, the bonus/correction token included (so 1 per
  round for the baseline), concatenated over turns.

Every turn's figures are checked before either file is written: tokens and rounds whole numbers
>= 0, prefill and decode times finite and >= 0 with a wall time above 0, tokens per round a list of
whole numbers; a turn that fails is refused naming its prompt, turn and key, and no file holds NaN.

Spec-Bench's speed statistic over these files (per task: mean over questions of
``sum(new_tokens) / sum(wall_time)``, over the same mean for the baseline, whose tokens it recounts
from ``turns`` with its tokenizer, minus one for a BOS) is recorded by every run as
``metrics.spec_bench_speedup`` from the same numbers, with the tokens the baseline generated; what
speed.py itself prints for the exported files, recounting as it does, is
``metrics.spec_bench_speed_py_speedup`` (the export notes when they differ). The record's own ``speedup`` is a ratio of
sums of end-to-end time and its ``decode_speedup`` a ratio of sums over decode time (prefill
excluded), different statistics. This module reads records and outputs only.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.files import atomic_write_texts, output_folder_problem, print_traceback_if_asked
from harness.tracking.command_line import boolean_option, run_folder_of, split_arguments, usage_status
from harness.tracking.run_notes import past_rounds_speedup_note, timing_outlier_note
from harness.tracking.store import (
    OUTPUTS_FILENAME,
    RecordError,
    gate_status,
    load_record,
    outputs_problem,
    record_gated,
)

#: Spec-Bench's categories: MT-bench's eight (merged into the task ``mt_bench`` by its evaluation)
#: and five single-turn tasks. harness/workloads/prompts.py holds the same names.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
#: the tasks of Spec-Bench's speed evaluation and leaderboard, in its column order
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
#: the leaderboard's column headings (Spec-Bench's Leaderboard.md)
TASK_TITLES = {
    "mt_bench": "Multi-turn Conversation",
    "translation": "Translation",
    "summarization": "Summarization",
    "qa": "Question Answering",
    "math_reasoning": "Mathematical Reasoning",
    "rag": "Retrieval-aug. Generation",
    "overall": "Overall",
}
OVERALL = "overall"
ARM_NAMES = {"spec": "speculative", "ar": "baseline"}


class ExportError(ValueError):
    pass


def task_of(category: str) -> str:
    """The Spec-Bench task (leaderboard column) of a category: the MT-bench eight are ``mt_bench``."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else str(category)


def task_order(tasks: Sequence[str]) -> list[str]:
    """Spec-Bench's tasks first in its column order, then any other category sorted."""
    present = set(tasks) - {OVERALL}
    return [t for t in TASKS if t in present] + sorted(present - set(TASKS))


def _question_id(output: dict, prompt_id: str) -> Any:
    qid = output.get("question_id")
    if qid is not None:
        return qid
    # a whole number written plainly ("81") as Spec-Bench's int ids; "007", "²" or "8_1" stay as written
    plain = prompt_id.isascii() and prompt_id.isdigit() and str(int(prompt_id)) == prompt_id
    return int(prompt_id) if plain else prompt_id


def _created_epoch(record: dict) -> float | None:
    try:
        return _dt.datetime.strptime(record["created_at"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def default_model_id(record: dict, arm: str) -> str:
    """``<experiment|sweep|adhoc>/<model>/<arm>-temperature-<T>[-batch-<B>]-<manifest hash, 8>``:
    Spec-Bench groups answers by model id, so two configurations never share one (the manifest
    hash tells apart what the axes do not: budgets, files, options). The speculative arm's id ends
    ``-heuristic`` for a run that is not exact and ``-ungated`` for one whose gates did not all pass:
    its answers are not vouched for as the target's (the baseline's are the target's own)."""
    ax = record["axes"]
    who = f"{ax['proposer']}-{ax['topology']}-{ax['verifier']}" if arm == "spec" else "ar-baseline"
    group = record.get("experiment") or record.get("sweep") or "adhoc"  # as the run folders are named
    batch = int(ax.get("batch_size") or 1)
    tail = (f"-batch-{batch}" if batch > 1 else "") + (
        f"-{str(record['manifest_hash'])[:8]}" if record.get("manifest_hash") else ""
    )
    if arm == "spec":
        tail += ("-heuristic" if record.get("exact") is False else "") + ("" if record_gated(record) else "-ungated")
    return f"{group}/{ax['model']}/{who}-temperature-{float(ax['temperature']):g}{tail}"


def read_outputs(run_dir: Path) -> list[dict]:
    path = run_dir / OUTPUTS_FILENAME
    if not path.is_file():
        raise ExportError(f"{path}: no such file (the run's outputs)")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ExportError(f"{path}:{n}: not valid JSON ({exc})") from None
    return rows


def check_destination(path: Path, *, overwrite: bool) -> None:
    """Refuse to write an answer file into a run folder (it would sit beside, or replace, the files
    a record binds) or over an existing file unless ``overwrite``."""
    run = run_folder_of(path.parent)
    if run is not None:
        raise ExportError(f"{path} is inside the run folder {run}: write the answers outside any run folder")
    if path.is_dir():
        raise ExportError(f"{path} is a folder; give a file path, e.g. {path / 'answers.jsonl'}")
    if path.exists() and not overwrite:
        raise ExportError(f"{path} already exists; give another path or overwrite=true")
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise ExportError(f"{path} cannot be written: {folder} is a file, not a folder")
    problem = output_folder_problem("folder", path.parent)
    if problem:  # a folder that cannot be written
        raise ExportError(f"{path} cannot be written ({problem})")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_time(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


def check_turn(pid: str, n: int, turn: Any, out: Any, arm: str) -> None:
    """Refuse turn ``n`` (from 1) of prompt ``pid`` unless the record's ``turn`` and the outputs' ``out``
    hold what its answer line is made of, for ``arm``: whole counts of tokens and rounds, finite
    times >= 0 with a wall time (prefill plus decode) above 0, tokens per round (one count per round,
    summing to the turn's tokens), the answer text."""
    where = f"prompt {pid!r}, turn {n}"
    if not isinstance(turn, dict) or not isinstance(out, dict):
        raise ExportError(f"{where}: a turn must be a JSON object in record.json and {OUTPUTS_FILENAME}")

    def got(key: str) -> str:
        return f"got {turn[key]!r}" if key in turn else "it is missing"

    for key in (f"{arm}_tokens", f"{arm}_rounds"):
        if not _is_count(turn.get(key)):
            raise ExportError(f"{where}: record.json's {key} must be a whole number >= 0; {got(key)}")
    for key in (f"{arm}_prefill_ms", f"{arm}_decode_ms"):
        if not _is_time(turn.get(key)):
            raise ExportError(f"{where}: record.json's {key} must be a finite number >= 0; {got(key)}")
    if not turn[f"{arm}_prefill_ms"] + turn[f"{arm}_decode_ms"] > 0:
        raise ExportError(
            f"{where}: {arm}_prefill_ms + {arm}_decode_ms is 0 in record.json; Spec-Bench divides tokens by that "
            "wall time"
        )
    key = f"{arm}_round_tokens"
    counts = out.get(key)
    if not isinstance(counts, list) or not all(_is_count(c) for c in counts):
        said = f"got {counts!r}" if key in out else "it is missing"
        raise ExportError(f"{where}: {OUTPUTS_FILENAME}'s {key} must be a list of whole numbers >= 0; {said}")
    if len(counts) != turn[f"{arm}_rounds"] or sum(counts) != turn[f"{arm}_tokens"]:
        raise ExportError(
            f"{where}: {OUTPUTS_FILENAME}'s {key} holds {len(counts)} rounds of {sum(counts)} tokens, record.json's "
            f"{arm}_rounds and {arm}_tokens say {turn[f'{arm}_rounds']} and {turn[f'{arm}_tokens']}; the two files "
            "are not of one run"
        )
    key = f"{arm}_answer"
    if not isinstance(out.get(key), str):
        said = f"got {out[key]!r}" if key in out else "it is missing"
        raise ExportError(f"{where}: {OUTPUTS_FILENAME}'s {key} must be the answer text; {said}")


def answer_lines(record: dict, outputs: Sequence[dict], arm: str, *, model_id: str | None = None) -> list[dict]:
    """One Spec-Bench answer line per question for ``arm`` (``spec`` or ``ar``); every turn is checked
    first (:func:`check_turn`), so a malformed one is refused naming its prompt, turn and key."""
    by_id = {str(o["prompt_id"]): o for o in outputs}
    tstamp = _created_epoch(record)
    name = model_id or default_model_id(record, arm)
    lines = []
    for row in record["per_prompt"]:
        pid = str(row["prompt_id"])
        out = by_id.get(pid)
        if out is None:
            raise ExportError(f"prompt {pid!r} is in record.json but not in {OUTPUTS_FILENAME}")
        turns, otr = row.get("turns"), out.get("turns")
        older = not turns or not otr
        if not older and (not isinstance(turns, list) or not isinstance(otr, list)):
            raise ExportError(f"prompt {pid!r}: turns must be a list in record.json and in {OUTPUTS_FILENAME}")
        if older or any(
            isinstance(t, dict) and key not in t
            for t, key in ((otr[0], f"{arm}_answer"), (turns[0], f"{arm}_prefill_ms"))
        ):
            raise ExportError(
                f"prompt {pid!r}: the run has no per-turn answers and timings (recorded by an older harness); re-run it"
            )
        if len(turns) != len(otr):
            raise ExportError(f"prompt {pid!r}: {len(turns)} turns in record.json, {len(otr)} in {OUTPUTS_FILENAME}")
        for n, (turn, out_turn) in enumerate(zip(turns, otr, strict=True), 1):
            check_turn(pid, n, turn, out_turn, arm)
        accept: list[int] = []
        for t in otr:
            accept.extend(int(n) for n in t[f"{arm}_round_tokens"])
        qid = _question_id(out, pid)
        lines.append(
            {
                "question_id": qid,
                "category": row["category"],
                "answer_id": f"{record['run_id']}/{ARM_NAMES[arm]}/{qid}",
                "model_id": name,
                "choices": [
                    {
                        "index": 0,
                        "turns": [t[f"{arm}_answer"] for t in otr],
                        "decoding_steps": [int(t[f"{arm}_rounds"]) for t in turns],
                        "new_tokens": [int(t[f"{arm}_tokens"]) for t in turns],
                        "wall_time": [(t[f"{arm}_prefill_ms"] + t[f"{arm}_decode_ms"]) / 1e3 for t in turns],
                        "accept_lengths": accept,
                    }
                ],
                "tstamp": tstamp,
            }
        )
    return lines


def _jsonl(lines: Sequence[dict]) -> str:
    """Answer lines as JSON Lines; a value that is no JSON number (NaN, an infinity) is refused."""
    try:
        return "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines)
    except ValueError as exc:
        raise ExportError(f"an answer line holds a value that is no JSON number ({exc})") from None


def baseline_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}-baseline{out.suffix or '.jsonl'}")


def export_spec_bench(
    run_dir: str | Path,
    out: str | Path,
    *,
    baseline: str | Path | None = None,
    model_id: str | None = None,
    overwrite: bool = False,
) -> dict:
    """Write both arms' answer files; returns what was written and the run's own figures.

    The run's ``outputs.jsonl`` must be the one its record binds; the answer files go outside
    every run folder and, unless ``overwrite``, to paths that do not exist yet."""
    for name, given in (("OUT", out), ("baseline", baseline)):
        # a path ending like a folder (Path() would drop the slash), ".", ".." or an existing folder:
        # no file name to write (nor to derive the baseline's from)
        if given is not None and (
            str(given).endswith(("/", "\\")) or Path(given).name in ("", ".", "..") or Path(given).is_dir()
        ):
            raise ExportError(f"{name}={given} names a folder; give a file path, e.g. {Path(given) / 'answers.jsonl'}")
    run_dir, out = Path(run_dir), Path(out)
    try:
        record = load_record(run_dir)
    except RecordError as exc:
        raise ExportError(str(exc)) from None
    folder = run_dir if run_dir.is_dir() else run_dir.parent
    problem = outputs_problem(record, folder)
    if problem is not None:
        raise ExportError(f"{folder}: {problem}; re-run it rather than export answers the record does not vouch for")
    outputs = read_outputs(folder)
    base = Path(baseline) if baseline else baseline_path(out)
    if base.resolve() == out.resolve():
        raise ExportError(f"the baseline file would overwrite {out}; give baseline=<another path>")
    for path in (out, base):
        check_destination(path, overwrite=overwrite)
    spec_lines = answer_lines(record, outputs, "spec", model_id=model_id)
    ar_lines = answer_lines(record, outputs, "ar", model_id=f"{model_id}-baseline" if model_id else None)
    # both files' text before either is written: strict JSON (no NaN or Infinity, which speed.py's
    # json.loads reads back as numbers that poison its means)
    texts = [(path, _jsonl(lines)) for path, lines in ((out, spec_lines), (base, ar_lines))]
    for path, _ in texts:
        path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_texts(texts)  # both or neither: a failed second write leaves no answers without their baseline
    m = record["metrics"]
    return {
        "speculative": str(out),
        "baseline": str(base),
        "questions": len(spec_lines),
        "turns": sum(len(x["choices"][0]["turns"]) for x in spec_lines),
        "run_spec_bench_speedup": m.get("spec_bench_speedup"),
        "speed_py_speedup": m.get("spec_bench_speed_py_speedup"),
        "run_speedup": m.get("speedup"),
        "run_mean_committed_per_round": m.get("mean_committed_per_round"),
        "notes": export_notes(record, outputs),
    }


#: the new tokens Spec-Bench's scripts generate a turn (their --max-new-token default)
SPEC_BENCH_MAX_NEW_TOKENS = 1024


def differing_turns_note(record: dict, outputs: Sequence[dict]) -> str:
    """The turns (question and turn) whose two answers differ in a run at temperature 0 that is not
    ``greedy_identical``, and what vouches for them: the greedy-equality gate's recorded near-ties."""
    by_id = {str(o["prompt_id"]): o for o in outputs}
    differ = []
    for row in record["per_prompt"]:
        out = by_id.get(str(row["prompt_id"])) or {}
        for n, t in enumerate(out.get("turns") or [], 1):
            if t.get("ar_token_ids") != t.get("spec_token_ids"):
                differ.append(f"question {_question_id(out, str(row['prompt_id']))} turn {n}")
    more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
    gate = (record.get("gates") or {}).get("greedy_equality")
    status = gate_status(gate) if isinstance(gate, dict) else "not recorded"
    if status == "passed":
        ties = len(gate.get("near_ties") or [])
        why = (
            f"each divergence is a recorded near-tie ({ties} in the record's gates.greedy_equality.near_ties: the "
            "target's top two logits within the dtype's tolerance), and a later turn carries each arm's own "
            "earlier answers"
        )
    else:
        why = f"the greedy-equality gate did not check them (gates.greedy_equality {status})"
    return (
        f"the speculative and baseline answers differ at temperature 0 in {len(differ)} "
        f"turn{'s' if len(differ) != 1 else ''}: {', '.join(differ[:5])}{more}; {why}, so Spec-Bench's "
        'evaluation/equal.py prints "Not Equal!" for these files'
    )


def answers_cut_note(outputs: Sequence[dict]) -> str | None:
    """How many answers of each arm were cut at the chat template's stop string (``{arm}_answer_cut``
    per turn in the outputs), or None where none was."""
    turns = [t for o in outputs for t in o.get("turns") or []]
    cut = {arm: sum(1 for t in turns if t.get(f"{arm}_answer_cut")) for arm in ARM_NAMES}
    if not any(cut.values()):
        return None
    return (
        f"{cut['spec']} speculative and {cut['ar']} baseline answer(s) of {len(turns)} turns were cut at their "
        "first \"</s>\" (workload.chat_template=vicuna: FastChat's stop string, where Spec-Bench's eval.py cuts "
        "them) before they were fed back and written here; their new_tokens and wall_time count the tokens "
        "generated past it, as Spec-Bench's do"
    )


def export_notes(record: dict, outputs: Sequence[dict]) -> list[str]:
    """What a reader of the exported files should know about the run behind them: a run whose gates
    did not all pass or that is not exact (compare and the dashboards keep it apart), prompts with
    none of Spec-Bench's categories, a batched run's times, another generation budget than Spec-Bench's,
    prompts cut to fit, answers cut at the stop string, prompts timed through a stall, a speedup
    with no proposed token accepted, answers that differ at temperature 0 (``outputs``: the run's
    rows) and Spec-Bench's speed.py reporting another figure than the run measured (it recounts the
    baseline's tokens from text)."""
    notes = []
    if not record_gated(record):
        kept = sorted(name for name, g in record.get("gates", {}).items() if gate_status(g) in ("skipped", "failed"))
        notes.append(
            f"the run is ungated (gates not passed: {', '.join(kept) or 'none recorded'}): its answers are not "
            "vouched for as the target's, and harness compare keeps it apart from gated runs"
        )
    if record.get("exact") is False:
        notes.append("the run is heuristic (exact: false): its speculative answers may differ from the target's")
    categories = sorted({str(p["category"]) for p in record["per_prompt"]})
    foreign = [c for c in categories if task_of(c) not in TASKS]
    if foreign and len(foreign) == len(categories):
        notes.append(
            f"none of the run's categories ({', '.join(categories)}) is one of Spec-Bench's: its speed.py finds "
            "rows for the overall figure only"
        )
    elif foreign:
        notes.append(
            f"categories {', '.join(foreign)} are not Spec-Bench's: its speed.py counts their rows in the overall "
            "figure only"
        )
    batch = int(record.get("axes", {}).get("batch_size") or 1)
    if batch > 1:
        notes.append(
            f"the run decoded {batch} requests a batch: each answer's wall_time is its request's latency inside its "
            "batch, its batch's whole prefill included, while Spec-Bench times one question at a time"
        )
    budget = ((record.get("config") or {}).get("generation") or {}).get("max_new_tokens")
    if isinstance(budget, int) and budget != SPEC_BENCH_MAX_NEW_TOKENS:
        notes.append(
            f"the run generated up to {budget} new tokens a turn where Spec-Bench generates up to "
            f"{SPEC_BENCH_MAX_NEW_TOKENS}: prefill weighs {'more' if budget < SPEC_BENCH_MAX_NEW_TOKENS else 'less'} "
            "in each wall_time, so the figures are not its leaderboard's (generation.max_new_tokens)"
        )
    cut = [
        str(p["prompt_id"]) for p in record["per_prompt"] if (p.get("cut_tokens") or p.get("ar_cut_tokens") or 0) > 0
    ]
    rule = ((record.get("metrics") or {}).get("context") or {}).get("rule")
    why = "workload.truncate=left" if rule != "refuse" else "earlier answers fed back as text tokenized longer"
    if cut:
        more = f" and {len(cut) - 5} more" if len(cut) > 5 else ""
        notes.append(
            f"{len(cut)} question(s) had their oldest text cut to fit the model's positions ({why}): "
            f"{', '.join(cut[:5])}{more}; their answers were generated from the cut prompt, where Spec-Bench feeds "
            "the whole one"
        )
    stopped = answers_cut_note(outputs)
    if stopped:
        notes.append(stopped)
    m = record["metrics"]
    if m.get("greedy_identical") is False:
        notes.append(differing_turns_note(record, outputs))
    if m.get("timing_outliers"):  # the run said so on its console; the files carry its times
        notes.append(timing_outlier_note(m["timing_outliers"]))
    unaccepted = past_rounds_speedup_note(m)
    if unaccepted:
        notes.append(unaccepted)
    ours, theirs = m.get("spec_bench_speedup"), m.get("spec_bench_speed_py_speedup")
    if ours and theirs and abs(theirs / ours - 1.0) > 0.005:
        counted = sum(t["ar_tokens"] for p in record["per_prompt"] for t in p.get("turns") or [])
        recounted = sum(t.get("ar_speed_py_tokens") or 0 for p in record["per_prompt"] for t in p.get("turns") or [])
        notes.append(
            f"Spec-Bench's speed.py will print a speedup of {theirs:.3f}x for these files, not the {ours:.3f}x the "
            f"run measured with the same statistic: it recounts the baseline's tokens from the answer text minus "
            f"one for a BOS, {recounted:,} where the baseline generated {counted:,} (the text does not tokenize back "
            "to the tokens generated, this tokenizer adds no BOS, or the EOS and special tokens are not in the "
            "text); metrics.spec_bench_speed_py_speedup in the record"
        )
    return notes


USAGE = (
    "usage: harness export spec-bench RUN_DIR OUT.jsonl [baseline=BASE.jsonl] [model_id=NAME] [overwrite=true]\n"
    "writes the speculative arm's answers to OUT.jsonl and the AR baseline's to BASE.jsonl "
    "(default <OUT stem>-baseline.jsonl), in Spec-Bench's answer format; existing files are kept "
    "unless overwrite=true, and nothing is written inside a run folder"
)
OPTIONS = ("baseline", "model_id", "overwrite")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    status = usage_status(USAGE, argv)
    if status is not None:
        return status
    kind = argv[0]
    if any(a in ("-h", "--help") for a in argv[1:]):  # harness export spec-bench --help
        return usage_status(USAGE, ["--help"]) or 0
    try:
        positionals, options = split_arguments(argv[1:])  # refuses an empty value
        if kind != "spec-bench":
            raise ExportError(f"unknown export format {kind!r}; one of ['spec-bench']")
        unknown = sorted(set(options) - set(OPTIONS))
        if len(positionals) != 2 or unknown:
            raise ExportError(
                f"expected RUN_DIR OUT.jsonl and only baseline=/model_id=/overwrite=; got {positionals} {unknown} "
                "(harness export --help)"
            )
        overwrite = boolean_option("overwrite", options.get("overwrite"))
        summary = export_spec_bench(
            positionals[0],
            positionals[1],
            baseline=options.get("baseline"),
            model_id=options.get("model_id"),
            overwrite=overwrite,
        )
    except (ExportError, ValueError) as exc:
        print_traceback_if_asked(exc)
        print(f"harness export: refused: {exc}", file=sys.stderr)
        return 2
    for note in summary["notes"]:
        print(f"harness export: note: {note}", file=sys.stderr)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
