"""EAGLE drafts: the network against transformers' Llama layer, the draft cache rolled back to the
committed path, EAGLE-2's dynamic tree (connected rerank, shapes that follow the draft's
confidences), greedy equality on the tiny model for every topology, sampled trees carrying the law
they were drawn from, training from cached features with held-out agreement by depth, published
EAGLE-1/2, EAGLE-3 and speculators checkpoints written by the test in their layouts and loaded key
for key (refused with expected vs got for another target), and the batch-1 limit."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import round_of_one, rounds_with_room, tokens_left
from safetensors.torch import save_file

from harness.contracts import Budget, ConfigError
from harness.engine.decode import RoundConfig, decode
from harness.heads.artifacts import load_configured_eagle
from harness.heads.checkpoint import ArtifactError, target_fingerprint
from harness.heads.eagle import DecoderLayer, EagleDraft, Rotary, causal_mask, spec_from_target
from harness.heads.state import HiddenTap
from harness.prepare.eagle import ensure_eagle
from harness.prepare.trained import Target
from harness.proposers.base import NullProposer
from harness.proposers.eagle import EagleProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.topology.choices import choice_tree
from harness.topology.compiler import compile_tree
from harness.topology.dynamic import rerank_connected
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy

GREEDY = SamplingPolicy()
OPTIONS = {
    "data": {"source": "inline", "token_budget": 1200, "held_out_tokens": 240, "max_len": 40},
    "train": {"epochs": 3, "lr": 3e-3, "batch_size": 4, "eval_depths": 3},
}
CHAIN = Budget(shape="sequence", max_nodes=4, max_depth=4)
DYNAMIC = Budget(shape="dynamic", max_nodes=8, max_depth=4, topk=3)
CARTESIAN = Budget(shape="cartesian", max_nodes=21, max_depth=3, widths=(3, 2, 2))
# EAGLE-1's static trees are choice lists; this one skips rank 1 below [0] (beam may skip ranks)
_CHOICES = choice_tree([[0], [1], [0, 0], [0, 2], [1, 0], [0, 0, 0]])
CHOICES = Budget(
    shape="choices",
    max_nodes=_CHOICES.num_nodes,
    max_depth=_CHOICES.depth,
    parents=_CHOICES.parents,
    ranks=_CHOICES.ranks,
)


@torch.inference_mode()
def greedy_docs(model, starts, n):
    return model.generate(starts, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0).tolist()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private cache, the tiny target, documents of its own greedy text, one trained draft."""
    import os

    old = os.environ.get("HARNESS_CACHE")
    os.environ["HARNESS_CACHE"] = str(tmp_path_factory.mktemp("eagle_cache"))
    model = build_tiny_model(seed=1)
    gen = torch.Generator().manual_seed(0)
    docs = greedy_docs(model, torch.randint(3, 96, (36, 3), generator=gen), 37)
    art = ensure_eagle(
        OPTIONS,
        Target(model, None, "tiny seed=1"),
        documents=(docs[:30], docs[30:]),
        progress=False,
    )
    yield {"model": model, "backend": CausalLMBackend(model), "docs": docs, "art": art}
    if old is None:
        os.environ.pop("HARNESS_CACHE", None)
    else:
        os.environ["HARNESS_CACHE"] = old


def make(env, budget, *, sampling="beam", policy=GREEDY, draft=None, model=None):
    model = model or env["model"]
    return EagleProposer(
        budget=budget,
        manifest_hash="h",
        policy=policy,
        model=model,
        draft=draft if draft is not None else env["art"].draft,
        checkpoint=target_fingerprint(model),
        sampling=sampling,
        artifact_manifest=env["art"].manifest if draft is None else None,
    )


def run(backend, proposer, *, verifier="greedy", prompt, new=24, policy=GREEDY, seed=0):
    rounds = []
    b = proposer.budget
    res = decode(
        target=backend,
        proposer=proposer,
        verifier=get_verifier(verifier),
        policy=policy,
        prompt_ids=prompt,
        max_new_tokens=new,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(seed),
        round_cfg=RoundConfig(max_nodes=b.max_nodes, max_depth=b.max_depth),
        on_round=lambda **kw: rounds.append(round_of_one(kw)),
    )
    proposer.finish()
    return res, rounds


def autoregressive(backend, prompt, new=24):
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    return run(backend, null, prompt=prompt, new=new)[0].tokens


