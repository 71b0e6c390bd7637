"""`harness oracles`: run the exactness oracle suite and print one row per case.

Rows: every exact, non-test-only registered verifier x the cases derived from its declarations
(``harness.gates.oracle.verifier_cases``: structured shapes, random small instances and the
named fixed cases) plus the SpecTr transport bound (``harness.gates.transport``) where it
applies. Then the negative control: the test-only ``naive_multi_draft`` verifier (one-draft
acceptance repeated over k candidates, which duplicates mass) must be CAUGHT, i.e. at least one
of its cases must miss the target marginal by far more than the bound.
Unless ``--quick`` or ``--no-e2e`` is given, the end-to-end cases of ``harness.gates.e2e`` run
too — the real round (every proposer through its real class — draft model, prompt lookup, REST,
Medusa / Hydra / Clover heads, early exit, layer skip, merged sources — compiler, target forward,
verifier, commit) on a tiny float64 Llama, plus float32 cases of the runs' own precision — with
their own negative control, proposers whose recorded q differs from the law they sampled, which
must be caught.
Exit status 1 on any failed case or an uncaught negative control.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tqdm import tqdm

from harness.files import atomic_write_text, json_object_with, output_file_problem, print_traceback_if_asked
from harness.gates.e2e import E2EModels, negative_control_rows, run_e2e_suite
from harness.gates.oracle import (
    MARGINAL_ATOL,
    check_case,
    check_fast_path,
    exact_verifier_names,
    overrides_select_logits,
    verifier_cases,
)
from harness.gates.transport import check_transport, transport_applies, transport_instances
from harness.verifiers import broken as _broken  # noqa: F401  (registers the negative control)
from harness.verifiers.base import VERIFIERS

#: the deliberately wrong verifier run as the negative control
NEGATIVE_CONTROL = "naive_multi_draft"
#: a negative control counts as caught only if it misses by at least this much (>> MARGINAL_ATOL)
CAUGHT_MIN_ERROR = 1e-4


def _register_extras() -> None:
    """Nothing left to do: importing this module registers the test-only verifiers (the negative
    control ``naive_multi_draft``); kept for callers that ask for it before running cases."""


def run_suite(
    verifier_names: list[str] | None = None,
    *,
    relations: Iterable[str] | None = None,
    seeds: Sequence[int] = (0, 1),
    random_count: int = 4,
    transport: bool = True,
    negative_control: bool | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run the oracle cases; one dict per case (``on_row`` is called with each as it is done).

    ``verifier_names=None``: every exact, non-test-only verifier plus the negative control.
    A list runs those verifiers only (a named test-only verifier is run like any other, so a
    broken verifier fails its gate). ``relations`` keeps only cases of those sampling relations.
    Row keys: ``verifier``, ``case``, ``kind`` ("marginal" | "fast_path" | "transport"), ``max_abs_error``,
    ``bound``, ``passed``, ``leaves``, ``seconds``, ``negative_control`` (True on rows of the
    negative control, which are EXPECTED to fail).
    """
    _register_extras()
    names = exact_verifier_names() if verifier_names is None else list(verifier_names)
    for name in names:
        if name not in VERIFIERS:
            raise ValueError(f"unknown verifier {name!r}; registered: {sorted(VERIFIERS)}")
    if negative_control is None:
        negative_control = verifier_names is None
    wanted = None if relations is None else set(relations)
    rows: list[dict] = []

    def run_one(name: str, is_control: bool) -> None:
        verifier = VERIFIERS[name]()
        if not verifier.exact:
            raise ValueError(f"verifier {name!r} is heuristic (exact=False): the oracle does not apply")
        for case in verifier_cases(verifier, seeds=seeds, random_count=random_count):
            if wanted is not None and case.tags.get("relation") not in wanted:
                continue
            checks = [check_case(verifier, case)]
            if overrides_select_logits(verifier):  # the runs' own path, against select on the same draws
                checks.append(check_fast_path(verifier, case))
            for row in checks:
                row["negative_control"] = is_control
                row["relation"] = case.tags.get("relation")
                rows.append(row)
                if on_row is not None:
                    on_row(row)
        if transport and transport_applies(verifier) and (wanted is None or "iid" in wanted):
            for case_name, p, q, k in transport_instances(count=max(2, random_count)):
                if ("set" if k > 1 else "sequence") not in verifier.topologies:
                    continue
                row = check_transport(verifier, name=case_name, p=p, q=q, k=k)
                row["negative_control"] = is_control
                row["relation"] = "iid"
                rows.append(row)
                if on_row is not None:
                    on_row(row)

    for name in names:
        run_one(name, False)
    if negative_control:
        run_one(NEGATIVE_CONTROL, True)
    return rows


