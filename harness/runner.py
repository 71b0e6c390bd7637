"""`harness run`: compose -> negotiate -> freeze manifest -> load -> gates -> measure -> record.

The Hydra entry point composes the config and calls :func:`run_job`; no logic lives in ``main``.
The autoregressive baseline and the speculative arm run on the same prompts with the same seeds,
interleaved (the order alternates per prompt), through the same round code and timers.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from harness import config as _config  # noqa: F401  (registers the schemas)
from harness.engine.build import BuildContext, Plan, build_proposer, plan, prepare
from harness.engine.decode import (
    DecodeResult,
    RoundConfig,
    check_temp_kv_budget,
    decode,
    greedy_divergence,
    top2_margin,
)
from harness.gates.stages import GateError
from harness.manifest import RECORD_SCHEMA_VERSION, freeze_manifest, manifest_extras, manifest_hash
from harness.measure.hardware import hardware_card, library_versions, peak_rss_bytes
from harness.measure.ledger import RoundLedger
from harness.proposers.base import Budget
from harness.proposers.prompt_lookup import NullProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.tracking.record import write_json_atomic, write_jsonl_atomic
from harness.workloads.prompts import encode_prompt, load_workload

log = logging.getLogger("harness.run")

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

#: a greedy divergence whose target top-2 logit margin is within this tolerance is a recorded
#: near-tie (CPU matrix kernels are not shape-invariant); anything larger fails the run.
NEAR_TIE_LOGIT_TOL = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 0.125, torch.float16: 0.03}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


def itl_samples(res: DecodeResult) -> list[float]:
    """Inter-token latency per emitted token: each round's duration split evenly over its tokens."""
    out, prev = [], 0.0
    for end, n in zip(res.round_end_ms, res.round_tokens):
        if n:
            out.extend([(end - prev) / n] * n)
        prev = end
    return out


def load_models(cfg: DictConfig):
    from harness.target.loading import load_model

    m = cfg.model
    target = load_model(
        name=m.name,
        name_or_path=m.name_or_path,
        dtype=m.dtype,
        device=m.device,
        seed=m.seed,
        attn_implementation=m.attn_implementation,
        tiny=OmegaConf.to_container(m.tiny),
        trust_remote_code=m.trust_remote_code,
    )
    draft = None
    d = draft_model_config(cfg)
    if d is not None:
        import transformers

        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # a truncated load lists every dropped layer
        try:
            draft = load_model(
                name=d.name,
                name_or_path=d.name_or_path,
                dtype=d.dtype,
                device=d.device,
                seed=d.seed,
                num_layers=d.num_layers,
                attn_implementation=m.attn_implementation,
                tiny=OmegaConf.to_container(d.tiny),
                trust_remote_code=d.trust_remote_code,
            )
        finally:
            transformers.logging.set_verbosity(verbosity)
        check_same_tokenizer(target, draft)
    return target, draft


def draft_model_config(cfg: DictConfig):
    """The separate draft model a run needs: ``proposer=draft_model``, or a merged tree with
    ``draft_model`` among ``proposer.sources``; None otherwise (nothing is loaded)."""
    if cfg.proposer.name == "draft_model":
        return cfg.proposer.model
    if cfg.proposer.name == "merged" and "draft_model" in (cfg.proposer.get("sources") or []):
        return cfg.proposer.draft_model.model
    return None


def check_same_tokenizer(target, draft) -> None:
    """0x0F: tokenizer(target) == tokenizer(parametric draft)."""
    from harness.workloads.datastore import tokenizer_fingerprint

    if target.model.config.vocab_size != draft.model.config.vocab_size:
        raise GateError(f"draft vocabulary {draft.model.config.vocab_size} != target {target.model.config.vocab_size}")
    if target.tokenizer is None and draft.tokenizer is None:
        return
    if (
        target.tokenizer is None
        or draft.tokenizer is None
        or (tokenizer_fingerprint(target.tokenizer) != tokenizer_fingerprint(draft.tokenizer))
    ):
        raise GateError("the draft model's tokenizer differs from the target's; a parametric draft must share it")


