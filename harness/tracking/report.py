"""`harness report`: a Markdown report with PNGs, regenerated from stored records only.

    harness report <records_root | store.parquet> [out=DIR [overwrite=true]] [recipe=default]

``out=`` defaults to ``<records_root>/report`` (a store's: ``report/`` beside the store); a run
folder's report (or that of a store inside one) goes beside the run folder, to ``<run>-report``,
and an ``out=`` inside a run folder is refused: nothing is written among a run's files.

The recipe (``reports/<name>.yaml``, or a path to a YAML file) lists the plots, in order, with
optional filters; see ``reports/default.yaml``. This module reads records (through
:mod:`harness.tracking.store`) and nothing else: never the model, never the engine.

Kept apart: heuristic runs (``exact: false``) and CPU-budget artifacts are listed in their own
tables and, where a plot shows them, drawn with their own markers and labelled. Numbers quoted
from papers (``source_reported`` in the recipe) appear only in a table titled "source-reported".
"""

from __future__ import annotations

import datetime as _dt
import difflib
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from harness.files import output_folder_problem, run_folder_of, temporary_sibling
from harness.tracking.command_line import boolean_option, parse_command, refuse
from harness.tracking.compare import (
    ALL,
    SECTION_TITLES,
    also_labelled,
    arm_config_keys,
    arm_label,
    arm_table,
    by_section,
    compare,
    config_text,
    filter_runs,
    leader_cell,
    leader_counts,
    leader_prompts_note,
    leaderboard,
    leaderboard_notes,
    machine_values,
    matching_label,
    pooled,
    run_speedups,
    section_columns,
    section_notes,
    varying_text,
)
from harness.tracking.conventions import MIN_DEPTH_ROUNDS, arm_labels, depth_rows
from harness.tracking.conventions import axis_piece as _axis_piece
from harness.tracking.spec_bench import OVERALL, TASK_TITLES
from harness.tracking.store import (
    AXES,
    FAILURES_FILENAME,
    NOT_STARTED,
    RECORD_FILENAME,
    ROUND_COST_STAGES,
    SECTIONS,
    failed_jobs,
    json_column,
    left_out_records,
    no_records_message,
    read_results,
)

REPO_REPORTS = Path(__file__).resolve().parents[1] / "reports"
SECTION_STYLE: dict[str, dict[str, Any]] = {
    "exact": {"marker": "o", "linestyle": "-", "tag": ""},
    "ungated": {"marker": "s", "linestyle": "-.", "tag": " [ungated: a gate was skipped]"},
    "heuristic": {"marker": "^", "linestyle": "--", "tag": " [heuristic, exact=false]"},
    "cpu_budget_artifact": {"marker": "x", "linestyle": ":", "tag": " [CPU-budget artifact]"},
}
SECTION_LEGEND: dict[str, str] = {
    "exact": "exact runs",
    "ungated": "ungated runs (a gate skipped)",
    "heuristic": "heuristic runs (exact: false)",
    "cpu_budget_artifact": "CPU-budget artifacts (small-budget training)",
}
STAGE_COLORS = ["#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974", "#64B5CD"]
PLOT_KEYS = {"kind", "name", "title", "where", "sections", "by", "min_rounds"}
SOURCE_KEYS = ("source", "citation", "quantity", "value", "setting")


@dataclass(frozen=True)
class Plot:
    """What a plot function returns: a figure, or the reason it has nothing to draw; ``caption``, a
    line the report writes under the figure."""

    figure: Figure | None
    note: str = ""
    caption: str = ""


# --------------------------------------------------------------------------------------------
# recipe


def find_recipe(recipe: str) -> Path:
    """A YAML path, else ``reports/<recipe>.yaml`` under the working directory, else the repo's."""
    direct = Path(recipe)
    if direct.suffix in {".yaml", ".yml"} and direct.is_file():
        return direct
    for folder in (Path.cwd() / "reports", REPO_REPORTS):
        path = folder / f"{recipe}.yaml"
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"recipe {recipe!r} not found: looked for {direct}, {Path.cwd() / 'reports'}/{recipe}.yaml "
        f"and {REPO_REPORTS}/{recipe}.yaml"
    )


#: the top-level keys of a recipe
RECIPE_KEYS = {"title", "source_reported", "compare", "leaderboard", "plots"}


def load_recipe(path: Path) -> dict[str, Any]:
    """A report recipe, checked: its keys, each plot's kind and keys, and the type of every value
    a plot reads (a misspelt key or a value of the wrong type is refused naming it, not ignored)."""
    try:
        recipe = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ValueError(f"{path}:{where}: not YAML a recipe can be read from ({problem})") from None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("plots"), list):
        raise ValueError(f"{path}: a recipe is a mapping with a 'plots' list; got {recipe!r}")
    extra = set(recipe) - RECIPE_KEYS
    if extra:
        near = difflib.get_close_matches(str(sorted(extra)[0]), RECIPE_KEYS, n=1)
        raise ValueError(
            f"{path}: unknown key {sorted(extra)[0]!r}"
            + (f" (did you mean {near[0]!r}?)" if near else "")
            + f"; a recipe's keys are {sorted(RECIPE_KEYS)}"
        )
    if "title" in recipe and not isinstance(recipe["title"], str):
        raise ValueError(f"{path}: title must be a string; got {recipe['title']!r}")
    for i, spec in enumerate(recipe["plots"]):
        if not isinstance(spec, dict) or spec.get("kind") not in PLOTS:
            raise ValueError(f"{path}: plots[{i}].kind must be one of {sorted(PLOTS)}; got {spec!r}")
        extra = set(spec) - PLOT_KEYS
        if extra:
            raise ValueError(f"{path}: plots[{i}] has unknown keys {sorted(extra)}; allowed {sorted(PLOT_KEYS)}")
        for key in ("name", "title", "by"):
            if key in spec and not isinstance(spec[key], str):
                raise ValueError(f"{path}: plots[{i}].{key} must be a string; got {spec[key]!r}")
        if "name" in spec and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", spec["name"]):
            raise ValueError(
                f"{path}: plots[{i}].name={spec['name']!r} must be a plain file name stem (letters, digits, . _ -)"
            )
        rounds = spec.get("min_rounds", 1)
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"{path}: plots[{i}].min_rounds must be a whole number >= 1; got {rounds!r}")
        bad = set(spec.get("sections", [])) - set(SECTIONS)
        if bad:
            raise ValueError(f"{path}: plots[{i}].sections {sorted(bad)} not in {list(SECTIONS)}")
    return recipe


#: the keys of a recipe's ``compare`` and ``leaderboard`` sections
TABLE_KEYS = {"by", "baseline", "where"}


def recipe_column_problem(recipe: Mapping[str, Any], path: Path, df: pd.DataFrame) -> str | None:
    """Why ``recipe`` cannot be drawn from the store ``df`` (None when it can): a ``compare`` or
    ``leaderboard`` section with a key it does not read, a ``by`` or ``where`` key naming no
    column of the store (an axis, or ``config.<key>``). The command line's ``harness compare
    by=...`` refuses such a name; a recipe is refused alike, not reported as "not available"."""
    named: list[tuple[str, str]] = []
    for section in ("compare", "leaderboard"):
        table = recipe.get(section) or {}
        if not isinstance(table, Mapping):
            return f"{path}: {section} must be a mapping of {sorted(TABLE_KEYS)}; got {table!r}"
        extra = set(table) - TABLE_KEYS
        if extra:
            return f"{path}: {section} has unknown keys {sorted(extra)}; allowed {sorted(TABLE_KEYS)}"
        named += [(f"{section}.by", str(table["by"]))] if "by" in table else []
        if not isinstance(table.get("where") or {}, Mapping):
            return f"{path}: {section}.where must be a mapping of filters ({{key: value}}); got {table['where']!r}"
        named += [(f"{section}.where.{k}", str(k)) for k in (table.get("where") or {})]
    for i, spec in enumerate(recipe["plots"]):
        named += [(f"plots[{i}].by", str(spec["by"]))] if "by" in spec else []
        if not isinstance(spec.get("where") or {}, Mapping):
            return f"{path}: plots[{i}].where must be a mapping of filters ({{key: value}}); got {spec['where']!r}"
        named += [(f"plots[{i}].where.{k}", str(k)) for k in (spec.get("where") or {})]
    for where, column in named:
        filter_key = ".where." in where  # a filter reads config.<key> too; by names a column as it is
        if column not in df.columns and not (filter_key and f"config.{column}" in df.columns):
            return f"{path}: {where}={column!r} names no axis {list(AXES)} or column of this store"
    table = recipe.get("compare") or {}
    if table.get("baseline") is not None:  # a baseline no run of the store has (a misspelt arm, say)
        by = str(table.get("by", "proposer"))
        arms = {arm_label(v) for v in df[by]} if by in df.columns else set()
        wanted = str(table["baseline"])
        if arms and matching_label(wanted, arms) not in arms:
            return f"{path}: compare.baseline={wanted!r} is no {by} of this store's runs; they have {sorted(arms)}"
    return None


