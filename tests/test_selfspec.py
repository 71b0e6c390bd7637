"""Self-speculation: early exit with a trained adapter (Kangaroo) and layer skipping with a
searched skip vector (Draft & Verify) on a 4-layer tiny model: greedy equality, the confidence
stop, the threshold loop, the self-draft state contract, artifacts refused against another target."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import round_of_one

from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.heads.artifacts import skip_artifact_path
from harness.heads.checkpoint import ArtifactError, target_fingerprint
from harness.heads.partial import PartialPath, ProvisionalKV, causal_rows_mask
from harness.heads.recipes import SearchRecipe
from harness.prepare.early_exit import ensure_adapter
from harness.prepare.skip_search import ensure_skip, layer_influence, search_skip
from harness.prepare.trained import Target
from harness.proposers.base import NullProposer
from harness.proposers.selfspec import EarlyExitProposer, LayerSkipProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy

GREEDY = SamplingPolicy()
CHAIN = Budget(shape="sequence", max_nodes=4, max_depth=4)
EXIT_OPTS = {
    "exit_layer": 1,
    "data": {"source": "inline", "token_budget": 1200, "held_out_tokens": 240, "max_len": 40},
    "train": {"epochs": 3, "lr": 3e-3},
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import os

    old = os.environ.get("HARNESS_CACHE")
    os.environ["HARNESS_CACHE"] = str(tmp_path_factory.mktemp("selfspec_cache"))
    model = build_tiny_model(seed=1, num_layers=4)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        docs = model.generate(
            torch.randint(3, 96, (36, 3), generator=gen),
            do_sample=False,
            max_new_tokens=37,
            min_new_tokens=37,
            pad_token_id=0,
        ).tolist()
    art = ensure_adapter(EXIT_OPTS, Target(model, None, "tiny4"), documents=(docs[:30], docs[30:]), progress=False)
    yield {"model": model, "backend": CausalLMBackend(model), "docs": docs, "adapter": art}
    if old is None:
        os.environ.pop("HARNESS_CACHE", None)
    else:
        os.environ["HARNESS_CACHE"] = old


def test_an_early_exit_adapter_trains_for_a_bfloat16_target(env):
    """The adapter takes the target's dtype and device; the teacher's rows run on its LM head in it."""
    model = build_tiny_model(seed=1, num_layers=4, dtype=torch.bfloat16)
    docs = env["docs"]
    art = ensure_adapter(EXIT_OPTS, Target(model, None, "tiny4 bf16"), documents=(docs[:30], docs[30:]), progress=False)
    assert all(p.dtype == torch.bfloat16 for p in art.adapter.parameters())
    held = art.manifest["held_out"]
    assert 0.0 <= held["top1_agreement"] <= 1.0, held


def run(env, proposer, *, verifier="greedy", prompt, new=30, policy=GREEDY, seed=0, capture=None):
    rounds = []
    b = proposer.budget

    def on_round(**kw):
        rounds.append(round_of_one(kw))
        if capture is not None and kw["finished"]:  # the target's cache as the request leaves the batch
            capture["seq"] = copy.deepcopy(kw["state"])

    res = decode(
        target=env["backend"],
        proposer=proposer,
        verifier=get_verifier(verifier),
        policy=policy,
        prompt_ids=prompt,
        max_new_tokens=new,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(seed),
        round_cfg=RoundConfig(max_nodes=b.max_nodes, max_depth=b.max_depth),
        on_round=on_round,
    )
    return res, rounds


def autoregressive(env, prompt, new=30):
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    return run(env, null, prompt=prompt, new=new)[0].tokens


def early_exit(env, eta=0.0, sampling="beam", policy=GREEDY):
    art = env["adapter"]
    return EarlyExitProposer(
        budget=CHAIN,
        manifest_hash="h",
        policy=policy,
        model=env["model"],
        checkpoint=target_fingerprint(env["model"]),
        adapter=art.adapter,
        exit_layer=1,
        eta=eta,
        sampling=sampling,
        artifact_manifest=art.manifest,
    )


def layer_skip(env, skip, **kw):
    return LayerSkipProposer(
        budget=CHAIN,
        manifest_hash="h",
        policy=kw.pop("policy", GREEDY),
        model=env["model"],
        checkpoint=target_fingerprint(env["model"]),
        skip=skip,
        **kw,
    )


# ---------------------------------------------------------------------------------------------- partial path


def test_partial_path_over_every_layer_is_the_target(env):
    m = env["model"]
    ids = [5, 6, 7, 8, 9, 10, 11]
    with torch.inference_mode():
        full = m(input_ids=torch.tensor([ids])).logits[0]
        path = PartialPath(m, range(4))
        kv = ProvisionalKV(checkpoint="c", boundary="all", dtype="float32")
        h1 = path.run(path.embed(ids[:5]), range(5), causal_rows_mask(0, 5), kv)
        h2 = path.run(path.embed(ids[5:]), range(5, 7), causal_rows_mask(5, 2), kv)
        logits = m.lm_head(m.model.norm(torch.cat([h1, h2], dim=1)))[0]
    assert (logits - full).abs().max() < 1e-5
    assert sorted(kv.keys) == [0, 1, 2, 3] and kv.keys[0].shape[-2] == 7


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("verifier", ["greedy", "membership"])
@pytest.mark.parametrize(
    "make",
    [
        lambda e: early_exit(e, eta=0.0),
        lambda e: layer_skip(e, [1, 2], gamma=0.0),
        lambda e: layer_skip(e, [0, 3], gamma=0.05, epsilon=0.05),
    ],
    ids=["early_exit", "skip12", "skip03_adaptive"],
)
def test_greedy_equality(env, make, verifier):
    prompt = env["docs"][33][:6]
    expected = autoregressive(env, prompt)
    p = make(env)
    res, rounds = run(env, p, verifier=verifier, prompt=prompt)
    assert res.tokens == expected
    assert p.stats.extras["drafted"] > 0


def test_early_exit_drafts_are_accepted(env):
    prompt = env["docs"][34][:6]
    p = early_exit(env, eta=0.0)
    res, rounds = run(env, p, prompt=prompt)
    assert res.tokens == autoregressive(env, prompt)
    assert max(len(r["selection"].accepted_rows) for r in rounds) >= 2 and len(rounds) < len(res.tokens)


def test_skipping_nothing_drafts_the_target_itself(env):
    """z = 0: the draft path is the full target, so every drafted token is accepted (the
    agreement end of Draft & Verify's trade-off)."""
    prompt = env["docs"][35][:6]
    p = layer_skip(env, [], gamma=0.0, adaptive=False)
    res, rounds = run(env, p, prompt=prompt)
    assert res.tokens == autoregressive(env, prompt)
    for r in rounds[:-1]:
        assert len(r["selection"].accepted_rows) == 4 == r["tree"].num_rows


def test_a_round_with_one_token_left_runs_no_draft_layer(env):
    """Skipping nothing, every round commits the whole chain and its bonus token; with 6 tokens the
    second round has one left, which it commits itself: the draft runs no layer for it (it fed the
    committed tokens and drafted a token the round could not use)."""
    prompt = env["docs"][32][:6]
    p = layer_skip(env, [], gamma=0.0, adaptive=False)
    extends = []
    extend = p._extend
    propose = p.propose

    def counted_extend(*args, **kwargs):
        if extends:  # the prompt's forward at the request's start is prefill, not a round's
            extends[-1] += 1
        return extend(*args, **kwargs)

    def counted_propose(committed, rng):
        extends.append(0)
        return propose(committed, rng)

    p._extend, p.propose = counted_extend, counted_propose
    res, rounds = run(env, p, prompt=prompt, new=6)
    assert res.tokens == autoregressive(env, prompt, new=6)
    assert [len(r["emitted"]) for r in rounds] == [5, 1]
    assert extends == [CHAIN.max_depth, 0]  # the feed and 3 more draft tokens; then nothing


@pytest.mark.parametrize(
    "make",
    [lambda e: early_exit(e, eta=0.0), lambda e: layer_skip(e, [1], gamma=0.0, adaptive=False)],
    ids=["early_exit", "layer_skip"],
)
def test_the_lm_head_runs_only_on_the_rows_whose_logits_are_read(env, make):
    """The prompt's rows at start() are only cached (no LM head); each draft forward of a round
    (the feed of the committed tokens, then one per drafted token) reads the last row's logits
    only, so the LM head runs on that one row, however many rows the forward appends."""
    prompt = env["docs"][33][:12]
    p = make(env)
    head = p.lm_head
    assert head is env["model"].lm_head  # the target's own LM head: count only inside the proposer
    calls: dict[str, list[int]] = {"start": [], "propose": []}
    fed: list[int] = []  # rows each draft forward of a round appends
    phase = [None]
    start, propose, extend, forward = p.start, p.propose, p._extend, head.forward

    def counted(x):
        if phase[0] is not None:
            calls[phase[0]].append(x.shape[:-1].numel())
        return forward(x)

    def in_phase(name, fn):
        def call(*args):
            phase[0] = name
            try:
                return fn(*args)
            finally:
                phase[0] = None

        return call

    def counted_extend(ids, at, **kw):
        if phase[0] == "propose":
            fed.append(len(ids))
        return extend(ids, at, **kw)

    head.forward = counted
    p.start, p.propose, p._extend = in_phase("start", start), in_phase("propose", propose), counted_extend
    try:
        res, rounds = run(env, p, prompt=prompt, new=20)
        assert res.tokens == autoregressive(env, prompt, new=20)
        assert calls["start"] == []  # 11 prompt rows cached, no logits computed
        extras = p.stats.extras
        assert extras["drafted"] > 0 and len(fed) == extras["draft_forwards"] - 1  # all but start()'s
        assert calls["propose"] == [1] * len(fed)  # one row of logits per forward, read by the round
        # a round whose committed tokens are 7 past the cached rows feeds them in one forward: one row of logits
        fed.clear()
        calls["propose"].clear()
        p.start(prompt[:6])
        result = p.propose(prompt, TorchRandomSource(0))
        assert calls["start"] == [] and fed == [7, 1, 1, 1] and len(result.nodes) == 4
        assert calls["propose"] == [1, 1, 1, 1]
    finally:
        del head.forward


@pytest.mark.parametrize(
    "make,verifier",
    [
        (lambda e, pol: early_exit(e, eta=0.0, sampling="iid", policy=pol), "rejection"),
        (lambda e, pol: layer_skip(e, [1], sampling="iid", policy=pol, gamma=0.0), "specinfer"),
    ],
    ids=["early_exit", "layer_skip"],
)
def test_sampled_chains_carry_q(env, make, verifier):
    policy = SamplingPolicy(temperature=0.9)
    prompt = env["docs"][31][:6]
    p = make(env, policy)
    p.start(prompt)
    result = p.propose(prompt, TorchRandomSource(1))
    assert result.probability_semantics == "normalized_conditional" and result.sampling_relation == "iid"
    assert result.q_dists.shape[0] == len(result.nodes) == 4
    for i, n in enumerate(result.nodes):
        assert n.parent == i - 1 and n.q == pytest.approx(float(result.q_dists[i, n.token_id]))
    res, _ = run(env, make(env, policy), verifier=verifier, prompt=prompt, policy=policy)
    assert len(res.tokens) == 30


# ---------------------------------------------------------------------------------------------- stopping rules


def test_confidence_stop_eta(env):
    """Kangaroo's second exit: no draft token whose top-1 confidence is <= eta."""
    prompt = env["docs"][32][:6]
    p = early_exit(env, eta=0.0)
    p.start(prompt)
    with torch.inference_mode():
        first = p._forward([prompt[-1]], [len(prompt) - 1], causal_rows_mask(len(p.kv), 1))[-1]
    conf = float(torch.softmax(first.float(), -1).max())
    for eta, drafted in ((conf - 1e-4, True), (conf, False)):  # exit when max_v M_s <= eta
        q = early_exit(env, eta=eta)
        q.start(prompt)
        result = q.propose(prompt, TorchRandomSource(0))
        assert (len(result.nodes) > 0) == drafted, (eta, conf)
        if not drafted:
            assert q.stats.extras["confidence_stops"] == 1


def test_threshold_loop_toy_numbers():
    """Draft & Verify: ema = b1 ema + (1 - b1) rate; candidate = gamma +- eps; gamma = b2 gamma + (1 - b2) candidate."""
    p = LayerSkipProposer(
        budget=CHAIN,
        manifest_hash="h",
        policy=GREEDY,
        model=build_tiny_model(seed=0),
        checkpoint="c",
        skip=[1],
        gamma=0.6,
        beta1=0.5,
        beta2=0.9,
        epsilon=0.01,
        target_acceptance=0.7,
    )
    p.observe_round(4, 1)  # rate 0.25, ema 0.25 <= 0.7: raise
    assert p.acceptance_ema == pytest.approx(0.25) and p.gamma == pytest.approx(0.9 * 0.6 + 0.1 * 0.61)
    g = p.gamma
    p.observe_round(4, 4)  # ema 0.625 <= 0.7: raise
    assert p.acceptance_ema == pytest.approx(0.625) and p.gamma == pytest.approx(0.9 * g + 0.1 * (g + 0.01))
    g = p.gamma
    p.observe_round(4, 4)  # ema 0.8125 > 0.7: lower
    assert p.acceptance_ema == pytest.approx(0.8125) and p.gamma == pytest.approx(0.9 * g + 0.1 * (g - 0.01))
    g = p.gamma
    p.observe_round(0, 0)  # nothing drafted: nothing rejected, counts as acceptance 1 (lowers gamma)
    assert p.gamma < g


@pytest.mark.parametrize(
    "overrides,line",
    [
        # a top-1 probability is never above 1: every round would pay a draft forward and draft nothing
        (
            ["proposer.threshold.gamma=1.0", "proposer.threshold.adaptive=false"],
            "proposer.threshold.gamma=1.0 is out of range: it must be in [0, 1)",
        ),
        (["proposer.search.gamma=1.0"], "proposer.search.gamma=1.0 is out of range: it must be in [0, 1)"),
        # the EMA is never above 1 (gamma only rises) nor, once a draft is accepted, at or below 0 (only falls)
        (
            ["proposer.threshold.target_acceptance=1.0"],
            "proposer.threshold.target_acceptance=1.0 is out of range: it must be in (0, 1)",
        ),
        (
            ["proposer.threshold.target_acceptance=0"],
            "proposer.threshold.target_acceptance=0.0 is out of range: it must be in (0, 1)",
        ),
        # each round moves gamma by (1 - beta2) * epsilon: 0 with beta2=1 or epsilon=0
        (["proposer.threshold.beta2=1.0"], "proposer.threshold.beta2=1.0 is out of range: it must be in [0, 1)"),
        (["proposer.threshold.epsilon=0"], "proposer.threshold.epsilon=0.0 is out of range: it must be in (0, 1]"),
        # beta1=1 keeps the EMA at the first round's rate: gamma moves one way for good
        (["proposer.threshold.beta1=1.0"], "proposer.threshold.beta1=1.0 is out of range: it must be in [0, 1)"),
    ],
    ids=["gamma", "search_gamma", "target_acceptance_1", "target_acceptance_0", "beta2", "epsilon", "beta1"],
)
def test_a_threshold_that_stops_drafting_or_freezes_the_loop_is_refused_in_one_line(overrides, line):
    """Refused by the config's declared ranges, before any model work; the proposer refuses the
    same values when built directly (an artifact's threshold options reach it past the schema)."""
    from harness.config import compose
    from harness.contracts import ConfigError
    from harness.engine.build import plan

    with pytest.raises(ConfigError) as info:
        plan(compose(["model=tiny", "proposer=layer_skip", "topology=sequence", *overrides]))
    assert str(info.value) == line
    key, value = overrides[0].split("=")
    if key.startswith("proposer.threshold."):
        name = key.rsplit(".", 1)[1]
        with pytest.raises(ValueError, match=rf"^proposer\.threshold\.{name} must be in .*; got {float(value)}$"):
            LayerSkipProposer(
                budget=CHAIN,
                manifest_hash="h",
                policy=GREEDY,
                model=build_tiny_model(seed=0),
                checkpoint="c",
                skip=[1],
                **{name: float(value)},
            )


def test_threshold_values_at_the_edge_of_their_ranges_are_accepted_and_the_loop_moves_both_ways():
    from harness.config import compose
    from harness.engine.build import plan

    edges = {"gamma": 0.0, "beta1": 0.0, "beta2": 0.0, "epsilon": 1.0, "target_acceptance": 0.999}
    plan(
        compose(
            ["model=tiny", "proposer=layer_skip", "topology=sequence", "proposer.search.gamma=0.999"]
            + [f"proposer.threshold.{k}={v}" for k, v in edges.items()]
        )
    )
    p = LayerSkipProposer(
        budget=CHAIN,
        manifest_hash="h",
        policy=GREEDY,
        model=build_tiny_model(seed=0),
        checkpoint="c",
        skip=[1],
        **edges,
    )
    p.observe_round(4, 0)  # ema 0 <= 0.999: gamma rises (by (1 - beta2) * epsilon, clamped to 1)
    assert p.gamma == 1.0
    p.observe_round(0, 0)  # nothing drafted counts as acceptance 1 > 0.999: gamma falls
    assert p.gamma == 0.0


# ------------------------------------------------------------------------ self-draft state contract


def test_skipped_path_state_is_never_target_kv(env):
    """The target's cache after a layer-skip run equals a plain prefill of the same tokens: no
    skipped-path row was published. The draft's own cache holds only the layers it ran."""
    prompt = env["docs"][33][:6]
    p = layer_skip(env, [1, 2], gamma=0.0)
    cap = {}
    res, _ = run(env, p, prompt=prompt, new=20, capture=cap)
    seq = cap["seq"]
    n = len(prompt) + len(res.tokens) - 1  # the cache may hold accepted tokens cut by max_new_tokens
    assert seq.cached_tokens[:n] == prompt + res.tokens[:-1]
    ref = env["backend"].prefill_one(seq.cached_tokens + [0])  # a plain prefill of exactly the cached tokens
    assert seq.cached_tokens == ref.cached_tokens
    for got, want in zip(seq.cache.layers, ref.cache.layers):
        assert torch.allclose(got.keys, want.keys, atol=1e-5) and torch.allclose(got.values, want.values, atol=1e-5)
    assert p.kv is not seq.cache
    p.start(prompt)
    assert sorted(p.kv.keys) == [0, 3]  # skipped layers 1 and 2 never produced a row


def test_may_reuse_refusal_forces_recompute(env):
    """A cached draft row whose tag does not match the committed path is recomputed, not reused."""
    from dataclasses import replace

    prompt = env["docs"][34][:6]
    p = layer_skip(env, [1], gamma=0.0)
    p.start(prompt)
    p.propose(prompt, TorchRandomSource(0))
    kv = p.kv
    rows = len(kv)  # 5 prompt rows + the pending row + 3 drafted rows (the 4th draft is never fed)
    assert rows == len(prompt) + 3
    kv.tags[2] = replace(kv.tags[2], layer_boundary="skip:2")  # e.g. a row from another skip vector
    recomputed = p.stats.extras["recomputed_rows"]
    p.propose(prompt, TorchRandomSource(0))
    assert p.stats.extras["recomputed_rows"] - recomputed == rows - 2  # untampered: rows - (len(prompt) - 1)
    res, _ = run(env, p, prompt=prompt)
    assert res.tokens == autoregressive(env, prompt)


# ---------------------------------------------------------------------------------------------- artifacts


def test_adapter_is_attention_and_norms_only_and_target_frozen(env):
    adapter = env["adapter"].adapter
    names = {n.split(".")[0] for n, _ in adapter.named_parameters()}
    assert names == {"norm1", "attn", "norm2"}  # no FFN, no LM head copy
    m = env["adapter"].manifest
    held = m["held_out"]
    assert held["top1_agreement"] > held["untrained"]["top1_agreement"]
    assert m["target_hash"] == target_fingerprint(env["model"])  # the target's weights did not change in training
    assert m["recipe"]["exit_layer"] == 1 and m["token_budget"] == 1200 and m["cpu_budget_artifact"] is True


def test_adapter_refused_against_another_target(env):
    other = build_tiny_model(seed=2, num_layers=4)
    with pytest.raises(ArtifactError, match="only valid for the target"):
        ensure_adapter(
            {**EXIT_OPTS, "artifact": str(env["adapter"].path)},
            Target(other, None, "other"),
            progress=False,
        )


def test_skip_search_artifact(env):
    prompt = env["docs"][33][:6]
    opts = {"search": {"trials": 4, "prompts": 1, "max_new_tokens": 8, "depth": 3, "gamma": 0.0}}
    skip, m = ensure_skip(
        opts, backend=env["backend"], tokenizer=None, target_source="tiny4", prompts=[prompt], progress=False
    )
    assert m["kind"] == "layer_skip" and m["skip"] == skip and all(0 <= i < 4 for i in skip)
    assert len(m["trials"]) >= 1 and {"ms_per_token", "mean_committed_per_round"} <= set(m["objective"])
    # the finalists (the fastest trials) and the AR reference are timed twice more, interleaved, and
    # stand at the median of their three timings, the first their trial's
    trial_ms = {tuple(t["skip"]): t["ms_per_token"] for t in m["trials"]}
    finalists = m["finalists"]
    assert [tuple(f["skip"]) for f in finalists] == sorted(trial_ms, key=trial_ms.get)[:2]
    for f in [*finalists, m["ar_reference"]]:
        assert len(f["timings"]) == 3 and f["ms_per_token"] == sorted(f["timings"])[1]
    assert all(f["timings"][0] == trial_ms[tuple(f["skip"])] for f in finalists)
    assert m["objective"]["ms_per_token"] == min(f["ms_per_token"] for f in finalists)
    assert m["skip"] in [f["skip"] for f in finalists] and m["recipe"]["confirm"] == 2
    assert m["ar_reference"]["ms_per_token"] > 0 and m["token_budget"] == 4 * 1 * 8
    again, _ = ensure_skip(
        opts, backend=env["backend"], tokenizer=None, target_source="tiny4", prompts=[prompt], progress=False
    )
    assert again == skip  # loaded, not searched again
    _, path = skip_artifact_path(opts, model=env["model"], tokenizer=None, prompts=[prompt])
    assert (path / "manifest.json").is_file() and m["search"]["device_name"]
    other = CausalLMBackend(build_tiny_model(seed=2, num_layers=4))
    with pytest.raises(ArtifactError, match="only valid for the target"):
        ensure_skip(
            {**opts, "artifact": str(path)}, backend=other, tokenizer=None, target_source="other", progress=False
        )


def test_the_skip_search_recipe_names_the_rule_that_splits_its_prompts(env, monkeypatch):
    """The search times its vectors on the dev split's prompts; a new split rule puts other prompts
    there, and the artifact searched on the old ones was loaded under the same key."""
    from harness.workloads import corpora, prompts

    for workload, module, salt in (
        ("sharegpt", corpora, "SPLIT_SALT"),
        ("humaneval", prompts, "HUMANEVAL_SPLIT_SALT"),
    ):
        opts = {"search": {"workload": workload}}
        recipe, path = skip_artifact_path(opts, model=env["model"], tokenizer=None)
        assert getattr(module, salt) in json.dumps(recipe)
        with monkeypatch.context() as m:
            m.setattr(module, salt, getattr(module, salt) + "-next")
            if workload == "humaneval":
                m.setattr("harness.heads.recipes.HUMANEVAL_SPLIT_SALT", prompts.HUMANEVAL_SPLIT_SALT)
            moved, moved_path = skip_artifact_path(opts, model=env["model"], tokenizer=None)
        assert moved != recipe and moved_path != path, workload
    sharegpt, path = skip_artifact_path({}, model=env["model"], tokenizer=None)
    assert len(sharegpt["sharegpt_sha256"]) == 64
    # the rule for which turn of a conversation is a prompt decides the searched prompts too
    assert sharegpt["sharegpt_prompts"] == prompts.SHAREGPT_PROMPT_RULE
    with monkeypatch.context() as m:
        m.setattr("harness.heads.recipes.SHAREGPT_PROMPT_RULE", prompts.SHAREGPT_PROMPT_RULE + "-next")
        assert skip_artifact_path({}, model=env["model"], tokenizer=None)[1] != path


def test_a_skip_vector_searched_with_other_threads_is_searched_again_or_noted(env, capsys):
    """The vector is the fastest one on the host that timed it, and its cache key named only the
    target and the recipe: one searched with 1 thread was loaded as is with 2. The cache now keys
    the host (device, its name, threads); an explicit artifact timed elsewhere is used with a note."""
    prompt = env["docs"][33][:6]
    opts = {"search": {"trials": 2, "prompts": 1, "max_new_tokens": 4, "depth": 2, "gamma": 0.0}}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, one = skip_artifact_path(opts, model=env["model"], tokenizer=None, prompts=[prompt])
        ensure_skip(opts, backend=env["backend"], tokenizer=None, target_source="t", prompts=[prompt], progress=False)
        torch.set_num_threads(2)
        _, two = skip_artifact_path(opts, model=env["model"], tokenizer=None, prompts=[prompt])
        assert two != one and not (two / "manifest.json").exists()  # a search of its own, not the 1-thread one
        capsys.readouterr()
        _, m = ensure_skip(
            {**opts, "artifact": str(one)}, backend=env["backend"], tokenizer=None, target_source="t", progress=False
        )
        assert m["search"]["threads"] == 1
        err = capsys.readouterr().err
        assert (
            f"harness: note: the layer-skip vector in {str(one)!r} was searched on threads 1; this run has threads 2"
            in err
        )
    finally:
        torch.set_num_threads(threads)


def test_search_warm_starts_from_the_least_influential_layers(env):
    """A layer whose attention and MLP outputs are zeroed leaves the residual stream unturned:
    influence 0, the first layer the warm start skips, and the first trial measured."""
    model = build_tiny_model(seed=1, num_layers=4)
    with torch.no_grad():
        layer = model.model.layers[2]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    prompt = env["docs"][33][:6]
    influence = layer_influence(model, [prompt])
    assert len(influence) == 4 and influence[2] == pytest.approx(0.0, abs=1e-6)
    assert min(influence[i] for i in (0, 1)) > 1e-3  # real layers turn the stream
    recipe = SearchRecipe(trials=2, prompts=1, max_new_tokens=6, depth=2, gamma=0.0)
    result = search_skip(CausalLMBackend(model), [prompt], recipe=recipe, progress=False)
    assert result["trials"][0]["skip"] == sorted(sorted(range(4), key=lambda i: influence[i])[:2])
    assert 2 in result["trials"][0]["skip"] and isinstance(result["beats_ar"], bool)


def test_the_search_never_measures_a_vector_that_bypasses_every_layer():
    """TPE's per-layer draws can bypass every layer of a small target: a draft of no decoder layer,
    which a run refuses; the search passes over such a draw instead of failing on it."""
    model = build_tiny_model(seed=1, num_layers=2)
    recipe = SearchRecipe(trials=8, prompts=1, max_new_tokens=3, depth=2, gamma=0.0, confirm=0, seed=3)
    result = search_skip(CausalLMBackend(model), [[5, 6, 7]], recipe=recipe, progress=False)
    assert all(len(t["skip"]) < 2 for t in result["trials"]) and len(result["skip"]) < 2


def test_the_skip_search_times_no_first_decode(monkeypatch):
    """The AR reference was the first decode after the model loaded: with confirm=0 its one timing held
    the first call's costs (kernel builds, compilation, the allocator's growth), which inflated the
    reference and flattered every vector against it (``beats_ar``). Each kind is decoded once, untimed,
    before the first timed decode: a first decode made a million times slower leaves no timing."""
    import dataclasses

    from harness.prepare import skip_search

    real = skip_search.decode
    calls = []

    def recording(**kwargs):
        res = real(**kwargs)
        kind = "ar" if isinstance(kwargs["proposer"], NullProposer) else "skip"
        first = kind not in calls
        calls.append(kind)
        return dataclasses.replace(res, decode_ms=res.decode_ms * 1e6 + 1e6) if first else res

    monkeypatch.setattr(skip_search, "decode", recording)
    model = build_tiny_model(seed=1, num_layers=4)
    recipe = SearchRecipe(trials=2, prompts=1, max_new_tokens=4, depth=2, gamma=0.0, confirm=0, seed=3)
    result = search_skip(CausalLMBackend(model), [[5, 6, 7, 8]], recipe=recipe, progress=False)
    assert calls[:2] == ["ar", "skip"] and calls[2] == "ar"  # the warm-ups, then the timed AR reference
    assert result["ar"]["ms_per_token"] < 1e5  # no first call's timing in the reference
    assert all(t["ms_per_token"] < 1e5 for t in result["trials"])  # nor in the first trial's


def test_a_skip_vector_searched_with_another_forward_setup_is_searched_again_or_noted(env, capsys):
    """The fastest vector depends on how the target's forward runs as much as on the host: another
    attention implementation (or linear kernel, cache kind, fused layers, compilation) keys another
    search, and an explicit artifact searched with another is used with a note naming it."""
    from harness.target.timing import forward_setup

    prompt = env["docs"][33][:6]
    opts = {"search": {"trials": 2, "prompts": 1, "max_new_tokens": 4, "depth": 2, "gamma": 0.0, "confirm": 0}}
    config = env["model"].config
    before = config._attn_implementation
    try:
        config._attn_implementation = "sdpa"
        _, sdpa = skip_artifact_path(opts, model=env["model"], tokenizer=None, prompts=[prompt])
        _, m = ensure_skip(
            opts, backend=env["backend"], tokenizer=None, target_source="t", prompts=[prompt], progress=False
        )
        assert m["search"]["attn_implementation"] == "sdpa" and m["search"]["linear_kernel"] == ["default"]
        assert {k: m["search"][k] for k in forward_setup(env["model"])} == forward_setup(env["model"])
        config._attn_implementation = "eager"
        _, eager = skip_artifact_path(opts, model=env["model"], tokenizer=None, prompts=[prompt])
        assert eager != sdpa and not (eager / "manifest.json").exists()
        capsys.readouterr()
        ensure_skip({**opts, "artifact": str(sdpa)}, backend=env["backend"], tokenizer=None, target_source="t")
        err = capsys.readouterr().err
        assert "was searched on attn_implementation 'sdpa'; this run has attn_implementation 'eager'" in err
    finally:
        config._attn_implementation = before


def test_an_explicit_artifact_folder_without_a_manifest_is_named_as_such(env, tmp_path):
    with pytest.raises(ArtifactError, match=r"holds no manifest.json \(not an artifact\)"):
        ensure_skip(
            {"artifact": str(tmp_path)}, backend=env["backend"], tokenizer=None, target_source="t", prompts=[[5]]
        )


@pytest.mark.parametrize("force", [False, True])
def test_searching_or_distilling_into_a_folder_that_is_no_artifact_of_the_kind_is_refused(env, tmp_path, force):
    """force=true distilled the adapter (or searched the skip vector) into proposer.artifact and
    deleted the user's folder it named, exit 0; an artifact folder of another kind was replaced; a
    file path ran to the end, then failed; without force a lock file was left beside the folder.
    Each is refused before any training or search, left as it is, with nothing written beside it."""
    from harness.heads.checkpoint import save_artifact

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "notes.txt").write_text("mine")
    heads = save_artifact(tmp_path / "heads", manifest={"kind": "hydra"})
    target = Target(env["model"], None, "tiny4")
    cases = [
        (mine, r"holds no manifest.json \(not an artifact\); leave proposer.artifact unset"),
        (tmp_path / "notes.txt", "is a file, not an artifact folder; leave proposer.artifact unset"),
        (heads, "holds an artifact of kind 'hydra', not '{kind}'; name one of kind '{kind}', or leave"),
    ]
    for path, message in cases:
        with pytest.raises(ArtifactError, match=message.format(kind="early_exit")):
            ensure_adapter({**EXIT_OPTS, "artifact": str(path)}, target, progress=False, force=force)
        with pytest.raises(ArtifactError, match=message.format(kind="layer_skip") + ".*proposer.skip=\\[...\\]$"):
            ensure_skip(
                {"artifact": str(path), "search": {"trials": 1, "prompts": 1, "max_new_tokens": 2, "confirm": 0}},
                backend=env["backend"],
                tokenizer=None,
                target_source="tiny4",
                prompts=[[5, 6]],
                progress=False,
                force=force,
            )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads", "mine", "notes.txt"]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"


