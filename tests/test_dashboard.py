"""`harness dashboard`: the design-review panel specification, tested offline.

The specification is checked against what a tracked run really logs (an offline W&B run of a
fixture record, read back with `wandb leet inspect`), and translated into W&B's report objects
(wandb-workspaces) without a server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import FIXTURE_SWEEP, fixture_run, history, inspect_run, run_info

from harness.app import dashboard_groups, dashboard_main
from harness.tracking.conventions import LABEL_AXES
from harness.tracking.dashboard import build_spec, spec_metrics, validate_spec
from harness.tracking.store import load_record
from harness.tracking.wandb_tracker import open_run

FIXTURES = FIXTURE_SWEEP
#: between them: t(n) (prompt lookup's adaptive budget) and a depth tried by at least 30 rounds (hydra)
FIXTURE_RUNS = (fixture_run(11), fixture_run(9))
REVIEW_PANELS = [
    "speedup_by_proposer_workload",
    "acceptance_by_depth",
    "reach_by_depth",
    "rounds_tried_by_depth",
    "frontier",
    "round_cost_ledger",
    "speedup_vs_batch",
    "round_ms",
    "committed_per_round",
    "t_profile",
    "memory",
    "axes",
]


#: the fixture records ran untracked
UNTRACKED_NOTE = (
    f"none of the 11 record(s) of group 'fixture-sweep' under {FIXTURES} was logged to W&B: the panels stay empty "
    "until a launch with tracking=wandb logs them (records= reads another folder of the group)"
)


def _spec_from_cli(tmp_path, capsys, *args: str) -> tuple[int, dict | None, str, str]:
    out = tmp_path / "dashboard.json"
    rc = dashboard_main(["fixture-sweep", f"records={FIXTURES}", f"out={out}", *args])
    captured = capsys.readouterr()
    return rc, json.loads(out.read_text()) if out.exists() else None, captured.out, captured.err


def test_offline_writes_the_review_specification_and_says_how_to_publish(tmp_path, capsys):
    rc, spec, out, err = _spec_from_cli(tmp_path, capsys)
    assert rc == 0 and err == f"harness dashboard: note: {UNTRACKED_NOTE}\n"
    assert validate_spec(spec) is spec
    assert "wrote" in out and "the options that tell runs apart in 11 records" in out
    assert f"harness dashboard --publish {tmp_path / 'dashboard.json'} entity=<your W&B entity>" in out
    assert spec["group"] == "fixture-sweep" and spec["project"] == "spec-harness"
    review, apart, failed = spec["sections"]
    assert [p["id"] for p in review["panels"]] == REVIEW_PANELS
    # gated exact runs apart from ungated / heuristic / CPU-budget runs and from failed or refused ones
    assert review["filter"] == (
        "Group = 'fixture-sweep' and State = 'finished' and Tags not in ['ungated', 'heuristic', "
        "'cpu-budget-artifact', 'superseded']"
    )
    assert apart["filter"].endswith(
        "Tags in ['ungated', 'heuristic', 'cpu-budget-artifact'] and Tags not in ['superseded']"
    )
    assert failed["filter"] == "Group = 'fixture-sweep' and State != 'finished'"
    assert "summary:failure_stage" in failed["columns"]
    # legends name every label axis and the machine, even those one value among the records on disk
    # (workload, model): the W&B group may hold runs that are not on disk
    assert spec["labels"]["axes"] == [*LABEL_AXES, "machine"]
    panels = {p["id"]: p for p in review["panels"]}
    assert panels["frontier"]["legend"] == spec["labels"]["legend_template"]
    assert spec["labels"]["legend_template"] == (
        "${config:proposer}/${config:topology}/${config:verifier}/T=${config:temperature}/B=${config:batch_size}/"
        "${config:workload}/${config:model}/${config:machine}"
    )
    # a bar never averages different arms: the same keys split it (a sweep run on each machine to
    # compare logs into one group)
    assert panels["speedup_by_proposer_workload"]["group_by"] == [
        "workload",
        "proposer",
        "topology",
        "verifier",
        "temperature",
        "batch_size",
        "model",
        "machine",
    ]
    assert spec["labels"]["config_keys"] == []
    assert panels["acceptance_by_depth"]["x"] == "depth"
    assert "depth/acceptance_few_rounds" in panels["acceptance_by_depth"]["y"]
    assert "fewer than 30 rounds" in panels["acceptance_by_depth"]["note"]
    assert panels["frontier"]["x"] == "mean_committed_per_round"
    assert panels["frontier"]["y"] == "time_per_committed_token_ms"
    assert panels["speedup_vs_batch"]["x"] == "config:batch_size"
    # the statistic harness compare and the report lead with (the round loop's), end to end beside it
    assert panels["speedup_by_proposer_workload"]["y"] == ["decode_speedup", "speedup"]
    assert panels["speedup_vs_batch"]["y"] == "decode_speedup"
    assert "Decode speedup" in panels["speedup_vs_batch"]["title"]

    rc, spec30, _, _ = _spec_from_cli(tmp_path, capsys, "min_rounds=30")
    assert rc == 0 and spec30["min_depth_rounds"] == 30
    (tmp_path / "dashboard.json").unlink()
    for value, message in (
        ("abc", "min_rounds='abc': expected a whole number >= 1"),
        ("0", "min_rounds=0 is out"),
        ("20", "min_rounds=20: the runs split acceptance by depth at 30 rounds when they logged it"),
    ):
        rc, none, _, err = _spec_from_cli(tmp_path, capsys, f"min_rounds={value}")
        assert rc == 2 and none is None and err.startswith(f"harness dashboard: refused: {message}")


def test_a_dashboard_for_one_run_s_records_is_not_written_into_that_run_s_folder(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUNS[0], run)
    monkeypatch.chdir(tmp_path)
    assert dashboard_main(["adhoc", f"records={run}"]) == 0
    assert not (run / "dashboard.json").exists() and (tmp_path / "dashboard-adhoc.json").is_file()
    # the run is of another group than the one asked: the output says so, not "no records found"
    assert f"no record under {run} is of group 'adhoc' (their groups: fixture-sweep)" in capsys.readouterr().out
    assert dashboard_main(["fixture-sweep", f"records={run}", "out=d.json"]) == 0
    assert "the options that tell runs apart in 1 record" in capsys.readouterr().out


def test_every_key_the_panels_read_is_logged_by_a_tracked_run(tmp_path, monkeypatch):
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    logged: set[str] = set()
    for fixture in FIXTURE_RUNS:
        run_dir = tmp_path / fixture.name
        shutil.copytree(fixture, run_dir)
        record = load_record(run_dir)
        with open_run(record, mode="offline", dir=run_dir) as tracker:
            tracker.log_record(record, run_dir)
        info, records = inspect_run(run_dir)
        logged.update(info["config"])
        for key, value in info["summary"].items():
            logged.add(key)
            if isinstance(value, dict):
                logged.update(f"{key}.{k}" for k in value)
        for step in history(records):
            logged.update(step)
    spec = build_spec("fixture-sweep")
    missing = sorted(spec_metrics(spec) - logged)
    # W&B keeps no summary value for None: a CPU run has no CUDA peaks to show (a GPU run logs them)
    assert missing == sorted(k for k in record["metrics"] if k.startswith(("cuda_peak", "ar_cuda_peak")))
    assert len(missing) == 4
    assert {
        "depth/acceptance_few_rounds",
        "round/committed_tokens",
        "t_profile/t_ms",
        "speedup",
        "decode_speedup",
    } <= spec_metrics(spec)


def test_the_specification_becomes_w_and_b_report_objects_without_a_server():
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    from wandb_workspaces import expr

    from harness.tracking.dashboard import report_blocks

    spec = build_spec("batch_scaling", entity="team")
    blocks = report_blocks(spec, wr)
    grids = [b for b in blocks if isinstance(b, wr.PanelGrid)]
    # the review's grouped bar chart has its own grid (runs grouped by workload, then proposer, then
    # with no records known every other axis), and so has each kept-apart section's
    grouped = [g for g in grids if g.runsets[0].groupby]
    axes = ["workload", "proposer", "topology", "verifier", "temperature", "batch_size", "model", "machine"]
    assert len(grouped) == 4 and grouped[0].runsets[0].groupby == [f"config.{a}" for a in axes]
    assert isinstance(grouped[0].panels[0], wr.BarPlot) and grouped[0].panels[0].metrics == [
        "decode_speedup",
        "speedup",
    ]
    titles = [p.title for g in grids for p in g.panels]
    assert "Frontier: time per committed token vs committed tokens per round" in titles
    for grid in grids:
        for panel in grid.panels:
            panel._to_model()  # the panel's W&B form, which needs no server
        expr.expr_to_filters(grid.runsets[0].filters)  # W&B's own parser reads the filter
    line = next(p for g in grids for p in g.panels if p.title.startswith("Acceptance at depth"))
    assert line.x == "depth" and line.legend_template == spec["labels"]["legend_template"]


def _admits(expression: str, *, group: str, state: str, tags: list[str]) -> bool:
    """Whether a run of this group, state and tags passes a W&B filter expression, as W&B's own
    parser reads it (conditions on the group, the state and the tags, all of which must hold)."""
    from wandb_workspaces import expr

    run = {"group": group, "state": state}
    for leaf in expr.expr_to_filters(expression).filters:
        name, value = leaf.key.name, leaf.value
        if name == "tags":
            hit = any(t in tags for t in value)
            ok = hit if leaf.op == "IN" else not hit if leaf.op == "NIN" else None
        else:
            ok = run[name] == value if leaf.op == "=" else run[name] != value if leaf.op == "!=" else None
        assert ok is not None, f"unexpected condition {leaf}"
        if not ok:
            return False
    return True


def test_a_speedup_bar_never_averages_runs_of_two_sections():
    """The kept-apart section's speedup bars grouped ungated, heuristic and CPU-budget-artifact runs
    of one arm into one bar (one run set over all three tags). Each finished run now counts in the
    bars of exactly one chart, and every chart's runs are of one section, the one harness compare and
    the report put them in; a superseded run counts nowhere. The runs are told apart by their tags,
    so runs logged before are kept apart too."""
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    from harness.tracking.dashboard import report_blocks
    from harness.tracking.store import record_gated, section_of
    from harness.tracking.wandb_tracker import status_tags

    def record(*, gated: bool, exact: bool, cpu: bool) -> dict:
        r = load_record(FIXTURE_RUNS[0])
        r["gated"], r["exact"] = gated, exact
        r["metrics"]["cpu_budget_artifact"] = cpu
        if not gated:
            r["gates"]["oracle"]["status"] = "skipped"
        return r

    runs = [record(gated=g, exact=e, cpu=c) for g in (True, False) for e in (True, False) for c in (False, True)]
    sections = {
        section_of(exact=r["exact"], cpu_budget_artifact=r["metrics"]["cpu_budget_artifact"], gated=record_gated(r))
        for r in runs
    }
    assert sections == {"exact", "ungated", "heuristic", "cpu_budget_artifact"}
    spec = build_spec("g", axes_rows=[])
    bar_filters = [
        grid.runsets[0].filters
        for grid in report_blocks(spec, wr)
        if isinstance(grid, wr.PanelGrid)
        and grid.panels
        and isinstance(grid.panels[0], wr.BarPlot)
        and grid.runsets[0].groupby
        and grid.panels[0].metrics[0] == "decode_speedup"
    ]
    charts: dict[str, set[str]] = {f: set() for f in bar_filters}
    for r in runs:
        section = section_of(
            exact=r["exact"], cpu_budget_artifact=r["metrics"]["cpu_budget_artifact"], gated=record_gated(r)
        )
        tags = status_tags(r)
        counted = [f for f in bar_filters if _admits(f, group="g", state="finished", tags=tags)]
        assert len(counted) == 1, (section, tags, counted)
        charts[counted[0]].add(section)
        assert not any(_admits(f, group="g", state="finished", tags=[*tags, "superseded"]) for f in bar_filters)
    assert sorted(sorted(s) for s in charts.values()) == [
        ["cpu_budget_artifact"],
        ["exact"],
        ["heuristic"],
        ["ungated"],
    ]
    assert len(bar_filters) == 4  # the review's, then one per kept-apart section
    apart = {p["section"]: p for p in spec["sections"][1]["panels"] if "section" in p}
    assert list(apart) == ["ungated", "heuristic", "cpu_budget_artifact"]
    for name, panel in apart.items():
        assert charts[panel["filter"]] == {name}


def test_bad_input_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert dashboard_main(["no_such_sweep"]) == 2
    assert "unknown sweep or experiment 'no_such_sweep'" in capsys.readouterr().err
    assert dashboard_main(["batch_scaling", "mode=cloud"]) == 2
    assert dashboard_main(["batch_scaling", "colour=red"]) == 2
    assert dashboard_main(["x", f"records={tmp_path / 'missing'}"]) == 2
    capsys.readouterr()
    (tmp_path / "bad.json").write_text("{}")
    assert dashboard_main(["--publish", str(tmp_path / "bad.json")]) == 2
    assert "not a dashboard specification" in capsys.readouterr().err
    (tmp_path / "garbage.txt").write_text("garbage\n")
    assert dashboard_main(["--publish", str(tmp_path / "garbage.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # one line, naming the file
    assert err == [
        f"harness dashboard: refused: --publish {tmp_path / 'garbage.txt'}: not a JSON dashboard specification "
        "(Expecting value: line 1 column 1 (char 0))"
    ]
    assert dashboard_main(["--publish", str(tmp_path / "none.json")]) == 2
    assert "none.json: no such file" in capsys.readouterr().err
    assert dashboard_main(["batch_scaling", "colour=red"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness dashboard: refused: expected one sweep or experiment name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "garbage.txt"]
    assert {"batch_scaling", "sources/rest_T0", "default"} <= set(dashboard_groups())


def test_online_without_a_reachable_server_keeps_the_specification_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    rc, spec, out, err = _spec_from_cli(tmp_path, capsys, "mode=online")
    assert rc == 1 and spec is not None and spec["group"] == "fixture-sweep"
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0] == f"harness dashboard: note: {UNTRACKED_NOTE}"
    assert lines[1].startswith("harness dashboard: not published (ConnectionRefusedError")
    assert "harness dashboard --publish" in lines[1]


def test_out_replaces_a_specification_only_and_records_may_be_a_job_folder(tmp_path, capsys, monkeypatch):
    """``out=`` never replaces a run's record or a file that is no specification (unless
    overwrite=true); ``records=`` and ``--publish`` take paths with ``=`` in them (job folders)."""
    job = tmp_path / "sweep" / "proposer=prompt_lookup,seed=1"
    shutil.copytree(FIXTURE_RUNS[0], job)
    record = (job / "record.json").read_bytes()
    base = ["fixture-sweep", f"records={job.parent}"]
    assert dashboard_main([*base, f"out={job / 'record.json'}", "overwrite=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"harness dashboard: refused: out={job / 'record.json'} is a file of the run folder {job}: write a "
        f"dashboard specification elsewhere (writing {job / 'record.json'})"
    ]
    assert (job / "record.json").read_bytes() == record
    # nothing is written inside a run folder, as export refuses: not beside the files a record binds
    for inside in (job / "dash.json", job / "sub" / "dash.json"):
        assert dashboard_main([*base, f"out={inside}", "overwrite=true"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"harness dashboard: refused: out={inside} is inside the run folder {job}: write a dashboard "
            f"specification outside any run folder (writing {inside})"
        ]
    assert sorted(p.name for p in job.iterdir()) == sorted(p.name for p in FIXTURE_RUNS[0].iterdir())
    # a specification named record.json anywhere (a sweep's root, say) would be read as a broken record
    assert dashboard_main([*base, f"out={job.parent / 'record.json'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"harness dashboard: refused: out={job.parent / 'record.json'}: record.json is the name of a run's record; "
        f"give a dashboard specification another name (writing {job.parent / 'record.json'})"
    ]
    assert not (job.parent / "record.json").exists()
    notes = tmp_path / "notes.json"
    notes.write_text("[1, 2]\n")
    assert dashboard_main([*base, f"out={notes}"]) == 2
    assert f"out={notes} already exists and is not a dashboard specification" in capsys.readouterr().err
    assert notes.read_text() == "[1, 2]\n"
    assert dashboard_main([*base, f"out={notes}", "overwrite=maybe"]) == 2
    assert "overwrite='maybe': must be true or false" in capsys.readouterr().err
    assert dashboard_main([*base, f"out={notes}", "overwrite=true"]) == 0
    assert json.loads(notes.read_text())["group"] == "fixture-sweep"
    assert dashboard_main([*base, f"out={notes}"]) == 0  # a specification replaces its earlier self
    spec_in_job_name = job.parent / "a=b.json"
    assert dashboard_main(["fixture-sweep", f"records={job}", f"out={spec_in_job_name}"]) == 0
    assert json.loads(spec_in_job_name.read_text())["group"] == "fixture-sweep"
    capsys.readouterr()
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    assert dashboard_main(["--publish", str(spec_in_job_name), "entity=x"]) == 2  # read as a path: no server here
    assert "not reachable" in capsys.readouterr().err


def test_the_dashboard_reads_the_project_its_records_were_logged_to(tmp_path, capsys, monkeypatch):
    """The records say which W&B project their runs went to: the specification reads that one, a
    ``project=`` they were not logged to is refused, and records of another group never have their
    folder's dashboard replaced."""
    sweep = tmp_path / "sweep"
    for i, src in enumerate(FIXTURE_RUNS):
        job = sweep / f"job{i}"
        shutil.copytree(src, job)
        record = json.loads((job / "record.json").read_text())
        record["tracking"] = {"backend": "wandb", "mode": "offline", "project": "myproj", "run_id": record["run_id"]}
        (job / "record.json").write_text(json.dumps(record))
    out = tmp_path / "d.json"
    assert dashboard_main(["fixture-sweep", f"records={sweep}", f"out={out}"]) == 0
    assert json.loads(out.read_text())["project"] == "myproj" and capsys.readouterr().err == ""
    for arg, said in (
        ("project=other", "project=other: the records of group 'fixture-sweep' were logged to myproj"),
        ("project=a:b", "project=a:b: W&B names cannot hold :"),
        ("entity=me/you", "entity=me/you: W&B names cannot hold /"),
    ):
        assert dashboard_main(["fixture-sweep", f"records={sweep}", f"out={out}", arg]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"harness dashboard: refused: {said}"], err
    record = json.loads((sweep / "job1" / "record.json").read_text())
    record["tracking"]["project"] = "second"
    (sweep / "job1" / "record.json").write_text(json.dumps(record))
    assert dashboard_main(["fixture-sweep", f"records={sweep}", f"out={out}"]) == 2
    assert "were logged to several W&B projects (myproj, second): give project=" in capsys.readouterr().err
    (sweep / "dashboard.json").write_text('{"sections": [], "format": "kept"}')
    monkeypatch.chdir(tmp_path)
    assert dashboard_main(["adhoc", f"records={sweep}"]) == 0  # no record of group adhoc there
    assert (sweep / "dashboard.json").read_text() == '{"sections": [], "format": "kept"}'
    assert (tmp_path / "dashboard-adhoc.json").is_file()


