"""`harness compare`: arms side by side, paired on prompts, with bootstrap CIs.

    harness compare <records_root | store.parquet> [by=proposer] [baseline=hydra]
                    [json=PATH [overwrite=true]] [level=0.95] [resamples=2000]
                    [bootstrap_seed=0] [method=percentile] [leaderboard=true|false]
                    [<axis>=<value> ...]            # filters, e.g. temperature=0 batch_size=1

A records root may be a job folder of a multirun (its name holds ``=``: an argument that names a
path is never read as an option). ``json=`` writes the tables as JSON, with the sweeps' jobs that
wrote no record (``jobs_without_record``) and the records a folder holds that no arm counts, their
bound outputs missing or changed (``left_out_records``: folder and why); it replaces a compare JSON
written before, and refuses a run's record or outputs, a folder, or any other existing file
(unless ``overwrite=true``), and a path inside a run folder.

An *arm* is every run sharing one value of the ``by`` axis inside one section (after the
filters), on one target model and one machine: the runs of one value on several models or machines
are arms apart, each named by what sets it apart (``draft_model (model=tiny)``,
``draft_model (machine=cuda: NVIDIA H100)``); a model is its full ``model`` label, dtype included, so
``tiny`` (float32) and ``tiny@bfloat16`` are two models. An arm pooling runs of other code is noted under
its table. Arms by the machine itself (``by=hardware.device_name``, ``by=hardware.device``) differ in
it by design: they have a ratio to a baseline on another machine, as arms by model to another model.
Its per-prompt rows are summed by prompt (its id and content fingerprint, :func:`prompt_key`) over
its runs, so the pairing unit is always the prompt. For each arm and each workload category (and ``all``,
the summary row; a category that is itself named ``all`` is shown as ``all (category)``, and in the
leaderboard one named ``overall`` as ``overall (category)``, so neither reads as, nor merges with, the summary):

* ``time_per_committed_token_ms`` = sum(spec_decode_ms) / sum(spec_tokens) (decode time);
* ``speedup`` = [sum(ar_decode_ms) / sum(ar_tokens)] / [sum(spec_decode_ms) / sum(spec_tokens)],
  the AR baseline of the same runs on the same prompts: the **decode** speedup (the round loop's;
  the counterpart of a record's ``decode_speedup``), printed as "decode speedup";
* ``end_to_end_speedup``: the same ratio with each prompt's prefill added to its decode time
  (the target's prompt forward and every proposer's start: a draft's prompt forward is the
  speculative arm's cost), the counterpart of a record's headline ``speedup``;
* with ``baseline=V``: ``vs_baseline`` = time per committed token of arm ``V`` over this arm's,
  on the prompts both arms ran (> 1: this arm is faster); none where this arm's runs are of
  another target model than the baseline's, another dtype of it included (one model's times over
  another's).

At batch > 1 a prompt's time is its request's latency inside its batch, so an arm with batched
runs has per-request figures: its requests' summed latencies over their summed tokens (each request
weighted by its tokens), not a record's per-batch ``time_per_committed_token_ms`` and
``decode_speedup``, nor its ``request_speedup`` (the ratio of the two arms' means of per-request ms
per token, each request weighted alike); the table says so under its section. A batch's requests share
its time, so the bootstrap resamples them together: an arm's resampling unit
(:func:`resampling_units`) is a connected component of prompts, those joined by sharing a batch in any
of its runs (a prompt no run batched is a unit alone, as at batch 1). Repeated runs of one configuration
add no units: two seeds of one batched sweep give the interval one gives, as repeats at batch 1 do, and a
prompt an arm ran at batch 1 and batched is one unit. An arm's ratio to the baseline resamples the prompts
both ran, in the components of both arms' batches, so that the two arms draw the same units.

The leaderboard (:func:`leaderboard`, printed after the tables; ``leaderboard=false`` leaves it
out) has Spec-Bench's shape: one row per arm, one column per Spec-Bench task (its eight MT-bench
categories merged into ``mt_bench``; any other category as its own column) plus ``overall``; each
cell holds the speedup above and the mean accepted tokens per round with the bonus/correction
token counted (``sum(spec_tokens) / sum(spec_rounds)``, as Spec-Bench's "#Mean Accepted Tokens"
and vLLM's mean acceptance length count it: 1.00 for plain decoding), each with its CI, and
Spec-Bench's speedup statistic (a ratio of per-prompt means, wall time with prefill, the tokens generated) as a
point value. It refuses what the table refuses (a prompt of two categories in one arm's runs). Notes
under each section's leaderboard name the arms that pool runs of other configurations (what the table's
mixed-axes column lists, seeds aside), arms of batched runs and arms that differ in more than ``by``; its
JSON gives each row's ``varying``, ``apart`` and ``batch_sizes``, and each section's ``notes``.

Confidence intervals: ``scipy.stats.bootstrap`` with ``paired=True``, resampling prompts (every quantity
of one prompt moves together; at batch > 1 the prompts that shared a batch, above) in the order of their
ids (:func:`prompt_order`), so an arm's interval does not depend on the other records compared beside it.
Runs whose timings are not honest (``cpu_budget_artifact``) and heuristic runs (``exact: false``) are
labelled and reported in their own sections, never mixed with exact runs. Values are recomputed from
``per_prompt``, each request's latency inside its batch; a record's ``decode_speedup`` and ``speedup``
divide batch wall time instead, so at batch 1 they differ by the batch's own bookkeeping (under 1% on the
test fixtures) and at larger batches by what batching overlaps.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from scipy import stats

from harness.tracking.command_line import (
    boolean_option,
    json_object_with,
    output_file_problem,
    parse_command,
    refuse,
    whole_number_option,
)
from harness.tracking.conventions import machine_label
from harness.tracking.record import write_json_atomic
from harness.tracking.run_notes import rounds_bound, sped_up_past_rounds
from harness.tracking.spec_bench import OVERALL, task_of, task_order
from harness.tracking.store import (
    AXES,
    NOT_STARTED,
    SECTIONS,
    failed_jobs,
    json_column,
    left_out_records,
    no_records_message,
    read_results,
)

ALL = "all"
SECTION_TITLES: dict[str, str] = {
    "exact": "exact runs",
    "ungated": "UNGATED runs (a gate was skipped by an override or never checked: not comparable with gated runs)",
    "heuristic": "HEURISTIC runs (exact: false; output distribution not guaranteed)",
    "cpu_budget_artifact": "CPU-BUDGET ARTIFACTS (heads, adapters or skip vectors trained or searched "
    "on this CPU's small token budget; acceptance is a lower bound, not the method's)",
}
_OPTION_KEYS = ("by", "baseline", "json", "overwrite", "level", "resamples", "bootstrap_seed", "method", "leaderboard")
_PROMPT_COLUMNS = ("spec_decode_ms", "spec_tokens", "ar_decode_ms", "ar_tokens")
#: per-prompt prefill times (missing in older records: their end-to-end speedup is "-")
_PREFILL_COLUMNS = ("spec_prefill_ms", "ar_prefill_ms")


@dataclass(frozen=True)
class Estimate:
    """A point value with a bootstrap interval (``None`` where it cannot be computed)."""

    value: float | None
    ci_low: float | None = None
    ci_high: float | None = None

    def fmt(self, digits: int = 3) -> str:
        if self.value is None:
            return "-"
        if self.ci_low is None or self.ci_high is None:
            return f"{self.value:.{digits}f}"
        return f"{self.value:.{digits}f} [{self.ci_low:.{digits}f}, {self.ci_high:.{digits}f}]"


@dataclass(frozen=True)
class ArmRow:
    section: str
    arm: str
    category: str
    n_prompts: int
    run_ids: tuple[str, ...]
    varying: dict[str, list[str]]
    time_per_committed_token_ms: Estimate
    ar_time_per_token_ms: float | None
    speedup: Estimate  # decode time
    vs_baseline: Estimate | None = None
    n_pairs_baseline: int = 0
    labels: tuple[str, ...] = field(default=())
    end_to_end_speedup: Estimate = field(default=Estimate(None))  # prefill + decode
    batch_sizes: tuple[int, ...] = field(default=())  # of its runs: above 1, its times are per request
    concurrent_jobs: tuple[int, ...] = field(default=())  # of its runs: how many jobs shared the machine as each ran
    # with a baseline: the axes other than ``by`` on which this arm's runs and the baseline's differ
    # (axis -> [this arm's values, the baseline's]): vs_baseline then compares more than ``by``
    baseline_differs: dict[str, list[str]] = field(default_factory=dict)
    timing_outliers: int = 0  # prompts its runs flagged as stalled (a record's metrics.timing_outliers)
    truncated_prompts: int = 0  # of its prompts, those workload.truncate=left cut in either arm
    # the ``all`` row, when a section's arms differ beyond ``by``: this arm's value of each axis or
    # config key whose values differ among the section's arms (key -> its values, comma-joined)
    apart: dict[str, str] = field(default_factory=dict)
    # the ``all`` row: how many of its prompts every other arm of its section ran too (None: one arm)
    common_prompts: int | None = None
    has_baseline: bool = False  # its section has the baseline's runs to pair with
    # its runs are of other target models than the baseline's (model -> [its, the baseline's]): no ratio then
    baseline_other_model: list[str] = field(default_factory=list)
    #: [these runs' machines, the baseline's] when they differ: no ratio to the baseline then
    baseline_other_machine: list[str] = field(default_factory=list)
    # the resampling units its intervals draw from (:func:`resampling_units`): prompts, or the groups of
    # prompts that shared a batch in its runs
    n_units: int = 0
    # the units its vs-baseline interval draws from: of the prompts both arms ran, the groups that shared a
    # batch in either arm's runs (n_pairs_baseline where neither batched)
    n_pair_units: int = 0
    # its runs whose decode sped up with no proposed token accepted (one token per round): not speculation's
    unaccepted_runs: int = 0


# --------------------------------------------------------------------------------------------
# statistics (vectorised over the resample axis, as scipy.stats.bootstrap calls them)


def ratio_of_sums(ms: np.ndarray, tok: np.ndarray, axis: int = -1) -> np.ndarray:
    # ms, tok: [..., P] per-prompt decode ms and token counts -> [...] ms per token
    return np.sum(ms, axis=axis) / np.sum(tok, axis=axis)


def speedup_statistic(
    base_ms: np.ndarray, base_tok: np.ndarray, ms: np.ndarray, tok: np.ndarray, axis: int = -1
) -> np.ndarray:
    # all [..., P]: (base ms/token) / (arm ms/token)
    return ratio_of_sums(base_ms, base_tok, axis) / ratio_of_sums(ms, tok, axis)


def _clean(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def paired_bootstrap(
    data: Sequence[np.ndarray],
    statistic: Any,
    *,
    confidence_level: float,
    n_resamples: int,
    seed: int,
    method: str,
) -> Estimate:
    """Point value and paired bootstrap CI of ``statistic(*data)`` over prompts (axis -1)."""
    arrays = [np.asarray(a, dtype=float) for a in data]  # each [P]
    n = arrays[0].shape[-1]
    with warnings.catch_warnings():
        # zero token counts give inf/NaN (reported as None); constant data gives a zero-width CI
        warnings.simplefilter("ignore", category=RuntimeWarning)
        warnings.simplefilter("ignore", category=stats.DegenerateDataWarning)
        value = _clean(statistic(*arrays, axis=-1))
        if value is None or n < 2:
            return Estimate(value)
        res = stats.bootstrap(
            tuple(arrays),
            statistic,
            paired=True,
            vectorized=True,
            axis=-1,
            n_resamples=n_resamples,
            confidence_level=confidence_level,
            method=method,
            rng=np.random.default_rng(seed),
        )
    return Estimate(value, _clean(res.confidence_interval.low), _clean(res.confidence_interval.high))


# --------------------------------------------------------------------------------------------
# frames


def _matches(value: Any, wanted: str) -> bool:
    if isinstance(value, (bool, np.bool_)):  # spelt as every harness option spells one: true / false
        return wanted.strip().lower() in (("true", "1") if value else ("false", "0"))
    if isinstance(value, (int, float, np.integer, np.floating)):
        try:
            return math.isclose(float(value), float(wanted), rel_tol=0, abs_tol=1e-12)
        except ValueError:
            return False
    if str(value) == wanted:
        return True
    if isinstance(value, str) and value[:1] in "[{" and wanted.strip()[:1] == value[:1]:
        # a list or mapping option, stored as JSON: compared as values, however the filter spaces or
        # quotes it (``topology.widths=[2,2,1]`` as Hydra and the sweep folders spell it)
        try:
            return json.loads(value) == yaml.safe_load(wanted)
        except (ValueError, yaml.YAMLError):
            return False
    return False


def arm_label(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{float(value):g}"
    return str(value)


def filter_runs(df: pd.DataFrame, filters: Mapping[str, str]) -> pd.DataFrame:
    """Keep runs whose column ``k`` matches ``v`` for every filter (numbers compared as numbers); a
    key that is no column but a top-level config key (``seed``, ``threads``) filters by
    ``config.<key>``."""
    for key, wanted in filters.items():
        column = key if key in df.columns else f"config.{key}"
        if column not in df.columns:
            raise ValueError(f"unknown filter {key!r}; expected an axis {list(AXES)} or a store column")
        df = df[df[column].map(lambda v, w=wanted: _matches(v, w))]
    return df


def run_prompts(df: pd.DataFrame) -> Iterator[tuple[pd.Series, dict[str, Any]]]:
    """Each (run, prompt entry) of the store's ``per_prompt`` column, runs in order."""
    for (_, run), prompts in zip(df.iterrows(), json_column(df, "per_prompt"), strict=True):
        for p in prompts or []:
            yield run, p