def load_source_reported(path: Path | None) -> list[dict[str, str]]:
    """Entries of a source-reported YAML (``entries: [{source, citation, quantity, value, setting}]``)."""
    if path is None:
        return []
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    entries = data.get("entries") or []
    for i, e in enumerate(entries):
        missing = [k for k in SOURCE_KEYS if k not in e]
        if missing:
            raise ValueError(f"{path}: entries[{i}] is missing {missing}; each entry needs {list(SOURCE_KEYS)}")
    return [{k: str(e[k]) for k in SOURCE_KEYS} for e in entries]


# --------------------------------------------------------------------------------------------
# helpers


def axis_piece(axis: str, value: Any) -> str:
    """How one axis value reads in a legend: ``T=0.7``, ``B=4``, else the bare value."""
    return _axis_piece(axis, value)


def run_labels(df: pd.DataFrame) -> dict[str, str]:
    """A label per run: its arm, by the axes that differ among the runs shown (never a run id),
    and the options that tell one arm's runs apart (a swept ``topology.max_nodes``:
    :func:`~harness.tracking.compare.arm_config_keys`), its machine where the runs span machines
    (``machine=cuda: NVIDIA H100``: two machines' runs of one arm are no repeats), plus the section tag
    (:func:`harness.tracking.conventions.arm_labels`)."""
    axes = [a for a in AXES if a in df.columns]
    keys = arm_config_keys(df)
    machines = dict(zip(df["run_id"], machine_values(df), strict=True))
    spanned = len(set(machines.values())) > 1
    options = {  # an option a run does not set (another proposer's) is no part of its label
        r["run_id"]: "/".join(
            [
                *(f"{k}={text}" for k in keys if (text := config_text(r.get(f"config.{k}"))) != "null"),
                *([f"machine={machines[r['run_id']]}"] if spanned else []),
            ]
        )
        for _, r in df.iterrows()
    }
    labels = arm_labels({r["run_id"]: {a: r[a] for a in axes} for _, r in df.iterrows()}, options=options)
    return {
        r["run_id"]: labels[r["run_id"]]
        + SECTION_STYLE[r["section"]]["tag"]
        + (f" {a}" if (a := also_labelled(r)) else "")
        for _, r in df.iterrows()
    }


#: characters of a run label drawn whole beside a plot's axes, in a legend (the acceptance plot's;
#: narrower figures leave less) and as tick labels or annotations; a longer label is drawn as a key
LEGEND_ROOM = 72
TICK_ROOM = 40


@dataclass(frozen=True)
class PlotLabels:
    """What a plot draws for each run (``text``: run id -> label or key) and the key lines under it
    (empty when the labels are drawn whole)."""

    text: dict[str, str]
    key: list[str]

    def height(self, width: float) -> float:
        """Inches the key needs under a plot ``width`` inches wide."""
        return 0.0 if not self.key else 0.3 + 0.135 * len(key_lines(self.key, width))


def plot_labels(df: pd.DataFrame, room: int) -> PlotLabels:
    """:func:`run_labels`, drawn whole where each fits in ``room`` characters (or the plot draws one
    run), else keys in the runs' order (``R1``, ``R2``, ...) spelled out in a key under the plot: a
    legend of a dozen arms that differ in several options would otherwise squeeze the axes."""
    full = run_labels(df)
    if len(full) < 2 or all(len(label) <= room for label in full.values()):
        return PlotLabels(full, [])
    keys = {run_id: f"R{i}" for i, run_id in enumerate(dict.fromkeys(df["run_id"]), 1)}
    return PlotLabels(keys, [f"{keys[run_id]}: {full[run_id]}" for run_id in keys])


def key_lines(key: Sequence[str], width: float) -> list[str]:
    """``key`` wrapped to a figure ``width`` inches wide at the key's font size."""
    chars = max(40, int(width * 15))
    lines = []
    for entry in key:
        line = ""
        for piece in re.split(r"(?<=[/ ])", entry):  # a label breaks after an option's slash
            if line.strip() and len(line) + len(piece) > chars:
                lines.append(line)
                line = "      "
            line += piece
        lines.append(line)
    return lines


def draw_key(fig: Figure, labels: PlotLabels, title: str = "runs") -> None:
    """The key of ``labels`` under everything else in ``fig``, headed ``title`` (nothing when labels
    are drawn whole)."""
    if not labels.key:
        return
    lines = key_lines(labels.key, fig.get_figwidth())
    blank = [Line2D([], [], linestyle="none")] * len(lines)
    fig.legend(
        blank,
        lines,
        loc="outside lower left",
        title=title,
        title_fontsize=7,
        alignment="left",
        fontsize=7,
        handlelength=0,
        handletextpad=0,
        frameon=False,
        labelspacing=0.2,
    )


def _sections(df: pd.DataFrame, spec: Mapping[str, Any], default: Sequence[str]) -> pd.DataFrame:
    return df[df["section"].isin(spec.get("sections", default))]


def _no_runs(df: pd.DataFrame, spec: Mapping[str, Any], default: Sequence[str]) -> str:
    """Why a plot drawing the sections ``spec`` (or ``default``) names has no runs in ``df``."""
    wanted = list(spec.get("sections", default))
    present = sorted(set(df["section"])) if "section" in df.columns else []
    return f"no runs of sections {wanted} (the runs here are {', '.join(present) or 'none'})"


