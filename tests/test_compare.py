"""`harness compare`: paired, per-category arms with bootstrap CIs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from helpers import FIXTURE_ROOT, fixture_record, fixture_run, fixture_run_id

from harness.tracking.command_line import split_arguments
from harness.tracking.compare import (
    ALL,
    compare,
    format_table,
    main,
    paired_bootstrap,
    speedup_statistic,
)
from harness.tracking.store import aggregate, rebuild_store

FIXTURES = FIXTURE_ROOT


def _toy(runs: dict[str, dict], section: str = "exact") -> pd.DataFrame:
    """A store frame from {run_id: {proposer, prompts: [(id, cat, spec_ms, spec_tok, ar_ms, ar_tok)]}}."""
    rows = []
    for run_id, spec in runs.items():
        rows.append(
            {
                "run_id": run_id,
                "section": spec.get("section", section),
                "proposer": spec["proposer"],
                "topology": "tree",
                "verifier": spec.get("verifier", "greedy"),
                "temperature": 0.0,
                "batch_size": 1,
                "workload": "w",
                "model": "m",
                "per_prompt": json.dumps(
                    [
                        dict(
                            zip(
                                ("prompt_id", "category", "spec_decode_ms", "spec_tokens", "ar_decode_ms", "ar_tokens"),
                                p,
                                strict=True,
                            )
                        )
                        for p in spec["prompts"]
                    ]
                ),
            }
        )
    return pd.DataFrame(rows)


def _row(rows, arm, category=ALL, section="exact"):
    (hit,) = [r for r in rows if r.arm == arm and r.category == category and r.section == section]
    return hit


def test_hand_computed_speedup_and_time_per_token():
    # a: spec 30+50 ms for 10+10 tokens -> 4 ms/token; AR 60+100 ms for 10+10 tokens -> 8 ms/token
    df = _toy({"r1": {"proposer": "a", "prompts": [("p1", "code", 30, 10, 60, 10), ("p2", "chat", 50, 10, 100, 10)]}})
    rows = compare(df, by="proposer", n_resamples=200)
    all_ = _row(rows, "a")
    assert all_.time_per_committed_token_ms.value == pytest.approx(4.0)
    assert all_.speedup.value == pytest.approx(2.0)  # not mean of ratios: (160/20)/(80/20)
    assert all_.ar_time_per_token_ms == pytest.approx(8.0)
    code = _row(rows, "a", "code")
    assert code.n_prompts == 1 and code.speedup.value == pytest.approx(2.0)
    assert code.speedup.ci_low is None  # one prompt: no interval, never a made-up one


def test_speedup_is_ratio_of_sums_not_mean_of_ratios():
    # per-prompt speedups 4 and 1/3: the ratio of sums is (40+10)/(10+30) = 1.25,
    # the mean of per-prompt ratios would be (4 + 1/3)/2 = 2.17
    df = _toy({"r1": {"proposer": "a", "prompts": [("p1", "c", 10, 10, 40, 10), ("p2", "c", 30, 10, 10, 10)]}})
    assert _row(compare(df, n_resamples=200), "a").speedup.value == pytest.approx(1.25)


def test_pairing_on_prompts_gives_a_tight_interval_when_the_ratio_is_constant():
    # prompt lengths differ wildly, but arm b is exactly 1.5x faster than arm a on every prompt
    sizes = [(10, 5), (200, 50), (35, 20), (900, 300), (60, 12), (15, 3)]
    a = [(f"p{i}", "c", ms, tok, 2 * ms, tok) for i, (ms, tok) in enumerate(sizes)]
    b = [(f"p{i}", "c", ms / 1.5, tok, 2 * ms, tok) for i, (ms, tok) in enumerate(sizes)]
    df = _toy({"ra": {"proposer": "a", "prompts": a}, "rb": {"proposer": "b", "prompts": b}})
    rows = compare(df, by="proposer", baseline="a", n_resamples=500)
    vs = _row(rows, "b").vs_baseline
    assert vs.value == pytest.approx(1.5)
    assert vs.ci_low == pytest.approx(1.5) and vs.ci_high == pytest.approx(1.5)
    assert _row(rows, "b").n_pairs_baseline == 6
    # the arm's own time per token does vary with the resampled prompts
    tpt = _row(rows, "b").time_per_committed_token_ms
    assert tpt.ci_high - tpt.ci_low > 0.5


def test_pairing_uses_only_common_prompts():
    a = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 10, 10, 20, 10), ("p3", "c", 1000, 10, 20, 10)]
    b = [("p1", "c", 5, 10, 20, 10), ("p2", "c", 5, 10, 20, 10)]
    df = _toy({"ra": {"proposer": "a", "prompts": a}, "rb": {"proposer": "b", "prompts": b}})
    row = _row(compare(df, baseline="a", n_resamples=200), "b")
    assert row.n_pairs_baseline == 2
    assert row.vs_baseline.value == pytest.approx(2.0)  # p3 (only in a) is left out


def test_runs_of_one_arm_are_summed_per_prompt_and_mixed_axes_reported():
    r1 = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 10, 10, 20, 10)]
    r2 = [("p1", "c", 30, 10, 20, 10), ("p2", "c", 30, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": r1}, "r2": {"proposer": "a", "verifier": "specinfer", "prompts": r2}})
    row = _row(compare(df, n_resamples=200), "a")
    assert row.run_ids == ("r1", "r2") and row.n_prompts == 2
    assert row.time_per_committed_token_ms.value == pytest.approx(2.0)  # 80 ms / 40 tokens
    assert row.varying == {"verifier": ["greedy", "specinfer"]}


def test_paired_bootstrap_is_reproducible_and_covers_the_point():
    rng = np.random.default_rng(1)
    ms, tok = rng.uniform(100, 400, 20), rng.integers(20, 80, 20).astype(float)
    data = (2 * ms, tok, ms, tok * rng.uniform(0.9, 1.1, 20))
    kw = dict(confidence_level=0.9, n_resamples=400, method="percentile")
    e1 = paired_bootstrap(data, speedup_statistic, seed=3, **kw)
    assert e1.ci_low < e1.value < e1.ci_high
    assert e1.ci_high - e1.ci_low < 0.2
    assert paired_bootstrap(data, speedup_statistic, seed=3, **kw) == e1
    assert paired_bootstrap(data, speedup_statistic, seed=4, **kw) != e1


def _per_prompt_ratio(rec: dict, ms: str, tokens: str) -> float:
    pp = rec["per_prompt"]
    return sum(p[ms] for p in pp) / sum(p[tokens] for p in pp)


def test_fixture_arms_match_the_records_and_sections_stay_apart():
    df = aggregate(FIXTURES)
    rows = compare(df, by="proposer", filters={"batch_size": "1", "verifier": "greedy"}, n_resamples=300)
    rec = fixture_record(3)  # the only exact draft_model run at B = 1 with greedy verification
    draft = _row(rows, "draft_model")
    assert draft.run_ids == (rec["run_id"],)
    # compare's statistics are the per-prompt decode rows' ratios of sums
    spec = _per_prompt_ratio(rec, "spec_decode_ms", "spec_tokens")
    assert draft.time_per_committed_token_ms.value == pytest.approx(spec, rel=1e-9)
    assert draft.speedup.value == pytest.approx(_per_prompt_ratio(rec, "ar_decode_ms", "ar_tokens") / spec, rel=1e-9)
    # the counterparts of the record's decode_speedup and (prefill counted) headline speedup, which
    # divide batch wall time rather than sum request latencies: equal up to the batch's bookkeeping
    m = rec["metrics"]
    assert draft.speedup.value == pytest.approx(m["decode_speedup"], rel=0.01)
    assert draft.end_to_end_speedup.value == pytest.approx(m["speedup"], rel=0.01)
    # end to end counts each side's prefill with its decode (how far it moves the ratio is the timing's)
    pp = rec["per_prompt"]
    end_to_end = (sum(p["ar_prefill_ms"] + p["ar_decode_ms"] for p in pp) / sum(p["ar_tokens"] for p in pp)) / (
        sum(p["spec_prefill_ms"] + p["spec_decode_ms"] for p in pp) / sum(p["spec_tokens"] for p in pp)
    )
    assert draft.end_to_end_speedup.value == pytest.approx(end_to_end, rel=1e-9)
    assert all(p["spec_prefill_ms"] > 0 and p["ar_prefill_ms"] > 0 for p in pp)
    assert draft.end_to_end_speedup.ci_low <= draft.end_to_end_speedup.value <= draft.end_to_end_speedup.ci_high
    table = format_table(rows, by="proposer", baseline=None, level=0.95)
    assert "decode speedup vs AR [95% CI]" in table and "end-to-end speedup [95% CI]" in table
    assert {r.category for r in rows} == {"code", "chat", ALL}
    assert _row(rows, "draft_model", "code").n_prompts == 2 and _row(rows, "draft_model").n_prompts == 4
    by_section = {
        s: {rid for r in rows if r.section == s for rid in r.run_ids}
        for s in ("exact", "cpu_budget_artifact", "ungated")
    }
    assert by_section["cpu_budget_artifact"] == {fixture_run_id(9)}  # hydra heads trained on 2,000 tokens
    assert by_section["ungated"] == {fixture_run_id(11)}  # gates.oracle=false
    assert by_section["exact"] == {fixture_run_id(n) for n in (1, 2, 3)}
    assert _row(rows, "hydra", section="cpu_budget_artifact").labels == ("cpu_budget_artifact",)
    assert not [r for r in rows if r.section == "exact" and r.arm == "hydra"]
    # the heuristic run is filtered out by verifier=greedy; with T=0.7 it is in its own section
    rows = compare(df, by="verifier", filters={"temperature": "0.7"}, baseline="specinfer", n_resamples=300)
    typical = _row(rows, "typical", section="heuristic")
    assert typical.run_ids == (fixture_run_id(10),) and typical.labels == ("heuristic (exact: false)",)
    assert typical.vs_baseline is not None and typical.n_pairs_baseline == 4  # vs the exact baseline, 4 prompts
    assert not [r for r in rows if r.section == "exact" and r.arm == "typical"]


def test_compare_refuses_bad_arguments():
    df = aggregate(FIXTURES)
    with pytest.raises(ValueError, match="by must name an axis"):
        compare(df, by="colour")
    with pytest.raises(ValueError, match="unknown filter 'colour'"):
        compare(df, filters={"colour": "red"})
    with pytest.raises(ValueError, match="no runs left"):
        compare(df, filters={"batch_size": "3"})
    with pytest.raises(ValueError, match="baseline proposer='medusa' has no runs"):
        compare(df, baseline="medusa")
    with pytest.raises(ValueError, match="given twice"):
        split_arguments(["by=a", "by=b"])


def test_main_prints_sections_and_writes_json(tmp_path, capsys):
    root = tmp_path / "recs"
    shutil.copytree(FIXTURES, root)
    rebuild_store(root)
    out = tmp_path / "cmp.json"
    rc = main(
        [
            str(root / "store.parquet"),
            "by=proposer",
            "baseline=prompt_lookup",
            "batch_size=1",
            f"json={out}",
            "resamples=300",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "== exact runs ==" in text and "HEURISTIC" in text and "CPU-BUDGET" in text
    assert "vs proposer=prompt_lookup" in text
    payload = json.loads(out.read_text())
    assert payload["pairing"] == "prompt_id" and payload["filters"] == {"batch_size": "1"}
    # one arm pools the runs that share its proposer: greedy, SpecInfer and rejection sampling
    draft = [r for r in payload["sections"]["exact"] if r["arm"] == "draft_model" and r["category"] == ALL][0]
    assert draft["run_ids"] == sorted(fixture_run_id(n) for n in (3, 4, 5))
    assert draft["vs_baseline"]["ci_low"] <= draft["vs_baseline"]["value"] <= draft["vs_baseline"]["ci_high"]
    # the decode speedup under its own name (a record's "speedup" is end to end), end to end beside it
    assert "speedup" not in draft and {"decode_speedup", "end_to_end_speedup"} <= set(draft)
    # records folder and store give the same numbers
    rc = main(
        [
            str(root),
            "by=proposer",
            "baseline=prompt_lookup",
            "batch_size=1",
            f"json={tmp_path / 'b.json'}",
            "resamples=300",
        ]
    )
    assert rc == 0
    assert json.loads((tmp_path / "b.json").read_text())["sections"] == payload["sections"]


def test_main_refuses_before_printing_when_the_leaderboard_cannot_be_computed(tmp_path, capsys):
    """The leaderboard was computed after the comparison table had been printed: a store whose
    per-prompt rounds are not numbers printed the table, then refused, leaving a table on stdout
    under a refusal. Both are computed before anything is printed now."""
    root = tmp_path / "recs"
    shutil.copytree(fixture_run(1), root / "run")
    store = root / "store.parquet"
    df = rebuild_store(root)
    prompts = json.loads(df.loc[0, "per_prompt"])
    prompts[0]["spec_rounds"] = "nine"  # a store written by other code, or edited: no record is read
    df.loc[0, "per_prompt"] = json.dumps(prompts)
    df.to_parquet(store, engine="pyarrow", index=False)
    assert main([str(store), "resamples=50"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "harness compare: refused: could not convert string to float: 'nine'" in captured.err
    assert main([str(store), "resamples=50", "leaderboard=false"]) == 0  # the table alone reads no rounds
    assert "== exact runs ==" in capsys.readouterr().out


def test_main_reports_errors_with_usage(capsys):
    assert main([str(FIXTURES), "colour=red"]) == 2
    assert "unknown filter 'colour'" in capsys.readouterr().err
    assert main([]) == 2


@pytest.mark.parametrize(
    "option, message",
    [
        ("resamples=0", "resamples=0 is out of range: it must be >= 2"),
        ("resamples=many", "resamples='many': expected a whole number >= 2"),
        ("bootstrap_seed=-1", "bootstrap_seed=-1 is out of range: it must be >= 0"),
        ("level=95", "level=95 is out of range: it must be in (0, 1), e.g. level=0.9"),
        ("level=high", "level='high': expected a number in (0, 1), e.g. level=0.9"),
        ("method=bca", "method='bca': expected percentile, basic or BCa"),
    ],
)
def test_bootstrap_options_out_of_range_are_refused_naming_the_option(capsys, option, message):
    assert main([str(FIXTURES), option]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == f"harness compare: refused: {message} (harness compare --help shows the usage)"


def test_an_arm_pooling_other_configurations_and_other_prompts_says_so_and_keeps_the_prompts_apart():
    """Two runs of one arm that differ outside the axes (another prompt file whose ids repeat,
    another tree budget) are listed under mixed axes, and prompts with one id in two files are two
    prompts; prompts with a content fingerprint pair by it."""
    r1 = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 10, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": r1}, "r2": {"proposer": "a", "prompts": r1}})
    df["config.workload.name"] = "jsonl"
    df["config.workload.path"] = ["/data/p.jsonl", "/data/p2.jsonl"]
    df["config.topology.max_nodes"] = [8, 2]
    df["config.output_dir"] = ["x", "y"]  # where a run wrote is no difference in what it measured
    row = _row(compare(df, n_resamples=200), "a")
    assert row.n_prompts == 4  # p1 and p2 of each file
    assert row.varying == {"topology.max_nodes": ["2", "8"], "workload.path": ["/data/p.jsonl", "/data/p2.jsonl"]}
    table = format_table(compare(df, n_resamples=200), by="proposer", baseline=None, level=0.95)
    assert "topology.max_nodes=2,8; workload.path=/data/p.jsonl,/data/p2.jsonl" in table
    # records that carry each prompt's fingerprint pair by it, whatever the file is called
    prompts = [json.loads(p) for p in df["per_prompt"]]
    for run in prompts:
        for p in run:
            p["prompt_sha256"] = f"sha-{p['prompt_id']}"
    df["per_prompt"] = [json.dumps(p) for p in prompts]
    assert _row(compare(df, n_resamples=200), "a").n_prompts == 2
    # one record without fingerprints among them: all pair by workload source, never half and half
    del prompts[1][0]["prompt_sha256"]
    df["per_prompt"] = [json.dumps(p) for p in prompts]
    assert _row(compare(df, n_resamples=200), "a").n_prompts == 4


def test_mixed_axes_sort_numbers_by_value_and_leave_out_what_the_workload_axis_implies():
    """``topology.max_nodes=16,8`` read as text order; and an arm pooling a file workload with a built-in
    one listed ``workload.path=/data/p.jsonl,null`` beside ``workload=humaneval,jsonl``, which says it."""
    r1 = [("p1", "c", 10, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": r1}, "r2": {"proposer": "a", "prompts": r1}})
    df["workload"] = ["humaneval", "jsonl"]
    df["config.workload.name"] = ["humaneval", "jsonl"]
    df["config.workload.path"] = [None, "/data/p.jsonl"]
    df["config.workload.limit"] = [4, 2]  # both workloads take a limit: still listed
    df["config.topology.max_nodes"] = [16, 8]
    row = _row(compare(df, n_resamples=200), "a")
    assert row.varying == {
        "workload": ["humaneval", "jsonl"],
        "topology.max_nodes": ["8", "16"],
        "workload.limit": ["2", "4"],
    }


def test_json_replaces_its_own_file_only_and_job_folders_named_by_overrides_are_paths(tmp_path, capsys, monkeypatch):
    """``json=`` never replaces a run's record or another file (unless overwrite=true); a job folder
    of a multirun, named ``key=value,...``, is a records root, not an option."""
    job = tmp_path / "sweep" / "proposer=prompt_lookup,topology=sequence,seed=1"
    shutil.copytree(fixture_run(1), job)
    record = (job / "record.json").read_bytes()
    for target in (job / "record.json", job / "outputs.jsonl"):
        assert main([str(job), f"json={target}", "resamples=50"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"harness compare: refused: json={target} is a file of the run folder {job}: write a compare JSON "
            "elsewhere (harness compare --help shows the usage)"
        ]
        assert main([str(job), f"json={target}", "overwrite=true", "resamples=50"]) == 2
        capsys.readouterr()
    assert (job / "record.json").read_bytes() == record
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    assert main([str(job), f"json={notes}", "resamples=50"]) == 2
    assert (
        f"json={notes} already exists and is not a compare JSON; give another path or overwrite=true"
        in capsys.readouterr().err
    )
    assert notes.read_text() == '{"mine": 1}\n'
    assert main([str(job), f"json={tmp_path}", "resamples=50"]) == 2
    assert f"json={tmp_path} is a folder; give a file path, e.g. json={tmp_path / 'compare.json'}" in (
        capsys.readouterr().err
    )
    assert main([str(job), "overwrite=true", "resamples=50"]) == 2
    assert "overwrite= goes with json=PATH" in capsys.readouterr().err
    # nothing is written inside a run folder, as export refuses: not beside the files a record binds
    for inside in (job / "cmp.json", job / "notes" / "cmp.json"):
        for extra in ([], ["overwrite=true"]):
            assert main([str(tmp_path / "sweep"), f"json={inside}", "resamples=50", *extra]) == 2
            assert capsys.readouterr().err.strip().splitlines() == [
                f"harness compare: refused: json={inside} is inside the run folder {job}: write a compare JSON "
                "outside any run folder (harness compare --help shows the usage)"
            ]
    assert sorted(p.name for p in job.iterdir()) == sorted(p.name for p in fixture_run(1).iterdir())
    # the job folder by its own name, relative or absolute; a compare JSON replaces its earlier self
    out = tmp_path / "cmp.json"
    assert main([str(job), f"json={out}", "resamples=50"]) == 0
    first = json.loads(out.read_text())
    assert first["source"] == str(job) and first["sections"]["exact"]
    assert main([str(job), f"json={out}", "resamples=50"]) == 0
    assert main([str(job), f"json={notes}", "overwrite=true", "resamples=50"]) == 0
    assert json.loads(notes.read_text())["sections"] == first["sections"]
    capsys.readouterr()
    monkeypatch.chdir(job.parent)
    assert main([job.name, "resamples=50"]) == 0
    assert "prompt_lookup" in capsys.readouterr().out
    # the store it reads is never the JSON's path, overwrite or not, nor is any store's name
    from harness.tracking.store import rebuild_store

    rebuild_store(job.parent)
    store = job.parent / "store.parquet"
    kept = store.read_bytes()
    for extra in ([], ["overwrite=true"]):
        assert main([str(store), f"json={store}", "resamples=50", *extra]) == 2
        assert f"json={store} is the store compare reads" in capsys.readouterr().err
    assert main([str(job), f"json={tmp_path / 'other.parquet'}", "resamples=50"]) == 2
    assert "is named as a store (.parquet)" in capsys.readouterr().err
    assert store.read_bytes() == kept and not (tmp_path / "other.parquet").exists()


def test_runs_without_a_value_of_the_by_axis_are_an_arm_of_their_own():
    """by=experiment over runs of which one ran outside any experiment: it is the arm "(none)", not
    dropped, in the tables and the leaderboard."""
    from harness.tracking.compare import NO_VALUE, leaderboard

    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "b", "prompts": prompts}})
    df["experiment"] = [("sources/lookup_T0" if r == "r1" else None) for r in df["run_id"]]
    rows = compare(df, by="experiment", n_resamples=50)
    arms = {r.arm for r in rows if r.category == ALL}
    assert arms == {"sources/lookup_T0", NO_VALUE}
    board = leaderboard(df, by="experiment", n_resamples=50)
    assert NO_VALUE in json.dumps(str(board))


def test_arms_with_batched_runs_say_their_figures_are_per_request():
    """At batch > 1 a prompt's time is its request's latency in the batch: compare's figures for such
    an arm are per request (summed request latencies over summed tokens), and the table says so under
    the section."""
    from harness.tracking.compare import batched_note

    df = aggregate(FIXTURES)
    rows = compare(df, by="batch_size", n_resamples=50)
    by_arm = {r.arm: r.batch_sizes for r in rows if r.section == "exact" and r.category == ALL}
    assert by_arm["1"] == (1,) and by_arm["4"] == (4,)
    text = format_table(rows, by="batch_size", baseline=None, level=0.95)
    assert "note: arms with runs at batch > 1 (2 (batch 2); 4 (batch 4)): a prompt's time is its request's" in text
    single = compare(df, by="proposer", filters={"batch_size": "1"}, n_resamples=50)
    assert batched_note([r for r in single if r.section == "exact"]) is None
    assert "note: arms with runs at batch > 1" not in format_table(single, by="proposer", baseline=None, level=0.95)


def test_arms_whose_runs_flagged_timing_outliers_are_noted_under_their_section():
    """A record's metrics.timing_outliers (prompts timed through a stall) reaches compare's table and
    the report as a note naming the arm and how many prompts its runs flagged; records without the
    field (written before it) count none."""
    from harness.tracking.compare import outlier_note

    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10), ("p3", "c", 11, 10, 90, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "b", "prompts": prompts}})
    assert outlier_note([r for r in compare(df, by="proposer", n_resamples=50)]) is None  # no such column
    stall = {"prompt_id": "p3", "arm": "ar", "ms_per_round": 9.0, "median_ms_per_round": 2.0, "ratio": 4.5}
    df["timing_outliers"] = [json.dumps([stall]), json.dumps([])]
    rows = compare(df, by="proposer", n_resamples=50)
    assert {r.arm: r.timing_outliers for r in rows if r.category == ALL} == {"a": 1, "b": 0}
    text = format_table(rows, by="proposer", baseline=None, level=0.95)
    assert (
        "note: arms whose runs flagged timing outliers (a (1 flagged)): a prompt's decode time per round was 3x" in text
    )
    from harness.tracking.report import _compare_section

    assert any(
        line.startswith("Note: arms whose runs flagged timing outliers (a (1 flagged))")
        for line in _compare_section(df, {"by": "proposer"})
    )  # the report's comparison says it too
    df["timing_outliers"] = [json.dumps([]), None]  # an empty list, and a record from before the flag
    assert "timing outliers" not in format_table(
        compare(df, by="proposer", n_resamples=50), by="proposer", baseline=None, level=0.95
    )


def test_batched_arms_resample_whole_batches_and_a_single_batch_has_no_interval():
    """A batch's requests share its time, so they are one measurement: an arm of batched runs
    resamples batches (its point estimate is the same ratio of sums), one batch gives no interval,
    and its comparison with a baseline resamples the same batches in both arms (one batch: none)."""
    from harness.tracking.compare import leaderboard

    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 14, 10, 20, 10), ("p3", "c", 9, 10, 30, 10)]
    prompts.append(("p4", "c", 12, 10, 25, 10))
    df = _toy({"b2": {"proposer": "two", "prompts": prompts}, "b4": {"proposer": "four", "prompts": prompts}})
    df = pd.concat([df, _toy({"b1": {"proposer": "one", "prompts": prompts}})], ignore_index=True)
    df["batch_size"] = [2, 4, 1]
    per_prompt = []
    for run, size in zip(df["run_id"], df["batch_size"], strict=True):
        entries = json.loads(df.loc[df["run_id"] == run, "per_prompt"].item())
        per_prompt.append(json.dumps([{**e, "batch_index": i // size} for i, e in enumerate(entries)]))
    df["per_prompt"] = per_prompt
    rows = {r.arm: r for r in compare(df, by="proposer", baseline="one", n_resamples=200) if r.category == ALL}
    point = (20 + 20 + 30 + 25) / (10 + 14 + 9 + 12)
    for arm in ("one", "two", "four"):
        assert rows[arm].speedup.value == pytest.approx(point)  # the same ratio of sums whatever the unit
    assert rows["four"].speedup.ci_low is None and rows["four"].time_per_committed_token_ms.ci_low is None
    two = paired_bootstrap(
        ([40.0, 55.0], [20.0, 20.0], [24.0, 21.0], [20.0, 20.0]),
        speedup_statistic,
        confidence_level=0.95,
        n_resamples=200,
        seed=0,
        method="percentile",
    )
    assert (rows["two"].speedup.ci_low, rows["two"].speedup.ci_high) == (two.ci_low, two.ci_high)  # two batches
    assert rows["one"].speedup.ci_low is not None  # four prompts at batch 1: four units
    # vs the batch-1 baseline: the two batches of "two", each arm's sums over them (the same rows: 1.0)
    same = paired_bootstrap(
        ([24.0, 21.0], [20.0, 20.0], [24.0, 21.0], [20.0, 20.0]),
        speedup_statistic,
        confidence_level=0.95,
        n_resamples=200,
        seed=0,
        method="percentile",
    )
    assert rows["two"].vs_baseline == same and (same.value, same.ci_low, same.ci_high) == (1.0, 1.0, 1.0)
    assert rows["two"].n_pair_units == 2 and rows["two"].n_pairs_baseline == 4
    assert rows["four"].vs_baseline.value == pytest.approx(1.0) and rows["four"].vs_baseline.ci_low is None
    assert rows["four"].n_pair_units == 1  # one batch of four: one unit in both arms
    _, board = leaderboard(df, by="proposer", n_resamples=200)
    cells = {r.arm: r.cells["overall"] for r in board}
    assert cells["four"].speedup.ci_low is None and cells["two"].speedup.ci_low == two.ci_low


def test_seed_filters_runs_by_their_seed_and_bootstrap_seed_seeds_the_resampling(capsys):
    """``seed=`` is the runs' seed (a top-level config key filters by ``config.<key>``), as ``harness
    run`` spells it; the resampling's own seed is ``bootstrap_seed=``."""
    assert main([str(FIXTURES), "seed=0", "resamples=50", "leaderboard=false"]) == 0
    assert "prompt_lookup" in capsys.readouterr().out
    assert main([str(FIXTURES), "seed=3", "resamples=50"]) == 2
    assert "no runs left after filters {'seed': '3'}" in capsys.readouterr().err
    # a true/false column filtered as every harness option is spelt (only Python's True matched)
    for spelt in ("true", "True", "1"):
        assert main([str(FIXTURES), f"exact={spelt}", "resamples=50", "leaderboard=false"]) == 0
        assert "prompt_lookup" in capsys.readouterr().out
    for spelt in ("false", "FALSE", "0"):  # the one heuristic run: typical acceptance
        assert main([str(FIXTURES), f"exact={spelt}", "by=verifier", "resamples=50", "leaderboard=false"]) == 0
        out = capsys.readouterr().out
        assert "typical" in out and "greedy" not in out
    outs = []
    for seed in ("1", "1", "2"):
        assert main([str(FIXTURES), "batch_size=1", f"bootstrap_seed={seed}", "resamples=50", "leaderboard=false"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_a_category_row_counts_the_runs_that_hold_its_prompts_and_their_outliers_only():
    """An arm of two runs where one category is in one run only: that category's row names that
    run alone (no mixed axes from the other), and a stalled prompt counts in its own category."""
    r1 = [("p1", "code", 10, 10, 20, 10), ("p2", "chat", 10, 10, 20, 10)]
    r2 = [("q1", "code", 10, 10, 20, 10), ("q2", "code", 11, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": r1}, "r2": {"proposer": "a", "prompts": r2}})
    df["workload"] = ["w1", "w2"]
    stall = {"prompt_id": "p2", "arm": "spec", "ms_per_round": 9.0, "median_ms_per_round": 2.0, "ratio": 4.5}
    df["timing_outliers"] = [json.dumps([stall]), json.dumps([])]
    rows = {r.category: r for r in compare(df, by="proposer", n_resamples=50)}
    assert rows["chat"].run_ids == ("r1",) and rows["chat"].varying == {}
    assert rows["code"].run_ids == ("r1", "r2") and rows["code"].varying == {"workload": ["w1", "w2"]}
    assert rows[ALL].run_ids == ("r1", "r2")
    assert (rows["chat"].timing_outliers, rows["code"].timing_outliers, rows[ALL].timing_outliers) == (1, 0, 1)


def test_a_baseline_run_on_other_axes_is_noted_under_the_table():
    """baseline=b compares arms by proposer; when the baseline arm ran at another temperature its
    ratio is not the proposer's effect alone, and the table says so (the same arms on the same axes
    get no note)."""
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "b", "prompts": prompts}})
    rows = compare(df, by="proposer", baseline="b", n_resamples=50)
    assert all(r.baseline_differs == {} for r in rows)
    assert "across other axes" not in format_table(rows, by="proposer", baseline="b", level=0.95)
    df["temperature"] = [0.7, 0.0]
    rows = compare(df, by="proposer", baseline="b", n_resamples=50)
    (a,) = [r for r in rows if r.arm == "a" and r.category == ALL]
    assert a.baseline_differs == {"temperature": ["0.7", "0"]}
    text = format_table(rows, by="proposer", baseline="b", level=0.95)
    assert (
        "note: arms compared with the baseline across other axes or options too (a: temperature 0.7 vs 0): their "
        "vs-baseline ratio is not the effect of proposer alone"
    ) in text


def test_an_ungated_run_that_is_also_heuristic_keeps_that_label_and_its_own_arm():
    """Ungated runs share one section; one that is also inexact (or a CPU-budget artifact) is not
    pooled with its arm's exact runs there, and its label says what else it is."""
    from harness.tracking.report import run_labels

    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy(
        {
            "r1": {"proposer": "a", "prompts": prompts, "section": "ungated"},
            "r2": {"proposer": "a", "prompts": prompts, "section": "ungated", "verifier": "typical"},
            "r3": {"proposer": "a", "prompts": prompts},
        }
    )
    df["exact"] = [True, False, True]
    df["cpu_budget_artifact"] = [False, False, False]
    rows = [r for r in compare(df, by="proposer", n_resamples=50) if r.category == ALL]
    assert {(r.section, r.arm, r.run_ids) for r in rows} == {
        ("ungated", "a", ("r1",)),
        ("ungated", "a [heuristic, exact=false]", ("r2",)),
        ("exact", "a", ("r3",)),
    }
    labels = run_labels(df)
    assert labels["r2"].endswith("[ungated: a gate was skipped] [heuristic, exact=false]")
    assert labels["r1"].endswith("[ungated: a gate was skipped]") and "heuristic" not in labels["r1"]


def test_a_heuristic_run_of_a_cpu_budget_artifact_is_heuristic_and_says_what_artifact_it_ran():
    """A gated, inexact run of heads trained on this CPU's small budget (Medusa's typical acceptance)
    went into the CPU-budget section, pooled there with its arm's exact runs. Inexact comes first:
    it is a heuristic run, its own arm, labelled with the artifact too."""
    from harness.tracking.report import run_labels
    from harness.tracking.store import section_of

    assert section_of(exact=False, cpu_budget_artifact=True) == "heuristic"
    assert section_of(exact=True, cpu_budget_artifact=True) == "cpu_budget_artifact"
    assert section_of(exact=False, cpu_budget_artifact=True, gated=False) == "ungated"
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy(
        {
            "r1": {"proposer": "medusa", "prompts": prompts, "section": "cpu_budget_artifact"},
            "r2": {"proposer": "medusa", "prompts": prompts, "section": "heuristic", "verifier": "typical"},
            "r3": {"proposer": "medusa", "prompts": prompts, "section": "heuristic", "verifier": "typical"},
        }
    )
    df["exact"] = [True, False, False]
    df["cpu_budget_artifact"] = [True, True, False]
    rows = [r for r in compare(df, by="proposer", n_resamples=50) if r.category == ALL]
    assert {(r.section, r.arm, r.run_ids) for r in rows} == {
        ("cpu_budget_artifact", "medusa", ("r1",)),
        ("heuristic", "medusa [CPU-budget artifact]", ("r2",)),
        ("heuristic", "medusa", ("r3",)),
    }
    labels = run_labels(df)
    assert labels["r2"].endswith("[heuristic, exact=false] [CPU-budget artifact]")
    assert labels["r3"].endswith("[heuristic, exact=false]")


def test_arms_that_differ_beyond_the_by_axis_or_ran_other_prompts_say_so_without_a_baseline():
    """Two arms on other models (or dtypes, or prompt sets) were ranked side by side with nothing
    said; now the table names what differs among the arms, each arm's value, and when they ran
    different prompts how many all share; the vs-baseline cell says when no prompt pairs."""
    pa = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    pb = [("p3", "c", 10, 10, 20, 10), ("p4", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "b", "prompts": pa}})
    df["config.proposer.max_ngram"] = [3, None]  # a's own option: what the arms are, never a note
    plain = format_table(compare(df, n_resamples=50), by="proposer", baseline=None, level=0.95)
    assert "differ in more than" not in plain and "different prompts" not in plain
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "b", "prompts": pb}})
    df["model"] = ["m@bfloat16", "m"]
    df["config.workload.split"] = ["eval", "dev"]
    rows = compare(df, n_resamples=50)
    assert _row(rows, "a").apart == {"model": "m@bfloat16", "workload.split": "eval"}
    assert _row(rows, "a").common_prompts == 0 and _row(rows, "a", "c").apart == {}
    text = format_table(rows, by="proposer", baseline=None, level=0.95)
    assert (
        "note: the arms differ in more than proposer (model: a m@bfloat16, b m; workload.split: a eval, b dev)"
    ) in text
    assert "note: the arms ran different prompts (a: 2, b: 2; 0 common to all)" in text
    # against a baseline of one model (another dtype is another model: no ratio, "- (other model)")
    df["model"] = ["m", "m"]
    df["verifier"] = ["typical", "greedy"]
    with_base = format_table(compare(df, baseline="b", n_resamples=50), by="proposer", baseline="b", level=0.95)
    assert "- (no prompt in common)" in with_base
    assert "compared with the baseline across other axes" not in with_base  # a ratio that does not exist
    df["per_prompt"] = [df["per_prompt"][0], df["per_prompt"][0]]  # the same prompts: a ratio, qualified
    df = df.drop(columns=["config.workload.split"])
    paired = format_table(compare(df, baseline="b", n_resamples=50), by="proposer", baseline="b", level=0.95)
    assert "arms compared with the baseline across other axes or options too (a: verifier typical vs greedy" in paired
    # a config key apart from the baseline is named too, as the arms-apart note names it
    df["config.generation.max_new_tokens"] = [16, 24]
    paired = format_table(compare(df, baseline="b", n_resamples=50), by="proposer", baseline="b", level=0.95)
    assert "(a: verifier typical vs greedy, generation.max_new_tokens 16 vs 24)" in paired
    # a balanced sweep (every arm crossed with the same temperatures and max_nodes) sets no arm apart
    runs = {f"r{i}": {"proposer": p, "prompts": pa} for i, p in enumerate("aabb")}
    df = _toy(runs)
    df["temperature"] = [0.0, 0.7, 0.0, 0.7]
    df["config.topology.max_nodes"] = [8, 16, 8, 16]
    balanced = format_table(compare(df, n_resamples=50), by="proposer", baseline=None, level=0.95)
    assert "differ in more than" not in balanced and "different prompts" not in balanced
    # arms by workload run their own prompts and options by design: no note says so
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "a", "prompts": pb}})
    df["workload"] = ["humaneval", "sharegpt"]
    df["config.workload.chat"] = [False, True]
    by_workload = format_table(compare(df, by="workload", n_resamples=50), by="workload", baseline=None, level=0.95)
    notes = [line for line in by_workload.splitlines() if "note:" in line]
    assert notes == [  # two prompts an arm: only that its intervals are the range
        "note: arms whose intervals resample fewer than 5 prompts or batches (humaneval: 2 prompts; sharegpt: 2 "
        "prompts): a bootstrap over so few units spans little more than the values measured, so read their "
        "intervals as that range, not as 95% coverage; measure more prompts"
    ]
    # a baseline with no runs in a section: that section's cells are plain "-", not "no prompt in common"
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "b", "prompts": pa, "section": "heuristic"}})
    table = format_table(compare(df, baseline="b", n_resamples=50), by="proposer", baseline="b", level=0.95)
    assert "no prompt in common" not in table