def test_the_adapter_training_code_version_is_in_the_adapter_s_key(env, monkeypatch):
    """A new version of the adapter's distillation code trains anew under another key (the adapter
    the earlier code distilled was loaded); the earlier one, named, is refused as another recipe's."""
    from harness.heads import recipes
    from harness.heads.artifacts import adapter_artifact_path

    art, version = env["adapter"], recipes.EXIT_TRAINING
    assert art.manifest["recipe"]["training_code"] == version
    assert (
        adapter_artifact_path(
            EXIT_OPTS, model=env["model"], tokenizer=None, documents=(env["docs"][:30], env["docs"][30:])
        )[1]
        == art.path
    )
    monkeypatch.setattr(recipes, "EXIT_TRAINING", "exit-training-next")
    assert (
        adapter_artifact_path(
            EXIT_OPTS, model=env["model"], tokenizer=None, documents=(env["docs"][:30], env["docs"][30:])
        )[1]
        != art.path
    )
    with pytest.raises(
        ArtifactError, match=rf"another recipe: \(training_code\): artifact {version}, configured exit-training-next"
    ):
        ensure_adapter({**EXIT_OPTS, "artifact": str(art.path)}, Target(env["model"], None, "tiny4"), progress=False)


def test_declare_refuses_trees_before_model_work():
    with pytest.raises(ValueError, match="chains only"):
        EarlyExitProposer.declare({}, Budget(shape="expansion", max_nodes=6, max_depth=3, widths=(2, 2, 1)))
    caps = LayerSkipProposer.declare({"sampling": "iid"}, CHAIN)
    assert caps.probability_semantics == frozenset({"normalized_conditional"}) and caps.topology == "sequence"