def _num(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _new_figure(width: float = 8.0, height: float = 4.5) -> Figure:
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    return fig


def _finish(
    fig: Figure,
    ax: Any,
    spec: Mapping[str, Any],
    title: str,
    *,
    xlabel: str,
    ylabel: str,
    legend_size: int = 8,
    grid_which: str = "major",
) -> Plot:
    """Label ``ax``, draw its grid and legend and title it (the recipe's ``title`` over
    ``title``): the plot of ``fig``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which=grid_which)
    ax.legend(fontsize=legend_size)
    ax.set_title(spec.get("title", title), fontsize=10)
    return Plot(fig)


# --------------------------------------------------------------------------------------------
# plots: each takes the filtered store frame and its spec, returns a Plot


#: the y label of the plots of the decode speedup (the leaderboard's and compare's statistic)
SPEEDUP_LABEL = "decode speedup over AR\n(AR ms / AR tokens) / (spec ms / spec tokens),\neach summed over prompts"


#: the categories' bar colours: matplotlib's tab20 without its greys (the ``all`` bars are grey, hatched)
CATEGORY_COLOURS = tuple(c for i, c in enumerate(colormaps["tab20"].colors) if i not in (14, 15))


def run_colour(k: int, n: int) -> Any:
    """The colour of run ``k`` of ``n`` in a plot with a line per run (its line style says its
    section): matplotlib's ten-colour cycle, twenty colours up to twenty runs, and beyond that
    ``n`` colours spread over a continuous map, so no two runs share one."""
    import matplotlib

    if n <= 10:
        return f"C{k}"
    if n <= 20:
        return matplotlib.colormaps["tab20"](k)
    return matplotlib.colormaps["turbo"](k / (n - 1))


def _headroom(ax) -> None:
    """A third more room above the tallest bar (its error bar included), where the legend goes."""
    bottom, top = ax.get_ylim()
    ax.set_ylim(bottom, top + (top - bottom) / 3)


def _bar_sections(spec: Mapping[str, Any]) -> list[str]:
    """The sections a bar plot draws, in the store's order (default: exact runs only)."""
    wanted = set(spec.get("sections") or ["exact"])
    return [s for s in SECTIONS if s in wanted]


def _section_arm(arm: str, section: str, sections: Sequence[str]) -> str:
    """An arm's bar label: its section's tag beside it where the plot draws several (an arm of one name
    can run in two of them)."""
    return arm if len(sections) == 1 else arm + SECTION_STYLE[section]["tag"]


#: the mark beside an arm's label in a bar plot when the arm pools runs of other configurations
POOLED_MARK = "*"


@dataclass(frozen=True)
class PooledArms:
    """The arms of a bar plot, each with the label drawn for it: its name, :data:`POOLED_MARK` after
    the name where it pools runs that differ in more than the plot's ``by`` axis, then its section's
    tag where the plot draws several sections; the footnote drawn under the figure and the caption
    the report writes under it name what those arms pool."""

    labels: dict[tuple[str, str], str]  # (section, arm) -> the label drawn
    footnote: PlotLabels
    caption: str


def pooled_arms(
    varying: Mapping[tuple[str, str], Mapping[str, Sequence[str]]], by: str, sections: Sequence[str]
) -> PooledArms:
    """:class:`PooledArms` from each arm's (section, name) -> its ``varying`` (what differs among its
    runs; repeats of other seeds pool nothing: :func:`~harness.tracking.compare.pooled`), drawn in a
    plot of ``sections``."""
    pooling = {key: pooled(v) for key, v in varying.items() if pooled(v)}
    labels = {
        (section, arm): _section_arm(f"{arm}{POOLED_MARK}" if (section, arm) in pooling else arm, section, sections)
        for section, arm in varying
    }
    named = [f"{labels[key]}: {varying_text(v)}" for key, v in pooling.items()]
    caption = (
        f"arms marked {POOLED_MARK} pool runs that differ in more than {by} ({'; '.join(named)}): each of their "
        "bars pools those runs' prompts into one figure, not one configuration's"
        if named
        else ""
    )
    return PooledArms(labels, PlotLabels({}, named), caption)


def _pooled_title(by: str) -> str:
    """The heading of a bar plot's footnote naming its pooled arms."""
    return f"{POOLED_MARK} pools runs that differ in more than {by}"


def plot_speedup_by_proposer_workload(df: pd.DataFrame, spec: Mapping[str, Any]) -> Plot:
    sections = _bar_sections(spec)
    runs = df[df["section"].isin(sections)]
    if runs.empty:
        return Plot(None, f"no {' or '.join(sections)} runs")
    by = spec.get("by", "proposer")
    rows = [r for r in compare(runs, by=by) if r.section in sections]
    marks = pooled_arms({(r.section, r.arm): r.varying for r in rows if r.category == ALL}, by, sections)
    labelled = marks.labels
    arms = [labelled[k] for k in sorted(labelled, key=lambda k: (sections.index(k[0]), k[1]))]
    cats = sorted({r.category for r in rows} - {ALL}) + [ALL]
    fig = _new_figure(8.0, 4.5 + marks.footnote.height(8.0))
    ax = fig.add_subplot()
    width = 0.8 / len(cats)
    bare = 0  # bars with no interval (one prompt)
    for j, cat in enumerate(cats):
        xs, ys, err = [], [], []  # err: (x, y, below, above) where the speedup has an interval
        for i, arm in enumerate(arms):
            hit = [r for r in rows if labelled[(r.section, r.arm)] == arm and r.category == cat]
            if not hit or hit[0].speedup.value is None:
                continue
            s = hit[0].speedup
            xs.append(i + (j - (len(cats) - 1) / 2) * width)
            ys.append(s.value)
            if s.ci_low is not None and s.ci_high is not None:  # one prompt has none: no bar is drawn for it
                err.append((xs[-1], s.value, s.value - s.ci_low, s.ci_high - s.value))
            else:
                bare += 1
        ax.bar(
            xs,
            ys,
            width=width,
            label=f"category: {cat}",
            color=CATEGORY_COLOURS[j % len(CATEGORY_COLOURS)] if cat != ALL else "0.45",
            hatch="//" if cat == ALL else None,
            edgecolor="white" if cat == ALL else None,
        )
        if err:
            ex, ey, below, above = zip(*err, strict=True)
            ax.errorbar(ex, ey, yerr=[below, above], fmt="none", ecolor="k", elinewidth=1, capsize=3)
    ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    ax.text(0.99, 1.0, "AR = 1", va="bottom", ha="right", fontsize=8, transform=ax.get_yaxis_transform())
    # long labels (an arm split by machine or model, a section's tag) overlap unless slanted
    ax.set_xticks(range(len(arms)), arms, rotation=20, ha="right", fontsize=8)
    ax.set_xlabel(by)
    ax.set_ylabel(SPEEDUP_LABEL)
    _headroom(ax)
    ax.legend(fontsize=8)
    ax.set_title(
        spec.get(
            "title",
            f"Speedup by {by} and workload category\n({', '.join(sections)} runs; 95% paired-bootstrap CI over prompts"
            f"{no_interval_caption(bare)})",
        ),
        fontsize=10,
    )
    draw_key(fig, marks.footnote, _pooled_title(by))
    return Plot(fig, caption=marks.caption)


def no_interval_caption(bare: int) -> str:
    """The part of a speedup plot's title that says how many of its bars have no interval (one
    resampling unit measured them: a single prompt, or prompts that shared batches), where some have none."""
    return f"; {bare} bar{'s' if bare != 1 else ''} without one: a single prompt or batch" if bare else ""


def _depth_metrics(runs: pd.DataFrame) -> list[dict[str, Any]]:
    """Per run, the record metrics :func:`depth_rows` reads (the counts are None in stores
    written before records carried them)."""
    columns = {}
    for name in ("acceptance_by_depth", "reach_by_depth", "rounds_tried_by_depth", "rounds_accepted_by_depth"):
        columns[name] = list(json_column(runs, name)) if name in runs.columns else [None] * len(runs)
    rounds = [_num(v) for v in runs["rounds"]] if "rounds" in runs.columns else [None] * len(runs)
    return [
        {**{name: columns[name][i] for name in columns}, "rounds": None if rounds[i] is None else int(rounds[i])}
        for i in range(len(runs))
    ]


def plot_acceptance_by_depth(df: pd.DataFrame, spec: Mapping[str, Any]) -> Plot:
    """Acceptance (given depth d-1 reached) and reach at each depth, each point with its 95% Wilson
    interval; a depth tried by fewer than ``min_rounds`` rounds is drawn hollow and grey, and the
    third panel shows how many rounds tried each depth."""
    runs = _sections(df, spec, SECTIONS)  # each run with its section's marker and tag
    if runs.empty:
        return Plot(None, _no_runs(df, spec, SECTIONS))
    min_rounds = int(spec.get("min_rounds", MIN_DEPTH_ROUNDS))
    labels = plot_labels(runs, LEGEND_ROOM)
    fig = _new_figure(13, 4.5 + labels.height(13))
    ax_c, ax_r, ax_n = fig.subplots(1, 3)
    ax_r.sharey(ax_c)
    uncounted = []
    for k, ((_, r), metrics) in enumerate(zip(runs.iterrows(), _depth_metrics(runs), strict=True)):
        rows = depth_rows(metrics, min_rounds=min_rounds)
        if not rows:
            continue
        st = SECTION_STYLE[r["section"]]
        color = run_colour(k, len(runs))
        if rows[0]["tried"] is None:
            uncounted.append(labels.text[r["run_id"]])
        for ax, key in ((ax_c, "acceptance"), (ax_r, "reach")):
            pts = [row for row in rows if row[key] is not None]
            ax.plot(
                [row["depth"] for row in pts],
                [row[key] for row in pts],
                color=color,
                linestyle=st["linestyle"],
                linewidth=1,
                label=labels.text[r["run_id"]] if ax is ax_c else None,
            )
            for row in pts:
                few = row["enough"] is False
                lo, hi = row[f"{key}_low"], row[f"{key}_high"]
                if lo is not None and hi is not None:
                    ax.errorbar(
                        row["depth"],
                        row[key],
                        yerr=[[max(row[key] - lo, 0.0)], [max(hi - row[key], 0.0)]],
                        color="0.7" if few else color,
                        capsize=2,
                        linewidth=0.8,
                    )
                ax.plot(
                    row["depth"],
                    row[key],
                    marker=st["marker"],
                    color="0.6" if few else color,
                    markerfacecolor="none" if few else color,
                    linestyle="none",
                )
        counted = [row for row in rows if row["tried"] is not None]
        if counted:
            ax_n.plot(
                [row["depth"] for row in counted],
                [row["tried"] for row in counted],  # 0 drawn at 0: the axis is linear below 1
                marker=st["marker"],
                color=color,
                linestyle=st["linestyle"],
                linewidth=1,
            )
    ax_c.set_title("acceptance at depth d,\ngiven depth d-1 reached", fontsize=9)
    ax_r.set_title("reach:\nP(accepted path length >= d)", fontsize=9)
    ax_n.set_title("rounds that\ntried depth d", fontsize=9)
    for ax in (ax_c, ax_r):
        ax.set_ylim(0, 1.02)
    for ax in (ax_c, ax_r, ax_n):
        ax.set_xlabel("depth d")
        ax.grid(alpha=0.3)
    ax_c.set_ylabel("probability (95% Wilson interval)")
    ax_n.set_yscale("symlog", linthresh=1.0)  # logarithmic above 1 round, linear to 0 (a depth no round tried)
    # the threshold line stays inside the axes when every depth was tried by fewer rounds
    ax_n.set_ylim(bottom=0, top=max(ax_n.get_ylim()[1], 2.0 * min_rounds))
    ax_n.axhline(min_rounds, color="0.5", linestyle=":", linewidth=1)
    ax_n.text(ax_n.get_xlim()[0], min_rounds, f" {min_rounds} rounds", va="bottom", fontsize=7, color="0.4")
    ax_n.set_ylabel("rounds (log above 1)")
    fig.legend(loc="outside right center", fontsize=7)
    note = f"depths tried by fewer than {min_rounds} rounds: hollow grey points"
    if uncounted:
        note += "; no round counts (no intervals) for: " + ", ".join(uncounted)
    fig.suptitle(f"{spec.get('title', 'Acceptance by depth')}\n{note}", fontsize=9)
    draw_key(fig, labels)
    return Plot(fig)


def plot_accepted_length_hist(df: pd.DataFrame, spec: Mapping[str, Any]) -> Plot:
    runs = _sections(df, spec, SECTIONS)  # each run with its section's marker and tag
    if runs.empty:
        return Plot(None, _no_runs(df, spec, SECTIONS))
    labels = plot_labels(runs, LEGEND_ROOM - 16)
    fig = _new_figure(9, 4.5 + labels.height(9))
    ax = fig.add_subplot()
    for k, ((_, r), hist) in enumerate(zip(runs.iterrows(), json_column(runs, "accepted_length_hist"), strict=True)):
        hist = hist or []
        total = sum(hist)
        if not total:
            continue
        st = SECTION_STYLE[r["section"]]
        ax.plot(
            range(len(hist)),
            [h / total for h in hist],
            color=run_colour(k, len(runs)),
            marker=st["marker"],
            linestyle=st["linestyle"],
            label=f"{labels.text[r['run_id']]} (n={total} rounds)",
        )
    ax.set_xlabel("accepted candidate tokens per round (bonus token not counted)")
    ax.set_ylabel("fraction of rounds")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside right center", fontsize=7)
    ax.set_title(spec.get("title", "Accepted-length distribution"), fontsize=10)
    draw_key(fig, labels)
    return Plot(fig)


def plot_round_cost(df: pd.DataFrame, spec: Mapping[str, Any]) -> Plot:
    runs = _sections(df, spec, SECTIONS)  # each run with its section's marker and tag
    if runs.empty:
        return Plot(None, _no_runs(df, spec, SECTIONS))
    labels = plot_labels(runs, TICK_ROOM)
    fig = _new_figure(9, 1.6 + 0.42 * len(runs) + labels.height(9))
    ax = fig.add_subplot()
    names = [labels.text[r] for r in runs["run_id"]]
    left = np.zeros(len(runs))  # [R]
    for stage, color in zip(ROUND_COST_STAGES, STAGE_COLORS, strict=True):
        vals = runs[f"round_cost_ms.{stage}"].map(lambda v: _num(v) or 0.0).to_numpy()  # [R]
        ax.barh(names, vals, left=left, color=color, label=stage)
        left += vals
    # a batch round's wall time (decode time / batch rounds) and what AR takes for the tokens one
    # commits (AR ms/token x tokens per batch round): the bar reaches the first, so it ends before
    # its mark exactly when the run's decode speedup is above 1, at any batch size
    if {"committed_tokens", "batch_rounds"} <= set(runs.columns):  # [R] tokens per batch round
        per_round = runs["committed_tokens"].map(_num) / runs["batch_rounds"].map(_num)
    else:  # records from before batch rounds were counted: batch 1's rounds
        per_round = runs["mean_committed_per_round"].map(_num)
    per_round = per_round.fillna(runs["mean_committed_per_round"].map(_num))
    wall = (runs["time_per_committed_token_ms"].map(_num) * per_round).to_numpy(dtype=float)
    other = np.clip(np.nan_to_num(wall - left), 0.0, None)  # the round's time outside its timed stages
    ax.barh(names, other, left=left, color="0.8", label="other (between stages)")
    breakeven = (runs["ar_time_per_token_ms"].map(_num) * per_round).to_numpy(dtype=float)
    ax.scatter(
        breakeven, names, marker="|", s=250, color="k", zorder=3, label="break-even: AR ms/token x tokens/batch round"
    )
    ax.invert_yaxis()
    ax.set_xlabel("mean ms per round")
    fig.legend(loc="outside upper center", ncol=4, fontsize=7)  # the key, where there is one, goes below
    ax.set_title(
        spec.get(
            "title",
            "Round-cost ledger per run: mean ms per batch round\n"
            "(a bar shorter than its break-even mark is faster than AR)",
        ),
        fontsize=10,
    )
    draw_key(fig, labels)
    return Plot(fig)


def plot_temp_kv_vs_rows(df: pd.DataFrame, spec: Mapping[str, Any]) -> Plot:
    runs = _sections(df, spec, SECTIONS)
    if runs.empty:
        return Plot(None, _no_runs(df, spec, SECTIONS))
    if "config.topology.max_nodes" not in runs.columns:
        return Plot(None, "no record carries config.topology.max_nodes")
    # the rows a round can verify (a chain's max_depth, an expansion's widths), which the budget is
    # sized from; topology.max_nodes for a record that does not say
    verified = pd.to_numeric(runs.get("context.tree_rows", pd.Series(index=runs.index, dtype=float)), errors="coerce")
    verified = verified.fillna(pd.to_numeric(runs["config.topology.max_nodes"], errors="coerce"))
    fig = _new_figure()
    ax = fig.add_subplot()
    mib = 1024.0 * 1024.0
    order = {name: k for k, name in enumerate(SECTIONS)}
    groups = sorted(runs.groupby(["section", "batch_size"], sort=False), key=lambda g: (order[g[0][0]], g[0][1]))
    for (section, bs), group in groups:
        rows = verified.loc[group.index].to_numpy(dtype=float)
        st = SECTION_STYLE[section]  # ungated, heuristic and CPU-budget runs with their own marker and tag
        ax.scatter(
            rows,
            group["temp_kv_bytes_peak"] / mib,
            marker=st["marker"],
            s=40,
            label=f"measured peak, B={arm_label(bs)}{st['tag']}",
        )
        # the most the configuration lets a round append: B x verified rows x KV bytes per token (the
        # measured peak is B x the widest round's padded rows; a formula copied from it would always agree)
        if "temp_kv_bytes_budget_formula" in group.columns:
            ax.scatter(
                rows,
                pd.to_numeric(group["temp_kv_bytes_budget_formula"], errors="coerce") / mib,
                marker="s",
                s=90,
                facecolors="none",
                edgecolors="k",
                linewidths=0.8,
            )
    if "temp_kv_bytes_budget_formula" in runs.columns:
        ax.scatter([], [], marker="s", facecolors="none", edgecolors="k", label="budget: B x rows x KV bytes/token")
    return _finish(
        fig,
        ax,
        spec,
        "Temporary KV bytes vs candidate rows",
        xlabel="candidate rows a round can verify (topology.max_nodes, or a chain's max_depth)",
        ylabel="temporary KV (MiB)",
    )


def plot_t_profile(df: pd.DataFrame, spec: Mapping[str, Any]) -> Plot:
    runs = _sections(df, spec, list(SECTIONS))
    profiles = [(r, p) for (_, r), p in zip(runs.iterrows(), json_column(runs, "t_profile"), strict=True) if p]
    if not profiles:
        return Plot(None, "no record carries a t(n) profile")
    labels = plot_labels(pd.DataFrame([r for r, _ in profiles]), LEGEND_ROOM - 16)
    fig = _new_figure(8.0, 4.5 + labels.height(8.0))
    ax = fig.add_subplot()
    for r, p in profiles:
        hw = r.get("hardware.device_name") or r.get("hardware.cpu") or r.get("hardware.device") or ""
        (line,) = ax.plot(p["n"], p["t"], marker="o", label=f"{labels.text[r['run_id']]} ({hw})")
        if p.get("floor_ms"):  # the run's roofline floor: weights read once, or the arithmetic at the product rate
            ax.plot(p["n"], p["floor_ms"], linestyle="--", color=line.get_color(), linewidth=1.0)
    if any(p.get("floor_ms") for _, p in profiles):
        ax.plot([], [], linestyle="--", color="grey", linewidth=1.0, label="roofline floor (dashed, per run)")
    ax.set_xscale("log", base=2)
    draw_key(fig, labels)
    return _finish(
        fig,
        ax,
        spec,
        "Target verify time t(n) (hardware profile)",
        xlabel="n: rows verified in one target forward",
        ylabel="t(n) ms",
        legend_size=7,
        grid_which="both",
    )


def _run_speedup(row: pd.Series, prompts: list[dict[str, Any]] | None) -> tuple[float | None, ...]:
    """The run's decode speedup and its interval, as the record and ``harness compare`` give them."""
    if not prompts:
        return None, None, None
    est, _ = run_speedups(prompts, row)
    return est.value, est.ci_low, est.ci_high


def series_config_keys(runs: pd.DataFrame) -> list[str]:
    """The config keys that differ among runs sharing every axis but batch size: the options
    (:func:`~harness.tracking.compare.arm_config_keys`) that tell one arm's runs apart, and those
    that differ only from one batch size to another (``topology.max_nodes`` 8 at B=1, 16 at B=2).
    The batch size's own option (``generation.batch_size``) and seeds are none of them."""
    if "batch_size" not in runs.columns:
        return arm_config_keys(runs)
    return arm_config_keys(runs.assign(batch_size=0))  # every batch size in one group per other axes


def plot_speedup_vs_batch(df: pd.DataFrame, spec: Mapping[str, Any]) -> Plot:
    runs = _sections(df, spec, ["exact"])
    if runs.empty or runs["batch_size"].nunique() < 2:
        return Plot(None, "fewer than two batch sizes among the runs")
    series_axes = [a for a in AXES if a != "batch_size"]
    # a series is one configuration of one section on one machine: its axes and the options that tell
    # apart runs of every axis but batch size (a swept topology.max_nodes, or one set per batch size),
    # so a line never zig-zags through two configurations at one batch size, nor joins one
    # configuration's point to another's at the next batch size, nor an ungated (or heuristic) run to an
    # exact one, nor one machine's point to another's
    options = [k for k in series_config_keys(runs) if f"config.{k}" in runs.columns]
    fig = _new_figure()
    ax = fig.add_subplot()
    order = {name: k for k, name in enumerate(SECTIONS)}
    machines = machine_values(runs)
    keyed = runs.assign(
        _machine=machines,
        _key=[
            (
                order[r["section"]],
                machine,
                *(arm_label(r[a]) for a in series_axes),
                *(config_text(r.get(f"config.{k}")) for k in options),
            )
            for machine, (_, r) in zip(machines, runs.iterrows(), strict=True)
        ],
    )
    vary = [a for a in series_axes if runs[a].map(arm_label).nunique() > 1]
    drawn = 0
    for _key, group in keyed.groupby("_key", sort=True):
        if group["batch_size"].nunique() < 2:
            continue
        drawn += 1
        group = group.sort_values("batch_size")
        # repeats of one configuration (seeds) at one batch size: points, no line through them
        repeats = bool(group["batch_size"].duplicated().any())
        # the point is the record's own decode speedup: at batch B > 1 the batch wall time per
        # committed token against batched AR on the same batches (throughput), which per-prompt
        # latencies cannot reproduce; the paired-bootstrap CI over prompts (the same statistic at
        # batch size 1) is drawn at batch size 1 only
        pts = [_run_speedup(r, p) for (_, r), p in zip(group.iterrows(), json_column(group, "per_prompt"), strict=True)]
        ys = np.array([_num(r.get("decode_speedup")) or np.nan for _, r in group.iterrows()], dtype=float)
        single = (group["batch_size"].astype(int) == 1).to_numpy()
        # no bar where there is no interval (a batched run, or too few prompts): NaN draws none, where a
        # zero would draw a bar of no width, as if the point were exact
        lo = np.where(single, ys - np.array([np.nan if p[1] is None else p[1] for p in pts], dtype=float), np.nan)
        hi = np.where(single, np.array([np.nan if p[2] is None else p[2] for p in pts], dtype=float) - ys, np.nan)
        lo, hi = np.clip(lo, 0.0, None), np.clip(hi, 0.0, None)
        first = group.iloc[0]
        pieces = [axis_piece(a, first[a]) for a in vary]
        pieces += [f"{k}={text}" for k in options if (text := config_text(first.get(f"config.{k}"))) != "null"]
        pieces += [f"machine={first['_machine']}"] if len(set(machines)) > 1 else []
        st = SECTION_STYLE[first["section"]]  # ungated, heuristic and CPU-budget series with their own marker and tag
        label = ("/".join(pieces) or "runs") + (" (repeats)" if repeats else "") + st["tag"]
        label += f" {also}" if (also := also_labelled(first)) else ""
        ax.errorbar(
            group["batch_size"],
            ys,
            yerr=[lo, hi],
            marker=st["marker"],
            capsize=3,
            linestyle="none" if repeats else st["linestyle"],
            label=label,
        )
    if not drawn:
        return Plot(
            None,
            "no configuration was run at two batch sizes (the other axes and options held fixed, in one section, "
            "on one machine)",
        )
    ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(runs["batch_size"].unique()), [arm_label(b) for b in sorted(runs["batch_size"].unique())])
    return _finish(
        fig,
        ax,
        spec,
        "Decode speedup over batched AR vs batch size (CI over prompts at B=1)",
        xlabel="batch size",
        ylabel="decode speedup over AR\nat the same batch size",
    )