def fingerprinted(df: pd.DataFrame) -> bool:
    """Whether every prompt of every run carries its content fingerprint (``prompt_sha256``): then
    prompts pair by it; with any older record among them, all pair by their workload source, so
    old and new records of one prompt still pair."""
    return all(p.get("prompt_sha256") for _, p in run_prompts(df))


def prompt_key(run: pd.Series, p: Mapping[str, Any], *, by_fingerprint: bool = True) -> str:
    """What pairs a prompt across runs: its id with the fingerprint of its content
    (``prompt_sha256``; ``by_fingerprint``), or else with the workload it came from (name, file
    name, split). One id in two different files is two prompts."""
    pid = str(p["prompt_id"])
    if by_fingerprint and p.get("prompt_sha256"):
        return f"{pid}#{p['prompt_sha256']}"

    def cfg(key: str) -> str:
        value = run.get(f"config.workload.{key}")
        return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)

    source = "/".join(x for x in (cfg("name"), Path(cfg("path")).name if cfg("path") else "", cfg("split")) if x)
    return f"{pid}@{source}" if source else pid


def _batch_unit(run: pd.Series, p: Mapping[str, Any], prompt: str) -> str:
    """The batch a run's request shared its time in: ``<run id>/batch <i>`` at batch > 1; else
    ``prompt`` (the prompt's pairing key), a batch of that prompt alone."""
    if p.get("batch_index") is not None and _run_batch_size(run) > 1:
        return f"{run['run_id']}/batch {p['batch_index']}"
    return prompt


def resampling_units(long: pd.DataFrame) -> dict[str, str]:
    """Each prompt of the per-prompt rows ``long`` (with ``prompt_id`` and ``batch_unit``) -> the
    unit the bootstrap resamples it in: the connected component of prompts joined by sharing a batch
    in any run of ``long``, named by its least prompt key. A prompt no run batched is a unit of its
    own, whatever number of runs repeat it; one batched with others in one run, or in another
    composition in another run, moves together with all of them."""
    parent: dict[str, str] = {k: k for k in long["prompt_id"].unique()}

    def root(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for keys in long.groupby("batch_unit", sort=False)["prompt_id"].unique():
        first = root(keys[0])
        for k in keys[1:]:
            other = root(k)
            if other != first:  # the least key roots the merged component: its name
                first, other = min(first, other), max(first, other)
                parent[other] = first
    return {k: root(k) for k in parent}


def _unit_sums(rows: pd.DataFrame, units: Mapping[str, str], summed: Any = None) -> pd.DataFrame:
    """``rows`` (per-prompt rows) summed per resampling unit (``units``: prompt -> unit, from
    :func:`resampling_units`), by ``summed`` (:func:`_summed` unless given), in :func:`prompt_order`."""
    return (summed or _summed)(rows.assign(_unit=rows["prompt_id"].map(units)), "_unit")


#: appended to a workload category whose name is (or starts as) the label of a summary row or column
#: (``all`` in the table, ``overall`` in the leaderboard), so that it reads as a category of that name
CATEGORY_SUFFIX = " (category)"


def category_label(category: str, summary: str) -> str:
    """A workload category as a table beside the summary row ``summary`` names it: itself, or with
    :data:`CATEGORY_SUFFIX` appended where, its suffixes taken off, it is ``summary`` (``all`` ->
    ``all (category)``, ``all (category)`` -> ``all (category) (category)``): no category reads as
    the summary, nor two categories as one."""
    stem = category
    while stem.endswith(CATEGORY_SUFFIX):
        stem = stem[: -len(CATEGORY_SUFFIX)]
    return category + CATEGORY_SUFFIX if stem == summary else category


def _run_batch_size(run: pd.Series) -> int:
    value = run.get("batch_size")
    return 1 if value is None or (isinstance(value, float) and math.isnan(value)) else int(value)


def prompt_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, prompt) from the store's ``per_prompt`` column."""
    by_fingerprint = fingerprinted(df)
    rows = [
        {
            "run_id": run["run_id"],
            "section": run["section"],
            **{a: run[a] for a in AXES},
            "prompt_id": (key := prompt_key(run, p, by_fingerprint=by_fingerprint)),
            "raw_prompt_id": str(p["prompt_id"]),
            "batch_unit": _batch_unit(run, p, key),
            "category": category_label(str(p["category"]), ALL),
            "truncated": bool(p.get("cut_tokens") or p.get("ar_cut_tokens")),  # absent in older records: none
            **{c: float(p[c]) for c in _PROMPT_COLUMNS},
            **{c: float(p[c]) if p.get(c) is not None else math.nan for c in _PREFILL_COLUMNS},
        }
        for run, p in run_prompts(df)
    ]
    columns = [
        "run_id",
        "section",
        *AXES,
        "prompt_id",
        "raw_prompt_id",
        "batch_unit",
        "category",
        "truncated",
        *_PROMPT_COLUMNS,
        *_PREFILL_COLUMNS,
    ]
    return pd.DataFrame(rows, columns=columns)


def _arm_prompts(long: pd.DataFrame) -> pd.DataFrame:
    """Sum one arm's rows by prompt: [prompt_id] -> category, the four decode columns and the
    two prefill columns."""
    refuse_mixed_categories(long)
    summed = _summed(long, "prompt_id")
    summed["category"] = long.groupby("prompt_id", sort=True)["category"].first()
    return summed


def refuse_mixed_categories(long: pd.DataFrame) -> None:
    """Refuse one arm's per-prompt rows ``long`` (``prompt_id``, ``raw_prompt_id``, ``run_id``,
    ``category``) where one prompt carries different categories in its runs: its category's figures
    would hold it under one of them only. The table and the leaderboard refuse alike."""
    cats = long.groupby("prompt_id")["category"].nunique()
    if (cats > 1).any():
        key = cats[cats > 1].index[0]
        rows = long[long["prompt_id"] == key]
        said = ", ".join(f"{c!r} in run {r[:16]}" for r, c in zip(rows["run_id"], rows["category"], strict=True))
        raise ValueError(
            f"prompt {rows['raw_prompt_id'].iloc[0]!r} (one text) carries different categories in the runs one arm "
            f"pools ({said}; {int((cats > 1).sum())} such prompt(s)): compare those runs apart (by= an axis they "
            "differ in, or a filter such as workload=..., seed=...), or give the prompt one category in every file"
        )


def _summed(long: pd.DataFrame, unit: str) -> pd.DataFrame:
    """The decode and prefill columns of ``long`` summed per ``unit`` (prefill NaN where any row lacks
    it), in :func:`prompt_order`."""
    summed = long.groupby(unit, sort=True)[list(_PROMPT_COLUMNS)].sum()
    grouped = long.groupby(unit, sort=True)
    for c in _PREFILL_COLUMNS:
        summed[c] = grouped[c].sum(min_count=1).where(grouped[c].count() == grouped[c].size())
    return prompt_order(summed, long, unit)


def prompt_order(summed: pd.DataFrame, long: pd.DataFrame, unit: str) -> pd.DataFrame:
    """``summed`` (one row per ``unit`` of the per-prompt rows ``long``) in the order the bootstrap
    resamples: by prompt id (a batch by its first prompt's), then by unit. The pairing key
    (:func:`prompt_key`: a fingerprint, or a workload source where any record of the frame lacks one)
    only breaks ties between prompts of one id, so an arm's interval stays the same whatever other
    records are compared beside it."""
    first = long.groupby(unit, sort=False)["raw_prompt_id"].min().to_dict()
    return summed.loc[sorted(summed.index, key=lambda u: (first[u], u))]


#: the arm of the runs that have no value of the ``by`` axis (e.g. ``by=experiment`` for runs outside any)
NO_VALUE = "(none)"
#: the column of :func:`_arm_runs` that names each run's arm; the ``by`` column keeps the values the
#: runs have (a batch size stays the number it ran)
ARM = "_arm"