def test_runs_of_one_arm_that_differ_in_another_option_are_told_apart(tmp_path, capsys):
    """A sweep over an option that is no axis (topology.max_nodes) makes runs with one name, job
    type and legend; the specification names the option in the legend and splits the bars by it,
    while repeats (another seed) stay one bar."""
    sweep = tmp_path / "sweep"
    for name, nodes, seed in (("a", 4, 0), ("b", 8, 0), ("c", 8, 1)):
        job = sweep / name
        shutil.copytree(FIXTURE_RUNS[0], job)
        record = json.loads((job / "record.json").read_text())
        record["config"]["topology"]["max_nodes"] = nodes
        record["config"]["seed"] = seed
        record["run_id"] = f"{record['run_id']}-{name}"
        (job / "record.json").write_text(json.dumps(record))
    out = tmp_path / "d.json"
    assert dashboard_main(["fixture-sweep", f"records={sweep}", f"out={out}"]) == 0
    spec = json.loads(out.read_text())
    assert spec["labels"]["config_keys"] == ["topology.max_nodes"]
    assert spec["labels"]["legend_template"].endswith("max_nodes=${config:resolved.topology.max_nodes}")
    bars = next(p for p in spec["sections"][0]["panels"] if p["id"] == "speedup_by_proposer_workload")
    assert bars["group_by"][-2:] == ["resolved.topology.max_nodes", "machine"]
    assert "resolved.seed" not in bars["group_by"]