def _frontier_groups(runs: pd.DataFrame) -> tuple[list[str], pd.Series]:
    """The (target model, machine, batch size) groups of ``runs``: each group's name by what differs
    among the groups (``model=tiny, machine=cpu: AMD EPYC, B=4``; ``""`` for a single group), in
    first-seen order, and each run's group as its index in that list. One model's, machine's or
    batch size's time per token is no point on another's frontier."""
    models = [arm_label(v) for v in runs["model"]] if "model" in runs.columns else ["-"] * len(runs)
    sizes = [arm_label(v) for v in runs["batch_size"]] if "batch_size" in runs.columns else ["-"] * len(runs)
    keys = list(zip(models, machine_values(runs), sizes, strict=True))
    groups = list(dict.fromkeys(keys))
    names = []
    for model, machine, size in groups:
        parts = [f"model={model}"] if len({g[0] for g in groups}) > 1 else []
        parts += [f"machine={machine}"] if len({g[1] for g in groups}) > 1 else []
        parts += [f"B={size}"] if len({g[2] for g in groups}) > 1 else []
        names.append(", ".join(parts))
    return names, pd.Series([groups.index(k) for k in keys], index=runs.index)


def plot_frontier(df: pd.DataFrame, spec: Mapping[str, Any]) -> Plot:
    """Time per committed token against committed tokens per round, each run with its section's
    marker; the frontier of the exact runs and their AR time per token are drawn per target model,
    machine and batch size (each group in its own colour, named, when the runs hold more than one)."""
    runs = _sections(df, spec, list(SECTIONS))
    runs = runs.dropna(subset=["mean_committed_per_round", "time_per_committed_token_ms"])
    if runs.empty:
        return Plot(None, "no run has both time per committed token and mean committed per round")
    labels = plot_labels(runs, TICK_ROOM)
    names, group_of = _frontier_groups(runs)
    groups = range(len(names))
    several = len(names) > 1
    colour = [f"C{g % 10}" for g in groups]
    fig = _new_figure(9, 5.5 + labels.height(9))
    ax = fig.add_subplot()
    for section in SECTIONS:
        group = runs[runs["section"] == section]
        if group.empty:
            continue
        st = SECTION_STYLE[section]
        # with several groups a run's colour is its group's and its marker its section's, the section
        # named once in the legend; with one, the section's points carry its legend entry
        for g in groups if several else [None]:
            part = group if g is None else group[group_of[group.index] == g]
            if not part.empty:
                ax.scatter(
                    part["mean_committed_per_round"],
                    part["time_per_committed_token_ms"],
                    marker=st["marker"],
                    s=50,
                    **({"label": SECTION_LEGEND[section]} if g is None else {"color": colour[g]}),
                )
        if several:
            ax.plot([], [], marker=st["marker"], color="0.4", linestyle="none", label=SECTION_LEGEND[section])
        at: dict[tuple[float, float], list[str]] = {}  # runs drawn at one point share one annotation
        for _, r in group.iterrows():
            point = (float(r["mean_committed_per_round"]), float(r["time_per_committed_token_ms"]))
            at.setdefault(point, []).append(labels.text[r["run_id"]])
        for point, texts in at.items():
            ax.annotate(
                (", " if labels.key else "\n").join(texts),
                point,
                textcoords="offset points",
                xytext=(4, 3),
                fontsize=7,
            )
    ars = []
    for g in groups:
        exact = runs[(runs["section"] == "exact") & (group_of == g)].sort_values(
            ["mean_committed_per_round", "time_per_committed_token_ms"], ascending=[False, True]
        )
        if exact.empty:
            continue
        front, best = [], math.inf
        for _, r in exact.iterrows():  # most committed first; keep each new best time
            if r["time_per_committed_token_ms"] < best:
                best = r["time_per_committed_token_ms"]
                front.append((r["mean_committed_per_round"], best))
        fx, fy = zip(*sorted(front), strict=True)
        ax.plot(
            fx,
            fy,
            color=colour[g] if several else "0.3",
            linewidth=1,
            marker="o",
            markersize=12,
            markerfacecolor="none",
            label=f"frontier ({names[g]}): no exact run of this group commits more in less time"
            if several
            else "frontier: no exact run commits more in less time",
        )
        ar = exact["ar_time_per_token_ms"].median()
        if math.isfinite(ar):
            ax.axhline(ar, color=colour[g] if several else "k", linestyle="--", linewidth=0.8)
            ars.append((ar, f"AR {ar:.3g} ms/token (median, exact runs{', ' + names[g] if several else ''}) "))
    for ar, text in ars:  # under the line at its right end: the runs' labels sit above and to the right of their points
        ax.text(ax.get_xlim()[1], ar, text, ha="right", va="top", fontsize=7)
    ax.margins(x=0.2, y=0.08)
    draw_key(fig, labels)
    return _finish(
        fig,
        ax,
        spec,
        "Frontier: time per committed token vs mean committed tokens per round"
        + ("\n(one frontier and AR line per target model, machine and batch size)" if several else ""),
        xlabel="mean committed tokens per round (bonus token included)",
        ylabel="time per committed token (ms)",
    )