def encode_workload(cfg: DictConfig, tokenizer) -> list[tuple[object, list[int]]]:
    w = cfg.workload
    prompts = load_workload(name=w.name, split=w.split, limit=w.limit, path=w.path)
    if tokenizer is None:  # model=tiny: deterministic synthetic ids from the prompt text
        vocab = int(cfg.model.tiny.get("vocab_size", 96)) if cfg.model.tiny else 96
        out = []
        for p in prompts:
            text = p.text if p.text is not None else " ".join(m["content"] for m in p.messages)
            ids = [3 + (b % (vocab - 3)) for b in text.encode()[:96]]
            out.append((p, ids or [3]))
        return out
    return [(p, encode_prompt(p, tokenizer, chat=bool(w.chat))) for p in prompts]


def eos_ids(target) -> frozenset[int]:
    ids = set()
    eos = target.model.config.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    tok = target.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return frozenset(ids)


def run_arm(
    *,
    backend: CausalLMBackend,
    proposer,
    verifier,
    plan_: Plan,
    prompt_ids: list[int],
    seed: int,
    max_new_tokens: int,
    eos: frozenset[int],
    round_cfg: RoundConfig,
) -> DecodeResult:
    return decode(
        target=backend,
        proposer=proposer,
        verifier=verifier,
        policy=plan_.policy,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos,
        rng=TorchRandomSource(seed),
        round_cfg=round_cfg,
    )