# ---------------------------------------------------------------------------------------------- the network


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_decoder_layer_is_transformers_llama_layer(rope):
    """Same weights, same output: our layer 1 equals LlamaDecoderLayer, and layer 0 equals it with the
    input norm replaced by the identity (EAGLE-1/2's first layer)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=128,
        rope_parameters=rope,
        attn_implementation="eager",
    )
    spec = spec_from_target(cfg)
    torch.manual_seed(0)
    x = torch.randn(2, 7, 64)
    pos = torch.arange(3, 10).repeat(2, 1)
    mask = causal_mask(2, 7, 0)
    additive = torch.zeros(2, 1, 7, 7).masked_fill(~mask.unsqueeze(1), float("-inf"))
    cos, sin = Rotary(spec)(x, pos)
    ref_pe = LlamaRotaryEmbedding(cfg)(x, pos)
    assert torch.equal(cos, ref_pe[0]) and torch.equal(sin, ref_pe[1])
    for index in (0, 1):
        ref = LlamaDecoderLayer(cfg, index)
        for p in ref.parameters():
            p.data.normal_(0, 0.2)
        ours = DecoderLayer(spec, index)
        state = ref.state_dict()
        if index == 0:
            assert "input_layernorm.weight" not in ours.state_dict()
            state.pop("input_layernorm.weight")
            ref.input_layernorm = torch.nn.Identity()
        ours.load_state_dict(state, strict=True)
        got = ours(x, cos, sin, None, mask)
        want = ref(x, attention_mask=additive, position_embeddings=ref_pe, position_ids=pos)
        assert torch.allclose(got, want, atol=1e-6), (index, (got - want).abs().max())


def test_rotary_frequencies_stay_float32_in_a_half_precision_draft():
    """Cast to bfloat16 (a GPU target's dtype), the draft keeps float32 RoPE frequencies, as a
    transformers model does: angles at position 4,000 are not rounded to bfloat16's 8-bit mantissa."""
    spec = spec_from_target(build_tiny_model().config)
    full = EagleDraft(spec)
    half = EagleDraft(spec).to(torch.bfloat16)
    assert half.rotary.inner.inv_freq.dtype == torch.float32 and half.fc.weight.dtype == torch.bfloat16
    assert torch.equal(half.rotary.inner.inv_freq, full.rotary.inner.inv_freq)
    pos = torch.tensor([[4000]])
    cos32, _ = full.rotary(torch.zeros(1, 1, 32), pos)
    cos16, _ = half.rotary(torch.zeros(1, 1, 32, dtype=torch.bfloat16), pos)
    assert (cos16.float() - cos32).abs().max() < 1e-2  # only the output's own rounding


def test_published_key_names_and_shapes():
    spec = spec_from_target(build_tiny_model().config, num_layers=2)
    shapes = {k: tuple(v.shape) for k, v in EagleDraft(spec).state_dict().items()}
    h, i = 32, 64
    assert shapes["fc.weight"] == (h, 2 * h) and shapes["fc.bias"] == (h,)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (h, h)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (16, h)  # 2 KV heads of 8
    assert shapes["layers.0.mlp.down_proj.weight"] == (h, i)
    assert "layers.0.input_layernorm.weight" not in shapes and shapes["layers.1.input_layernorm.weight"] == (h,)
    assert not any("rotary" in k for k in shapes)  # the rotary table is not a weight


def test_draft_reads_feature_token_and_earlier_pairs():
    """g_j depends on f_j and x_{j+1} and, through the draft's attention, on earlier pairs only."""
    torch.manual_seed(0)
    net = EagleDraft(spec_from_target(build_tiny_model().config)).eval()
    f, e = torch.randn(1, 3, 32), torch.randn(1, 3, 32)
    pos = torch.arange(3)[None]
    mask = causal_mask(1, 3, 0)
    with torch.no_grad():
        base = net(f, e, pos, mask=mask)
        for tensor in (f, e):
            moved = tensor.clone()
            moved[0, 1] += 1.0
            out = net(moved if tensor is f else f, moved if tensor is e else e, pos, mask=mask)
            assert torch.equal(out[0, 0], base[0, 0])  # causal: pair 0 never sees pair 1
            assert not torch.allclose(out[0, 1], base[0, 1])  # its own feature / token
            assert not torch.allclose(out[0, 2], base[0, 2])  # a later pair attends to it


# ---------------------------------------------------------------------------------------------- dynamic rerank


def test_rerank_keeps_the_best_connected_subtree():
    parents = [-1, -1, 0, 0, 1, 2]
    scores = [-0.1, -0.5, -0.2, -0.9, -0.6, -0.3]
    assert rerank_connected(parents, scores, 3) == [0, 2, 5]  # a chain beats the second root child
    assert rerank_connected(parents, scores, 4) == [0, 1, 2, 5]
    assert rerank_connected(parents, scores, 0) == []
    # a child scoring above its parent (not a joint log-probability) waits for its parent
    assert rerank_connected([-1, -1, 1], [-0.1, -0.9, -0.05], 2) == [0, 1]
    # ties: the lower pool index (the parent, drafted first) wins
    assert rerank_connected([-1, 0, -1], [-0.5, -0.5, -0.5], 2) == [0, 1]
    with pytest.raises(ValueError, match="parents"):
        rerank_connected([0], [0.0], 1)


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("verifier", ["greedy", "membership"])
@pytest.mark.parametrize(
    "budget",
    [CHAIN, DYNAMIC, CARTESIAN, Budget(shape="expansion", max_nodes=12, max_depth=3, widths=(2, 2, 1)), CHOICES],
    ids=["chain", "dynamic", "cartesian", "expansion", "choices"],
)
def test_greedy_equality(env, budget, verifier):
    prompt = env["docs"][33][:6]
    expected = autoregressive(env["backend"], prompt)
    p = make(env, budget)
    res, rounds = run(env["backend"], p, verifier=verifier, prompt=prompt)
    assert res.tokens == expected
    ex = p.stats.extras
    assert ex["hidden_misses"] == 0 and ex["feature_gaps"] == 0 and ex["refused_reuse"] == 0
    assert all(r["tree"].num_rows >= 1 for r in rounds_with_room(rounds, 24))
    assert len(rounds) < len(expected)  # some round committed more than one token
    # near the end the trees are cut to what the round can commit
    left = tokens_left(rounds, 24)
    assert all(r["tree"].num_rows == 0 or int(r["tree"].depths.max()) <= n - 1 for r, n in zip(rounds, left))

    assert ex["pairs_fed"] == len(prompt) - 1 + sum(len(r["emitted"]) for r in rounds[:-1])


def test_a_round_after_a_cut_tree_finds_the_draft_s_features_in_its_verify_forward(env):
    """Near the end of a request the round loop cuts the tree to what the round can commit; the
    draft reads the target's features of that cut tree's verify forward, so the next round drafts
    from them (no hidden misses, no feature gaps) and decoding stays exact."""
    prompt = env["docs"][33][:6]
    for new in range(6, 30):
        p = make(env, CHAIN)
        res, rounds = run(env["backend"], p, prompt=prompt, new=new)
        assert res.tokens == autoregressive(env["backend"], prompt, new=new)
        ex = p.stats.extras
        assert ex["hidden_misses"] == 0 and ex["feature_gaps"] == 0 and ex["refused_reuse"] == 0
        left = tokens_left(rounds, new)
        cut = [k for k, n in enumerate(left[:-1]) if 1 < n <= CHAIN.max_depth]
        if cut and rounds[cut[0] + 1]["tree"].num_rows >= 1:
            assert int(rounds[cut[0]]["tree"].depths.max()) <= left[cut[0]] - 1
            break
    else:
        pytest.fail("no request had a cut round followed by a drafted one")


def test_a_choice_list_shapes_every_proposal_by_rank(env):
    """topology=choices: each proposal has the list's parents, and a node of rank r is its parent's
    r-th most likely child under the draft (rank 1 below [0] skipped, as beam allows)."""
    prompt = env["docs"][33][:6]
    p = make(env, CHOICES)
    laws = []
    orig = p._probs

    def spy(logits):
        out = orig(logits)
        laws.append(out)
        return out

    p._probs = spy
    env["backend"].prefill_one(prompt)
    p.start(prompt)
    result = p.propose(prompt, TorchRandomSource(0))
    assert [n.parent for n in result.nodes] == list(CHOICES.parents)
    assert len(laws) == CHOICES.max_depth  # one draft stage (one law call) per depth
    # the rows of each call, in node order: the frontier; nodes [0] and [1]; node [0, 0]
    level = {-1: laws[0][0], 0: laws[1][0], 1: laws[1][1], 2: laws[2][0]}
    for node, (parent, rank) in enumerate(zip(CHOICES.parents, CHOICES.ranks)):
        order = torch.argsort(level[parent], descending=True, stable=True)
        assert result.nodes[node].token_id == int(order[rank]), node
    with pytest.raises(ValueError, match="skips rank 1"):
        EagleProposer.declare({"sampling": "iid"}, CHOICES)


def test_draft_cache_holds_exactly_the_committed_pairs(env):
    """After every proposal the draft cache holds one row per committed pair (f_j, x_{j+1}), and
    the incremental draft output equals a from-scratch pass over the same pairs; a round that can
    commit only its bonus token (one token left) feeds nothing and proposes nothing."""
    prompt = env["docs"][34][:7]
    p = make(env, DYNAMIC)
    seen = []
    capped = []
    orig = p.propose

    def spy(committed, rng):
        out = orig(committed, rng)
        if p.round_max_depth() == 0:
            capped.append((len(committed), p.cache.length, len(out.nodes)))
        else:
            seen.append((len(committed), p.cache.length, [pos for pos, _ in p.fed], p.g_last.clone()))
        return out

    p.propose = spy
    res, _ = run(env["backend"], p, prompt=prompt, new=16)
    model = env["model"]
    full = prompt + res.tokens
    with torch.inference_mode():
        feats = model.base_model(input_ids=torch.tensor([full])).last_hidden_state  # [1, T, d]
        for n, length, positions, g_last in seen:
            assert length == n - 1 and positions == list(range(n - 1))
            ids = torch.tensor([full[1:n]])
            g = p.draft(feats[:, : n - 1], p.embed(ids), torch.arange(n - 1)[None], mask=causal_mask(1, n - 1, 0))
            assert torch.allclose(g[0, -1], g_last, atol=1e-4)
    assert len(full) == len(prompt) + 16 and len(capped) == 1  # the request's last round
    n, length, nodes = capped[0]
    assert nodes == 0 and length < n - 1 and length == seen[-1][1]  # the draft cache was not fed


def test_dynamic_tree_shape_follows_the_drafts_confidence():
    """On a target with peaked laws (LM head scaled) a random draft is confident in some rounds and
    not in others: the verified trees take several shapes, each within the budget, and decoding
    stays exact."""
    model = build_tiny_model(seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(200)
    backend = CausalLMBackend(model)
    torch.manual_seed(0)
    draft = EagleDraft(spec_from_target(model.config))
    budget = Budget(shape="dynamic", max_nodes=6, max_depth=4, topk=2)
    p = EagleProposer(
        budget=budget, manifest_hash="h", policy=GREEDY, model=model, draft=draft, checkpoint=target_fingerprint(model)
    )
    prompt = [5, 17, 33, 2, 9, 40]
    res, rounds = run(backend, p, prompt=prompt, new=24)
    assert res.tokens == autoregressive(backend, prompt)
    shapes = {tuple(r["tree"].parents.tolist()) for r in rounds}
    assert len(shapes) >= 3  # not a fixed shape
    for r in rounds_with_room(rounds, 24):
        tree = r["tree"]
        assert 1 <= tree.num_rows <= 6 and int(tree.depths.max()) <= 4
        assert all(int(par) < i for i, par in enumerate(tree.parents.tolist()))  # connected, topological
    ex = p.stats.extras
    assert ex["max_tree_rows"] <= 6 and ex["max_tree_depth"] >= 3 and sum(ex["tree_rows_hist"]) == ex["rounds"]


def test_dynamic_tree_is_eagle2s_rerank_of_the_full_pool(env, monkeypatch):
    """The early stop (no deeper node can enter the kept set) changes nothing: with it disabled the
    pool is complete (k + (D - 1) k^2 nodes) and the rerank keeps the same tree."""
    import harness.proposers.eagle as eagle_mod

    prompt = env["docs"][32][:8]
    budget = Budget(shape="dynamic", max_nodes=5, max_depth=4, topk=3)

    def tree_of(p):
        env["backend"].prefill_one(prompt)
        p.start(prompt)
        return p.propose(prompt, TorchRandomSource(0))

    fast = tree_of(make(env, budget))
    monkeypatch.setattr(eagle_mod, "deeper_nodes_cannot_enter", lambda *a, **k: False)
    slow_p = make(env, budget)
    full = tree_of(slow_p)
    assert full.extras["pool_nodes"] == 3 + 3 * 9
    assert [(n.token_id, n.parent) for n in fast.nodes] == [(n.token_id, n.parent) for n in full.nodes]
    assert fast.extras["pool_nodes"] <= full.extras["pool_nodes"]
    # each kept node's joint log-confidence is the sum of the draft's log-probabilities on its path
    for i, n in enumerate(full.nodes):
        parent = full.extras["joint_logp"][n.parent] if n.parent >= 0 else 0.0
        assert full.extras["joint_logp"][i] == pytest.approx(parent + float(torch.tensor(n.score).log()), abs=1e-5)
    assert full.probability_semantics == "score_only" and full.sampling_relation == "beam"


def test_critical_path_is_one_draft_stage_per_depth(env):
    prompt = env["docs"][31][:6]
    p = make(env, CHAIN)
    _, rounds = run(env["backend"], p, prompt=prompt)
    # catch-up + depths 2..4, or fewer where the request had fewer tokens left than 4 + 1; the first
    # round's catch-up is the draft's prompt forward, run at the request's start (prefill)
    depths = [max(1, min(CHAIN.max_depth, n - 1)) for n in tokens_left(rounds, 24)]
    assert depths[0] == 4 and min(depths) < 4
    expected = (sum(depths) - 1) / len(depths)
    assert p.stats.extras["critical_path_stages_per_round"] == pytest.approx(expected)


def test_the_drafts_prompt_forward_runs_at_the_requests_start_in_prefill(env):
    """The draft's forward over the prompt's (feature, token) pairs runs in ``start``, inside the
    prefill the arm times, as a draft model's prompt forward does: the first round drafts only."""
    prompt = env["docs"][30][:12]
    p = make(env, CHAIN)
    backend = env["backend"]
    fed = []
    forward = p.draft.forward

    def spy(feats, *a, **kw):
        fed.append((p.stats.extras["rounds"], int(feats.shape[1]), kw.get("real")))
        return forward(feats, *a, **kw)

    p.draft.forward = spy
    try:
        res, rounds = run(backend, p, prompt=prompt, new=8)
    finally:
        del p.draft.forward
    assert fed[0] == (0, len(prompt) - 1, True)  # before any round: the whole prompt at once
    first_round = [rows for r, rows, real in fed if r == 1]
    assert first_round and max(first_round) == 1  # round 1 drafts one row per depth
    assert res.tokens == autoregressive(backend, prompt, new=8)


def test_unexpected_forward_is_a_miss_not_a_wrong_feature(env):
    """A target forward between a proposal and its verify forward fails the generation field of the
    may_reuse check: its rows are refused, the next round proposes nothing (its feature is
    missing), and drafting resumes the round after, with a gap in the draft's context."""
    prompt = env["docs"][30][:6]
    backend = env["backend"]
    expected = autoregressive(backend, prompt)
    p = make(env, CHAIN)
    calls = {"n": 0}
    orig = p.propose

    def meddling(committed, rng):
        out = orig(committed, rng)
        calls["n"] += 1
        if calls["n"] == 3:
            with torch.inference_mode():
                env["model"](input_ids=torch.tensor([committed[-3:]]))  # an unrelated forward
        return out

    p.propose = meddling
    res, rounds = run(backend, p, prompt=prompt)
    assert res.tokens == expected
    ex = p.stats.extras
    assert ex["hidden_misses"] == 1 and ex["feature_gaps"] >= 1
    assert rounds[3]["tree"].num_rows == 0 and rounds[4]["tree"].num_rows >= 1


@pytest.mark.parametrize(
    "sampling,verifier,budget",
    [
        ("iid", "specinfer", Budget(shape="expansion", max_nodes=12, max_depth=3, widths=(2, 2, 1))),
        ("without_replacement", "sequoia", DYNAMIC),
        ("iid", "rejection", CHAIN),
    ],
)
def test_sampled_trees_carry_the_law_they_were_drawn_from(env, sampling, verifier, budget):
    policy = SamplingPolicy(temperature=0.8)
    prompt = env["docs"][31][:6]
    p = make(env, budget, sampling=sampling, policy=policy)
    env["backend"].prefill_one(prompt)
    p.start(prompt)
    result = p.propose(prompt, TorchRandomSource(3))
    assert result.probability_semantics == "normalized_conditional" and result.sampling_relation == sampling
    assert result.q_dists is not None and result.q_dists.shape[0] == len(result.nodes) <= budget.max_nodes
    for i, n in enumerate(result.nodes):
        assert abs(n.q - float(result.q_dists[i, n.token_id])) < 1e-6
    # the first draw's law is the draft's distribution after the last committed pair, under the policy
    with torch.inference_mode():
        want = policy.probs(p.lm_head(p.g_last[None]))[0]
    assert torch.allclose(result.q_dists[0], want, atol=1e-6)
    res, _ = run(
        env["backend"],
        make(env, budget, sampling=sampling, policy=policy),
        verifier=verifier,
        prompt=prompt,
        policy=policy,
    )
    assert len(res.tokens) == 24


def test_sampled_dynamic_tree_expands_by_confidence_within_budget(env):
    policy = SamplingPolicy(temperature=1.0)
    prompt = env["docs"][30][:6]
    budget = Budget(shape="dynamic", max_nodes=7, max_depth=3, topk=2)
    p = make(env, budget, sampling="without_replacement", policy=policy)
    env["backend"].prefill_one(prompt)
    p.start(prompt)
    result = p.propose(prompt, TorchRandomSource(5))
    tree = compile_tree([result], prefix_len=len(prompt))
    depth1 = [i for i, n in enumerate(result.nodes) if n.parent == -1]
    assert len(depth1) == 2 and len(result.nodes) == 2 + 4 + 1  # 2, then 2 x 2, then the 1 left
    joint = result.extras["joint_logp"]
    expanded = {n.parent for n in result.nodes if n.parent >= 0 and result.nodes[n.parent].parent >= 0}
    depth2 = [i for i, n in enumerate(result.nodes) if n.parent in depth1]
    assert expanded == {max(depth2, key=lambda i: (joint[i], -i))}  # the most confident depth-2 node
    assert int(tree.depths.max()) == 3


# ---------------------------------------------------------------------------------------------- negotiation, batch


def test_negotiation_admits_only_verifiers_exact_for_the_relation():
    from harness.config import compose
    from harness.engine.build import plan
    from harness.verifiers.base import NegotiationError

    base = ["model=tiny", "proposer=eagle", "topology=dynamic"]
    plan(compose(base))  # beam at T = 0: greedy
    plan(compose(base + ["verifier=membership", "generation.temperature=0.7"]))
    with pytest.raises(NegotiationError, match="score_only"):
        plan(compose(base + ["verifier=sequoia", "generation.temperature=0.7"]))
    sampled = base + ["proposer.sampling=without_replacement", "generation.temperature=0.7"]
    plan(compose(sampled + ["verifier=sequoia"]))
    with pytest.raises(NegotiationError, match="without_replacement"):
        plan(compose(sampled + ["verifier=specinfer"]))
    with pytest.raises(ValueError, match="topk"):
        plan(compose(base + ["topology.topk=0"]))
    with pytest.raises(ValueError, match="does not exist and is not a hub id"):
        plan(compose(base + ["proposer.artifact=/nonexistent/eagle-draft"]))
    plan(compose(base + ["proposer.artifact=yuhuili/EAGLE-LLaMA3-Instruct-8B"]))  # a hub id: read at load time


def test_batch_above_one_is_refused_before_model_work():
    from harness.config import compose
    from harness.engine.build import plan

    plan(compose(["model=tiny", "proposer=eagle", "topology=sequence"]))
    with pytest.raises(ConfigError, match=r"batch_size <= 1; got 2: EAGLE reads"):
        plan(compose(["model=tiny", "proposer=eagle", "topology=sequence", "generation.batch_size=2"]))


# ---------------------------------------------------------------------------------------------- training


def successor_model(seed=0):
    """A tiny target whose greedy next token is ``x + 1`` (attention and MLP outputs zeroed, LM head
    = the embeddings rolled by one)."""
    m = build_tiny_model(seed=seed, hidden_size=128, intermediate_size=64)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.copy_(torch.roll(m.model.embed_tokens.weight, 1, 0) * 8)
    return m.eval()


def test_training_reaches_high_held_out_agreement_at_every_depth(env):
    model = successor_model()
    docs = [list(range(s, s + 30)) for s in range(3, 63, 2)]
    assert greedy_docs(model, torch.tensor([docs[0][:1]]), 29)[0] == docs[0]
    opts = {
        "intermediate_size": 64,
        "data": {"source": "inline", "token_budget": 600, "held_out_tokens": 150, "max_len": 40},
        "train": {"epochs": 12, "lr": 5e-3, "batch_size": 2, "eval_depths": 4, "token_weight": 1.0},
    }
    art = ensure_eagle(opts, Target(model, None, "successor"), documents=(docs[::2], docs[1::2]), progress=False)
    held = art.manifest["held_out"]
    assert len(held["top1_agreement"]) == 4
    assert all(b < 0.2 for b in held["top1_agreement_untrained"]), held
    assert all(a > 0.9 for a in held["top1_agreement"]), held


def test_manifest_fields(env):
    m = env["art"].manifest
    held = m["held_out"]
    assert len(held["top1_agreement"]) == 3 and held["rows"][0] > held["rows"][2] > 0
    assert all(0.0 <= a <= 1.0 for a in held["top1_agreement"] + held["top1_agreement_untrained"])
    assert m["target_hash"] == target_fingerprint(env["model"]) and m["kind"] == "eagle" and not m["published"]
    assert m["token_budget"] == 1200 and 0 < m["tokens_seen"] <= 1200
    assert m["recipe"]["spec"]["version"] == "eagle" and m["recipe"]["spec"]["hidden_size"] == 32
    assert m["recipe"]["train"]["feature_weight"] == 1.0 and m["recipe"]["train"]["token_weight"] == 0.1
    assert m["cpu_budget_artifact"] is True and m["training"]["steps"] == 3 * 8
    assert make(env, CHAIN).cpu_budget_artifact is True
    weights = env["art"].path / "weights.safetensors"
    from safetensors.torch import load_file

    assert sorted(load_file(str(weights))) == sorted(EagleDraft(spec_from_target(env["model"].config)).state_dict())


def test_the_heads_feature_cache_is_shared(env):
    """EAGLE trains from the same cached target features as the heads of the same data recipe."""
    from harness.prepare.heads import ensure_heads

    before = sorted(p.name for p in (env["art"].path.parents[1] / "heads" / "streams").iterdir())
    ensure_heads(
        "medusa",
        {**OPTIONS, "num_heads": 2, "train": {"epochs": 1}},
        Target(env["model"], None, "tiny"),
        documents=(env["docs"][:30], env["docs"][30:]),
        progress=False,
    )
    after = sorted(p.name for p in (env["art"].path.parents[1] / "heads" / "streams").iterdir())
    mine = target_fingerprint(env["model"])[:12]
    assert before == after and len([n for n in after if n.startswith(mine)]) == 2  # train + held-out


def test_artifact_refused_against_another_target_or_recipe(env):
    with pytest.raises(ArtifactError, match="only valid for the target it was trained"):
        ensure_eagle(
            {**OPTIONS, "artifact": str(env["art"].path)},
            Target(build_tiny_model(seed=2), None, "tiny seed=2"),
            progress=False,
        )
    with pytest.raises(ArtifactError, match=r"proposer.num_layers: artifact 1, configured 2; to use it, set proposer"):
        ensure_eagle(
            {**OPTIONS, "num_layers": 2, "artifact": str(env["art"].path)},
            Target(env["model"], None, "tiny"),
            progress=False,
        )
    with pytest.raises(ArtifactError, match="auto_train=false"):
        ensure_eagle(
            {**OPTIONS, "train": {"epochs": 2}, "auto_train": False},
            Target(env["model"], None, "tiny"),
            progress=False,
        )


def test_training_a_draft_into_a_path_that_is_no_eagle_artifact_is_refused_before_training(env, tmp_path):
    """force=true trained into proposer.artifact and replaced another kind's artifact there; a file
    path trained fully, then failed. Both are refused before any training (forced or not), left as
    they are with no lock file beside them."""
    from harness.heads.checkpoint import save_artifact

    heads = save_artifact(tmp_path / "heads", manifest={"kind": "medusa"})
    (tmp_path / "notes.txt").write_text("mine")
    target = Target(env["model"], None, "tiny")
    for path, message in (
        (heads, f"proposer.artifact={str(heads)!r} holds an artifact of kind 'medusa', not 'eagle'; name one"),
        (tmp_path / "notes.txt", "is a file, not an artifact folder; leave proposer.artifact unset to use the cache"),
    ):
        for force in (False, True):
            with pytest.raises(ArtifactError, match=message):
                ensure_eagle({**OPTIONS, "artifact": str(path)}, target, progress=False, force=force)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads", "notes.txt"]
    assert json.loads((heads / "manifest.json").read_text())["kind"] == "medusa"


def test_the_eagle_training_code_version_is_in_the_drafts_key(env, monkeypatch):
    """A new version of the EAGLE training code trains anew under another key (the draft the earlier
    code trained was loaded); the artifact of the earlier version, named, is refused as another
    recipe's. The heads' version leaves the draft's key alone."""
    from harness.heads import recipes
    from harness.heads.artifacts import eagle_artifact_path

    art, version = env["art"], recipes.EAGLE_TRAINING
    assert art.manifest["recipe"]["training_code"] == version
    monkeypatch.setattr(recipes, "HEADS_TRAINING", "heads-training-next")
    assert (
        eagle_artifact_path(
            OPTIONS, model=env["model"], tokenizer=None, documents=(env["docs"][:30], env["docs"][30:])
        )[1]
        == art.path
    )
    monkeypatch.setattr(recipes, "EAGLE_TRAINING", "eagle-training-next")
    assert (
        eagle_artifact_path(
            OPTIONS, model=env["model"], tokenizer=None, documents=(env["docs"][:30], env["docs"][30:])
        )[1]
        != art.path
    )
    with pytest.raises(
        ArtifactError, match=rf"another recipe: \(training_code\): artifact {version}, configured eagle-training-next"
    ):
        ensure_eagle({**OPTIONS, "artifact": str(art.path)}, Target(env["model"], None, "tiny"), progress=False)


# ---------------------------------------------------------------------------------------------- published checkpoints


def llama_fields(cfg, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **extra,
    }


def eagle12_state(cfg, *, layers=1, bias=True, qkv_bias=False, embed=None, seed=0) -> dict:
    """Random weights under the EAGLE-1/2 key names and shapes."""
    gen = torch.Generator().manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size
    hd = h // cfg.num_attention_heads
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    r = lambda *s: torch.randn(*s, generator=gen) * 0.1  # noqa: E731
    state = {"fc.weight": r(h, 2 * h)}
    if bias:
        state["fc.bias"] = r(h)
    for layer in range(layers):
        p = f"layers.{layer}."
        state.update(
            {
                p + "self_attn.q_proj.weight": r(nh * hd, h),
                p + "self_attn.k_proj.weight": r(nkv * hd, h),
                p + "self_attn.v_proj.weight": r(nkv * hd, h),
                p + "self_attn.o_proj.weight": r(h, nh * hd),
                p + "mlp.gate_proj.weight": r(i, h),
                p + "mlp.up_proj.weight": r(i, h),
                p + "mlp.down_proj.weight": r(h, i),
                p + "post_attention_layernorm.weight": 1 + r(h),
            }
        )
        if layer:
            state[p + "input_layernorm.weight"] = 1 + r(h)
        if qkv_bias:
            state.update(
                {
                    p + "self_attn.q_proj.bias": r(nh * hd),
                    p + "self_attn.k_proj.bias": r(nkv * hd),
                    p + "self_attn.v_proj.bias": r(nkv * hd),
                }
            )
    if embed is not None:
        state["embed_tokens.weight"] = embed.clone()
    return state


def write_published(path, config: dict, state: dict, *, fmt="bin"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    "fmt,bias,qkv_bias,layers",
    [("bin", True, False, 1), ("safetensors", False, False, 1), ("bin", True, True, 2)],
    ids=["eagle-bin", "eagle2-safetensors-nobias", "qwen2-qkv-bias-2-layers"],
)
def test_published_eagle12_checkpoint_loads_key_for_key_and_decodes_exactly(
    env, tmp_path, capsys, fmt, bias, qkv_bias, layers
):
    model = env["model"]
    cfg = model.config
    state = eagle12_state(cfg, layers=layers, bias=bias, qkv_bias=qkv_bias, embed=model.get_input_embeddings().weight)
    extra = {"bias": False} if not bias else {}
    if qkv_bias:
        extra["qkv_bias"] = True
    path = write_published(tmp_path / "ckpt", llama_fields(cfg, num_hidden_layers=layers, **extra), state, fmt=fmt)
    art = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    assert art.published and art.manifest["format"] == "eagle" and not art.cpu_budget_artifact
    assert art.manifest["embedding"] == {"in_checkpoint": True, "max_abs_diff_vs_target": 0.0, "saved_dtype": "float32"}
    assert art.manifest["saved_dtypes"] == {"float32": len(state)}
    loaded = art.draft.state_dict()
    assert sorted(loaded) == sorted(state)
    assert all(torch.equal(loaded[k], state[k].float()) for k in state)
    assert (
        art.draft.spec.fc_bias == bias and art.draft.spec.qkv_bias == qkv_bias and art.draft.spec.num_layers == layers
    )
    prompt = env["docs"][33][:6]
    p = make(env, DYNAMIC, draft=art.draft)
    res, _ = run(env["backend"], p, prompt=prompt)
    assert res.tokens == autoregressive(env["backend"], prompt)
    assert p.stats.extras["hidden_misses"] == 0
    assert capsys.readouterr().err == ""  # its embedding is the target's
    if fmt == "bin" and not qkv_bias:  # an embedding of another base model is warned about
        state["embed_tokens.weight"] = state["embed_tokens.weight"] + 0.5
        other = write_published(
            tmp_path / "other", llama_fields(cfg, num_hidden_layers=layers, **extra), state, fmt=fmt
        )
        load_configured_eagle({"artifact": str(other)}, model=model, tokenizer=None)
        assert "its embedding is 0.5 away from the target's" in capsys.readouterr().err
        # saved in bf16 (as drafts are published): the target's embedding rounded, no other model's
        state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach() * 40  # large: wide ulps
        scaled = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
        half = write_published(tmp_path / "bf16", llama_fields(cfg, num_hidden_layers=layers, **extra), scaled)
        kept = model.get_input_embeddings().weight.detach().clone()
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(40)
        try:
            art = load_configured_eagle({"artifact": str(half)}, model=model, tokenizer=None)
        finally:
            with torch.no_grad():
                model.get_input_embeddings().weight.copy_(kept)
        assert art.manifest["embedding"]["saved_dtype"] == "bfloat16"
        assert art.manifest["saved_dtypes"] == {"bfloat16": len(scaled)}
        assert art.manifest["embedding"]["max_abs_diff_vs_target"] > 1e-3  # beyond the old absolute tolerance
        assert capsys.readouterr().err == ""


def test_published_checkpoint_refusals(env, tmp_path, capsys):
    model = env["model"]
    cfg = model.config
    emb = model.get_input_embeddings().weight

    def load(name, config, state):
        path = write_published(tmp_path / name, config, state)
        return load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)

    wide = build_tiny_model(hidden_size=48).config
    with pytest.raises(ArtifactError, match=r"expected 32, got 48"):
        load("wide", llama_fields(wide), eagle12_state(wide))
    with pytest.raises(ArtifactError, match=r"vocab_size 120; the target's vocabulary is 96"):
        load("vocab", llama_fields(cfg, vocab_size=120), eagle12_state(cfg))
    with pytest.raises(ArtifactError, match=r"embed_tokens.weight is \[120, 32\]"):
        load("embed", llama_fields(cfg), eagle12_state(cfg, embed=torch.zeros(120, 32)))
    state = eagle12_state(cfg, embed=emb)
    state.pop("layers.0.mlp.up_proj.weight")
    with pytest.raises(ArtifactError, match="lacks .*up_proj"):
        load("missing", llama_fields(cfg), state)
    with pytest.raises(ArtifactError, match="does not define"):
        load("extra", llama_fields(cfg), {**eagle12_state(cfg), "lm_head.weight": torch.zeros(96, 32)})
    # only EAGLE-3's own t2d and a layer's rotary frequencies are let through: a stray tensor whose name
    # merely ends so was passed as ignorable
    for stray in ("foo.t2d", "fc.rotary_emb.inv_freq"):
        with pytest.raises(ArtifactError, match=rf"keys this layout does not define: \['{stray}'\]"):
            load(f"stray-{stray}", llama_fields(cfg), {**eagle12_state(cfg, embed=emb), stray: torch.zeros(4)})
    ok = {**eagle12_state(cfg, embed=emb), "layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    load("inv-freq", llama_fields(cfg), ok)
    # heads that do not divide: settings that do not go together, not "a setting of the wrong type"
    with pytest.raises(ArtifactError, match=r"config.json: settings that do not go together \(.*num_attention_heads"):
        load("heads", llama_fields(cfg, num_attention_heads=8, num_key_value_heads=3), eagle12_state(cfg, embed=emb))
    with pytest.raises(ArtifactError, match=r"has shape \[32, 32\], expected \[32, 64\]"):
        load("shape", llama_fields(cfg), {**eagle12_state(cfg), "fc.weight": torch.zeros(32, 32)})
    # no heads, a rope type without its settings, a bias the config promises and the weights lack: refusals
    # naming the artifact, not a ZeroDivisionError, a KeyError or a state-dict error (exit 1)
    with pytest.raises(ArtifactError, match=r"settings that do not go together \(hidden_size=32 and num_attention_h"):
        load("no-heads", llama_fields(cfg, num_attention_heads=0), eagle12_state(cfg, embed=emb))
    partial = llama_fields(cfg, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ArtifactError, match=r"its config.json and weights do not build an EAGLE draft \(KeyError: "):
        load("llama3-partial", partial, eagle12_state(cfg, embed=emb))
    with pytest.raises(ArtifactError, match=r"do not build an EAGLE draft \(RuntimeError: .* Missing key\(s\)"):
        load("mlp-bias", llama_fields(cfg, mlp_bias=True), eagle12_state(cfg, embed=emb))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="neither a harness EAGLE artifact"):
        load_configured_eagle({"artifact": str(tmp_path / "empty")}, model=model, tokenizer=None)
    # a tensor the config requires is missing: refused by name; a config the weights contradict otherwise: noted
    no_fc_bias = eagle12_state(cfg, embed=emb)
    no_fc_bias.pop("fc.bias")
    with pytest.raises(ArtifactError, match=r"config.json says bias=true but the weights hold no fc.bias"):
        load("no-fc-bias", llama_fields(cfg, bias=True), no_fc_bias)
    with pytest.raises(ArtifactError, match=r"says qkv_bias=true but the weights hold no layers.0.self_attn.q_proj"):
        load("no-qkv-bias", llama_fields(cfg, qkv_bias=True), eagle12_state(cfg, embed=emb))
    noted = load("contradicted", llama_fields(cfg, bias=False, num_hidden_layers=3), eagle12_state(cfg, embed=emb))
    # the config decides a bias, as in EAGLE's code; the weights decide the layers (EAGLE's code would leave
    # the ones they lack uninitialised)
    assert not noted.draft.spec.fc_bias and noted.draft.spec.num_layers == 1
    assert "fc.bias" not in noted.draft.state_dict()
    assert noted.manifest["notes"] == [
        "config.json says bias=false: fc.bias in the weights is not used (EAGLE's code builds fc without one)",
        "config.json says num_hidden_layers=3; the weights hold 1 (read from the weights)",
    ]
    err = capsys.readouterr().err  # said on stderr too
    assert all(
        f"harness: note: the published EAGLE draft at {tmp_path / 'contradicted'}: {n}" in err
        for n in noted.manifest["notes"]
    )


def test_malformed_published_eagle_checkpoints_are_refused_naming_file_key_or_field(env, tmp_path):
    """Each refusal is an ArtifactError (one line, exit 2), never a KeyError or a library error,
    and names the artifact and what is wrong."""
    model = env["model"]
    cfg = model.config
    good = eagle12_state(cfg, embed=model.get_input_embeddings().weight)

    def load(name, config, state, fmt="bin"):
        path = write_published(tmp_path / name, config, state, fmt=fmt)
        return load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)

    as_int = {**good, "fc.weight": good["fc.weight"].to(torch.int32)}
    with pytest.raises(ArtifactError, match=r"'.*int32'.*fc.weight is torch.int32; weights must be floating point"):
        load("int32", llama_fields(cfg), as_int)
    nan = {**good, "layers.0.mlp.up_proj.weight": good["layers.0.mlp.up_proj.weight"].clone()}
    nan["layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    with pytest.raises(ArtifactError, match=r"layers.0.mlp.up_proj.weight holds 1 non-finite value"):
        load("nan", llama_fields(cfg), nan)
    fields = llama_fields(cfg)
    del fields["intermediate_size"]
    with pytest.raises(ArtifactError, match=r"'.*no-inter'.*config.json lacks 'intermediate_size'"):
        load("no-inter", fields, good)
    with pytest.raises(ArtifactError, match=r"config.json.* holds a JSON list, not an object"):
        path = write_published(tmp_path / "list", {}, good)
        (path / "config.json").write_text("[1, 2]")
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    with pytest.raises(ArtifactError, match=r"config.json' is not valid JSON"):
        (path / "config.json").write_text("{not json")
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    empty = write_published(tmp_path / "zero", llama_fields(cfg), good, fmt="safetensors")
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(ArtifactError, match=r"cannot read '.*zero/model.safetensors' as a tensor file"):
        load_configured_eagle({"artifact": str(empty)}, model=model, tokenizer=None)
    config, state, _ = eagle3_checkpoint(cfg, draft_vocab=48)
    with pytest.raises(ArtifactError, match=r"d2t is torch.float32; it holds token ids and must be integer"):
        load("float-d2t", config, {**state, "d2t": state["d2t"].float()})


def eagle3_checkpoint(cfg, *, draft_vocab: int, seed=0, speculators=False):
    """Random EAGLE-3 weights and config (EAGLE repo naming, or speculators' ``layers.0.``)."""
    gen = torch.Generator().manual_seed(seed)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd = h // cfg.num_attention_heads
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    r = lambda *s: torch.randn(*s, generator=gen) * 0.1  # noqa: E731
    used = torch.sort(torch.randperm(v, generator=gen)[:draft_vocab]).values
    p = "layers.0." if speculators else "midlayer."
    state = {
        "fc.weight": r(h, 3 * h),
        p + "hidden_norm.weight": 1 + r(h),
        p + "input_layernorm.weight": 1 + r(h),
        p + "self_attn.q_proj.weight": r(nh * hd, 2 * h),
        p + "self_attn.k_proj.weight": r(nkv * hd, 2 * h),
        p + "self_attn.v_proj.weight": r(nkv * hd, 2 * h),
        p + "self_attn.o_proj.weight": r(h, nh * hd),
        p + "post_attention_layernorm.weight": 1 + r(h),
        p + "mlp.gate_proj.weight": r(i, h),
        p + "mlp.up_proj.weight": r(i, h),
        p + "mlp.down_proj.weight": r(h, i),
        "norm.weight": 1 + r(h),
        "lm_head.weight": r(draft_vocab, h) * 20,
        "d2t": used - torch.arange(draft_vocab),
        "t2d": torch.zeros(v, dtype=torch.bool).index_fill_(0, used, True),
    }
    layer = llama_fields(cfg)
    if not speculators:
        return {**layer, "draft_vocab_size": draft_vocab}, state, set(used.tolist())
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "tiny-llama-8-layers", "architectures": ["LlamaForCausalLM"]},
        },
    }
    return config, state, set(used.tolist())