def _arm_runs(df: pd.DataFrame, by: str, filters: Mapping[str, str] | None) -> pd.DataFrame:
    """The runs the filters keep, each with its arm in the column :data:`ARM`: its value of ``by``
    as a label (:data:`NO_VALUE` where it has none), with what else it is and what sets it apart;
    refuses a ``by`` that names no column and an empty selection."""
    if by not in df.columns:
        raise ValueError(f"by must name an axis {list(AXES)} or a store column; got {by!r}")
    runs = filter_runs(df, filters or {})
    if runs.empty:
        raise ValueError(f"no runs left after filters {dict(filters or {})}")
    missing = runs[by].isna()  # grouping by the value would drop them
    arms = pd.Series(
        [NO_VALUE if m else arm_label(v) for v, m in zip(runs[by], missing, strict=True)], index=runs.index
    )
    if "exact" in runs.columns and "cpu_budget_artifact" in runs.columns:
        # an ungated run keeps its other label: never pooled with exact runs of its arm
        also = [also_labelled(r) for _, r in runs.iterrows()]
        arms = pd.Series([f"{a} {t}" if t else a for a, t in zip(arms, also, strict=True)], index=runs.index)
    # an arm's runs of several target models, or timed on several machines, are arms apart: pooled,
    # one interval mixed one model's (or machine's) times with another's, and a prompt run on two
    # machines summed their times; the model is its full label, so one model in two dtypes
    # (``tiny``, ``tiny@bfloat16``) is two arms
    apart: list[tuple[str, pd.Series]] = []
    if by != "model" and "model" in runs.columns:
        apart.append(("model", runs["model"].map(arm_label)))
    apart.append((MACHINE, pd.Series(machine_values(runs), index=runs.index)))
    mixed = {name: {label for label in set(arms) if values[arms == label].nunique() > 1} for name, values in apart}
    if any(mixed.values()):
        split = []
        for i, label in enumerate(arms):
            said = [f"{name}={values.iloc[i]}" for name, values in apart if label in mixed[name]]
            split.append(f"{label} ({', '.join(said)})" if said else label)
        arms = pd.Series(split, index=runs.index)
    return pd.concat([runs, arms.rename(ARM)], axis=1)  # a store's many columns: no insert into a fragmented frame


def matching_label(value: str, labels: set[str]) -> str:
    """The arm label ``value`` names: itself, or the label of the same number (``baseline=0.0`` for
    the arm ``0``, as filters match numbers); ``value`` when none does."""
    if value in labels:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return value
    same = [label for label in labels if _as_float(label) == number]
    return same[0] if len(same) == 1 else value


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def also_labelled(run: Mapping[str, Any]) -> str:
    """What a run also is, which its section (``ungated`` comes first, then ``heuristic``) does not
    say: for an ungated run ``[heuristic, exact=false]``, ``[CPU-budget artifact]``, both, or ``""``;
    for a heuristic run ``[CPU-budget artifact]`` or ``""``."""
    if run.get("section") not in ("ungated", "heuristic"):
        return ""
    tags = []
    if run.get("section") == "ungated" and (run.get("exact") is False or run.get("exact") == 0):
        tags.append("heuristic, exact=false")
    if bool(run.get("cpu_budget_artifact")) and run.get("cpu_budget_artifact") == run.get("cpu_budget_artifact"):
        tags.append("CPU-budget artifact")
    return f"[{'; '.join(tags)}]" if tags else ""


def decode_speedup(p: pd.DataFrame, boot: Mapping[str, Any]) -> Estimate:
    """Decode speedup vs AR of one arm's summed prompts ``p``: AR's ms per token over the arm's."""
    return paired_bootstrap(
        (p["ar_decode_ms"], p["ar_tokens"], p["spec_decode_ms"], p["spec_tokens"]), speedup_statistic, **boot
    )


#: the intervals ``harness compare`` draws by default
DEFAULT_BOOTSTRAP = {"confidence_level": 0.95, "n_resamples": 2000, "seed": 0, "method": "percentile"}


#: per-prompt decode times -> the same arm's time of the batch the prompt ran in (summed over its turns)
_BATCH_DECODE_COLUMNS = {"spec_decode_ms": "spec_batch_decode_ms", "ar_decode_ms": "ar_batch_decode_ms"}


def _alone_in_batches(per_prompt: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every prompt (each of its turns) ran in a batch of its own and carries its batches'
    decode times (:data:`_BATCH_DECODE_COLUMNS`): then those times are what the record's decode and
    end-to-end speedups divide, the request's own latency (its batch holds it alone)."""
    return bool(per_prompt) and all(
        q.get("batch_requests") == 1
        and all(t.get("batch_requests", 1) == 1 for t in q.get("turns") or [])
        and all(q.get(c) is not None for c in _BATCH_DECODE_COLUMNS.values())
        for q in per_prompt
    )


def run_speedups(per_prompt: Sequence[Mapping[str, Any]], run: pd.Series | None = None) -> tuple[Estimate, Estimate]:
    """One run's decode and end-to-end speedups with the intervals of compare's bootstrap for that run
    alone: its prompts in compare's order (:func:`prompt_order`: by id, then by :func:`prompt_key`;
    ``run``, the store row, names the workload of prompts without a fingerprint), compare's default
    resamples and seed. Where every prompt ran in a batch of its own (batch size 1), each prompt's
    decode time is its batch's (``spec_batch_decode_ms``, ``ar_batch_decode_ms``): the times the
    record's own ``decode_speedup`` and ``speedup`` divide, so each point lies in its interval; else
    (older records, batches of several requests) each request's latency, as ``harness compare``
    reads it."""
    run = pd.Series(dtype=object) if run is None else run
    fingerprints = all(q.get("prompt_sha256") for q in per_prompt)
    rows = sorted(per_prompt, key=lambda q: (str(q["prompt_id"]), prompt_key(run, q, by_fingerprint=fingerprints)))
    source = {c: c for c in (*_PROMPT_COLUMNS, *_PREFILL_COLUMNS)}
    if _alone_in_batches(rows):
        source.update(_BATCH_DECODE_COLUMNS)
    p = pd.DataFrame(
        [{c: math.nan if q.get(k) is None else float(q[k]) for c, k in source.items()} for q in rows],
        columns=list(source),
    )
    return decode_speedup(p, DEFAULT_BOOTSTRAP), end_to_end_speedup(p, DEFAULT_BOOTSTRAP)


def end_to_end_speedup(p: pd.DataFrame, boot: Mapping[str, Any]) -> Estimate:
    """The same with each prompt's prefill counted; None when a prompt has no recorded prefill."""
    if any(c not in p.columns or p[c].isna().any() for c in _PREFILL_COLUMNS):
        return Estimate(None)
    return paired_bootstrap(
        (
            p["ar_prefill_ms"] + p["ar_decode_ms"],
            p["ar_tokens"],
            p["spec_prefill_ms"] + p["spec_decode_ms"],
            p["spec_tokens"],
        ),
        speedup_statistic,
        **boot,
    )


#: config keys that say where or how a run was launched or logged, not what it measured
_LAUNCH_CONFIG = (
    "config.output_dir",
    "config.experiment",
    "config.sweep",
    "config.concurrent_jobs",
    "config.tracking.",
)
#: the config keys behind each axis: the axis's own value, or the options of its group
_AXIS_CONFIG = {
    "proposer": "config.proposer.",
    "topology": "config.topology.",
    "verifier": "config.verifier.",
    "workload": "config.workload.name",
    "model": "config.model.",
    "temperature": "config.generation.temperature",
    "batch_size": "config.generation.batch_size",
}


#: the pseudo-key under which runs timed on different machines are told apart (the store's
#: ``hardware.device`` and ``hardware.device_name``: a CPU's model or a GPU's name)
MACHINE = "machine"
#: the store columns a run's machine is read from: arms by one of them differ in their machine by
#: design (as arms by model differ in their model), so neither a note nor the baseline sets them apart for it
MACHINE_COLUMNS = ("hardware.device", "hardware.device_name")


def machine_values(runs: pd.DataFrame) -> list[str]:
    """Each run's machine as ``<device kind>: <device name>`` (``-`` where the store has neither)."""
    kind_column, name_column = MACHINE_COLUMNS
    kinds = runs[kind_column] if kind_column in runs.columns else [None] * len(runs)
    names = runs[name_column] if name_column in runs.columns else [None] * len(runs)
    return [machine_label({"device": kind, "device_name": name}) for kind, name in zip(kinds, names, strict=True)]


#: the pseudo-key under which runs of other code are told apart: the harness's code hash
#: (``harness_code``) and the torch and transformers versions the hardware card names
SOFTWARE = "software"


def _software_values(runs: pd.DataFrame) -> list[str]:
    """Each run's code as ``harness <code hash>, torch <version>, transformers <version>`` (``-``
    for what the store lacks: records written before they named their code)."""

    def column(name: str) -> list:
        return list(runs[name]) if name in runs.columns else [None] * len(runs)

    def text(v) -> str:
        return "-" if v is None or (isinstance(v, float) and v != v) else str(v)

    return [
        f"harness {text(code)[:12]}, torch {text(torch)}, transformers {text(tf)}"
        for code, torch, tf in zip(
            column("harness_code"), column("hardware.torch"), column("hardware.transformers"), strict=True
        )
    ]


#: pseudo-keys: not config keys, not axes
_PSEUDO_KEYS = (MACHINE, SOFTWARE)


def _varying(runs: pd.DataFrame, by: str, *, skip_group: bool = False) -> dict[str, list[str]]:
    """The axes, then the other config keys, whose values differ among one arm's runs: an arm that
    pools runs of different configurations says which (``mixed axes``). Where a group's axis
    already differs (two proposers, say), only the options no run leaves null are listed (a max_nodes
    both topologies take), not those one side lacks; ``skip_group``: none of ``by``'s group's options."""
    out: dict[str, list[str]] = {}
    for axis in AXES:
        if axis == by or axis not in runs.columns:
            continue
        values = sorted({arm_label(v) for v in runs[axis]}, key=_value_order)
        if len(values) > 1:
            out[axis] = values
    machines = sorted(set(machine_values(runs)))
    if len(machines) > 1 and by not in MACHINE_COLUMNS:  # times of one machine pooled with, or divided by, another's
        out[MACHINE] = machines
    software = sorted(set(_software_values(runs)))
    if len(software) > 1:  # another build of the harness, or of the libraries its forwards run
        out[SOFTWARE] = software
    partial = [_AXIS_CONFIG[a] for a in out if a in _AXIS_CONFIG and _AXIS_CONFIG[a].endswith(".")]
    partial += ["config.workload."] if "workload" in out else []  # a prompt file's path, say, of one workload
    hidden = [_AXIS_CONFIG[a] for a in ("workload", "temperature", "batch_size") if a in _AXIS_CONFIG]
    hidden += [f"{_AXIS_CONFIG[a]}name" for a in ("proposer", "topology", "verifier", "model")]
    hidden += ["config.model.dtype"] if "model" in out else []  # the model axis names the dtype
    if skip_group and by in _AXIS_CONFIG:  # the compared axis's own options (workload: all of config.workload.)
        hidden.append("config.workload." if by == "workload" else _AXIS_CONFIG[by])
    for column in sorted(c for c in runs.columns if c.startswith("config.")):
        if column.startswith((*_LAUNCH_CONFIG, *hidden)) or column in (by, f"config.{by}"):  # by=config.<key>
            continue
        if column.startswith(tuple(partial)) and any(_config_text(v) == "null" for v in runs[column]):
            continue  # an option of one side's group only
        values = sorted({_config_text(v) for v in _read_values(runs, column)}, key=_value_order)
        if len(values) > 1:
            out[column.removeprefix("config.")] = values
    return out


def _read_values(runs: pd.DataFrame, column: str) -> list:
    """``runs[column]`` of the runs that read it: a tiny model's shape (``config.model.tiny.*``,
    a draft's likewise) only of the runs whose model is the tiny one (smollm2 carries the defaults)."""
    for prefix in ("config.model.", "config.proposer.model."):
        if column.startswith(f"{prefix}tiny.") and f"{prefix}name" in runs.columns:
            return [v for v, name in zip(runs[column], runs[f"{prefix}name"], strict=True) if str(name) == "tiny"]
    return list(runs[column]) if column in runs.columns else [None]


def _value_order(text: str) -> tuple:
    """Config values in reading order: numbers by value (8 before 16), then the rest as text."""
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)


