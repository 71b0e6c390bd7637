"""`harness dashboard`: the panels a design review needs, as a W&B report, built from code.

    harness dashboard SWEEP_OR_EXPERIMENT [mode=offline|online] [project=spec-harness] [entity=E]
                      [records=DIR] [out=FILE [overwrite=true]]
    harness dashboard --publish FILE [entity=E]

``out=`` replaces a specification written before; a run's record or outputs, a folder, or any
other existing file is refused (unless ``overwrite=true``), and so is a path inside a run folder.

One panel specification (:func:`build_spec`, plain JSON) describes the review of one W&B group (a
sweep, an experiment's runs, or one launch of a multirun without a sweep name, given as its folder:
``multirun/adhoc/<time>`` is group ``adhoc/<time>``): speedup by proposer and workload, acceptance
and reach by depth (95% Wilson bounds; depths tried by too few rounds apart), the rounds that tried
each depth, the frontier (time per committed token against committed tokens per round), the
round-cost ledger, speedup against batch size, the per-round series, t(n), memory, and the axes in
parallel coordinates. Offline (the default) the specification is written to a file, with the
command that publishes it; online it is published as a W&B report through W&B's report API
(``wandb-workspaces``, imported on use) and the specification is written as well.

The panels read only what :mod:`harness.tracking.wandb_tracker` logs: record metrics from the run
summary, ``depth/*``, ``round/*`` and ``t_profile/*`` from the run history, the axes from the run
config. The speedup bars split, and legends name each run, by the same keys: every label axis, the
experiment where the group crosses experiments (its sweep file or its records say so), the options
(no axes) that tell one arm's runs apart, and the machine; the records on disk need not be all the
group's runs, so no key is left out for having one value among them. Runs are
kept apart as the report keeps them: gated exact runs in the main panels; ungated, heuristic and
CPU-budget runs in their own section, with speedup bars of their own per kind (a bar never averages
one kind's runs with another's); failed, refused and interrupted runs listed with their stage and error.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.files import print_traceback_if_asked
from harness.tracking.command_line import (
    boolean_option,
    json_object_with,
    output_file_problem,
    split_arguments,
    usage_status,
    whole_number_option,
)
from harness.tracking.compare import MACHINE, arm_config_keys, machine_values
from harness.tracking.conventions import LABEL_AXES, MIN_DEPTH_ROUNDS
from harness.tracking.record import write_json_atomic
from harness.tracking.store import (
    AXES,
    PREVIOUS_DIR,
    RECORD_FILENAME,
    ROUND_COST_STAGES,
    RecordError,
    aggregate,
    iter_record_paths,
)
from harness.tracking.wandb_tracker import DEFAULT_PROJECT, base_url, tracking_problem, unreachable, wandb_group

SPEC_FORMAT = "harness-dashboard/1"
#: the sections runs are kept apart in besides the exact one (:func:`~harness.tracking.store.section_of`),
#: in its order, each with the tag that marks its runs (see wandb_tracker.status_tags) and its name
APART_SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("ungated", "ungated", "ungated runs (a gate skipped)"),
    ("heuristic", "heuristic", "heuristic runs (exact: false)"),
    ("cpu_budget_artifact", "cpu-budget-artifact", "CPU-budget-artifact runs"),
)
#: tags of runs kept out of the main panels
APART_TAGS: tuple[str, ...] = tuple(tag for _, tag, _ in APART_SECTIONS)
#: the tag of a run whose record a later run of the same job replaced (kept out of every panel)
SUPERSEDED_TAG = "superseded"
PANEL_KINDS: tuple[str, ...] = ("bar", "line", "scatter", "parallel_coordinates")
#: the top-level run config key of a run's experiment (a sweep over experiments crosses it)
EXPERIMENT = "experiment"

USAGE = (
    "usage: harness dashboard SWEEP_OR_EXPERIMENT [mode=offline|online] [project=NAME] [entity=NAME]\n"
    "                         [records=DIR] [min_rounds=N] [out=FILE [overwrite=true]]\n"
    "       harness dashboard --publish FILE [entity=NAME]"
)


# --------------------------------------------------------------------------------------------
# the specification


def legend_template(axes: Sequence[str], config_keys: Sequence[str] = ()) -> str:
    """A W&B legend template naming a run by these axes, as the report's labels do
    (``${config:proposer}/T=${config:temperature}``), then by the other config keys that tell one
    arm's runs apart (``max_nodes=${config:resolved.topology.max_nodes}``)."""
    pieces = {"temperature": "T=${config:temperature}", "batch_size": "B=${config:batch_size}"}
    named = [pieces.get(a, f"${{config:{a}}}") for a in axes]
    named += [f"{k.rsplit('.', 1)[-1]}=${{config:resolved.{k}}}" for k in config_keys]
    return "/".join(named)


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _panel(pid: str, title: str, kind: str, **fields: Any) -> dict[str, Any]:
    return {"id": pid, "title": title, "kind": kind, **fields}