@pytest.fixture(scope="module")
def deep_target():
    """An 8-layer tiny target: EAGLE-3 fuses the residual stream entering layers 2, 4 and 5."""
    model = build_tiny_model(seed=3, num_layers=8)
    return model, CausalLMBackend(model)


def test_an_eagle_proposer_takes_its_hooks_off_the_target_while_the_ar_arm_decodes(env):
    """The autoregressive arm decodes inside every speculative proposer's ``target_unhooked``: a
    proposer that reads hidden rows through the tap has its hooks off the shared target there."""
    from harness.proposers.merged import MergedProposer

    model = env["model"]
    p = make(env, Budget(shape="sequence", max_nodes=3, max_depth=3))
    tap = p.tap
    base = model.base_model
    assert len(base._forward_hooks) >= 1
    with p.target_unhooked():
        assert not base._forward_hooks
        serial = tap.serial
        CausalLMBackend(model).prefill_one([5, 9, 13])
        assert tap.serial == serial
    assert len(base._forward_hooks) >= 1
    merged = MergedProposer.__new__(MergedProposer)
    merged.sources = [p]
    with merged.target_unhooked():
        assert not base._forward_hooks
    assert len(base._forward_hooks) >= 1


def test_tap_records_the_residual_stream_entering_chosen_layers(deep_target):
    model, backend = deep_target
    tap = HiddenTap.on(model)
    tap.capture_layers([2, 4, 5])
    ids = [5, 9, 13, 17, 21]
    backend.prefill_one(ids + [3])
    with torch.inference_mode():
        ref = model.base_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer in (2, 4, 5):
        assert torch.allclose(tap.last.aux[layer], ref[layer][0], atol=1e-6)
    with pytest.raises(ValueError, match="outside the target's 8 layers"):
        tap.capture_layers([8])


