"""Gated stages that run before anything is measured or logged: implementation and release
assertions that must pass before a run publishes any figure.

1. ``negotiation`` — already enforced by :func:`harness.engine.build.plan`; recorded here.
2. ``oracle`` — the enumeration oracle cases of the configured verifier and its sampling relation
   (the same verifier/sampling/compiler code the run uses), plus its end-to-end cases
   (:mod:`harness.gates.e2e`: real proposers, target forward and commit on a tiny float64 model).
   A heuristic verifier (``exact=false``) has no oracle; its drift is measured instead.
3. ``equivalence`` — on the configured model: every tree row's logits equal its root-to-node path
   decoded sequentially, and the cache after committing non-contiguous paths over three rounds
   equals the cache of sequentially decoding the committed tokens.
4. ``statistical`` — at temperature > 0: a chi-square test of the speculative round's first-token
   distribution against the exact target distribution (top-M tokens + "other"). Skipped (and so
   recorded) for a heuristic verifier, whose first-token law differs from the target's by design.
5. ``greedy_equality`` — at temperature 0, checked on every measured prompt (the run stops on a
   divergence that is not a recorded near-tie); recorded in the metrics.

Results are cached under ``$HARNESS_CACHE/gates`` by a key hashing the source bytes of every
module involved, library versions, model, dtype and device, so a sweep pays each gate once and a
changed verifier can never pass from the cache. A failed gate raises :class:`GateError` with its
evidence: no record, no tracker run.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from scipy.stats import chisquare
from tqdm import tqdm

from harness.contracts import ProposalResult
from harness.gates.e2e import E2EModels, applicable, case_capabilities, check_e2e_case, standard_cases
from harness.gates.oracle import MARGINAL_ATOL, check_case, verifier_cases
from harness.gates.oracle_cli import _register_extras
from harness.gates.transport import check_transport, transport_applies, transport_instances
from harness.measure.hardware import library_versions
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import cache_root
from harness.topology.compiler import compile_tree, validate_candidate_graph, validate_commit
from harness.verifiers.base import VERIFIERS


class GateError(RuntimeError):
    """A gate failed: the run stops before any record or tracker run."""


#: absolute logit tolerance of the model-level equivalence gate, by dtype
EQUIVALENCE_ATOL = {torch.float64: 1e-8, torch.float32: 2e-3, torch.bfloat16: 0.25, torch.float16: 0.05}

GATE_MODULES = (
    "harness/contracts.py",
    "harness/random_source.py",
    "harness/topology/compiler.py",
    "harness/verifiers/base.py",
    "harness/verifiers/builtin.py",
    "harness/verifiers/sampling.py",
    "harness/proposers/sampling.py",
    "harness/gates/oracle.py",
    "harness/gates/oracle_cli.py",
    "harness/gates/transport.py",
    "harness/gates/stages.py",
    "harness/target/backend.py",
    "harness/engine/decode.py",
    "harness/gates/e2e.py",
)
#: the oracle gate's end-to-end cases also run these (real proposers on a tiny float64 model)
ORACLE_MODULES = GATE_MODULES + (
    "harness/proposers/draft_model.py",
    "harness/proposers/prompt_lookup.py",
    "harness/proposers/merged.py",
    "harness/proposers/base.py",
    "harness/proposers/eagle.py",
    "harness/proposers/heads.py",
    "harness/heads/eagle.py",
    "harness/heads/state.py",
    "harness/topology/dynamic.py",
    "harness/target/loading.py",
)
REPO = Path(__file__).resolve().parents[2]
#: proposal-side code whose change must invalidate cached statistical gates
PROPOSER_MODULES = tuple(
    sorted(
        str(p.relative_to(REPO))
        for pattern in ("harness/proposers/*.py", "harness/heads/*.py")
        for p in REPO.glob(pattern)
    )
)


def gate_key(*parts: object, modules: tuple[str, ...] = GATE_MODULES) -> str:
    h = hashlib.sha256()
    for rel in modules:
        path = REPO / rel
        h.update(rel.encode())
        h.update(path.read_bytes() if path.exists() else b"<absent>")
    for module in sys.modules.values():  # a verifier registered from elsewhere (tests) is hashed too
        f = getattr(module, "__file__", None)
        if f and "/harness/verifiers/" in f and not f.endswith(tuple(modules)):
            h.update(Path(f).read_bytes())
    h.update(json.dumps(library_versions(), sort_keys=True).encode())
    h.update(json.dumps([str(p) for p in parts]).encode())
    return h.hexdigest()[:24]


def _cached(name: str, key: str, enabled: bool, compute):
    path = cache_root() / "gates" / f"{name}-{key}.json"
    if enabled and path.exists():
        result = json.loads(path.read_text())
        result["cached"] = True
        return result
    result = compute()
    result["cached"] = False
    result["key"] = key
    if enabled and result["passed"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
    return result


# --------------------------------------------------------------------------- oracle gate


def e2e_gate_rows(verifier_name: str, relation: str, *, greedy: bool) -> list[dict]:
    """The end-to-end cases (:mod:`harness.gates.e2e`) of this verifier whose proposer samples with
    ``relation`` and whose temperature is zero iff the run's is."""

    verifier = VERIFIERS[verifier_name]()
    cases = [
        c
        for c in standard_cases()
        if (c.policy.temperature == 0.0) == greedy
        and relation in case_capabilities(c).sampling_relations
        and applicable(c, verifier)
    ]
    if not cases:
        return []
    models = E2EModels.build()
    return [check_e2e_case(verifier, c, models) for c in cases]