def _arms_apart(arm_runs: Mapping[tuple[str, str], pd.DataFrame], section: str, by: str) -> dict[str, dict[str, str]]:
    """For each arm of ``section`` (its ``by`` value), its values of the axes and config keys that
    differ among the section's arms beyond ``by`` and ``by``'s own options: ``{}`` when they agree."""
    keys = [k for k in arm_runs if k[0] == section]
    if len(keys) < 2:
        return {}
    union = pd.concat([arm_runs[k] for k in keys], ignore_index=True)
    candidates = [k for k in _varying(union, by, skip_group=True) if k not in REPEAT_CONFIG]

    def values(runs: pd.DataFrame, key: str) -> str:
        if key in AXES:
            return ",".join(sorted({arm_label(v) for v in runs[key]}))
        if key == MACHINE:
            return ",".join(sorted(set(machine_values(runs))))
        if key == SOFTWARE:
            return "; ".join(sorted(set(_software_values(runs))))
        return ",".join(sorted({_config_text(v) for v in _read_values(runs, f"config.{key}")}) or ["-"])

    # a key sets the arms apart when their sets of values differ (a sweep crossing every arm with
    # the same temperatures pools the same values in each: no difference between the arms)
    differing = [key for key in candidates if len({values(arm_runs[k], key) for k in keys}) > 1]
    return {k[1]: {key: values(arm_runs[k], key) for key in differing} for k in keys}


#: config keys whose differences among one arm's runs are repeats, not other configurations
REPEAT_CONFIG = ("seed",)


def arm_config_keys(df: pd.DataFrame) -> list[str]:
    """The config keys (dotted, without ``config.``) that differ among the runs of one arm (same
    axes) in ``df``: a sweep over an option that is no axis (``topology.max_nodes``) makes arms
    that share a name; a seed is a repeat and is left out. In first-seen order over the arms."""
    keys: dict[str, None] = {}
    present = [a for a in AXES if a in df.columns]
    if df.empty or not present:
        return []
    for _, runs in df.groupby([df[a].map(arm_label) for a in present], sort=False):
        if len(runs) > 1:
            for key in _varying(runs, by=""):
                if key not in AXES and key not in REPEAT_CONFIG and key not in _PSEUDO_KEYS:
                    keys[key] = None
    return list(keys)


def _model_names(runs: pd.DataFrame) -> set[str]:
    """The target models of ``runs`` as the model axis names them, dtype included: ``m@bfloat16``
    and ``m`` (float32) are two models, whose times per token are not one model's."""
    if "model" not in runs.columns:
        return set()
    return {arm_label(v) for v in runs["model"]}


def _axes_apart(runs: pd.DataFrame, base: pd.DataFrame, by: str) -> dict[str, list[str]]:
    """The axes other than ``by``, then the config keys (as the arms-apart note reads them: not
    ``by``'s own options, nor a seed), whose values differ between ``runs`` and the baseline's
    ``base``: key -> [these runs' values, the baseline's], each comma-joined."""
    out = {}
    for axis in AXES:
        if axis == by or axis not in runs.columns or axis not in base.columns:
            continue
        mine, theirs = sorted({arm_label(v) for v in runs[axis]}), sorted({arm_label(v) for v in base[axis]})
        if mine != theirs:
            out[axis] = [",".join(mine), ",".join(theirs)]
    machines = [sorted(set(machine_values(df))) for df in (runs, base)]
    if machines[0] != machines[1] and by not in MACHINE_COLUMNS:
        out[MACHINE] = [",".join(m) for m in machines]
    software = [sorted(set(_software_values(df))) for df in (runs, base)]
    if software[0] != software[1]:
        out[SOFTWARE] = ["; ".join(v) for v in software]
    union = pd.concat([runs, base], ignore_index=True)
    for key in _varying(union, by, skip_group=True):
        if key in AXES or key in REPEAT_CONFIG or key in _PSEUDO_KEYS:
            continue
        mine, theirs = (
            sorted({_config_text(v) for v in _read_values(df, f"config.{key}")}, key=_value_order) or ["-"]
            for df in (runs, base)
        )
        if mine != theirs:
            out[key] = [",".join(mine), ",".join(theirs)]
    return out


#: what a comparison with the baseline means when the two arms differ beyond the ``by`` axis
BASELINE_NOTE = (
    "arms compared with the baseline across other axes or options too ({arms}): their vs-baseline ratio is not the "
    "effect of {by} alone"
)


def baseline_note(sec: Sequence[ArmRow], by: str) -> str | None:
    """:data:`BASELINE_NOTE` naming the arms of ``sec`` whose runs differ from the baseline's on an
    axis other than ``by`` (its ``all`` rows), or None; an arm with no ratio to the baseline (no
    prompt in common) is not named: there is no ratio to qualify."""
    apart = sorted(
        {
            f"{r.arm}: " + ", ".join(f"{a} {v[0]} vs {v[1]}" for a, v in r.baseline_differs.items())
            for r in sec
            if r.baseline_differs and r.category == ALL and r.vs_baseline is not None
        }
    )
    return BASELINE_NOTE.format(arms="; ".join(apart), by=by) if apart else None


#: why an arm has no ratio to the baseline when their runs are of other models
OTHER_MODEL_NOTE = (
    "arms whose runs are of another target model than the baseline's ({arms}) have no ratio to it: one model's "
    "time per token over another's is the models' difference, not {by}'s; filter to one model, or compare by=model"
)


#: why an arm has no ratio to the baseline when their runs were timed on other machines
OTHER_MACHINE_NOTE = (
    "arms timed on another machine than the baseline ({arms}) have no ratio to it: one machine's time per token "
    "over another's is the machines' difference, not {by}'s; filter to one machine (hardware.device_name=...)"
)


def other_machine_note(sec: Sequence[ArmRow], by: str) -> str | None:
    """:data:`OTHER_MACHINE_NOTE` naming the arms of ``sec`` left without a vs-baseline ratio for
    their machine (their ``all`` rows), or None."""
    arms = sorted(
        {
            f"{r.arm}: {r.baseline_other_machine[0]} vs {r.baseline_other_machine[1]}"
            for r in sec
            if r.baseline_other_machine and r.category == ALL
        }
    )
    return OTHER_MACHINE_NOTE.format(arms="; ".join(arms), by=by) if arms else None


def other_model_note(sec: Sequence[ArmRow], by: str) -> str | None:
    """:data:`OTHER_MODEL_NOTE` naming the arms of ``sec`` left without a vs-baseline ratio for their
    model (their ``all`` rows), or None."""
    arms = sorted(
        {
            f"{r.arm}: model {r.baseline_other_model[0]} vs {r.baseline_other_model[1]}"
            for r in sec
            if r.baseline_other_model and r.category == ALL
        }
    )
    return OTHER_MODEL_NOTE.format(arms="; ".join(arms), by=by) if arms else None


#: what a section's figures mean when its arms differ beyond the ``by`` axis
APART_NOTE = (
    "the arms differ in more than {by} ({keys}): each arm's speedup is over its own AR baseline, but "
    "the arms' figures are not the effect of {by} alone"
)
#: what a section's figures mean when its arms ran different prompts
PROMPTS_APART_NOTE = (
    "the arms ran different prompts ({arms}; {common} common to all): their speedups are over different "
    "prompt sets, so rank them with care; filter to a shared workload or split to compare like with like"
)


def apart_note(rows: Sequence[Any], by: str) -> str | None:
    """:data:`APART_NOTE` naming what differs among ``rows`` (one section's arms: ``all`` rows, or
    leaderboard rows) beyond ``by``, each arm's values (their ``apart``), or None."""
    keys = sorted({k for r in rows for k in r.apart})
    if not keys:
        return None
    said = "; ".join(f"{k}: " + ", ".join(f"{r.arm} {r.apart.get(k, '-')}" for r in rows) for k in keys)
    return APART_NOTE.format(by=by, keys=said)


def apart_notes(sec: Sequence[ArmRow], by: str) -> list[str]:
    """:data:`APART_NOTE` naming what differs among the arms of ``sec`` beyond ``by`` (each arm's
    values), and :data:`PROMPTS_APART_NOTE` when they ran different prompts; from the ``all`` rows."""
    rows = [r for r in sec if r.category == ALL]
    notes = []
    apart = apart_note(rows, by)
    if apart:
        notes.append(apart)
    other_prompts = any(r.common_prompts is not None and r.common_prompts != r.n_prompts for r in rows)
    if len(rows) > 1 and other_prompts and by != "workload":  # arms by workload run other prompts by design
        common = min(r.common_prompts or 0 for r in rows)
        notes.append(PROMPTS_APART_NOTE.format(arms=", ".join(f"{r.arm}: {r.n_prompts}" for r in rows), common=common))
    return notes


def config_text(value: Any) -> str:
    """A config value as a label spells it (``null``, ``[a,b]``, ``0.7``)."""
    return _config_text(value)