@pytest.mark.parametrize("speculators", [False, True], ids=["eagle3", "speculators-eagle3"])
def test_published_eagle3_checkpoint_drafts_in_its_draft_vocabulary(deep_target, tmp_path, speculators):
    model, backend = deep_target
    config, state, used = eagle3_checkpoint(model.config, draft_vocab=40, speculators=speculators)
    path = write_published(tmp_path / "e3", config, state, fmt="safetensors")
    art = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    fmt = "speculators-eagle3" if speculators else "eagle3"
    assert art.manifest["format"] == fmt and art.draft.spec.aux_layers == (2, 4, 5)
    assert art.draft.spec.draft_vocab_size == 40 and art.manifest["embedding"] == {"in_checkpoint": False}
    loaded = art.draft.state_dict()
    rename = (lambda k: k.replace("layers.0.", "midlayer.")) if speculators else (lambda k: k)
    assert sorted(loaded) == sorted(rename(k) for k in state if k != "t2d")
    assert all(torch.equal(loaded[rename(k)], state[k].to(loaded[rename(k)].dtype)) for k in state if k != "t2d")
    if speculators:
        assert art.manifest["verifier"]["name_or_path"] == "tiny-llama-8-layers"
    p, rounds = greedy_dynamic_rounds(model, backend, art.draft, new=16)
    assert p.stats.extras["hidden_misses"] == 0 and p.stats.extras["refused_reuse"] == 0
    proposed = {int(t) for r in rounds for t in r["tree"].token_ids.tolist()}
    assert proposed and proposed <= used  # no mass outside the draft vocabulary