def review_panels(*, legend: str, min_rounds: int, split_by: Sequence[str]) -> list[dict[str, Any]]:
    """The panels of the main section (gated exact runs), in review order. ``split_by``: the axes
    and config keys (``resolved.<key>``) that tell the runs of one proposer and workload apart, so
    a bar never averages different arms; the parallel-coordinates panel has a column for each."""
    wilson = "95% Wilson bounds from the rounds that tried each depth"
    arm_keys = ["workload", "proposer", *[k for k in split_by if k not in ("workload", "proposer")]]
    return [
        _panel(
            "speedup_by_proposer_workload",
            "Decode speedup over AR by proposer and workload (end to end beside it)",
            "bar",
            y=["decode_speedup", "speedup"],
            group_by=arm_keys,
            aggregate="mean",
            note=(
                "decode_speedup: the round loop's, the statistic of harness compare and the report; speedup: end "
                "to end, prefill and a draft's prompt forward counted; bars: mean over the runs of a group; "
                "1.0 = autoregressive; per-prompt CIs: harness compare"
            ),
        ),
        _panel(
            "acceptance_by_depth",
            "Acceptance at depth d, given depth d-1 reached",
            "line",
            x="depth",
            y=["depth/acceptance", "depth/acceptance_few_rounds", "depth/acceptance_low", "depth/acceptance_high"],
            legend=legend,
            range_y=[0, 1],
            note=f"{wilson}; depth/acceptance_few_rounds: depths tried by fewer than {min_rounds} rounds",
        ),
        _panel(
            "reach_by_depth",
            "Reach: P(accepted path length >= d)",
            "line",
            x="depth",
            y=["depth/reach", "depth/reach_low", "depth/reach_high"],
            legend=legend,
            range_y=[0, 1],
            note="95% Wilson bounds over all rounds",
        ),
        _panel(
            "rounds_tried_by_depth",
            "Rounds that tried depth d",
            "line",
            x="depth",
            y=["depth/rounds_tried"],
            legend=legend,
            log_y=True,
            note=f"a depth tried by fewer than {min_rounds} rounds is a handful of coin flips; the line ends at the "
            "deepest depth any round tried (a log axis has no zero)",
        ),
        _panel(
            "frontier",
            "Frontier: time per committed token vs committed tokens per round",
            "scatter",
            x="mean_committed_per_round",
            y="time_per_committed_token_ms",
            legend=legend,
            note="lower right is better: more tokens per round, less time per token",
        ),
        _panel(
            "round_cost_ledger",
            "Round-cost ledger (mean ms per round, by stage)",
            "bar",
            y=[f"round_cost_ms.{s}" for s in ROUND_COST_STAGES],
            legend=legend,
            note="round cost = proposal + retrieval + packing + target verify + selection + temporary state",
        ),
        _panel(
            "speedup_vs_batch",
            "Decode speedup over batched AR vs batch size",
            "scatter",
            x="config:batch_size",
            y="decode_speedup",
            log_x=True,
            legend=legend,
        ),
        _panel(
            "round_ms",
            "Round time by round (ms)",
            "line",
            x="round",
            y=["round/ms", "round/target_verify_ms", "round/proposal_ms"],
            legend=legend,
        ),
        _panel(
            "committed_per_round",
            "Committed tokens per round",
            "line",
            x="round",
            y=["round/committed_tokens", "round/accepted_length"],
            legend=legend,
        ),
        _panel(
            "t_profile",
            "Target verify time t(n) and its roofline floor",
            "line",
            x="verify_rows",
            y=["t_profile/t_ms", "t_profile/floor_ms"],
            log_x=True,
            legend=legend,
        ),
        _panel(
            "memory",
            "Peak memory per job (host RSS) and per arm (CUDA allocated, reserved)",
            "bar",
            y=[
                "peak_rss_bytes",
                "cuda_peak_allocated_bytes",
                "cuda_peak_reserved_bytes",
                "ar_cuda_peak_allocated_bytes",
                "ar_cuda_peak_reserved_bytes",
            ],
            legend=legend,
        ),
        _panel(
            "axes",
            "Axes and speedup",
            "parallel_coordinates",
            columns=[f"config:{a}" for a in arm_keys] + ["decode_speedup", "speedup", "time_per_committed_token_ms"],
        ),
    ]


