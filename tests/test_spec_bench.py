"""Spec-Bench answers: our reader reproduces Spec-Bench's speed computation on a hand-made fixture,
and on an exported tiny run it agrees with the run's own recorded Spec-Bench statistic and mean
accepted tokens; the export keeps Spec-Bench's field names and shapes."""

import json
import shutil
from pathlib import Path

import pytest
from helpers import fixture_run, spec_bench_questions, write_jsonl
from specbench_reader import WordTokenizer, get_single_speedup, speed

from harness.cli import main as cli_main
from harness.config import compose
from harness.runner import run_job
from harness.tracking.spec_bench import ExportError, export_spec_bench, task_of, task_order
from harness.tracking.store import load_record

CATS = ("writing", "math", "qa", "summarization", "rag")


def choice(new_tokens, wall_time, accept_lengths=None, turns=None):
    c = {"index": 0, "new_tokens": new_tokens, "wall_time": wall_time}
    if accept_lengths is not None:
        c["accept_lengths"] = accept_lengths
    if turns is not None:
        c["turns"] = turns
    return c


def test_reader_reproduces_spec_bench_on_a_hand_made_fixture(tmp_path):
    """Three questions whose figures Spec-Bench's own speed() gives as listed (ratio of means,
    step-weighted accepted tokens, baseline tokens recounted from text minus one BOS)."""
    words = lambda n: " ".join(["w"] * n)  # noqa: E731
    method = write_jsonl(
        tmp_path / "method.jsonl",
        [
            {"question_id": 321, "category": "qa", "choices": [choice([10], [0.5], [3, 3, 4])]},
            {"question_id": 322, "category": "qa", "choices": [choice([20], [0.5], [5, 5, 5, 5])]},
            {"question_id": 81, "category": "writing", "choices": [choice([6, 4], [0.25, 0.25], [2] * 5)]},
        ],
    )
    base = write_jsonl(
        tmp_path / "base.jsonl",
        [
            {"question_id": 321, "category": "qa", "choices": [choice([0], [1.0], turns=[words(10)])]},
            {"question_id": 322, "category": "qa", "choices": [choice([0], [2.0], turns=[words(20)])]},
            {
                "question_id": 81,
                "category": "writing",
                "choices": [choice([0, 0], [1.0, 1.0], turns=[words(6), words(4)])],
            },
        ],
    )
    got = get_single_speedup(method, base, WordTokenizer())
    assert set(got) == {"qa", "mt_bench", "overall"}
    assert got["qa"] == pytest.approx((30.0, 10.0, 3.0, 30 / 7))
    assert got["mt_bench"] == pytest.approx((20.0, 5.0, 4.0, 2.0))
    assert got["overall"] == pytest.approx((80 / 3, 25 / 3, 3.2, 40 / 12))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_bench")
    import os

    old = os.environ.get("HARNESS_CACHE")
    os.environ["HARNESS_CACHE"] = str(root / "cache")
    try:
        path = write_jsonl(root / "question.jsonl", spec_bench_questions(2, categories=CATS))
        cfg = compose(
            [
                "model=tiny",
                "workload=spec_bench",
                f"workload.path={path}",
                "generation.max_new_tokens=12",
                "generation.warmup_tokens=2",
                "gates.oracle=false",
                "threads=1",
            ]
        )
        record = run_job(cfg, run_dir=root / "run")
    finally:
        if old is None:
            os.environ.pop("HARNESS_CACHE", None)
        else:
            os.environ["HARNESS_CACHE"] = old
    summary = export_spec_bench(root / "run", root / "answers" / "harness.jsonl")
    return record, summary, root


def lines(path):
    return [json.loads(x) for x in open(path).read().splitlines()]


