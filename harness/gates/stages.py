"""The gates a run passes before anything is measured or logged, and the record of each.

1. ``negotiation`` — enforced by :func:`harness.engine.build.plan` before any model work; recorded.
2. ``oracle`` — the synthetic enumeration cases of the configured verifier for the proposer's sampling
   relations (the same verifier, sampling and compiler code the run uses) and the SpecTr transport bound.
3. ``end_to_end_oracle`` — the real round (proposer, compiler, the target's verify forward, the
   verifier, the commit) on tiny float64 models with every draw enumerated
   (:mod:`harness.gates.e2e`), for the cases that match the run's proposer, relation and temperature,
   one of them deepened to the run's depth (up to :data:`~harness.gates.e2e.DEEP_DEPTH`).
4. ``equivalence`` — on the configured model (:mod:`harness.gates.equivalence`).
5. ``statistical`` — at temperature > 0, a chi-square test of the first token at the first prefix
   of the workload's first prompts where the proposer proposes (:mod:`harness.gates.statistical`).
6. ``workload_governance`` — the proposer's check of the evaluation workload (leakage into a REST
   datastore, or into the training text of draft heads, an EAGLE draft or an early-exit adapter trained here).
7. ``greedy_equality`` — at temperature 0, on every measured output (:mod:`harness.gates.greedy`),
   after the measurement.

Each is recorded as passed, skipped (with the override), or not applicable (with why); a failed
gate raises :class:`~harness.gates.status.GateError` with its evidence (no record, no tracker run).
Results are cached under ``$HARNESS_CACHE/gates`` by a key over everything they depend on
(:mod:`harness.gates.keys`), so a sweep pays each gate once and a changed verifier can never pass
from the cache.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from harness.files import atomic_write_text
from harness.gates.e2e import (
    DEEP_DEPTH,
    DEEP_MAX_LEAVES,
    GATE_TIERS,
    E2EModels,
    budget_depth,
    check_e2e_case,
    deep_candidates,
    gate_tier,
    truncating_case,
)
from harness.gates.equivalence import batched_equivalence_gate, equivalence_gate
from harness.gates.keys import gate_key
from harness.gates.oracle import (
    MARGINAL_ATOL,
    OracleError,
    check_case,
    check_fast_path,
    overrides_select_logits,
    verifier_cases,
)
from harness.gates.statistical import (
    CONTINUATION_TOKENS,
    GATE_PROMPTS,
    MIN_WAY_SHARE,
    PILOT_SAMPLES,
    prefix_rule,
    statistical_gate,
    way_taken,
)
from harness.gates.status import GateError, not_applicable, passed, skipped
from harness.gates.transport import check_transport, transport_applies, transport_instances
from harness.measure import hardware
from harness.proposers.registry import PROPOSERS
from harness.target import native
from harness.target.backend import CausalLMBackend
from harness.target.loading import cache_root
from harness.verifiers.base import VERIFIERS


def _cached(name: str, key: str, enabled: bool, compute) -> dict:
    """A passed gate's result under its key, computed on a miss. The file is written atomically
    (jobs of a sweep share the cache). Only a passed entry is ever written, so a file that cannot be
    read, or holds anything but a JSON object with status ``passed`` (and the same key, where it
    records one), is not a verdict: the gate is computed again, and the file replaced where it passes."""
    path = cache_root() / "gates" / f"{name}-{key}.json"
    if enabled and path.exists():
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            entry = None  # unreadable
        if isinstance(entry, dict) and entry.get("status") == "passed" and entry.get("key", key) == key:
            return {**entry, "cached": True}
    result = {**compute(), "cached": False, "key": key}
    if enabled and result["status"] == "passed":
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(result, indent=2, default=str))
    return result


def _module(ref: str) -> str:
    return ref.partition(":")[0]


#: the code the statistical gate's result depends on besides the gate's own module: what builds the
#: run's proposer (its options, policy and budget), what prepares it (a measured cost curve, trained
#: heads; the preparers the registry names), and the stage that decides the gate's arguments
STATISTICAL_BUILD_MODULES = ("harness.engine.build", "harness.prepare", "harness.gates.stages")


def statistical_entries(proposer: str, verifier_module: str) -> list[str]:
    """The entry modules whose import closure keys the statistical gate's cached result."""
    return ["harness.gates.statistical", _module(PROPOSERS[proposer]), verifier_module, *STATISTICAL_BUILD_MODULES]


# --------------------------------------------------------------------------- oracle gates


