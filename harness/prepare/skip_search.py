"""Draft & Verify (Zhang et al., 2024) skip-vector search: Bayesian optimisation with Optuna.

``z in {0, 1}^L`` (one entry per target layer, 1 = bypassed while drafting) minimises the measured
time per verified token on the dev split,

    f(z) = sum_r (T_draft + T_verify + T_state)(z) / sum_r N_verified(z),

measured by running the real round engine (``decode()``, greedy verification) with the
``layer_skip`` proposer on dev prompts: every stage of every round is in the numerator, so a
cheap draft that collapses acceptance and an expensive draft that repeats the target both lose.
Optuna's TPE sampler proposes ``z`` (seeded); a repeated ``z`` reuses its measurement. The
fastest trials (``finalists``) and the AR reference are then timed ``confirm`` more times,
interleaved, and each stands at the median of its timings: one timing of a vector varies by more
than the gaps between candidates. The seed fixes the warm start and TPE's first random draws;
later proposals follow the measured times, so the search is reproducible only as far as the
timings are. One untimed decode of each kind (autoregressive, layer-skip) runs before the first
timed one (:func:`warm_up`). The result is an artifact versioned against the target (``kind = "layer_skip"``):
the skip vector, its objective, the AR reference time per token, every trial and the finalists'
timings. Its ``search`` section records how many sweep jobs shared the machine while it was timed
(``concurrent_jobs``); a run beside fewer jobs than that (or alone, where the artifact records no
count) searches the cached vector again rather than reuse it
(:func:`~harness.prepare.profile.contention_problem`, the rule Sequoia's hardware profile follows).
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.files import artifact_lock
from harness.heads.artifacts import load_skip, missing, refuse_foreign, skip_artifact_path
from harness.heads.checkpoint import ArtifactError, cpu_budget_label, save_artifact, target_fingerprint
from harness.heads.recipes import SearchRecipe
from harness.prepare import Preparation
from harness.prepare.heads_data import byte_ids
from harness.prepare.profile import CONCURRENCY_FIELD, contention_problem, run_concurrency
from harness.prepare.trained import load_or_train, why_trained
from harness.proposers.base import NullProposer
from harness.proposers.selfspec import LayerSkipProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.timing import forward_setup, timing_host
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy
from harness.workloads.conversations import encode_prompt
from harness.workloads.prompts import load_workload

log = logging.getLogger("harness.heads")


def dev_prompts(recipe: SearchRecipe, tokenizer, vocab_size: int) -> list[list[int]]:
    """Token ids of the dev-split prompts (byte ids for a tokenizer-less tiny model)."""

    prompts = load_workload(name=recipe.workload, split=recipe.split, limit=recipe.prompts)
    out = []
    for p in prompts:
        if tokenizer is None:
            text = p.text if p.text is not None else " ".join(m["content"] for m in p.messages)
            ids = byte_ids(text, vocab_size=vocab_size, max_len=recipe.max_prompt_tokens)
        else:
            ids = encode_prompt(p, tokenizer, chat=recipe.chat)[-recipe.max_prompt_tokens :]
        out.append(ids or [3])
    return out


def measure(backend, skip: list[int] | None, prompts: list[list[int]], *, recipe: SearchRecipe) -> dict:
    """Time per verified token of one skip vector (``None``: the autoregressive reference)."""

    policy = SamplingPolicy()
    if skip is None:
        budget = Budget(shape="sequence", max_nodes=1, max_depth=1)
        proposer = NullProposer(budget=budget, manifest_hash="skip-search")
    else:
        budget = Budget(shape="sequence", max_nodes=recipe.depth, max_depth=recipe.depth)
        proposer = LayerSkipProposer(
            budget=budget,
            manifest_hash="skip-search",
            policy=policy,
            model=backend.model,
            checkpoint="search",
            skip=skip,
            gamma=recipe.gamma,
        )
    ms = tokens = rounds = accepted = 0
    for ids in prompts:
        res = decode(
            target=backend,
            proposer=proposer,
            verifier=get_verifier("greedy"),
            policy=policy,
            prompt_ids=ids,
            max_new_tokens=recipe.max_new_tokens,
            eos_token_ids=frozenset(),
            rng=TorchRandomSource(0),
            round_cfg=RoundConfig(max_nodes=budget.max_nodes, max_depth=budget.max_depth),
        )
        ms += res.decode_ms
        tokens += len(res.tokens)
        rounds += res.ledger.rounds
        accepted += res.ledger.accepted_tokens
    return {
        "skip": skip,
        "ms_per_token": ms / tokens if tokens else None,
        "tokens": tokens,
        "mean_committed_per_round": tokens / rounds if rounds else None,
        "mean_accepted_per_round": accepted / rounds if rounds else None,
    }


@torch.inference_mode()
def layer_influence(model, prompts: list[list[int]]) -> list[float]:
    """Per decoder layer, ``1 - cos(h_in, h_out)`` averaged over every dev-prompt token: how much the
    layer turns the residual stream (a layer that barely turns it is a cheap one to skip)."""
    totals: list[float] | None = None
    count = 0
    device = next(model.parameters()).device
    for ids in prompts:
        out = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
        hs = out.hidden_states  # embeddings, then each layer's output (the last one after the final norm)
        layers = len(hs) - 1
        per = []
        for i in range(layers):
            h_in, h_out = hs[i][0].float(), hs[i + 1][0].float()
            per.append(float((1 - torch.nn.functional.cosine_similarity(h_in, h_out, dim=-1)).sum()))
        totals = per if totals is None else [a + b for a, b in zip(totals, per)]
        count += len(ids)
    return [t / count for t in (totals or [])]


#: the other way out of a refused search artifact: naming the layers to skip
SKIP_INSTEAD = ", or give the layers to skip: proposer.skip=[...]"

#: warm-start trials: skip this many of the least influential layers (TPE explores from there)
WARM_SKIP_COUNTS = (2, 4, 6, 8)


def warm_up(backend, prompts: list[list[int]], *, recipe: SearchRecipe) -> None:
    """One untimed autoregressive decode of the first prompt and one with the layer-skip draft (the odd
    layers bypassed), before any timed decode: the costs of a first call (kernel builds,
    compilation, the allocator's growth) stay out of the AR reference and the first trial, which are
    timed once each where ``recipe.confirm`` is 0."""
    measure(backend, None, prompts[:1], recipe=recipe)
    layers = int(backend.model.config.num_hidden_layers)
    if layers > 1:  # the warm start's every-other-layer vector (a vector bypassing every layer drafts nothing)
        measure(backend, [i for i in range(layers) if i % 2], prompts[:1], recipe=recipe)


def search_skip(backend, prompts: list[list[int]], *, recipe: SearchRecipe, progress: bool = True) -> dict:
    """Optuna TPE over the skip vector. Returns the best trial, the AR reference and every trial.

    The study is warm-started with the vectors that skip the 2, 4, 6 and 8 least influential
    layers (:func:`layer_influence`) and every other layer; TPE's independent per-layer draws
    alone skip about half the layers, which on a small target drafts nothing usable."""
    import optuna  # imported here: 0.36 s at import, and only the search uses it

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    layers = int(backend.model.config.num_hidden_layers)
    warm_up(backend, prompts, recipe=recipe)
    ar = measure(backend, None, prompts, recipe=recipe)
    seen: dict[tuple[int, ...], dict] = {}
    # closed on every way out: a failure's one line is printed on the line the bar cleared
    with tqdm(
        total=recipe.trials, desc="layer-skip search", unit="trial", file=sys.stderr, disable=not progress, leave=False
    ) as bar:

        def objective(trial) -> float:
            skip = tuple(i for i in range(layers) if trial.suggest_int(f"skip_{i}", 0, 1))
            if len(skip) == layers:  # a draft of no decoder layer: not a vector a run accepts
                bar.update(1)
                raise optuna.TrialPruned("the vector bypasses every layer")
            if skip not in seen:
                seen[skip] = measure(backend, list(skip), prompts, recipe=recipe)
            bar.update(1)
            bar.set_postfix(best_ms=f"{min(v['ms_per_token'] for v in seen.values()):.2f}")
            return seen[skip]["ms_per_token"]

        study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=recipe.seed))
        influence = layer_influence(backend.model, prompts)
        order = sorted(range(layers), key=lambda i: influence[i])  # least influential first
        for k in WARM_SKIP_COUNTS:
            if k < layers:
                chosen = set(order[:k])
                study.enqueue_trial({f"skip_{i}": int(i in chosen) for i in range(layers)})
        study.enqueue_trial({f"skip_{i}": i % 2 for i in range(layers)})  # every other layer: a common start
        study.optimize(objective, n_trials=recipe.trials)
    if not seen:
        raise ValueError(f"every one of the {recipe.trials} trial(s) drew a vector bypassing every layer")
    finalists = sorted(seen, key=lambda k: seen[k]["ms_per_token"])[: recipe.finalists]
    confirmed = confirm_finalists(backend, prompts, {None: ar, **{k: seen[k] for k in finalists}}, recipe=recipe)
    ar = confirmed.pop(None)
    best = min(confirmed, key=lambda k: (confirmed[k]["ms_per_token"], finalists.index(k)))
    return {
        "skip": list(best),
        "best": confirmed[best],
        "ar": ar,
        "layer_influence": influence,
        "beats_ar": confirmed[best]["ms_per_token"] < ar["ms_per_token"],
        "trials": [{"skip": list(k), **{kk: vv for kk, vv in v.items() if kk != "skip"}} for k, v in seen.items()],
        "finalists": [
            {"skip": list(k), **{kk: vv for kk, vv in confirmed[k].items() if kk != "skip"}} for k in finalists
        ],
    }


def confirm_finalists(backend, prompts, first: dict, *, recipe: SearchRecipe) -> dict:
    """Each vector of ``first`` (``None``: the AR reference) timed ``recipe.confirm`` more times,
    the vectors interleaved in every pass so that a drift of the machine reaches them all alike.
    Returns each with ``ms_per_token`` the median of its timings (the first included) and
    ``timings`` listing them; the tokens and acceptance of a greedy decode do not change."""
    timings = {k: [v["ms_per_token"]] for k, v in first.items()}
    for _ in range(recipe.confirm):
        for k in first:
            timings[k].append(measure(backend, None if k is None else list(k), prompts, recipe=recipe)["ms_per_token"])
    return {k: {**v, "ms_per_token": statistics.median(timings[k]), "timings": timings[k]} for k, v in first.items()}


def ensure_skip(
    options: dict,
    *,
    backend,
    tokenizer,
    target_source: str,
    progress: bool = True,
    force: bool = False,
    prompts: list[list[int]] | None = None,
    concurrent_jobs: int = 1,
) -> tuple[list[int], dict]:
    """The skip vector to draft with: ``proposer.skip`` when given, else the search artifact (run
    the search when absent and ``auto_train``). ``proposer.artifact`` naming anything but an absent
    path or a layer-skip artifact is refused before anything is searched or written.

    ``concurrent_jobs``: how many jobs share the machine with this run. The cache's vector, chosen
    by timings, is searched again in its place when it was timed beside more jobs than that, or
    records no count and this run is alone (:func:`~harness.prepare.profile.contention_problem`);
    where ``proposer.auto_train=false`` forbids the search, the run is refused. A vector
    ``proposer.artifact`` names is used as given, with a note, as one searched on another host is."""
    if options.get("skip") is not None and not force:
        return load_skip(options, model=backend.model, tokenizer=tokenizer)
    if options.get("artifact"):
        refuse_foreign("layer_skip", options["artifact"], extra=SKIP_INSTEAD)
    model = backend.model
    rd, path = skip_artifact_path(options, model=model, tokenizer=tokenizer, prompts=prompts)
    purpose = "searching the layer-skip vector"

    def resolve(replacing: str | None) -> tuple[list[int], dict]:
        return load_or_train(
            path,
            load=lambda: load_skip({**options, "artifact": str(path)}, model=model, tokenizer=tokenizer),
            train=lambda: _search_absent(
                options,
                rd,
                path,
                backend=backend,
                tokenizer=tokenizer,
                target_source=target_source,
                progress=progress,
                force=force,
                prompts=prompts,
                concurrent_jobs=concurrent_jobs,
                replacing=replacing,
            ),
            purpose=purpose,
            force=force or replacing is not None,
        )

    if options.get("artifact") or force:
        if options.get("artifact") and not force:
            _note_contention(path, concurrent_jobs)
        return resolve(None)
    if skip_contention(path, concurrent_jobs) is None:
        return resolve(None)
    with artifact_lock(path, purpose=purpose):  # another job may have searched it again meanwhile
        return resolve(skip_contention(path, concurrent_jobs))


def skip_contention(path: Path, concurrent_jobs: int) -> str | None:
    """Why the layer-skip vector at ``path`` was not timed for a run beside ``concurrent_jobs`` jobs
    (:func:`~harness.prepare.profile.contention_problem` on its ``search.concurrent_jobs``), or None: it
    may be used, or there is none (or none readable: the load says why)."""
    try:
        manifest = json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("kind") != "layer_skip":
        return None
    return contention_problem((manifest.get("search") or {}).get(CONCURRENCY_FIELD), concurrent_jobs)


def _note_contention(path: Path, concurrent_jobs: int) -> None:
    why = skip_contention(path, concurrent_jobs)
    if why:
        print(
            f"harness: note: the layer-skip vector in {str(path)!r} is used as proposer.artifact gives it, but {why}: "
            "the fastest vector then may not be now (leave proposer.artifact unset to search it again)",
            file=sys.stderr,
        )


def _search_absent(
    options: dict,
    rd: dict,
    path: Path,
    *,
    backend,
    tokenizer,
    target_source: str,
    progress: bool,
    force: bool,
    prompts: list[list[int]] | None,
    concurrent_jobs: int = 1,
    replacing: str | None = None,
) -> tuple[list[int], dict]:
    """Search the vector into ``path`` (``replacing``: why the one there is searched again)."""
    model = backend.model
    target_hash = target_fingerprint(model, tokenizer)
    recipe = SearchRecipe(**dict(options.get("search") or {}))
    explicit = options.get("artifact")
    if not force and replacing is not None and not options.get("auto_train", True):
        raise ArtifactError(
            f"the layer-skip vector in {str(path)!r} does not serve this run: {replacing}; proposer.auto_train=false "
            "forbids searching it again (`harness train proposer=layer_skip` searches it alone, or let the run "
            f"search it: proposer.auto_train=true){SKIP_INSTEAD}"
        )
    if not force and (explicit or not options.get("auto_train", True)):
        raise missing("layer_skip", path, bool(explicit), extra=SKIP_INSTEAD)
    log.warning(
        "searching the layer-skip vector (%s)", why_trained(Path(path)) + (f": {replacing}" if replacing else "")
    )
    t0 = time.perf_counter()
    if prompts is None:
        prompts = dev_prompts(recipe, tokenizer, int(model.config.vocab_size))
    result = search_skip(backend, prompts, recipe=recipe, progress=progress)
    device = str(next(model.parameters()).device)
    manifest = {
        "kind": "layer_skip",
        "target_hash": target_hash,
        "target_source": target_source,
        "recipe": rd,
        "skip": result["skip"],
        "objective": result["best"],
        "ar_reference": result["ar"],
        "trials": result["trials"],
        "finalists": result["finalists"],
        "layer_influence": result["layer_influence"],
        "beats_ar": result["beats_ar"],
        "token_budget": recipe.trials * recipe.prompts * recipe.max_new_tokens,
        "search": {
            "seconds": time.perf_counter() - t0,
            "device": device,
            "device_name": timing_host(device)["device_name"],
            "threads": torch.get_num_threads(),
            CONCURRENCY_FIELD: int(concurrent_jobs),  # jobs sharing the machine while the vectors were timed
            **forward_setup(model),
            "sampler": "optuna TPESampler",
            "objective": "decode ms per committed token (greedy); finalists and AR reference: median of their timings",
        },
    }
    manifest["cpu_budget_artifact"] = cpu_budget_label(manifest)  # from the search's token budget, not the device
    if not result["beats_ar"]:
        log.warning(
            "no skip vector found beat the autoregressive reference (%.2f vs %.2f ms per token); the "
            "artifact keeps the best one and says so (beats_ar: false)",
            result["best"]["ms_per_token"],
            result["ar"]["ms_per_token"],
        )
    save_artifact(path, manifest=manifest)
    return load_skip({**options, "artifact": str(path)}, model=model, tokenizer=tokenizer)


def train_from_config(cfg, *, target, force: bool = False, progress: bool = True) -> dict:
    """`harness train proposer=layer_skip`: run (or load) the search for the configured target."""

    options = OmegaConf.to_container(cfg.proposer, resolve=True)
    backend = CausalLMBackend(target.model, device=torch.device(cfg.model.device))
    skip, m = ensure_skip(
        options,
        backend=backend,
        tokenizer=target.tokenizer,
        target_source=target.source,
        progress=progress,
        force=force,
        concurrent_jobs=run_concurrency(cfg),
    )
    _, path = skip_artifact_path(options, model=target.model, tokenizer=target.tokenizer)
    return {  # the fields every kind's summary has (path, kind, target_hash), then the search's own
        "path": str(path),
        "artifact_id": m.get("artifact_id"),
        "kind": m.get("kind"),
        "target_hash": m.get("target_hash"),
        "skip": skip,
        "beats_ar": m.get("beats_ar"),
        **{k: m.get(k) for k in ("objective", "ar_reference", "token_budget", "search", "recipe")},
        "cpu_budget_artifact": cpu_budget_label(m),
    }


def prepare_layer_skip(options: dict, context) -> Preparation:
    """Proposer preparer: the search artifact's path (searched first when absent); nothing when
    ``proposer.skip`` is given."""
    if options.get("skip") is not None:
        return Preparation()
    ensure_skip(
        options,
        backend=context.target_backend,
        tokenizer=context.tokenizer,
        target_source=context.model_source,
        concurrent_jobs=run_concurrency(getattr(context, "cfg", None)),
    )
    _, path = skip_artifact_path(options, model=context.target_backend.model, tokenizer=context.tokenizer)
    return Preparation(options={"artifact": str(path)})