def apart_panels(*, legend: str, min_rounds: int, split_by: Sequence[str], in_group: str) -> list[dict[str, Any]]:
    """The panels of the kept-apart section: the speedup bars once per section of
    :data:`APART_SECTIONS`, each over that section's runs only (its ``filter``: a run's first tag
    among :data:`APART_TAGS` decides its section, as :func:`~harness.tracking.store.section_of`
    does), so a bar never averages an ungated run with a CPU-budget-artifact one; then acceptance by
    depth and the frontier, one line or point per run."""
    panels = {p["id"]: p for p in review_panels(legend=legend, min_rounds=min_rounds, split_by=split_by)}
    bars = panels["speedup_by_proposer_workload"]
    out = []
    for k, (section, tag, name) in enumerate(APART_SECTIONS):
        earlier = [t for _, t, _ in APART_SECTIONS[:k]] + [SUPERSEDED_TAG]
        out.append(
            {
                **({key: v for key, v in bars.items() if key != "note"} if k else bars),  # the note once
                "id": f"{bars['id']}:{section}",
                "title": f"{bars['title']}: {name}",
                "section": section,
                "runs": name,
                "filter": (
                    f"{in_group} and State = 'finished' and Tags in [{_quote(tag)}] and "
                    f"Tags not in [{', '.join(_quote(t) for t in earlier)}]"
                ),
            }
        )
    return out + [panels["acceptance_by_depth"], panels["frontier"]]


