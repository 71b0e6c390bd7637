"""The leaderboard in Spec-Bench's shape (rows = arms, columns = its tasks plus overall; cells =
speedup and mean accepted tokens with the bonus token counted, with paired-bootstrap CIs), in
`harness compare` and in the report, on hand-computable synthetic records."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
from helpers import fixture_run

from harness.tracking.compare import format_leaderboard, leaderboard, main
from harness.tracking.report import build_report, find_recipe, load_recipe
from harness.tracking.store import aggregate, load_record

FIXTURE = fixture_run(1)  # a record the runner wrote: the template the hand-computable rows go into


def prompt(pid, category, spec_ms, spec_tok, ar_ms, ar_tok, rounds, spec_pre=10.0, ar_pre=10.0):
    return {
        "prompt_id": pid,
        "category": category,
        "spec_decode_ms": spec_ms,
        "spec_tokens": spec_tok,
        "ar_decode_ms": ar_ms,
        "ar_tokens": ar_tok,
        "spec_rounds": rounds,
        "spec_prefill_ms": spec_pre,
        "ar_prefill_ms": ar_pre,
    }


ARMS = {
    # writing and roleplay are MT-bench categories: one column
    "prompt_lookup": [
        prompt("81", "writing", 100.0, 20, 200.0, 20, 5),
        prompt("91", "roleplay", 50.0, 10, 100.0, 10, 5),
        prompt("321", "qa", 40.0, 10, 60.0, 10, 2),
        prompt("322", "qa", 40.0, 10, 60.0, 10, 2),
    ],
    "rest": [
        prompt("81", "writing", 180.0, 20, 200.0, 20, 10),
        prompt("91", "roleplay", 90.0, 10, 100.0, 10, 5),
        prompt("321", "qa", 60.0, 10, 60.0, 10, 10),
        prompt("322", "qa", 60.0, 10, 60.0, 10, 10),
    ],
}


@pytest.fixture
def root(tmp_path):
    template = json.loads((FIXTURE / "record.json").read_text())
    for k, (proposer, rows) in enumerate(ARMS.items()):
        rec = copy.deepcopy(template)
        rec["run_id"] = f"lb{k}"
        rec["axes"].update({"proposer": proposer, "workload": "spec_bench", "batch_size": 1})
        rec["per_prompt"] = rows
        d = tmp_path / "runs" / f"lb{k}"
        d.mkdir(parents=True)
        shutil.copy(FIXTURE / "outputs.jsonl", d / "outputs.jsonl")  # the file the record binds
        rec.pop("round_series")  # a record naming no round series: no rounds.jsonl to bind
        (d / "record.json").write_text(json.dumps(rec))
    return tmp_path / "runs"


def test_cells_are_hand_computable(root):
    columns, rows = leaderboard(aggregate(root), n_resamples=200)
    assert columns == ["mt_bench", "qa", "overall"]
    assert [r.arm for r in rows] == ["prompt_lookup", "rest"]  # best overall first
    pl = rows[0].cells
    assert pl["mt_bench"].n_prompts == 2 and pl["qa"].n_prompts == 2 and pl["overall"].n_prompts == 4
    assert pl["mt_bench"].speedup.value == pytest.approx((300 / 30) / (150 / 30))
    assert pl["mt_bench"].accepted_tokens.value == pytest.approx(30 / 10)  # bonus token counted
    assert pl["qa"].speedup.value == pytest.approx(1.5) and pl["qa"].accepted_tokens.value == pytest.approx(5.0)
    assert pl["overall"].speedup.value == pytest.approx((420 / 50) / (230 / 50))
    assert pl["overall"].accepted_tokens.value == pytest.approx(50 / 14)
    # CIs over prompts: the constant-ratio qa column has a zero-width interval
    assert pl["qa"].speedup.ci_low == pytest.approx(1.5) and pl["qa"].speedup.ci_high == pytest.approx(1.5)
    lo, hi = pl["overall"].speedup.ci_low, pl["overall"].speedup.ci_high
    assert lo <= pl["overall"].speedup.value <= hi and lo < hi
    # Spec-Bench's statistic: mean of per-prompt tokens / (prefill + decode) s, over AR's
    spec = [20 / 0.11, 10 / 0.06, 10 / 0.05, 10 / 0.05]
    ar = [20 / 0.21, 10 / 0.11, 10 / 0.07, 10 / 0.07]
    assert pl["overall"].spec_bench_speedup == pytest.approx((sum(spec) / 4) / (sum(ar) / 4))
    rest = rows[1].cells
    assert rest["qa"].speedup.value == pytest.approx(1.0) and rest["qa"].accepted_tokens.value == pytest.approx(1.0)
    text = format_leaderboard(columns, rows, by="proposer", level=0.95)
    assert "mean accepted tokens per round, bonus token counted" in text
    assert "prompt_lookup  2.000x [" in text and "/ 3.00 [" in text


def test_compare_prints_the_leaderboard_and_writes_it_to_json(root, tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main([str(root), "resamples=200", f"json={out}"]) == 0
    printed = capsys.readouterr().out
    assert "== leaderboard (Spec-Bench shape), exact runs ==" in printed
    board = json.loads(out.read_text())["leaderboard"]
    assert board["columns"] == ["mt_bench", "qa", "overall"]
    assert [r["arm"] for r in board["rows"]] == ["prompt_lookup", "rest"]
    assert board["rows"][0]["cells"]["qa"]["decode_speedup"]["value"] == pytest.approx(1.5)
    assert main([str(root), "resamples=200", "leaderboard=false"]) == 0
    assert "leaderboard" not in capsys.readouterr().out


def test_the_fixture_sweep_has_its_own_columns_and_records_without_rounds_show_no_accepted_tokens(tmp_path):
    df = aggregate(FIXTURE.parent)
    columns, rows = leaderboard(df, n_resamples=100)
    assert columns == ["chat", "code", "overall"]  # categories that are no Spec-Bench task: their own columns
    # the exact prompt lookup arm: accepted tokens per round (bonus counted) from its runs' per-prompt rows
    (lookup,) = [r for r in rows if r.arm == "prompt_lookup" and r.section == "exact"]
    runs = [load_record(d) for d in FIXTURE.parent.iterdir() if d.is_dir()]
    prompts = [p for r in runs if r["axes"]["proposer"] == "prompt_lookup" and r["gated"] for p in r["per_prompt"]]
    overall = lookup.cells["overall"]
    assert overall.n_prompts == 4
    expected = sum(p["spec_tokens"] for p in prompts) / sum(p["spec_rounds"] for p in prompts)
    assert overall.accepted_tokens.value == pytest.approx(expected, rel=1e-12)
    assert overall.spec_bench_speedup is not None and overall.speedup.value is not None
    # a record written before per-prompt rounds and prefill times: no accepted tokens, no Spec-Bench statistic
    older = tmp_path / "older"
    shutil.copytree(FIXTURE, older)
    record = load_record(older)
    for p in record["per_prompt"]:
        del p["spec_rounds"], p["spec_prefill_ms"], p["ar_prefill_ms"]
    (older / "record.json").write_text(json.dumps(record))
    columns, rows = leaderboard(aggregate(tmp_path), n_resamples=100)
    assert all(c.accepted_tokens.value is None and c.spec_bench_speedup is None for r in rows for c in r.cells.values())
    assert all(r.cells["overall"].speedup.value is not None for r in rows)


def test_report_has_the_leaderboard_and_the_speedup_by_category_plot(root, tmp_path):
    recipe_path = find_recipe("default")
    path = build_report(
        aggregate(root), tmp_path / "rep", load_recipe(recipe_path), recipe_path=recipe_path, source="x"
    )
    md = path.read_text()
    assert "## Leaderboard (Spec-Bench shape)" in md
    assert "| proposer | Multi-turn Conversation | Question Answering | Overall |" in md
    assert (
        "| prompt_lookup | 2.000x [" in md
        and "Spec-Bench's speedup statistic (the formula of its evaluation/speed.py" in md
    )
    assert "Prompts: Multi-turn Conversation 2, Question Answering 2, Overall 4." in md
    # Spec-Bench's statistic to three decimals, as harness compare prints it (it printed 4 significant figures)
    spec_bench = md[md.index("Spec-Bench's speedup statistic") :].split("\n\n")[1].splitlines()
    assert all(
        cell.strip() == "-" or cell.strip().endswith("x") for line in spec_bench[2:] for cell in line.split("|")[2:-1]
    )
    assert any(re.search(r"\| \d+\.\d{3}x \|", line) for line in spec_bench[2:])
    png = tmp_path / "rep" / "09_speedup_by_category.png"
    assert png.is_file() and f"]({png.name})" in md


def test_a_category_only_another_section_holds_is_no_column_of_this_one(root):
    """An ungated run's own category made a column of dashes in the exact runs' leaderboard."""
    ungated = json.loads((root / "lb0" / "record.json").read_text())
    ungated["run_id"] = "lb-ungated"
    ungated["gated"] = False
    ungated["gates"]["oracle"] = {"status": "skipped", "override": "gates.oracle=false"}
    ungated["per_prompt"] = [prompt("900", "default", 50.0, 10, 60.0, 10, 3)]
    (root / "ungated").mkdir()
    shutil.copy(root / "lb0" / "outputs.jsonl", root / "ungated" / "outputs.jsonl")
    (root / "ungated" / "record.json").write_text(json.dumps(ungated))
    df = aggregate(root)
    assert set(df["section"]) == {"exact", "ungated"}
    columns, rows = leaderboard(df, n_resamples=50)
    assert "default" in columns  # the ungated run's category, over both sections
    text = format_leaderboard(columns, rows, by="proposer", level=0.95)
    exact, ungated_part = text.split("== leaderboard (Spec-Bench shape), UNGATED")
    assert "default" not in exact.splitlines()[2] and "default" in ungated_part.splitlines()[2]


def test_a_run_without_rounds_or_prefill_pooled_with_one_that_has_them_gives_no_figure(root):
    """An older record's prompts carry no spec_rounds or prefill: pooled into an arm with a newer
    run of the same prompts, the leaderboard summed the rounds of one run only and doubled the mean
    accepted tokens (and took Spec-Bench's statistic from half the prefill). Such cells are "-" now,
    as the comparison table's end-to-end column is."""
    template = json.loads((root / "lb0" / "record.json").read_text())
    older = copy.deepcopy(template)
    older["run_id"] = "lb0-older"
    for p in older["per_prompt"]:
        p.pop("spec_rounds"), p.pop("spec_prefill_ms")
    d = root / "lb0-older"
    d.mkdir()
    shutil.copy(FIXTURE / "outputs.jsonl", d / "outputs.jsonl")
    (d / "record.json").write_text(json.dumps(older))
    _, rows = leaderboard(aggregate(root), n_resamples=200)
    pl = next(r for r in rows if r.arm == "prompt_lookup").cells["overall"]
    assert pl.accepted_tokens.value is None and pl.spec_bench_speedup is None
    assert pl.speedup.value == pytest.approx((420 / 50) / (230 / 50))  # the decode times are complete


def _pool_a_second_temperature(root):
    """A run of prompt_lookup at temperature 0.7 beside its run at 0: one arm by proposer pools both."""
    record = json.loads((root / "lb0" / "record.json").read_text())
    record["run_id"] = "lb0-t07"
    record["axes"]["temperature"] = 0.7
    d = root / "lb0-t07"
    d.mkdir()
    shutil.copy(root / "lb0" / "outputs.jsonl", d / "outputs.jsonl")
    (d / "record.json").write_text(json.dumps(record))


def test_a_row_pooling_runs_of_other_temperatures_names_them_in_text_json_and_report(root, tmp_path, capsys):
    """The leaderboard merged every run of one proposer, whatever its temperature, verifier or batch
    size, into one row with nothing said, where the comparison table lists them under "mixed axes".
    Each row now carries what varies among its runs, and the notes under the table name it."""
    _pool_a_second_temperature(root)
    columns, rows = leaderboard(aggregate(root), n_resamples=50)
    by_arm = {r.arm: r for r in rows}
    assert by_arm["prompt_lookup"].varying == {"temperature": ["0", "0.7"]} and by_arm["rest"].varying == {}
    assert by_arm["prompt_lookup"].apart == {"temperature": "0,0.7"} and by_arm["rest"].apart == {"temperature": "0"}
    text = format_leaderboard(columns, rows, by="proposer", level=0.95)
    assert (
        "note: arms pooling runs that differ in more than proposer (prompt_lookup: temperature=0,0.7): each of "
        "their cells pools those runs' prompts into one figure"
    ) in text
    assert "note: the arms differ in more than proposer (temperature: prompt_lookup 0,0.7, rest 0)" in text
    out = tmp_path / "c.json"
    assert main([str(root), "resamples=50", f"json={out}"]) == 0
    printed = capsys.readouterr().out
    board_text = printed[printed.index("== leaderboard") :]
    assert "arms pooling runs that differ in more than proposer (prompt_lookup: temperature=0,0.7)" in board_text
    board = json.loads(out.read_text())["leaderboard"]
    rows_json = {r["arm"]: r for r in board["rows"]}
    assert rows_json["prompt_lookup"]["varying"] == {"temperature": ["0", "0.7"]}
    assert rows_json["rest"]["varying"] == {} and rows_json["prompt_lookup"]["batch_sizes"] == [1]
    assert any("prompt_lookup: temperature=0,0.7" in note for note in board["notes"]["exact"])
    recipe_path = find_recipe("default")
    md = build_report(
        aggregate(root), tmp_path / "rep", load_recipe(recipe_path), recipe_path=recipe_path, source="x"
    ).read_text()
    leader_md = md[md.index("## Leaderboard") : md.index("## Plots")]
    assert "Note: arms pooling runs that differ in more than proposer (prompt_lookup: temperature=0,0.7)" in leader_md
    plots_md = md[md.index("## Plots") :]  # each bar plot's caption, its marks escaped for Markdown
    caption = r"Note: arms marked \* pool runs that differ in more than proposer (prompt_lookup\*: temperature=0,0.7)"
    assert plots_md.count(caption) == 2


def test_a_leaderboard_of_batched_arms_says_their_speedups_are_per_request():
    columns, rows = leaderboard(aggregate(FIXTURE.parent), by="batch_size", n_resamples=50)
    assert {r.arm: r.batch_sizes for r in rows if r.section == "exact"}["4"] == (4,)
    text = format_leaderboard(columns, rows, by="batch_size", level=0.95)
    assert "note: arms with runs at batch > 1 (2 (batch 2); 4 (batch 4)): a prompt's time is its request's" in text


def test_the_speedup_bar_plots_mark_an_arm_pooling_other_temperatures(root):
    """Both speedup bar plots drew an arm pooling runs of two temperatures as one bar, unmarked. Its
    label carries a mark, and the footnote under the figure and the caption the report writes name
    what it pools; an arm of one setting stays unmarked."""
    from harness.tracking.report import PLOTS

    plain = PLOTS["speedup_by_proposer_workload"](aggregate(root), {})
    assert [t.get_text() for t in plain.figure.axes[0].get_xticklabels()] == ["prompt_lookup", "rest"]
    assert plain.caption == "" and not plain.figure.legends
    _pool_a_second_temperature(root)
    df = aggregate(root)
    plot = PLOTS["speedup_by_proposer_workload"](df, {})
    assert [t.get_text() for t in plot.figure.axes[0].get_xticklabels()] == ["prompt_lookup*", "rest"]
    assert plot.caption.startswith(
        "arms marked * pool runs that differ in more than proposer (prompt_lookup*: temperature=0,0.7)"
    )
    (footnote,) = plot.figure.legends  # drawn under the axes
    assert footnote.get_title().get_text() == "* pools runs that differ in more than proposer"
    assert [t.get_text() for t in footnote.get_texts()] == ["prompt_lookup*: temperature=0,0.7"]
    plot = PLOTS["speedup_by_category"](df, {})
    labels = [t.get_text() for t in plot.figure.axes[0].get_legend().get_texts()]
    assert labels == ["proposer: prompt_lookup*", "proposer: rest"]
    assert "(prompt_lookup*: temperature=0,0.7)" in plot.caption
    assert [t.get_text() for t in plot.figure.legends[0].get_texts()] == ["prompt_lookup*: temperature=0,0.7"]


def _rewrite(root, name, per_prompt, run_id=None):
    """Write run ``name`` under ``root``: lb0's record (prompt_lookup) with ``per_prompt`` (and ``run_id``)."""
    record = json.loads((root / "lb0" / "record.json").read_text())
    record["per_prompt"] = per_prompt
    record["run_id"] = run_id or record["run_id"]
    (root / name).mkdir(exist_ok=True)
    shutil.copy(root / "lb0" / "outputs.jsonl", root / name / "outputs.jsonl")
    (root / name / "record.json").write_text(json.dumps(record))


def test_a_category_named_overall_is_a_column_beside_the_overall_one(root):
    """A category named ``overall`` was no column: its prompts showed in the overall cell only. It
    is a column of its own, ``overall (category)``, and the overall column still holds every prompt."""
    for name in ("lb0", "lb1"):
        record = json.loads((root / name / "record.json").read_text())
        record["per_prompt"] = [
            {**p, "category": "overall" if p["category"] == "qa" else p["category"]} for p in record["per_prompt"]
        ]
        (root / name / "record.json").write_text(json.dumps(record))
    columns, rows = leaderboard(aggregate(root), n_resamples=100)
    assert columns == ["mt_bench", "overall (category)", "overall"]
    pl = rows[0].cells
    assert pl["overall (category)"].n_prompts == 2 and pl["overall"].n_prompts == 4
    assert pl["overall (category)"].speedup.value == pytest.approx(120 / 80)  # prompts 321 and 322 only
    assert pl["overall"].speedup.value == pytest.approx((420 / 50) / (230 / 50))
    text = format_leaderboard(columns, rows, by="proposer", level=0.95)
    assert "prompts per column: mt_bench=2, overall (category)=2, overall=4" in text


def test_the_leaderboard_refuses_a_prompt_of_two_categories_in_one_arm_as_the_table_does(root):
    """The table refused an arm whose runs gave one prompt two categories; the leaderboard took the
    first run's category and showed figures the table refused, beside it in the report."""
    from harness.tracking.compare import compare
    from harness.tracking.report import _leaderboard_section

    rows = [prompt("321", "summarization", 40.0, 10, 60.0, 10, 2), prompt("322", "qa", 40.0, 10, 60.0, 10, 2)]
    _rewrite(root, "lb-other", rows, run_id="lb-other")
    df = aggregate(root)
    said = (
        "prompt '321' (one text) carries different categories in the runs one arm pools ('summarization' in run "
        "lb-other, 'qa' in run lb0; 1 such prompt(s)): compare those runs apart"
    )
    with pytest.raises(ValueError, match=re.escape(said)):
        compare(df, n_resamples=50)
    with pytest.raises(ValueError, match=re.escape(said)):
        leaderboard(df, n_resamples=50)
    assert _leaderboard_section(df, {})[0].startswith(f"_leaderboard not available: {said}")
    # apart (by= the run), each arm has one category per prompt: both figure
    columns, board = leaderboard(df, by="run_id", n_resamples=50)
    assert {r.arm for r in board} == {"lb0", "lb1", "lb-other"} and "summarization" in columns