def _config_text(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "[" + ",".join(_config_text(v) for v in value) + "]"
    return arm_label(value)


def _labels(section: str) -> tuple[str, ...]:
    return {
        "exact": (),
        "ungated": ("ungated (a gate was skipped)",),
        "heuristic": ("heuristic (exact: false)",),
        "cpu_budget_artifact": ("cpu_budget_artifact",),
    }[section]


def compare(
    df: pd.DataFrame,
    *,
    by: str = "proposer",
    baseline: str | None = None,
    filters: Mapping[str, str] | None = None,
    confidence_level: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    method: str = "percentile",
) -> list[ArmRow]:
    """Arms side by side per section and category (see the module docstring)."""
    if not 0.0 < confidence_level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1); got {confidence_level}")
    runs = _arm_runs(df, by, filters)
    long = prompt_table(runs)
    boot = dict(confidence_level=confidence_level, n_resamples=n_resamples, seed=seed, method=method)

    arms: dict[tuple[str, str], pd.DataFrame] = {}
    arm_runs: dict[tuple[str, str], pd.DataFrame] = {}
    arm_long: dict[tuple[str, str], pd.DataFrame] = {}
    for (section, arm), group in runs.groupby(["section", ARM], sort=True):
        key = (str(section), str(arm))
        arm_runs[key] = group
        arm_long[key] = long[long["run_id"].isin(group["run_id"])]
        arms[key] = _arm_prompts(arm_long[key])
    # each arm's resampling units: its prompts, joined where they shared a batch in any of its runs
    units_of = {key: resampling_units(rows) for key, rows in arm_long.items()}

    base_key: dict[str, tuple[str, str] | None] = {}
    if baseline is not None:
        baseline = matching_label(baseline, {k[1] for k in arms})
        for section in SECTIONS:
            same, exact = (section, baseline), ("exact", baseline)
            base_key[section] = same if same in arms else exact if exact in arms else None
        if all(v is None for v in base_key.values()):
            split = sorted({k[1] for k in arms if k[1].startswith(f"{baseline} (")})
            if split:  # its runs span target models or machines: an arm each, none of them the bare value
                raise ValueError(
                    f"baseline {by}={baseline!r} ran on several target models or machines, an arm each: "
                    f"give one of {split} (quoted: baseline='{split[0]}')"
                )
            raise ValueError(f"baseline {by}={baseline!r} has no runs; arms: {sorted({k[1] for k in arms})}")

    out: list[ArmRow] = []
    for section in SECTIONS:
        apart = _arms_apart(arm_runs, section, by)
        section_keys = [k for k in arms if k[0] == section]
        shared = None
        if len(section_keys) > 1:
            shared = set(arms[section_keys[0]].index)
            for k in section_keys[1:]:
                shared &= set(arms[k].index)
        for key in sorted(section_keys):
            prompts = arms[key]
            categories = [*sorted(prompts["category"].unique()), ALL]
            for cat in categories:
                p = prompts if cat == ALL else prompts[prompts["category"] == cat]
                if p.empty:
                    continue
                # a category's row counts the runs that hold its prompts, and their outliers only
                cat_long = arm_long[key] if cat == ALL else arm_long[key][arm_long[key]["category"] == cat]
                cat_runs = arm_runs[key][arm_runs[key]["run_id"].isin(cat_long["run_id"])]
                # the resampling unit (:func:`resampling_units`): a prompt, summed over the runs that
                # repeat it, or the prompts that shared a batch with it (a category no batched run holds
                # is resampled by prompt alone)
                units = _unit_sums(cat_long, units_of[key])
                tpt = paired_bootstrap((units["spec_decode_ms"], units["spec_tokens"]), ratio_of_sums, **boot)
                speed = decode_speedup(units, boot)
                vs, n_pairs, n_pair_units, differs, other_model, other_machine = None, 0, 0, {}, [], []
                bk = base_key.get(section)
                if bk is not None and bk != key:
                    differs = _axes_apart(cat_runs, arm_runs[bk], by)
                    if by != "model" and _model_names(cat_runs) != _model_names(arm_runs[bk]):
                        other_model = differs.get("model", [])  # another model's times: no ratio to them
                    elif MACHINE in differs:  # another machine's times likewise: its speed, not the arm's
                        other_machine = differs[MACHINE]
                if bk is not None and not other_model and not other_machine:
                    b = arms[bk] if cat == ALL else arms[bk][arms[bk]["category"] == cat]
                    in_base = set(b.index)
                    common = [k for k in p.index if k in in_base]  # in this arm's order
                    n_pairs = len(common)
                    if n_pairs:
                        # both arms resample the same units: the components of their prompts' batches in
                        # either arm's runs (a prompt batched with another in either moves with it)
                        base_long = arm_long[bk] if cat == ALL else arm_long[bk][arm_long[bk]["category"] == cat]
                        if (key, bk) not in units_of:
                            units_of[key, bk] = resampling_units(pd.concat([arm_long[key], arm_long[bk]]))
                        a = _unit_sums(cat_long[cat_long["prompt_id"].isin(common)], units_of[key, bk])
                        b = _unit_sums(base_long[base_long["prompt_id"].isin(common)], units_of[key, bk]).loc[a.index]
                        n_pair_units = len(a)
                        vs = paired_bootstrap(
                            (b["spec_decode_ms"], b["spec_tokens"], a["spec_decode_ms"], a["spec_tokens"]),
                            speedup_statistic,
                            **boot,
                        )
                out.append(
                    ArmRow(
                        section=section,
                        arm=key[1],
                        category=cat,
                        n_prompts=len(p),
                        run_ids=tuple(sorted(cat_runs["run_id"])),
                        varying=_varying(cat_runs, by),
                        time_per_committed_token_ms=tpt,
                        ar_time_per_token_ms=_clean(p["ar_decode_ms"].sum() / p["ar_tokens"].sum())
                        if p["ar_tokens"].sum()
                        else None,
                        speedup=speed,
                        vs_baseline=vs,
                        n_pairs_baseline=n_pairs,
                        n_pair_units=n_pair_units,
                        labels=_labels(section),
                        end_to_end_speedup=end_to_end_speedup(units, boot),
                        batch_sizes=_batch_sizes(cat_runs),
                        concurrent_jobs=_concurrent_jobs(cat_runs),
                        timing_outliers=_timing_outliers(cat_runs, cat_long),
                        unaccepted_runs=_unaccepted_runs(cat_runs) if cat == ALL else 0,
                        truncated_prompts=int(cat_long.loc[cat_long["truncated"], "prompt_id"].nunique()),
                        baseline_differs=differs,
                        n_units=len(units),
                        apart=apart.get(key[1], {}) if cat == ALL else {},
                        common_prompts=None if shared is None or cat != ALL else len(shared & set(p.index)),
                        has_baseline=bk is not None,
                        baseline_other_model=list(other_model),
                        baseline_other_machine=list(other_machine),
                    )
                )
    return out


# --------------------------------------------------------------------------------------------
# the leaderboard (Spec-Bench's shape)

#: per-prompt columns the leaderboard reads (missing in older records: those cells are "-")
_LEADER_COLUMNS = (*_PROMPT_COLUMNS, "spec_rounds", "spec_prefill_ms", "ar_prefill_ms")


@dataclass(frozen=True)
class LeaderCell:
    n_prompts: int
    speedup: Estimate  # as in the comparison: ratio of sums over decode time, AR over this arm
    accepted_tokens: Estimate  # mean accepted tokens per round, bonus token counted
    spec_bench_speedup: float | None  # Spec-Bench's statistic: mean tokens/s over mean AR tokens/s


@dataclass(frozen=True)
class LeaderRow:
    section: str
    arm: str
    run_ids: tuple[str, ...]
    cells: dict[str, LeaderCell]  # column (a Spec-Bench task, another category, or overall) -> cell
    # as an ArmRow's: the axes and config keys whose values differ among the arm's runs (the compare
    # table's "mixed axes"), its values of what differs among its section's arms beyond ``by``, and
    # its runs' batch sizes (above 1, its times are per request)
    varying: dict[str, list[str]] = field(default_factory=dict)
    apart: dict[str, str] = field(default_factory=dict)
    batch_sizes: tuple[int, ...] = field(default=())
    # column -> the pairing keys (:func:`prompt_key`) of the prompts behind its cell: rows of one count
    # may still have run different prompts
    prompts: dict[str, frozenset[str]] = field(default_factory=dict)