def test_an_explicit_skip_vector_is_checked_at_plan_and_search_options_beside_it_are_inert():
    """proposer.skip and proposer.artifact both name the skip vector: both is refused, as is a layer
    listed twice (another manifest for the same draft) or outside the target, before any model
    work; the search options change nothing beside an explicit vector and are listed as inert."""
    from harness.config import compose
    from harness.contracts import ConfigError
    from harness.engine.build import plan
    from harness.runner import inert_options

    base = ["model=tiny", "proposer=layer_skip", "topology=sequence"]
    with pytest.raises(ConfigError, match=r"proposer.skip=\[1\] and proposer.artifact=/x both name the skip vector"):
        plan(compose([*base, "proposer.skip=[1]", "proposer.artifact=/x"]))
    with pytest.raises(ConfigError, match=r"lists layer\(s\) \[1\] more than once") as info:
        plan(compose([*base, "proposer.skip=[1,0,1]"]))
    assert info.value.suggestions == (("proposer.skip=[0,1]",),)
    with pytest.raises(ConfigError, match=r"lists \[2\], outside this 2-layer target's layers \[0, 1\]"):
        plan(compose([*base, "proposer.skip=[2]"]))
    with pytest.raises(ConfigError, match=r"lists all 2 layers of the target: the draft would run no decoder layer"):
        plan(compose([*base, "proposer.skip=[1,0]"]))
    with pytest.raises(ValueError, match=r"bypasses all 2 layers"):  # an artifact's vector, past the plan's check
        LayerSkipProposer(
            budget=CHAIN,
            manifest_hash="t",
            policy=SamplingPolicy(),
            model=build_tiny_model(),
            checkpoint="t",
            skip=[0, 1],
        )
    plan(compose([*base, "proposer.skip=[1]"]))
    assert inert_options(compose([*base, "proposer.skip=[1]", "proposer.search.trials=3"])) == [
        "proposer.search.trials=3: proposer.skip names the layers, no search runs"
    ]
    assert inert_options(compose([*base, "proposer.search.trials=3"])) == []  # the search runs