def _synthetic_rows(verifier_name: str, relations: Sequence[str]):
    """The synthetic marginal cases of the verifier and the transport bound, for every sampling
    relation the proposer declares (a merged proposer declares its sources' relations): the same cases
    and checks as ``harness oracles`` for this verifier. Where every relation samples, only the cases
    of those relations run; a relation that does not sample (a ranked or deterministic proposal) runs
    them all."""
    verifier = VERIFIERS[verifier_name]()
    sampled = [r in ("iid", "without_replacement") for r in relations]
    fast = overrides_select_logits(verifier)  # the runs' own path is checked against select on the same draws
    for case in verifier_cases(verifier, seeds=(0, 1), random_count=4):
        if all(sampled) and case.tags.get("relation") not in relations:
            continue
        yield check_case(verifier, case)
        if fast:
            yield check_fast_path(verifier, case)
    if transport_applies(verifier) and (not all(sampled) or "iid" in relations):
        for case_name, p, q, k in transport_instances(count=4):
            if ("set" if k > 1 else "sequence") in verifier.topologies:
                yield check_transport(verifier, name=case_name, p=p, q=q, k=k)


def _summarise_rows(rows: list[dict], t0: float, *, empty_why: str) -> dict:
    checked = [r for r in rows if r["kind"] in ("marginal", "end_to_end", "fast_path")]
    failed = [r for r in rows if not r["passed"]]
    if not rows:
        return not_applicable(empty_why)
    entry = {
        "status": "failed" if failed or not checked else "passed",
        "cases": [r["case"] for r in rows],
        "max_abs_error": max((r["max_abs_error"] for r in checked), default=None),
        "bound": MARGINAL_ATOL,
        "seconds": time.perf_counter() - t0,
    }
    if failed:
        entry["failed_case"] = {
            k: failed[0].get(k) for k in ("case", "kind", "max_abs_error", "bound", "acceptance", "optimum")
        }
    return entry


def oracle_gate(verifier_name: str, relations: str | Sequence[str]) -> dict:
    """Synthetic oracle cases and the transport bound for the proposer's sampling ``relations``;
    stops at the first failed case."""
    relations = [relations] if isinstance(relations, str) else sorted(relations)
    t0 = time.perf_counter()
    rows: list[dict] = []
    for row in _synthetic_rows(verifier_name, relations):
        rows.append(row)
        if not row["passed"]:
            break
    return _summarise_rows(rows, t0, empty_why=f"no synthetic oracle case covers verifier {verifier_name!r}")


def e2e_gate(
    verifier_name: str,
    proposer: str,
    relations: list[str],
    *,
    greedy: bool,
    shape: str | None = None,
    truncated: bool = False,
    max_depth: int | None = None,
) -> dict:
    """The end-to-end cases a run of ``proposer`` (its relations and shape) under this verifier at this
    kind of temperature enumerates (:func:`harness.gates.e2e.gate_cases`: its own proposer first).

    A ``truncated`` run (a sampled law cut to top-k / top-p) whose cases all sample the whole law gets
    the nearest case that truncates added (:func:`harness.gates.e2e.truncating_case`); the entry's
    ``coverage.truncation`` names it and its tier, or says that no case of the run's relations does.

    ``max_depth``: the deepest node the run drafts (:func:`harness.gates.e2e.budget_depth`). A run
    deeper than its cases also enumerates one of them deepened to ``min(max_depth, DEEP_DEPTH)``
    (:func:`harness.gates.e2e.deep_candidates`, the first whose enumeration stays within
    ``DEEP_MAX_LEAVES``); ``coverage.depth`` gives the run's depth and the depth enumerated, with a
    ``partial`` note where the run drafts deeper than any case enumerated."""
    t0 = time.perf_counter()
    verifier = VERIFIERS[verifier_name]()
    tier, cases = gate_tier(proposer, relations, verifier, greedy=greedy, shape=shape)
    truncation = None
    if truncated and not greedy and tier is not None:
        own = next((c for c in cases if c.policy.truncated), None)
        if own is not None:
            truncation = {"case": f"e2e/{own.name}", "tier": tier}
        else:
            t_tier, extra = truncating_case(proposer, relations, verifier, shape=shape)
            if extra is None:
                truncation = {"case": None, "why": "no end-to-end case of the run's relations truncates its law"}
            else:
                cases.append(extra)
                truncation = {"case": f"e2e/{extra.name}", "tier": t_tier, "covers": GATE_TIERS[t_tier]}
    rows: list[dict] = []
    enumerated = max((budget_depth(c.budget) for c in cases), default=0)
    depth = None
    if cases:
        models = E2EModels.build()
        for case in cases:
            rows.append(check_e2e_case(verifier, case, models))
            if not rows[-1]["passed"]:
                break
        if max_depth is not None:
            depth = {"run": int(max_depth), "enumerated": enumerated}
            wanted = min(int(max_depth), DEEP_DEPTH)
            if wanted > enumerated and all(r["passed"] for r in rows):
                too_large = []
                for case in deep_candidates(cases, wanted, truncated=truncated):
                    try:
                        rows.append(check_e2e_case(verifier, case, models, max_leaves=DEEP_MAX_LEAVES))
                    except OracleError as err:
                        if "exceeds max_leaves" not in str(err):  # anything else is the round's own error
                            raise
                        too_large.append(f"e2e/{case.name}")
                        continue
                    depth.update(enumerated=budget_depth(case.budget), case=rows[-1]["case"])
                    break
                if too_large:
                    depth["too_large"] = too_large
            if depth["enumerated"] < depth["run"]:
                depth["partial"] = (
                    f"the run drafts up to {depth['run']} deep; the cases enumerate rounds {depth['enumerated']} deep"
                )
    entry = _summarise_rows(
        rows, t0, empty_why=f"no end-to-end case runs verifier {verifier_name!r} with relations {relations}"
    )
    if tier is not None:  # what the cases prove about this run: its own configuration, or the nearest covered
        entry["coverage"] = {"tier": tier, "covers": GATE_TIERS[tier], "run_shape": shape}
        if truncation is not None:
            entry["coverage"]["truncation"] = truncation
        if depth is not None:
            entry["coverage"]["depth"] = depth
            if "partial" in depth:
                entry["coverage"]["covers"] += f", {depth['enumerated']} deep (the run drafts {depth['run']} deep)"
    return entry