def greedy_dynamic_rounds(model, backend, draft, *, new: int, prompt=(7, 11, 19, 23, 29, 31)):
    """A greedy decode drafted by ``draft`` on EAGLE-2's dynamic tree, checked token for token
    against the target's own greedy decode: (the proposer, its rounds)."""
    p = EagleProposer(
        budget=DYNAMIC,
        manifest_hash="h",
        policy=GREEDY,
        model=model,
        draft=draft,
        checkpoint=target_fingerprint(model),
    )
    res, rounds = run(backend, p, prompt=list(prompt), new=new)
    assert res.tokens == autoregressive(backend, list(prompt), new=new)
    return p, rounds


def test_an_eagle3_draft_over_the_whole_vocabulary_loads_without_its_index_maps(deep_target, tmp_path):
    """A draft vocabulary that is the target's needs no d2t/t2d: such a checkpoint loads (the identity
    map) and drafts exactly as one that ships an all-zero d2t."""
    model, backend = deep_target
    v = model.config.vocab_size
    config, state, _ = eagle3_checkpoint(model.config, draft_vocab=v)
    without = {k: t for k, t in state.items() if k not in ("d2t", "t2d")}
    outputs = []
    for name, weights in (("bare", without), ("zeros", {**without, "d2t": torch.zeros(v, dtype=torch.long)})):
        path = write_published(tmp_path / name, config, weights, fmt="safetensors")
        art = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
        assert art.draft.spec.draft_vocab_size == v and not bool(art.draft.d2t.any())
        _, rounds = greedy_dynamic_rounds(model, backend, art.draft, new=12)
        outputs.append([r["tree"].token_ids.tolist() for r in rounds])
    assert outputs[0] == outputs[1]