def run_job(cfg: DictConfig, *, run_dir: Path | None = None) -> dict:
    """One job: everything `harness run` does. Returns the record (also written to run_dir)."""
    t_job = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    # 1. negotiation and budgets: before any model work
    plan_ = plan(cfg)
    from harness.target.loading import model_kv_bytes_per_token

    bpt = model_kv_bytes_per_token(cfg.model)
    # a batch of B requests holds up to B * max_nodes candidate rows at once
    formula_budget_bytes = check_temp_kv_budget(
        max_nodes=plan_.budget.max_nodes,
        bytes_per_token=bpt,
        budget_bytes=cfg.generation.temp_kv_budget_bytes,
        batch_size=int(cfg.generation.batch_size),
    )
    versions = library_versions()
    manifest = freeze_manifest(cfg, versions=versions, extra=manifest_extras(cfg))
    mhash = manifest_hash(manifest)
    run_dir = Path(run_dir or cfg.output_dir or os.getcwd())

    # 2. models, workload
    target, draft = load_models(cfg)
    device = torch.device(cfg.model.device)
    backend = CausalLMBackend(target.model, device=device)
    if backend.bytes_per_token != bpt:
        raise GateError(f"KV bytes per token {backend.bytes_per_token} != config-derived {bpt}")
    draft_backend = CausalLMBackend(draft.model, device=device) if draft is not None else None
    items = encode_workload(cfg, target.tokenizer)
    context = BuildContext(
        cfg=cfg,
        target_backend=backend,
        tokenizer=target.tokenizer,
        draft_backend=draft_backend,
        items=items,
        model_source=target.source,
    )
    plan_ = prepare(cfg, plan_, context)  # topology stages that need the models (e.g. Sequoia calibration)
    proposer = build_proposer(cfg, plan_, manifest_hash=mhash, context=context)
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash=mhash)
    round_cfg = RoundConfig(
        max_nodes=plan_.budget.max_nodes,
        max_depth=plan_.budget.max_depth,
        temp_kv_budget_bytes=cfg.generation.temp_kv_budget_bytes,
    )
    eos = eos_ids(target)

    # 3. gates: nothing is logged unless the configured round passes them
    from harness.gates.stages import run_gates

    gates = run_gates(
        cfg,
        plan_=plan_,
        backend=backend,
        proposer=proposer,
        items=items,
        eos=eos,
        round_cfg=round_cfg,
        model_source=target.source,
    )
    governance = proposer.check_workload(items, allow_leakage=bool(cfg.get("allow_leakage", False)))
    if governance is not None:
        gates["workload_governance"] = governance

    # 4. measure: warm-up (excluded), then both arms per prompt (per batch of B prompts when
    # generation.batch_size = B > 1: one target forward per round for the batch), interleaved
    max_new = int(cfg.generation.max_new_tokens)
    batch_size = int(cfg.generation.batch_size)
    warm_ids = items[0][1]
    batched = None
    if batch_size > 1:
        from harness.engine.batched import BatchedArms
        from harness.target.batched import BatchedBackend

        slots = [proposer] + [
            build_proposer(cfg, plan_, manifest_hash=mhash, context=context) for _ in range(batch_size - 1)
        ]  # proposers keep per-request state
        nulls = [NullProposer(budget=null.budget, manifest_hash=mhash) for _ in range(batch_size)]
        batched = BatchedArms(
            target=BatchedBackend(target.model, device=device),
            spec_proposers=slots,
            null_proposers=nulls,
            spec_verifier=plan_.verifier,
            ar_verifier=plan_.baseline_verifier,
            policy=plan_.policy,
            prompts=[ids for _, ids in items],
            seed=int(cfg.seed),
            batch_size=batch_size,
            max_new_tokens=max_new,
            eos_token_ids=eos,
            round_cfg=round_cfg,
            rng_factory=TorchRandomSource,
        )
        batched.warmup(int(cfg.generation.warmup_tokens))
        batched_pairs = batched.pairs()
    else:
        for arm_proposer, arm_verifier in ((null, plan_.baseline_verifier), (proposer, plan_.verifier)):
            run_arm(
                backend=backend,
                proposer=arm_proposer,
                verifier=arm_verifier,
                plan_=plan_,
                prompt_ids=warm_ids,
                seed=cfg.seed,
                max_new_tokens=int(cfg.generation.warmup_tokens),
                eos=eos,
                round_cfg=round_cfg,
            )
    from tqdm import tqdm

    spec_ledger, ar_ledger = RoundLedger(), RoundLedger()
    per_prompt, outputs = [], []
    itl, ar_itl = [], []
    near_ties = []
    sources: dict[str, int] = {}
    tol = NEAR_TIE_LOGIT_TOL.get(backend.dtype, 1e-3)
    for i, (prompt, ids) in enumerate(tqdm(items, desc="prompts", unit="prompt", file=sys.stderr)):
        seed = int(cfg.seed) * 1_000_003 + i
        arms = {}
        order = ("ar", "spec") if i % 2 == 0 else ("spec", "ar")
        for arm in order if batched is None else ():
            if arm == "ar":
                arms[arm] = run_arm(
                    backend=backend,
                    proposer=null,
                    verifier=plan_.baseline_verifier,
                    plan_=plan_,
                    prompt_ids=ids,
                    seed=seed,
                    max_new_tokens=max_new,
                    eos=eos,
                    round_cfg=round_cfg,
                )
            else:
                arms[arm] = run_arm(
                    backend=backend,
                    proposer=proposer,
                    verifier=plan_.verifier,
                    plan_=plan_,
                    prompt_ids=ids,
                    seed=seed,
                    max_new_tokens=max_new,
                    eos=eos,
                    round_cfg=round_cfg,
                )
        ar, spec = (arms["ar"], arms["spec"]) if batched is None else next(batched_pairs)  # same seed per request
        spec_ledger.merge(spec.ledger)
        ar_ledger.merge(ar.ledger)
        itl.extend(itl_samples(spec))
        ar_itl.extend(itl_samples(ar))
        for k, v in spec.sources.items():
            sources[k] = sources.get(k, 0) + v
        if plan_.policy.greedy:
            pos = greedy_divergence(ar.tokens, spec.tokens)
            if pos is not None:
                margin = top2_margin(target.model, ids + ar.tokens[:pos])
                entry = {"prompt_id": prompt.prompt_id, "position": pos, "top2_margin": margin, "tolerance": tol}
                if margin > tol:
                    raise GateError(
                        f"greedy equality failed on prompt {prompt.prompt_id!r} at generated position {pos}: "
                        f"AR {ar.tokens[pos : pos + 4]} vs speculative {spec.tokens[pos : pos + 4]}; target top-2 "
                        f"margin {margin:.3g} exceeds the {backend.dtype} near-tie tolerance {tol}"
                    )
                near_ties.append(entry)
        per_prompt.append(
            {
                "prompt_id": prompt.prompt_id,
                "category": prompt.category,
                "spec_decode_ms": spec.decode_ms,
                "spec_tokens": len(spec.tokens),
                "ar_decode_ms": ar.decode_ms,
                "ar_tokens": len(ar.tokens),
                "spec_ttft_ms": spec.ttft_ms,
                "ar_ttft_ms": ar.ttft_ms,
                "spec_rounds": spec.ledger.rounds,
                **(batched.prompt_fields(i) if batched is not None else {}),
            }
        )
        outputs.append(
            {
                "prompt_id": prompt.prompt_id,
                "category": prompt.category,
                "prompt_token_ids": ids,
                "ar_token_ids": ar.tokens,
                "spec_token_ids": spec.tokens,
                "ar_text": target.tokenizer.decode(ar.tokens) if target.tokenizer else None,
                "spec_text": target.tokenizer.decode(spec.tokens) if target.tokenizer else None,
            }
        )

    spec_ms = sum(p["spec_decode_ms"] for p in per_prompt)
    ar_ms = sum(p["ar_decode_ms"] for p in per_prompt)
    spec_tok = sum(p["spec_tokens"] for p in per_prompt)
    ar_tok = sum(p["ar_tokens"] for p in per_prompt)
    tpt = spec_ms / spec_tok if spec_tok else None
    ar_tpt = ar_ms / ar_tok if ar_tok else None
    summary = spec_ledger.summary()
    cost = summary["round_cost_ms"]
    round_total = sum(cost.values())
    peak_rows = summary["temp_kv_bytes_peak"] // backend.bytes_per_token if backend.bytes_per_token else 0
    metrics = {
        "time_per_committed_token_ms": tpt,
        "ar_time_per_token_ms": ar_tpt,
        "speedup": (ar_tpt / tpt) if (tpt and ar_tpt) else None,
        "ttft_ms": sum(p["spec_ttft_ms"] for p in per_prompt) / len(per_prompt),
        "ar_ttft_ms": sum(p["ar_ttft_ms"] for p in per_prompt) / len(per_prompt),
        "committed_tokens": spec_tok,
        "ar_tokens": ar_tok,
        **{
            k: summary[k]
            for k in (
                "rounds",
                "mean_committed_per_round",
                "mean_accepted_per_round",
                "acceptance_by_depth",
                "reach_by_depth",
                "accepted_length_hist",
                "first_child_coverage",
                "fallback_rate",
                "mean_candidate_rows",
                "round_cost_ms",
            )
        },
        "round_cost_non_verify_share": (1.0 - cost["target_verify"] / round_total) if round_total else None,
        "ar_round_cost_ms": ar_ledger.summary()["round_cost_ms"],
        "temp_kv_bytes_peak": summary["temp_kv_bytes_peak"],
        "temp_kv_bytes_formula": peak_rows * backend.bytes_per_token,
        "temp_kv_bytes_budget_formula": formula_budget_bytes,
        "kv_bytes_per_token": backend.bytes_per_token,
        "proposal_state_bytes": proposer.state_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
        "greedy_identical": (not near_ties) if plan_.policy.greedy else None,
        "greedy_near_ties": near_ties if plan_.policy.greedy else None,
        "throughput_tokens_per_s": spec_tok / (spec_ms / 1e3) if spec_ms else None,
        "ar_throughput_tokens_per_s": ar_tok / (ar_ms / 1e3) if ar_ms else None,
        "itl_ms_p50": _percentile(itl, 0.5),
        "itl_ms_p95": _percentile(itl, 0.95),
        "ar_itl_ms_p50": _percentile(ar_itl, 0.5),
        "ar_itl_ms_p95": _percentile(ar_itl, 0.95),
        "accepted_by_source": sources,
        "retrieval": dict(proposer.stats.extras),
        "concurrent_jobs": int(cfg.concurrent_jobs),
        "torch_threads": torch.get_num_threads(),
        # artifacts trained on this CPU's token budget (heads, adapters, skip vectors) are labelled
        "cpu_budget_artifact": bool(getattr(proposer, "cpu_budget_artifact", False)),
        "job_seconds": time.perf_counter() - t_job,
    }
    if not plan_.verifier.exact:
        from harness.gates.drift import heuristic_drift

        metrics["drift"] = heuristic_drift(cfg, plan_=plan_, backend=backend, proposer=proposer, items=items)
    if batched is not None:  # batch-level throughput, per-request times, batch rounds, temporary KV per batch
        metrics.update(batched.metrics(bytes_per_token=backend.bytes_per_token, max_nodes=plan_.budget.max_nodes))
    metrics.update(plan_.extras.get("metrics", {}))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    record = {
        "schema_version": RECORD_SCHEMA_VERSION,
        "run_id": f"{mhash}-{time.strftime('%Y%m%dT%H%M%S')}",
        "experiment": cfg.experiment,
        "sweep": cfg.sweep,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "exact": plan_.verifier.exact,
        "gates": gates,
        "config": resolved,
        "manifest": manifest,
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
        "metric_notes": {
            "mean_committed_per_round": "bonus/correction token included",
            "mean_accepted_per_round": "accepted candidate tokens only (bonus excluded)",
            "speedup": "AR decode time per token / speculative decode time per committed token, same prompts",
            "itl_ms": "each round's duration split evenly over the tokens it emitted",
            "temp_kv_bytes_peak": (
                "bytes the verify forward added to the cache for candidate rows (pending row excluded)"
            ),
        },
        "per_prompt": per_prompt,
        "hardware": hardware_card(cfg.model.device),
        "model_source": target.source,
        "artifacts": {
            **plan_.extras.get("artifacts", {}),
            **(
                {"proposer_artifact": proposer.artifact_manifest}
                if getattr(proposer, "artifact_manifest", None)
                else {}
            ),
        },
    }
    t_profile = getattr(proposer, "t_profile", None) or plan_.extras.get("t_profile")
    if t_profile:
        record["t_profile"] = t_profile  # measured verify time t(n) (ms) this run used
    if "sequoia_predicted_time_per_token_ms" in metrics:
        from harness.topology.sequoia_artifact import cost_model_error

        metrics["sequoia_cost_model_error"] = cost_model_error(record)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(run_dir / "outputs.jsonl", outputs)
    write_json_atomic(run_dir / "record.json", record)
    return record