def test_an_arm_or_a_category_measured_on_one_prompt_is_noted():
    """An arm measured on one prompt showed its speedup under a "[95% CI]" header with no interval
    and no note (the few-units note starts at two), and so did a category of one prompt inside an
    arm measured on more."""
    one = [("p1", "qa", 10, 10, 20, 10)]
    more = [("p1", "qa", 10, 10, 20, 10), ("p2", "code", 12, 10, 20, 10), ("p3", "code", 11, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": one}, "r2": {"proposer": "b", "prompts": more}})
    text = format_table(compare(df, n_resamples=50), by="proposer", baseline=None, level=0.95)
    notes = [line for line in text.splitlines() if "one prompt or batch" in line]
    assert notes == [
        "note: measured on one prompt or batch (a; b's category qa): a single value with no interval, which says "
        "nothing of how another prompt would fare; measure more prompts"
    ]
    two = [("p1", "qa", 10, 10, 20, 10), ("p4", "qa", 9, 10, 20, 10), *more[1:]]  # two prompts in each category
    df = _toy({"r1": {"proposer": "a", "prompts": two}, "r2": {"proposer": "b", "prompts": two}})
    text = format_table(compare(df, n_resamples=50), by="proposer", baseline=None, level=0.95)
    assert "one prompt or batch" not in text


def test_an_arm_that_sped_up_with_nothing_accepted_is_noted():
    """A run notes a decode speedup with no proposed token accepted on its console; compare and the
    report showed the same figure beside "1.00" committed tokens per round with no note."""
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "b", "prompts": prompts}})
    df["decode_speedup"] = [1.3, 1.3]
    df["mean_committed_per_round"] = [1.0, 2.4]  # a accepted nothing; b did
    text = format_table(compare(df, n_resamples=50), by="proposer", baseline=None, level=0.95)
    assert (
        "note: arms with runs that sped up more than their rounds allow (a (1 of 1 runs); at batch 1 their tokens "
        "committed per round, at one token per round no proposed token accepted; above, the baseline's batch steps "
        "over their batch rounds): each round runs at least one verify forward"
    ) in text
    df["decode_speedup"] = [1.01, 1.3]  # within noise of no speedup: nothing to say
    assert "more than their rounds" not in format_table(
        compare(df, n_resamples=50), by="proposer", baseline=None, level=0.95
    )
    df["decode_speedup"], df["mean_committed_per_round"] = [1.01, 2.9], [1.0, 2.4]  # b: past its 2.4 per round
    assert "allow (b (1 of 1 runs);" in format_table(
        compare(df, n_resamples=50), by="proposer", baseline=None, level=0.95
    )