def test_a_tree_wider_than_an_eagle3_draft_vocabulary_is_refused(deep_target, tmp_path):
    """Rows past a reduced draft vocabulary were filled with tokens the draft gives no mass (or a
    uniform fill), and their acceptance was credited to the draft: refused at plan from the
    checkpoint's config.json, and by the proposer where the config was not at hand (a hub id)."""
    from harness.config import compose
    from harness.contracts import ContractError
    from harness.engine.build import plan
    from harness.runner import check_budget_fits_vocabulary

    model, _ = deep_target
    config, state, _ = eagle3_checkpoint(model.config, draft_vocab=8)
    path = write_published(tmp_path / "e3", config, state, fmt="safetensors")
    base = ["model=tiny", "model.tiny.num_layers=8", "proposer=eagle", f"proposer.artifact={path}", "topology=set"]
    cfg = compose([*base, "topology.max_nodes=12", "topology.max_depth=1"])
    with pytest.raises(
        ConfigError,
        match=r"^topology.max_nodes asks for 12 children of one node \(its widest level\) "
        r"but the EAGLE-3 draft at proposer.artifact=.* proposes from its 8-token vocabulary",
    ):
        check_budget_fits_vocabulary(cfg, plan(cfg).budget)
    narrow = compose([*base, "topology.max_nodes=8", "topology.max_depth=1"])
    check_budget_fits_vocabulary(narrow, plan(narrow).budget)
    art = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    with pytest.raises(
        ContractError, match="asks for 12 children of one node but this EAGLE-3 draft proposes from its 8"
    ):
        EagleProposer(
            budget=Budget("set", 12, 1, widths=(12,)),
            manifest_hash="h",
            policy=GREEDY,
            model=model,
            draft=art.draft,
            checkpoint=target_fingerprint(model),
        )


def test_biases_the_config_does_not_build_are_left_unused_as_eagles_code_leaves_them(env, tmp_path, capsys):
    """EAGLE's loader builds the layers its config.json describes and loads with ``strict=False``: q/k/v
    biases without ``qkv_bias`` (or ``attention_bias``) in the config are dropped, so the draft computes
    what it computes without them. Read the same here, and noted."""
    model = env["model"]
    cfg = model.config
    emb = model.get_input_embeddings().weight
    with_biases = eagle12_state(cfg, qkv_bias=True, embed=emb)
    without = {k: v for k, v in with_biases.items() if not k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))}
    drafts = {}
    for name, state, extra in (
        ("unsaid", with_biases, {}),
        ("bare", without, {}),
        ("said", with_biases, {"attention_bias": True}),
    ):
        path = write_published(tmp_path / name, llama_fields(cfg, **extra), state)
        drafts[name] = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    unsaid, bare, said = drafts["unsaid"], drafts["bare"], drafts["said"]
    assert not unsaid.draft.spec.qkv_bias and said.draft.spec.qkv_bias
    assert unsaid.manifest["notes"] == [
        "config.json says neither qkv_bias nor attention_bias is true: the q/k/v biases in the weights are not "
        "used (EAGLE's code builds q/k/v without them)"
    ]
    assert bare.manifest["notes"] == [] and said.manifest["notes"] == []
    assert sorted(unsaid.draft.state_dict()) == sorted(bare.draft.state_dict())
    assert all(torch.equal(v, bare.draft.state_dict()[k]) for k, v in unsaid.draft.state_dict().items())
    prompt = env["docs"][33][:6]
    trees = {}
    for name, art in drafts.items():
        _, rounds = run(env["backend"], make(env, DYNAMIC, draft=art.draft), prompt=prompt, new=12)
        trees[name] = [r["tree"].token_ids.tolist() for r in rounds]
    assert trees["unsaid"] == trees["bare"] and trees["said"] != trees["bare"]  # the biases are live when built
    assert "q/k/v biases in the weights are not used" in capsys.readouterr().err