def plot_speedup_by_category(df: pd.DataFrame, spec: Mapping[str, Any]) -> Plot:
    """The leaderboard as bars: speedup per Spec-Bench task (or category) and overall, one bar per arm."""
    sections = _bar_sections(spec)
    runs = df[df["section"].isin(sections)]
    if runs.empty:
        return Plot(None, f"no {' or '.join(sections)} runs")
    by = spec.get("by", "proposer")
    columns, rows = leaderboard(runs, by=by)  # the resamples of the report's leaderboard table: the same CIs
    rows = [r for r in rows if r.section in sections]
    rows.sort(key=lambda r: sections.index(r.section))
    columns = section_columns(columns, rows)
    marks = pooled_arms({(r.section, r.arm): r.varying for r in rows}, by, sections)
    fig_width = max(8.0, 1.2 * len(columns) + 3)
    fig = _new_figure(fig_width, 4.5 + marks.footnote.height(fig_width))
    ax = fig.add_subplot()
    width = 0.8 / max(len(rows), 1)
    bare = 0  # bars with no interval (one prompt): no whisker, rather than one of zero width
    for k, row in enumerate(rows):
        xs, ys, err = [], [], []
        for i, col in enumerate(columns):
            cell = row.cells.get(col)
            if cell is None or cell.speedup.value is None:
                continue
            s = cell.speedup
            xs.append(i + (k - (len(rows) - 1) / 2) * width)
            ys.append(s.value)
            if s.ci_low is not None and s.ci_high is not None:
                err.append((xs[-1], s.value, s.value - s.ci_low, s.ci_high - s.value))
            else:
                bare += 1
        ax.bar(xs, ys, width=width, label=f"{by}: {marks.labels[(row.section, row.arm)]}")
        if err:
            ex, ey, below, above = zip(*err, strict=True)
            ax.errorbar(ex, ey, yerr=[below, above], fmt="none", ecolor="k", elinewidth=1, capsize=3)
    ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(columns)), [TASK_TITLES.get(c, c) for c in columns], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(SPEEDUP_LABEL)
    _headroom(ax)
    ax.legend(fontsize=8)
    ax.set_title(
        spec.get(
            "title",
            f"Speedup by category\n({', '.join(sections)} runs; 95% paired-bootstrap CI over prompts"
            f"{no_interval_caption(bare)})",
        ),
        fontsize=10,
    )
    draw_key(fig, marks.footnote, _pooled_title(by))
    # as under the leaderboard's tables: bars side by side over different prompts say so
    apart = [note for _, sec in by_section(rows) if (note := leader_prompts_note(sec, by))]
    return Plot(fig, caption=". ".join(c for c in (marks.caption, *apart) if c))