def test_an_arm_of_another_model_than_the_baseline_has_no_ratio_to_it():
    """A draft-model arm on SmolLM2 against a prompt-lookup baseline on the tiny model printed a
    vs-baseline "200.142": one model's milliseconds over another's. No ratio now, and a note says
    why; the same model in another dtype is another model, with no ratio either."""
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "b", "prompts": prompts}})
    df["model"] = ["smollm2", "tiny"]
    rows = compare(df, baseline="b", n_resamples=50)
    a = _row(rows, "a")
    assert a.vs_baseline is None and a.baseline_other_model == ["smollm2", "tiny"]
    text = format_table(rows, by="proposer", baseline="b", level=0.95)
    assert "- (other model)" in text and "across other axes" not in text
    assert (
        "note: arms whose runs are of another target model than the baseline's (a: model smollm2 vs tiny) have no "
        "ratio to it: one model's time per token over another's is the models' difference, not proposer's"
    ) in text
    df["model"] = ["tiny@bfloat16", "tiny"]
    rows = compare(df, baseline="b", n_resamples=50)
    a = _row(rows, "a")
    assert a.vs_baseline is None and a.baseline_other_model == ["tiny@bfloat16", "tiny"]
    text = format_table(rows, by="proposer", baseline="b", level=0.95)
    assert "- (other model)" in text and "(a: model tiny@bfloat16 vs tiny) have no ratio to it" in text
    by_model = compare(df, by="model", baseline="tiny", n_resamples=50)  # the models are the arms: a ratio
    assert _row(by_model, "tiny@bfloat16").vs_baseline is not None