def build_spec(
    group: str,
    *,
    project: str = DEFAULT_PROJECT,
    entity: str | None = None,
    axes_rows: Sequence[Mapping[str, Any]] = (),
    min_rounds: int = MIN_DEPTH_ROUNDS,
    config_keys: Sequence[str] = (),
    records: str | Path | None = None,
    experiments: bool = False,
) -> dict[str, Any]:
    """The panel specification of the review of W&B group ``group``.

    The speedup bars split, and the legends of the panels that draw one line or point per run name
    runs, by the same keys: every label axis and the machine (the records on disk may be a part of
    the group: group ``adhoc`` holds every single run, and a sweep run on each machine logs into
    one group; a key with one value in the group costs a W&B bar or legend nothing), the run's
    ``experiment`` where the group crosses experiments (``experiments``, or ``axes_rows``, the axes
    and experiments of the group's records, naming several: experiments may share every axis), then
    ``config_keys``, the options (no axes) that differ among one arm's runs. ``records``: the
    folder of the group's records, where known (publishing tags the runs of the records set aside
    there superseded: :func:`set_aside_runs`)."""
    experiments = experiments or len({row.get(EXPERIMENT) for row in axes_rows}) > 1
    keys = [*LABEL_AXES, *([EXPERIMENT] if experiments else []), MACHINE]
    legend = legend_template(keys, config_keys)
    split_by = [*keys[:-1], *(f"resolved.{k}" for k in config_keys), MACHINE]
    in_group = f"Group = {_quote(group)}"
    apart = "[" + ", ".join(_quote(t) for t in APART_TAGS) + "]"
    out = "[" + ", ".join(_quote(t) for t in (*APART_TAGS, SUPERSEDED_TAG)) + "]"
    current = f"Tags not in [{_quote(SUPERSEDED_TAG)}]"
    return {
        "format": SPEC_FORMAT,
        "title": f"Design review: {group}",
        "description": (
            f"Runs of W&B group {group!r} (project {project!r}), named by arm "
            "(<proposer>-<topology>-<verifier>-T<temperature>-B<batch>-<workload>). Acceptance by depth carries "
            f"95% Wilson bounds; depths tried by fewer than {min_rounds} rounds are logged apart "
            "(depth/acceptance_few_rounds). Gated exact runs only in the first section; a run whose record a "
            "later run of the same job replaced, or whose record was set aside in its job's .previous/ folder, is "
            "tagged superseded when the dashboard is published, and left out."
        ),
        "project": project,
        "entity": entity,
        "group": group,
        "records": str(Path(records).resolve()) if records is not None else None,
        "labels": {"axes": keys, "config_keys": list(config_keys), "legend_template": legend},
        "min_depth_rounds": min_rounds,
        "sections": [
            {
                "id": "review",
                "title": "Gated exact runs",
                "filter": f"{in_group} and State = 'finished' and Tags not in {out}",
                "panels": review_panels(legend=legend, min_rounds=min_rounds, split_by=split_by),
            },
            {
                "id": "apart",
                "title": "Kept apart: ungated, heuristic (exact: false) and CPU-budget-artifact runs",
                "filter": f"{in_group} and State = 'finished' and Tags in {apart} and {current}",
                "panels": apart_panels(legend=legend, min_rounds=min_rounds, split_by=split_by, in_group=in_group),
            },
            {
                "id": "failed",
                "title": "Failed, refused and interrupted runs",
                "filter": f"{in_group} and State != 'finished'",
                "columns": ["run:state", "tags:__ALL__", "summary:outcome", "summary:failure_stage", "summary:error"],
                "panels": [],
            },
        ],
    }


def spec_metrics(spec: Mapping[str, Any]) -> set[str]:
    """Every run key the specification's panels read (``config:`` keys without the prefix)."""
    keys: set[str] = set()
    for section in spec["sections"]:
        for p in section["panels"]:
            for field in ("x", "y", "columns"):
                value = p.get(field)
                for key in [value] if isinstance(value, str) else value or []:
                    keys.add(key.split(":", 1)[1] if key.startswith("config:") else key)
            keys.update(p.get("group_by", []))
    return keys


def validate_spec(spec: Any, *, path: str | Path = "<spec>") -> dict[str, Any]:
    """A specification as :func:`build_spec` writes it, or ValueError naming what is wrong."""
    if not isinstance(spec, dict) or spec.get("format") != SPEC_FORMAT:
        raise ValueError(f"{path}: not a dashboard specification (format {SPEC_FORMAT!r})")
    for key in ("title", "project", "group", "sections"):
        if key not in spec:
            raise ValueError(f"{path}: missing {key!r}")
    for section in spec["sections"]:
        for p in section.get("panels", []):
            if p.get("kind") not in PANEL_KINDS:
                raise ValueError(f"{path}: panel {p.get('id')!r} has kind {p.get('kind')!r}; one of {PANEL_KINDS}")
    return spec


# --------------------------------------------------------------------------------------------
# W&B report (online)


def _metric(wr: Any, key: str) -> Any:
    """A panel axis: ``config:<key>`` is a config key, anything else a run summary/history key."""
    if key.startswith("config:"):
        return wr.Config(key.split(":", 1)[1])
    return wr.SummaryMetric(key)


def _wandb_panel(p: Mapping[str, Any], wr: Any) -> Any:
    title, legend = p["title"], p.get("legend")
    if p["kind"] == "bar":
        return wr.BarPlot(title=title, metrics=list(p["y"]), orientation="v", legend_template=legend)
    if p["kind"] == "line":
        return wr.LinePlot(
            title=title,
            x=p["x"],
            y=list(p["y"]),
            log_x=p.get("log_x"),
            log_y=p.get("log_y"),
            range_y=tuple(p.get("range_y", (None, None))),
            legend_template=legend,
        )
    if p["kind"] == "scatter":
        return wr.ScatterPlot(
            title=title, x=_metric(wr, p["x"]), y=_metric(wr, p["y"]), log_x=p.get("log_x"), legend_template=legend
        )
    return wr.ParallelCoordinatesPlot(
        title=title, columns=[wr.ParallelCoordinatesPlotColumn(metric=_metric(wr, c)) for c in p["columns"]]
    )