HEADINGS: dict[str, str] = {
    "speedup_by_proposer_workload": "Speedup by proposer and workload category",
    "acceptance_by_depth": "Acceptance by depth",
    "accepted_length_hist": "Accepted-length histograms",
    "round_cost": "Round-cost ledger",
    "temp_kv_vs_rows": "Temporary KV bytes vs candidate rows",
    "t_profile": "Target verify time t(n)",
    "speedup_vs_batch": "Speedup vs batch size",
    "frontier": "Frontier: time per committed token vs mean committed tokens per round",
    "speedup_by_category": "Speedup by category (the leaderboard's columns)",
}

PLOTS: dict[str, Callable[[pd.DataFrame, Mapping[str, Any]], Plot]] = {
    "speedup_by_proposer_workload": plot_speedup_by_proposer_workload,
    "acceptance_by_depth": plot_acceptance_by_depth,
    "accepted_length_hist": plot_accepted_length_hist,
    "round_cost": plot_round_cost,
    "temp_kv_vs_rows": plot_temp_kv_vs_rows,
    "t_profile": plot_t_profile,
    "speedup_vs_batch": plot_speedup_vs_batch,
    "frontier": plot_frontier,
    "speedup_by_category": plot_speedup_by_category,
}


# --------------------------------------------------------------------------------------------
# markdown


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


NUMERIC_COLUMNS = (
    "time_per_committed_token_ms",
    "ar_time_per_token_ms",
    "speedup",
    "mean_committed_per_round",
    "temp_kv_bytes_peak",
    "temp_kv_bytes_formula",
    "temp_kv_bytes_budget_formula",
    "config.topology.max_nodes",
)
RUN_COLUMNS = (
    "run_id",
    *AXES,
    "speedup",
    "decode_speedup",
    "time_per_committed_token_ms",
    "ar_time_per_token_ms",
    "mean_committed_per_round",
    "gated",
)