# --------------------------------------------------------------------------- orchestration


def disabled_gates(cfg: DictConfig) -> dict[str, str]:
    """Gate -> the override that switches it off (a datastore's leakage refusal is overridden by
    ``allow_leakage=true`` only where something leaked: its entry says so)."""
    g = cfg.gates
    if not g.enabled:
        off = ("oracle", "end_to_end_oracle", "equivalence", "statistical", "greedy_equality")
        return {name: "gates.enabled=false" for name in off}
    out = {}
    if not g.oracle:
        out["oracle"] = out["end_to_end_oracle"] = "gates.oracle=false"
    if not g.equivalence:
        out["equivalence"] = "gates.equivalence=false"
    if not g.statistical:
        out["statistical"] = "gates.statistical=false"
    elif g.skip_statistical:
        out["statistical"] = "gates.skip_statistical=true"
    return out


def announce_disabled(cfg: DictConfig, plan_) -> None:
    """One line on stderr at start for every run whose gates an override switched off, naming only
    the gates that apply to the run (``plan_``), as :func:`run_gates` decides: the statistical gate
    tests sampled rounds (any temperature above 0, top_k=1 included), the greedy-equality gate
    deterministic ones (temperature 0, or top_k=1), and a heuristic verifier makes no exactness
    claim for the oracles or the statistical gate to check."""
    off = disabled_gates(cfg)
    if plan_.policy.greedy or not plan_.verifier.exact:  # temperature 0, or a heuristic verifier: not applicable
        off.pop("statistical", None)
    if not plan_.policy.deterministic:  # sampled outputs: nothing to compare token for token
        off.pop("greedy_equality", None)
    if not plan_.verifier.exact:
        off.pop("oracle", None)
        off.pop("end_to_end_oracle", None)
    if off:
        overrides = sorted(set(off.values()))
        print(
            f"harness: gate(s) {', '.join(sorted(off))} switched off by {', '.join(overrides)}: "
            "the record will say gated: false",
            file=sys.stderr,
        )


def machine_identity(devices: Sequence[str | None]) -> dict:
    """The hardware whose kernels compute the gates' forwards on ``devices`` (the target's, a draft
    model's; None: none; ``["cpu"]`` for the oracle gates, which compute on the CPU whatever the
    run's device), part of every cached gate's key, so that a cache shared across machines never
    serves a pass computed on other kernels: each device's model (a CUDA device's name and
    compute capability, else the CPU's), the instruction set torch's CPU kernels dispatch to where a
    model runs on the CPU, and the native kernels' code paths where they are loaded."""
    models = []
    for device in dict.fromkeys(d for d in devices if d):
        dev = torch.device(device)
        if dev.type == "cuda":
            name = hardware.device_name(device)
            capability = list(torch.cuda.get_device_capability(dev)) if name is not None else None
            models.append([str(dev), name, capability])
        else:
            models.append([str(dev), hardware.cpu_name()])
    out: dict = {"devices": models}
    if any(m[0].startswith("cpu") for m in models):
        out["cpu_capability"] = hardware.cpu_capability()
    if native.native_kernels_loaded():
        out["native_code_paths"] = native.code_paths()
    return out