def test_a_sweep_launched_from_a_sweep_file_is_found_under_multirun(tmp_path, capsys, monkeypatch):
    """`harness sweep ~/my.yaml` writes multirun/<its name>; `harness dashboard <its name>` said the
    name was unknown unless records= was given."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(FIXTURE_RUNS[0], tmp_path / "multirun" / "fixture-sweep" / "job0")
    assert dashboard_main(["fixture-sweep"]) == 0
    assert "the options that tell runs apart in 1 record" in capsys.readouterr().out
    assert (tmp_path / "multirun" / "fixture-sweep" / "dashboard.json").is_file()


def test_a_known_sweep_not_yet_run_gets_its_dashboard_in_its_own_folder(tmp_path, capsys, monkeypatch):
    """The README says `harness dashboard batch_scaling` writes multirun/batch_scaling/dashboard.json;
    before the sweep had run it wrote ./dashboard-batch_scaling.json instead."""
    monkeypatch.chdir(tmp_path)
    assert dashboard_main(["batch_scaling"]) == 0
    assert (tmp_path / "multirun" / "batch_scaling" / "dashboard.json").is_file()
    assert not list(tmp_path.glob("dashboard-*.json"))
    # no records known yet: the speedup bars are split by every axis (they averaged batch sizes,
    # temperatures and models into one bar per proposer while the legend named every axis), and by
    # the experiment the sweep crosses
    spec = json.loads((tmp_path / "multirun" / "batch_scaling" / "dashboard.json").read_text())
    bars = next(p for p in spec["sections"][0]["panels"] if p["id"] == "speedup_by_proposer_workload")
    assert bars["group_by"] == [
        *("workload", "proposer", "topology", "verifier", "temperature", "batch_size", "model", "experiment"),
        "machine",
    ]
    assert f"wrote {Path('multirun') / 'batch_scaling' / 'dashboard.json'}: " in capsys.readouterr().out


def test_a_sweep_not_yet_run_splits_its_bars_by_what_its_file_crosses(tmp_path, capsys, monkeypatch):
    """With no records to read, tree_vs_hardware's 4- and 8-node runs shared one bar and one legend
    entry: the sweep file crosses topology.max_nodes, which is no axis."""
    monkeypatch.chdir(tmp_path)
    assert dashboard_main(["tree_vs_hardware"]) == 0
    spec = json.loads((tmp_path / "multirun" / "tree_vs_hardware" / "dashboard.json").read_text())
    assert spec["labels"]["config_keys"] == ["topology.max_nodes"]
    assert "max_nodes=${config:resolved.topology.max_nodes}" in spec["labels"]["legend_template"]
    bars = next(p for p in spec["sections"][0]["panels"] if p["id"] == "speedup_by_proposer_workload")
    assert "resolved.topology.max_nodes" in bars["group_by"]
    assert dashboard_main(["batch_scaling", "overwrite=true"]) == 0  # crosses experiments and batch sizes only
    spec = json.loads((tmp_path / "multirun" / "batch_scaling" / "dashboard.json").read_text())
    assert spec["labels"]["config_keys"] == []
    capsys.readouterr()


def _bars_and_legend(spec: dict) -> tuple[list[str], str]:
    panels = {p["id"]: p for p in spec["sections"][0]["panels"]}
    return panels["speedup_by_proposer_workload"]["group_by"], panels["t_profile"]["legend"]


def test_runs_of_one_group_timed_on_several_machines_are_named_and_split_by_machine():
    """A sweep run on each machine logs into one group, and the records on disk may be one machine's:
    the line panels (t(n), frontier, acceptance by depth), which group nothing, named both machines'
    runs alike unless the local records showed two machines, and named no model or machine with no
    records. The legend names runs by the keys the bars split by, the machine and model always."""
    rows = [
        {"proposer": "prompt_lookup", "topology": "sequence", "machine": machine}
        for machine in ("cpu: AMD EPYC 9R14", "cuda: NVIDIA H100 80GB HBM3")
    ]
    for spec in (
        build_spec("tree_vs_hardware", axes_rows=rows),
        build_spec("tree_vs_hardware", axes_rows=rows[:1]),  # one machine's records on disk
        build_spec("tree_vs_hardware", config_keys=["topology.max_nodes"]),  # no records
    ):
        bars, legend = _bars_and_legend(spec)
        assert bars[-1] == "machine" and "model" in bars
        assert spec["labels"]["axes"] == [*LABEL_AXES, "machine"]
        assert legend == spec["labels"]["legend_template"]
        assert "/${config:model}/${config:machine}" in legend
        # every key the bars split by is named in the legend (the workload and proposer too)
        named = {a: f"${{config:{a}}}" for a in bars}
        named.update(temperature="T=${config:temperature}", batch_size="B=${config:batch_size}")
        named.update({k: f"max_nodes=${{config:{k}}}" for k in bars if k.startswith("resolved.")})
        assert legend.split("/") == [named[a] for a in spec["labels"]["axes"]] + [
            named[k] for k in bars if k.startswith("resolved.")
        ]
        assert sorted(legend.split("/")) == sorted(named[a] for a in bars)


def test_a_run_folder_s_dashboard_splits_bars_by_every_axis(tmp_path, capsys):
    """Group adhoc holds every single `harness run`: the dashboard of one run's folder split its bars
    by workload, proposer and machine only (the axes that differ among the one local record), so the
    group's runs of other topologies, models or temperatures were averaged into the same bar."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUNS[0], run)
    record = load_record(run)
    record.update(sweep=None, experiment=None)
    record.pop("tracking", None)
    (run / "record.json").write_text(json.dumps(record))
    out = tmp_path / "d.json"
    assert dashboard_main([str(run), f"out={out}"]) == 0
    assert (
        "panels for W&B group 'adhoc' (legends name every axis, and the options that tell runs apart in 1 record)"
        in capsys.readouterr().out
    )
    spec = json.loads(out.read_text())
    bars, legend = _bars_and_legend(spec)
    assert bars == ["workload", "proposer", "topology", "verifier", "temperature", "batch_size", "model", "machine"]
    assert "experiment" not in bars and "${config:experiment}" not in legend  # one experiment (none) in adhoc
    # two records that differ in topology only: still every axis
    rows = [{**{a: "x" for a in LABEL_AXES}, "topology": t, "machine": "m"} for t in ("sequence", "sequoia")]
    assert _bars_and_legend(build_spec("adhoc", axes_rows=rows))[0] == bars
    # every apart section's bars too
    for panel in spec["sections"][1]["panels"]:
        if panel["kind"] == "bar":
            assert panel["group_by"] == bars