def _runs_section(df: pd.DataFrame) -> list[str]:
    """The Runs tables, one per section: :data:`RUN_COLUMNS`, and each run's machine after the axes
    where the runs span machines."""
    machines = machine_values(df)
    at = RUN_COLUMNS.index(AXES[-1]) + 1
    extra = ["machine"] if len(set(machines)) > 1 else []
    out: list[str] = []
    for section in SECTIONS:
        part = df[df["section"] == section]
        if part.empty:
            continue
        out += [f"### {SECTION_TITLES[section]}", ""]
        mine = [m for m, s in zip(machines, df["section"], strict=True) if s == section]
        body = [
            [*(r.get(c) for c in RUN_COLUMNS[:at]), *([m] if extra else []), *(r.get(c) for c in RUN_COLUMNS[at:])]
            for m, (_, r) in zip(mine, part.iterrows(), strict=True)
        ]
        out.append(md_table([*RUN_COLUMNS[:at], *extra, *RUN_COLUMNS[at:]], body))
        out.append("")
    out += [
        "`speedup`: end-to-end (prefill, a draft's prompt forward included); `decode_speedup`: the round loop's, "
        "AR `ar_time_per_token_ms` over `time_per_committed_token_ms` (both decode only).",
        "",
    ]
    return out


def _compare_section(df: pd.DataFrame, cfg: Mapping[str, Any]) -> list[str]:
    by = cfg.get("by", "proposer")
    baseline = cfg.get("baseline")
    where = {k: str(v) for k, v in (cfg.get("where") or {}).items()}
    try:
        rows = compare(df, by=by, baseline=None if baseline is None else str(baseline), filters=where)
    except ValueError as exc:
        return [f"_comparison not available: {exc}_", ""]
    baseline = None if baseline is None else matching_label(str(baseline), {r.arm for r in rows})
    out = [
        f"Arms by `{by}`" + (f", filters {where}" if where else "") + "; pairing unit: prompt; "
        "95% paired-bootstrap CIs over prompts, or for batched runs over the groups of prompts that shared "
        "a batch (`harness compare`).",
        "",
    ]
    for section, sec in by_section(rows):
        header, body = arm_table(sec, by=by, baseline=baseline, ar_column=False)
        out += [f"### {SECTION_TITLES[section]}", "", md_table(header, body), ""]
        for note in section_notes(sec, by):
            out += [f"Note: {note}.", ""]
    return out


def _leaderboard_section(df: pd.DataFrame, cfg: Mapping[str, Any]) -> list[str]:
    """Spec-Bench's leaderboard shape: rows = arms, columns = its tasks (other categories after
    them) and Overall; each cell the speedup and the mean accepted tokens per round, with CIs."""
    by = cfg.get("by", "proposer")
    where = {k: str(v) for k, v in (cfg.get("where") or {}).items()}
    try:
        columns, rows = leaderboard(df, by=by, filters=where)
    except ValueError as exc:
        return [f"_leaderboard not available: {exc}_", ""]
    out = [
        f"Rows: arms by `{by}`" + (f", filters {where}" if where else "") + ", best overall first. Cell: speedup "
        "over AR (ratio of sums, decode time: the decode speedup) / mean accepted tokens per round with the "
        "bonus token counted "
        "(Spec-Bench's \"#Mean Accepted Tokens\", vLLM's mean acceptance length: 1.00 for plain decoding), each "
        "with its 95% paired-bootstrap CI over prompts. Spec-Bench's eight MT-bench categories form one column.",
        "",
    ]
    every = columns
    for section in SECTION_TITLES:
        sec = [r for r in rows if r.section == section]
        if not sec:
            continue
        columns = section_columns(every, sec)
        titles = [TASK_TITLES.get(c, c) for c in columns]
        body = [[r.arm, *(leader_cell(r.cells.get(c)) for c in columns)] for r in sec]
        counts = leader_counts(sec, columns, TASK_TITLES, sep=" ")
        out += [f"### {SECTION_TITLES[section]}", "", md_table([by, *titles], body), "", f"Prompts: {counts}.", ""]
        sb = [
            [r.arm, *(r.cells[c].spec_bench_speedup if c in r.cells else None for c in columns)]
            for r in sec
            if OVERALL in r.cells
        ]
        if any(v is not None for row in sb for v in row[1:]):
            sb = [[row[0], *(None if v is None else f"{v:.3f}x" for v in row[1:])] for row in sb]  # as compare
            out += [
                "Spec-Bench's speedup statistic (the formula of its evaluation/speed.py: mean per-prompt tokens/s "
                "over the baseline's, wall time with prefill; a ratio of means), with the tokens each arm generated. "
                "speed.py itself recounts the baseline's tokens from its answer text, minus one for a BOS: what it "
                "prints for a run's exported files is the record's `spec_bench_speed_py_speedup`, and `harness "
                "export spec-bench` names both when they differ:",
                "",
                md_table([by, *titles], sb),
                "",
            ]
        for note in leaderboard_notes(sec, by):
            out += [f"Note: {note}.", ""]
    return out


def numeric_metrics(df: pd.DataFrame) -> pd.DataFrame:
    """Scalar metric columns as floats (a metric the runner did not measure is None -> NaN)."""
    out = df.copy()
    names = [c for c in out.columns if c.startswith("round_cost_ms.") or c in NUMERIC_COLUMNS]
    for name in names:
        out[name] = pd.to_numeric(out[name], errors="coerce")
    return out


def replace_together(out_dir: Path, moves: Sequence[tuple[Path | None, str]]) -> None:
    """Put each ``(temporary file, name)`` of ``moves`` in place as ``out_dir / name`` (``None``:
    remove that name), all or none: each file already there is first set aside under a temporary
    name; an error or interrupt midway puts every one back and removes what was moved in, so the
    folder keeps the earlier report whole. The files set aside are removed once all are in place."""
    undo: list[tuple[Path, Path | None]] = []  # (name in place, the earlier file set aside there, or None)
    try:
        for tmp, name in moves:
            final = out_dir / name
            aside = temporary_sibling(final, "old") if final.exists() else None
            undo.append((final, aside))
            if aside is not None:
                os.replace(final, aside)
            if tmp is not None:
                os.replace(tmp, final)
    except BaseException:
        for final, aside in reversed(undo):
            if aside is None:
                final.unlink(missing_ok=True)  # nothing was there before
            elif aside.exists():
                os.replace(aside, final)
        raise
    for _, aside in undo:
        if aside is not None:
            aside.unlink(missing_ok=True)


def plot_files(recipe: Mapping[str, Any]) -> list[str]:
    """The file each of ``recipe``'s plots is drawn into (``NN_<name>.png``), drawn or not."""
    return [f"{i + 1:02d}_{spec.get('name', spec['kind'])}.png" for i, spec in enumerate(recipe["plots"])]


def report_plots(out_dir: Path) -> set[str]:
    """The plot files the report this command wrote in ``out_dir`` draws (its ``](NN_name.png)``
    links); none where ``out_dir`` holds no such report."""
    if not _is_report(out_dir):
        return set()
    text = (out_dir / "report.md").read_text(encoding="utf-8")
    return set(re.findall(r"\]\((\d\d_[^)/\\]+\.png)\)", text))


def _failures_section(failures: Sequence[Mapping[str, Any]], left_out: Sequence[tuple[str, str]] = ()) -> list[str]:
    out: list[str] = []
    if left_out:
        out += [
            "## Records left out",
            "",
            f"{len(left_out)} record(s) under the source are not counted anywhere in this report: the outputs "
            "each binds are missing or changed, so it is no complete job.",
            "",
            md_table(["folder", "why"], [[f"`{folder}`", why] for folder, why in left_out]),
            "",
        ]
    if not failures:
        return out
    body = []
    for f in failures:
        error = f.get("error") or {}
        message = " ".join(str(error.get("message", "")).split())
        outcome = NOT_STARTED if f.get("stage") == NOT_STARTED else "refused" if f.get("refused") else "failed"
        body.append(
            [
                f"`{f.get('job', '?')}`",
                outcome,
                str(f.get("stage", "")),
                f"{error.get('type', '')}: {message[:160]}",
            ]
        )
    return [
        *out,
        "## Jobs without a record",
        "",
        f"{len(failures)} job(s) of this sweep wrote no record (`{FAILURES_FILENAME}`); nothing above counts them.",
        "",
        md_table(["job", "outcome", "stage", "error"], body),
        "",
    ]