def test_a_named_artifact_that_does_not_exist_says_to_use_the_cache_not_to_switch_auto_train(env, tmp_path):
    """A path the config names is never trained into, auto_train or not (on by default): the
    refusal says to leave the option unset (the cache is trained into), for both self-speculative drafts."""
    gone = tmp_path / "gone"
    with pytest.raises(ArtifactError) as info:
        ensure_adapter({**EXIT_OPTS, "artifact": str(gone)}, Target(env["model"], None, "tiny4"), progress=False)
    assert str(info.value) == (
        f"proposer.artifact={str(gone)!r} does not exist; leave proposer.artifact unset to use the cache "
        "(the run trains into it, or `harness train proposer=early_exit` does and prints the path)"
    )
    with pytest.raises(ArtifactError, match=r"`harness train proposer=layer_skip` does .*, or give the layers to skip"):
        ensure_skip(
            {"artifact": str(gone)}, backend=env["backend"], tokenizer=None, target_source="tiny4", prompts=[[5, 6]]
        )
    assert "auto_train" not in str(info.value)


def test_harness_train_layer_skip_prints_the_fields_every_kind_s_summary_has(tmp_path, monkeypatch, capsys):
    """`harness train proposer=layer_skip` printed neither the artifact's path, kind and target hash
    (every other kind's summary has them) nor beats_ar, which its log line pointed to."""
    import json

    from harness.cli import main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    argv = ["train", "model=tiny", "proposer=layer_skip", "proposer.search.trials=2", "proposer.search.prompts=1"]
    assert main([*argv, "proposer.search.max_new_tokens=4", "threads=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"path", "kind", "target_hash", "beats_ar", "skip", "artifact_id"} <= set(out)
    assert out["kind"] == "layer_skip" and isinstance(out["beats_ar"], bool)
    manifest = json.loads((Path(out["path"]) / "manifest.json").read_text())
    assert manifest["target_hash"] == out["target_hash"] and manifest["skip"] == out["skip"]


def test_a_search_workload_with_no_prompts_of_its_own_is_refused_before_any_model(tmp_path, monkeypatch, capsys):
    """`proposer.search.workload=jsonl` was refused after the model loaded, naming workload.path,
    an option the search does not read; the search takes the built-in prompt sets only."""
    from harness.cli import main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert main(["train", "model=tiny", "proposer=layer_skip", "proposer.search.workload=jsonl"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "harness train: refused: proposer.search.workload=jsonl is out of range: it must be one of "
        "['humaneval', 'sharegpt']"
    ]
    assert not (tmp_path / "artifacts").exists()


def test_the_skip_vector_is_keyed_by_the_chat_template_its_prompts_are_put_through():
    """The search times prompts put through the tokenizer's own chat template, but its key named a
    template only where workload.chat_template replaced it: a checkpoint whose template alone changed
    (the tokenizer's fingerprint leaves it out) reused the vector searched on other prompts. With
    search.chat off the template shapes no prompt and keys nothing."""
    from checkpoint_fixtures import byte_tokenizer

    from harness.target.loading import chat_template_hash

    model = build_tiny_model(vocab_size=259, num_layers=4)
    one, other = byte_tokenizer(), byte_tokenizer()
    one.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    other.chat_template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}{% endfor %}"
    recipe_one, path_one = skip_artifact_path({}, model=model, tokenizer=one)
    recipe_other, path_other = skip_artifact_path({}, model=model, tokenizer=other)
    assert recipe_one["chat_template"] == chat_template_hash(one) != recipe_other["chat_template"]
    assert path_one != path_other
    plain = {"search": {"chat": False}}
    recipe_plain, path_plain = skip_artifact_path(plain, model=model, tokenizer=one)
    assert "chat_template" not in recipe_plain
    assert skip_artifact_path(plain, model=model, tokenizer=other)[1] == path_plain
    # the tiny model's byte ids go through no template: its key holds none
    assert "chat_template" not in skip_artifact_path({}, model=model, tokenizer=None)[0]


def test_prompts_given_to_the_search_key_the_skip_vector():
    """Prompts given in place of the recipe's workload are hashed into the cache's key, so other
    prompts search a vector of their own; the recipe a manifest records stays the configured one."""
    model = build_tiny_model(seed=1, num_layers=4)
    opts = {"search": {"trials": 2, "prompts": 1}}
    one, two = [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 11]
    recipe, path = skip_artifact_path(opts, model=model, tokenizer=None)
    recipe_one, path_one = skip_artifact_path(opts, model=model, tokenizer=None, prompts=[one])
    recipe_two, path_two = skip_artifact_path(opts, model=model, tokenizer=None, prompts=[two])
    assert len({path, path_one, path_two}) == 3 and recipe == recipe_one == recipe_two
    assert skip_artifact_path(opts, model=model, tokenizer=None, prompts=[one])[1] == path_one
