"""One job, in stages: plan -> load -> prepare -> gate -> measure -> summarise -> write.

Each stage is a function of typed values; :func:`run_job` reads as the list of them. Nothing is
written or tracked unless every stage before ``write`` succeeded: a refused plan, a failed gate or a
greedy divergence raises, and the job leaves no record. The autoregressive baseline and the
speculative arm run on the same prompts with the same seeds, batch by batch (a batch of one at
``generation.batch_size=1``), interleaved, through the same round loop and clock.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from harness.contracts import Budget
from harness.engine.arms import METRIC_NOTES, Arms, ArmsResult, merged_proposer_extras
from harness.engine.build import BuildContext, Plan, build_proposer, plan
from harness.engine.decode import RoundConfig, check_temp_kv_budget
from harness.gates.drift import heuristic_drift
from harness.gates.greedy import greedy_equality
from harness.gates.stages import GateError, run_gates
from harness.manifest import RECORD_SCHEMA_VERSION, freeze_manifest, manifest_extras, manifest_hash
from harness.measure.hardware import hardware_card, library_versions, peak_rss_bytes
from harness.prepare import prepare
from harness.prepare.sequoia import cost_model_error
from harness.proposers.base import NullProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import (
    DERIVED,
    CheckpointError,
    LoadedModel,
    checkpoint_ref_problem,
    derive_draft,
    eos_ids,
    load_model,
    load_tokenizer_of,
    model_geometry,
    model_kv_bytes_per_token,
    tokenizer_difference,
)
from harness.tracking.record import write_json_atomic, write_jsonl_atomic
from harness.tracking.wandb_tracker import open_run
from harness.workloads.prompts import encode_workload


@dataclass(frozen=True)
class Planned:
    """What the config alone decides, before any model work."""

    plan: Plan
    manifest: dict
    manifest_hash: str
    round_cfg: RoundConfig
    kv_bytes_per_token: int
    temp_kv_budget_formula_bytes: int
    run_dir: Path


@dataclass(frozen=True)
class Loaded:
    target: LoadedModel
    draft: LoadedModel | None
    backend: CausalLMBackend
    draft_backend: CausalLMBackend | None
    items: list  # [(Prompt, token ids)]
    eos: frozenset[int]


@dataclass(frozen=True)
class Prepared:
    plan: Plan  # after the topology preparers (e.g. a Sequoia tree budget)
    context: BuildContext
    proposers: list  # one per batch slot (proposers keep per-request state)
    null_proposers: list  # the autoregressive arm's slots


@dataclass(frozen=True)
class Measured:
    arms: ArmsResult
    per_prompt: list[dict]
    outputs: list[dict]
    greedy: dict | None  # the greedy-equality evidence (temperature 0), else None


def run_job(cfg: DictConfig, *, run_dir: Path | None = None) -> dict:
    """One job: everything `harness run` does. Returns the record (also written to run_dir)."""
    t_job = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    planned = plan_job(cfg, run_dir)
    loaded = load(cfg, planned)
    prepared = prepare_job(cfg, planned, loaded)
    gates = gate(cfg, planned, loaded, prepared)
    measured = measure(cfg, planned, loaded, prepared)
    record = summarise(cfg, planned, loaded, prepared, gates, measured, job_seconds=time.perf_counter() - t_job)
    write(record, measured, planned.run_dir)
    return record


# --------------------------------------------------------------------------- plan


def plan_job(cfg: DictConfig, run_dir: Path | None) -> Planned:
    """Negotiation, budgets and the frozen manifest: every refusal that needs no model."""
    check_models(cfg)
    plan_ = plan(cfg)
    bpt = model_kv_bytes_per_token(cfg.model)
    formula = check_temp_kv_budget(
        max_nodes=plan_.budget.max_nodes,
        bytes_per_token=bpt,
        budget_bytes=cfg.generation.temp_kv_budget_bytes,
        batch_size=int(cfg.generation.batch_size),
    )
    manifest = freeze_manifest(cfg, versions=library_versions(), extra=manifest_extras(cfg))
    return Planned(
        plan=plan_,
        manifest=manifest,
        manifest_hash=manifest_hash(manifest),
        round_cfg=RoundConfig(
            max_nodes=plan_.budget.max_nodes,
            max_depth=plan_.budget.max_depth,
            temp_kv_budget_bytes=cfg.generation.temp_kv_budget_bytes,
        ),
        kv_bytes_per_token=bpt,
        temp_kv_budget_formula_bytes=formula,
        run_dir=Path(run_dir or cfg.output_dir or os.getcwd()),
    )


# --------------------------------------------------------------------------- load


def load(cfg: DictConfig, planned: Planned) -> Loaded:
    """The target (and a separate draft model when the proposer needs one) and the workload."""
    target, draft = load_models(cfg)
    device = torch.device(cfg.model.device)
    backend = CausalLMBackend(target.model, device=device)
    if backend.bytes_per_token != planned.kv_bytes_per_token:
        raise GateError(f"KV bytes per token {backend.bytes_per_token} != config-derived {planned.kv_bytes_per_token}")
    draft_backend = None
    if draft is not None:
        draft_backend = CausalLMBackend(draft.model, device=torch.device(draft_model_config(cfg).device))
    return Loaded(
        target=target,
        draft=draft,
        backend=backend,
        draft_backend=draft_backend,
        items=encode_workload(cfg, target.tokenizer),
        eos=eos_ids(target.model, target.tokenizer),
    )


def load_models(cfg: DictConfig) -> tuple[LoadedModel, LoadedModel | None]:
    """The target, and the draft model when the proposer needs a separate one.

    A draft checkpoint's tokenizer is read and compared with the target's before any weights are
    read (a mismatch is refused naming the first difference); a derived draft is cut from the
    loaded target. Both load whole, each with its own dtype, device and attention implementation
    (the draft's default to the target's)."""
    d = draft_model_config(cfg)
    target_tokenizer = load_tokenizer_of(cfg.model)
    draft_tokenizer = None
    if d is not None and d.name != DERIVED:
        draft_tokenizer = load_tokenizer_of(d)
        check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_ref=d.name_or_path or d.name)
    target = _load(cfg.model, tokenizer=target_tokenizer)
    if d is None:
        return target, None
    if d.name == DERIVED:
        draft = derive_draft(
            target,
            num_layers=int(d.num_layers),
            dtype=d.dtype,
            device=d.device,
            attn_implementation=d.attn_implementation,
        )
    else:
        draft = _load(d, tokenizer=draft_tokenizer)
    return target, draft


def _load(m: DictConfig, *, tokenizer=None) -> LoadedModel:
    return load_model(
        name=m.name,
        name_or_path=m.name_or_path,
        dtype=m.dtype,
        device=m.device,
        seed=m.seed,
        num_layers=m.num_layers,
        attn_implementation=m.attn_implementation,
        tiny=OmegaConf.to_container(m.tiny),
        trust_remote_code=m.trust_remote_code,
        tokenizer=tokenizer,
    )


def draft_model_config(cfg: DictConfig):
    """The separate draft model a run needs: ``proposer=draft_model``, or a merged tree with
    ``draft_model`` among ``proposer.sources``; None otherwise (nothing is loaded)."""
    if cfg.proposer.name == "draft_model":
        return cfg.proposer.model
    if cfg.proposer.name == "merged" and "draft_model" in (cfg.proposer.get("sources") or []):
        return cfg.proposer.draft_model.model
    return None


def draft_model_key(cfg: DictConfig) -> str:
    """The config key of the draft model, for messages."""
    return "proposer.draft_model.model" if cfg.proposer.name == "merged" else "proposer.model"


def check_models(cfg: DictConfig) -> None:
    """Refuse a draft model configuration before any model work: truncation asked of a
    checkpoint (or of the target), a derived draft without a valid layer count, a checkpoint draft
    without a path."""
    if cfg.model.num_layers is not None:
        raise CheckpointError(
            f"model.num_layers={cfg.model.num_layers}: the target loads whole; layer truncation applies only to "
            "a derived draft (proposer.model.name=derived proposer.model.num_layers=k)"
        )
    d = draft_model_config(cfg)
    if d is None:
        return
    key = draft_model_key(cfg)
    if d.name == DERIVED:
        if d.num_layers is None:
            raise CheckpointError(f"{key}.name=derived needs {key}.num_layers=<k>: the target's first k layers")
        total = model_geometry(cfg.model)["num_hidden_layers"]
        if not 1 <= int(d.num_layers) <= total:
            raise CheckpointError(
                f"{key}.num_layers must be in [1, {total}] for this {total}-layer target; got {d.num_layers}"
            )
        return
    if d.num_layers is not None:
        raise CheckpointError(
            f"{key}.num_layers={d.num_layers} applies only to {key}.name=derived (the target's first k layers); "
            f"a draft given by name or path loads whole: drop {key}.num_layers"
        )
    if d.name not in ("tiny", "smollm2") or d.name_or_path:
        if d.name == "hf" and not d.name_or_path:
            raise CheckpointError(f"{key}.name=hf needs {key}.name_or_path=<checkpoint directory or hub id>")
        problem = checkpoint_ref_problem(d.name_or_path or d.name, f"{key}.name_or_path")
        if problem:
            raise CheckpointError(problem)


def check_same_tokenizer(target_tokenizer, draft_tokenizer, *, draft_ref: str = "the draft") -> None:
    """A parametric draft must tokenize exactly as the target: compared by content (vocabulary,
    special tokens, normalisation), not by ``config.vocab_size`` (embedding matrices of one family
    are often padded to different sizes)."""
    if target_tokenizer is None and draft_tokenizer is None:
        return  # tiny models: both use the synthetic id space
    if target_tokenizer is None or draft_tokenizer is None:
        which = "target" if target_tokenizer is None else "draft"
        raise CheckpointError(
            f"the {which} has no tokenizer (model=tiny) and the other has one: "
            "a draft must share the target's tokenizer"
        )
    diff = tokenizer_difference(target_tokenizer, draft_tokenizer)
    if diff is not None:
        raise CheckpointError(
            f"the draft {draft_ref!r} tokenizes differently from the target: {diff}; "
            "a draft model must share the target's tokenizer"
        )


# --------------------------------------------------------------------------- prepare


def prepare_job(cfg: DictConfig, planned: Planned, loaded: Loaded) -> Prepared:
    """Artifacts that need the models (e.g. a Sequoia tree), then one proposer per batch slot."""
    context = BuildContext(
        cfg=cfg,
        target_backend=loaded.backend,
        tokenizer=loaded.target.tokenizer,
        draft_backend=loaded.draft_backend,
        items=loaded.items,
        model_source=loaded.target.source,
    )
    plan_ = prepare(cfg, planned.plan, context)
    batch = int(cfg.generation.batch_size)
    proposers = [build_proposer(cfg, plan_, manifest_hash=planned.manifest_hash, context=context) for _ in range(batch)]
    null_budget = Budget(shape="sequence", max_nodes=1, max_depth=1)
    nulls = [NullProposer(budget=null_budget, manifest_hash=planned.manifest_hash) for _ in range(batch)]
    return Prepared(plan=plan_, context=context, proposers=proposers, null_proposers=nulls)


# --------------------------------------------------------------------------- gate


def gate(cfg: DictConfig, planned: Planned, loaded: Loaded, prepared: Prepared) -> dict:
    """The gates that run before anything is measured (a failure raises GateError), and the
    proposer's workload governance (e.g. datastore leakage)."""
    proposer = prepared.proposers[0]
    gates = run_gates(
        cfg,
        plan_=prepared.plan,
        backend=loaded.backend,
        proposer=proposer,
        items=loaded.items,
        eos=loaded.eos,
        round_cfg=planned.round_cfg,
        model_source=loaded.target.source,
    )
    governance = proposer.check_workload(loaded.items, allow_leakage=bool(cfg.get("allow_leakage", False)))
    if governance is not None:
        gates["workload_governance"] = governance
    return gates