def test_runs_timed_on_other_machines_are_named_and_have_no_ratio_to_each_other():
    """Two arms timed on two CPUs (or an H100 and an H200) were divided by each other as a
    vs-baseline ratio, and runs of two machines pooled into one arm, with nothing said: only the
    config was compared, never the hardware. The machine is now told apart like the model."""
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "b", "prompts": prompts}})
    df["hardware.device"] = ["cpu", "cpu"]
    df["hardware.device_name"] = ["AMD EPYC 7763", "Intel(R) Xeon(R) Processor"]
    rows = compare(df, baseline="b", n_resamples=50)
    a = _row(rows, "a")
    assert a.vs_baseline is None and a.baseline_other_machine == [
        "cpu: AMD EPYC 7763",
        "cpu: Intel(R) Xeon(R) Processor",
    ]
    assert a.apart == {"machine": "cpu: AMD EPYC 7763"}
    text = format_table(rows, by="proposer", baseline="b", level=0.95)
    assert "- (other machine)" in text
    assert (
        "note: arms timed on another machine than the baseline (a: cpu: AMD EPYC 7763 vs cpu: Intel(R) Xeon(R) "
        "Processor) have no ratio to it"
    ) in text
    df["hardware.device_name"] = ["Intel(R) Xeon(R) Processor"] * 2  # one machine: the ratio is back
    a = _row(compare(df, baseline="b", n_resamples=50), "a")
    assert a.vs_baseline is not None and a.baseline_other_machine == [] and a.apart == {}
    # one value's runs of two machines: an arm per machine, named by it (test_an_arm_s_runs_on_two_machines...)
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "a", "prompts": prompts}})
    df["hardware.device"], df["hardware.device_name"] = ["cuda:0", "cuda"], ["NVIDIA H100", "NVIDIA H200"]
    assert {r.arm for r in compare(df, n_resamples=50)} == {
        "a (machine=cuda: NVIDIA H100)",
        "a (machine=cuda: NVIDIA H200)",
    }