def test_export_writes_spec_bench_fields_per_question(exported):
    record, summary, root = exported
    assert summary["baseline"].endswith("answers/harness-baseline.jsonl") and summary["questions"] == 10
    spec, base = lines(summary["speculative"]), lines(summary["baseline"])
    keys = ["question_id", "category", "answer_id", "model_id", "choices", "tstamp"]
    for arm, rows in (("spec", spec), ("ar", base)):
        assert len(rows) == len(record["per_prompt"])
        for row, pp in zip(rows, record["per_prompt"], strict=True):
            assert (
                list(row) == keys and isinstance(row["question_id"], int) and str(row["question_id"]) == pp["prompt_id"]
            )
            assert row["category"] == pp["category"] and isinstance(row["tstamp"], float)
            (c,) = row["choices"]  # one choice
            assert list(c) == ["index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"]
            n = len(pp["turns"])
            assert len(c["turns"]) == len(c["new_tokens"]) == len(c["wall_time"]) == len(c["decoding_steps"]) == n
            assert n == (2 if pp["category"] in ("writing", "math") else 1)
            assert sum(c["new_tokens"]) == pp[f"{arm}_tokens"]
            assert c["decoding_steps"] == [t[f"{arm}_rounds"] for t in pp["turns"]]
            assert len(c["accept_lengths"]) == sum(c["decoding_steps"])  # flat: every round of every turn
            assert sum(c["accept_lengths"]) == sum(c["new_tokens"])  # bonus token counted in each round
            walls = [(t[f"{arm}_prefill_ms"] + t[f"{arm}_decode_ms"]) / 1e3 for t in pp["turns"]]
            assert c["wall_time"] == pytest.approx(walls, rel=1e-12)
            # model=tiny has no tokenizer: every generated id as a decimal word
            assert [len(t.split()) for t in c["turns"]] == c["new_tokens"]
    assert all(set(r["choices"][0]["accept_lengths"]) == {1} for r in base)  # AR: one token per round
    assert spec[0]["model_id"].endswith(
        f"prompt_lookup-sequence-greedy-temperature-0-{record['manifest_hash'][:8]}-ungated"  # gates.oracle=false
    )
    assert base[0]["model_id"].endswith(f"ar-baseline-temperature-0-{record['manifest_hash'][:8]}")


def test_spec_bench_speed_on_our_export_agrees_with_the_recorded_figures(exported):
    record, summary, _ = exported
    got = get_single_speedup(summary["speculative"], summary["baseline"], WordTokenizer())
    m = record["metrics"]
    assert set(got) == {"mt_bench", "summarization", "qa", "rag", "overall"}
    tps, tps_base, ratio, accepted = got["overall"]
    assert ratio == pytest.approx(m["spec_bench_speedup"], rel=1e-9)
    assert accepted == pytest.approx(m["mean_committed_per_round"], rel=1e-12)
    assert summary["run_spec_bench_speedup"] == m["spec_bench_speedup"]
    # per task, the same statistic from the record's per-prompt rows
    for task in ("mt_bench", "qa", "rag", "summarization"):
        rows = [p for p in record["per_prompt"] if task_of(p["category"]) == task]
        rate = {
            arm: sum(p[f"{arm}_tokens"] / ((p[f"{arm}_prefill_ms"] + p[f"{arm}_decode_ms"]) / 1e3) for p in rows)
            / len(rows)
            for arm in ("spec", "ar")
        }
        assert got[task][0] == pytest.approx(rate["spec"], rel=1e-9)
        assert got[task][1] == pytest.approx(rate["ar"], rel=1e-9)
        assert speed(summary["speculative"], summary["baseline"], WordTokenizer(), task)[2] == pytest.approx(
            rate["spec"] / rate["ar"], rel=1e-9
        )


class NoBosWordTokenizer(WordTokenizer):
    """Splits on whitespace and adds no BOS (as SmolLM2's tokenizer): speed.py's minus one then drops a word."""

    def __call__(self, text: str):
        return self.Encoding(text.split())