# --------------------------------------------------------------------------- measure


def measure(cfg: DictConfig, planned: Planned, loaded: Loaded, prepared: Prepared) -> Measured:
    """Warm-up (excluded), then both arms batch by batch; at temperature 0 every prompt's two
    outputs must agree up to recorded near-ties."""
    plan_ = prepared.plan
    arms = Arms(
        target=loaded.backend,
        spec_proposers=prepared.proposers,
        null_proposers=prepared.null_proposers,
        spec_verifier=plan_.verifier,
        ar_verifier=plan_.baseline_verifier,
        policy=plan_.policy,
        prompts=[ids for _, ids in loaded.items],
        seed=int(cfg.seed),
        batch_size=int(cfg.generation.batch_size),
        max_new_tokens=int(cfg.generation.max_new_tokens),
        eos_token_ids=loaded.eos,
        round_cfg=planned.round_cfg,
        rng_factory=TorchRandomSource,
    )
    arms.warmup(int(cfg.generation.warmup_tokens))
    tokenizer = loaded.target.tokenizer
    per_prompt, outputs = [], []
    for i in tqdm(arms.run(), total=len(loaded.items), desc="prompts", unit="prompt", file=sys.stderr):
        prompt, ids = loaded.items[i]
        ar, spec = arms.result.request("ar", i), arms.result.request("spec", i)
        per_prompt.append({"prompt_id": prompt.prompt_id, "category": prompt.category, **arms.result.prompt_fields(i)})
        outputs.append(
            {
                "prompt_id": prompt.prompt_id,
                "category": prompt.category,
                "prompt_token_ids": ids,
                "ar_token_ids": ar.tokens,
                "spec_token_ids": spec.tokens,
                "ar_text": tokenizer.decode(ar.tokens) if tokenizer else None,
                "spec_text": tokenizer.decode(spec.tokens) if tokenizer else None,
            }
        )
    greedy = None
    if plan_.policy.greedy:
        greedy = greedy_equality(loaded.backend.model, outputs, max_fraction=float(cfg.gates.near_tie_max_fraction))
    return Measured(arms=arms.result, per_prompt=per_prompt, outputs=outputs, greedy=greedy)