def test_runs_of_other_code_or_library_versions_say_so_when_pooled_or_compared():
    """One arm's runs of two harness builds (or torch versions) pooled with nothing said: the
    forwards they timed are not the same code. Its mixed axes name them, and an arm set against a
    baseline of other code says so (the ratio stands: the same machine timed both)."""
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "a", "prompts": prompts}})
    df["harness_code"] = ["1585c078c17d26dc", "1585c078c17d26dc"]
    df["hardware.torch"] = ["2.13.0+cpu", "2.13.0+cpu"]
    df["hardware.transformers"] = ["5.24.0", "5.24.0"]
    (row,) = [r for r in compare(df, n_resamples=50) if r.category == ALL]
    assert "software" not in row.varying
    df["harness_code"] = ["1585c078c17d26dc", "99aa00bb11cc22dd"]
    df["hardware.torch"] = ["2.13.0+cpu", "2.14.0+cpu"]
    (row,) = [r for r in compare(df, n_resamples=50) if r.category == ALL]
    assert row.varying["software"] == [
        "harness 1585c078c17d, torch 2.13.0+cpu, transformers 5.24.0",
        "harness 99aa00bb11cc, torch 2.14.0+cpu, transformers 5.24.0",
    ]
    assert "software=harness 1585c078c17d" in format_table([row], by="proposer", baseline=None, level=0.95)
    df["proposer"] = ["a", "b"]
    a = _row(compare(df, baseline="b", n_resamples=50), "a")
    assert a.vs_baseline is not None
    assert a.apart == {"software": "harness 1585c078c17d, torch 2.13.0+cpu, transformers 5.24.0"}
    # records without a code hash (written before they named it) read as unknown, not as a difference
    df = df.drop(columns=["harness_code", "hardware.torch", "hardware.transformers"])
    assert "software" not in _row(compare(df, baseline="b", n_resamples=50), "a").apart


def test_an_arm_s_runs_on_two_machines_are_arms_apart_and_the_leaderboard_follows():
    """One arm pooled runs timed on a CPU and on an H100: one interval over two machines' times (a
    prompt run on both summed its milliseconds), said only in a mixed-axes cell cut after four keys.
    Each machine is its own arm now, named by it, in the table and the leaderboard alike."""
    from harness.tracking.compare import leaderboard

    cpu = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    gpu = [("p1", "c", 1, 10, 2, 10), ("p2", "c", 1.2, 10, 2, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": cpu}, "r2": {"proposer": "a", "prompts": gpu}})
    df["hardware.device"], df["hardware.device_name"] = ["cpu", "cuda:0"], ["AMD EPYC", "NVIDIA H100"]
    for column, value in (("topology", ["t1", "t2"]), ("verifier", ["g", "h"]), ("workload", ["w1", "w2"])):
        df[column] = value  # enough other differences to fill the mixed-axes cell
    df["config.topology.max_nodes"], df["config.topology.max_depth"] = [4, 8], [2, 3]
    rows = compare(df, n_resamples=50)
    cpu_arm, gpu_arm = "a (machine=cpu: AMD EPYC)", "a (machine=cuda: NVIDIA H100)"
    assert {r.arm for r in rows} == {cpu_arm, gpu_arm}
    assert _row(rows, cpu_arm).time_per_committed_token_ms.value == pytest.approx(1.1)
    assert _row(rows, gpu_arm).time_per_committed_token_ms.value == pytest.approx(0.11)
    assert all("machine" not in r.varying for r in rows)
    text = format_table(rows, by="proposer", baseline=None, level=0.95)
    assert cpu_arm in text and gpu_arm in text
    _, board = leaderboard(df, n_resamples=50)
    assert {r.arm for r in board} == {cpu_arm, gpu_arm}
    # the bare value as a baseline names the split arms to choose from (it said the arm had no runs)
    with pytest.raises(ValueError, match=r"baseline proposer='a' ran on several target models or machines"):
        compare(df, n_resamples=50, baseline="a")
    assert _row(compare(df, n_resamples=50, baseline=cpu_arm), cpu_arm).time_per_committed_token_ms.value > 0
    # with the model split too, the arm names both
    df["model"] = ["m1", "m2"]
    assert {r.arm for r in compare(df, n_resamples=50)} == {
        "a (model=m1, machine=cpu: AMD EPYC)",
        "a (model=m2, machine=cuda: NVIDIA H100)",
    }


def test_an_arm_pooling_runs_of_other_code_is_noted_and_its_cell_names_it_first():
    """An arm pooling two harness builds said so only inside its mixed-axes cell, after up to four
    other keys and then cut ("and N more"). A note under the table names it with its builds, and the
    cell lists software before any other key."""
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "a", "prompts": prompts}})
    for column, value in (("topology", ["t1", "t2"]), ("verifier", ["g", "h"]), ("workload", ["w1", "w2"])):
        df[column] = value
    df["config.topology.max_nodes"], df["config.topology.max_depth"] = [4, 8], [2, 3]
    df["temperature"] = [0.0, 0.7]  # a fourth axis: software came fifth among the keys, and was cut
    df["harness_code"] = ["1585c078c17d26dc", "99aa00bb11cc22dd"]
    text = format_table(compare(df, n_resamples=50), by="proposer", baseline=None, level=0.95)
    assert (
        "note: arms pooling runs of other code (a: harness 1585c078c17d, torch -, transformers - / harness "
        "99aa00bb11cc, torch -, transformers -): their times are of different builds"
    ) in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("a ") and " all " in ln]
    cell = line.split("  ")[-1].strip()
    assert cell.endswith("and 3 more") and cell.startswith("software=harness")
    df["harness_code"] = "1585c078c17d26dc"  # one build: nothing to say
    assert "other code" not in format_table(compare(df, n_resamples=50), by="proposer", baseline=None, level=0.95)


def test_an_arm_s_runs_of_several_target_models_are_arms_apart():
    """by=batch_size pooled a tiny-model run with a SmolLM2 run into one arm with one interval, flagged
    only in its mixed-axes cell; each model is its own arm now."""
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "a", "prompts": prompts}})
    df["model"] = ["smollm2", "tiny"]
    arms = {r.arm for r in compare(df, n_resamples=50)}
    assert arms == {"a (model=smollm2)", "a (model=tiny)"}


def test_two_dtypes_of_one_model_are_two_arms_with_no_ratio_between_them(tmp_path):
    """Two records identical but for the target's dtype were pooled into one arm (the model label was
    read without its ``@dtype``), and against a baseline of the other dtype kept a ratio: one dtype's
    times over another's. Each dtype is its own arm, named by its model label, in the table and the
    leaderboard, and has no ratio to a baseline of the other dtype."""
    from harness.tracking.compare import leaderboard

    template = fixture_record(1)
    proposer = template["axes"]["proposer"]
    for name, dtype, model in (("fp32", "float32", "tiny"), ("bf16", "bfloat16", "tiny@bfloat16")):
        record = json.loads(json.dumps(template))
        record["run_id"] = f"{template['run_id']}-{name}"
        record["axes"]["model"] = model
        record["config"]["model"]["dtype"] = dtype
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        shutil.copy(fixture_run(1) / "outputs.jsonl", folder / "outputs.jsonl")
        shutil.copy(fixture_run(1) / "rounds.jsonl", folder / "rounds.jsonl")  # the round series it names
        (folder / "record.json").write_text(json.dumps(record))
    df = aggregate(tmp_path / "runs")
    rows = compare(df, n_resamples=50)
    fp32, bf16 = f"{proposer} (model=tiny)", f"{proposer} (model=tiny@bfloat16)"
    assert {r.arm for r in rows} == {fp32, bf16}
    assert len(_row(rows, fp32).run_ids) == 1 and len(_row(rows, bf16).run_ids) == 1
    _, board = leaderboard(df, n_resamples=50)
    assert sorted(r.arm for r in board) == sorted([fp32, bf16])
    with_base = compare(df, baseline=fp32, n_resamples=50)
    assert _row(with_base, bf16).vs_baseline is None
    assert _row(with_base, bf16).baseline_other_model == ["tiny@bfloat16", "tiny"]
    text = format_table(with_base, by="proposer", baseline=fp32, level=0.95)
    assert "- (other model)" in text and f"({bf16}: model tiny@bfloat16 vs tiny) have no ratio to it" in text


def test_arms_by_a_config_key_are_not_set_apart_by_that_key_and_a_numeric_baseline_matches_its_arm():
    """by=config.topology.max_nodes named max_nodes itself as what else set the arms apart, and
    baseline=0.0 found no arm labelled 0 (filters match numbers)."""
    pa = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "a", "prompts": pa}})
    df["config.topology.max_nodes"] = [4, 8]
    by = "config.topology.max_nodes"
    table = format_table(compare(df, by=by, n_resamples=50), by=by, baseline=None, level=0.95)
    assert "differ in more than" not in table
    df["temperature"] = [0.0, 0.7]
    rows = compare(df, by="temperature", baseline="0.0", n_resamples=50)
    assert {r.arm for r in rows} == {"0", "0.7"}
    assert next(r for r in rows if r.arm == "0.7" and r.category == "all").has_baseline
    assert next(r for r in rows if r.arm == "0.7" and r.category == "all").n_pairs_baseline == 2
    with pytest.raises(ValueError, match=r"baseline temperature='0.5' has no runs"):
        compare(df, by="temperature", baseline="0.5", n_resamples=50)


def test_mixed_axes_lists_the_options_every_run_sets_when_their_group_s_axis_differs_too():
    """A pooled arm whose runs differ in topology and in a max_nodes both topologies take listed
    the topology only; an option one topology lacks stays out."""
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "a", "prompts": prompts}})
    df["topology"] = ["sequence", "expansion"]
    df["config.topology.max_nodes"] = [2, 8]
    df["config.topology.expansion_width"] = [None, 4]
    df["config.model.tiny.hidden_size"] = [32, 64]
    assert _row(compare(df, n_resamples=50), "a").varying == {
        "topology": ["expansion", "sequence"],
        "model.tiny.hidden_size": ["32", "64"],
        "topology.max_nodes": ["2", "8"],
    }