def track(cfg: DictConfig, record: dict, run_dir: Path) -> None:
    """Trackers open after the gates passed and the record exists."""
    if cfg.tracking.name == "none":
        return
    from harness.tracking.wandb_tracker import open_run

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


def main(argv: list[str] | None = None) -> int:
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    status = {"code": 0}

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _entry(cfg: DictConfig) -> dict | None:
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode.name == "MULTIRUN":  # skip finished jobs; a failing job never stops the sweep
            from harness.sweep import run_sweep_job

            job = run_sweep_job(cfg, hydra_cfg=hydra_cfg)
            if job["status"] == "failed":
                status["code"] = 1  # seen here when the launcher runs jobs in this process
            return job
        run_dir = Path(cfg.output_dir or hydra_cfg.runtime.output_dir)
        try:
            record = run_job(cfg, run_dir=run_dir)
        except (GateError, ValueError) as exc:
            print(f"harness run: refused: {exc}", file=sys.stderr)
            status["code"] = 2
            return
        track(cfg, record, run_dir)
        m = record["metrics"]
        print(
            json.dumps(
                {
                    "record": str(run_dir / "record.json"),
                    "speedup": m["speedup"],
                    "time_per_committed_token_ms": m["time_per_committed_token_ms"],
                    "ar_time_per_token_ms": m["ar_time_per_token_ms"],
                    "mean_committed_per_round": m["mean_committed_per_round"],
                    "greedy_identical": m["greedy_identical"],
                },
                indent=2,
            )
        )

    old = sys.argv
    sys.argv = ["harness run"] + argv
    try:
        _entry()
    finally:
        sys.argv = old
    return status["code"]
