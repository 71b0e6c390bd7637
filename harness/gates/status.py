"""Gate entries and the error of a failed gate (statuses and what makes a run gated:
:mod:`harness.record_schema`)."""

from __future__ import annotations


class GateError(RuntimeError):
    """A gate failed: the run stops before any record or tracker run."""


def passed(**evidence) -> dict:
    return {"status": "passed", **evidence}


def skipped(override: str, **evidence) -> dict:
    return {"status": "skipped", "override": override, **evidence}


def not_applicable(why: str, **evidence) -> dict:
    return {"status": "not_applicable", "why": why, **evidence}