def test_the_outlier_note_names_each_arm_once_with_its_whole_count():
    from harness.tracking.compare import outlier_note

    prompts = [("p1", "x", 10, 10, 20, 10), ("p2", "y", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}})
    stalls = [{"prompt_id": p, "arm": "ar", "ms_per_round": 9.0, "median_ms_per_round": 2.0} for p in ("p1", "p2")]
    df["timing_outliers"] = [json.dumps(stalls)]
    note = outlier_note(compare(df, n_resamples=50))
    assert "(a (2 flagged))" in note and note.count("flagged)") == 1


def test_leaderboard_prompt_counts_are_per_row_when_the_rows_ran_different_prompts(capsys):
    from harness.tracking.compare import format_leaderboard, leaderboard

    pa = [("p1", "qa", 10, 10, 20, 10), ("p2", "qa", 12, 10, 20, 10), ("p3", "summarization", 9, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "b", "prompts": pa[:1]}})
    columns, rows = leaderboard(df, n_resamples=50)
    text = format_leaderboard(columns, rows, by="proposer", level=0.95)
    assert "prompts per column: summarization=-/1, qa=1/2, overall=1/3 (rows b, a in order" in text
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "b", "prompts": pa}})
    text = format_leaderboard(*leaderboard(df, n_resamples=50), by="proposer", level=0.95)
    assert "prompts per column: summarization=1, qa=2, overall=3\n" in text


def test_leaderboard_option_takes_true_or_false_only(capsys):
    assert main([str(FIXTURES), "leaderboard=maybe"]) == 2
    assert "leaderboard='maybe': must be true or false" in capsys.readouterr().err


def test_one_prompt_with_two_categories_in_one_arm_is_refused_naming_the_runs_and_the_way_out():
    r1 = [("p1", "qa", 10, 10, 20, 10)]
    r2 = [("p1", "summarization", 10, 10, 20, 10)]
    df = _toy({"run-one": {"proposer": "a", "prompts": r1}, "run-two": {"proposer": "a", "prompts": r2}})
    with pytest.raises(ValueError) as err:
        compare(df, n_resamples=50)
    assert str(err.value).startswith(
        "prompt 'p1' (one text) carries different categories in the runs one arm pools ('qa' in run run-one, "
        "'summarization' in run run-two; 1 such prompt(s)): compare those runs apart (by= an axis"
    )


def test_a_batched_run_changes_only_the_intervals_of_the_categories_it_holds():
    """One batch-2 run of code prompts made the arm resample by batch in every category: its chat
    rows (from runs of one request at a time) got another interval, and its vs-baseline cells none."""
    chat = [("c1", "chat", 10, 10, 20, 10), ("c2", "chat", 14, 10, 20, 10), ("c3", "chat", 9, 10, 30, 10)]
    code = [("k1", "code", 10, 10, 20, 10), ("k2", "code", 12, 10, 20, 10)]
    runs = {"r1": {"proposer": "a", "prompts": chat}, "r2": {"proposer": "a", "prompts": chat}}
    runs["b1"] = {"proposer": "b", "prompts": chat}
    alone = compare(_toy(runs), baseline="b", n_resamples=300)
    df = _toy({**runs, "r3": {"proposer": "a", "prompts": code}})
    df.loc[df["run_id"] == "r3", "batch_size"] = 2
    prompts = json.loads(df.loc[df["run_id"] == "r3", "per_prompt"].item())
    for p in prompts:
        p["batch_index"] = 0  # both code prompts in one batch
    df.loc[df["run_id"] == "r3", "per_prompt"] = json.dumps(prompts)
    mixed = compare(df, baseline="b", n_resamples=300)
    assert _row(mixed, "a", "chat").speedup == _row(alone, "a", "chat").speedup
    assert _row(mixed, "a", "chat").vs_baseline == _row(alone, "a", "chat").vs_baseline
    assert _row(mixed, "a", "chat").vs_baseline.ci_low is not None
    # the code category is one batch: one unit, no interval
    assert _row(mixed, "a", "code").speedup.ci_low is None


def test_intervals_over_fewer_than_five_units_are_said_to_be_the_range():
    """Two batches (or two prompts) gave "1.144 [1.041, 1.273]": the two batches' own speedups, shown as
    a 95% interval. Below five resampling units the table says so; from five on it says nothing."""
    few = [(f"p{i}", "c", 10 + i, 10, 20, 10) for i in range(3)]
    many = [(f"p{i}", "c", 10 + i, 10, 20, 10) for i in range(5)]
    rows = compare(_toy({"r1": {"proposer": "a", "prompts": few}, "r2": {"proposer": "b", "prompts": many}}))
    assert _row(rows, "a").n_units == 3 and _row(rows, "b").n_units == 5
    text = format_table(rows, by="proposer", baseline=None, level=0.95)
    assert "note: arms whose intervals resample fewer than 5 prompts or batches (a: 3 prompts): " in text
    # ten prompts of its own, three shared with the baseline: the vs-baseline interval pairs three
    ten = [(f"p{i}", "c", 10 + i, 10, 20, 10) for i in range(10)]
    base = [(f"p{i}", "c", 10 + i, 10, 20, 10) for i in (0, 1, 2, 20, 21)]
    paired = compare(
        _toy({"r1": {"proposer": "a", "prompts": ten}, "r2": {"proposer": "b", "prompts": base}}), baseline="b"
    )
    text = format_table(paired, by="proposer", baseline="b", level=0.95)
    assert "(a: 3 prompts shared with the baseline)" in text
    lone = compare(_toy({"r1": {"proposer": "a", "prompts": few[:1]}}))
    assert "fewer than 5" not in format_table(lone, by="proposer", baseline=None, level=0.95)  # no interval at all
    # eight prompts, two per category: the arm's interval draws eight, each category's two
    cats = [(f"p{i}", f"cat{i // 2}", 10 + i, 10, 20, 10) for i in range(8)]
    text = format_table(
        compare(_toy({"r1": {"proposer": "a", "prompts": cats}})), by="proposer", baseline=None, level=0.95
    )
    assert (
        "note: arms whose intervals resample fewer than 5 prompts or batches (a's categories cat0 (2 prompts), "
        "cat1 (2 prompts), cat2 (2 prompts), cat3 (2 prompts)): "
    ) in text


def test_a_tiny_model_s_shape_is_no_difference_beside_a_model_that_is_not_tiny():
    """Arms on smollm2 and on the tiny model listed model.tiny.max_position_embeddings 512 vs 2048,
    an option smollm2 never reads; between two tiny models it is a real difference."""
    pa = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "b", "prompts": pa}})
    df["model"] = ["smollm2", "tiny"]
    df["config.model.name"] = ["smollm2", "tiny"]
    df["config.model.tiny.max_position_embeddings"] = [512, 2048]
    assert _row(compare(df, n_resamples=50), "a").apart == {"model": "smollm2"}
    df["model"] = ["tiny", "tiny"]
    df["config.model.name"] = ["tiny", "tiny"]
    assert _row(compare(df, n_resamples=50), "a").apart == {"model.tiny.max_position_embeddings": "512"}
    # two tiny arms of different shapes beside a smollm2 arm: their difference still shows
    df = _toy({f"r{i}": {"proposer": p, "prompts": pa} for i, p in enumerate("abc")})
    df["model"] = ["tiny", "tiny", "smollm2"]
    df["config.model.name"] = ["tiny", "tiny", "smollm2"]
    df["config.model.tiny.max_position_embeddings"] = [512, 2048, 512]
    rows = compare(df, n_resamples=50)
    assert _row(rows, "a").apart["model.tiny.max_position_embeddings"] == "512"
    assert _row(rows, "b").apart["model.tiny.max_position_embeddings"] == "2048"
    assert _row(rows, "c").apart["model.tiny.max_position_embeddings"] == "-"  # smollm2 reads no tiny shape


def test_runs_past_their_tokens_per_round_are_counted_on_decode_or_end_to_end():
    """An end-to-end speedup of 3.66x with nothing accepted (prefills timed under load) was shown with no
    word where only the decode speedup was checked."""
    import pandas as pd

    from harness.tracking.compare import _unaccepted_runs

    runs = pd.DataFrame(
        {
            "decode_speedup": [0.48, 1.3, 1.9, 0.9],
            "speedup": [3.66, 1.2, 1.8, None],
            "mean_committed_per_round": [1.0, 1.0, 2.0, 1.0],
        }
    )
    assert _unaccepted_runs(runs) == 2  # the first (end to end) and the second (decode)
    assert _unaccepted_runs(runs.drop(columns=["speedup"])) == 1


def test_a_batched_run_is_held_to_its_arms_batch_rounds_not_a_requests_tokens_per_round():
    """At batch 4 one verify forward serves every live request: 32 baseline batch steps against 4
    speculative batch rounds allow 8x, though a request commits 7.36 tokens per round; at batch 3 with
    the bound 1.28x (below its 1.40 tokens per round) a 1.5x run is past it."""
    import pandas as pd

    from harness.tracking.compare import _unaccepted_runs

    runs = pd.DataFrame(
        {
            "decode_speedup": [7.9, 8.5, 1.5],
            "speedup": [7.0, 7.5, 1.2],
            "mean_committed_per_round": [7.36, 7.36, 1.40],
            "batch_requests": [json.dumps([4]), json.dumps([4]), json.dumps([3])],
            "ar_batch_rounds": [32, 32, 32],
            "ar_tokens": [128, 128, 96],
            "batch_rounds": [4, 4, 25],
            "committed_tokens": [128, 128, 96],
        }
    )
    assert _unaccepted_runs(runs) == 2  # the second and the third
    # read as batch 1 (no batch sizes stored): each past 1.05x its tokens per round
    assert _unaccepted_runs(runs.drop(columns=["batch_requests"])) == 3


def test_compare_names_the_jobs_that_wrote_no_record(tmp_path, capsys):
    """A sweep's failures file names the jobs that wrote no record: compare said nothing of them (an
    arm whose every job failed simply was not in the table). It names them under the table, and in
    its JSON."""
    root = tmp_path / "sweep"
    shutil.copytree(fixture_run(1), root / fixture_run(1).name)
    assert main([str(root), "resamples=50"]) == 0
    assert "wrote no record" not in capsys.readouterr().out
    failures = [
        {
            "job": f"proposer=rest,seed={k}",
            "stage": "gates",
            "refused": False,
            "error": {"type": "GateFailure", "message": "equivalence"},
        }
        for k in range(7)
    ]
    (root / "failures.jsonl").write_text("".join(json.dumps(f) + "\n" for f in failures))
    assert main([str(root), "resamples=50", f"json={tmp_path / 'c.json'}"]) == 0
    out = capsys.readouterr().out
    assert (
        "note: 7 job(s) wrote no record (failures.jsonl), so no arm above counts them and an arm whose every job "
        "failed is missing: proposer=rest,seed=0 (failed at gates: GateFailure);"
    ) in out
    assert "; and 2 more" in out
    written = json.loads((tmp_path / "c.json").read_text())["jobs_without_record"]
    assert [f["job"] for f in written] == [f["job"] for f in failures]