def run_gates(
    cfg: DictConfig,
    *,
    plan_,
    backend: CausalLMBackend,
    proposer,
    items,
    model_source: str,
    model_identity: dict | None = None,
    positions: int | None = None,
) -> dict[str, dict]:
    """Every gate that runs before the measurement; ``greedy_equality`` runs after it (``pending``
    here at temperature 0). Raises GateError on the first failure. ``model_identity``: what else
    decides the forward the gates check (the run manifest's resolved backend options and the
    target's and draft's checkpoint files), part of every cached gate's key. ``positions``: the run's
    context limit, inside which the equivalence gate's forwards stay (None: none)."""
    g = cfg.gates
    off = disabled_gates(cfg)
    caps, verifier, policy = plan_.capabilities, plan_.verifier, plan_.policy
    relations = sorted(caps.sampling_relations)  # a merged proposer declares its sources' relations
    gates: dict[str, dict] = {
        "negotiation": passed(
            proposer=caps.name,
            probability_semantics=sorted(caps.probability_semantics),
            sampling_relations=sorted(caps.sampling_relations),
            topology=caps.topology,
            verifier=verifier.name,
            temperature=policy.temperature,
        )
    }

    def gate(name: str, compute) -> None:
        if name in off:
            gates[name] = skipped(off[name])
            return
        gates[name] = entry = compute()
        if entry["status"] == "failed":
            raise gate_failure(name, plan_, entry)

    verifier_module = VERIFIERS[verifier.name].__module__
    model_id = {
        "source": model_source,
        "dtype": str(backend.dtype),
        "device": str(backend.device),
        "attn_implementation": cfg.model.attn_implementation,
        "tiny": OmegaConf.to_container(cfg.model.tiny, resolve=True) if cfg.model.name == "tiny" else None,
        "seed": int(cfg.model.seed) if cfg.model.name == "tiny" else None,
        **(model_identity or {}),
        **machine_identity([str(backend.device), OmegaConf.select(cfg, "proposer.model.device", default=None)]),
    }
    heuristic = not verifier.exact
    why_heuristic = "heuristic verifier (exact=false): no exactness claim to check; its drift is measured"
    if heuristic:
        gates["oracle"] = not_applicable(why_heuristic)
        gates["end_to_end_oracle"] = not_applicable(why_heuristic)
    else:
        # both oracle gates compute on the CPU whatever the run's device (the synthetic cases' float32
        # fast-path checks, the end-to-end cases' CPU forwards): keyed by the CPU's kernels
        cpu = machine_identity(["cpu"])
        oracle_inputs = {"verifier": verifier.name, "relations": relations, **cpu}
        gate(
            "oracle",
            lambda: _cached(
                "oracle",
                gate_key("oracle", entries=["harness.gates.stages", verifier_module], inputs=oracle_inputs),
                g.cache,
                lambda: oracle_gate(verifier.name, relations),
            ),
        )
        e2e_inputs = {
            "verifier": verifier.name,
            "proposer": caps.name,
            "relations": relations,
            "greedy": policy.greedy,
            "shape": plan_.budget.shape,
            "truncated": policy.truncated,
            "max_depth": budget_depth(plan_.budget),
            **cpu,
        }
        e2e_entries = ["harness.gates.e2e", "harness.gates.stages", verifier_module]
        gate(
            "end_to_end_oracle",
            lambda: _cached(
                "end_to_end_oracle",
                gate_key("end_to_end_oracle", entries=e2e_entries, inputs=e2e_inputs),
                g.cache,
                lambda: e2e_gate(
                    verifier.name,
                    caps.name,
                    relations,
                    greedy=policy.greedy,
                    shape=plan_.budget.shape,
                    truncated=policy.truncated,
                    max_depth=budget_depth(plan_.budget),
                ),
            ),
        )
    prompt = items[0][1]
    gate(
        "equivalence",
        lambda: _cached(
            "equivalence",
            gate_key(
                "equivalence",
                entries=["harness.gates.equivalence", "harness.target.loading"],
                inputs={**model_id, "prompt": prompt[-48:], "positions": positions},
            ),
            g.cache,
            lambda: equivalence_gate(backend, prompt, positions=positions),
        ),
    )
    batch = int(cfg.generation.batch_size)
    if batch > 1 and gates["equivalence"].get("status") == "passed":
        # a batched run verifies and commits several requests at once (ragged prompts, padded rows,
        # holes): checked over the run's batch size of its own prompts
        batch_prompts = [list(item[1]) for item in items[:batch]]
        batch_prompts += [batch_prompts[i % len(batch_prompts)][1:] for i in range(batch - len(batch_prompts))]

        def with_batch() -> dict:
            batched = _cached(
                "equivalence_batched",
                gate_key(
                    "equivalence_batched",
                    entries=["harness.gates.equivalence", "harness.target.loading"],
                    inputs={**model_id, "prompts": [p[-48:] for p in batch_prompts], "positions": positions},
                ),
                g.cache,
                lambda: batched_equivalence_gate(backend, batch_prompts, positions=positions),
            )
            return {**gates["equivalence"], "status": batched["status"], "batched": batched}

        gate("equivalence", with_batch)
    if policy.greedy:
        gates["statistical"] = not_applicable("temperature 0: greedy equality is checked on every output instead")
    elif heuristic:
        gates["statistical"] = not_applicable(
            "heuristic verifier (exact=false): its first-token law differs from the target's by design"
        )
    else:
        gate_prompts = [list(item[1]) for item in items[:GATE_PROMPTS]]
        continuation = min(CONTINUATION_TOKENS, int(cfg.generation.max_new_tokens))  # inside the run's context
        inputs = {
            **model_id,
            "proposer": OmegaConf.to_container(cfg.proposer, resolve=True),
            "topology": OmegaConf.to_container(cfg.topology, resolve=True),
            "verifier": verifier.name,
            "policy": policy,
            "budget": plan_.budget,
            "samples": int(g.chi2_samples),
            "bins": int(g.chi2_top_m),
            "alpha": float(g.chi2_alpha),
            "seed": int(cfg.seed),
            "prompts": gate_prompts,  # the candidate prefixes the rule scans
            "prefix_rule": prefix_rule(),
            "continuation": continuation,
            "artifact": getattr(proposer, "artifact_manifest", None) or {},
            "proposer_options": plan_.extras.get("proposer_options", {}),
        }
        entries = statistical_entries(cfg.proposer.name, verifier_module)
        chi2 = _statistical_options(cfg, plan_)
        gate(
            "statistical",
            lambda: _cached(
                "statistical",
                gate_key("statistical", entries=entries, inputs=inputs),
                g.cache,
                lambda: statistical_gate(
                    backend=backend, proposer=proposer, prompts=gate_prompts, continuation=continuation, **chi2
                ),
            ),
        )
        entry = gates.get("statistical") or {}
        if entry.get("coverage") == "one_way":
            print(one_way_note(entry), file=sys.stderr)
    governance = proposer.check_workload(items, allow_leakage=bool(cfg.get("allow_leakage", False)))
    if governance is not None and governance.get("leaked"):
        print(
            f"harness: gate workload_governance let {len(governance['leaked'])} leaked prompt(s) through by "
            f"allow_leakage=true ({', '.join(governance['leaked'][:3])}"
            f"{', ...' if len(governance['leaked']) > 3 else ''}): the record will say gated: false",
            file=sys.stderr,
        )
    gates["workload_governance"] = (
        governance
        if governance is not None
        else not_applicable(f"proposer {caps.name!r} reads no datastore and runs no artifact trained on text here")
    )
    if policy.deterministic:  # temperature 0, or top_k = 1: one token per position, outputs compared
        gates["greedy_equality"] = (
            skipped(off["greedy_equality"]) if "greedy_equality" in off else {"status": "pending"}
        )
    else:
        gates["greedy_equality"] = not_applicable(
            f"temperature {policy.temperature}: outputs are sampled (the statistical gate tests sampled rounds)"
        )
    return gates


