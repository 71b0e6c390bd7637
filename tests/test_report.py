"""`harness report`: Markdown + PNGs regenerated from stored records only."""

from __future__ import annotations

import io
import json
import logging
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from helpers import FIXTURE_ROOT, fixture_record, fixture_run, fixture_run_id

from harness.tracking.report import PLOTS, find_recipe, load_recipe, main

FIXTURES = FIXTURE_ROOT
REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_default_report_from_records_only_without_model_code(tmp_path):
    """The whole default recipe, in a fresh interpreter that must never import model code."""
    out = tmp_path / "report"
    script = textwrap.dedent(
        f"""
        import sys
        from harness.tracking.report import main
        rc = main([{str(FIXTURES)!r}, "out={out}"])
        banned = [m for m in ("torch", "transformers", "wandb", "harness.engine", "harness.target",
                              "harness.proposers") if m in sys.modules]
        print("RC", rc, "BANNED", banned)
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "RC 0 BANNED []" in res.stdout, res.stdout + res.stderr
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == [
        "01_speedup_by_proposer_workload.png",
        "02_acceptance_by_depth.png",
        "03_accepted_length_hist.png",
        "04_round_cost.png",
        "05_temp_kv_vs_rows.png",
        "06_t_profile.png",
        "07_speedup_vs_batch.png",
        "08_frontier.png",
        "09_speedup_by_category.png",
    ]
    for name in pngs:
        w, h = _png_size(out / name)
        assert w >= 600 and h >= 300, (name, w, h)
    md = (out / "report.md").read_text()
    for name in pngs:
        assert f"]({name})" in md
    assert "Not drawn" not in md
    # sections kept apart and labelled: each run's row sits under its own section's heading
    runs_part = md.split("## Comparison")[0]
    exact_part, rest = runs_part.split("### UNGATED")
    ungated_part, rest = rest.split("### HEURISTIC")
    heuristic_part, artifact_part = rest.split("### CPU-BUDGET ARTIFACTS")
    assert all(fixture_run_id(n) in exact_part for n in range(1, 9))
    for number, part in ((11, ungated_part), (10, heuristic_part), (9, artifact_part)):
        run_id = fixture_run_id(number)
        assert run_id in part and run_id not in exact_part
    # quoted paper numbers only under the source-reported label
    src = md.split("## Source-reported numbers (not measured here)")[1]
    assert src.count("| source-reported |") == 3 and "1.62x to 2.36x" in src
    assert "1.62x" not in md.split("## Source-reported")[0]
    # the runs table shows the record's own numbers
    rec = fixture_record(3)
    m = rec["metrics"]
    numbers = (
        m["speedup"],
        m["decode_speedup"],
        m["time_per_committed_token_ms"],
        m["ar_time_per_token_ms"],
        m["mean_committed_per_round"],
    )
    row = f"| {rec['run_id']} | draft_model | expansion | greedy | 0 | 1 | jsonl | tiny | "
    assert row + " | ".join(f"{x:.4g}" for x in numbers) + " | True |" in md


def test_custom_recipe_filters_and_notes_missing_data(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        "title: Batch four only\n"
        "plots:\n"
        "  - kind: frontier\n"
        "    where: {batch_size: 4}\n"
        "  - kind: t_profile\n"
        "    where: {batch_size: 4}\n"
        "  - kind: speedup_by_proposer_workload\n"
        "    where: {proposer: rest}\n"
        "    name: rest_only\n"
        "    sections: [heuristic]\n"
    )
    out = tmp_path / "r"
    assert main([str(FIXTURES), f"out={out}", f"recipe={recipe}"]) == 0
    md = (out / "report.md").read_text()
    assert md.startswith("# Batch four only")
    assert sorted(p.name for p in out.glob("*.png")) == ["01_frontier.png"]
    assert "_Not drawn: no record carries a t(n) profile._" in md
    assert "_Not drawn: no heuristic runs._" in md
    assert "Source-reported" not in md  # this recipe names no source-reported file


def test_every_plot_survives_unmeasured_metrics_and_reads_a_parquet_store(tmp_path):
    """A record whose runner left metrics as None ("not measured") and lists empty."""
    from harness.tracking.store import load_record, rebuild_store

    root = tmp_path / "recs"
    shutil.copytree(fixture_run(1), root / "a")
    shutil.copytree(fixture_run(2), root / "b")  # the outputs its record binds come along
    rec = load_record(fixture_run(2))
    for name in (
        "speedup",
        "decode_speedup",
        "time_per_committed_token_ms",
        "ar_time_per_token_ms",
        "temp_kv_bytes_peak",
    ):
        rec["metrics"][name] = None
    rec["metrics"]["round_cost_ms"]["retrieval"] = None
    rec["metrics"]["acceptance_by_depth"] = rec["metrics"]["reach_by_depth"] = []
    rec["metrics"]["accepted_length_hist"] = []
    (root / "b" / "record.json").write_text(json.dumps(rec))
    rebuild_store(root)
    recipe = tmp_path / "all.yaml"
    recipe.write_text("plots:\n" + "".join(f"  - kind: {k}\n" for k in PLOTS))
    assert main([str(root / "store.parquet"), f"recipe={recipe}"]) == 0  # out defaults next to the store
    md = (root / "report" / "report.md").read_text()
    assert (root / "report" / "04_round_cost.png").is_file()
    assert (root / "report" / "08_frontier.png").is_file()
    assert "_Not drawn: no record carries a t(n) profile._" in md
    assert "_Not drawn: fewer than two batch sizes among the runs._" in md
    assert f"| {rec['run_id']} | rest | sequences | greedy | 0 | 1 | jsonl | tiny | - | - | - |" in md


def test_recipes_are_validated(tmp_path, capsys):
    assert find_recipe("default").resolve() == REPO / "harness" / "reports" / "default.yaml"
    assert [p["kind"] for p in load_recipe(find_recipe("default"))["plots"]][-2:] == ["frontier", "speedup_by_category"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("plots:\n  - kind: pie_chart\n")
    with pytest.raises(ValueError, match="kind must be one of"):
        load_recipe(bad)
    bad.write_text("plots:\n  - kind: frontier\n    colour: red\n")
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        load_recipe(bad)
    assert main([str(FIXTURES), "recipe=does-not-exist"]) == 2
    assert "recipe 'does-not-exist' not found" in capsys.readouterr().err
    assert main([str(FIXTURES), "colour=red"]) == 2
    # a by or filter the store has no column for: refused as compare by=... is (it wrote "_comparison not
    # available_" and exited 0), and no folder is left behind
    out = tmp_path / "r"
    for text, said in (
        ("compare: {by: nosuchaxis}\nplots: []\n", "compare.by='nosuchaxis' names no axis"),
        ("leaderboard: {by: proposer, colour: red}\nplots: []\n", "leaderboard has unknown keys ['colour']"),
        ("plots:\n  - kind: frontier\n    where: {nosuch: 1}\n", "plots[0].where.nosuch='nosuch' names no axis"),
        ("compare: {where: 5}\nplots: []\n", "compare.where must be a mapping of filters"),
        # a baseline no run has: the report wrote "_comparison not available_" and exited 0
        ("compare: {baseline: prompt_lookpu}\nplots: []\n", "compare.baseline='prompt_lookpu' is no proposer of"),
        ("plots:\n  - kind: frontier\n    where: [batch_size]\n", "plots[0].where must be a mapping of filters"),
        # a misspelt top-level key, or a plot value of the wrong type, was ignored or failed naming no key;
        # malformed YAML ended as an error (exit 1) with the parser's context over several lines
        ("titel: X\nplots: []\n", "unknown key 'titel' (did you mean 'title'?); a recipe's keys are"),
        ("title: [1, 2]\nplots: []\n", "title must be a string; got [1, 2]"),
        ("plots:\n  - kind: acceptance_by_depth\n    min_rounds: abc\n", "plots[0].min_rounds must be a whole"),
        ("plots:\n  - kind: acceptance_by_depth\n    min_rounds: -5\n", "plots[0].min_rounds must be a whole"),
        ("plots:\n  - kind: frontier\n    name: ../../escape\n", "plots[0].name='../../escape' must be a plain"),
        ("plots:\n  - kind: frontier\n  - [\n", "bad.yaml: line 4, column 1: not YAML a recipe can be read from"),
    ):
        bad.write_text(text)
        capsys.readouterr()
        assert main([str(FIXTURES), f"out={out}", f"recipe={bad}"]) == 2
        err = capsys.readouterr().err
        assert said in err and not out.exists() and err.count("\n") == 1, err
    bad.write_text("compare: {by: config.proposer.max_ngram, where: {seed: 0}}\nplots: []\n")  # columns it has
    assert main([str(FIXTURES), f"out={out}", f"recipe={bad}"]) == 0
    bad.write_text("compare: {by: batch_size, baseline: 1.0}\nplots: []\n")  # the arm 1, named as a number
    assert main([str(FIXTURES), f"out={out}", f"recipe={bad}"]) == 0
    # a source-reported file that is not there: refused before anything is drawn, the folder not made
    bad.write_text("source_reported: missing.yaml\nplots:\n  - kind: frontier\n")
    assert main([str(FIXTURES), f"out={tmp_path / 'r2'}", f"recipe={bad}"]) == 2
    assert not (tmp_path / "r2").exists()


def test_source_reported_entries_need_their_citation(tmp_path):
    from harness.tracking.report import load_source_reported

    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({"entries": [{"source": "X", "value": "2x"}]}))
    with pytest.raises(ValueError, match=r"missing \['citation', 'quantity', 'setting'\]"):
        load_source_reported(path)
    shipped = load_source_reported(REPO / "harness" / "reports" / "source_reported.yaml")
    assert {e["source"] for e in shipped} == {"REST", "Hydra", "Sequoia"}
    assert all("arXiv:" in e["citation"] for e in shipped)


# --------------------------------------------------------------------------------------------
# labels and acceptance-by-depth intervals


def _store_frame():
    from harness.tracking.report import numeric_metrics
    from harness.tracking.store import aggregate

    return numeric_metrics(aggregate(FIXTURES))


def test_legends_label_runs_by_the_axes_that_differ_never_by_run_id():
    from harness.tracking.report import run_labels

    df = _store_frame()
    b1_greedy = df[(df["batch_size"] == 1) & (df["verifier"] == "greedy") & (df["section"] == "exact")]
    labels = run_labels(b1_greedy)
    # proposer and topology differ among these runs (verifier, T, B, workload and model do not)
    assert labels == {
        fixture_run_id(1): "prompt_lookup/sequence",
        fixture_run_id(2): "rest/sequences",
        fixture_run_id(3): "draft_model/expansion",
    }
    draft = run_labels(df[df["proposer"] == "draft_model"])
    assert len(draft) == 6 and len(set(draft.values())) == 6
    assert draft[fixture_run_id(7)] == "expansion/greedy/T=0/B=4"
    assert draft[fixture_run_id(5)] == "sequence/rejection/T=0.7/B=1"
    assert draft[fixture_run_id(10)] == "expansion/typical/T=0.7/B=1 [heuristic, exact=false]"
    # nothing differs: the full arm name; repeats of one arm are numbered
    one = run_labels(df[df["run_id"] == fixture_run_id(3)])
    assert one == {fixture_run_id(3): "draft_model-expansion-greedy-T0-B1-jsonl"}
    first = df[df["run_id"] == fixture_run_id(1)]
    twice = pd.concat([first, first.assign(run_id="a repeat of the first run")])
    assert sorted(run_labels(twice).values()) == [
        "prompt_lookup-sequence-greedy-T0-B1-jsonl #1",
        "prompt_lookup-sequence-greedy-T0-B1-jsonl #2",
    ]
    # runs of one arm told apart by a swept option that is no axis: the option names them, not #1/#2
    swept = pd.concat([first.assign(**{"config.topology.max_nodes": 8}), first.assign(run_id="r2")])
    swept.loc[swept["run_id"] == "r2", "config.topology.max_nodes"] = 2
    assert sorted(run_labels(swept).values()) == [
        "prompt_lookup-sequence-greedy-T0-B1-jsonl/topology.max_nodes=2",
        "prompt_lookup-sequence-greedy-T0-B1-jsonl/topology.max_nodes=8",
    ]
    for plot in ("acceptance_by_depth", "accepted_length_hist", "t_profile", "frontier"):
        fig = PLOTS[plot](df, {}).figure
        texts = [t.get_text() for t in fig.legends[0].get_texts()] if fig.legends else []
        texts += [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        texts += [t.get_text() for ax in fig.axes for t in ax.texts]
        assert texts and not any(run_id[:16] in t for t in texts for run_id in df["run_id"]), (plot, texts)


def test_acceptance_by_depth_draws_wilson_intervals_and_greys_out_depths_with_few_rounds():
    from matplotlib.colors import to_rgba

    from harness.tracking.conventions import wilson_interval

    df = _store_frame()
    m = fixture_record(3)["metrics"]  # draft_model on an expansion tree of depth 3
    tried, accepted = m["rounds_tried_by_depth"], m["rounds_accepted_by_depth"]
    min_rounds = 20
    few = [float(d + 1) for d, n in enumerate(tried) if n < min_rounds]
    assert few and len(few) < len(tried)  # the record has depths on both sides of the threshold
    run = df[df["run_id"] == fixture_run_id(3)]
    fig = PLOTS["acceptance_by_depth"](run, {"min_rounds": min_rounds}).figure
    ax_c, ax_r, ax_n = fig.axes[:3]
    points = [ln for ln in ax_c.get_lines() if ln.get_linestyle() == "None" and ln.get_marker() not in (None, "", "_")]
    by_depth = {float(ln.get_xdata()[0]): ln for ln in points}
    grey = to_rgba("0.6")
    assert [d for d, ln in sorted(by_depth.items()) if to_rgba(ln.get_color()) == grey] == few
    assert all(by_depth[d].get_markerfacecolor() == "none" for d in few)
    # the interval drawn at depth 1 is the Wilson interval of the record's counts there
    low, high = wilson_interval(accepted[0], tried[0])
    segs = [seg for coll in ax_c.collections for seg in coll.get_segments() if abs(seg[0][0] - 1.0) < 1e-9]
    assert any(abs(seg[0][1] - low) < 1e-9 and abs(seg[1][1] - high) < 1e-9 for seg in segs)
    assert list(ax_n.get_lines()[0].get_ydata()) == tried
    assert f"fewer than {min_rounds} rounds" in fig._suptitle.get_text()


def test_wilson_interval_matches_scipy():
    from scipy.stats import binomtest

    from harness.tracking.conventions import depth_rows, wilson_interval

    for k, n in ((0, 5), (3, 7), (136, 165), (14, 14)):
        ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-9)
    assert wilson_interval(0, 0) is None
    rows = depth_rows({"acceptance_by_depth": [0.5, None], "reach_by_depth": [0.5, 0.0]})
    assert rows[0]["tried"] is None and rows[0]["acceptance_low"] is None and rows[1]["acceptance"] is None


def test_depths_no_round_tried_are_drawn_at_zero_not_at_a_made_up_count(tmp_path):
    from harness.tracking.report import plot_acceptance_by_depth
    from harness.tracking.store import aggregate

    root = tmp_path / "recs"
    shutil.copytree(fixture_run(1), root / "a")
    tried = fixture_record(1)["metrics"]["rounds_tried_by_depth"]
    assert 0 in tried  # the fixture run's deepest depths were never tried
    plot = plot_acceptance_by_depth(aggregate(root), {})
    ax_n = plot.figure.axes[2]
    (line,) = [ln for ln in ax_n.get_lines() if len(ln.get_ydata()) == len(tried)]
    assert list(line.get_ydata()) == tried and ax_n.get_yscale() == "symlog" and ax_n.get_ylim()[0] == 0


def test_speedup_vs_batch_is_not_drawn_empty_when_no_configuration_has_two_batch_sizes():
    from harness.tracking.report import plot_speedup_vs_batch

    df = pd.DataFrame(
        {
            "section": ["exact", "exact"],
            "run_id": ["r1", "r2"],
            "proposer": ["a", "b"],  # batch 1 for one proposer, batch 2 for the other: no series
            "topology": "t",
            "verifier": "greedy",
            "temperature": 0.0,
            "batch_size": [1, 2],
            "workload": "w",
            "model": "m",
            "speedup": [1.1, 1.2],
            "per_prompt": "[]",
        }
    )
    plot = plot_speedup_vs_batch(df, {})
    assert plot.figure is None and "no configuration was run at two batch sizes" in plot.note


def test_speedup_vs_batch_draws_one_line_per_configuration_and_repeats_without_a_line():
    """Runs of one arm at two topology.max_nodes were one series: a line zig-zagging through two
    points at each batch size, labelled "runs". Each configuration is its own line now, named by the
    option; repeats of one configuration (seeds) are points with no line through them."""
    from harness.tracking.report import plot_speedup_vs_batch

    df = pd.DataFrame(
        {
            "section": "exact",
            "run_id": ["r1", "r2", "r3", "r4"],
            "proposer": "prompt_lookup",
            "topology": "sequence",
            "verifier": "greedy",
            "temperature": 0.0,
            "batch_size": [1, 1, 2, 2],
            "workload": "w",
            "model": "m",
            "decode_speedup": [1.11, 0.91, 1.3, 1.0],
            "config.topology.max_nodes": [4, 8, 4, 8],
            "config.seed": 0,
            "per_prompt": "[]",
        }
    )
    plot = plot_speedup_vs_batch(df, {})
    ax = plot.figure.axes[0]
    lines = {c.get_label(): list(c.lines[0].get_ydata()) for c in ax.containers}
    assert lines == {"topology.max_nodes=4": [1.11, 1.3], "topology.max_nodes=8": [0.91, 1.0]}
    df["config.topology.max_nodes"], df["config.seed"] = 4, [0, 1, 0, 1]  # two seeds of one configuration
    ax = plot_speedup_vs_batch(df, {}).figure.axes[0]
    (series,) = ax.containers
    assert series.get_label() == "runs (repeats)" and series.lines[0].get_linestyle() == "None"


def test_speedup_vs_batch_never_joins_options_that_differ_only_from_one_batch_size_to_another():
    """topology.max_nodes 8 at batch 1 and 16 at batches 2 and 4: within each batch size the option
    is one value, yet the runs are two configurations. The batch-1 run is no point of the other
    configuration's line, and the line is named by the option; the batch size's own option
    (generation.batch_size) names nothing."""
    from harness.tracking.report import plot_speedup_vs_batch

    df = pd.DataFrame(
        {
            "section": "exact",
            "run_id": ["r1", "r2", "r3"],
            "proposer": "prompt_lookup",
            "topology": "sequence",
            "verifier": "greedy",
            "temperature": 0.0,
            "batch_size": [1, 2, 4],
            "workload": "w",
            "model": "m",
            "decode_speedup": [1.2, 0.9, 0.8],
            "config.topology.max_nodes": [8, 16, 16],
            "config.generation.batch_size": [1, 2, 4],
            "per_prompt": "[]",
        }
    )
    ax = plot_speedup_vs_batch(df, {}).figure.axes[0]
    (series,) = ax.containers
    assert series.get_label() == "topology.max_nodes=16"
    assert list(series.lines[0].get_xdata()) == [2, 4] and list(series.lines[0].get_ydata()) == [0.9, 0.8]
    plot = plot_speedup_vs_batch(df[df["batch_size"] < 4], {})  # one batch size per configuration: no line
    assert plot.figure is None and "no configuration was run at two batch sizes" in plot.note


def test_speedup_vs_batch_draws_each_section_as_its_own_series_with_its_marker_and_tag():
    """An exact run at batch 1 and an ungated run of the same configuration at batch 4 were one
    series: a line from one to the other with the exact runs' marker and no "[ungated]" in its label.
    A series is one section's now, drawn with that section's marker, line style and tag."""
    from harness.tracking.report import SECTION_STYLE, plot_speedup_vs_batch

    df = pd.DataFrame(
        {
            "section": ["exact", "exact", "ungated", "ungated"],
            "run_id": ["r1", "r2", "r3", "r4"],
            "proposer": "prompt_lookup",
            "topology": "sequence",
            "verifier": "greedy",
            "temperature": 0.0,
            "batch_size": [1, 4, 1, 4],
            "workload": "w",
            "model": "m",
            "decode_speedup": [1.1, 0.9, 1.2, 0.8],
            "per_prompt": "[]",
        }
    )
    ax = plot_speedup_vs_batch(df, {"sections": ["exact", "ungated"]}).figure.axes[0]
    series = {c.get_label(): c.lines[0] for c in ax.containers}
    tag = SECTION_STYLE["ungated"]["tag"]
    assert set(series) == {"runs", f"runs{tag}"}
    assert list(series["runs"].get_ydata()) == [1.1, 0.9] and list(series[f"runs{tag}"].get_ydata()) == [1.2, 0.8]
    for label, section in (("runs", "exact"), (f"runs{tag}", "ungated")):
        assert series[label].get_marker() == SECTION_STYLE[section]["marker"]
        assert series[label].get_linestyle() == SECTION_STYLE[section]["linestyle"]
    # one batch size per section: no series at all, never a line joining the two sections
    mixed = df[df["run_id"].isin(["r1", "r4"])]
    plot = plot_speedup_vs_batch(mixed, {"sections": ["exact", "ungated"]})
    assert plot.figure is None and "in one section" in plot.note


def test_the_frontier_and_ar_line_are_drawn_per_target_model_and_machine():
    """Runs of two target models timed on two machines shared one frontier (a line from one model's
    point to the other's) and one "AR ... ms/token (median, exact runs)" line, the median of two
    machines' AR times that neither measured. Each (model, machine, batch size) group has its own now,
    named."""
    from harness.tracking.report import plot_frontier

    df = _store_frame()
    runs = df[df["run_id"].isin([fixture_run_id(1), fixture_run_id(2), fixture_run_id(3)])].copy()
    other = runs["run_id"] == fixture_run_id(2)
    runs.loc[other, "model"] = "llama-7b"
    runs.loc[other, "hardware.device_name"] = "Other CPU"
    for column in ("time_per_committed_token_ms", "ar_time_per_token_ms"):
        runs.loc[other, column] = runs.loc[other, column] * 10
    ax = plot_frontier(runs, {}).figure.axes[0]
    fronts = {ln.get_label(): ln for ln in ax.get_lines() if ln.get_label().startswith("frontier")}
    big = "model=llama-7b, machine=cpu: Other CPU"
    tiny = "model=tiny, machine=cpu: AMD EPYC"
    assert set(fronts) == {
        f"frontier ({big}): no exact run of this group commits more in less time",
        f"frontier ({tiny}): no exact run of this group commits more in less time",
    }
    big_line = fronts[f"frontier ({big}): no exact run of this group commits more in less time"]
    (big_run,) = runs[other].itertuples()
    assert list(big_line.get_xdata()) == [big_run.mean_committed_per_round]  # its own point only
    ar_texts = sorted(t.get_text() for t in ax.texts if t.get_text().startswith("AR "))
    tiny_runs = runs[~other]
    assert ar_texts == sorted(
        [
            f"AR {big_run.ar_time_per_token_ms:.3g} ms/token (median, exact runs, {big}) ",
            f"AR {tiny_runs['ar_time_per_token_ms'].median():.3g} ms/token (median, exact runs, {tiny}) ",
        ]
    )
    # one model on one machine: one frontier and one AR line, unnamed, as before
    ax = plot_frontier(tiny_runs, {}).figure.axes[0]
    assert [ln.get_label() for ln in ax.get_lines() if ln.get_label().startswith("frontier")] == [
        "frontier: no exact run commits more in less time"
    ]
    assert [t.get_text() for t in ax.texts if t.get_text().startswith("AR ")] == [
        f"AR {tiny_runs['ar_time_per_token_ms'].median():.3g} ms/token (median, exact runs) "
    ]
    # one model on one machine at two batch sizes: a frontier each (a B=4 point joined B=1's frontier)
    batched = tiny_runs.copy()
    batched.loc[batched["run_id"] == fixture_run_id(3), "batch_size"] = 4
    ax = plot_frontier(batched, {}).figure.axes[0]
    assert sorted(ln.get_label() for ln in ax.get_lines() if ln.get_label().startswith("frontier")) == [
        "frontier (B=1): no exact run of this group commits more in less time",
        "frontier (B=4): no exact run of this group commits more in less time",
    ]


def test_a_reused_report_folder_keeps_no_plot_of_other_runs_and_a_run_folder_is_refused(tmp_path, capsys):
    """Plots an earlier report drew that this one does not are removed (other files are kept), a
    file of a plot's name that no report there drew is never replaced or removed unless
    overwrite=true (it was), and out= naming a run folder is refused with the folder untouched."""
    out = tmp_path / "report"
    out.mkdir()
    stale = out / "07_speedup_vs_batch.png"
    stale.write_bytes(PNG_MAGIC)
    (out / "report.md").write_text(
        "# Speculative decoding harness report\n\nRegenerated from 2 stored run records\n\n"
        "![Speedup vs batch](07_speedup_vs_batch.png)\n"
    )  # an earlier report that drew it
    mine = out / "01_my_own_figure.png"
    mine.write_bytes(PNG_MAGIC)
    one = tmp_path / "one"
    shutil.copytree(fixture_run(1), one / fixture_run(1).name)
    assert main([str(one), f"out={out}"]) == 0
    capsys.readouterr()
    text = (out / "report.md").read_text()
    drawn = {p.name for p in out.glob("*.png")}
    assert not stale.exists() and mine.exists()
    assert all(name in text for name in drawn - {mine.name}) and mine.name not in text
    # the user's own file under a plot's name, in a folder whose report never drew it: kept
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "04_round_cost.png").write_text("user image")
    assert main([str(one), f"out={theirs}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"harness report: refused: out={theirs} holds 04_round_cost.png, which no report of this command there "
        "drew, and the report draws a plot of that name; give another folder or overwrite=true (harness report "
        "--help shows the usage)"
    ]
    assert sorted(p.name for p in theirs.iterdir()) == ["04_round_cost.png"]
    assert (theirs / "04_round_cost.png").read_text() == "user image"
    assert main([str(one), f"out={theirs}", "overwrite=true"]) == 0
    capsys.readouterr()
    # an empty out= named the current folder
    assert main([str(one), "out="]) == 2
    assert capsys.readouterr().err.strip() == (
        "harness report: refused: out= is empty; give a value or leave the option out (harness report --help shows "
        "the usage)"
    )
    run = one / fixture_run(1).name
    before = sorted(p.name for p in run.iterdir())
    assert main([str(one), f"out={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"harness report: refused: out={run} is a run folder (it holds record.json); write the report elsewhere "
        "(harness report --help shows the usage)"
    ]
    assert sorted(p.name for p in run.iterdir()) == before
    # a report.md this command did not write is never replaced unless overwrite=true; its own is
    (tmp_path / "paper").mkdir()
    draft = tmp_path / "paper" / "report.md"
    draft.write_text("# My paper draft\nimportant text\n")
    assert main([str(one), f"out={draft.parent}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"harness report: refused: out={draft.parent} holds a report.md this command did not write; give another "
        "folder or overwrite=true (harness report --help shows the usage)"
    ]
    assert draft.read_text() == "# My paper draft\nimportant text\n"
    assert main([str(one), f"out={out}"]) == 0  # its own report: replaced
    assert main([str(one), f"out={draft.parent}", "overwrite=true"]) == 0
    assert "Regenerated from 1 stored run records" in draft.read_text()
    assert main([str(one), f"out={out}", "overwrite=maybe"]) == 2
    capsys.readouterr()
    (tmp_path / "odd" / "report.md").mkdir(parents=True)  # overwrite=true could not replace a folder
    assert main([str(one), f"out={tmp_path / 'odd'}", "overwrite=true"]) == 2
    assert f"out={tmp_path / 'odd'} holds a folder named report.md; give another folder" in capsys.readouterr().err


def test_a_sweep_folders_jobs_without_a_record_are_listed(tmp_path, capsys):
    """A sweep folder's failures file names the jobs that wrote no record: the report lists them
    (refused or failed, the stage, the error) after its runs; a folder without one lists none."""
    root = tmp_path / "sweep"
    shutil.copytree(fixture_run(1), root / fixture_run(1).name)
    assert main([str(root), f"out={tmp_path / 'r0'}"]) == 0
    assert "Jobs without a record" not in (tmp_path / "r0" / "report.md").read_text()
    failure = {
        "job": "proposer=prompt_lookup,verifier=rejection",
        "stage": "setup",
        "refused": True,
        "error": {"type": "NegotiationError", "message": "verifier 'rejection' needs temperature > 0\n(more)"},
    }
    (root / "failures.jsonl").write_text(json.dumps(failure) + "\n")
    assert main([str(root), f"out={tmp_path / 'r1'}"]) == 0
    capsys.readouterr()
    text = (tmp_path / "r1" / "report.md").read_text()
    assert "## Jobs without a record" in text and "1 job(s) of this sweep wrote no record" in text
    assert (
        "| `proposer=prompt_lookup,verifier=rejection` | refused | setup | NegotiationError: verifier 'rejection' "
        "needs temperature > 0 (more) |"
    ) in text

    # a report over the folder above the sweep lists the sweep's failed jobs too, by their path
    assert main([str(tmp_path), f"out={tmp_path / 'r2'}"]) == 0
    text = (tmp_path / "r2" / "report.md").read_text()
    assert "| `sweep/proposer=prompt_lookup,verifier=rejection` | refused | setup |" in text

    # a store lists its own sweep's failed jobs, not those of sweeps beside it under its folder
    from harness.tracking.store import rebuild_store

    rebuild_store(root, root / "store.parquet")
    assert main([str(root / "store.parquet"), f"out={tmp_path / 'r3'}"]) == 0
    assert "1 job(s) of this sweep wrote no record" in (tmp_path / "r3" / "report.md").read_text()
    rebuild_store(root, tmp_path / "elsewhere.parquet")
    assert main([str(tmp_path / "elsewhere.parquet"), f"out={tmp_path / 'r4'}"]) == 0
    assert "Jobs without a record" not in (tmp_path / "r4" / "report.md").read_text()


def test_records_left_out_for_their_outputs_are_named_in_the_report_and_in_an_empty_result(tmp_path, capsys, caplog):
    """A record whose bound outputs are gone is no complete job: the report says which and why
    (not only a warning on stderr), and a folder holding only such records says so rather than
    'no run records'."""
    from harness.tracking.compare import main as compare_main

    root = tmp_path / "runs"
    for k in (1, 2):
        shutil.copytree(fixture_run(k), root / fixture_run(k).name)
    (root / fixture_run(2).name / "outputs.jsonl").unlink()
    assert main([str(root), f"out={tmp_path / 'r'}"]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "Regenerated from 1 stored run records" in text
    assert "## Records left out" in text and f"| `{fixture_run(2).name}` | its outputs.jsonl is missing |" in text
    (root / fixture_run(1).name / "outputs.jsonl").unlink()
    capsys.readouterr()
    for command in (main, compare_main):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert command([str(root)]) == 2
        assert caplog.text == ""  # the refusal names them: no warning per record before it
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        err = lines[0]
        assert f"no complete run records under {root}: 2 record(s) left out because their outputs" in err
        assert f"{fixture_run(1).name}: its outputs.jsonl is missing" in err


def test_the_round_cost_bar_reaches_the_batch_round_time_and_ends_before_its_mark_exactly_when_faster():
    """Each bar (the timed stages plus the time between them) is the run's decode time per batch
    round, and its mark what AR takes for the tokens one batch round commits: the bar ends before
    the mark exactly when the record's decode speedup is above 1, at batch 1 and above."""
    df = _store_frame()
    runs = df[df["section"].isin(["exact", "heuristic"])]
    ax = PLOTS["round_cost"](runs, {}).figure.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    from harness.tracking.report import TICK_ROOM, plot_labels

    labels = plot_labels(runs, TICK_ROOM).text
    totals = dict.fromkeys(names, 0.0)
    for bar in ax.patches:
        y = bar.get_y() + bar.get_height() / 2
        totals[names[round(y)]] += bar.get_width()
    (marks,) = [c for c in ax.collections if c.get_label().startswith("break-even")]
    mark_at = {names[round(y)]: x for x, y in marks.get_offsets()}
    assert {int(b) for b in runs["batch_size"]} >= {1, 2, 4}
    for _, run in runs.iterrows():
        name = labels[run["run_id"]]
        per_round = run["committed_tokens"] / run["batch_rounds"]
        assert totals[name] == pytest.approx(run["time_per_committed_token_ms"] * per_round, rel=1e-9)
        assert mark_at[name] == pytest.approx(run["ar_time_per_token_ms"] * per_round, rel=1e-9)
        assert (totals[name] < mark_at[name]) == (run["decode_speedup"] > 1), name


def test_speedup_vs_batch_draws_the_decode_speedup_with_its_own_interval():
    """The points are the records' decode speedups; at batch 1 the interval is the bootstrap of that
    statistic over the run's prompts (their batches' decode times, the times the record's point
    divides: the point lies inside), never the end-to-end speedup's nor one of the requests' latencies."""
    from harness.tracking.compare import run_speedups

    df = _store_frame()
    runs = df[(df["proposer"] == "draft_model") & (df["verifier"] == "greedy")]
    ax = PLOTS["speedup_vs_batch"](runs, {}).figure.axes[0]
    (line,) = ax.get_lines()[:1]
    by_batch = dict(zip(line.get_xdata(), line.get_ydata(), strict=True))
    for _, run in runs.iterrows():
        assert by_batch[run["batch_size"]] == pytest.approx(run["decode_speedup"])
    (one,) = [r for _, r in runs.iterrows() if r["batch_size"] == 1]
    est, _ = run_speedups(json.loads(one["per_prompt"]), one)
    assert est.value == pytest.approx(one["decode_speedup"], rel=1e-12)  # the record's point, the same columns
    drawn = [seg for coll in ax.collections for seg in coll.get_segments() if len(seg)]
    assert all(abs(seg[0][0] - 1.0) < 1e-9 for seg in drawn)  # a bar at batch size 1 only
    (seg,) = drawn
    assert (seg[0][1], seg[1][1]) == (pytest.approx(est.ci_low), pytest.approx(est.ci_high))
    assert seg[0][1] < one["decode_speedup"] < seg[1][1]
    assert "decode speedup" in ax.get_ylabel()


def test_the_category_plot_draws_the_report_table_s_intervals_and_by_groups_the_first_plot():
    from harness.tracking.compare import leaderboard

    df = _store_frame()
    exact = df[df["section"] == "exact"]
    ax = PLOTS["speedup_by_category"](exact, {"by": "topology"}).figure.axes[0]
    columns, rows = leaderboard(exact, by="topology")  # the table's resamples
    drawn = sorted((round(seg[0][1], 9), round(seg[1][1], 9)) for coll in ax.collections for seg in coll.get_segments())
    table = sorted(
        (round(c.speedup.ci_low, 9), round(c.speedup.ci_high, 9))
        for r in rows
        for c in r.cells.values()
        if c.speedup.ci_low is not None
    )
    assert table and drawn == table  # a one-prompt cell had a whisker of zero width, which reads as precise
    # an arm pooling a batch of all its prompts with runs at batch 1 is one resampling unit: no interval
    bare_exact = sum(c.speedup.value is not None and c.speedup.ci_low is None for r in rows for c in r.cells.values())
    assert bare_exact and f"; {bare_exact} bars without one: a single prompt or batch)" in ax.get_title()
    one = exact.copy()  # every run cut to its first prompt: no interval anywhere, and the title says so
    one["per_prompt"] = one["per_prompt"].map(lambda s: json.dumps(json.loads(s)[:1]))
    ax_one = PLOTS["speedup_by_category"](one, {"by": "topology"}).figure.axes[0]
    _, rows_one = leaderboard(one, by="topology")
    cells = [c.speedup for r in rows_one for c in r.cells.values() if c.speedup.value is not None]
    bare = sum(c.ci_low is None for c in cells)
    drawn = [seg for coll in ax_one.collections for seg in coll.get_segments()]
    assert bare and len(drawn) == len(cells) - bare  # no whisker on a bar without an interval
    assert f"; {bare} bars without one: a single prompt or batch)" in ax_one.get_title()
    ax1 = PLOTS["speedup_by_proposer_workload"](exact, {"by": "topology"}).figure.axes[0]
    assert ax1.get_xlabel() == "topology"
    # an error bar only where a speedup has an interval (a one-prompt bar had a zero-width one), and
    # each category's bars a colour of their own, none the grey of the "all" bars
    from harness.tracking.compare import ALL, compare, pooled

    rows_ = [r for r in compare(exact, by="topology") if r.section == "exact"]
    marked = {r.arm: r.arm + "*" if pooled(r.varying) else r.arm for r in rows_ if r.category == ALL}
    assert [t.get_text() for t in ax1.get_xticklabels()] == [marked[t] for t in sorted(set(exact["topology"]))]
    with_ci = sorted(
        (round(r.speedup.ci_low, 9), round(r.speedup.ci_high, 9)) for r in rows_ if r.speedup.ci_low is not None
    )
    bars = sorted((round(seg[0][1], 9), round(seg[1][1], 9)) for c in ax1.collections for seg in c.get_segments())
    assert bars == with_ci
    bare = sum(r.speedup.value is not None and r.speedup.ci_low is None for r in rows_)
    assert ("without one: a single prompt or batch" in ax1.get_title()) == (bare > 0)
    colours = {
        c.get_label(): tuple(c.patches[0].get_facecolor()) for c in ax1.containers if getattr(c, "patches", None)
    }
    assert len(colours) > 2 and len(set(colours.values())) == len(colours)
    assert colours["category: all"][:3] == (0.45, 0.45, 0.45)


def test_markdown_tables_escape_pipes_in_the_header_too():
    from harness.tracking.report import md_table

    table = md_table(["proposer", "a|b"], [["x", "c|d"]])
    assert table.splitlines()[0] == "| proposer | a\\|b |"
    assert table.splitlines()[2] == "| x | c\\|d |"


def test_no_two_runs_share_a_colour_in_the_per_run_plots():
    """Past ten runs the colour cycle repeated: runs 1 and 11 were drawn alike in the acceptance and
    accepted-length plots."""
    from matplotlib.colors import to_rgba

    from harness.tracking.report import run_colour

    for n in (3, 14, 30):
        colours = {to_rgba(run_colour(k, n)) for k in range(n)}
        assert len(colours) == n


def test_cpu_budget_artifact_runs_are_drawn_in_the_per_run_plots_with_their_own_tag(tmp_path, capsys):
    """Runs of artifacts trained on a CPU budget (medusa, clover, early exit here) were left out of the
    acceptance, accepted-length, round-cost and KV plots, which said "no runs" (and "no record carries
    max_nodes") beside records that had both. The recipe promises every section drawn with its own
    marker and tag: they are now, and a plot with nothing to draw names the sections it looked for."""
    import json

    from harness.tracking.report import _no_runs, read_results

    root = tmp_path / "runs"
    run = root / "budget"
    shutil.copytree(fixture_run(1), run)
    record = json.loads((run / "record.json").read_text())
    record["metrics"]["cpu_budget_artifact"] = True
    (run / "record.json").write_text(json.dumps(record))
    out = tmp_path / "rep"
    assert main([str(root), f"out={out}"]) == 0
    capsys.readouterr()
    text = (out / "report.md").read_text()
    for heading in ("Acceptance by depth", "Round-cost ledger", "Temporary KV bytes"):
        section = text[text.index(f"### {heading}") :].split("### ")[1]
        assert "Not drawn" not in section and ".png)" in section, section
    df, _ = read_results(str(root))
    assert set(df["section"]) == {"cpu_budget_artifact"}
    assert (
        _no_runs(df, {"sections": ["exact"]}, ())
        == "no runs of sections ['exact'] (the runs here are cpu_budget_artifact)"
    )


def test_an_interrupted_report_leaves_no_plot_of_its_own_behind(tmp_path, monkeypatch):
    """Plots are drawn before report.md is written: an interrupt between left plots no report linked,
    and the next report into the folder was refused as if they were the user's."""
    from harness.tracking import report

    one = tmp_path / "one"
    shutil.copytree(fixture_run(1), one / fixture_run(1).name)
    out = tmp_path / "rep"

    def interrupted(df, spec):
        raise KeyboardInterrupt

    monkeypatch.setitem(report.PLOTS, "frontier", interrupted)  # drawn after the first plots
    with pytest.raises(KeyboardInterrupt):
        main([str(one), f"out={out}"])
    assert not list(out.glob("*.png")) and not (out / "report.md").exists()
    monkeypatch.undo()
    assert main([str(one), f"out={out}"]) == 0 and (out / "report.md").is_file()


def test_an_interrupted_report_into_a_folder_of_an_earlier_one_leaves_that_report_whole(tmp_path, monkeypatch):
    """A second report interrupted while drawing its third plot had already replaced the first two
    plots of the earlier report, whose report.md then showed other runs' figures under its own
    tables. Plots are drawn into temporary files and put in place with report.md, together, only
    once all are drawn: the earlier report and every plot of it stay as they were."""
    import hashlib

    from harness.tracking import report

    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(fixture_run(1), first / "a")
    shutil.copytree(fixture_run(3), first / "b")
    shutil.copytree(fixture_run(2), second / "c")
    shutil.copytree(fixture_run(9), second / "d")
    out = tmp_path / "rep"
    assert main([str(first), f"out={out}"]) == 0

    def snapshot():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}

    before = snapshot()
    assert "report.md" in before and "01_speedup_by_proposer_workload.png" in before

    def interrupted(df, spec):
        raise KeyboardInterrupt

    monkeypatch.setitem(report.PLOTS, "accepted_length_hist", interrupted)  # the third plot
    with pytest.raises(KeyboardInterrupt):
        main([str(second), f"out={out}"])
    assert snapshot() == before  # no hidden temporary file left either
    # an interrupt while the files are put in place puts every earlier one back
    monkeypatch.undo()
    real_replace, calls = report.os.replace, []

    def replace_then_interrupt(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(report.os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        main([str(second), f"out={out}"])
    monkeypatch.undo()
    assert snapshot() == before
    assert main([str(second), f"out={out}"]) == 0
    assert snapshot()["report.md"] != before["report.md"] and str(second) in (out / "report.md").read_text()


def test_runs_with_long_labels_are_drawn_as_keys_spelled_out_under_the_plot():
    """A dozen arms that differ in several options made legends wider than the figure: the axes
    collapsed (matplotlib warned that constrained layout was not applied), tick labels were cut and
    panel titles overlapped. Such runs are drawn as R1, R2, ... with a key under the plot."""
    import warnings

    from harness.tracking.report import LEGEND_ROOM, TICK_ROOM, plot_labels, run_labels

    first = _store_frame()
    first = first[first["run_id"] == fixture_run_id(1)]
    runs = pd.concat(
        [
            first.assign(
                run_id=f"r{i}",
                **{
                    "config.topology.max_nodes": 4 * (i + 1),
                    "config.proposer.max_ngram": i + 1,
                    "config.proposer.max_matches": 2 * i + 1,
                    "config.generation.max_new_tokens": 16 + i,
                },
            )
            for i in range(12)
        ],
        ignore_index=True,
    )
    full = run_labels(runs)
    assert min(len(label) for label in full.values()) > LEGEND_ROOM
    labels = plot_labels(runs, LEGEND_ROOM)
    assert [labels.text[f"r{i}"] for i in range(12)] == [f"R{i}" for i in range(1, 13)]
    for plot in ("acceptance_by_depth", "accepted_length_hist", "round_cost", "frontier"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a collapsed layout warns when the figure is drawn
            fig = PLOTS[plot](runs, {}).figure
            fig.savefig(io.BytesIO(), format="png")  # lays the figure out as the report does
        (key,) = [legend for legend in fig.legends if legend.get_title().get_text() == "runs"]
        text = "".join("".join(t.get_text() for t in key.get_texts()).split())  # the key's wrapping undone
        for i in range(12):  # each full label is in the key after its own key
            assert f"R{i + 1}:" + "".join(full[f"r{i}"].split()) + "R" in text + "R", (plot, i)
        for ax in fig.axes:  # nothing drawn is a whole label
            drawn = [t.get_text() for t in ax.get_yticklabels() + ax.texts]
            assert not any(full[f"r{i}"] in t for t in drawn for i in range(12)), plot
        key_box = key.get_window_extent()
        axes_box = fig.axes[0].get_window_extent()
        assert key_box.y1 <= axes_box.y0 and key_box.x1 <= fig.bbox.x1 + 1, plot  # under the axes, inside the figure
    cost = PLOTS["round_cost"](runs, {}).figure.axes[0]
    assert [t.get_text() for t in cost.get_yticklabels()] == [f"R{i}" for i in range(1, 13)]
    # short labels, and one run's label, are drawn whole, with no key
    df = _store_frame()
    b1_greedy = df[(df["batch_size"] == 1) & (df["verifier"] == "greedy") & (df["section"] == "exact")]
    for few in (first, b1_greedy):
        short = plot_labels(few, TICK_ROOM)
        assert not short.key and short.text == run_labels(few)
    assert len(b1_greedy) == 3


def test_the_t_profile_plot_draws_each_runs_roofline_floor_where_the_record_has_one():
    df = _store_frame()
    run = df[df["run_id"] == fixture_run_id(11)]  # the adaptive prompt lookup run: a measured t(n)
    profile = fixture_record(11)["t_profile"]
    assert len(profile["floor_ms"]) == len(profile["n"])  # the runner writes each point's floor
    fig = PLOTS["t_profile"](run, {}).figure
    lines = fig.axes[0].get_lines()
    drawn = [ln for ln in lines if len(ln.get_xdata())]
    assert [list(ln.get_ydata()) for ln in drawn] == [profile["t"], profile["floor_ms"]]
    assert drawn[1].get_linestyle() == "--" and drawn[1].get_color() == drawn[0].get_color()
    older = run.assign(t_profile=[json.dumps({"n": profile["n"], "t": profile["t"]})])  # a record without floors
    lines = PLOTS["t_profile"](older, {}).figure.axes[0].get_lines()
    assert [list(ln.get_ydata()) for ln in lines if len(ln.get_xdata())] == [profile["t"]]


def test_speedup_vs_batch_draws_no_bar_where_there_is_no_interval():
    """A point without an interval (a batched run, or a run of one prompt) was drawn with a bar of no
    width, as if it were exact."""
    from harness.tracking.report import plot_speedup_vs_batch

    df = pd.DataFrame(
        {
            "section": ["exact", "exact"],
            "run_id": ["r1", "r2"],
            "proposer": "a",
            "topology": "t",
            "verifier": "greedy",
            "temperature": 0.0,
            "batch_size": [1, 2],
            "workload": "w",
            "model": "m",
            "speedup": [1.1, 1.2],
            "decode_speedup": [1.3, 1.4],
            "per_prompt": "[]",
        }
    )
    plot = plot_speedup_vs_batch(df, {})
    (container,) = plot.figure.axes[0].containers
    (bars,) = container.lines[2]
    assert [seg for seg in bars.get_segments() if len(seg)] == []


def test_the_temp_kv_plot_sets_the_measured_peak_beside_the_budget_not_beside_a_copy_of_itself():
    """The plot's "formula" markers were the record's temp_kv_bytes_formula, a copy of the measured
    peak: they sat on the measured points whatever the run did. The markers are the budget now,
    B x the rows a round can verify x KV bytes per token, which the peak stays at or under."""
    from harness.tracking.report import plot_temp_kv_vs_rows
    from harness.tracking.store import aggregate

    df = aggregate(FIXTURES)
    ax = plot_temp_kv_vs_rows(df, {}).figure.axes[0]
    mib = 1024.0 * 1024.0
    drawn = {tuple(c.get_offsets()[:, 1].round(9)) for c in ax.collections if len(c.get_offsets())}
    for _, group in df.groupby(["section", "batch_size"], sort=True):
        assert tuple((group["temp_kv_bytes_budget_formula"] / mib).round(9)) in drawn
        assert tuple((group["temp_kv_bytes_peak"] / mib).round(9)) in drawn
    assert (df["temp_kv_bytes_peak"] <= df["temp_kv_bytes_budget_formula"]).all()
    assert (df["temp_kv_bytes_peak"] < df["temp_kv_bytes_budget_formula"]).any()  # markers apart from the points
    labels = ax.get_legend_handles_labels()[1]
    assert "budget: B x rows x KV bytes/token" in labels
    # ungated, heuristic and CPU-budget runs are drawn apart, with their own marker and tag
    assert {"exact", "ungated", "heuristic", "cpu_budget_artifact"} <= set(df["section"])
    assert "measured peak, B=1" in labels and "measured peak, B=1 [CPU-budget artifact]" in labels
    assert "measured peak, B=1 [heuristic, exact=false]" in labels
    assert "measured peak, B=1 [ungated: a gate was skipped]" in labels


def test_the_temp_kv_plot_places_a_run_at_the_rows_its_rounds_can_verify_not_at_max_nodes():
    """A chain of max_depth 8 with topology.max_nodes=1900 verifies 8 rows a round, and its budget is
    sized from 8: the plot placed it at 1900 rows, far from its budget's own sizing."""
    from harness.tracking.report import plot_temp_kv_vs_rows
    from harness.tracking.store import aggregate

    df = aggregate(FIXTURES)
    chain = df.index[df["config.topology.name"] == "sequence"][0]
    df.loc[chain, "config.topology.max_nodes"] = 1900
    ax = plot_temp_kv_vs_rows(df, {}).figure.axes[0]
    xs = {float(x) for c in ax.collections for x in c.get_offsets()[:, 0]}
    assert 1900.0 not in xs and float(df.loc[chain, "context.tree_rows"]) in xs
    assert "candidate rows a round can verify" in ax.get_xlabel()
    older = df.drop(columns=["context.tree_rows"])  # a record that does not say: its max_nodes
    xs = {float(x) for c in plot_temp_kv_vs_rows(older, {}).figure.axes[0].collections for x in c.get_offsets()[:, 0]}
    assert 1900.0 in xs


def test_plots_and_the_runs_table_name_the_machine_when_the_runs_span_machines():
    """A CPU run at batch 1 and an H100 run at batch 4 of one configuration were joined as one line of
    the speedup-vs-batch plot, two runs of one arm on two machines were labelled as repeats (#1, #2),
    and the Runs table did not say which machine timed which run. Each machine is its own series and
    names its runs, and the Runs table has a machine column when the runs span machines."""
    from harness.tracking.report import _runs_section, plot_speedup_vs_batch, run_labels

    df = pd.DataFrame(
        {
            "section": "exact",
            "run_id": ["r1", "r2", "r3", "r4"],
            "proposer": "prompt_lookup",
            "topology": "sequence",
            "verifier": "greedy",
            "temperature": 0.0,
            "batch_size": [1, 4, 1, 4],
            "workload": "w",
            "model": "m",
            "decode_speedup": [1.1, 0.9, 1.4, 1.6],
            "per_prompt": "[]",
            "hardware.device": ["cpu", "cuda:0", "cpu", "cuda:0"],
            "hardware.device_name": ["AMD EPYC", "NVIDIA H100", "AMD EPYC", "NVIDIA H100"],
        }
    )
    across = df[df["run_id"].isin(["r1", "r2"])]  # B=1 on the CPU, B=4 on the H100: no line to draw
    plot = plot_speedup_vs_batch(across, {})
    assert plot.figure is None and "two batch sizes" in plot.note
    df["hardware.device"] = ["cpu", "cpu", "cuda:0", "cuda:0"]
    df["hardware.device_name"] = ["AMD EPYC", "AMD EPYC", "NVIDIA H100", "NVIDIA H100"]
    ax = plot_speedup_vs_batch(df, {}).figure.axes[0]
    lines = {c.get_label(): list(c.lines[0].get_ydata()) for c in ax.containers}
    assert lines == {"machine=cpu: AMD EPYC": [1.1, 0.9], "machine=cuda: NVIDIA H100": [1.4, 1.6]}
    one_arm = df[df["batch_size"] == 1]
    assert run_labels(one_arm) == {
        "r1": "prompt_lookup-sequence-greedy-T0-B1-w/machine=cpu: AMD EPYC",
        "r3": "prompt_lookup-sequence-greedy-T0-B1-w/machine=cuda: NVIDIA H100",
    }
    table = "\n".join(_runs_section(one_arm))
    assert "| run_id | proposer |" in table and "| machine |" in table
    assert "| r1 |" in table and "| cpu: AMD EPYC |" in table and "| cuda: NVIDIA H100 |" in table
    same = one_arm.assign(**{"hardware.device": "cpu", "hardware.device_name": "AMD EPYC"})
    assert "machine" not in "\n".join(_runs_section(same))  # one machine: no column, no label piece
    assert sorted(run_labels(same).values()) == [
        "prompt_lookup-sequence-greedy-T0-B1-w #1",
        "prompt_lookup-sequence-greedy-T0-B1-w #2",
    ]


def test_a_report_is_never_written_inside_a_run_folder(tmp_path, capsys):
    """``out=`` below a run folder was accepted (only the run folder itself was refused), and a report of
    a run folder went into ``<run>/report`` by default: files inside a run folder no run wrote. Such an
    out= is refused, and a run folder's report goes beside it, to ``<run>-report``."""
    root = tmp_path / "runs"
    run = root / fixture_run(1).name
    shutil.copytree(fixture_run(1), run)
    before = sorted(p.name for p in run.iterdir())
    inside = run / "report"
    assert main([str(run), f"out={inside}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"harness report: refused: out={inside} is inside the run folder {run.resolve()}: write the report outside "
        "any run folder (harness report --help shows the usage)"
    ]
    assert sorted(p.name for p in run.iterdir()) == before
    assert main([str(run)]) == 0
    beside = root.resolve() / f"{run.name}-report"
    assert capsys.readouterr().out.strip() == f"wrote {beside / 'report.md'}"
    assert sorted(p.name for p in run.iterdir()) == before
    assert sorted(p.name for p in root.iterdir()) == sorted([run.name, beside.name])
    # a store built inside a run folder: its report goes beside that run folder too
    from harness.tracking.store import rebuild_store

    rebuild_store(run)
    assert main([str(run / "store.parquet")]) == 0
    assert f"under `{run / 'store.parquet'}`" in (beside / "report.md").read_text()
    assert sorted(p.name for p in run.iterdir()) == sorted([*before, "store.parquet"])


def test_a_report_of_an_interrupted_sweep_names_the_jobs_that_never_started(tmp_path, capsys):
    """A launch cut short recorded the jobs it never started only in its summary.json: a report (or a
    comparison) of the sweep read afterwards counted the jobs that ran and said nothing of the others.
    They are in the sweep's failures file now, at stage "not started", and listed as such."""
    from harness import sweep
    from harness.tracking.compare import main as compare_main

    root = tmp_path / "sweep"
    shutil.copytree(fixture_run(1), root / "seed=1")
    (root / "launch.json").write_text(
        json.dumps({"launch_id": "L1", "planned_jobs": [["seed=1"], ["seed=2"], ["seed=3"]]})
    )
    status = {"job": "seed=1", "num": 0, "overrides": ["seed=1"], "launch_id": "L1", "status": "ran"}
    (root / "seed=1" / "job_status.json").write_text(json.dumps(status))
    summary = sweep.finish_sweep(root, launch_id="L1", stopped_by=sweep.INTERRUPTED)
    assert summary.not_started == ["seed=2", "seed=3"] and not summary.failed
    failures = [json.loads(line) for line in (root / "failures.jsonl").read_text().splitlines()]
    assert [(f["job"], f["overrides"], f["stage"], f["refused"]) for f in failures] == [
        ("seed=2", ["seed=2"], "not started", False),
        ("seed=3", ["seed=3"], "not started", False),
    ]
    assert main([summary.store, f"out={tmp_path / 'r'}"]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "2 job(s) of this sweep wrote no record" in text
    assert "| `seed=2` | not started | not started | NotStarted: the launch stopped before this job started" in text
    capsys.readouterr()
    assert compare_main([summary.store, "resamples=50"]) == 0
    out = capsys.readouterr().out
    assert (
        "note: 2 job(s) wrote no record (failures.jsonl)" in out
        and ": seed=2 (not started); seed=3 (not started)\n" in out
    )


def test_a_recipe_comparing_by_batch_size_draws_its_table_with_an_ungated_heuristic_run(tmp_path, capsys):
    """A recipe's ``compare: {by: batch_size}`` printed "_comparison not available: invalid literal for
    int()_" when an ungated run was also heuristic (its arm labelled ``1 [heuristic, exact=false]``)."""
    root = tmp_path / "runs"
    for n in (1, 8):
        shutil.copytree(fixture_run(n), root / fixture_run(n).name)
    run = root / "ungated"
    shutil.copytree(fixture_run(10), run)  # heuristic (typical acceptance); its gates skipped: ungated too
    record = json.loads((run / "record.json").read_text())
    record["gates"]["oracle"] = {**record["gates"]["oracle"], "status": "skipped", "override": "gates.oracle=false"}
    record["gated"] = False
    (run / "record.json").write_text(json.dumps(record))
    recipe = tmp_path / "bs.yaml"
    recipe.write_text("compare: {by: batch_size}\nplots: []\n")
    assert main([str(root), f"out={tmp_path / 'r'}", f"recipe={recipe}"]) == 0
    capsys.readouterr()
    text = (tmp_path / "r" / "report.md").read_text()
    assert "not available" not in text
    assert "| 1 [heuristic, exact=false] | all |" in text and "| 4 | all |" in text


def test_the_report_s_table_and_plot_draw_the_same_interval_beside_an_older_record():
    """An older record without prompt fingerprints in another section switched the table's pairing key
    (the table compares every section; the plot the exact runs only), and with it the order in which the
    seeded bootstrap drew the prompts: the table's interval and the plot's error bar differed."""
    from harness.tracking.compare import compare
    from harness.tracking.report import _compare_section

    df = _store_frame()
    exact = df[df["run_id"] == fixture_run_id(1)].copy()

    def twelve(text: str) -> str:  # ids whose order differs between "p1#<sha>" and "p1@<source>"
        prompts = json.loads(text)
        return json.dumps(
            [
                {**p, "prompt_id": f"p{i}", "prompt_sha256": f"{i:064d}", "spec_decode_ms": p["spec_decode_ms"] * i}
                for i, p in enumerate((prompts * 3)[:12], 1)
            ]
        )

    exact["per_prompt"] = exact["per_prompt"].map(twelve)
    older = df[df["run_id"] == fixture_run_id(10)].copy()
    older["per_prompt"] = older["per_prompt"].map(
        lambda s: json.dumps([{k: v for k, v in p.items() if k != "prompt_sha256"} for p in json.loads(s)])
    )
    both = pd.concat([exact, older], ignore_index=True)
    ax = PLOTS["speedup_by_proposer_workload"](both, {}).figure.axes[0]
    drawn = sorted((round(s[0][1], 9), round(s[1][1], 9)) for c in ax.collections for s in c.get_segments())
    rows = [r for r in compare(both) if r.section == "exact" and r.speedup.ci_low is not None]
    assert drawn and drawn == sorted((round(r.speedup.ci_low, 9), round(r.speedup.ci_high, 9)) for r in rows)
    (line,) = [ln for ln in _compare_section(both, {"by": "proposer"}) if "| prompt_lookup | all |" in ln]
    (row,) = [r for r in rows if r.category == "all"]
    assert f"| {row.speedup.fmt(3)} |" in line


def test_the_bar_plots_draw_every_section_the_recipe_names_each_arm_tagged_with_its_section():
    """Both bar plots drew the first of a recipe's sections only: ``sections: [exact, heuristic]``
    left the heuristic runs out without a word. Each named section's arms are drawn, tagged."""
    from harness.tracking.compare import ALL, compare, leaderboard, pooled
    from harness.tracking.report import SECTION_STYLE

    df = _store_frame()
    assert {"exact", "heuristic"} <= set(df["section"])
    tag = SECTION_STYLE["heuristic"]["tag"]
    spec = {"sections": ["heuristic", "exact"]}
    ax = PLOTS["speedup_by_proposer_workload"](df, spec).figure.axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    rows = [r for r in compare(df) if r.section in ("exact", "heuristic") and r.category == ALL]
    star = {(r.section, r.arm): "*" if pooled(r.varying) else "" for r in rows}  # an arm pooling other settings
    exact_arms = sorted(r.arm + star[(r.section, r.arm)] for r in rows if r.section == "exact")
    heuristic_arms = sorted(r.arm + star[(r.section, r.arm)] for r in rows if r.section == "heuristic")
    assert heuristic_arms and ticks == exact_arms + [a + tag for a in heuristic_arms]
    assert "(exact, heuristic runs;" in ax.get_title()
    # one section named: the arms untagged, as before
    only = PLOTS["speedup_by_proposer_workload"](df, {"sections": ["heuristic"]}).figure.axes[0]
    assert [t.get_text() for t in only.get_xticklabels()] == heuristic_arms
    ax = PLOTS["speedup_by_category"](df, spec).figure.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    _, board = leaderboard(df[df["section"].isin(["exact", "heuristic"])])
    marked = {(r.section, r.arm): r.arm + ("*" if pooled(r.varying) else "") for r in board}
    assert labels == [f"proposer: {marked[('exact', r.arm)]}" for r in board if r.section == "exact"] + [
        f"proposer: {marked[('heuristic', r.arm)]}{tag}" for r in board if r.section == "heuristic"
    ]
    assert any(tag in label for label in labels) and "(exact, heuristic runs;" in ax.get_title()


def _other_code_prompts(df: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """``df`` with the code prompts of run ``run_id`` replaced by other texts of the same ids."""

    def other(text: str) -> str:
        prompts = json.loads(text)
        return json.dumps(
            [
                {**p, "prompt_sha256": "deadbeef" + p["prompt_sha256"][8:]} if p["category"] == "code" else p
                for p in prompts
            ]
        )

    out = df.copy()
    hit = out["run_id"] == run_id
    out.loc[hit, "per_prompt"] = out.loc[hit, "per_prompt"].map(other)
    return out


def test_the_report_s_leaderboard_and_category_plot_say_when_arms_of_equal_counts_ran_other_prompts():
    """Two arms of as many prompts, two of one arm's other texts: the report's leaderboard and the
    category plot's caption note that the arms ran different prompts, as the comparison table does."""
    from harness.tracking.report import _compare_section, _leaderboard_section

    df = _store_frame()
    runs = df[df["run_id"].isin([fixture_run_id(1), fixture_run_id(3)])]
    same = "\n".join(_leaderboard_section(runs, {"by": "proposer"}))
    assert "ran different prompts" not in same and "Prompts: chat 2, code 2, Overall 4." in same
    assert "different prompts" not in PLOTS["speedup_by_category"](runs, {}).caption
    apart = _other_code_prompts(runs, fixture_run_id(3))
    assert "Note: the arms ran different prompts (" in "\n".join(_compare_section(apart, {"by": "proposer"}))
    board = "\n".join(_leaderboard_section(apart, {"by": "proposer"}))
    assert "Note: the arms ran different prompts (" in board and "; 2 common to all)" in board
    assert "Prompts: chat 2/2, code 2/2, Overall 4/4 (" in board and "the rows ran different prompts" in board
    caption = PLOTS["speedup_by_category"](apart, {}).caption
    assert caption.startswith("the arms ran different prompts (") and "; 2 common to all)" in caption


def test_the_speedup_by_proposer_plot_slants_its_arm_labels():
    """The arm labels are slanted and right-aligned, so long ones ("prompt_lookup (machine=cpu: AMD
    EPYC)") do not run into each other."""
    df = _store_frame()
    runs = df[df["section"] == "exact"]
    ax = PLOTS["speedup_by_proposer_workload"](runs, {}).figure.axes[0]
    ticks = ax.get_xticklabels()
    assert len(ticks) > 1 and all(t.get_rotation() == 20 and t.get_horizontalalignment() == "right" for t in ticks)