def test_a_sweep_over_experiments_splits_bars_and_legends_by_experiment(tmp_path, capsys, monkeypatch):
    """Experiments that set the same axes (heads: hydra, hydra_mlp4, hydra_distill, hydra_prefix;
    source_selection: merged_T0, merged3_T0) shared one bar and one legend label: the sweep file's
    `experiment` parameter was dropped as an axis parameter. The run config's top-level `experiment`
    key splits the bars and names the runs."""
    from harness.app import swept_options

    swept = swept_options()
    assert {"heads", "source_selection", "batch_scaling", "temperature"} <= {
        name for name, keys in swept.items() if "experiment" in keys
    }
    assert "experiment" not in swept["tree_vs_hardware"]
    monkeypatch.chdir(tmp_path)
    for name in ("heads", "source_selection"):
        assert dashboard_main([name]) == 0  # no records yet
        spec = json.loads((tmp_path / "multirun" / name / "dashboard.json").read_text())
        bars, legend = _bars_and_legend(spec)
        assert bars[-2:] == ["experiment", "machine"] and "model" in bars
        assert legend.endswith("/${config:model}/${config:experiment}/${config:machine}")
        assert spec["labels"]["config_keys"] == []  # the experiment is a top-level key, no resolved option
        assert all(p["group_by"] == bars for p in spec["sections"][1]["panels"] if p["kind"] == "bar")
    # records of the sweep on disk (one experiment's): the sweep file still says it crosses experiments
    job = tmp_path / "multirun" / "heads" / "job0"
    shutil.copytree(FIXTURE_RUNS[0], job)
    record = load_record(job)
    record.update(sweep="heads", experiment="heads/hydra")
    record.pop("tracking", None)
    (job / "record.json").write_text(json.dumps(record))
    assert dashboard_main(["heads", "overwrite=true"]) == 0
    assert "(legends name every axis, and the options that tell runs apart in 1 record)" in capsys.readouterr().out
    bars, legend = _bars_and_legend(json.loads((tmp_path / "multirun" / "heads" / "dashboard.json").read_text()))
    assert "experiment" in bars and "${config:experiment}" in legend
    # a group whose records name several experiments (an unnamed multirun over experiments)
    rows = [{"proposer": "hydra", "experiment": e, "machine": "m"} for e in ("heads/hydra", "heads/hydra_mlp4")]
    bars, legend = _bars_and_legend(build_spec("adhoc/2024-01-01_10-00-00", axes_rows=rows))
    assert "experiment" in bars and "${config:experiment}" in legend
    bars, legend = _bars_and_legend(build_spec("adhoc/2024-01-01_10-00-00", axes_rows=rows[:1]))
    assert "experiment" not in bars and "${config:experiment}" not in legend