def build_report(
    df: pd.DataFrame,
    out_dir: Path,
    recipe: Mapping[str, Any],
    *,
    recipe_path: Path,
    source: str,
    failures: Sequence[Mapping[str, Any]] = (),
    left_out: Sequence[tuple[str, str]] = (),
) -> Path:
    """Write ``report.md`` and one PNG per plot into ``out_dir``; returns the Markdown path.
    ``failures``: the sweep's jobs that wrote no record; ``left_out``: records the store left out
    (``(folder, why)``); both listed after the runs. Of the files already there, only report.md and
    the plots an earlier report of this command drew are replaced or removed, all together once
    every plot is drawn. A report that fails or is interrupted leaves the earlier report and its
    plots as they were, no file of its own, and not the folder when it made it."""
    created = not out_dir.exists()
    try:
        return _write_report(
            df, out_dir, recipe, recipe_path=recipe_path, source=source, failures=failures, left_out=left_out
        )
    except BaseException:
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise


def _write_report(
    df: pd.DataFrame,
    out_dir: Path,
    recipe: Mapping[str, Any],
    *,
    recipe_path: Path,
    source: str,
    failures: Sequence[Mapping[str, Any]],
    left_out: Sequence[tuple[str, str]],
) -> Path:
    sources = recipe.get("source_reported")
    entries = load_source_reported((recipe_path.parent / sources) if sources else None)  # refused before drawing
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = report_plots(out_dir)
    df = numeric_metrics(df)
    title = recipe.get("title", "Speculative decoding harness report")
    lines = [
        f"# {title}",
        "",
        f"{_REGENERATED}{len(df)} stored run records under `{source}` (recipe "
        f"`{recipe_path.name}`) on {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}. "
        "Nothing here ran a model; every number comes from the records.",
        "",
        "## Runs",
        "",
        *_runs_section(df),
        *_failures_section(failures, left_out),
        "## Comparison",
        "",
        *_compare_section(df, recipe.get("compare") or {}),
        "## Leaderboard (Spec-Bench shape)",
        "",
        *_leaderboard_section(df, recipe.get("leaderboard") or recipe.get("compare") or {}),
        "## Plots",
        "",
    ]
    # every plot is drawn into a temporary file beside its name and report.md written likewise; only
    # then are they put in place together (:func:`replace_together`): a report that fails or is
    # interrupted leaves the folder's earlier report and its plots as they were, and none of its own
    drawn: dict[str, Path] = {}  # plot file name -> the temporary file it is drawn into
    markdown = temporary_sibling(out_dir / "report.md")
    try:
        for i, spec in enumerate(recipe["plots"]):
            where = {k: str(v) for k, v in (spec.get("where") or {}).items()}
            runs = filter_runs(df, where) if where else df
            heading = spec.get("title", HEADINGS[spec["kind"]])
            lines += [f"### {heading}", ""]
            if where:
                lines += [f"Runs with {where}.", ""]
            plot = PLOTS[spec["kind"]](runs, spec) if not runs.empty else Plot(None, f"no runs match {where}")
            if plot.figure is None:
                lines += [f"_Not drawn: {plot.note}._", ""]
                continue
            name = plot_files(recipe)[i]
            drawn[name] = temporary_sibling(out_dir / name)
            plot.figure.savefig(drawn[name], format="png")
            lines += [f"![{heading}]({name})", ""]
            if plot.caption:
                caption = plot.caption.replace("*", r"\*")  # two bare marks would read as emphasis
                lines += [f"Note: {caption}.", ""]
        if entries:
            lines += [
                "## Source-reported numbers (not measured here)",
                "",
                "Quoted from the papers, measured by their authors on their models and hardware. "
                "They are context, not expectations for this harness: each holds for its own configuration.",
                "",
                md_table(["label", *SOURCE_KEYS], [["source-reported", *(e[k] for k in SOURCE_KEYS)] for e in entries]),
                "",
            ]
        markdown.write_text("\n".join(lines), encoding="utf-8")
        # the plots an earlier report drew that this one does not are removed with it: a reused report
        # folder shows no figure of other runs (every other file is left alone)
        stale = [(None, name) for name in sorted(earlier - set(drawn))]
        replace_together(out_dir, [*((tmp, name) for name, tmp in drawn.items()), *stale, (markdown, "report.md")])
    finally:
        for tmp in (*drawn.values(), markdown):
            tmp.unlink(missing_ok=True)
    return out_dir / "report.md"


USAGE = "usage: harness report <records_root | store.parquet> [out=DIR [overwrite=true]] [recipe=default]"

#: the line under a report's title that says where its numbers come from (how a report is recognised)
_REGENERATED = "Regenerated from "


def default_out(root: Path) -> Path:
    """Where a report of the records under ``root`` goes without ``out=``: ``<root>/report``; where that
    is inside a run folder (``root`` is a run's folder, or a store's there), beside that run folder,
    ``<run>-report``: nothing is written inside a run folder."""
    run = run_folder_of(root / "report")
    return root / "report" if run is None else run.parent / f"{run.name}-report"


def _is_report(out_dir: Path) -> bool:
    """Whether ``out_dir``'s report.md is one this command wrote (its third line says where its
    numbers come from), which a new report may replace."""
    try:
        lines = (out_dir / "report.md").read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return len(lines) > 2 and lines[0].startswith("# ") and lines[2].startswith(_REGENERATED)


def main(argv: list[str] | None = None) -> int:
    parsed = parse_command("report", USAGE, argv)
    if isinstance(parsed, int):
        return parsed
    positionals, kv = parsed
    try:
        extra = set(kv) - {"out", "recipe", "overwrite"}
        if len(positionals) != 1 or extra:
            raise ValueError(
                f"expected one source and only out=/recipe=/overwrite=; got {positionals} and {sorted(extra)}"
            )
        overwrite = boolean_option("overwrite", kv.get("overwrite"))
        df, root = read_results(positionals[0])
        if df.empty:
            raise ValueError(no_records_message(positionals[0], root if Path(positionals[0]).is_dir() else None))
        recipe_path = find_recipe(kv.get("recipe", "default"))
        recipe = load_recipe(recipe_path)
        problem = recipe_column_problem(recipe, recipe_path, df)
        if problem is not None:
            raise ValueError(problem)
        out_dir = Path(kv["out"]) if "out" in kv else default_out(root or Path("."))
        problem = output_folder_problem("out", out_dir)
        if problem is None and (out_dir / RECORD_FILENAME).is_file():
            problem = f"out={out_dir} is a run folder (it holds {RECORD_FILENAME}); write the report elsewhere"
        if problem is None and (run := run_folder_of(out_dir)) is not None:
            problem = f"out={out_dir} is inside the run folder {run}: write the report outside any run folder"
        if problem is None and (out_dir / "report.md").is_dir():
            problem = f"out={out_dir} holds a folder named report.md; give another folder"
        if problem is None and not overwrite and (out_dir / "report.md").exists() and not _is_report(out_dir):
            problem = (
                f"out={out_dir} holds a report.md this command did not write; give another folder or overwrite=true"
            )
        clash = [n for n in plot_files(recipe) if (out_dir / n).exists() and n not in report_plots(out_dir)]
        if problem is None and not overwrite and clash:
            problem = (
                f"out={out_dir} holds {clash[0]}, which no report of this command there drew, and the report draws a "
                "plot of that name; give another folder or overwrite=true"
            )
        if problem is not None:
            raise ValueError(problem)
        from_folder = Path(positionals[0]).is_dir()
        path = build_report(
            df,
            out_dir,
            recipe,
            recipe_path=recipe_path,
            source=positionals[0],
            failures=failed_jobs(root, below=from_folder),  # a store: its own sweep's failures, not its neighbours'
            left_out=left_out_records(root) if from_folder else (),
        )
    except (ValueError, OSError) as exc:
        return refuse("report", exc)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
