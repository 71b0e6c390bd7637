"""How runs are named and labelled, and how acceptance by depth is qualified, in reports and in W&B.

One place for the conventions every view of the records shares:

* a run is named by its arm: ``<proposer>-<topology>-<verifier>-T<temperature>-B<batch>-<workload>``
  (:func:`run_name`); the arm without the workload is :func:`arm_name` (W&B's ``job_type``);
* a plot labels each run by the axes that differ among the runs it shows (:func:`arm_labels`):
  ``prompt_lookup/T=0.7`` when only the proposer and the temperature differ, never a run id;
* acceptance at depth d is a rate over the rounds that tried depth d, and deep depths rest on few
  rounds: each rate comes with its Wilson score interval (Wilson 1927) and its count, and a depth
  tried by fewer than ``min_rounds`` rounds is drawn greyed out (:func:`depth_rows`).

Records only: nothing here reads a model or the engine.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any


def name_of(value: Any) -> str | None:
    """A config entry's name: the string itself, or a mapping's ``name`` (a sweep, an experiment, a
    tracker given as a group); None for anything else."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, Mapping) and isinstance(value.get("name"), str):
        return value["name"]
    return None


#: the axes a run name and a label are made of, in this order (the model joins a label when it differs)
NAME_AXES: tuple[str, ...] = ("proposer", "topology", "verifier", "temperature", "batch_size", "workload")
LABEL_AXES: tuple[str, ...] = (*NAME_AXES, "model")

#: a depth tried by fewer rounds than this is drawn greyed out (its rate is a handful of coin flips)
MIN_DEPTH_ROUNDS = 30
#: the normal quantile of the 95% intervals drawn around rates
Z95 = 1.959963984540054


def value_text(value: Any) -> str:
    """An axis value as text: ``0.7``, ``0``, ``4``, ``rest`` (numbers without trailing zeros)."""
    if value is None or isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        f = float(value)
        return f"{f:g}" if math.isfinite(f) else str(f)
    return str(value)


def axis_piece(axis: str, value: Any) -> str:
    """How one axis value reads in a label: ``T=0.7``, ``B=4``, else the bare value."""
    v = value_text(value)
    return {"temperature": f"T={v}", "batch_size": f"B={v}"}.get(axis, v)


def arm_name(axes: Mapping[str, Any]) -> str:
    """``<proposer>-<topology>-<verifier>-T<temperature>-B<batch>``: the arm, whatever the workload."""
    return "-".join(
        [
            str(axes["proposer"]),
            str(axes["topology"]),
            str(axes["verifier"]),
            f"T{value_text(axes['temperature'])}",
            f"B{value_text(axes['batch_size'])}",
        ]
    )


def run_name(axes: Mapping[str, Any]) -> str:
    """``<proposer>-<topology>-<verifier>-T<temperature>-B<batch>-<workload>``: what ran."""
    return f"{arm_name(axes)}-{axes['workload']}"


def varying_axes(axes_list: Sequence[Mapping[str, Any]]) -> list[str]:
    """The label axes whose values differ among these runs, in label order."""
    return [a for a in LABEL_AXES if len({value_text(ax.get(a)) for ax in axes_list}) > 1]


def arm_labels(
    axes_by_run: Mapping[str, Mapping[str, Any]], options: Mapping[str, str] | None = None
) -> dict[str, str]:
    """A label per run: the axes that differ among these runs (``rest/T=0.7``), then the run's
    ``options`` (``topology.max_nodes=8``: what tells runs of one arm apart), when given.

    When no axis differs, the full run name; two runs with the same label (repeats of one arm)
    get ``#1``, ``#2`` in run-id order, so no two lines share a legend entry.
    """
    vary = varying_axes(list(axes_by_run.values()))
    options = options or {}
    labels = {
        rid: ("/".join(axis_piece(a, ax.get(a)) for a in vary) if vary else run_name(ax))
        + (f"/{options[rid]}" if options.get(rid) else "")
        for rid, ax in axes_by_run.items()
    }
    seen: dict[str, list[str]] = {}
    for rid in sorted(labels):
        seen.setdefault(labels[rid], []).append(rid)
    for label, rids in seen.items():
        if len(rids) > 1:
            for k, rid in enumerate(rids, 1):
                labels[rid] = f"{label} #{k}"
    return labels


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of a binomial rate (Wilson 1927); None without trials."""
    if trials <= 0:
        return None
    n, p = float(trials), successes / trials
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2.0 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def depth_rows(metrics: Mapping[str, Any], *, min_rounds: int = MIN_DEPTH_ROUNDS) -> list[dict[str, Any]]:
    """Acceptance and reach at each depth with their counts and 95% Wilson intervals.

    One row per depth d = 1, 2, ...: ``acceptance`` (accepted at d / tried d), ``reach``
    (accepted at d / rounds), ``tried`` and ``accepted`` (rounds), the intervals
    (``acceptance_low`` ... ``reach_high``) and ``enough`` (tried >= ``min_rounds``). Records
    written before the counts existed give rates only: counts, intervals and ``enough`` are None.
    """
    acc = list(metrics.get("acceptance_by_depth") or [])
    reach = list(metrics.get("reach_by_depth") or [])
    tried = metrics.get("rounds_tried_by_depth")
    accepted = metrics.get("rounds_accepted_by_depth")
    rounds = metrics.get("rounds")
    counted = tried is not None and accepted is not None
    rows = []
    for d in range(max(len(acc), len(reach))):
        row: dict[str, Any] = {
            "depth": d + 1,
            "acceptance": acc[d] if d < len(acc) else None,
            "reach": reach[d] if d < len(reach) else None,
            "tried": None,
            "accepted": None,
            "acceptance_low": None,
            "acceptance_high": None,
            "reach_low": None,
            "reach_high": None,
            "enough": None,
        }
        if counted and d < len(tried) and d < len(accepted):
            n, k = int(tried[d]), int(accepted[d])
            row.update(tried=n, accepted=k, enough=n >= min_rounds)
            ci = wilson_interval(k, n)
            if ci is not None:
                row["acceptance_low"], row["acceptance_high"] = ci
            if rounds:
                ci = wilson_interval(k, int(rounds))
                if ci is not None:
                    row["reach_low"], row["reach_high"] = ci
        rows.append(row)
    return rows


def machine_label(hardware: Mapping[str, Any] | None) -> str:
    """A record's machine as ``<device kind>: <device name>`` from its hardware card (``cpu: <CPU
    model>``, ``cuda: NVIDIA H100 80GB HBM3``; ``-`` for what the card lacks): how compare splits
    arms by machine and W&B runs name theirs (config ``machine``)."""
    hardware = hardware or {}

    def given(v: Any) -> str | None:
        return None if v is None or (isinstance(v, float) and v != v) or v == "" else str(v)

    kind, name = given(hardware.get("device")), given(hardware.get("device_name"))
    return f"{kind.split(':')[0] if kind else '-'}: {name or '-'}"