class FakeRun:
    """What mark_superseded reads and writes of a W&B API run."""

    def __init__(self, run_id, state="finished", replaces=(), tags=(), summary=None):
        self.id, self.state, self.config, self.tags = run_id, state, {"replaces": list(replaces)}, list(tags)
        self.summary = dict(summary or {})
        self.updates = 0

    def update(self):
        self.updates += 1


def test_a_run_a_finished_re_run_replaced_is_tagged_superseded_once():
    """A re-run job's earlier W&B run stayed finished in the group beside the new one, and the
    dashboard's bars averaged the arm twice; a re-run that did not finish replaced nothing."""
    from harness.tracking.dashboard import mark_superseded

    old, new = FakeRun("r1"), FakeRun("r2", replaces=["r1"])
    kept, failed = FakeRun("r3"), FakeRun("r4", state="failed", replaces=["r3"])
    assert mark_superseded([old, new, kept, failed]) == ["r1"]
    assert old.tags == ["superseded"] and old.updates == 1 and kept.tags == [] and new.tags == []
    assert mark_superseded([old, new, kept, failed]) == [] and old.updates == 1  # once
    # a re-run whose gate failed left the earlier record aside (the gate's evidence refutes it): superseded
    refuted, failed_gate = FakeRun("r5"), FakeRun("r6", "failed", ["r5"], summary={"earlier_record": "set_aside"})
    assert mark_superseded([refuted, failed_gate]) == ["r5"] and refuted.tags == ["superseded"]