def _oracle_rows(verifier_name: str, relation: str, *, greedy: bool | None):
    """Yield the gate's oracle rows one by one: synthetic marginal cases (the run's sampling
    relation only, when it samples), the SpecTr transport bound, then the end-to-end cases. The
    same cases and checks as ``harness oracles`` (``oracle_cli.run_suite``) for this verifier."""

    _register_extras()
    if verifier_name not in VERIFIERS:
        raise GateError(f"gate 'oracle': unknown verifier {verifier_name!r}; registered: {sorted(VERIFIERS)}")
    verifier = VERIFIERS[verifier_name]()
    sampled = relation in ("iid", "without_replacement")
    for case in verifier_cases(verifier, seeds=(0, 1), random_count=4):
        if sampled and case.tags.get("relation") != relation:
            continue
        yield check_case(verifier, case)
    if transport_applies(verifier) and (not sampled or relation == "iid"):
        for case_name, p, q, k in transport_instances(count=4):
            if ("set" if k > 1 else "sequence") in verifier.topologies:
                yield check_transport(verifier, name=case_name, p=p, q=q, k=k)
    if greedy is not None:
        yield from e2e_gate_rows(verifier_name, relation, greedy=greedy)


def oracle_gate(verifier_name: str, relation: str, *, greedy: bool | None = None) -> dict:
    """Synthetic oracle cases of the verifier (restricted to the run's sampling relation when it
    samples), the transport bound and, when ``greedy`` is given, its end-to-end cases on a tiny
    float64 model. Stops at the first failed case (its evidence is what the error reports)."""
    t0 = time.perf_counter()
    rows: list[dict] = []
    for row in _oracle_rows(verifier_name, relation, greedy=greedy):
        rows.append(row)
        if not row["passed"]:
            break
    marginal = [r for r in rows if r["kind"] in ("marginal", "end_to_end")]
    failed = [r for r in rows if not r["passed"]]
    return {
        "passed": bool(marginal) and not failed,
        "cases": len(rows),
        "end_to_end_cases": sum(r["kind"] == "end_to_end" for r in rows),
        "max_abs_error": max((r["max_abs_error"] for r in marginal), default=None),
        "bound": MARGINAL_ATOL,
        "failed_case": None
        if not failed
        else {k: failed[0].get(k) for k in ("case", "kind", "max_abs_error", "bound", "acceptance", "optimum")},
        "seconds": time.perf_counter() - t0,
        "evidence": "no oracle case covers this verifier" if not marginal else None,
    }


# --------------------------------------------------------------------------- model equivalence


def _paths_from(ids: list[int]) -> list[list[int]]:
    """The end-to-end proposal-buffer trace's tree shape (A B {C,D,E}, A F, X B) built from prompt
    tokens: a shared prefix, siblings, and an equal token (B) under a different parent."""
    a, b, c, d, e, f, x = (ids[i % len(ids)] for i in (0, 1, 2, 3, 4, 5, 6))
    return [[a, b, c], [a, b, d], [a, b, e], [a, f], [x, b]]