def _prefix_way(test: dict, accepted_key: str) -> tuple[str | None, bool]:
    """The way to a first token a test took (:func:`~harness.gates.statistical.way_taken`, by the same
    threshold as its ``paths_note``) and whether every sample took it (not all but a few)."""
    accepted, samples = int(test[accepted_key]), int(test["samples"])
    way = test.get("way") or way_taken(accepted, samples, proposed=test.get("proposed"))
    return way, (accepted == samples if way == "accepted" else accepted == 0)


def one_way_note(entry: dict) -> str:
    """The stderr line of a statistical gate entry with ``coverage: one_way``: the first test and, at
    each piloted prefix, the test that decided there (the full test where the pilot took both ways,
    else the pilot) each took one way to a first token. Said as the first test's ``paths_note`` where
    every sample of every test took the same way, as the way most samples took where they agree on it
    (the first test's note quoted), and as not the same everywhere otherwise."""
    pilots = entry.get("pilots", [])
    ways = [_prefix_way(entry, "first_token_accepted")]
    ways += [_prefix_way(p.get("full_test", p), "accepted") for p in pilots]
    sides = [w for w, _ in ways]
    first = entry["paths_note"].split(":")[0]
    both = sum("full_test" in p for p in pilots)
    if len(set(sides)) == 1 and all(exact for _, exact in ways):
        way, tail = first, "no test exercised both ways to a first token"
    else:
        if set(sides) == {"accepted"}:
            way = "every sample's first token, or all but a few, was an accepted proposed token"
        elif set(sides) == {"rejected"}:
            way = "no sample, or only a few, accepted a proposed token"
        else:
            way = (
                f"every sample, or all but a few, took one way (not the same everywhere: mostly accepted at "
                f"{sides.count('accepted')}, mostly rejected at {sides.count('rejected')})"
            )
        way += f" (the first test: {first})"
        tail = f"no test took each way to a first token in {MIN_WAY_SHARE:.0%} of its samples with a proposal"
    if both:
        way += f" (at {both} of them a {PILOT_SAMPLES}-sample pilot took both ways, the full test there one way)"
        tail = tail.replace("no test", "no full test", 1)
    return (
        f"harness: note: statistical gate passed, but at each of the {len(ways)} prefixes it tried {way}: {tail} "
        "(the oracle gates test the verifier's rule on every path)"
    )