def test_a_list_option_filters_by_value_however_it_is_spaced():
    """``topology.widths=[2,2,1]``, as Hydra and the sweep's folder names spell it, matched nothing
    (the store holds ``[2, 2, 1]``); a list or mapping is compared as a value."""
    from harness.tracking.compare import filter_runs

    prompts = [("p1", "c", 10, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "b", "prompts": prompts}})
    df["config.topology.widths"] = [json.dumps([2, 2, 1]), json.dumps([])]
    df["config.proposer.sources"] = [json.dumps(["rest", "prompt_lookup"]), None]
    for spelt in ("[2,2,1]", "[2, 2, 1]", " [2,2, 1]"):
        assert list(filter_runs(df, {"topology.widths": spelt})["run_id"]) == ["r1"]
    assert list(filter_runs(df, {"topology.widths": "[]"})["run_id"]) == ["r2"]
    assert filter_runs(df, {"topology.widths": "[2,2]"}).empty
    assert filter_runs(df, {"topology.widths": "[2,2,1"}).empty  # not a list: no match, no error
    assert list(filter_runs(df, {"proposer.sources": "[rest,prompt_lookup]"})["run_id"]) == ["r1"]


def test_by_batch_size_reads_the_batch_size_of_arms_relabelled_for_what_else_they_are(capsys):
    """``by=batch_size`` relabelled an ungated heuristic run's batch size as text (``1 [heuristic,
    exact=false]``) and then read it back as a number: the comparison was refused with "invalid
    literal for int()". The arm's label and the batch size it ran are kept apart now."""
    from harness.tracking.compare import leaderboard

    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    df = _toy(
        {
            "r1": {"proposer": "a", "prompts": prompts, "section": "ungated"},
            "r2": {"proposer": "a", "prompts": prompts, "section": "ungated"},
            "r3": {"proposer": "a", "prompts": prompts},
        }
    )
    df["exact"], df["cpu_budget_artifact"] = [False, True, True], [False, True, False]
    df["batch_size"] = [1, 4, 1]
    df["per_prompt"] = [
        json.dumps([{**p, "batch_index": 0} for p in json.loads(v)]) if b > 1 else v
        for v, b in zip(df["per_prompt"], df["batch_size"], strict=True)
    ]
    rows = [r for r in compare(df, by="batch_size", n_resamples=50) if r.category == ALL]
    assert {(r.section, r.arm, r.batch_sizes) for r in rows} == {
        ("ungated", "1 [heuristic, exact=false]", (1,)),
        ("ungated", "4 [CPU-budget artifact]", (4,)),
        ("exact", "1", (1,)),
    }
    assert _row(rows, "4 [CPU-budget artifact]", section="ungated").n_units == 1  # a batch of two requests
    _, board = leaderboard(df, by="batch_size", n_resamples=50)
    assert {r.arm for r in board} == {"1 [heuristic, exact=false]", "4 [CPU-budget artifact]", "1"}


def test_an_arm_s_interval_does_not_change_when_an_unrelated_older_record_joins_the_frame():
    """One record without prompt fingerprints, in another section, switched every prompt's pairing key
    from its fingerprint to its workload source: the prompts were resampled in another order, so the
    seeded bootstrap drew other intervals for arms that record has nothing to do with (and the report's
    table and plot disagreed). Prompts are resampled in the order of their ids whatever pairs them."""
    from harness.tracking.compare import leaderboard, run_speedups

    rng = np.random.default_rng(0)

    def prompts(sha: bool) -> list[tuple]:
        out = []
        for i in range(1, 13):
            spec = float(rng.uniform(5, 50))
            out.append((f"p{i}", "c", spec, 16, spec * float(rng.uniform(0.8, 2.5)), 16, sha and f"{i:016d}"))
        return out

    def frame(runs: dict) -> pd.DataFrame:
        df = _toy({k: {**v, "prompts": [p[:6] for p in v["prompts"]]} for k, v in runs.items()})
        df["per_prompt"] = [
            json.dumps(
                [
                    {**q, **({"prompt_sha256": p[6]} if p[6] else {})}
                    for q, p in zip(json.loads(pp), runs[rid]["prompts"], strict=True)
                ]
            )
            for pp, rid in zip(df["per_prompt"], df["run_id"], strict=True)
        ]
        df["config.workload.name"] = "w"
        return df

    a = {"proposer": "a", "prompts": prompts(sha=True)}
    old = {"proposer": "b", "prompts": prompts(sha=False), "section": "ungated"}
    alone, both = frame({"ra": a}), frame({"ra": a, "rold": old})
    first, second = _row(compare(alone), "a"), _row(compare(both), "a")
    assert (first.speedup, first.time_per_committed_token_ms) == (second.speedup, second.time_per_committed_token_ms)
    assert first.speedup.ci_low < first.speedup.value < first.speedup.ci_high
    cells = [next(r for r in leaderboard(df)[1] if r.arm == "a").cells["overall"] for df in (alone, both)]
    assert cells[0] == cells[1]
    # one run's own interval (the report's speedup-vs-batch points) is the arm's of that run alone
    assert run_speedups(json.loads(alone["per_prompt"][0]), alone.iloc[0])[0] == first.speedup