def leaderboard_prompts(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, prompt) with the leaderboard's per-prompt columns (NaN where absent), its
    category and its column (``task``: :func:`~harness.tracking.spec_bench.task_of`, or
    ``overall (category)`` for a category named ``overall``)."""
    by_fingerprint = fingerprinted(runs)
    rows = [
        {
            "run_id": run["run_id"],
            "prompt_id": (key := prompt_key(run, p, by_fingerprint=by_fingerprint)),
            "raw_prompt_id": str(p["prompt_id"]),
            "batch_unit": _batch_unit(run, p, key),
            "category": str(p["category"]),
            # a category named as the overall column (``overall``) is a column of its own beside it
            "task": category_label(task_of(str(p["category"])), OVERALL),
            **{c: float(p[c]) if p.get(c) is not None else np.nan for c in _LEADER_COLUMNS},
        }
        for run, p in run_prompts(runs)
    ]
    columns = ["run_id", "prompt_id", "raw_prompt_id", "batch_unit", "category", "task", *_LEADER_COLUMNS]
    return pd.DataFrame(rows, columns=columns)


def _complete_sums(rows: pd.DataFrame, unit: str) -> pd.DataFrame:
    """The leaderboard's columns of ``rows`` summed per ``unit``, in :func:`prompt_order`; NaN where
    any row lacks the value (an older record's prompts have no spec_rounds or prefill): a sum over
    part of the runs pooled would read as the whole (accepted tokens per round doubled)."""
    grouped = rows.groupby(unit, sort=True)[list(_LEADER_COLUMNS)]
    summed = grouped.sum(min_count=1).where(grouped.count() == grouped.size().to_numpy()[:, None])
    return prompt_order(summed, rows, unit)


def spec_bench_statistic(p: pd.DataFrame) -> float | None:
    """Spec-Bench's speedup: mean over prompts of tokens / wall s (prefill + decode), speculative
    over AR. None when a prompt lacks its prefill time."""
    wall = {a: p[f"{a}_prefill_ms"] + p[f"{a}_decode_ms"] for a in ("spec", "ar")}
    if any(w.isna().any() or (w <= 0).any() for w in wall.values()):
        return None
    spec = (p["spec_tokens"] / (wall["spec"] / 1e3)).mean()
    ar = (p["ar_tokens"] / (wall["ar"] / 1e3)).mean()
    return _clean(spec / ar) if ar else None


def leaderboard(
    df: pd.DataFrame,
    *,
    by: str = "proposer",
    filters: Mapping[str, str] | None = None,
    confidence_level: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    method: str = "percentile",
) -> tuple[list[str], list[LeaderRow]]:
    """Columns (Spec-Bench's tasks present, other categories, ``overall``) and one row per arm and
    section, sorted by the overall speedup (best first) as Spec-Bench sorts its leaderboard."""
    runs = _arm_runs(df, by, filters)
    long = leaderboard_prompts(runs)
    columns = [*task_order(long["task"].unique()), OVERALL]
    boot = dict(confidence_level=confidence_level, n_resamples=n_resamples, seed=seed, method=method)
    arm_runs = {(str(section), str(arm)): group for (section, arm), group in runs.groupby(["section", ARM], sort=True)}
    out: list[LeaderRow] = []
    for section in SECTIONS:
        apart = _arms_apart(arm_runs, section, by)
        rows = []
        for arm, group in runs[runs["section"] == section].groupby(ARM, sort=True):
            mine = long[long["run_id"].isin(group["run_id"])]
            refuse_mixed_categories(mine)  # as the table refuses it: no figure the table has none of
            summed = _complete_sums(mine, "prompt_id")
            summed["task"] = mine.groupby("prompt_id", sort=True)["task"].first()
            units_of = resampling_units(mine)  # as the table's: prompts, joined where they shared a batch
            cells, prompts = {}, {}
            for col in columns:
                p = summed if col == OVERALL else summed[summed["task"] == col]
                if p.empty:
                    continue
                prompts[col] = frozenset(p.index)
                units = _unit_sums(mine if col == OVERALL else mine[mine["task"] == col], units_of, _complete_sums)
                speed = decode_speedup(units, boot)
                accepted = Estimate(None)
                if not units["spec_rounds"].isna().any():
                    accepted = paired_bootstrap((units["spec_tokens"], units["spec_rounds"]), ratio_of_sums, **boot)
                cells[col] = LeaderCell(len(p), speed, accepted, spec_bench_statistic(p))
            rows.append(
                LeaderRow(
                    section,
                    str(arm),
                    tuple(sorted(group["run_id"])),
                    cells,
                    varying=_varying(group, by),
                    apart=apart.get(str(arm), {}),
                    batch_sizes=_batch_sizes(group),
                    prompts=prompts,
                )
            )
        rows.sort(key=lambda r: -(r.cells[OVERALL].speedup.value or -math.inf) if OVERALL in r.cells else math.inf)
        out += rows
    return columns, out


def times(e: Estimate, digits: int = 3) -> str:
    """A speedup with its interval: ``1.234x [1.100, 1.310]``."""
    if e.value is None:
        return "-"
    head, sep, tail = e.fmt(digits).partition(" [")
    return f"{head}x{sep}{tail}"


def leader_cell(cell: LeaderCell | None) -> str:
    """``1.234x [1.100, 1.310] / 3.12 [2.95, 3.30]``: the speedup, then accepted tokens per round."""
    if cell is None:
        return "-"
    return f"{times(cell.speedup)} / {cell.accepted_tokens.fmt(2)}"


def format_leaderboard(columns: Sequence[str], rows: Sequence[LeaderRow], *, by: str, level: float) -> str:
    """Plain-text leaderboard, one table per section."""
    pct = f"{level * 100:g}% CI"
    lines: list[str] = []
    every = columns
    for section, sec in by_section(rows):
        columns = section_columns(every, sec)
        header = [by, *columns]
        body = [[r.arm, *(leader_cell(r.cells.get(c)) for c in columns)] for r in sec]
        sb = [
            [
                r.arm,
                *(
                    "-"
                    if c not in r.cells or r.cells[c].spec_bench_speedup is None
                    else f"{r.cells[c].spec_bench_speedup:.3f}x"
                    for c in columns
                ),
            ]
            for r in sec
        ]
        widths = [max(len(h), *(len(b[i]) for b in body + sb)) for i, h in enumerate(header)]
        lines.append(f"== leaderboard (Spec-Bench shape), {SECTION_TITLES[section]} ==")
        lines.append(
            f"cell: decode speedup vs AR [{pct}] / mean accepted tokens per round, bonus token counted [{pct}]; "
            f"prompts per column: {leader_counts(sec, columns)}"
        )
        lines += _aligned([header, ["-" * w for w in widths], *body], widths)
        if any(cell != "-" for b in sb for cell in b[1:]):
            lines.append(
                "Spec-Bench's statistic (mean per-prompt tokens/s over AR's, wall time with prefill, the tokens each "
                "arm generated; speed.py itself recounts AR's from text: each record's spec_bench_speed_py_speedup):"
            )
            lines += _aligned(sb, widths)
        lines += [f"note: {note}" for note in leaderboard_notes(sec, by)]
        lines.append("")
    return "\n".join(lines)


def pooled(varying: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The keys of an arm's ``varying`` that pool other configurations into its figures: all but
    repeats (:data:`REPEAT_CONFIG`: runs of other seeds are what pooling is for)."""
    return {k: list(v) for k, v in varying.items() if k not in REPEAT_CONFIG}


def varying_text(varying: Mapping[str, Sequence[str]]) -> str:
    """``temperature=0,0.7; verifier=greedy,typical``: each key with its values (the machines' and
    builds', which hold commas, apart by `` / ``)."""
    return "; ".join(f"{k}={(' / ' if k in _PSEUDO_KEYS else ',').join(v)}" for k, v in varying.items())


#: what a leaderboard row's cells mean when its arm pools runs of other configurations
POOLED_NOTE = (
    "arms pooling runs that differ in more than {by} ({arms}): each of their cells pools those runs' prompts "
    "into one figure, not one configuration's; filter to one value (e.g. temperature=0) or compare by= that axis "
    "to see each"
)
#: what a leaderboard row's cells mean when its arm's runs batched requests
LEADER_BATCHED_NOTE = (
    "arms with runs at batch > 1 ({arms}): a prompt's time is its request's latency inside its batch, so their "
    "speedups are per request, the requests' summed latencies over their summed tokens, not batch throughput; "
    "their intervals resample whole batches (with every batch their prompts shared in another run)"
)


def leader_prompts_note(sec: Sequence[LeaderRow], by: str) -> str | None:
    """:data:`PROMPTS_APART_NOTE` when the rows of one section's leaderboard ran different prompts
    (their overall columns' prompt keys differ, whatever their counts), as the comparison table says
    it; None when they ran the same, or the arms are workloads (other prompts by design)."""
    rows = [r for r in sec if OVERALL in r.cells and OVERALL in r.prompts]
    sets = [r.prompts[OVERALL] for r in rows]
    if len(rows) < 2 or by == "workload" or len(set(sets)) == 1:
        return None
    arms = ", ".join(f"{r.arm}: {r.cells[OVERALL].n_prompts}" for r in rows)
    return PROMPTS_APART_NOTE.format(arms=arms, common=len(frozenset.intersection(*sets)))


def leaderboard_notes(sec: Sequence[LeaderRow], by: str) -> list[str]:
    """The notes under one section's leaderboard: arms pooling runs of other configurations
    (:data:`POOLED_NOTE`), arms of batched runs, arms that differ in more than ``by``
    (:data:`APART_NOTE`) and arms that ran different prompts (:func:`leader_prompts_note`)."""
    notes = []
    mixed = sorted(f"{r.arm}: {varying_text(pooled(r.varying))}" for r in sec if pooled(r.varying))
    if mixed:
        notes.append(POOLED_NOTE.format(by=by, arms="; ".join(mixed)))
    batched = sorted(
        f"{r.arm} (batch {','.join(map(str, r.batch_sizes))})" for r in sec if max(r.batch_sizes or (1,)) > 1
    )
    if batched:
        notes.append(LEADER_BATCHED_NOTE.format(arms="; ".join(batched)))
    apart = apart_note(sec, by)
    prompts = leader_prompts_note(sec, by)
    return [*notes, *(note for note in (apart, prompts) if note)]


def section_columns(columns: Sequence[str], sec: Sequence[LeaderRow]) -> list[str]:
    """The leaderboard's ``columns`` some row of one section fills: a category only another section's
    runs hold (an ungated run's) made a column of dashes there."""
    return [c for c in columns if any(c in r.cells for r in sec)]


def leader_counts(
    sec: Sequence[LeaderRow], columns: Sequence[str], titles: Mapping[str, str] | None = None, sep: str = "="
) -> str:
    """The prompts behind each column: ``code=2, overall=9`` when every row ran the same prompts
    (the same count and the same prompt keys), else each row's count in row order (``overall=9/6``,
    or ``overall=9/9`` for as many other prompts; ``-`` where a row has no such prompt) and a note."""
    name = (lambda c: titles.get(c, c)) if titles else (lambda c: c)
    counts = {c: [r.cells[c].n_prompts if c in r.cells else None for r in sec] for c in columns}
    counts = {c: n for c, n in counts.items() if any(v is not None for v in n)}
    same_prompts = all(len({r.prompts.get(c) for r in sec}) == 1 for c in counts)
    if same_prompts and all(len(set(n)) == 1 for n in counts.values()):
        return ", ".join(f"{name(c)}{sep}{n[0]}" for c, n in counts.items())
    per_row = ", ".join(
        f"{name(c)}{sep}" + "/".join("-" if v is None else str(v) for v in n) for c, n in counts.items()
    )
    return (
        f"{per_row} (rows {', '.join(r.arm for r in sec)} in order: the rows ran different prompts, "
        "so their cells are over different prompt sets)"
    )


def _decode_named(d: dict[str, Any]) -> dict[str, Any]:
    """A row or cell as JSON with its decode speedup under ``decode_speedup``: a record's ``speedup``
    is end to end, and a reader joining the two on one key would mix the statistics."""
    return {("decode_speedup" if k == "speedup" else k): v for k, v in d.items()}


def leaderboard_json(columns: Sequence[str], rows: Sequence[LeaderRow], *, by: str | None = None) -> dict[str, Any]:
    """The leaderboard as JSON: each row with what varies among its runs (``varying``), what sets it
    apart from its section's other arms (``apart``) and its runs' batch sizes; with ``by``, the notes
    under each section's table too (``notes``: section -> lines)."""
    out: dict[str, Any] = {
        "columns": list(columns),
        "accepted_tokens": "mean accepted tokens per round, bonus/correction token counted",
        "rows": [
            {
                "section": r.section,
                "arm": r.arm,
                "run_ids": list(r.run_ids),
                "varying": {k: list(v) for k, v in r.varying.items()},
                "apart": dict(r.apart),
                "batch_sizes": list(r.batch_sizes),
                "cells": {c: _decode_named(asdict(cell)) for c, cell in r.cells.items()},
            }
            for r in rows
        ],
    }
    if by is not None:
        out["notes"] = {section: leaderboard_notes(sec, by) for section, sec in by_section(rows)}
    return out


# --------------------------------------------------------------------------------------------
# output


def by_section(rows: Sequence[Any]) -> Iterator[tuple[str, list[Any]]]:
    """(section, its rows) for each section that has rows, in :data:`SECTIONS` order."""
    for section in SECTIONS:
        sec = [r for r in rows if r.section == section]
        if sec:
            yield section, sec


def arm_table(
    sec: Sequence[ArmRow], *, by: str, baseline: str | None, ci: str = "", ar_column: bool = True
) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one section's arms: ``ci`` follows each estimate's heading;
    ``ar_column`` adds AR's ms per token."""
    header = [by, "category", "prompts", "runs", f"decode ms/committed token{ci}"]
    header += ["AR decode ms/token"] if ar_column else []
    header.append(f"decode speedup vs AR{ci}")
    header.append(f"end-to-end speedup{ci}")
    if baseline is not None:
        header.append(f"vs {by}={baseline}{ci}")
    header.append("mixed axes")
    body = []
    for r in sec:
        line = [r.arm, r.category, str(r.n_prompts), str(len(r.run_ids)), r.time_per_committed_token_ms.fmt(2)]
        line += [Estimate(r.ar_time_per_token_ms).fmt(2)] if ar_column else []
        line.append(r.speedup.fmt(3))
        line.append(r.end_to_end_speedup.fmt(3))
        if baseline is not None:
            paired = r.vs_baseline is not None or r.arm == baseline or not r.has_baseline
            if r.baseline_other_model:
                line.append("- (other model)")
            elif r.baseline_other_machine:
                line.append("- (other machine)")
            else:
                line.append(r.vs_baseline.fmt(3) if r.vs_baseline else "-" if paired else "- (no prompt in common)")
        # what the machine or the code was comes first, never among the keys cut off after four
        ordered = sorted(r.varying.items(), key=lambda kv: kv[0] not in _PSEUDO_KEYS)
        mixed = [f"{k}={','.join(v)}" for k, v in ordered]
        line.append("; ".join(mixed[:4]) + (f"; and {len(mixed) - 4} more" if len(mixed) > 4 else "") or "-")
        body.append(line)
    return header, body


def _aligned(cells: Sequence[Sequence[str]], widths: Sequence[int]) -> list[str]:
    """Rows of ``cells`` left-aligned in columns of ``widths``, two spaces apart."""
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]


def _concurrent_jobs(runs: pd.DataFrame) -> tuple[int, ...]:
    """The ``metrics.concurrent_jobs`` of ``runs`` (records from before it: left out)."""
    if "concurrent_jobs" not in runs.columns:
        return ()
    return tuple(sorted({int(c) for c in pd.to_numeric(runs["concurrent_jobs"], errors="coerce").dropna()}))


#: what a section's figures mean when some of its runs were timed while other jobs ran
CONCURRENT_NOTE = (
    "runs launched with other jobs at once ({arms}): on one machine each run's speedup pairs its two arms under "
    "the same load, but their ms per token, and ratios to arms timed alone, are not a quiet machine's (a relaunch "
    "with concurrent_jobs=1 times them again; a Slurm array's tasks count as sharing one node unless the launch "
    "asked for whole nodes)"
)


def concurrent_note(sec: Sequence[ArmRow]) -> str | None:
    """:data:`CONCURRENT_NOTE` naming the arms of ``sec`` with runs timed beside other jobs (their
    ``all`` rows), or None."""
    shared = sorted(
        {
            f"{r.arm}: {', '.join(map(str, r.concurrent_jobs))} at once"
            for r in sec
            if r.category == ALL and r.concurrent_jobs and max(r.concurrent_jobs) > 1
        }
    )
    return CONCURRENT_NOTE.format(arms="; ".join(shared)) if shared else None


def _batch_sizes(runs: pd.DataFrame) -> tuple[int, ...]:
    if "batch_size" not in runs.columns:
        return ()
    return tuple(sorted({int(b) for b in runs["batch_size"].dropna()}))


def _timing_outliers(runs: pd.DataFrame, prompts: pd.DataFrame | None = None) -> int:
    """Flagged (prompt, arm) pairs over ``runs`` (each record's ``metrics.timing_outliers``, a JSON list
    in the store; absent in records written before the flag); with ``prompts`` (rows of
    :func:`prompt_table`), only those of these prompts."""
    if "timing_outliers" not in runs.columns:
        return 0
    keep = None if prompts is None else set(zip(prompts["run_id"], prompts["raw_prompt_id"], strict=True))
    n = 0
    for run_id, v in zip(runs["run_id"], runs["timing_outliers"], strict=True):
        if isinstance(v, str):
            n += sum(1 for o in json.loads(v) if keep is None or (run_id, str(o.get("prompt_id"))) in keep)
    return n


#: what an arm's figures mean when its runs hold prompts timed through a stall
OUTLIER_NOTE = (
    "arms whose runs flagged timing outliers ({arms}): a prompt's decode time per round was 3x or more its "
    "arm's median, a stall rather than the method, and those prompts' times are in the figures above; see each "
    "record's metrics.timing_outliers, and re-run on a quiet machine"
)


def outlier_note(sec: Sequence[ArmRow]) -> str | None:
    """:data:`OUTLIER_NOTE` naming the arms of ``sec`` whose runs flagged timing outliers, or None."""
    flagged = sorted({f"{r.arm} ({r.timing_outliers} flagged)" for r in sec if r.timing_outliers and r.category == ALL})
    return OUTLIER_NOTE.format(arms="; ".join(flagged)) if flagged else None


#: what an arm's speedup means when runs of it sped up past their tokens per round (with one token per
#: round: no proposed token accepted)
UNACCEPTED_NOTE = (
    "arms with runs that sped up more than their rounds allow ({arms}; at batch 1 their tokens committed per "
    "round, at one token per round no proposed token accepted; above, the baseline's batch steps over their "
    "batch rounds): each round runs at least one verify forward, about the baseline's step, so that speedup "
    "is not speculation's: the machine's load while the arms were timed, or a verify forward of several rows "
    "running faster than the baseline's step"
)


#: the store columns :func:`~harness.tracking.run_notes.rounds_bound` reads
_ROUNDS_BOUND_COLUMNS = (
    "mean_committed_per_round",
    "batch_requests",
    "ar_batch_rounds",
    "ar_tokens",
    "batch_rounds",
    "committed_tokens",
)


def _row_bound_metrics(row: Mapping[str, Any]) -> dict[str, Any]:
    """A store row's figures as :func:`~harness.tracking.run_notes.rounds_bound` reads a record's
    metrics (``batch_requests`` is stored as JSON text)."""
    out = {k: row.get(k) for k in _ROUNDS_BOUND_COLUMNS}
    out = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}
    batches = out["batch_requests"]
    if isinstance(batches, str):
        try:
            batches = json.loads(batches)
        except ValueError:
            batches = None
    out["batch_requests"] = list(batches) if isinstance(batches, list) else None
    return out


