"""`harness report`: Markdown + PNGs regenerated from stored records only."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.tracking.report import PLOTS, find_recipe, load_recipe, main

FIXTURES = Path(__file__).parent / "fixtures" / "records"
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
    # sections kept apart and labelled
    exact_part = md.split("### HEURISTIC")[0]
    assert "fx10-hydra-typical-t0.7-b1" not in exact_part
    assert "fx09-prompt_lookup-greedy-t0-b1" not in exact_part
    assert "### CPU-BUDGET ARTIFACTS" in md
    # quoted paper numbers only under the source-reported label
    src = md.split("## Source-reported numbers (not measured here)")[1]
    assert src.count("| source-reported |") == 3 and "1.62x to 2.36x" in src
    assert "1.62x" not in md.split("## Source-reported")[0]
    # a number from the records appears in the runs table (fx03 speedup 1.7838)
    assert "| fx03-hydra-greedy-t0-b1 | hydra | sequoia | greedy | 0 | 1 | code+chat | smollm2-135m | 1.784 |" in md


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
    shutil.copytree(FIXTURES / "fixture-sweep" / "fx01-prompt_lookup-greedy-t0-b1", root / "a")
    rec = load_record(FIXTURES / "fixture-sweep" / "fx02-rest-greedy-t0-b1")
    for name in ("speedup", "time_per_committed_token_ms", "ar_time_per_token_ms", "temp_kv_bytes_peak"):
        rec["metrics"][name] = None
    rec["metrics"]["round_cost_ms"]["retrieval"] = None
    rec["metrics"]["acceptance_by_depth"] = rec["metrics"]["reach_by_depth"] = []
    rec["metrics"]["accepted_length_hist"] = []
    (root / "b").mkdir()
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
    assert "| fx02-rest-greedy-t0-b1 | rest | tree | greedy | 0 | 1 | code+chat | smollm2-135m | - | - |" in md


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
        "fx01-prompt_lookup-greedy-t0-b1": "prompt_lookup/chain",
        "fx02-rest-greedy-t0-b1": "rest/tree",
        "fx03-hydra-greedy-t0-b1": "hydra/sequoia",
    }
    hydra = run_labels(df[df["proposer"] == "hydra"])
    assert hydra["fx07-hydra-greedy-t0-b4"] == "greedy/T=0/B=4"
    assert hydra["fx10-hydra-typical-t0.7-b1"] == "typical/T=0.7/B=1 [heuristic, exact=false]"
    # nothing differs: the full arm name; repeats of one arm are numbered
    one = run_labels(df[df["run_id"] == "fx03-hydra-greedy-t0-b1"])
    assert one == {"fx03-hydra-greedy-t0-b1": "hydra-sequoia-greedy-T0-B1-code+chat"}
    twice = df[df["run_id"].isin(["fx01-prompt_lookup-greedy-t0-b1", "fx09-prompt_lookup-greedy-t0-b1"])]
    twice = twice.assign(section="exact")
    assert sorted(run_labels(twice).values()) == [
        "prompt_lookup-chain-greedy-T0-B1-code+chat #1",
        "prompt_lookup-chain-greedy-T0-B1-code+chat #2",
    ]
    for plot in ("acceptance_by_depth", "accepted_length_hist", "t_profile", "frontier"):
        fig = PLOTS[plot](df, {}).figure
        texts = [t.get_text() for t in fig.legends[0].get_texts()] if fig.legends else []
        texts += [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        texts += [t.get_text() for ax in fig.axes for t in ax.texts]
        assert texts and not any("fx0" in t or "fx1" in t for t in texts), (plot, texts)


def test_acceptance_by_depth_draws_wilson_intervals_and_greys_out_depths_with_few_rounds():
    from matplotlib.colors import to_rgba

    from harness.tracking.conventions import wilson_interval

    df = _store_frame()
    run = df[df["run_id"] == "fx03-hydra-greedy-t0-b1"]  # depth 6 tried by 14 rounds, depth 5 by 33
    fig = PLOTS["acceptance_by_depth"](run, {"min_rounds": 30}).figure
    ax_c, ax_r, ax_n = fig.axes[:3]
    points = [ln for ln in ax_c.get_lines() if ln.get_linestyle() == "None" and ln.get_marker() not in (None, "", "_")]
    by_depth = {float(ln.get_xdata()[0]): ln for ln in points}
    grey = to_rgba("0.6")
    assert [d for d, ln in sorted(by_depth.items()) if to_rgba(ln.get_color()) == grey] == [6.0]
    assert by_depth[6.0].get_markerfacecolor() == "none"
    # the interval drawn at depth 1 is the Wilson interval of 136 accepted out of 165 tried
    low, high = wilson_interval(136, 165)
    segs = [seg for coll in ax_c.collections for seg in coll.get_segments() if abs(seg[0][0] - 1.0) < 1e-9]
    assert any(abs(seg[0][1] - low) < 1e-9 and abs(seg[1][1] - high) < 1e-9 for seg in segs)
    assert list(ax_n.get_lines()[0].get_ydata()) == [165, 136, 99, 62, 33, 14]
    assert "fewer than 30 rounds" in fig._suptitle.get_text()


def test_wilson_interval_matches_scipy():
    from scipy.stats import binomtest

    from harness.tracking.conventions import depth_rows, wilson_interval

    for k, n in ((0, 5), (3, 7), (136, 165), (14, 14)):
        ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-9)
    assert wilson_interval(0, 0) is None
    rows = depth_rows({"acceptance_by_depth": [0.5, None], "reach_by_depth": [0.5, 0.0]})
    assert rows[0]["tried"] is None and rows[0]["acceptance_low"] is None and rows[1]["acceptance"] is None