def test_arms_by_the_machine_are_compared_with_a_baseline_machine():
    """``by=hardware.device_name baseline=...`` refused every ratio as "(other machine)": the arms
    differ in their machine by design, as arms by model differ in their model."""
    prompts = [("p1", "c", 10, 10, 20, 10), ("p2", "c", 12, 10, 20, 10)]
    fast = [("p1", "c", 5, 10, 20, 10), ("p2", "c", 6, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": prompts}, "r2": {"proposer": "a", "prompts": fast}})
    df["hardware.device"] = ["cuda:0", "cuda:0"]
    df["hardware.device_name"] = ["NVIDIA H100", "NVIDIA H200"]
    for by in ("hardware.device_name", "hardware.device"):
        if by == "hardware.device":
            df["hardware.device"], df["hardware.device_name"] = ["cpu", "cuda:0"], ["-", "-"]
        base = "NVIDIA H100" if by == "hardware.device_name" else "cpu"
        rows = compare(df, by=by, baseline=base, n_resamples=50)
        (other,) = [r for r in rows if r.category == ALL and r.arm != base]
        assert other.baseline_other_machine == [] and other.vs_baseline.value == pytest.approx(2.0)
        assert "machine" not in other.baseline_differs and other.apart == {}
        text = format_table(rows, by=by, baseline=base, level=0.95)
        assert "(other machine)" not in text and "differ in more than" not in text


def test_the_json_names_the_records_left_out_for_changed_outputs(tmp_path, capsys):
    """A record whose bound outputs changed is left out of the comparison, said on stderr and in the
    report, but the JSON did not say so: a reader of the JSON alone took the arms for every record."""
    root = tmp_path / "sweep"
    for n in (1, 3):
        shutil.copytree(fixture_run(n), root / fixture_run(n).name)
    with open(root / fixture_run(3).name / "outputs.jsonl", "a", encoding="utf-8") as fh:
        fh.write("{}\n")
    assert main([str(root), "resamples=50", f"json={tmp_path / 'c.json'}"]) == 0
    written = json.loads((tmp_path / "c.json").read_text())["left_out_records"]
    assert [f["folder"] for f in written] == [fixture_run(3).name]
    assert written[0]["why"].startswith("its outputs.jsonl is not the one the record binds (sha256 ")
    shutil.rmtree(root / fixture_run(3).name)
    assert main([str(root), "resamples=50", f"json={tmp_path / 'c.json'}"]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["left_out_records"] == []


#: six prompts (id, category, spec ms, spec tokens, AR ms, AR tokens) for the batched-unit tests
_SIX = [
    ("p0", "c", 10, 10, 20, 10),
    ("p1", "c", 30, 10, 30, 10),
    ("p2", "c", 10, 5, 12, 5),
    ("p3", "c", 100, 10, 100, 10),
    ("p4", "c", 20, 10, 50, 10),
    ("p5", "c", 15, 10, 15, 10),
]


def _batched(df: pd.DataFrame, batches: dict[str, dict[str, int]]) -> pd.DataFrame:
    """``df`` with the runs named in ``batches`` (run id -> {prompt id: batch index}) at batch size 2."""
    df = df.copy()
    for run, index in batches.items():
        entries = json.loads(df.loc[df["run_id"] == run, "per_prompt"].item())
        df.loc[df["run_id"] == run, "per_prompt"] = json.dumps(
            [{**e, "batch_index": index[e["prompt_id"]]} for e in entries]
        )
        df.loc[df["run_id"] == run, "batch_size"] = 2
    return df


_PAIRS = {"p0": 0, "p1": 0, "p2": 1, "p3": 1, "p4": 2, "p5": 2}  # batches {p0, p1}, {p2, p3}, {p4, p5}


def _boot(*data):
    return paired_bootstrap(
        data, speedup_statistic, confidence_level=0.95, n_resamples=300, seed=0, method="percentile"
    )


def test_repeated_batched_runs_add_no_resampling_units():
    """Two seeds of one batched configuration were resampled as six independent batches, not three:
    the same data twice gave an interval about 40% narrower. Repeats now sum into the units one run
    has, as repeats at batch 1 sum by prompt, and a batch-1 run pooled with a batched one puts each
    prompt in one unit (the components of the batches its prompts shared)."""
    one = _batched(_toy({"s0": {"proposer": "a", "prompts": _SIX}}), {"s0": _PAIRS})
    two = _batched(
        _toy({"s0": {"proposer": "a", "prompts": _SIX}, "s1": {"proposer": "a", "prompts": _SIX}}),
        {"s0": _PAIRS, "s1": _PAIRS},
    )
    mixed = _batched(
        _toy({"s0": {"proposer": "a", "prompts": _SIX}, "s1": {"proposer": "a", "prompts": _SIX}}), {"s0": _PAIRS}
    )  # s1 at batch 1
    # the three batches' sums: spec 40/20, 110/15, 35/20 ms/tokens; AR 50/20, 112/15, 65/20
    expected = _boot([50.0, 112.0, 65.0], [20.0, 15.0, 20.0], [40.0, 110.0, 35.0], [20.0, 15.0, 20.0])
    assert expected.value == pytest.approx((227 / 55) / (185 / 55))
    assert expected.ci_low < expected.value < expected.ci_high
    for df in (one, two, mixed):
        row = _row(compare(df, n_resamples=300), "a")
        assert row.n_units == 3 and row.n_prompts == 6
        assert row.speedup == expected  # twice the sums: the same ratios, the same interval
    # the leaderboard's cell draws the same three units
    from harness.tracking.compare import leaderboard

    for df in (one, two, mixed):
        (cell,) = [r.cells["overall"] for r in leaderboard(df, n_resamples=300)[1]]
        assert cell.speedup == expected


def test_resampling_units_join_the_prompts_that_shared_a_batch_in_any_run():
    from harness.tracking.compare import resampling_units

    long = pd.DataFrame(
        {
            "prompt_id": ["p0", "p1", "p2", "p3", "p1", "p2", "p3", "p4", "p5", "p5"],
            "batch_unit": ["x/batch 0", "x/batch 0", "x/batch 1", "x/batch 1"]  # run x: {p0, p1}, {p2, p3}
            + ["y/batch 0", "y/batch 0", "y/batch 1", "y/batch 1"]  # run y: {p1, p2}, {p3, p4}
            + ["p5", "p5"],  # p5 at batch 1 in two runs: a unit of its own
        }
    )
    assert resampling_units(long) == {"p0": "p0", "p1": "p0", "p2": "p0", "p3": "p0", "p4": "p0", "p5": "p5"}


def test_a_batched_arm_s_ratio_to_the_baseline_resamples_the_batches_of_both_arms():
    """An arm of batched runs had a vs-baseline point and no interval. Both arms now resample the
    components of the prompts' batches in either arm's runs, each arm's times summed over them."""
    base = [("p0", "c", 15, 10, 20, 10), ("p1", "c", 40, 10, 30, 10), ("p2", "c", 10, 5, 12, 5)]
    base += [("p3", "c", 90, 10, 100, 10), ("p4", "c", 30, 10, 50, 10), ("p5", "c", 30, 10, 15, 10)]
    df = _toy({"ra": {"proposer": "a", "prompts": _SIX}, "rb": {"proposer": "b", "prompts": base}})
    # the baseline at batch 1: the units are a's batches; b's spec 55/20, 100/15, 60/20 over them
    rows = compare(_batched(df, {"ra": _PAIRS}), baseline="b", n_resamples=300)
    expected = _boot([55.0, 100.0, 60.0], [20.0, 15.0, 20.0], [40.0, 110.0, 35.0], [20.0, 15.0, 20.0])
    a = _row(rows, "a")
    assert a.vs_baseline == expected and expected.ci_low < expected.ci_high
    assert (a.n_pairs_baseline, a.n_pair_units) == (6, 3)
    text = format_table(rows, by="proposer", baseline="b", level=0.95)
    assert "fewer than 5 prompts or batches (a: 3 batches, 3 batches of 6 prompts shared with the baseline): " in text
    # the baseline batched {p1, p2} together: with a's {p0, p1} and {p2, p3}, one unit {p0..p3}, and {p4, p5}
    b_batches = {"p1": 0, "p2": 0, "p0": 1, "p3": 2, "p4": 3, "p5": 4}
    rows = compare(_batched(df, {"ra": _PAIRS, "rb": b_batches}), baseline="b", n_resamples=300)
    expected = _boot([155.0, 60.0], [35.0, 20.0], [150.0, 35.0], [35.0, 20.0])
    a = _row(rows, "a")
    assert a.vs_baseline == expected and a.n_pair_units == 2
    assert _row(rows, "a").n_units == 3 and _row(rows, "b").n_units == 5  # each arm's own interval: its batches


def test_a_category_named_all_is_its_own_row_beside_the_summary():
    """A workload category named ``all`` was taken for the summary row: its row held every prompt
    and each arm's summary printed twice. It is shown as ``all (category)``."""
    prompts = [("a", "all", 10, 10, 20, 10), ("b", "all", 30, 10, 30, 10), ("c", "code", 10, 5, 10, 5)]
    prompts.append(("d", "code", 100, 10, 100, 10))
    rows = [r for r in compare(_toy({"r1": {"proposer": "pl", "prompts": prompts}}), n_resamples=50) if r.arm == "pl"]
    assert [(r.category, r.n_prompts) for r in rows] == [("all (category)", 2), ("code", 2), ("all", 4)]
    assert rows[0].speedup.value == pytest.approx((50 / 20) / (40 / 20))  # its two prompts only
    assert rows[2].speedup.value == pytest.approx((160 / 35) / (150 / 35))
    text = format_table(rows, by="proposer", baseline=None, level=0.95)
    assert [line.split()[:3] for line in text.splitlines() if line.startswith("pl ")] == [
        ["pl", "all", "(category)"],
        ["pl", "code", "2"],
        ["pl", "all", "4"],
    ]
    # no category reads as the summary, nor two as one
    from harness.tracking.compare import category_label

    assert category_label("all", "all") == "all (category)"
    assert category_label("all (category)", "all") == "all (category) (category)"
    assert category_label("code", "all") == "code" and category_label("overall", "all") == "overall"


def test_the_leaderboard_says_when_rows_of_equal_counts_ran_different_prompts():
    """Arms of as many prompts, some of them other prompts (other ids, or one id with other text): the
    leaderboard gives each row's count and notes that the arms ran different prompts, as the comparison
    table does; arms of the same prompts, or arms by workload, get one count per column and no note."""
    from harness.tracking.compare import format_leaderboard, leaderboard, leaderboard_json

    pa = [("p1", "qa", 10, 10, 20, 10), ("p2", "qa", 12, 10, 20, 10), ("p3", "code", 9, 10, 20, 10)]
    pb = [("p1", "qa", 11, 10, 20, 10), ("p4", "qa", 14, 10, 20, 10), ("p5", "code", 8, 10, 20, 10)]
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "b", "prompts": pb}})
    columns, rows = leaderboard(df, n_resamples=50)
    assert {r.arm: r.prompts["overall"] for r in rows} == {"a": {"p1", "p2", "p3"}, "b": {"p1", "p4", "p5"}}
    text = format_leaderboard(columns, rows, by="proposer", level=0.95)
    order = ", ".join(r.arm for r in rows)
    assert f"prompts per column: qa=2/2, code=1/1, overall=3/3 (rows {order} in order: the rows ran different" in text
    arms = ", ".join(f"{r.arm}: 3" for r in rows)
    assert f"note: the arms ran different prompts ({arms}; 1 common to all)" in text
    assert any(
        "the arms ran different prompts" in n for n in leaderboard_json(columns, rows, by="proposer")["notes"]["exact"]
    )
    # the same ids with other content (fingerprints) are other prompts too
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "b", "prompts": pa}})
    df["per_prompt"] = [
        json.dumps(
            [
                {**q, "prompt_sha256": f"{run}{q['prompt_id']}" if q["category"] == "code" else "s"}
                for q in json.loads(pp)
            ]
        )
        for run, pp in zip(("x", "y"), df["per_prompt"], strict=True)
    ]
    text = format_leaderboard(*leaderboard(df, n_resamples=50), by="proposer", level=0.95)
    assert "qa=2/2, code=1/1, overall=3/3" in text and "; 2 common to all)" in text
    # the same prompts: one count per column and no note; arms by workload run other prompts by design
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "b", "prompts": pa}})
    text = format_leaderboard(*leaderboard(df, n_resamples=50), by="proposer", level=0.95)
    assert "prompts per column: qa=2, code=1, overall=3\n" in text and "different prompts" not in text
    df = _toy({"r1": {"proposer": "a", "prompts": pa}, "r2": {"proposer": "a", "prompts": pb}})
    df["workload"] = ["w1", "w2"]
    text = format_leaderboard(*leaderboard(df, by="workload", n_resamples=50), by="workload", level=0.95)
    assert "note: the arms ran different prompts" not in text


def _batch_one_prompts(k: int = 8) -> list[dict]:
    """Prompts of a run at batch 1, each with its request's latency and its batch's decode time (the
    request's plus the loop's time around it, more for the speculative arm): every request's own
    speedup exactly 2, the batches' a little less."""
    return [
        {
            "prompt_id": f"p{i}",
            "prompt_sha256": f"{i:064d}",
            "category": "code",
            "spec_decode_ms": 10.0 + i,
            "spec_tokens": 10,
            "ar_decode_ms": 2 * (10.0 + i),
            "ar_tokens": 10,
            "spec_prefill_ms": 3.0,
            "ar_prefill_ms": 2.0,
            "spec_batch_decode_ms": 10.0 + i + 0.4 + 0.1 * (i % 3),
            "ar_batch_decode_ms": 2 * (10.0 + i) + 0.1,
            "batch_requests": 1,
            "batch_index": i,
        }
        for i in range(k)
    ]


def test_a_run_s_decode_speedup_lies_in_its_own_interval_at_batch_1():
    """At batch 1 a record's decode speedup divides its batches' decode times (a little over the
    requests' latencies): a run's interval is drawn from those same columns, so its point is the
    record's and lies inside it, even where the requests' own speedup lies outside."""
    from harness.tracking.compare import run_speedups

    prompts = _batch_one_prompts()

    def ratio(spec: str, ar: str, extra: str | None = None) -> float:
        add = (lambda q: q[extra]) if extra else (lambda q: 0.0)
        s = sum(q[spec] + add(q) for q in prompts) / sum(q["spec_tokens"] for q in prompts)
        a = sum(q[ar] + add(q) for q in prompts) / sum(q["ar_tokens"] for q in prompts)
        return a / s

    point = ratio("spec_batch_decode_ms", "ar_batch_decode_ms")  # the record's decode_speedup (Arms.metrics)
    decode, e2e = run_speedups(prompts)
    assert decode.value == pytest.approx(point, rel=1e-12) and point < 2.0
    assert decode.ci_low <= point <= decode.ci_high and decode.ci_high < 2.0  # the requests' 2.0 lies outside
    wall_spec = sum(q["spec_batch_decode_ms"] + q["spec_prefill_ms"] for q in prompts)
    wall_ar = sum(q["ar_batch_decode_ms"] + q["ar_prefill_ms"] for q in prompts)
    assert e2e.value == pytest.approx(wall_ar / wall_spec, rel=1e-12) and e2e.ci_low <= e2e.value <= e2e.ci_high
    # the fixture sweep's batch-1 records: each decode and end-to-end speedup is its interval's point
    for number in range(1, 12):
        record = fixture_record(number)
        if record["axes"]["batch_size"] != 1:
            continue
        decode, e2e = run_speedups(record["per_prompt"])
        m = record["metrics"]
        assert decode.value == pytest.approx(m["decode_speedup"], rel=1e-12), number
        assert e2e.value == pytest.approx(m["speedup"], rel=1e-12), number
        assert decode.ci_low <= m["decode_speedup"] <= decode.ci_high, number
    # requests that shared a batch (or a record without batch times): each request's latency, as compare reads it
    shared = [{**q, "batch_requests": 2} for q in prompts]
    older = [{k: v for k, v in q.items() if "batch" not in k} for q in prompts]
    for rows in (shared, older):
        assert run_speedups(rows)[0].value == pytest.approx(2.0, rel=1e-12)