def _unaccepted_runs(runs: pd.DataFrame) -> int:
    """Runs of ``runs`` whose decode or end-to-end speedup is more than their rounds allow
    (:func:`~harness.tracking.run_notes.sped_up_past_rounds` of records' ``metrics.decode_speedup``
    or ``metrics.speedup`` against :func:`~harness.tracking.run_notes.rounds_bound`: the tokens
    committed per round at batch 1, the arms' batch rounds above)."""
    if "mean_committed_per_round" not in runs.columns:
        return 0
    bounds = [rounds_bound(_row_bound_metrics(row))[0] for row in runs.to_dict("records")]
    past = [False] * len(runs)
    for column in ("decode_speedup", "speedup"):  # decode, or end to end with the prefills
        if column in runs.columns:
            speedup = pd.to_numeric(runs[column], errors="coerce")
            past = [a or sped_up_past_rounds(s, b) for a, s, b in zip(past, speedup, bounds, strict=True)]
    return sum(past)


def unaccepted_note(sec: Sequence[ArmRow]) -> str | None:
    """:data:`UNACCEPTED_NOTE` naming the arms of ``sec`` with such runs, or None."""
    arms = sorted(
        {
            f"{r.arm} ({r.unaccepted_runs} of {len(r.run_ids)} runs)"
            for r in sec
            if r.unaccepted_runs and r.category == ALL
        }
    )
    return UNACCEPTED_NOTE.format(arms="; ".join(arms)) if arms else None


#: what an arm's figures mean when the context limit cut some of its prompts
TRUNCATION_NOTE = (
    "arms whose prompts were cut to fit the model's positions ({arms}): their oldest text was removed "
    "(workload.truncate=left; under workload.truncate=false only a later turn whose earlier answers, fed back "
    "as text, tokenized longer than generated), so their figures are for the cut prompts, and another context "
    "limit measures other prompts; see each record's metrics.context"
)


def truncation_note(sec: Sequence[ArmRow]) -> str | None:
    """:data:`TRUNCATION_NOTE` naming the arms of ``sec`` some of whose prompts were cut, or None."""
    cut = sorted(
        {f"{r.arm} ({r.truncated_prompts} of {r.n_prompts})" for r in sec if r.truncated_prompts and r.category == ALL}
    )
    return TRUNCATION_NOTE.format(arms="; ".join(cut)) if cut else None


#: what an arm's figures mean when its runs ran other code
SOFTWARE_NOTE = (
    "arms pooling runs of other code ({arms}): their times are of different builds of the harness or of "
    "torch/transformers pooled into one figure, so what changed between the builds is in it; filter to one build "
    "(harness_code=...) to compare like with like"
)


def software_note(sec: Sequence[ArmRow]) -> str | None:
    """:data:`SOFTWARE_NOTE` naming the arms of ``sec`` whose runs ran other code (their ``all``
    rows), each with its builds, or None."""
    arms = sorted(
        {f"{r.arm}: {' / '.join(r.varying[SOFTWARE])}" for r in sec if r.category == ALL and SOFTWARE in r.varying}
    )
    return SOFTWARE_NOTE.format(arms="; ".join(arms)) if arms else None


def section_notes(sec: Sequence[ArmRow], by: str) -> list[str]:
    """The notes under a section's table: batched arms, timing outliers, cut prompts, few resampling
    units, arms pooling other code, the baseline, arms apart beyond ``by``."""
    notes = (
        batched_note(sec),
        software_note(sec),
        concurrent_note(sec),
        outlier_note(sec),
        unaccepted_note(sec),
        truncation_note(sec),
        few_units_note(sec),
        one_unit_note(sec),
        baseline_note(sec, by),
        other_model_note(sec, by),
        other_machine_note(sec, by),
        *apart_notes(sec, by),
    )
    return [n for n in notes if n]


#: below this many resampling units a bootstrap interval is little more than the range of the values
MIN_INTERVAL_UNITS = 5