def test_the_figure_spec_bench_s_speed_py_prints_is_recorded_and_the_export_says_when_it_differs(
    exported, tmp_path, capsys
):
    """speed.py recounts the baseline's tokens from its text minus one: with a tokenizer that adds a
    BOS it agrees with the run's statistic; with one that adds none it prints another figure, which
    the record holds (metrics.spec_bench_speed_py_speedup) and the export names."""
    from harness.runner import speed_py_speedup, speed_py_tokens

    record, summary, root = exported
    assert record["metrics"]["spec_bench_speed_py_speedup"] is None  # the tiny model has no tokenizer
    for tokenizer in (WordTokenizer(), NoBosWordTokenizer()):
        rows = json.loads(json.dumps(record["per_prompt"]))
        answers = {str(o["prompt_id"]): o["turns"] for o in lines(root / "run" / "outputs.jsonl")}
        for row in rows:
            for t, out in zip(row["turns"], answers[str(row["prompt_id"])], strict=True):
                t["ar_speed_py_tokens"] = speed_py_tokens(tokenizer, out["ar_answer"])
        ratio = speed(summary["speculative"], summary["baseline"], tokenizer, "overall")[2]
        assert speed_py_speedup(rows) == pytest.approx(ratio, rel=1e-9)
    assert speed_py_speedup(rows) != pytest.approx(record["metrics"]["spec_bench_speedup"], rel=1e-3)
    # the export says so, naming both figures and both counts
    differs = tmp_path / "differs"
    shutil.copytree(root / "run", differs)
    changed = {**record, "per_prompt": rows}
    changed["metrics"] = {**record["metrics"], "spec_bench_speed_py_speedup": speed_py_speedup(rows)}
    (differs / "record.json").write_text(json.dumps(changed))
    assert cli_main(["export", "spec-bench", str(differs), str(tmp_path / "a.jsonl")]) == 0
    err = capsys.readouterr().err
    counted = sum(t["ar_tokens"] for r in rows for t in r["turns"])
    recounted = sum(t["ar_speed_py_tokens"] for r in rows for t in r["turns"])
    assert (
        f"harness export: note: Spec-Bench's speed.py will print a speedup of {speed_py_speedup(rows):.3f}x for these "
        f"files, not the {record['metrics']['spec_bench_speedup']:.3f}x the run measured with the same statistic: "
        f"it recounts the baseline's tokens from the answer text minus one for a BOS, {recounted:,} where the "
        f"baseline generated {counted:,}"
    ) in err