@torch.inference_mode()
def equivalence_gate(backend: CausalLMBackend, prompt_ids: list[int], *, rounds: int = 3) -> dict:
    """Tree-attention and commit equivalence on the configured model."""
    model = backend.model
    atol = EQUIVALENCE_ATOL.get(backend.dtype, 2e-3)
    ids = list(prompt_ids[-48:]) if len(prompt_ids) > 48 else list(prompt_ids)
    if len(ids) < 2:
        ids = ids + ids
    dev = backend.device
    seq = backend.prefill_one(ids)
    committed = list(ids)
    worst_tree, worst_cache = 0.0, 0.0
    for r in range(rounds):
        paths = _paths_from(committed[-(7 + r) :])
        tree = compile_tree(
            [ProposalResult.from_paths(paths, source="gate", manifest_hash="gate")], prefix_len=len(committed)
        )
        validate_candidate_graph(tree)
        out = backend.verify_one(seq, committed[-1], tree)
        # each row equals its root-to-node path decoded sequentially
        for row in range(-1, tree.num_rows):
            path = [] if row < 0 else [int(tree.token_ids[x]) for x in tree.path_to(row)]
            ref = model(input_ids=torch.tensor([committed + path], device=dev)).logits[0, -1]
            worst_tree = max(worst_tree, float((out.logits[row + 1].float() - ref.float()).abs().max()))
        # commit a non-contiguous accepted path: the last-inserted row at the greatest depth
        # (A -> B -> E: rows 0, 1, 4 in that trace's shape)
        deep = max(range(tree.num_rows), key=lambda x: (int(tree.depths[x]), x))
        path_rows = list(tree.path_to(deep))
        validate_commit(tree, path_rows)
        backend.commit_one(seq, path_rows)
        committed += [int(tree.token_ids[x]) for x in path_rows] + [int(out.logits[1 + path_rows[-1]].argmax())]
    ref_seq = backend.prefill_one(committed)
    for a, b in zip(seq.cache.layers, ref_seq.cache.layers):
        worst_cache = max(worst_cache, float((a.keys - b.keys).abs().max()), float((a.values - b.values).abs().max()))
    passed = worst_tree <= atol and worst_cache <= atol and seq.cached_tokens == committed[:-1]
    return {
        "passed": passed,
        "tree_max_abs_logit_diff": worst_tree,
        "commit_max_abs_kv_diff": worst_cache,
        "tolerance": atol,
        "rounds": rounds,
        "dtype": str(backend.dtype),
    }


# --------------------------------------------------------------------------- statistical gate


@torch.inference_mode()
def statistical_gate(
    *,
    backend: CausalLMBackend,
    proposer,
    verifier,
    policy,
    prompt_ids: list[int],
    samples: int,
    top_m: int,
    alpha: float,
    seed: int,
) -> dict:
    """Chi-square of the speculative first token against the exact target distribution."""

    seq = backend.prefill_one(prompt_ids)
    base_len = seq.cache_len
    committed = list(prompt_ids)
    proposer.start(list(prompt_ids))
    counts: dict[int, int] = {}
    p_exact = None
    for s in tqdm(range(samples), desc="gate: chi-square samples", unit="sample", file=sys.stderr, leave=False):
        rng = TorchRandomSource(seed * 7919 + s)
        proposal = proposer.propose(committed, rng)
        tree = compile_tree([proposal], prefix_len=len(committed))
        out = backend.verify_one(seq, committed[-1], tree)
        probs = policy.probs(out.logits)
        if p_exact is None:
            p_exact = policy.probs(out.logits[0].double(), dtype=torch.float64)
        sel = verifier.select(tree, probs, rng)
        first = int(tree.token_ids[sel.accepted_rows[0]]) if sel.accepted_rows else sel.next_token
        counts[first] = counts.get(first, 0) + 1
        backend.truncate(seq, base_len)
        proposer.observe_commit(committed)
    proposer.finish()
    top = torch.topk(p_exact, min(top_m, int((p_exact > 0).sum()))).indices.tolist()
    expected = [float(p_exact[t]) * samples for t in top]
    observed = [counts.get(t, 0) for t in top]
    other_p = 1.0 - sum(float(p_exact[t]) for t in top)
    if other_p * samples >= 5.0:
        expected.append(other_p * samples)
        observed.append(samples - sum(observed))
    else:  # fold a tiny tail into the last bin so every expected count stays usable
        expected[-1] += other_p * samples
        observed[-1] += samples - sum(observed)
    stat, pvalue = chisquare(observed, f_exp=expected)
    return {
        "passed": bool(pvalue >= alpha),
        "samples": samples,
        "bins": len(observed),
        "statistic": float(stat),
        "p_value": float(pvalue),
        "alpha": alpha,
        "observed": observed,
        "expected": [round(e, 3) for e in expected],
    }