def test_eagle3_reads_what_its_config_builds(deep_target, tmp_path):
    """EAGLE-3's q/k/v have no bias unless the config says so (EAGLE's code builds none), and a draft over
    the target's whole vocabulary reads no d2t (EAGLE's code deletes it): both noted and left unused."""
    model, backend = deep_target
    h, v = model.config.hidden_size, model.config.vocab_size
    nh, nkv = model.config.num_attention_heads, model.config.num_key_value_heads
    hd = h // nh
    config, state, _ = eagle3_checkpoint(model.config, draft_vocab=40)
    gen = torch.Generator().manual_seed(3)
    biases = {
        f"midlayer.self_attn.{n}_proj.bias": torch.randn(w, generator=gen)
        for n, w in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd))
    }
    plain = load_configured_eagle(
        {"artifact": str(write_published(tmp_path / "plain", config, state, fmt="safetensors"))},
        model=model,
        tokenizer=None,
    )
    unsaid = load_configured_eagle(
        {"artifact": str(write_published(tmp_path / "unsaid", config, {**state, **biases}, fmt="safetensors"))},
        model=model,
        tokenizer=None,
    )
    said_path = write_published(
        tmp_path / "said", {**config, "attention_bias": True}, {**state, **biases}, fmt="safetensors"
    )
    said = load_configured_eagle({"artifact": str(said_path)}, model=model, tokenizer=None)
    assert not unsaid.draft.spec.qkv_bias and said.draft.spec.qkv_bias
    assert "the q/k/v biases in the weights are not used" in unsaid.manifest["notes"][0]
    assert all(torch.equal(t, plain.draft.state_dict()[k]) for k, t in unsaid.draft.state_dict().items())
    with pytest.raises(ArtifactError, match=r"says attention_bias=true but the weights hold no midlayer.self_attn.q"):
        path = write_published(tmp_path / "truncated", {**config, "attention_bias": True}, state, fmt="safetensors")
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    # the whole vocabulary with a d2t that is not the identity: EAGLE's code drafts the raw ids
    whole, full_state, _ = eagle3_checkpoint(model.config, draft_vocab=v)
    rolled = {**full_state, "d2t": torch.roll(torch.arange(v), 1) - torch.arange(v)}
    art = load_configured_eagle(
        {"artifact": str(write_published(tmp_path / "rolled", whole, rolled, fmt="safetensors"))},
        model=model,
        tokenizer=None,
    )
    assert not bool(art.draft.d2t.any())
    assert art.manifest["notes"] == [
        "draft_vocab_size is the target's vocabulary: d2t is not used (EAGLE's code drops it), though it is not "
        "the identity"
    ]
    greedy_dynamic_rounds(model, backend, art.draft, new=8)