def report_blocks(spec: Mapping[str, Any], wr: Any) -> list[Any]:
    """The W&B report blocks (``wandb_workspaces.reports.v2``) of a specification: per section a
    heading, the panels' notes and a panel grid over the section's runs; a panel that groups runs
    (``group_by``, e.g. speedup by workload and proposer) or reads a part of the section's runs
    (its own ``filter``: one kept-apart section's) gets its own grid whose run set is grouped by
    those axes and filtered by that filter (W&B groups and filters runs per run set)."""

    def runset(section: Mapping[str, Any], group_by: Sequence[str] = (), panel: Mapping[str, Any] | None = None) -> Any:
        panel = panel or {}
        return wr.Runset(
            entity=spec.get("entity") or "",
            project=spec["project"],
            name=(panel.get("runs") or section["title"])[:60],
            filters=panel.get("filter") or section["filter"],
            groupby=[f"config.{a}" for a in group_by],
            visible_columns=list(section.get("columns", [])),
        )

    blocks: list[Any] = [wr.P(spec["description"])]
    for section in spec["sections"]:
        blocks.append(wr.H2(section["title"]))
        notes = [f"{p['title']}: {p['note']}" for p in section["panels"] if p.get("note")]
        if notes:
            blocks.append(wr.UnorderedList(items=notes))
        for p in section["panels"]:
            if p.get("group_by") or p.get("filter"):
                grid = [runset(section, p.get("group_by", ()), p)]
                blocks.append(wr.PanelGrid(runsets=grid, panels=[_wandb_panel(p, wr)]))
        plain = [_wandb_panel(p, wr) for p in section["panels"] if not (p.get("group_by") or p.get("filter"))]
        blocks.append(wr.PanelGrid(runsets=[runset(section)], panels=plain))
    return blocks


def set_aside_runs(records_root: str | Path) -> list[str]:
    """The W&B run ids of the records set aside under ``records_root`` (in a job's ``.previous/``
    folder: a re-run job's earlier record, or the stale record of a job skipped because another
    folder holds the same job), that no current record there names: runs whose records no store,
    compare or report counts. Records that were never logged name no run."""
    root = Path(records_root)
    current: set[str] = set()
    aside: list[str] = []
    for path in sorted(root.rglob(RECORD_FILENAME)):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # an unreadable record is the store's to report
        tracking = record.get("tracking") if isinstance(record, dict) else None
        if not isinstance(tracking, dict) or not tracking.get("run_id"):
            continue
        run_id = str(tracking["run_id"])
        if PREVIOUS_DIR in path.relative_to(root).parts[:-1]:
            aside += [run_id] if run_id not in aside else []
        else:
            current.add(run_id)
    return [run_id for run_id in aside if run_id not in current]


def mark_superseded(runs: Sequence[Any], set_aside: Sequence[str] = ()) -> list[str]:
    """Tag :data:`SUPERSEDED_TAG` each of ``runs`` (W&B API runs of one group) that a finished run
    of them replaces (its config ``replaces``: a re-run job's earlier record), or whose id is in
    ``set_aside`` (:func:`set_aside_runs`: its record lies in a ``.previous/`` folder); returns
    their ids. A replacing run that did not finish (interrupted, refused) left the earlier record in
    place, so it supersedes nothing, unless it says the earlier record stays aside
    (``earlier_record: set_aside`` in its summary: a failed gate refuted it)."""

    def replacing(run) -> bool:
        return run.state == "finished" or (run.summary or {}).get("earlier_record") == "set_aside"

    replaced = {str(r) for run in runs if replacing(run) for r in (run.config.get("replaces") or [])}
    replaced |= {str(r) for r in set_aside}
    marked = []
    for run in runs:
        if run.id in replaced and SUPERSEDED_TAG not in (run.tags or []):
            run.tags = [*(run.tags or []), SUPERSEDED_TAG]
            run.update()
            marked.append(run.id)
    return marked


