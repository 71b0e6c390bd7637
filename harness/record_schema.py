"""What a run record promises about its gates and its round-cost ledger, shared by the gates and the
decode loop that write it and the store, compare, report and trackers that read it (no torch, no
model code).

Every run records, per gate, one status:

- ``passed`` — the gate ran and passed, with its evidence;
- ``failed`` — it ran and failed (the run stops: a failed run has no record);
- ``skipped`` — an override switched it off (``override`` names it); the run is not gated;
- ``not_applicable`` — it has nothing to check for this configuration (``why`` says why).

A run is *gated* when every gate passed or does not apply. Ungated runs are kept apart from gated
ones (their own section), never pooled with them.
"""

from __future__ import annotations

from collections.abc import Mapping

#: every gate a run records, in the order they run
GATES = (
    "negotiation",
    "oracle",
    "end_to_end_oracle",
    "equivalence",
    "statistical",
    "workload_governance",
    "greedy_equality",
)
STATUSES = ("passed", "failed", "skipped", "not_applicable")

#: the round-cost ledger (round cost = proposal + retrieval + packing + target verify + selection
#: + temporary state), in this order
ROUND_COST_STAGES: tuple[str, ...] = (
    "proposal",
    "retrieval",
    "packing",
    "target_verify",
    "selection",
    "temporary_state",
)

#: the stages of a batch round that one forward or one commit serves for every live request: each
#: request's row of the round series carries them in full (it waited for them); the other stages are
#: each request's own
SHARED_ROUND_STAGES: tuple[str, ...] = ("target_verify", "temporary_state")


def status_of(entry: Mapping) -> str:
    """A gate entry's status. Records of schema 1 carry only ``passed``: True, False, or None with
    ``skipped: true`` for an override (None without it was checked during the measurement, and the
    run would have stopped had it failed)."""
    if "status" in entry:
        return str(entry["status"])
    if entry.get("passed") is None:
        return "skipped" if entry.get("skipped") else "passed"
    return "passed" if entry["passed"] else "failed"


def is_gated(gates: Mapping[str, Mapping]) -> bool:
    """Every gate recorded, and each passed or does not apply."""
    return set(GATES) <= set(gates) and all(status_of(g) in ("passed", "not_applicable") for g in gates.values())


#: the switches by which a schema-1 run turned a gate off; that runner then wrote no entry for it
V1_GATE_SWITCHES = ("enabled", "oracle", "equivalence", "statistical")
#: the gates a schema-1 runner checked before measuring whenever none was switched off, each written
#: with ``passed: true`` (a failure stopped the run)
V1_REQUIRED_GATES = ("negotiation", "oracle", "equivalence")
#: of these, a schema-1 run with its gates on wrote one: ``greedy_equality`` at temperature 0
#: (``passed: null``, checked on every measured prompt), ``statistical`` when sampling
#: (``passed: true``, or ``skipped`` for a heuristic verifier)
V1_OUTPUT_GATES = ("greedy_equality", "statistical")


def _v1_evidence(gates: Mapping[str, Mapping], name: str) -> bool:
    """Whether a schema-1 record shows gate ``name`` run and passed as that runner wrote it:
    ``passed: true``, or for ``greedy_equality`` (checked during the measurement) ``passed: null``
    without ``skipped``."""
    entry = gates.get(name)
    if not isinstance(entry, Mapping):
        return False
    if entry.get("passed") is True:
        return True
    return name == "greedy_equality" and entry.get("passed") is None and not entry.get("skipped")


def is_gated_v1(gates: Mapping[str, Mapping], config: Mapping | None = None) -> bool:
    """The same for a schema-1 record, which listed only the gates that ran: the evidence that runner
    wrote for a run with its gates on (:data:`V1_REQUIRED_GATES` each ``passed: true``, and one of
    :data:`V1_OUTPUT_GATES`; a record with less, ``"gates": {}`` say, is no evidence of a gated run),
    none skipped or failed, no ``skipped`` entry (what ``gates.enabled=false`` wrote, with ``passed:
    true``), and, where its ``config`` is given, no gate switched off there (``gates.oracle=false``
    and the like left the gate out of the record, with nothing to say it had been skipped;
    ``gates.skip_statistical=true``)."""
    switches = ((config or {}).get("gates") or {}) if isinstance(config, Mapping) else {}
    if any(switches.get(name) is False for name in V1_GATE_SWITCHES) or switches.get("skip_statistical") is True:
        return False
    if not all(_v1_evidence(gates, name) for name in V1_REQUIRED_GATES):
        return False
    if not any(_v1_evidence(gates, name) for name in V1_OUTPUT_GATES):
        return False
    return "skipped" not in gates and all(status_of(g) in ("passed", "not_applicable") for g in gates.values())