# --------------------------------------------------------------------------- summarise


def summarise(
    cfg: DictConfig,
    planned: Planned,
    loaded: Loaded,
    prepared: Prepared,
    gates: dict,
    measured: Measured,
    *,
    job_seconds: float,
) -> dict:
    """The run record: decode metrics (defined once in :mod:`harness.engine.arms`), proposal-side
    state, the gates, the resolved config, the manifest and the hardware card."""
    plan_, proposer, backend = prepared.plan, prepared.proposers[0], loaded.backend
    slots = prepared.proposers
    metrics: dict[str, Any] = measured.arms.metrics()
    metrics.update(
        {
            "kv_bytes_per_token": backend.bytes_per_token,
            "temp_kv_bytes_formula": metrics["temp_kv_bytes_peak"],  # B (R - 1) rows x bytes per token
            "temp_kv_bytes_budget_formula": planned.temp_kv_budget_formula_bytes,
            "proposal_state_bytes": sum(p.state_bytes() for p in slots),
            "retrieval": merged_proposer_extras(slots),
            "greedy_identical": (not measured.greedy["near_ties"]) if measured.greedy is not None else None,
            "greedy_near_ties": measured.greedy["near_ties"] if measured.greedy is not None else None,
            "peak_rss_bytes": peak_rss_bytes(),
            "concurrent_jobs": int(cfg.concurrent_jobs),
            "torch_threads": torch.get_num_threads(),
            # artifacts trained on this CPU's token budget (heads, adapters, skip vectors) are labelled
            "cpu_budget_artifact": bool(getattr(proposer, "cpu_budget_artifact", False)),
            "job_seconds": job_seconds,
        }
    )
    if not plan_.verifier.exact:
        metrics["drift"] = heuristic_drift(cfg, plan_=plan_, backend=backend, proposer=proposer, items=loaded.items)
    metrics.update(plan_.extras.get("metrics", {}))
    if measured.greedy is not None:
        gates = {**gates, "greedy_equality": measured.greedy}
    mhash = planned.manifest_hash
    record = {
        "schema_version": RECORD_SCHEMA_VERSION,
        "run_id": f"{mhash}-{time.strftime('%Y%m%dT%H%M%S')}",
        "experiment": cfg.experiment,
        "sweep": cfg.sweep,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "exact": plan_.verifier.exact,
        "gates": gates,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "manifest": planned.manifest,
        "manifest_hash": mhash,
        "axes": {
            "model": cfg.model.name,
            "proposer": cfg.proposer.name,
            "topology": cfg.topology.name,
            "verifier": cfg.verifier.name,
            "temperature": float(cfg.generation.temperature),
            "batch_size": int(cfg.generation.batch_size),
            "workload": cfg.workload.name,
        },
        "metrics": metrics,
        "metric_notes": METRIC_NOTES,
        "per_prompt": measured.per_prompt,
        "hardware": hardware_card(cfg.model.device),
        "model_source": loaded.target.source,
        "draft_source": loaded.draft.source if loaded.draft is not None else None,
        "load_report": {
            "target": loaded.target.load_report,
            **({"draft": loaded.draft.load_report} if loaded.draft is not None else {}),
        },
        "artifacts": {
            **plan_.extras.get("artifacts", {}),
            **(
                {"proposer_artifact": proposer.artifact_manifest}
                if getattr(proposer, "artifact_manifest", None)
                else {}
            ),
        },
    }
    t_profile = plan_.extras.get("t_profile")
    if t_profile:
        record["t_profile"] = t_profile  # measured verify time t(n) (ms) this run used
    if "sequoia_predicted_time_per_token_ms" in metrics:
        metrics["sequoia_cost_model_error"] = cost_model_error(record)
    return record


# --------------------------------------------------------------------------- write


def write(record: dict, measured: Measured, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(run_dir / "outputs.jsonl", measured.outputs)
    write_json_atomic(run_dir / "record.json", record)


# --------------------------------------------------------------------------- trackers


def track(cfg: DictConfig, record: dict, run_dir: Path) -> None:
    """Trackers open after the gates passed and the record exists."""
    if cfg.tracking.name == "none":
        return

    group = cfg.sweep or cfg.experiment or "adhoc"
    tags = [f"{k}={v}" for k, v in record["axes"].items()]
    with open_run(
        record["config"],
        mode=cfg.tracking.mode,
        project=cfg.tracking.project,
        group=group,
        tags=tags,
        dir=str(run_dir),
        name=record["run_id"],
        entity=cfg.tracking.entity,
    ) as tracker:
        tracker.log_record(record, run_dir)