def publish(spec: Mapping[str, Any], *, entity: str | None = None) -> str:
    """Tag the group's superseded runs (:func:`mark_superseded`; with the runs of the records set
    aside in the specification's ``records`` folder, where it is on this machine), then save the
    specification as a W&B report; returns its URL (needs `wandb login`)."""
    import wandb
    import wandb_workspaces.reports.v2 as wr  # imported on use: about 5 s at import

    spec = dict(spec)
    if entity:
        spec["entity"] = entity
    set_aside: list[str] = []
    if spec.get("records") and Path(spec["records"]).is_dir():
        set_aside = set_aside_runs(spec["records"])
    elif spec.get("records"):
        print(
            f"harness dashboard: note: records={spec['records']} is not on this machine: the runs of records set "
            "aside in its .previous/ folders are not tagged superseded (publish where the records are)",
            file=sys.stderr,
        )
    api = wandb.Api()
    where = f"{spec.get('entity') or api.default_entity}/{spec['project']}"
    marked = mark_superseded(list(api.runs(where, filters={"group": spec["group"]})), set_aside)
    if marked:
        print(
            f"tagged {len(marked)} run(s) superseded by a later run of the same job or set aside in .previous/: "
            f"{', '.join(marked)}"
        )
    kwargs = {"entity": spec["entity"]} if spec.get("entity") else {}
    report = wr.Report(
        project=spec["project"],
        title=spec["title"][:128],
        description=spec["description"][:1000],
        blocks=report_blocks(spec, wr),
        width="fluid",
        **kwargs,
    )
    report.save()
    return str(report.url)


# --------------------------------------------------------------------------------------------
# command line