def run_e2e(
    verifier_names: list[str] | None = None,
    *,
    negative_control: bool = True,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """End-to-end rows (:mod:`harness.gates.e2e`: the real round on a tiny model) for every named
    (default: every exact) verifier, plus the end-to-end negative control of those verifiers
    (proposers whose recorded q is not the law they sampled), whose rows must FAIL."""

    _register_extras()
    names = exact_verifier_names() if verifier_names is None else list(verifier_names)
    models = E2EModels.build()
    rows = run_e2e_suite(names, models=models, on_row=on_row)
    for row in rows:
        row["negative_control"] = False
    if negative_control:
        rows += negative_control_rows(models, verifiers=None if verifier_names is None else names)
    return rows


def e2e_negative_control_status(rows: list[dict]) -> dict:
    """``caught`` iff every end-to-end negative-control case misses by >= ``CAUGHT_MIN_ERROR``."""
    control = [r for r in rows if r.get("negative_control") and r["kind"] == "end_to_end"]
    if not control:
        return {"proposer": "misrecorded_q", "status": "not run", "caught": False, "cases": 0}
    caught = all(r["max_abs_error"] >= CAUGHT_MIN_ERROR for r in control)
    return {
        "proposer": "misrecorded_q",
        "status": "caught" if caught else "NOT CAUGHT",
        "caught": caught,
        "cases": len(control),
        "min_abs_error": min(r["max_abs_error"] for r in control),
    }


def negative_control_status(rows: list[dict]) -> dict:
    """``caught`` iff a negative-control marginal case misses by >= ``CAUGHT_MIN_ERROR``."""
    control = [r for r in rows if r.get("negative_control") and r["kind"] == "marginal"]
    if not control:
        return {"verifier": NEGATIVE_CONTROL, "status": "not run", "caught": False, "cases": 0}
    worst = max(control, key=lambda r: r["max_abs_error"])
    caught_cases = [r for r in control if r["max_abs_error"] >= CAUGHT_MIN_ERROR]
    return {
        "verifier": NEGATIVE_CONTROL,
        "status": "caught" if caught_cases else "NOT CAUGHT",
        "caught": bool(caught_cases),
        "cases": len(control),
        "cases_caught": len(caught_cases),
        "max_abs_error": worst["max_abs_error"],
        "worst_case": worst["case"],
    }


def summarize(rows: list[dict]) -> dict:
    checked = [r for r in rows if not r.get("negative_control")]
    failed = [r for r in checked if not r["passed"]]
    control = negative_control_status(rows)
    e2e_control = e2e_negative_control_status(rows)
    return {
        "cases": len(checked),
        "failed": len(failed),
        "marginal_bound": MARGINAL_ATOL,
        "end_to_end_cases": sum(r["kind"] == "end_to_end" for r in checked),
        "negative_control": control,
        "e2e_negative_control": e2e_control,
        "passed": not failed and all(c["caught"] or c["status"] == "not run" for c in (control, e2e_control)),
    }


def format_table(rows: list[dict]) -> str:
    lines = [f"{'verifier':<18} {'case':<52} {'max abs error':>14} {'leaves':>8}  result"]
    for r in rows:
        if r.get("negative_control"):
            continue
        leaves = "" if r.get("leaves") is None else str(r["leaves"])
        extra = ""
        if r["kind"] == "transport":
            extra = f"  (acceptance {r['acceptance']:.6f} <= optimum {r['optimum']:.6f})"
        lines.append(
            f"{r['verifier']:<18} {r['case']:<52} {r['max_abs_error']:>14.3e} {leaves:>8}  "
            f"{'pass' if r['passed'] else 'FAIL'}{extra}"
        )
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse that raises a one-line usage error instead of printing the usage and exiting."""

    def error(self, message: str):
        raise ValueError(f"{message} (harness oracles --help shows the options)")


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {value}")
    return value


def check_json_destination(path: Path, *, overwrite: bool = False) -> None:
    """``--json PATH`` must be a file path whose folder exists or can be created and is writable, and
    not a run's file or any other existing file but an oracle suite JSON (unless ``overwrite``)."""
    problem = output_file_problem(
        "--json",
        path,
        what="an oracle suite JSON",
        ours=json_object_with("summary", "rows"),
        example="oracles.json",
        overwrite=overwrite,
        overwrite_option="--overwrite",
    )
    if problem is not None:
        raise ValueError(problem)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"--json {path}: not writable")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="harness oracles", description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write rows and summary as JSON here")
    parser.add_argument(
        "--overwrite", action="store_true", help="let --json replace an existing file that is not an oracle suite JSON"
    )
    parser.add_argument(
        "--verifier",
        action="append",
        default=None,
        help="run only this verifier (repeatable); default: every exact verifier",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one seed, no end-to-end cases, two random instances per verifier (unless --random gives the count)",
    )
    parser.add_argument(
        "--random", type=_count, default=None, help="random instances per verifier (default 4; 2 with --quick)"
    )
    parser.add_argument(
        "--no-e2e",
        action="store_true",
        help="skip the end-to-end cases on a tiny float64 model (--quick skips them too)",
    )
    t0 = time.perf_counter()
    try:
        args = parser.parse_args([] if argv is None else argv)
        if args.json is not None and not args.json.strip():
            raise ValueError(
                "--json= is empty: give the file to write the rows and summary to (e.g. --json oracles.json)"
            )
        if args.overwrite and args.json is None:
            raise ValueError("--overwrite goes with --json PATH (the file it may replace)")
        if args.json is not None:  # a destination that cannot be written is refused before the suite runs
            args.json = Path(args.json)
            check_json_destination(args.json, overwrite=args.overwrite)
        _register_extras()
        unknown = [name for name in args.verifier or () if name not in VERIFIERS]
        if unknown:  # refused before the progress bar starts, so the line stands alone
            raise ValueError(f"unknown verifier {unknown[0]!r}; registered: {sorted(VERIFIERS)}")
        heuristic = [name for name in args.verifier or () if not VERIFIERS[name].exact]
        if heuristic:  # likewise
            raise ValueError(f"verifier {heuristic[0]!r} is heuristic (exact=False): the oracle does not apply")
        seeds = (0,) if args.quick else (0, 1)
        random_count = args.random if args.random is not None else (2 if args.quick else 4)
        with tqdm(desc="oracle cases", unit="case", file=sys.stderr, leave=False) as bar:

            def done(row: dict) -> None:
                bar.set_postfix_str(f"{row['verifier']} {row['case']}"[:60], refresh=False)
                bar.update(1)

            rows = run_suite(args.verifier, seeds=seeds, random_count=random_count, negative_control=True, on_row=done)
            if not (args.quick or args.no_e2e):
                bar.set_description("end-to-end cases (tiny model)")
                rows += run_e2e(args.verifier, negative_control=True, on_row=done)
    except ValueError as exc:
        print_traceback_if_asked(exc)
        print(f"harness oracles: refused: {exc}", file=sys.stderr)
        return 2
    summary = summarize(rows)
    print(format_table(rows))
    control = summary["negative_control"]
    if control["caught"]:
        print(
            f"\nnegative control {control['verifier']}: caught ({control['cases_caught']}/{control['cases']} cases "
            f"miss the target; worst {control['max_abs_error']:.3e} on {control['worst_case']})"
        )
    else:
        print(f"\nnegative control {control['verifier']}: {control['status']}")
    e2e_control = summary["e2e_negative_control"]
    if e2e_control["status"] != "not run":
        print(
            f"end-to-end negative control (recorded q is not the law sampled): {e2e_control['status']} "
            f"({e2e_control['cases']} cases, smallest miss {e2e_control['min_abs_error']:.3e})"
        )
    print(
        f"{summary['cases']} cases, {summary['failed']} failed, bound {MARGINAL_ATOL:g}, "
        f"{time.perf_counter() - t0:.1f} s: {'PASS' if summary['passed'] else 'FAIL'}"
    )
    if args.json is not None:  # its folder was checked before the suite; created now, the file written whole
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps({"summary": summary, "rows": rows}, indent=2, sort_keys=True))
    return 0 if summary["passed"] else 1