def _statistical_options(cfg: DictConfig, plan_) -> dict:
    """The statistical gate's test as the run configures it (all but its prefixes)."""
    g = cfg.gates
    return {
        "verifier": plan_.verifier,
        "policy": plan_.policy,
        "samples": int(g.chi2_samples),
        "top_m": int(g.chi2_top_m),
        "alpha": float(g.chi2_alpha),
        "seed": int(cfg.seed),
        "max_nodes": plan_.budget.max_nodes,
        "max_depth": plan_.budget.max_depth,
    }


def found_no_prefix(entry: dict | None) -> bool:
    """Whether a statistical gate entry is ``not_applicable`` because the proposer proposed at none
    of the prefixes it scanned (not for the temperature or the verifier)."""
    entry = entry or {}
    return entry.get("status") == "not_applicable" and "prefix" in entry and "proposed nothing" in str(entry.get("why"))


def statistical_gate_on_run(
    cfg: DictConfig, *, plan_, backend: CausalLMBackend, proposer, prefixes: list[list[int]], probe: dict
) -> dict:
    """The statistical gate at ``prefixes``, the contexts from which the measured run's first proposing
    rounds drafted, where its scan of the workload's first prompts (``probe``, its entry) found no
    proposing prefix: the rounds the run measured are then tested by sampling rather than left
    untested. Raises GateError when the test fails (the run is refused: nothing is logged)."""
    entry = statistical_gate(
        backend=backend, proposer=proposer, prompts=prefixes[:GATE_PROMPTS], **_statistical_options(cfg, plan_)
    )
    entry = {
        **entry,
        "prefixes_from": "the measured run: the contexts its first proposing rounds drafted from",
        "workload_probe": {k: probe[k] for k in ("why", "prefix") if k in probe},
    }
    if entry["status"] == "failed":
        raise gate_failure("statistical", plan_, entry, where=" at a prefix where the measured run proposed")
    return entry


def gate_failure(name: str, plan_, entry: dict, *, where: str = "") -> GateError:
    """The one line a failed gate refuses the run with: the gate, the round it checked and its
    evidence (the failed case, else the entry)."""
    evidence = entry.get("failed_case") or {k: v for k, v in entry.items() if k not in ("status", "key")}
    caps = plan_.capabilities
    return GateError(
        f"gate {name!r} failed for verifier {plan_.verifier.name!r}, proposer {caps.name!r} "
        f"(relations {', '.join(sorted(caps.sampling_relations))}, temperature {plan_.policy.temperature}){where}: "
        f"{json.dumps(evidence, default=str)}"
    )