# --------------------------------------------------------------------------- orchestration


def run_gates(
    cfg: DictConfig, *, plan_, backend: CausalLMBackend, proposer, items, eos, round_cfg, model_source: str
) -> dict:
    g = cfg.gates
    gates: dict[str, dict] = {
        "negotiation": {
            "passed": True,
            "proposer": plan_.capabilities.name,
            "probability_semantics": sorted(plan_.capabilities.probability_semantics),
            "sampling_relations": sorted(plan_.capabilities.sampling_relations),
            "topology": plan_.capabilities.topology,
            "verifier": plan_.verifier.name,
            "temperature": plan_.policy.temperature,
        }
    }
    if not g.enabled:
        gates["skipped"] = {"passed": True, "evidence": "gates.enabled=false (explicit override)"}
        return gates
    relation = next(iter(plan_.capabilities.sampling_relations))
    if g.oracle:
        if not plan_.verifier.exact:
            gates["oracle"] = {"passed": True, "evidence": "heuristic verifier: exact=false, drift measured instead"}
        else:
            key = gate_key("oracle", plan_.verifier.name, relation, plan_.policy.greedy, modules=ORACLE_MODULES)
            gates["oracle"] = _cached(
                "oracle", key, g.cache, lambda: oracle_gate(plan_.verifier.name, relation, greedy=plan_.policy.greedy)
            )
            if not gates["oracle"]["passed"]:
                raise GateError(f"gate 'oracle' failed for verifier {plan_.verifier.name!r}: {gates['oracle']}")
    model_id = [model_source, str(backend.dtype), str(backend.device)]
    if g.equivalence:
        key = gate_key("equivalence", *model_id)
        gates["equivalence"] = _cached("equivalence", key, g.cache, lambda: equivalence_gate(backend, items[0][1]))
        if not gates["equivalence"]["passed"]:
            raise GateError(f"gate 'equivalence' failed on the configured model: {gates['equivalence']}")
    if plan_.policy.greedy:
        gates["greedy_equality"] = {"passed": None, "evidence": "checked on every measured prompt"}
    elif not plan_.verifier.exact:
        gates["statistical"] = {
            "passed": None,
            "skipped": True,
            "evidence": "heuristic verifier (exact=false): its first-token law differs from the "
            "target's by design; the drift is measured instead (metrics.drift)",
        }
    elif g.statistical:
        if g.skip_statistical:
            gates["statistical"] = {
                "passed": None,
                "skipped": True,
                "evidence": "gates.skip_statistical=true (explicit override)",
            }
        else:
            key = gate_key(
                "statistical",
                *model_id,
                json.dumps(OmegaConf.to_container(cfg.proposer, resolve=True), sort_keys=True),
                json.dumps(OmegaConf.to_container(cfg.topology, resolve=True), sort_keys=True),
                plan_.verifier.name,
                plan_.policy,
                plan_.budget,
                g.chi2_samples,
                items[0][1],
                getattr(proposer, "artifact_manifest", None) or {},
                modules=GATE_MODULES + PROPOSER_MODULES,
            )
            gates["statistical"] = _cached(
                "statistical",
                key,
                g.cache,
                lambda: statistical_gate(
                    backend=backend,
                    proposer=proposer,
                    verifier=plan_.verifier,
                    policy=plan_.policy,
                    prompt_ids=items[0][1],
                    samples=int(g.chi2_samples),
                    top_m=int(g.chi2_top_m),
                    alpha=float(g.chi2_alpha),
                    seed=int(cfg.seed),
                ),
            )
            if not gates["statistical"]["passed"]:
                raise GateError(f"gate 'statistical' failed (first-token chi-square): {gates['statistical']}")
    return gates