def test_the_export_notes_an_ungated_run_and_prompts_outside_spec_bench_s_categories(exported, tmp_path, capsys):
    _, _, root = exported
    assert cli_main(["export", "spec-bench", str(root / "run"), str(tmp_path / "a.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "harness export: note: the run is ungated (gates not passed: end_to_end_oracle, oracle)" in err
    assert "one of Spec-Bench's" not in err
    fixture = fixture_run(3)  # gated, code and chat prompts
    assert cli_main(["export", "spec-bench", str(fixture), str(tmp_path / "b.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "ungated" not in err and "requests a batch" not in err
    assert (
        "harness export: note: none of the run's categories (chat, code) is one of Spec-Bench's: its speed.py finds "
        "rows for the overall figure only"
    ) in err
    batched = fixture_run(7)  # batch 4: a request's wall time includes its batch's prefill
    assert cli_main(["export", "spec-bench", str(batched), str(tmp_path / "b4.jsonl")]) == 0
    assert (
        "harness export: note: the run decoded 4 requests a batch: each answer's wall_time is its request's latency "
        "inside its batch, its batch's whole prefill included, while Spec-Bench times one question at a time"
    ) in capsys.readouterr().err
    mixed = tmp_path / "mixed"
    shutil.copytree(root / "run", mixed)
    record = load_record(mixed)
    record["per_prompt"][0]["category"] = "poetry"
    (mixed / "record.json").write_text(json.dumps(record))
    assert cli_main(["export", "spec-bench", str(mixed), str(tmp_path / "m.jsonl")]) == 0
    assert (
        "harness export: note: categories poetry are not Spec-Bench's: its speed.py counts their rows in the overall "
        "figure only"
    ) in capsys.readouterr().err
    # the run's own console notes on its figures travel with the files: a stall, a speedup with nothing accepted
    stalled = {"prompt_id": record["per_prompt"][0]["prompt_id"], "arm": "spec", "ratio": 4.2}
    record["metrics"].update(timing_outliers=[stalled], decode_speedup=1.3, mean_committed_per_round=1.0)
    (mixed / "record.json").write_text(json.dumps(record))
    assert cli_main(["export", "spec-bench", str(mixed), str(tmp_path / "n.jsonl")]) == 0
    err = capsys.readouterr().err
    assert (
        f"harness export: note: 1 prompt's arm took 3x or more the arm's median time per round: "
        f"{stalled['prompt_id']} (spec, 4.2x); a stall, not the method"
    ) in err
    assert "harness export: note: decode speedup 1.30x with no proposed token accepted" in err
    # another generation budget than Spec-Bench's 1,024, and prompts cut to fit: said with the files
    assert (
        "harness export: note: the run generated up to 12 new tokens a turn where Spec-Bench generates up to 1024: "
        "prefill weighs more in each wall_time, so the figures are not its leaderboard's"
    ) in err
    assert "oldest text cut" not in err
    record["per_prompt"][1]["cut_tokens"] = 300
    record["config"]["generation"]["max_new_tokens"] = 1024
    (mixed / "record.json").write_text(json.dumps(record))
    assert cli_main(["export", "spec-bench", str(mixed), str(tmp_path / "t.jsonl")]) == 0
    err = capsys.readouterr().err
    assert (
        f"harness export: note: 1 question(s) had their oldest text cut to fit the model's positions "
        f"(workload.truncate=left): {record['per_prompt'][1]['prompt_id']}; their answers were generated from the "
        "cut prompt, where Spec-Bench feeds the whole one"
    ) in err
    assert "new tokens a turn" not in err
    assert cli_main(["export", "spec-bench", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: harness export spec-bench")
    assert cli_main(["export", "spec-bench", str(fixture), str(tmp_path / "c.jsonl"), "model_id="]) == 2
    assert capsys.readouterr().err.strip() == (
        "harness export: refused: model_id= is empty; give a value or leave the option out"
    )
    assert not (tmp_path / "c.jsonl").exists()


def test_export_command_and_its_refusals(exported, tmp_path, capsys, monkeypatch):
    record, _, root = exported
    out = tmp_path / "o.jsonl"
    assert cli_main(["export", "spec-bench", str(root / "run"), str(out), f"baseline={tmp_path / 'b.jsonl'}"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["questions"] == 10 and (tmp_path / "b.jsonl").is_file() and out.is_file()
    assert cli_main(["export", "csv", str(root / "run"), str(out)]) == 2
    assert "unknown export format 'csv'" in capsys.readouterr().err
    assert cli_main(["export", "spec-bench", str(root / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness export: refused: expected RUN_DIR OUT.jsonl")
    assert cli_main(["export"]) == 2  # no arguments: the usage, on stderr
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: harness export spec-bench")
    # an existing answer file is kept unless overwrite=true
    before = out.read_text()
    assert cli_main(["export", "spec-bench", str(root / "run"), str(out), f"baseline={tmp_path / 'b2.jsonl'}"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"harness export: refused: {out} already exists; give another path or overwrite=true"
    )
    assert out.read_text() == before and not (tmp_path / "b2.jsonl").exists()
    argv = ["export", "spec-bench", str(root / "run"), str(out), f"baseline={tmp_path / 'b.jsonl'}", "overwrite=true"]
    assert cli_main(argv) == 0
    capsys.readouterr()
    # nothing is written inside a run folder: there it would replace or sit beside the bound files
    run_files = sorted(p.name for p in (root / "run").iterdir())
    for target in (root / "run" / "record.json", root / "run" / "answers.jsonl", root / "run" / "sub" / "a.jsonl"):
        assert cli_main(["export", "spec-bench", str(root / "run"), str(target), "overwrite=true"]) == 2
        assert f"is inside the run folder {(root / 'run').resolve()}" in capsys.readouterr().err
    assert sorted(p.name for p in (root / "run").iterdir()) == run_files
    # a job folder of a multirun is named by its overrides: a path with "=" in it is still a path
    job = tmp_path / "sweep" / "proposer=prompt_lookup,workload=spec_bench"
    shutil.copytree(root / "run", job)
    assert cli_main(["export", "spec-bench", str(job), str(tmp_path / "job=answers.jsonl")]) == 0
    assert (
        json.loads(capsys.readouterr().out)["questions"] == 10 and (tmp_path / "job=answers-baseline.jsonl").is_file()
    )
    # outputs that are not the ones the record binds are not exported
    tampered = tmp_path / "tampered"
    shutil.copytree(root / "run", tampered)
    with open(tampered / "outputs.jsonl", "a") as f:
        f.write("\n")
    with pytest.raises(ExportError, match="outputs.jsonl is not the one the record binds"):
        export_spec_bench(tampered, tmp_path / "t.jsonl")
    assert not (tmp_path / "t.jsonl").exists()
    with pytest.raises(ExportError, match="would overwrite"):
        export_spec_bench(root / "run", out, baseline=out)
    # a file where a folder is needed, and a path that ends like a folder, are named as such
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportError, match=r"a.jsonl cannot be written: .*afile is a file, not a folder$"):
        export_spec_bench(root / "run", tmp_path / "afile" / "a.jsonl")
    with pytest.raises(ExportError, match=r"cannot be written: .*afile is a file, not a folder$"):
        export_spec_bench(root / "run", tmp_path / "ok.jsonl", baseline=tmp_path / "afile" / "base.jsonl")
    with pytest.raises(ExportError, match=r"^baseline=.*l.jsonl.d/ names a folder; give a file path"):
        export_spec_bench(root / "run", tmp_path / "ok.jsonl", baseline=f"{tmp_path}/l.jsonl.d/")
    assert not (tmp_path / "ok.jsonl").exists() and not (tmp_path / "l.jsonl.d").exists()
    # OUT=. (or .., or a folder) has no file name: refused as a folder, not with Path's "has an empty name"
    monkeypatch.chdir(tmp_path)
    for folder in (".", "..", str(tmp_path)):
        assert cli_main(["export", "spec-bench", str(root / "run"), folder]) == 2
        assert capsys.readouterr().err.strip() == (
            f"harness export: refused: OUT={folder} names a folder; give a file path, e.g. "
            f"{Path(folder) / 'answers.jsonl'}"
        )
    with pytest.raises(ExportError, match=r"^baseline=\. names a folder; give a file path, e.g. answers.jsonl$"):
        export_spec_bench(root / "run", tmp_path / "ok.jsonl", baseline=".")
    assert not (tmp_path / "ok.jsonl").exists()
    with pytest.raises(ExportError, match="no such record file"):
        export_spec_bench(tmp_path / "nowhere", out)
    # a run the runner wrote exports (the fixture sweep's prompt lookup run on the tiny model)
    fixture = fixture_run(1)
    record = load_record(fixture)
    done = export_spec_bench(fixture, tmp_path / "fx.jsonl")
    assert done["questions"] == len(record["per_prompt"]) == 4 and done["run_speedup"] == record["metrics"]["speedup"]
    assert done["run_spec_bench_speedup"] == record["metrics"]["spec_bench_speedup"]
    (tmp_path / "fx.jsonl").unlink()
    (tmp_path / "fx-baseline.jsonl").unlink()
    # a record without per-turn rows (what an older harness wrote) is refused, as is a run folder
    # without its outputs
    older = tmp_path / "older"
    shutil.copytree(fixture, older)
    for row in record["per_prompt"]:
        del row["turns"]
    (older / "record.json").write_text(json.dumps(record))
    with pytest.raises(ExportError, match="'code-0': the run has no per-turn answers and timings"):
        export_spec_bench(older, tmp_path / "x.jsonl")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(fixture / "record.json", bare / "record.json")
    with pytest.raises(ExportError, match="bare: its outputs.jsonl is missing"):
        export_spec_bench(bare, tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()


def _set_turn(key, value):
    def mutate(record, outputs):
        record["per_prompt"][0]["turns"][0][key] = value

    return mutate


def _drop_turn_key(key):
    def mutate(record, outputs):
        del record["per_prompt"][0]["turns"][0][key]

    return mutate


def _set_output_turn(key, value):
    def mutate(record, outputs):
        outputs[0]["turns"][0][key] = value

    return mutate


def _one_more_round_token(record, outputs):
    outputs[0]["turns"][0]["spec_round_tokens"][-1] += 1


def _one_round_fewer(record, outputs):
    del outputs[0]["turns"][0]["ar_round_tokens"][-1]


def _zero_wall_time(record, outputs):
    record["per_prompt"][0]["turns"][0].update(ar_prefill_ms=0.0, ar_decode_ms=0)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            _set_turn("spec_decode_ms", float("nan")),
            "record.json's spec_decode_ms must be a finite number >= 0; got nan",
        ),
        (_set_turn("ar_prefill_ms", None), "record.json's ar_prefill_ms must be a finite number >= 0; got None"),
        (_set_turn("spec_tokens", -1), "record.json's spec_tokens must be a whole number >= 0; got -1"),
        (_set_turn("ar_rounds", 2.5), "record.json's ar_rounds must be a whole number >= 0; got 2.5"),
        (_drop_turn_key("spec_rounds"), "record.json's spec_rounds must be a whole number >= 0; it is missing"),
        (_zero_wall_time, "ar_prefill_ms + ar_decode_ms is 0 in record.json"),
        (_set_output_turn("spec_round_tokens", ["2"]), "outputs.jsonl's spec_round_tokens must be a list of whole"),
        (_set_output_turn("ar_answer", None), "outputs.jsonl's ar_answer must be the answer text; got None"),
        (_one_more_round_token, "spec_round_tokens holds"),
        (_one_round_fewer, "ar_round_tokens holds"),
    ],
)
def test_export_refuses_a_turn_with_a_figure_that_is_no_count_or_time_and_writes_nothing(
    tmp_path, capsys, mutate, message
):
    """A turn's decode time of NaN was exported as "wall_time": [NaN] with exit 0 (speed.py reads it
    back as a number and its means turn NaN), a missing rounds key ended in a KeyError and exit 1,
    a null prefill in a TypeError, tokens per round that did not add up to the turn's tokens gave
    inconsistent accept_lengths. Each turn is checked before anything is written: one line naming
    the prompt, the turn and the key, exit 2, no file."""
    from harness.files import file_sha256

    run = tmp_path / "run"
    shutil.copytree(fixture_run(1), run)
    record = json.loads((run / "record.json").read_text())
    outputs = [json.loads(line) for line in (run / "outputs.jsonl").read_text().splitlines() if line.strip()]
    mutate(record, outputs)
    (run / "outputs.jsonl").write_text("".join(json.dumps(o) + "\n" for o in outputs))
    record["outputs"]["sha256"] = file_sha256(run / "outputs.jsonl")  # the record binds the outputs as changed
    (run / "record.json").write_text(json.dumps(record))
    out = tmp_path / "answers" / "a.jsonl"
    assert cli_main(["export", "spec-bench", str(run), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness export: refused: prompt 'code-0', turn 1: "), err
    assert message in err[0]
    assert not (tmp_path / "answers").exists()


def test_task_columns():
    assert [task_of(c) for c in ("writing", "humanities", "qa", "code")] == ["mt_bench", "mt_bench", "qa", "code"]
    assert task_order(["rag", "code", "mt_bench", "chat", "translation", "overall"]) == [
        "mt_bench",
        "translation",
        "rag",
        "chat",
        "code",
    ]


def test_spec_bench_category_names_match_the_workloads_copy():
    from helpers import SB_CATEGORIES, SB_MT_BENCH

    from harness.tracking import spec_bench
    from harness.workloads import prompts

    assert prompts.SPEC_BENCH_CATEGORIES == SB_CATEGORIES
    assert spec_bench.MT_BENCH_CATEGORIES == prompts.MT_BENCH_CATEGORIES == SB_MT_BENCH


def test_model_id_names_the_experiment_else_the_sweep_else_adhoc():
    from harness.tracking.spec_bench import default_model_id

    axes = {"proposer": "rest", "topology": "sequences", "verifier": "greedy", "model": "smollm2", "temperature": 0.0}
    in_sweep = {"axes": axes, "experiment": None, "sweep": "spec_bench", "gated": True}
    assert default_model_id(in_sweep, "spec") == "spec_bench/smollm2/rest-sequences-greedy-temperature-0"
    assert default_model_id({**in_sweep, "experiment": "default"}, "ar").startswith("default/smollm2/ar-baseline")
    assert default_model_id({**in_sweep, "sweep": None}, "spec").startswith("adhoc/")
    # two configurations the axes do not tell apart get two ids: the manifest hash, and the batch size
    hashed = {**in_sweep, "manifest_hash": "0123456789abcdef"}
    assert default_model_id(hashed, "spec") == "spec_bench/smollm2/rest-sequences-greedy-temperature-0-01234567"
    batched = {**hashed, "axes": {**axes, "batch_size": 4}}
    assert default_model_id(batched, "ar") == "spec_bench/smollm2/ar-baseline-temperature-0-batch-4-01234567"


def test_an_ungated_or_heuristic_runs_default_model_id_says_so(exported, tmp_path, capsys):
    """An ungated or heuristic run's answers were exported under a model id a gated run's could have,
    and Spec-Bench groups answers by model id: the speculative arm's default id says which it is (the
    baseline's answers are the target's own either way); a model_id given stays as given."""
    from harness.tracking.spec_bench import default_model_id

    axes = {"proposer": "rest", "topology": "sequences", "verifier": "typical", "model": "smollm2", "temperature": 0.7}
    gated = {"axes": axes, "experiment": None, "sweep": "s", "gated": True, "manifest_hash": "0123456789abcdef"}
    name = "s/smollm2/rest-sequences-typical-temperature-0.7-01234567"
    assert default_model_id(gated, "spec") == name
    assert default_model_id({**gated, "gated": False}, "spec") == f"{name}-ungated"
    assert default_model_id({**gated, "exact": False}, "spec") == f"{name}-heuristic"
    assert default_model_id({**gated, "gated": False, "exact": False}, "spec") == f"{name}-heuristic-ungated"
    assert default_model_id({**gated, "gated": False, "exact": False}, "ar").endswith(
        "ar-baseline-temperature-0.7-01234567"
    )
    _, _, root = exported  # ungated (gates.oracle=false): said on stderr and in the id; an id given stays
    assert cli_main(["export", "spec-bench", str(root / "run"), str(tmp_path / "a.jsonl"), "model_id=mine"]) == 0
    assert "harness export: note: the run is ungated" in capsys.readouterr().err
    assert {x["model_id"] for x in lines(tmp_path / "a.jsonl")} == {"mine"}
    assert {x["model_id"] for x in lines(tmp_path / "a-baseline.jsonl")} == {"mine-baseline"}


def _rebind(run, record, outputs):
    """Write a changed record and outputs into ``run``, the record binding the outputs as changed."""
    from harness.files import file_sha256

    (run / "outputs.jsonl").write_text("".join(json.dumps(o) + "\n" for o in outputs))
    record["outputs"]["sha256"] = file_sha256(run / "outputs.jsonl")
    (run / "record.json").write_text(json.dumps(record))


def test_the_export_names_the_turns_whose_answers_differ_at_temperature_0(exported, tmp_path, capsys):
    """A gated run at temperature 0 can hold answers that differ between the arms (recorded near-ties),
    and Spec-Bench's evaluation/equal.py then prints "Not Equal!" for the two files: the export said
    nothing of it."""
    _, _, root = exported
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    record = load_record(run)
    outputs = [json.loads(x) for x in (run / "outputs.jsonl").read_text().splitlines() if x.strip()]
    assert cli_main(["export", "spec-bench", str(run), str(tmp_path / "same.jsonl")]) == 0
    assert "differ" not in capsys.readouterr().err  # identical answers: nothing said
    two = next(o for o in outputs if o["n_turns"] == 2)
    diverged = two["turns"][1]
    diverged["spec_token_ids"] = diverged["spec_token_ids"][:-1] + [(diverged["spec_token_ids"][-1] + 1) % 96]
    tie = {"prompt_id": two["prompt_id"], "turn": 2, "position": len(diverged["spec_token_ids"]) - 1}
    record["metrics"]["greedy_identical"] = False
    record["gates"]["greedy_equality"]["near_ties"] = [tie]
    _rebind(run, record, outputs)
    assert cli_main(["export", "spec-bench", str(run), str(tmp_path / "tie.jsonl")]) == 0
    err = capsys.readouterr().err
    assert (
        f"harness export: note: the speculative and baseline answers differ at temperature 0 in 1 turn: question "
        f"{two['question_id']} turn 2; each divergence is a recorded near-tie (1 in the record's "
        "gates.greedy_equality.near_ties: the target's top two logits within the dtype's tolerance), and a later "
        "turn carries each arm's own earlier answers, so Spec-Bench's evaluation/equal.py prints \"Not Equal!\" for "
        "these files"
    ) in err
    record["gates"]["greedy_equality"] = {"status": "skipped", "reason": "gates.greedy_equality=false"}
    _rebind(run, record, outputs)
    assert cli_main(["export", "spec-bench", str(run), str(tmp_path / "unchecked.jsonl")]) == 0
    err = capsys.readouterr().err
    assert (
        f"in 1 turn: question {two['question_id']} turn 2; the greedy-equality gate did not check them "
        "(gates.greedy_equality skipped)"
    ) in err


def test_the_export_counts_the_answers_cut_at_the_stop_string(exported, tmp_path, capsys):
    """Under workload.chat_template=vicuna each answer is cut at its first "</s>", as Spec-Bench's
    eval.py cuts it; its new_tokens still count the tokens generated past it, which the export says."""
    _, _, root = exported
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    record = load_record(run)
    outputs = [json.loads(x) for x in (run / "outputs.jsonl").read_text().splitlines() if x.strip()]
    turns = [t for o in outputs for t in o["turns"]]
    for t in turns:
        t["ar_answer_cut"] = t["spec_answer_cut"] = False
    turns[0]["spec_answer_cut"] = turns[1]["spec_answer_cut"] = turns[1]["ar_answer_cut"] = True
    _rebind(run, record, outputs)
    assert cli_main(["export", "spec-bench", str(run), str(tmp_path / "a.jsonl")]) == 0
    assert (
        f"harness export: note: 2 speculative and 1 baseline answer(s) of {len(turns)} turns were cut at their "
        "first \"</s>\" (workload.chat_template=vicuna: FastChat's stop string, where Spec-Bench's eval.py cuts "
        "them) before they were fed back and written here; their new_tokens and wall_time count the tokens "
        "generated past it, as Spec-Bench's do"
    ) in capsys.readouterr().err


def test_a_checkpoint_without_a_chat_template_runs_spec_bench_in_vicunas_format(tmp_path, monkeypatch, capsys):
    """Spec-Bench builds every model's prompts in FastChat's Vicuna format, and Vicuna's tokenizer has no
    chat template: such a checkpoint was refused with transformers' own error. It is refused naming
    workload.chat_template before any weights are read, and runs with workload.chat_template=vicuna."""
    from checkpoint_fixtures import tiny_checkpoint

    from harness.app import run_main
    from harness.workloads.conversations import VICUNA_SYSTEM

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    path = write_jsonl(tmp_path / "question.jsonl", spec_bench_questions(1, categories=("writing",)))
    argv = ["model=hf", f"model.name_or_path={ckpt}", "workload=spec_bench", f"workload.path={path}"]
    argv += ["generation.max_new_tokens=4", "generation.warmup_tokens=1", "gates.oracle=false", "threads=1"]
    assert run_main([*argv, f"output_dir={tmp_path / 'refused'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "harness run: refused: the target's tokenizer has no chat template: set workload.chat_template=vicuna"
    )
    assert not (tmp_path / "refused" / "record.json").exists()
    assert run_main([*argv, "workload.chat_template=vicuna", f"output_dir={tmp_path / 'run'}"]) == 0
    capsys.readouterr()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    rows = [json.loads(x) for x in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    turns = rows[0]["turns"]
    first = tok.decode(turns[0]["spec_prompt_token_ids"])
    assert first.startswith(f"{VICUNA_SYSTEM} USER: ") and first.endswith(" ASSISTANT:")
    assert turns[0]["spec_prompt_token_ids"] == tok(first)["input_ids"]  # as Spec-Bench tokenizes its prompt text
    assert tok.decode(turns[-1]["spec_prompt_token_ids"]).endswith(" ASSISTANT:")
    record = load_record(tmp_path / "run")
    assert record["config"]["workload"]["chat_template"] == "vicuna"


@pytest.mark.parametrize("fails", ["write", "rename"])
def test_a_failed_baseline_write_leaves_both_answer_files_as_they_were(tmp_path, monkeypatch, fails):
    """The answers and their baseline are one pair: the answers were written, then the baseline's write
    failed (a full disk), leaving answers without a baseline (a retry was then refused: the answers
    file exists) or, over an earlier export, answers beside another export's baseline."""
    import errno
    import os
    import tempfile

    fixture = fixture_run(1)
    out, base = tmp_path / "answers.jsonl", tmp_path / "answers-baseline.jsonl"
    real_mkstemp, real_replace = tempfile.mkstemp, os.replace

    def mkstemp(*args, **kwargs):  # the baseline's temporary file cannot be written
        if fails == "write" and str(kwargs.get("prefix", "")).startswith(f".{base.name}."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_mkstemp(*args, **kwargs)

    def replace(src, dst, *args, **kwargs):  # nor renamed into place
        if fails == "rename" and Path(dst) == base:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    def export_failing(**kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(tempfile, "mkstemp", mkstemp)
            patch.setattr(os, "replace", replace)
            with pytest.raises(OSError, match="No space left"):
                export_spec_bench(fixture, out, **kwargs)

    export_failing()
    assert list(tmp_path.iterdir()) == []  # neither file, no temporary
    export_spec_bench(fixture, out)  # a retry is not refused
    written = {p.name: p.read_bytes() for p in (out, base)}
    export_failing(model_id="another", overwrite=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == written
    export_spec_bench(fixture, out, model_id="another", overwrite=True)
    assert all(json.loads(line)["model_id"] == "another" for line in out.read_text().splitlines())


def test_a_prompt_id_becomes_an_int_question_id_only_when_written_as_one():
    from harness.tracking.spec_bench import _question_id

    assert _question_id({}, "81") == 81
    assert _question_id({"question_id": "q7"}, "81") == "q7"
    for kept in ("007", "²", "8_1", "HumanEval/3", "٣"):  # int() would drop, refuse or rewrite these
        assert _question_id({}, kept) == kept