def test_a_re_run_s_w_and_b_run_names_the_run_it_replaces(tmp_path, monkeypatch):
    from helpers import inspect_run

    import harness.runner as runner
    from harness.config import compose
    from harness.tracking.store import load_record

    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "job"
    base = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.enabled=false", "tracking=wandb"]
    first = runner.run_job(compose([*base, f"output_dir={out}"]), run_dir=out)
    second = runner.run_job(compose([*base, f"output_dir={out}", "seed=1"]), run_dir=out)
    info, _ = inspect_run(out, sync_dir=out / load_record(out)["tracking"]["dir"])
    assert info["config"]["replaces"] == [first["run_id"]] and second["run_id"] != first["run_id"]
    (aside,) = (out / ".previous").iterdir()  # the earlier run's own W&B folder went aside with its record
    assert "replaces" not in inspect_run(aside, sync_dir=aside / first["tracking"]["dir"])[0]["config"]


def test_a_folder_of_records_names_its_group_and_unnamed_multiruns_are_found_as_adhoc(tmp_path, monkeypatch, capsys):
    """`harness dashboard multirun/x` was refused (a folder is no group name), and `harness dashboard
    adhoc` looked in outputs/adhoc only, while `harness run -m` without a sweep writes to
    multirun/adhoc/<time>/ (group adhoc)."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "multirun" / "mine"
    shutil.copytree(FIXTURES, folder)
    assert dashboard_main([str(folder), "out=a.json"]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["group"] == "fixture-sweep"
    assert "the options that tell runs apart in 11 records" in capsys.readouterr().out
    mixed = tmp_path / "mixed"
    shutil.copytree(FIXTURE_RUNS[0], mixed / "one")
    record = load_record(mixed / "one")
    record["sweep"] = "other"
    (mixed / "one" / "record.json").write_text(json.dumps(record))
    shutil.copytree(FIXTURE_RUNS[1], mixed / "two")
    assert dashboard_main([str(mixed)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"harness dashboard: refused: {mixed} holds records of 2 W&B groups (fixture-sweep, other); name the group "
        f"and give the folder as records={mixed}"
    )
    assert str(dashboard_groups()["adhoc"]) == "outputs/adhoc"  # where single runs land
    # each launch of a multirun without a sweep name is a group of its own, named by its folder
    (tmp_path / "multirun" / "adhoc" / "2026-12-05_05-15-00").mkdir(parents=True)
    groups = dashboard_groups()
    assert str(groups["adhoc"]) == "outputs/adhoc"
    assert str(groups["adhoc/2026-12-05_05-15-00"]) == "multirun/adhoc/2026-12-05_05-15-00"


def test_the_dashboard_of_an_unnamed_multirun_s_folder_selects_that_launch_s_w_and_b_group(
    tmp_path, monkeypatch, capsys
):
    """Every `harness run -m` without a sweep name logged into W&B group "adhoc": the dashboard of one
    launch's folder took its legends from that folder's records but its filter selected every unnamed
    launch's runs. Each launch is now its own group, ``adhoc/<its folder's name>``, and the dashboard
    of its folder selects that group."""
    from harness.app import run_main

    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    tiny = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.enabled=false", "tracking=wandb"]
    assert run_main(["-m", *tiny, "seed=1,2"]) == 0
    (launch,) = (tmp_path / "multirun" / "adhoc").iterdir()
    group = f"adhoc/{launch.name}"
    jobs = sorted(launch.glob("*/record.json"))
    assert len(jobs) == 2 and {load_record(p.parent)["tracking"]["group"] for p in jobs} == {group}
    assert {run_info(inspect_run(p.parent)[1])["run_group"] for p in jobs} == {group}  # what W&B holds
    capsys.readouterr()
    assert dashboard_main([f"multirun/adhoc/{launch.name}"]) == 0
    spec = json.loads((launch / "dashboard.json").read_text())
    assert spec["group"] == group and all(
        section["filter"].startswith(f"Group = '{group}' and ") for section in spec["sections"]
    )
    assert (
        f"panels for W&B group '{group}' (legends name every axis, and the options that tell runs apart in 2 records)"
        in capsys.readouterr().out
    )
    # another unnamed launch beside it is another group: the folder above them holds two
    other = tmp_path / "multirun" / "adhoc" / "2026-01-01_00-00-00"
    shutil.copytree(FIXTURE_RUNS[0], other / "seed=3")
    (other / "launch.json").write_text(json.dumps({"launch_id": "x", "sweep": None}))
    record = load_record(other / "seed=3")
    record["sweep"] = record["experiment"] = None
    (other / "seed=3" / "record.json").write_text(json.dumps(record))
    assert dashboard_main(["multirun/adhoc"]) == 2
    assert f"multirun/adhoc holds records of 2 W&B groups (adhoc/2026-01-01_00-00-00, {group})" in (
        capsys.readouterr().err
    )


def test_a_stale_record_a_skipped_twin_set_aside_is_tagged_superseded_when_published(tmp_path, monkeypatch, capsys):
    """A job skipped as another folder's twin sets its own stale record aside, and no later run of its
    folder names that record's W&B run: publishing left the run among the arm's, counted twice."""
    import wandb
    import wandb_workspaces.reports.v2 as wr
    from helpers import run_info

    from harness import sweep
    from harness.app import sweep_main
    from harness.tracking import dashboard

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.chdir(tmp_path)
    sweep_dir = tmp_path / "multirun" / "smoke"
    common = ["smoke", "launcher=basic", "proposer=prompt_lookup", "verifier=greedy", "gates.enabled=false"]
    common += ["tracking=wandb", "hydra.callbacks.harness_sweep.report=false", f"hydra.sweep.dir={sweep_dir}"]
    assert sweep_main([*common, "seed=0"]) == 0
    (restated,) = sweep.LAST_SUMMARY["ran"]
    path = sweep_dir / restated / "record.json"
    stale = json.loads(path.read_text())
    stale["manifest_hash"] = "0" * 16  # as a record written by other code
    path.write_text(json.dumps(stale))
    assert sweep_main(common) == 0
    (job,) = sweep.LAST_SUMMARY["ran"]
    assert sweep_main([*common, "seed=0"]) == 0 and sweep.LAST_SUMMARY["same_as"] == {restated: job}
    assert not path.exists() and load_record(sweep_dir / job)["tracking"]["run_id"] != stale["tracking"]["run_id"]

    runs = []  # the group's W&B runs, as W&B's API gives them once the offline runs are synced
    for sync_dir in sorted(sweep_dir.rglob("offline-run-*")):
        info, records = inspect_run(None, sync_dir=sync_dir)
        run = run_info(records)
        runs.append(FakeRun(run["run_id"], info["state"], info["config"].get("replaces") or (), run["tags"]))
    assert sorted(r.id for r in runs) == sorted([stale["tracking"]["run_id"], load_record(sweep_dir / job)["run_id"]])

    class Api:
        default_entity = "me"

        def runs(self, where, filters):
            assert where == "me/spec-harness" and filters == {"group": "smoke"}
            return runs

    class Report:
        def __init__(self, **kwargs):
            self.url = "https://wandb.ai/me/spec-harness/reports/x"

        def save(self):
            return self

    monkeypatch.setattr(wandb, "Api", Api)
    monkeypatch.setattr(wr, "Report", Report)
    monkeypatch.setattr(dashboard, "unreachable", lambda url: None)
    out = tmp_path / "dashboard.json"
    assert dashboard_main(["smoke", f"records={sweep_dir}", f"out={out}"]) == 0
    capsys.readouterr()
    assert dashboard_main(["--publish", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "tagged 1 run(s) superseded by a later run of the same job or set aside in .previous/: "
        f"{stale['tracking']['run_id']}"
    )
    assert {r.id: "superseded" in r.tags for r in runs} == {
        stale["tracking"]["run_id"]: True,
        load_record(sweep_dir / job)["run_id"]: False,
    }
    # published from a machine without the records: said, not silently skipped
    moved = json.loads(out.read_text())
    assert moved["records"] == str(sweep_dir.resolve())
    moved["records"] = str(tmp_path / "elsewhere")
    out.write_text(json.dumps(moved))
    assert dashboard_main(["--publish", str(out)]) == 0
    assert capsys.readouterr().err.strip() == (
        f"harness dashboard: note: records={tmp_path / 'elsewhere'} is not on this machine: the runs of records set "
        "aside in its .previous/ folders are not tagged superseded (publish where the records are)"
    )


def test_a_record_s_group_is_the_one_its_run_was_logged_to(tmp_path, capsys):
    """A record of an unnamed launch logged before each launch had a group of its own (its W&B run in
    group "adhoc") was counted in group "adhoc/<time>" by its folder: the folder's dashboard filtered
    on a group that held none of its runs. The group a record's run was logged to decides."""
    from harness.tracking.dashboard import group_axes, group_projects

    launch = tmp_path / "multirun" / "adhoc" / "2024-01-01_10-00-00"
    shutil.copytree(FIXTURE_RUNS[0], launch / "one")
    shutil.copytree(FIXTURE_RUNS[1], launch / "two")
    (launch / "launch.json").write_text(json.dumps({"launch_id": "x", "sweep": None}))
    for name, tracking in (("one", {"backend": "wandb", "project": "p", "group": "adhoc"}), ("two", None)):
        record = load_record(launch / name)
        record.update(sweep=None, experiment=None)
        record.pop("tracking", None)
        if tracking is not None:
            record["tracking"] = tracking
        (launch / name / "record.json").write_text(json.dumps(record))
    assert group_projects(launch, "adhoc") == (1, {"p"})  # logged there
    assert group_projects(launch, "adhoc/2024-01-01_10-00-00") == (1, set())  # untracked: its launch's group
    assert group_axes(launch, "")[1] == ["adhoc", "adhoc/2024-01-01_10-00-00"]


def test_the_parallel_coordinates_panel_has_a_column_for_every_key_the_bars_split_by():
    """The axes panel listed the six name axes only: runs of two models, machines, experiments or
    max_nodes values were lines the panel could not tell apart."""
    rows = [{"proposer": "hydra", "experiment": e, "machine": "m"} for e in ("heads/hydra", "heads/hydra_mlp4")]
    spec = build_spec("adhoc/2024-01-01_10-00-00", axes_rows=rows, config_keys=["topology.max_nodes"])
    bars, _ = _bars_and_legend(spec)
    (axes,) = [p for p in spec["sections"][0]["panels"] if p["kind"] == "parallel_coordinates"]
    assert axes["columns"][: len(bars)] == [f"config:{k}" for k in bars]
    assert {"config:model", "config:machine", "config:experiment", "config:resolved.topology.max_nodes"} <= set(
        axes["columns"]
    )
    assert axes["columns"][len(bars) :] == ["decode_speedup", "speedup", "time_per_committed_token_ms"]