def test_published_eagle3_joins_its_features_in_layer_order(deep_target, tmp_path):
    """EAGLE's and vLLM's targets collect the three features while walking their layers, so a draft is
    trained on them in ascending layer order whatever order its config lists: [5, 2, 4] was joined as
    h5|h2|h4 (a silent fall in acceptance)."""
    model, _ = deep_target
    config, state, _ = eagle3_checkpoint(model.config, draft_vocab=40)
    listed = load_configured_eagle(
        {
            "artifact": str(
                write_published(tmp_path / "listed", {**config, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, state)
            )
        },
        model=model,
        tokenizer=None,
    )
    shuffled = load_configured_eagle(
        {
            "artifact": str(
                write_published(tmp_path / "shuffled", {**config, "eagle_aux_hidden_state_layer_ids": [5, 2, 4]}, state)
            )
        },
        model=model,
        tokenizer=None,
    )
    assert listed.draft.spec.aux_layers == shuffled.draft.spec.aux_layers == (2, 4, 5)
    assert not any("layer order" in note for note in listed.manifest["notes"])
    assert (
        "eagle_aux_hidden_state_layer_ids lists [5, 2, 4]: the features are joined in layer order [2, 4, 5], as "
        "EAGLE's code collects them while the target runs its layers"
    ) in shuffled.manifest["notes"]


def test_published_eagle3_refusals(deep_target, tmp_path):
    model, _ = deep_target
    config, state, _ = eagle3_checkpoint(model.config, draft_vocab=40)
    bad = dict(state)
    bad["d2t"] = bad["d2t"] + 100
    path = write_published(tmp_path / "d2t", config, bad, fmt="safetensors")
    with pytest.raises(ArtifactError, match="d2t maps the draft vocabulary outside"):
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    path = write_published(tmp_path / "layers", {**config, "eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, state)
    with pytest.raises(ArtifactError, match=r"fuses target layers \[2, 4, 9\]; the target has 8"):
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    # a layer fused twice (the default 2, N // 2, N - 3 on a target of 6 layers or fewer): EAGLE's code
    # collects each layer once, and its fc would not load
    path = write_published(tmp_path / "twice", {**config, "eagle_aux_hidden_state_layer_ids": [2, 4, 4]}, state)
    with pytest.raises(ArtifactError, match=r"fuses target layers \[2, 4, 4\]: a layer twice"):
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    path = write_published(tmp_path / "th", {**config, "target_hidden_size": 64}, state)
    with pytest.raises(ArtifactError, match="expected 32, got 64"):
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    hass = {
        "speculators_model_type": "eagle",
        "layernorms": True,
        "transformer_layer_config": llama_fields(model.config),
    }
    path = write_published(tmp_path / "hass", hass, {"fusion_fc.weight": torch.zeros(32, 64)})
    with pytest.raises(ArtifactError, match="HASS"):
        load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)


def test_legacy_speculators_eagle_is_the_eagle1_layout(env, tmp_path):
    model = env["model"]
    cfg = model.config
    state = eagle12_state(cfg, bias=False)
    legacy = {
        ("fusion_fc." + k[3:] if k.startswith("fc.") else "transformer." + k[len("layers.0.") :]): v
        for k, v in state.items()
    }
    config = {
        "speculators_model_type": "eagle",
        "layernorms": False,
        "fusion_bias": False,
        "transformer_layer_config": llama_fields(cfg),
    }
    path = write_published(tmp_path / "legacy", config, legacy, fmt="safetensors")
    art = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=None)
    assert art.manifest["format"] == "speculators-eagle"
    assert all(torch.equal(art.draft.state_dict()[k], v) for k, v in state.items())


def test_harness_run_with_a_published_checkpoint_and_a_dynamic_tree(env, tmp_path, monkeypatch):
    """`harness run proposer=eagle proposer.artifact=DIR topology=dynamic` end to end on the tiny
    model: the prepare stage loads the checkpoint as it is, gates pass, the record carries the
    artifact's provenance and the dynamic tree's sizes."""
    from harness.config import compose
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    model = build_tiny_model()  # model=tiny seed 0
    cfg = model.config
    path = write_published(
        tmp_path / "ckpt", llama_fields(cfg), eagle12_state(cfg, embed=model.get_input_embeddings().weight)
    )
    run_cfg = compose(
        [
            "model=tiny",
            "proposer=eagle",
            f"proposer.artifact={path}",
            "topology=dynamic",
            "workload.limit=2",
            "generation.max_new_tokens=12",
            "gates.oracle=false",
            "threads=1",
        ]
    )
    record = run_job(run_cfg, run_dir=tmp_path / "run")
    from harness.tracking.store import load_record

    load_record(tmp_path / "run" / "record.json")  # the record validates
    m = record["metrics"]
    assert m["greedy_identical"] is True and m["cpu_budget_artifact"] is False
    art = record["artifacts"]["proposer_artifact"]
    assert art["published"] is True and art["format"] == "eagle" and art["source"] == str(path)
    extras = m["retrieval"]
    assert extras["hidden_misses"] == 0 and 1 <= extras["max_tree_rows"] <= 8
    assert sum(extras["tree_rows_hist"]) == extras["rounds"]
    # the heads comparison table reads the record (scripts/heads_show.py)
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "heads_show.py"
    spec = importlib.util.spec_from_file_location("heads_show", script)
    show = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(show)
    row = show.row_of(record)
    assert row["proposer"] == "eagle" and row["topology"] == "dynamic" and row["mean_tree_rows"] >= 1
    assert "| dynamic" not in show.table([row]) and f"{row['mean_tree_rows']:.1f}" in show.table([row])


def test_harness_train_proposer_eagle_on_the_tiny_model(tmp_path, monkeypatch, capsys, caplog):
    """`harness train proposer=eagle model=tiny ...`: ShareGPT documents as byte ids, the artifact's
    summary printed as JSON; a second call finds the artifact; a published checkpoint is never trained."""
    from harness.app import train_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    argv = [
        "proposer=eagle",
        "model=tiny",
        "threads=1",
        "proposer.data.token_budget=300",
        "proposer.data.held_out_tokens=100",
        "proposer.data.max_len=50",
        "proposer.train.eval_depths=2",
    ]
    assert train_main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["kind"] == "eagle" and summary["tokens_seen"] <= 300 and summary["cpu_budget_artifact"] is True
    assert len(summary["held_out_top1_agreement_by_depth"]) == 2
    assert summary["reused"] is False and "already holds" not in captured.err
    assert train_main(argv) == 0  # loads the existing artifact, and says so
    captured = capsys.readouterr()
    again = json.loads(captured.out)
    assert again["artifact_id"] == summary["artifact_id"] and again["reused"] is True
    assert (
        f"harness train: {summary['path']} already holds this recipe's eagle artifact: printed as it is, "
        "nothing trained (force=true retrains)"
    ) in captured.err
    with caplog.at_level(logging.WARNING, logger="harness"):
        assert train_main([*argv, "force=true", f"output_dir={tmp_path / 'unread'}"]) == 0  # retrains in place
    captured = capsys.readouterr()
    assert json.loads(captured.out)["reused"] is False
    assert f"training the EAGLE draft artifact (replacing the one in {summary['path']})" in caplog.text
    assert (  # an option train does not read is said so, not dropped silently
        f"harness train: note: option(s) with no effect here: output_dir={tmp_path / 'unread'}: train writes its "
        "artifact to $HARNESS_CACHE/artifacts, by target and recipe (printed as path)"
    ) in captured.err
    assert not (tmp_path / "unread").exists()
    assert train_main([*argv, "force=true", "force=false"]) == 2  # the last one did not win: any true retrained
    assert capsys.readouterr().err.strip() == (
        "harness train: refused: force= given 2 times (force=true, force=false): give it once"
    )
    model = build_tiny_model()
    path = write_published(tmp_path / "ckpt", llama_fields(model.config), eagle12_state(model.config))
    for force in ([], ["force=true"]):  # refused before any model work, forced or not (as for head banks)
        assert train_main([*argv, f"proposer.artifact={path}", *force]) == 2
        assert (
            capsys.readouterr()
            .err.strip()
            .endswith(
                f"proposer.artifact={str(path)!r} is a published eagle checkpoint: a run loads it as it is, nothing is "
                "trained here; drop proposer.artifact to train one for this target"
            )
        )


# ---------------------------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    from harness.target.loading import load_model

    return load_model(name="smollm2")


@pytest.mark.model
def test_smollm2_published_layout_checkpoint_decodes_exactly_with_a_dynamic_tree(smollm2, tmp_path):
    """A random checkpoint in EAGLE-1/2's published layout with SmolLM2's shapes (576 wide, 9 heads, 3 KV
    heads, vocabulary 49,152, the base embedding copied in) loads and decodes greedy-identically."""
    model, tok = smollm2.model, smollm2.tokenizer
    cfg = model.config
    state = eagle12_state(cfg, embed=model.get_input_embeddings().weight.detach())
    config = llama_fields(cfg, rope_theta=float(cfg.rope_parameters["rope_theta"]), bias=True)
    path = write_published(tmp_path / "ckpt", config, state, fmt="safetensors")
    art = load_configured_eagle({"artifact": str(path)}, model=model, tokenizer=tok)
    assert art.manifest["embedding"]["max_abs_diff_vs_target"] == 0.0
    backend = CausalLMBackend(model)
    prompt = tok("def fibonacci(n):\n    ")["input_ids"]
    p = EagleProposer(
        budget=DYNAMIC,
        manifest_hash="h",
        policy=GREEDY,
        model=model,
        draft=art.draft,
        checkpoint=target_fingerprint(model),
    )
    res, rounds = run(backend, p, prompt=prompt, new=16)
    assert res.tokens == autoregressive(backend, prompt, new=16)
    assert p.stats.extras["hidden_misses"] == 0 and all(r["tree"].num_rows >= 1 for r in rounds_with_room(rounds, 16))


@pytest.mark.model
def test_smollm2_trains_an_eagle_draft_from_sharegpt(smollm2, tmp_path, monkeypatch):
    """The SmolLM2 path of `harness train proposer=eagle` on a tiny budget (chat-templated ShareGPT
    documents, cached features, held-out agreement by depth), and a run on the result."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    opts = {
        "data": {"token_budget": 400, "held_out_tokens": 120, "max_len": 128},
        "train": {"epochs": 1, "eval_depths": 3},
    }
    art = ensure_eagle(opts, Target(smollm2.model, smollm2.tokenizer, "smollm2"), progress=False)
    held = art.manifest["held_out"]
    assert len(held["top1_agreement"]) == 3 and held["rows"][0] > 0 and art.manifest["training"]["steps"] >= 1
    backend = CausalLMBackend(smollm2.model)
    prompt = smollm2.tokenizer("The capital of France is")["input_ids"]
    p = EagleProposer(
        budget=CHAIN,
        manifest_hash="h",
        policy=GREEDY,
        model=smollm2.model,
        draft=art.draft,
        checkpoint=target_fingerprint(smollm2.model, smollm2.tokenizer),
    )
    res, _ = run(backend, p, prompt=prompt, new=12)
    assert res.tokens == autoregressive(backend, prompt, new=12)


def test_a_hub_id_is_downloaded_then_read_like_a_directory(env, tmp_path, monkeypatch):
    """``proposer.artifact=owner/name`` goes through huggingface_hub's snapshot download (config and
    weights only); a failed download is one clear refusal."""
    import huggingface_hub

    model = env["model"]
    local = write_published(
        tmp_path / "snapshot", llama_fields(model.config), eagle12_state(model.config), fmt="safetensors"
    )
    calls = []

    def fake_download(repo_id, allow_patterns, local_files_only=False):
        calls.append((repo_id, tuple(allow_patterns), local_files_only))
        if repo_id == "someone/missing":
            raise OSError("404 Client Error: repository not found")
        return str(local)

    import harness.heads.eagle_formats as formats

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.setattr(formats, "hub_unreachable", lambda: None)
    art = load_configured_eagle({"artifact": "someone/eagle-tiny"}, model=model, tokenizer=None)
    assert art.manifest["source"] == "someone/eagle-tiny" and art.manifest["path"] == str(local)
    assert calls == [("someone/eagle-tiny", ("*.json", "*.safetensors", "*.bin"), False)]
    with pytest.raises(ArtifactError, match="cannot download the EAGLE checkpoint 'someone/missing'.*404"):
        load_configured_eagle({"artifact": "someone/missing"}, model=model, tokenizer=None)
    # the hub unreachable: the local cache only, and a miss says why
    monkeypatch.setattr(formats, "hub_unreachable", lambda: "huggingface.co:443: Name or service not known")
    with pytest.raises(ArtifactError, match=r"not in the local hub cache, and the hub cannot be reached \(huggingface"):
        load_configured_eagle({"artifact": "someone/missing"}, model=model, tokenizer=None)
    assert calls[-1] == ("someone/missing", ("*.json", "*.safetensors", "*.bin"), True)


def test_a_published_draft_for_another_target_is_refused_before_any_model_work(env, tmp_path, monkeypatch):
    """Its config.json names another hidden size or vocabulary: refused at plan, as published heads
    are (it was refused after the target's weights had loaded, minutes on a 7B target)."""
    import harness.runner as runner
    from harness.config import compose
    from harness.engine.build import plan

    model = env["model"]
    cfg = model.config
    state = eagle12_state(cfg, embed=model.get_input_embeddings().weight)
    wide = write_published(tmp_path / "wide", {**llama_fields(cfg), "vocab_size": 259}, state)
    other = write_published(tmp_path / "other", {**llama_fields(cfg), "hidden_size": 64}, state)
    monkeypatch.setattr(runner, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))
    for path, said in (
        (wide, r"\(EAGLE draft\) has vocab_size 259; the target's vocabulary is 96"),
        (other, r"\(EAGLE draft\) reads features of hidden size 64; the target's is 32"),
    ):
        with pytest.raises(ArtifactError, match=rf"^proposer.artifact='{path}' {said}"):
            plan(compose(["model=tiny", "proposer=eagle", f"proposer.artifact={path}", "topology=sequence"]))
    # a folder in neither layout (published Medusa heads, say) is refused at plan too, not after loading
    heads = tmp_path / "medusa"
    heads.mkdir()
    (heads / "config.json").write_text('{"medusa_num_heads": 2}')
    (heads / "medusa_lm_head.pt").write_bytes(b"")
    with pytest.raises(ArtifactError, match=rf"^proposer.artifact='{heads}' is neither a harness EAGLE artifact"):
        plan(compose(["model=tiny", "proposer=eagle", f"proposer.artifact={heads}", "topology=sequence"]))
    fits = write_published(tmp_path / "fits", llama_fields(cfg), state)
    plan(compose(["model=tiny", "proposer=eagle", f"proposer.artifact={fits}", "topology=sequence"]))


def test_a_beam_draft_refused_by_a_q_verifier_is_offered_sampling_that_records_q(capsys):
    """EAGLE's default beam records scores, so ``verifier=specinfer`` at T > 0 is refused; the line
    offered only ``verifier=membership``, not drawing the children (``proposer.sampling=iid``), which
    is what its T = 0.7 experiments do. A proposer without the option is offered no such fix."""
    from harness.app import run_main

    argv = ["model=tiny", "proposer=eagle", "verifier=specinfer", "generation.temperature=0.7"]
    assert run_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "try verifier=membership or proposer.sampling=iid or proposer.sampling=without_replacement verifier=sequoia"
    )
    assert run_main(["model=tiny", "proposer=prompt_lookup", "verifier=specinfer", "generation.temperature=0.7"]) == 2
    assert capsys.readouterr().err.strip().endswith("try verifier=membership")


def test_a_one_token_prompt_keeps_no_earlier_forward_as_its_prefill(env):
    backend = env["backend"]
    p = make(env, DYNAMIC)
    run(backend, p, prompt=env["docs"][33][:6], new=4)
    with torch.inference_mode():  # a forward shaped like a one-token prompt's prefill, not this request's
        env["model"](input_ids=torch.tensor([env["docs"][33][:1]]))
    p.start(env["docs"][33][:1])
    assert p._start_capture is None
    p.finish()
    res, _ = run(backend, p, prompt=env["docs"][33][:1], new=8)
    assert res.tokens == autoregressive(backend, env["docs"][33][:1], new=8)
    assert p.stats.extras["hidden_misses"] == 1