def group_axes(records_root: Path, group: str) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The axes, experiment and machine of the records under ``records_root`` that belong to W&B
    group ``group`` (each record's group as its job logged it: :func:`record_group`), the groups of
    every record there, and the config keys that tell one arm's runs of the group apart
    (:func:`~harness.tracking.compare.arm_config_keys`)."""
    df = aggregate(records_root)
    if df.empty:
        return [], [], []

    def none(v: Any) -> Any:
        return None if v is None or (isinstance(v, float) and v != v) else v

    groups = []
    for _, r in df.iterrows():
        folder = records_root / str(r["record_dir"])
        try:
            record = json.loads((folder / "record.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = {}
        groups.append(
            record_group(record if isinstance(record, dict) else {}, folder, none(r["sweep"]), none(r["experiment"]))
        )
    mine = [g == group for g in groups]
    machines = machine_values(df)
    rows = [
        {**{a: r[a] for a in AXES if a in df.columns}, EXPERIMENT: none(r[EXPERIMENT]), MACHINE: machine}
        for (_, r), m, machine in zip(df.iterrows(), mine, machines)
        if m
    ]
    return rows, sorted(set(groups)), arm_config_keys(df[mine])


def record_group(record: Mapping[str, Any], folder: Path, sweep: Any = None, experiment: Any = None) -> str:
    """The W&B group of the record in ``folder``: the one its run was logged to (its ``tracking``
    entry: a record logged before unnamed launches had groups of their own, or whose folder was moved
    since, keeps it), else the one its job would log to (:func:`wandb_group`)."""
    tracking = record.get("tracking")
    if isinstance(tracking, dict) and tracking.get("group"):
        return str(tracking["group"])
    return wandb_group(sweep or record.get("sweep"), experiment or record.get("experiment"), folder)


def group_projects(records_root: Path, group: str) -> tuple[int, set[str]]:
    """How many records under ``records_root`` belong to W&B group ``group``, and the W&B projects
    those that were logged went to (their ``tracking`` entries)."""
    count, projects = 0, set()
    for path in iter_record_paths(records_root):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # an unreadable record is the store's to report
        if not isinstance(record, dict) or record_group(record, path.parent) != group:
            continue
        count += 1
        if isinstance(record.get("tracking"), dict) and record["tracking"].get("project"):
            projects.add(str(record["tracking"]["project"]))
    return count, projects


def dashboard_project(
    group: str, given: str | None, count: int, projects: set[str], *, records: Path | None = None
) -> tuple[str, str | None]:
    """The W&B project the dashboard reads (``project=`` or the one the group's records were logged
    to) and a note for stderr, or None. Refuses a project the records were not logged to, and an
    ambiguous one."""
    if given is not None:
        problem = tracking_problem(given, environ={})
        if problem:
            raise ValueError(problem.replace("tracking.project", "project"))
        if projects and given not in projects:
            raise ValueError(
                f"project={given}: the records of group {group!r} were logged to {', '.join(sorted(projects))}"
            )
        return given, None
    if len(projects) > 1:
        raise ValueError(
            f"the records of group {group!r} were logged to several W&B projects ({', '.join(sorted(projects))}): "
            "give project="
        )
    if projects:
        return projects.pop(), None
    note = None
    if count:
        where = f" under {records}" if records is not None else ""
        note = (
            f"none of the {count} record(s) of group {group!r}{where} was logged to W&B: the panels stay empty "
            "until a launch with tracking=wandb logs them (records= reads another folder of the group)"
        )
    return DEFAULT_PROJECT, note


def main(
    argv: Sequence[str] | None = None,
    *,
    known: Mapping[str, Path | None] | None = None,
    swept: Mapping[str, Sequence[str]] | None = None,
) -> int:
    """``known``: the sweep and experiment names this installation has, each with the folder its
    records land in by default (or None); ``swept``: per sweep, the parameters it crosses that are
    no axis (its panels split by them where no record is found to read them from), ``experiment``
    among them for a sweep over experiments (its panels always split by it); the caller
    (``harness.app``) knows them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    known = dict(known or {})
    status = usage_status(USAGE, argv)
    if status is not None:
        return status
    try:
        positionals, opts = split_arguments(argv)
        if positionals and positionals[0] == "--publish":
            if len(positionals) != 2 or set(opts) - {"entity"}:
                raise ValueError("--publish takes one specification file and optionally entity=")
            path = Path(positionals[1])
            if not path.is_file():
                raise ValueError(f"--publish {path}: no such file (a specification `harness dashboard NAME` wrote)")
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"--publish {path}: not a JSON dashboard specification ({exc})") from None
            spec = validate_spec(doc, path=path)
            problem = unreachable(base_url())
            if problem is not None:
                raise ValueError(f"W&B server {base_url()} not reachable ({problem}); nothing published")
            print(f"published {publish(spec, entity=opts.get('entity'))}")
            return 0
        extra = set(opts) - {"mode", "project", "entity", "records", "out", "overwrite", "min_rounds"}
        if len(positionals) != 1 or extra:
            raise ValueError(
                f"expected one sweep or experiment name and options; got {positionals} and {sorted(extra)} "
                "(harness dashboard --help shows the usage)"
            )
        group = positionals[0]
        if group not in known and "records" not in opts and Path(group).is_dir():  # a folder of records
            opts["records"] = group
            found = group_axes(Path(group), "")[1]
            if len(found) != 1:
                raise ValueError(
                    f"{group} holds records of {len(found)} W&B groups ({', '.join(found) or 'none'}); name the group "
                    f"and give the folder as records={group}"
                )
            group = found[0]
        mode = opts.get("mode", "offline")
        if mode not in {"offline", "online"}:
            raise ValueError(f"mode must be offline or online; got {mode!r}")
        if group not in known and "records" not in opts:
            raise ValueError(
                f"unknown sweep or experiment {group!r}; one of {sorted(known)} (or give records=DIR for another group)"
            )
        min_rounds = whole_number_option("min_rounds", opts.get("min_rounds"), MIN_DEPTH_ROUNDS)
        if min_rounds != MIN_DEPTH_ROUNDS:  # the runs logged their split already; panels cannot move it
            raise ValueError(
                f"min_rounds={min_rounds}: the runs split acceptance by depth at {MIN_DEPTH_ROUNDS} rounds when they "
                "logged it (depth/acceptance, depth/acceptance_few_rounds), and a specification cannot move that "
                f"split; depth/rounds_tried shows each depth's rounds (min_rounds={MIN_DEPTH_ROUNDS} or leave it out)"
            )
        records = Path(opts["records"]) if "records" in opts else known.get(group)
        if "records" in opts and not records.is_dir():
            raise ValueError(f"records={records}: not a folder")
        axes_rows, groups, config_keys = (
            group_axes(records, group) if records is not None and records.is_dir() else ([], [], [])
        )
        crossed = list((swept or {}).get(group, ()))
        experiments = EXPERIMENT in crossed  # the sweep file says so whether or not its records are here
        if not axes_rows:  # no records yet (or elsewhere): the sweep file says what else it crosses
            config_keys = [k for k in crossed if k != EXPERIMENT]
        count, projects = group_projects(records, group) if records is not None and records.is_dir() else (0, set())
        project, note = dashboard_project(group, opts.get("project"), count, projects, records=records)
        if opts.get("entity") is not None and tracking_problem(DEFAULT_PROJECT, opts["entity"], environ={}):
            raise ValueError(tracking_problem(DEFAULT_PROJECT, opts["entity"], environ={}).replace("tracking.", ""))
    except (ValueError, OSError, RecordError) as exc:
        print_traceback_if_asked(exc)
        print(f"harness dashboard: refused: {exc}", file=sys.stderr)
        return 2
    spec = build_spec(
        group,
        project=project,
        entity=opts.get("entity"),
        axes_rows=axes_rows,
        min_rounds=min_rounds,
        config_keys=config_keys,
        records=records if records is not None and records.is_dir() else None,
        experiments=experiments,
    )
    if "out" in opts:
        out = Path(opts["out"])
    elif records is not None and records.is_dir() and not (records / RECORD_FILENAME).is_file() and not groups:
        out = records / "dashboard.json"  # an empty folder the group's records will land in
    elif records is not None and records.is_dir() and not (records / RECORD_FILENAME).is_file() and axes_rows:
        out = records / "dashboard.json"  # beside the sweep's records; never inside one run's folder
    elif records is not None and "records" not in opts and not records.exists():
        out = records / "dashboard.json"  # the folder a known sweep's records will land in, made now
    else:
        out = Path(f"dashboard-{group.replace('/', '_')}.json")
    try:
        overwrite = boolean_option("overwrite", opts.get("overwrite"))
    except ValueError as exc:
        problem = str(exc)
    else:
        problem = output_file_problem(
            "out",
            out,
            what="a dashboard specification",
            ours=json_object_with("sections", format=SPEC_FORMAT),
            example="dashboard.json",
            overwrite=overwrite,
        )
    if problem is not None:
        print(f"harness dashboard: refused: {problem} (writing {out})", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, spec)
    if note:
        print(f"harness dashboard: note: {note}", file=sys.stderr)
    n_panels = sum(len(s["panels"]) for s in spec["sections"])
    if axes_rows:
        n = len(axes_rows)
        source = f"legends name every axis, and the options that tell runs apart in {n} record{'s' * (n != 1)}"
    elif groups:
        source = (
            f"no record under {records} is of group {group!r} (their groups: {', '.join(groups)}): "
            "legends name every axis"
        )
    else:
        source = "no records found: legends name every axis"
    print(f"wrote {out}: {n_panels} panels for W&B group {group!r} ({source})")
    publish_cmd = f"harness dashboard --publish {out}" + ("" if spec["entity"] else " entity=<your W&B entity>")
    if mode == "offline":
        print(f"publish it with `wandb login` then `{publish_cmd}` (after `wandb sync` of the runs)")
        return 0
    problem = unreachable(base_url())
    if problem is None:
        try:
            print(f"published {publish(spec)}")
            return 0
        except Exception as exc:  # no credentials, no such entity, the server said no: the file stands
            problem = f"{type(exc).__name__}: {exc}"
    print(f"harness dashboard: not published ({problem}); publish later with `{publish_cmd}`", file=sys.stderr)
    return 1