#: what an interval means when it resamples fewer than :data:`MIN_INTERVAL_UNITS` units
FEW_UNITS_NOTE = (
    "arms whose intervals resample fewer than {n} prompts or batches ({arms}): a bootstrap over so few units "
    "spans little more than the values measured, so read their intervals as that range, not as 95% coverage; "
    "measure more prompts"
)


def few_units_note(sec: Sequence[ArmRow]) -> str | None:
    """:data:`FEW_UNITS_NOTE` naming the arms of ``sec`` (their ``all`` rows) whose intervals draw
    from 2 to :data:`MIN_INTERVAL_UNITS` - 1 units (one unit has no interval): their own, or the
    prompts (or batches of them) their vs-baseline interval pairs; and, of an arm measured on more, the
    categories of its breakdown drawn from so few; or None."""

    def units(r: ArmRow, n: int) -> str:
        return f"{n} {'batches' if r.batch_sizes and max(r.batch_sizes) > 1 else 'prompts'}"

    few: dict[str, str] = {}
    for r in sec:
        if r.category != ALL:
            continue
        parts = []
        if 2 <= r.n_units < MIN_INTERVAL_UNITS:
            parts.append(units(r, r.n_units))
        interval = r.vs_baseline is not None and r.vs_baseline.ci_low is not None
        if interval and 2 <= r.n_pair_units < MIN_INTERVAL_UNITS:  # the vs-baseline interval draws these
            shared = f"{r.n_pairs_baseline} prompts shared with the baseline"
            parts.append(shared if r.n_pair_units == r.n_pairs_baseline else f"{r.n_pair_units} batches of {shared}")
        if parts:
            few[r.arm] = f"{r.arm}: {', '.join(parts)}"
    categories: dict[str, list[str]] = {}
    for r in sec:
        if r.category != ALL and r.arm not in few and 2 <= r.n_units < MIN_INTERVAL_UNITS:
            categories.setdefault(r.arm, []).append(f"{r.category} ({units(r, r.n_units)})")
    named = sorted(few.values())
    for arm, listed in sorted(categories.items()):
        shown = ", ".join(sorted(listed)[:4]) + (f" and {len(listed) - 4} more" if len(listed) > 4 else "")
        named.append(f"{arm}'s categor{'y' if len(listed) == 1 else 'ies'} {shown}")
    return FEW_UNITS_NOTE.format(n=MIN_INTERVAL_UNITS, arms="; ".join(named)) if named else None


#: what an arm's figure means when one prompt (or batch) measured it
ONE_UNIT_NOTE = (
    "measured on one prompt or batch ({arms}): a single value with no interval, which says nothing of how "
    "another prompt would fare; measure more prompts"
)


def one_unit_note(sec: Sequence[ArmRow]) -> str | None:
    """:data:`ONE_UNIT_NOTE` naming the arms of ``sec`` (and the categories of an arm's breakdown)
    that one unit measured, or None."""
    one = sorted({r.arm for r in sec if r.category == ALL and r.n_units == 1})
    categories: dict[str, list[str]] = {}  # an arm measured on more prompts, some of its categories on one
    for r in sec:
        if r.category != ALL and r.n_units == 1 and r.arm not in one:
            categories.setdefault(r.arm, []).append(r.category)
    for arm, single in sorted(categories.items()):
        listed = ", ".join(sorted(single)[:4]) + (f" and {len(single) - 4} more" if len(single) > 4 else "")
        one.append(f"{arm}'s categor{'y' if len(single) == 1 else 'ies'} {listed}")
    return ONE_UNIT_NOTE.format(arms="; ".join(one)) if one else None


#: what an arm's figures mean when its runs batched requests
BATCHED_NOTE = (
    "arms with runs at batch > 1 ({arms}): a prompt's time is its request's latency inside its batch, so "
    "their ms/committed token and speedups are per request, the requests' summed latencies over their summed "
    "tokens: not a record's time_per_committed_token_ms and decode_speedup (batch time per token: throughput), "
    "nor its request_speedup (a ratio of means of per-request ms per token); their intervals "
    "resample whole batches, a batch's requests sharing its time (with every batch their prompts shared in "
    "another run, and for the comparison with the baseline in the baseline's: runs repeated give no more "
    "units); none from a single batch"
)


def batched_note(sec: Sequence[ArmRow]) -> str | None:
    """:data:`BATCHED_NOTE` naming the arms of ``sec`` whose runs batched requests, or None."""
    batched = sorted(
        {f"{r.arm} (batch {','.join(map(str, r.batch_sizes))})" for r in sec if max(r.batch_sizes or (1,)) > 1}
    )
    return BATCHED_NOTE.format(arms="; ".join(batched)) if batched else None


def format_table(rows: Sequence[ArmRow], *, by: str, baseline: str | None, level: float) -> str:
    """Plain-text tables, one per section, with each section's label as its heading; a note under a
    section whose arms batched requests (their figures are per request)."""
    ci = f" [{level * 100:g}% CI]"
    lines: list[str] = []
    for section, sec in by_section(rows):
        header, body = arm_table(sec, by=by, baseline=baseline, ci=ci)
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
        lines.append(f"== {SECTION_TITLES[section]} ==")
        lines += _aligned([header, ["-" * w for w in widths], *body], widths)
        lines += [f"note: {note}" for note in section_notes(sec, by)]
        lines.append("")
    return "\n".join(lines)


def to_json(rows: Sequence[ArmRow], **meta: Any) -> dict[str, Any]:
    sections: dict[str, list[dict[str, Any]]] = {s: [] for s in SECTIONS}
    for r in rows:
        d = _decode_named(asdict(r))
        d["run_ids"] = list(r.run_ids)
        d["labels"] = list(r.labels)
        sections[r.section].append(d)
    return {**meta, "sections": sections}


USAGE = (
    "usage: harness compare <records_root | store.parquet> [by=proposer] [baseline=VALUE] "
    "[json=PATH [overwrite=true]] [level=0.95] [resamples=2000] [bootstrap_seed=0] [method=percentile|basic|BCa] "
    "[leaderboard=true|false] [<axis>=<value> ...]"
)


def failures_note(failures: Sequence[Mapping[str, Any]], shown: int = 5) -> str:
    """One line naming the jobs of the sweeps read that wrote no record (their ``failures.jsonl``):
    no arm above counts them, and an arm whose every job failed is not in the table at all."""
    named = []
    for f in failures[:shown]:
        error = f.get("error") or {}
        if f.get("stage") == NOT_STARTED:  # a launch cut short before it started the job
            named.append(f"{f.get('job', '?')} ({NOT_STARTED})")
            continue
        outcome = "refused" if f.get("refused") else "failed"
        stage = f" at {f['stage']}" if f.get("stage") else ""
        named.append(f"{f.get('job', '?')} ({outcome}{stage}: {error.get('type', '?')})")
    more = f"; and {len(failures) - shown} more" if len(failures) > shown else ""
    return (
        f"note: {len(failures)} job(s) wrote no record (failures.jsonl), so no arm above counts them and an arm "
        f"whose every job failed is missing: {'; '.join(named)}{more}"
    )


def main(argv: list[str] | None = None) -> int:
    parsed = parse_command("compare", USAGE, argv)
    if isinstance(parsed, int):
        return parsed
    positionals, kv = parsed
    try:
        if len(positionals) != 1:
            raise ValueError(f"expected one records folder or store; got {positionals}")
        df, root = read_results(positionals[0])
        if df.empty:
            raise ValueError(no_records_message(positionals[0], root if Path(positionals[0]).is_dir() else None))
        opts = {k: kv.pop(k) for k in _OPTION_KEYS if k in kv}
        by = opts.get("by", "proposer")
        try:
            level = float(opts.get("level", 0.95))
        except ValueError:
            raise ValueError(f"level={opts['level']!r}: expected a number in (0, 1), e.g. level=0.9") from None
        if not 0.0 < level < 1.0:
            raise ValueError(f"level={level:g} is out of range: it must be in (0, 1), e.g. level=0.9")
        boot = {
            "confidence_level": level,
            "n_resamples": whole_number_option("resamples", opts.get("resamples"), 2000, minimum=2),
            "seed": whole_number_option("bootstrap_seed", opts.get("bootstrap_seed"), 0, minimum=0),
            "method": opts.get("method", "percentile"),
        }
        if boot["method"] not in ("percentile", "basic", "BCa"):
            raise ValueError(f"method={boot['method']!r}: expected percentile, basic or BCa")
        if "json" in opts:  # before any work: a JSON that may not be written is refused first
            out = Path(opts["json"])
            if out.exists() and out.resolve() == Path(positionals[0]).resolve():
                raise ValueError(f"json={out} is the store compare reads: give the compare JSON another path")
            if out.suffix == ".parquet":
                raise ValueError(f"json={out} is named as a store (.parquet): give the compare JSON a .json path")
            problem = output_file_problem(
                "json",
                Path(opts["json"]),
                what="a compare JSON",
                ours=json_object_with("sections", "pairing"),
                example="compare.json",
                overwrite=boolean_option("overwrite", opts.get("overwrite")),
            )
            if problem is not None:
                raise ValueError(problem)
        elif "overwrite" in opts:
            raise ValueError("overwrite= goes with json=PATH (the file it may replace)")
        show_board = boolean_option("leaderboard", opts.get("leaderboard"), default=True)
        rows = compare(df, by=by, baseline=opts.get("baseline"), filters=kv, **boot)
        # the leaderboard too before anything is printed: a refusal leaves no table behind it
        board = leaderboard(df, by=by, filters=kv, **boot) if show_board else None
    except (ValueError, KeyError, OSError) as exc:
        return refuse("compare", exc)
    baseline = None if opts.get("baseline") is None else matching_label(opts["baseline"], {r.arm for r in rows})
    print(format_table(rows, by=by, baseline=baseline, level=level))
    # a store is its own sweep's: its folder's failures only; a folder: every sweep's below it
    failures = failed_jobs(root, below=Path(positionals[0]).is_dir())
    if failures:
        print(failures_note(failures))
    if board is not None:
        print(format_leaderboard(*board, by=by, level=level))
    if "json" in opts:
        payload = to_json(
            rows,
            source=str(positionals[0]),
            by=by,
            baseline=baseline,
            filters=kv,
            **boot,
            pairing="prompt_id",
            jobs_without_record=[
                {k: f.get(k) for k in ("job", "overrides", "stage", "refused", "error") if k in f} for f in failures
            ],
            # the records a folder holds that no arm counts: their bound outputs are missing or changed
            left_out_records=[
                {"folder": folder, "why": why}
                for folder, why in (left_out_records(root) if Path(positionals[0]).is_dir() else [])
            ],
            **({"leaderboard": leaderboard_json(*board, by=by)} if board is not None else {}),
        )
        write_json_atomic(Path(opts["json"]), payload)
        print(f"wrote {opts['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
