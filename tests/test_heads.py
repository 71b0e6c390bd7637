"""Draft heads (Medusa, Hydra, Clover): factorisations, Cartesian trees, training and artifacts,
greedy equality on the tiny model, sampled trees carrying q, refusal against another target."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import round_of_one, rounds_with_room, tokens_left

from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.heads.checkpoint import ArtifactError, target_fingerprint
from harness.heads.models import DraftHeads, HeadSpec
from harness.heads.recipes import heads_recipe
from harness.prepare.heads import ensure_heads
from harness.prepare.trained import Target
from harness.proposers.base import NullProposer
from harness.proposers.heads import CloverProposer, HydraProposer, MedusaProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.topology.budgets import cartesian_rows
from harness.topology.compiler import compile_tree
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy

GREEDY = SamplingPolicy()
CLASSES = {"medusa": MedusaProposer, "hydra": HydraProposer, "clover": CloverProposer}
OPTIONS = {
    "num_heads": 3,
    "data": {"source": "inline", "token_budget": 1200, "held_out_tokens": 240, "max_len": 40},
    "train": {"epochs": 3, "lr": 3e-3, "batch_size": 32},
}


@torch.inference_mode()
def greedy_docs(model, starts, n):
    """Greedy continuations of ``starts`` ``[B, s]`` (EOS suppressed): the target's own text."""
    return model.generate(starts, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0).tolist()


def successor_model(seed=0):
    """A tiny target with learnable structure: attention and MLP outputs zeroed and the LM head set
    to the embeddings rolled by one, so its greedy next token is ``x + 1``."""
    m = build_tiny_model(seed=seed, hidden_size=128, intermediate_size=64)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.copy_(torch.roll(m.model.embed_tokens.weight, 1, 0) * 8)
    return m.eval()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private cache, the tiny target, documents of its own greedy text, one artifact per kind."""
    import os

    old = os.environ.get("HARNESS_CACHE")
    os.environ["HARNESS_CACHE"] = str(tmp_path_factory.mktemp("heads_cache"))
    model = build_tiny_model(seed=1)
    gen = torch.Generator().manual_seed(0)
    docs = greedy_docs(model, torch.randint(3, 96, (36, 3), generator=gen), 37)
    arts = {
        k: ensure_heads(
            k,
            OPTIONS,
            Target(model, None, "tiny seed=1"),
            documents=(docs[:30], docs[30:]),
            progress=False,
        )
        for k in CLASSES
    }
    yield {"model": model, "backend": CausalLMBackend(model), "docs": docs, "arts": arts}
    if old is None:
        os.environ.pop("HARNESS_CACHE", None)
    else:
        os.environ["HARNESS_CACHE"] = old


def trained_on(env):
    """The inline (train, held-out) documents the fixture's artifacts were trained on (their key holds them)."""
    return env["docs"][:30], env["docs"][30:]


def make(env, kind, budget, sampling="beam", policy=GREEDY):
    art = env["arts"][kind]
    return CLASSES[kind](
        budget=budget,
        manifest_hash="h",
        policy=policy,
        model=env["model"],
        heads=art.heads,
        checkpoint=target_fingerprint(env["model"]),
        sampling=sampling,
        artifact_manifest=art.manifest,
    )


def run(env, proposer, *, verifier="greedy", prompt, new=24, policy=GREEDY, seed=0):
    rounds = []
    b = proposer.budget
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
        on_round=lambda **kw: rounds.append(round_of_one(kw)),
    )
    return res, rounds


def autoregressive(env, prompt, new=24):
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    return run(env, null, prompt=prompt, new=new)[0].tokens


# ---------------------------------------------------------------------------------------------- factorisation


@pytest.mark.parametrize("kind,depends", [("medusa", False), ("hydra", True), ("clover", True)])
def test_head_output_depends_on_earlier_drafted_token_only_when_dependent(kind, depends):
    torch.manual_seed(0)
    heads = DraftHeads(HeadSpec(kind=kind, num_heads=3, hidden_size=16, embed_size=16, attn_heads=2))
    for p in heads.parameters():  # zero-initialised blocks would hide nothing here, but perturb anyway
        p.data.add_(0.05 * torch.randn_like(p))
    ctx = torch.randn(1, 16)
    x_t, a, b, c = torch.randn(4, 16)
    with torch.no_grad():
        out_a = heads.depth(3, ctx, torch.stack([x_t, a, c])[None])  # path x_t, x^_{t+1}=a, x^_{t+2}=c
        out_b = heads.depth(3, ctx, torch.stack([x_t, b, c])[None])  # only the depth-1 draft differs
        out_other_pending = heads.depth(3, ctx, torch.stack([a, a, c])[None])
    assert (not torch.allclose(out_a, out_b)) == depends
    if not depends:
        assert torch.equal(out_a, out_b)  # bit-identical: Medusa head 3 never reads the drafted tokens
    if kind != "clover":
        assert not torch.allclose(out_a, out_other_pending)  # every kind reads the committed pending token
        return
    # Clover-2 reads the pending token in its augmenting block (row t - 1 with E(x_t)), into s0
    assert torch.equal(out_a, out_other_pending)
    rows = torch.randn(1, 3, 16)
    with torch.no_grad():
        s0 = [heads.augment_rows(rows, torch.stack([b, c, pend])[None], torch.arange(3)[None]) for pend in (x_t, a)]
    assert torch.equal(s0[0][:, :2], s0[1][:, :2]) and not torch.allclose(s0[0][:, 2], s0[1][:, 2])


def perturbed_heads(kind, model, seed=0):
    """Untrained heads with every parameter perturbed (no zero-initialised block hides an input)."""
    torch.manual_seed(seed)
    heads = DraftHeads(
        HeadSpec(kind=kind, num_heads=3, hidden_size=model.config.hidden_size, embed_size=model.config.hidden_size)
    )
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return heads.eval()


def test_attention_heads_constrain_the_hidden_width_only_of_heads_that_attend():
    """Medusa and Hydra without the prefix layer have no attention: a hidden width the default
    attn_heads does not divide was refused, naming an option the recipe leaves out."""
    for kind in ("medusa", "hydra"):
        spec = HeadSpec(kind=kind, num_heads=2, hidden_size=18, embed_size=18)
        heads = DraftHeads(spec)
        assert spec.attn_heads == 4 and heads.prefix is None and heads.augment is None
    for attending in (
        dict(kind="hydra", prefix_attention=True),
        dict(kind="clover"),
    ):
        with pytest.raises(ValueError, match="hidden_size 18 must be divisible by attn_heads 4"):
            HeadSpec(num_heads=2, hidden_size=18, embed_size=18, **attending)


def test_cartesian_tree_parent_dependence(env):
    """Cartesian beam trees: Medusa puts the same children below every depth-1 node, Hydra need not."""
    prompt = env["docs"][31][:8]
    shapes = {}
    for kind in ("medusa", "hydra"):
        p = CLASSES[kind](
            budget=Budget(shape="cartesian", max_nodes=21, max_depth=3, widths=(3, 2, 2)),
            manifest_hash="h",
            policy=GREEDY,
            model=env["model"],
            heads=perturbed_heads(kind, env["model"]),
            checkpoint=target_fingerprint(env["model"]),
        )
        env["backend"].prefill_one(prompt)  # the tap sees the prefill forward, as in decode()
        p.start(prompt)
        result = p.propose(prompt, TorchRandomSource(0))
        assert len(result.nodes) == 21 and result.probability_semantics == "score_only"
        kids = {}
        for n in result.nodes:
            if n.parent >= 0 and result.nodes[n.parent].parent == -1:
                kids.setdefault(n.parent, []).append(n.token_id)
        shapes[kind] = [tuple(v) for v in kids.values()]
    assert len(set(shapes["medusa"])) == 1  # [(a, b)] * 3: the product of independent marginals
    assert len(set(shapes["hydra"])) > 1


# ---------------------------------------------------------------------------------------------- topology


def test_cartesian_rows_formula():
    assert cartesian_rows([3, 2, 2]) == 21  # 3 + 6 + 12 (the Cartesian future-head tree)
    assert cartesian_rows([1, 1, 1, 1]) == 4 and cartesian_rows([4]) == 4
    with pytest.raises(ValueError, match=r"got \[3, 0\]"):
        cartesian_rows([3, 0])


@pytest.mark.parametrize("kind", ["medusa", "hydra", "clover"])
def test_cartesian_proposal_compiles_to_21_rows(env, kind):
    prompt = env["docs"][32][:8]
    p = make(env, kind, Budget(shape="cartesian", max_nodes=21, max_depth=3, widths=(3, 2, 2)))
    env["backend"].prefill_one(prompt)
    p.start(prompt)
    tree = compile_tree([p.propose(prompt, TorchRandomSource(0))], prefix_len=len(prompt))
    assert tree.num_rows == 21
    assert [int((tree.depths == d).sum()) for d in (1, 2, 3)] == [3, 6, 12]


# ---------------------------------------------------------------------------------------------- exactness


BUDGETS = [
    Budget(shape="sequence", max_nodes=3, max_depth=3),
    Budget(shape="cartesian", max_nodes=21, max_depth=3, widths=(3, 2, 2)),
]


@pytest.mark.parametrize("verifier", ["greedy", "membership"])
@pytest.mark.parametrize("budget", BUDGETS, ids=["sequence", "cartesian"])
@pytest.mark.parametrize("kind", ["medusa", "hydra", "clover"])
def test_greedy_equality(env, kind, budget, verifier):
    prompt = env["docs"][33][:6]
    expected = autoregressive(env, prompt)
    p = make(env, kind, budget)
    res, rounds = run(env, p, verifier=verifier, prompt=prompt)
    assert res.tokens == expected
    assert p.stats.extras["hidden_misses"] == 0  # h_{t-1} came from the target's own forwards every round
    # only rows on the committed path are offered for reuse: every rejected row counted as refused
    assert p.stats.extras["refused_reuse"] == 0
    assert max(len(r["selection"].accepted_rows) for r in rounds) >= 2
    assert len(rounds) < len(expected)  # some round committed more than one token


def test_critical_path_stages(env):
    prompt = env["docs"][34][:6]
    stages, expected = {}, {}
    for kind in ("medusa", "hydra"):
        p = make(env, kind, Budget(shape="sequence", max_nodes=3, max_depth=3))
        res, rounds = run(env, p, prompt=prompt)
        stages[kind] = p.stats.extras["critical_path_stages_per_round"]
        # independent: one stage; dependent: K stages, fewer where the request had fewer than K + 1
        # tokens left (the round loop cuts the tree to what the round can commit)
        left = tokens_left(rounds, 24)
        per_round = [min(1 if kind == "medusa" else 3, n - 1) for n in left]  # a last token: no head
        expected[kind] = pytest.approx(sum(per_round) / len(per_round))
    assert stages == expected
    assert left[-1] == 1 and min(per_round[:-1]) < 3  # the run had such rounds


def test_medusa_runs_only_the_heads_of_the_levels_a_capped_round_verifies(env):
    """Medusa's heads are independent, so one stage runs them all; in a request's last rounds the tree
    is compiled to fewer levels, and only those levels' heads run (every head ran, and the deeper
    heads' rows were thrown away, charged to the speculative arm)."""
    prompt = env["docs"][34][:6]
    p = make(env, "medusa", Budget(shape="sequence", max_nodes=3, max_depth=3))
    res, rounds = run(env, p, prompt=prompt)
    left = tokens_left(rounds, 24)
    assert min(left) == 1 and any(1 < n < 4 for n in left)  # the run had capped rounds
    assert p.stats.extras["lm_head_rows"] == sum(min(3, n - 1) for n in left)


def test_unexpected_forward_is_a_miss_not_a_wrong_hidden_state(env):
    """A target forward the proposer did not expect (here: an extra one) fails the cache-generation
    field of the may_reuse check; the round proposes nothing instead of reusing a row of unknown
    provenance."""
    prompt = env["docs"][35][:6]
    expected = autoregressive(env, prompt)
    p = make(env, "hydra", Budget(shape="sequence", max_nodes=3, max_depth=3))
    calls = {"n": 0}
    orig = p.propose

    def meddling(committed, rng):
        calls["n"] += 1
        if calls["n"] == 3:
            with torch.inference_mode():
                env["model"](input_ids=torch.tensor([committed[-3:]]))  # an unrelated forward
        return orig(committed, rng)

    p.propose = meddling
    res, _ = run(env, p, prompt=prompt)
    assert res.tokens == expected
    assert p.stats.extras["hidden_misses"] == 1


def one_token_requests(env, p, prompt, *, new=24):
    """A longer request, then a one-token prompt (no prefill forward) on the same proposer: the
    second request's outputs, rounds and misses, and autoregressive decoding's tokens."""
    run(env, p, prompt=env["docs"][32][:6], new=8)
    misses = p.stats.extras["hidden_misses"]
    res, rounds = run(env, p, prompt=prompt, new=new)
    return res, rounds, p.stats.extras["hidden_misses"] - misses, autoregressive(env, prompt, new=new)


@pytest.mark.parametrize("kind", ["medusa", "hydra", "clover"])
def test_a_one_token_prompt_misses_its_first_round_only(env, kind):
    """A one-token prompt runs no prefill forward: the first round has no row before its pending
    token and proposes nothing, and its verify forward (the pending token alone, on an empty cache,
    shaped like a prefill) supplies h_0, so every later round proposes (Clover's augmenting block
    reads every committed row from position 0)."""
    p = make(env, kind, Budget(shape="sequence", max_nodes=3, max_depth=3))
    res, rounds, misses, expected = one_token_requests(env, p, env["docs"][33][:1])
    assert res.tokens == expected
    assert misses == 1
    assert [r["tree"].num_rows > 0 for r in rounds_with_room(rounds, 24)] == [False] + [True] * (
        len(rounds_with_room(rounds, 24)) - 1
    )
    assert len(rounds) < len(expected)  # some later round committed more than one token


@pytest.mark.parametrize("kind", ["hydra", "clover"])
def test_a_one_token_prompts_rows_come_from_its_own_forwards_only(env, kind):
    """A one-token prompt runs no prefill forward, so the tap's last forward at ``start`` (here
    another caller's plain forward from position 0 over the same first token) is not taken as its
    prefill: the first round admits no row, and h_0 comes from the request's own verify forward."""
    p = make(env, kind, Budget(shape="sequence", max_nodes=3, max_depth=3))
    prompt = env["docs"][33][:1]
    with torch.inference_mode():
        env["model"](input_ids=torch.tensor([env["docs"][33][:4]]))  # shaped like a prefill: no cache, no mask
    state = env["backend"].prefill_one(prompt)
    p.start(prompt)
    assert p.propose(prompt, TorchRandomSource(0)).nodes == ()
    assert p.store.rows == {} and p.stats.extras["hidden_misses"] == 1
    env["backend"].verify_one(state, prompt[-1], None)  # the pending token alone, on the empty cache
    env["backend"].commit_one(state, [])
    nxt = prompt + [env["docs"][33][1]]
    assert p.propose(nxt, TorchRandomSource(0)).nodes != ()
    assert p.stats.extras["hidden_misses"] == 1


def prefix_mlp_hydra(env, tmp_path) -> HydraProposer:
    """A greedy Hydra proposer over a published-layout bank with the prefix-mlp layer (random
    weights, written to ``tmp_path``), three heads deep."""
    from checkpoint_fixtures import hydra_config, hydra_prefix_state, hydra_state, write_hydra

    from harness.heads.artifacts import load_configured_heads

    model = env["model"]
    cfg = model.config
    state = hydra_state(
        heads=3,
        layers=2,
        hidden=cfg.hidden_size,
        vocab=cfg.vocab_size,
        arch="prefix-mlp",
        embed=model.get_input_embeddings().weight,
        prefix=hydra_prefix_state(model, seed=5),
        seed=6,
    )
    path = write_hydra(tmp_path / "hydra-prefix", state, config=hydra_config(3, 2, arch="prefix-mlp"))
    art = load_configured_heads("hydra", {"artifact": str(path)}, model=model, tokenizer=None)
    p = HydraProposer(
        budget=Budget(shape="sequence", max_nodes=3, max_depth=3),
        manifest_hash="h",
        policy=GREEDY,
        model=model,
        heads=art.heads,
        checkpoint=target_fingerprint(model),
        artifact_manifest=art.manifest,
    )
    assert p.prefix_feed
    return p


def test_a_published_prefix_mlp_hydra_misses_a_one_token_prompts_first_round_only(env, tmp_path):
    """Hydra's published prefix layer reads every committed row from position 0: on a one-token
    prompt h_0 comes from the first verify forward, and the prefix layer has read every committed
    row before the pending token each round after the first."""
    p = prefix_mlp_hydra(env, tmp_path)
    fed = []
    propose = p.propose

    def spy(committed, rng):
        out = propose(committed, rng)
        fed.append((len(committed), p._prefix_fed, out.nodes != ()))
        return out

    p.propose = spy
    res, rounds, misses, expected = one_token_requests(env, p, env["docs"][34][:1], new=16)
    assert res.tokens == expected
    assert misses == 1
    fed = fed[-len(rounds) :]
    assert fed[0] == (1, 0, False)
    with_room = [f for f, left in zip(fed, tokens_left(rounds, 16)) if left > 1]
    assert len(with_room) >= 3 and all(rows == n - 1 and proposed for n, rows, proposed in with_room[1:])


# ---------------------------------------------------------------------------------------------- sampled trees


@pytest.mark.parametrize("sampling,verifier", [("iid", "specinfer"), ("without_replacement", "sequoia")])
def test_sampled_head_trees_carry_the_law_they_were_drawn_from(env, sampling, verifier):
    policy = SamplingPolicy(temperature=0.8)
    prompt = env["docs"][31][:6]
    p = make(
        env,
        "hydra",
        Budget(shape="expansion", max_nodes=12, max_depth=3, widths=(2, 2, 1)),
        sampling=sampling,
        policy=policy,
    )
    env["backend"].prefill_one(prompt)
    p.start(prompt)
    result = p.propose(prompt, TorchRandomSource(3))
    assert result.probability_semantics == "normalized_conditional" and result.sampling_relation == sampling
    assert result.q_dists is not None and result.q_dists.shape[0] == len(result.nodes)
    for i, n in enumerate(result.nodes):
        assert abs(n.q - float(result.q_dists[i, n.token_id])) < 1e-6
    # the root-level law is the depth-1 head's distribution under the sampling policy
    with torch.inference_mode():
        rows, mask = p.store.window(len(prompt) - 2, 1)
        ctx = p.heads.context(rows[None].float(), mask[None])
        emb = p.embed(torch.tensor([[prompt[-1]]])).float()
        want = policy.probs(p.lm_head(p.heads.depth(1, ctx, emb)))[0]
    assert torch.allclose(result.q_dists[0], want, atol=1e-6)
    res, rounds = run(
        env,
        make(
            env,
            "hydra",
            Budget(shape="expansion", max_nodes=12, max_depth=3, widths=(2, 2, 1)),
            sampling=sampling,
            policy=policy,
        ),
        verifier=verifier,
        prompt=prompt,
        policy=policy,
    )
    assert len(res.tokens) == 24


# ---------------------------------------------------------------------------------------------- artifacts


@pytest.mark.parametrize("kind", ["medusa", "hydra", "clover"])
def test_training_reaches_high_held_out_agreement_on_a_learnable_target(env, kind):
    model = successor_model()
    docs = [list(range(s, s + 30)) for s in range(3, 63, 2)]  # its greedy text: x, x + 1, ...
    assert greedy_docs(model, torch.tensor([docs[0][:1]]), 29)[0] == docs[0]
    opts = {
        **OPTIONS,
        "data": {"source": "inline", "token_budget": 600, "held_out_tokens": 150, "max_len": 40},
        "train": {"epochs": 10, "lr": 5e-3, "batch_size": 32},
    }
    art = ensure_heads(
        kind,
        opts,
        Target(model, None, "successor"),
        documents=(docs[::2], docs[1::2]),
        progress=False,
    )
    held = art.manifest["held_out"]
    assert all(b < 0.2 for b in held["top1_agreement_untrained"]), held  # identity init predicts x_t, not x_{t+i}
    assert all(a > 0.9 for a in held["top1_agreement"]), held


def test_heads_train_for_a_bfloat16_target(env):
    """The target's embedding and LM head run in its dtype: bf16 rows in, float32 logits out."""
    model = build_tiny_model(seed=2, dtype=torch.bfloat16)
    docs = env["docs"]
    art = ensure_heads(
        "medusa", OPTIONS, Target(model, None, "tiny seed=2 bf16"), documents=(docs[:30], docs[30:]), progress=False
    )
    held = art.manifest["held_out"]
    assert len(held["top1_agreement"]) == 3 and all(0.0 <= a <= 1.0 for a in held["top1_agreement"]), held
    assert all(p.dtype == torch.float32 for p in art.heads.parameters())


def test_manifest_fields(env):
    m = env["arts"]["hydra"].manifest
    assert len(m["held_out"]["top1_agreement"]) == 3 and m["held_out"]["rows"][0] > 0
    assert all(0.0 <= a <= 1.0 for a in m["held_out"]["top1_agreement"])
    assert m["target_hash"] == target_fingerprint(env["model"])
    assert m["token_budget"] == 1200 and 0 < m["tokens_seen"] <= 1200
    assert m["recipe"]["spec"]["kind"] == "hydra" and m["recipe"]["train"]["loss"] == "hard"
    assert m["cpu_budget_artifact"] is True and m["training"]["steps"] > 0
    assert make(env, "hydra", BUDGETS[0]).cpu_budget_artifact is True


def test_artifact_refused_against_another_target(env):
    other = build_tiny_model(seed=2)
    other.config._name_or_path = "/models/other-target"  # the configured target is named beside its hash
    with pytest.raises(
        ArtifactError,
        match=r"the configured target is \w{16}\.\.\. \('/models/other-target'\): a proposal artifact is only valid "
        r"for the target it was trained or searched on \(run it with that target, or leave proposer.artifact unset",
    ):
        ensure_heads(
            "hydra",
            {**OPTIONS, "artifact": str(env["arts"]["hydra"].path)},
            Target(other, None, "tiny seed=2"),
            progress=False,
        )


def test_artifact_refused_for_another_recipe_or_edited_manifest(env, tmp_path):
    path = env["arts"]["hydra"].path
    with pytest.raises(ArtifactError, match="mlp_layers"):
        ensure_heads(
            "hydra",
            {**OPTIONS, "mlp_layers": 4, "artifact": str(path)},
            Target(env["model"], None, "tiny"),
            progress=False,
        )
    # the differences are named as the overrides that set them, with the artifact's values to set
    other = {**OPTIONS, "data": {**OPTIONS["data"], "token_budget": 4000}, "artifact": str(path)}
    with pytest.raises(
        ArtifactError,
        match=r"was built with another recipe: proposer.data.token_budget: artifact "
        r"1200, configured 4000; to use it, set proposer.data.token_budget=1200 \(or leave",
    ):
        ensure_heads("hydra", other, Target(env["model"], None, "tiny"), progress=False)
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["held_out"]["top1_agreement"] = [0.99, 0.99, 0.99]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="edited"):
        ensure_heads(
            "hydra",
            {**OPTIONS, "artifact": str(copy)},
            Target(env["model"], None, "tiny"),
            progress=False,
        )
    (copy / "manifest.json").write_text("{bad")  # a broken file is named, not a bare JSON error
    with pytest.raises(ArtifactError, match=r"^'.*edited/manifest.json' is not valid JSON: Expecting property name"):
        ensure_heads("hydra", {**OPTIONS, "artifact": str(copy)}, Target(env["model"], None, "tiny"), progress=False)
    # a truncated weights file was safetensors' bare error, an unexpected failure (exit 1) naming no file
    cut = tmp_path / "truncated"
    shutil.copytree(path, cut)
    weights = cut / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(
        ArtifactError,
        match=r"^artifact '.*truncated': cannot read weights.safetensors as a safetensors file \(SafetensorError: "
        r".*\): rebuild it, or leave proposer.artifact unset$",
    ):
        ensure_heads("hydra", {**OPTIONS, "artifact": str(cut)}, Target(env["model"], None, "tiny"), progress=False)


def test_missing_artifact_without_auto_train_is_refused(env):
    with pytest.raises(ArtifactError, match="auto_train=false"):
        ensure_heads(
            "hydra",
            {**OPTIONS, "num_heads": 2, "auto_train": False},
            Target(env["model"], None, "tiny"),
            progress=False,
        )


def test_training_into_a_path_that_is_no_artifact_of_the_kind_is_refused_before_training(env, tmp_path):
    """force=true trained into proposer.artifact and replaced what it held: a folder of another kind's
    artifact (a Hydra bank for proposer=medusa), a user's folder for clover (no published clover
    layout); a file path trained fully, then failed. Each is refused before any training, left as it
    is, with no lock file beside it; an artifact of the same kind is retrained in place as before."""
    import shutil

    from harness.heads.artifacts import heads_artifact_path

    target = Target(env["model"], None, "tiny")
    docs = (env["docs"][:30], env["docs"][30:])
    hydra = tmp_path / "hydra"
    shutil.copytree(env["arts"]["hydra"].path, hydra)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "notes.txt").write_text("mine")
    cases = [
        ("medusa", hydra, f"proposer.artifact={str(hydra)!r} holds an artifact of kind 'hydra', not 'medusa'"),
        ("clover", mine, "is a published clover checkpoint"),
        ("medusa", tmp_path / "notes.txt", "is a file, not an artifact folder; leave proposer.artifact unset"),
    ]
    before = {p.name: sorted(q.name for q in p.iterdir()) if p.is_dir() else p.read_text() for p in tmp_path.iterdir()}
    for kind, path, message in cases:
        for force in (False, True):
            with pytest.raises(ArtifactError, match=message):
                ensure_heads(
                    kind, {**OPTIONS, "artifact": str(path)}, target, documents=docs, progress=False, force=force
                )
    after = {p.name: sorted(q.name for q in p.iterdir()) if p.is_dir() else p.read_text() for p in tmp_path.iterdir()}
    assert after == before and (mine / "notes.txt").read_text() == "mine"
    # the same kind, of the same recipe, at an explicit path: force=true retrains it there
    old = json.loads((hydra / "manifest.json").read_text())
    opts = {**OPTIONS, "train": {**OPTIONS["train"], "seed": 0}, "artifact": str(hydra)}
    art = ensure_heads("hydra", opts, target, documents=docs, progress=False, force=True)
    assert art.path == hydra and art.manifest["recipe"] == old["recipe"]
    assert art.manifest["training"]["total_seconds"] != old["training"]["total_seconds"]
    assert heads_artifact_path("hydra", opts, model=env["model"], tokenizer=None)[1] == hydra


def test_saving_never_replaces_a_folder_that_is_no_artifact_of_the_kind(tmp_path):
    """save_artifact deleted whatever folder it was given before renaming the new artifact in: it
    now refuses a folder without manifest.json, or with another kind's, and replaces its own kind's."""
    from harness.heads.checkpoint import save_artifact

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match=r"mine' is not an artifact folder \(no manifest.json in it\): nothing"):
        save_artifact(mine, manifest={"kind": "medusa"}, state={"w": torch.zeros(2)})
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ArtifactError, match="is not an artifact folder"):
        save_artifact(tmp_path / "afile", manifest={"kind": "medusa"})
    other = save_artifact(tmp_path / "other", manifest={"kind": "eagle"})
    with pytest.raises(ArtifactError, match=r"holds an artifact of kind 'eagle', not 'medusa': nothing was saved"):
        save_artifact(other, manifest={"kind": "medusa"})
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (tmp_path / "afile").read_text() == "mine"
    assert json.loads((other / "manifest.json").read_text())["kind"] == "eagle"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "mine", "other"]  # no temporary folder left
    save_artifact(other, manifest={"kind": "eagle", "n": 2})  # its own kind is replaced
    assert json.loads((other / "manifest.json").read_text())["n"] == 2


@pytest.mark.parametrize("failure", [OSError, KeyboardInterrupt])
def test_saving_over_an_artifact_keeps_the_earlier_one_when_the_new_one_cannot_take_its_place(
    tmp_path, monkeypatch, failure
):
    """The earlier artifact was removed before the new one was renamed in: a failed rename, or an
    interrupt between the two, left neither. It is moved aside instead, and goes back."""
    from pathlib import Path

    from harness.heads.checkpoint import save_artifact

    out = save_artifact(tmp_path / "art", manifest={"kind": "medusa", "n": 1}, state={"w": torch.zeros(2)})
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    real_rename = Path.rename

    def failing_rename(self, target):
        if Path(target) == out and self.name.endswith(".tmp"):  # the new artifact into place
            raise failure(28, "No space left on device") if failure is OSError else failure()
        return real_rename(self, target)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "rename", failing_rename)
        with pytest.raises(failure):
            save_artifact(out, manifest={"kind": "medusa", "n": 2}, state={"w": torch.ones(2)})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # no temporary or set-aside folder left
    save_artifact(out, manifest={"kind": "medusa", "n": 2}, state={"w": torch.ones(2)})
    assert json.loads((out / "manifest.json").read_text())["n"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_the_training_code_version_and_the_sharegpt_split_rule_are_in_the_artifact_key(env, monkeypatch):
    """A change to the heads' training code, or to the rule that splits ShareGPT, loaded the artifact
    the earlier code or split trained: both are in the recipe now, so a bumped version trains anew
    under another key, and an artifact of the earlier one named by proposer.artifact is refused."""
    from harness.heads import recipes
    from harness.heads.artifacts import heads_artifact_path
    from harness.heads.checkpoint import short_hash
    from harness.workloads import corpora

    art, version = env["arts"]["medusa"], recipes.HEADS_TRAINING
    assert art.manifest["recipe"]["training_code"] == version
    recipe, path = heads_artifact_path("medusa", OPTIONS, model=env["model"], tokenizer=None, documents=trained_on(env))
    assert path == art.path and recipe == art.manifest["recipe"]
    monkeypatch.setattr(recipes, "HEADS_TRAINING", "heads-training-next")
    assert (
        heads_artifact_path("medusa", OPTIONS, model=env["model"], tokenizer=None, documents=trained_on(env))[1]
        != art.path
    )
    with pytest.raises(
        ArtifactError,
        match=rf"another recipe: \(training_code\): artifact {version}, configured heads-training-next "
        r"\(or leave proposer.artifact unset",
    ):
        ensure_heads("medusa", {**OPTIONS, "artifact": str(art.path)}, Target(env["model"], None, "t"), progress=False)
    monkeypatch.undo()
    # the EAGLE draft's and the adapter's versions leave the heads' key alone
    monkeypatch.setattr(recipes, "EAGLE_TRAINING", "eagle-training-next")
    monkeypatch.setattr(recipes, "EXIT_TRAINING", "exit-training-next")
    assert (
        heads_artifact_path("medusa", OPTIONS, model=env["model"], tokenizer=None, documents=trained_on(env))[1]
        == art.path
    )

    monkeypatch.setattr(recipes, "file_sha256", lambda path: "a" * 64)  # the packaged ShareGPT file, read as
    sharegpt = recipes.DataRecipe()

    def key() -> str:
        return short_hash(recipes.data_sources_key(sharegpt, None))

    first = key()
    monkeypatch.setattr(corpora, "SPLIT_SALT", "harness-sharegpt-split-next")
    assert key() != first
    monkeypatch.setattr(corpora, "SPLIT_SALT", "harness-sharegpt-split-v1")
    assert key() == first
    monkeypatch.setattr(corpora, "SPLIT_BOUNDS", (("calibration", 100), ("dev", 500), ("eval", 1000), ("train", 10000)))
    assert key() != first
    assert "sharegpt_split" not in recipes.data_sources_key(recipes.DataRecipe(source="inline"), None)


def test_take_budget_stops_once_no_document_fits_the_budget_left():
    """With 1 or 2 tokens of budget left every later document is cut below 3 tokens and dropped:
    the whole split was read for nothing."""
    from harness.prepare.heads_data import take_budget

    read = []

    def documents():
        for i in range(1000):
            read.append(i)
            yield [5] * 10

    assert take_budget(documents(), 21) == [[5] * 10, [5] * 10] and len(read) == 2
    read.clear()
    assert take_budget(documents(), 23) == [[5] * 10, [5] * 10, [5] * 3] and len(read) == 3
    read.clear()
    assert take_budget(documents(), 2) == [] and read == []


def test_hydra_plus_plus_switches_are_separate_recipe_fields(env):
    base = heads_recipe("hydra", OPTIONS, env["model"])
    for switch, field_path in (
        (("mlp_layers", 4), ("spec", "mlp_layers")),
        (("distill", True), ("train", "loss")),
        (("prefix_attention", True), ("spec", "prefix_attention")),
    ):
        r = heads_recipe("hydra", {**OPTIONS, switch[0]: switch[1]}, env["model"])
        changed = [(g, k) for g in ("spec", "data", "train") for k in r[g] if r[g][k] != base[g][k]]
        assert changed == [field_path]


def test_options_that_train_no_other_weights_keep_the_recipe_and_are_listed_as_inert(env):
    """A prefix window or attention heads without the prefix-attention layer, or a distillation
    temperature under the hard-label loss, built the same heads under another key: set, they trained
    the artifact again and refused one given by path as another recipe's."""
    from harness.config import compose
    from harness.runner import inert_options

    model = env["model"]
    base = heads_recipe("hydra", OPTIONS, model)
    hot = {**OPTIONS["train"], "distill_temperature": 2.0}
    for option in ({"prefix_window": 4}, {"attn_heads": 2}, {"attn_heads": 5}, {"train": hot}):
        assert heads_recipe("hydra", {**OPTIONS, **option}, model) == base, option
    # where the options are read they stay in the recipe
    prefix = {**OPTIONS, "prefix_attention": True}
    assert (
        heads_recipe("hydra", {**prefix, "prefix_window": 4, "attn_heads": 2}, model)["spec"]
        | {
            "prefix_window": 16,
            "attn_heads": 4,
        }
        == heads_recipe("hydra", prefix, model)["spec"]
    )
    assert heads_recipe("hydra", {**prefix, "prefix_window": 4}, model)["spec"]["prefix_window"] == 4
    assert heads_recipe("clover", {**OPTIONS, "attn_heads": 2}, model)["spec"]["attn_heads"] == 2
    assert heads_recipe("hydra", {**OPTIONS, "distill": True, "train": hot}, model)["train"]["distill_temperature"] == 2

    inert = ["proposer.prefix_window=4", "proposer.attn_heads=2", "proposer.train.distill_temperature=2.0"]
    listed = inert_options(compose(["model=tiny", "proposer=hydra", *inert]))
    assert [line.partition(":")[0] for line in listed] == inert
    assert "proposer.prefix_attention=false builds no prefix-attention layer" in listed[0]
    assert "proposer.distill=true reads it" in listed[2]
    read = ["proposer.prefix_attention=true", "proposer.distill=true"]
    assert inert_options(compose(["model=tiny", "proposer=hydra", *inert, *read])) == []
    clover = inert_options(compose(["model=tiny", "proposer=clover", "proposer.attn_heads=2"]))
    assert clover == []


def test_hydra_plus_plus_artifact_trains_and_runs(env):
    opts = {
        **OPTIONS,
        "mlp_layers": 2,
        "distill": True,
        "prefix_attention": True,
        "prefix_window": 4,
        "train": {"epochs": 2, "lr": 3e-3, "batch_size": 32},
    }
    art = ensure_heads(
        "hydra",
        opts,
        Target(env["model"], None, "tiny"),
        documents=(env["docs"][:30], env["docs"][30:]),
        progress=False,
    )
    assert art.manifest["recipe"]["train"]["loss"] == "distill" and art.heads.prefix is not None
    prompt = env["docs"][33][:6]
    p = HydraProposer(
        budget=BUDGETS[1],
        manifest_hash="h",
        policy=GREEDY,
        model=env["model"],
        heads=art.heads,
        checkpoint=target_fingerprint(env["model"]),
        artifact_manifest=art.manifest,
    )
    res, _ = run(env, p, prompt=prompt)
    assert res.tokens == autoregressive(env, prompt)
    assert p.stats.extras["hidden_misses"] == 0


def test_topology_deeper_than_the_head_bank_is_refused_before_model_work():
    with pytest.raises(ValueError, match="num_heads=2"):
        HydraProposer.declare({"num_heads": 2}, Budget(shape="cartesian", max_nodes=21, max_depth=3, widths=(3, 2, 2)))
    caps = MedusaProposer.declare(
        {"sampling": "iid"}, Budget(shape="cartesian", max_nodes=21, max_depth=3, widths=(3, 2, 2))
    )
    assert caps.probability_semantics == frozenset({"normalized_conditional"}) and caps.topology == "tree"


@pytest.mark.parametrize("name", ["medusa", "hydra", "clover"])
def test_heads_at_batch_above_one_are_refused_before_model_work(name):
    """The hidden tap is batch-1: a batched run would silently propose nothing, so plan() refuses."""
    from harness.config import compose
    from harness.contracts import ConfigError
    from harness.engine.build import plan

    ok = compose(["model=tiny", f"proposer={name}", "topology=sequence"])
    big = compose(["model=tiny", f"proposer={name}", "topology=sequence", "generation.batch_size=2"])
    plan(ok)
    with pytest.raises(ConfigError, match=r"batch_size <= 1; got 2: the heads read"):
        plan(big)
    # a merged proposer built with such a source (through the API: its config offers none) serves
    # what its most limited source serves
    from harness.contracts import Budget
    from harness.proposers.merged import MergedProposer

    options = {"sources": ["prompt_lookup", name], "prompt_lookup": {}, name: {}}
    limit, why = MergedProposer.batch_limit(options, Budget(shape="sequences", max_nodes=8, max_depth=4))
    assert limit == 1 and why.startswith(f"its source {name}: the heads read")
    assert MergedProposer.batch_limit({"sources": ["prompt_lookup"], "prompt_lookup": {}}, Budget("tree", 8, 4)) == (
        None,
        "",
    )


@pytest.mark.parametrize("bias", [False, True])
def test_vocab_projection_equals_the_lm_head(bias):
    from harness.proposers.heads import vocab_projection

    torch.manual_seed(0)
    lm = torch.nn.Linear(16, 97, bias=bias)
    for n in (1, 3, 8):
        h = torch.randn(n, 16)
        got = vocab_projection(lm, h)
        assert got.shape == (n, 97)
        assert torch.allclose(got, lm(h), atol=1e-5, rtol=1e-5)
    emb = torch.nn.Embedding(10, 4)  # not a Linear: falls back to calling the module
    assert torch.equal(vocab_projection(emb, torch.tensor([1, 2])), emb(torch.tensor([1, 2])))


def test_a_saved_artifact_s_weights_are_readable_as_its_manifest_is(tmp_path):
    """safetensors writes its file 0600: a trained artifact's weights were private while its manifest
    was group-readable, so a shared cache's other users read a manifest whose weights they could not."""
    import os
    import stat

    from harness.files import plain_file_mode
    from harness.heads.checkpoint import MANIFEST_FILE, WEIGHTS_FILE, save_artifact

    out = save_artifact(tmp_path / "art", manifest={"kind": "test"}, state={"w": torch.zeros(2, 2)})
    modes = {name: stat.S_IMODE(os.stat(out / name).st_mode) for name in (WEIGHTS_FILE, MANIFEST_FILE)}
    assert modes[WEIGHTS_FILE] == modes[MANIFEST_FILE] == plain_file_mode()


def test_a_training_that_diverges_saves_nothing_and_says_to_lower_the_learning_rate(tmp_path, monkeypatch, capsys):
    """lr=1e30 drove every weight to NaN and the artifact was saved (exit 0, final_loss NaN): a run
    then loaded it and failed in a gate naming no artifact. Such a learning rate is refused before any
    model work now (above 10, and past about 3.4e37 Adam's first step overflowed float32 with a bare
    RuntimeError); a training that still diverges saves nothing, in one line naming what to change (a
    distillation's temperature too, which divides the teacher's logits)."""
    from harness.cli import main
    from harness.heads.checkpoint import ArtifactError, save_artifact

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    for lr in ("1e30", "1e38", "11"):
        argv = ["train", "model=tiny", "proposer=hydra", f"proposer.train.lr={lr}", "proposer.data.token_budget=300"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("harness train: refused: proposer.train.lr=")
        assert err.endswith("is out of range: it must be in (0, 10]")
    tiny_tau = ["proposer.distill=true", "proposer.train.distill_temperature=1e-40"]
    assert main(["train", "model=tiny", "proposer=hydra", *tiny_tau]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("harness train: refused: proposer.train.distill_temperature=") and "out of range" in err
    assert not (tmp_path / "artifacts").exists()
    nan = {"w": torch.full((2, 2), float("nan")), "b": torch.zeros(2)}
    hard = {"kind": "hydra", "recipe": {"train": {"lr": 0.5, "loss": "hard", "distill_temperature": 1.0}}}
    with pytest.raises(ArtifactError) as err:
        save_artifact(tmp_path / "hard", manifest=hard, state=nan)
    assert str(err.value).startswith("the training diverged: 1 of 2 weight tensors hold NaN or inf (w)")
    assert str(err.value).endswith("lower proposer.train.lr (now 0.5)")
    distilled = {"kind": "hydra", "recipe": {"train": {"lr": 0.001, "loss": "distill", "distill_temperature": 0.001}}}
    with pytest.raises(ArtifactError) as err:
        save_artifact(tmp_path / "distilled", manifest=distilled, state=nan)
    assert str(err.value).endswith(
        "lower proposer.train.lr (now 0.001), or raise proposer.train.distill_temperature (now 0.001)"
    )
    adapter = {"kind": "early_exit", "recipe": {"train": {"lr": 0.001, "distill_temperature": 1.0}}}
    with pytest.raises(ArtifactError, match=r"or raise proposer.train.distill_temperature \(now 1.0\)$"):
        save_artifact(tmp_path / "adapter", manifest=adapter, state=nan)
    assert not [p for p in tmp_path.iterdir() if p.name in ("hard", "distilled", "adapter")]


def test_an_early_exit_layer_mismatch_names_the_override_that_matches():
    """The recipe's top-level exit_layer was named "(exit_layer)", as a field no option sets, with no
    "to use it, set ..." line; it is proposer.exit_layer."""
    from harness.heads.checkpoint import recipe_differences

    have = {"exit_layer": 1, "data": {"token_budget": 300}, "kind": "early_exit"}
    want = {"exit_layer": 2, "data": {"token_budget": 300}, "kind": "early_exit"}
    assert recipe_differences(have, want) == [("proposer.exit_layer", 1, 2)]


def test_a_chat_template_mismatch_is_shown_as_a_derived_field_not_as_an_override_to_set(tmp_path):
    """The refusal offered workload.chat_template=<the artifact's template hash> as the fix; the
    option takes vicuna or a Jinja file, never a hash. The hash is shown in parentheses, as the
    target's fields are, and the hint names only overrides that would match the artifact."""
    from harness.heads.checkpoint import load_artifact, save_artifact

    recipe = {"data": {"chat": True, "token_budget": 300}, "train": {"loss": "hard"}, "chat_template": "a" * 16}
    path = save_artifact(tmp_path / "art", manifest={"kind": "medusa", "target_hash": "t", "recipe": recipe})

    def refusal(**changes) -> str:
        want = {**recipe, **changes}
        with pytest.raises(ArtifactError) as info:
            load_artifact(path, kind="medusa", target_hash="t", recipe=want)
        return str(info.value)

    text = refusal(chat_template="b" * 16)
    assert f"another recipe: (chat_template): artifact {'a' * 16}, configured {'b' * 16} (or leave" in text
    text = refusal(chat_template="b" * 16, train={"loss": "distill"})
    assert "(chat_template): artifact" in text and "proposer.distill: artifact false, configured true" in text
    text = refusal(chat_template=None, data={"chat": False, "token_budget": 300})
    assert "(chat_template): artifact" in text and "proposer.data.chat: artifact true, configured false" in text
    for text in (refusal(chat_template="b" * 16), refusal(chat_template="b" * 16, train={"loss": "distill"})):
        assert "workload.chat_template" not in text and "to use it, set" not in text
    # a difference an override undoes alone is still offered as the fix
    assert "to use it, set proposer.data.token_budget=300 (or leave" in refusal(data={"chat": True, "token_budget": 9})


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_the_heads_read_the_target_row_before_the_pending_token(kind):
    """Each round's context is the target's last hidden row at the position before the pending
    token (the row whose next-token logits produced it), not the pending token's own row: a row off
    by one keeps the output exact and only lowers acceptance, so greedy equality cannot catch it."""
    torch.manual_seed(0)
    model = build_tiny_model(seed=1).eval()
    cfg = model.config
    spec = HeadSpec(kind=kind, num_heads=3, hidden_size=cfg.hidden_size, embed_size=cfg.hidden_size)
    cls = {"medusa": MedusaProposer, "hydra": HydraProposer}[kind]
    p = cls(
        budget=Budget(shape="sequence", max_nodes=3, max_depth=3),
        manifest_hash="h",
        policy=GREEDY,
        model=model,
        heads=DraftHeads(spec),
        checkpoint=target_fingerprint(model),
        sampling="beam",
    )
    seen, committed_now = [], {}
    context, propose = p._round_context, p.propose

    def spy_propose(committed, rng):
        committed_now["ids"] = list(committed)
        return propose(committed, rng)

    def spy_context(pos):
        out = context(pos)
        ids = committed_now["ids"]
        with torch.inference_mode():
            rows = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [len, d]
        seen.append((pos, len(ids), out, rows))
        return out

    p.propose, p._round_context = spy_propose, spy_context
    decode(
        target=CausalLMBackend(model),
        proposer=p,
        verifier=get_verifier("greedy"),
        policy=GREEDY,
        prompt_ids=[5, 9, 17, 33, 2, 8, 40, 41],
        max_new_tokens=20,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=3, max_depth=3),
    )
    assert len(seen) >= 3 and p.stats.extras["hidden_misses"] == 0
    for pos, n, out, rows in seen:
        assert pos == n - 2  # the row before the pending token
        torch.testing.assert_close(out[0], rows[pos], rtol=1e-4, atol=1e-5)
        assert (out[0] - rows[pos + 1]).abs().max() > 1e-2  # and not the pending token's own row


def test_the_target_fingerprint_holds_no_model_alive_and_folds_in_each_calls_tokenizer():
    """The fingerprint cache held every target it saw for the whole process (a multirun's later jobs
    kept every earlier job's model), and answered a call with a tokenizer with the value computed
    without one. It holds models weakly now and folds each call's tokenizer in; a cached answer is
    the one a first computation gives."""
    import gc
    import weakref

    model = build_tiny_model(seed=3)
    plain = target_fingerprint(model)  # computed, then cached
    with_a = target_fingerprint(model, "tokenizer-a")  # a tokenizer given as its fingerprint
    assert len({plain, with_a, target_fingerprint(model, "tokenizer-b")}) == 3
    assert target_fingerprint(build_tiny_model(seed=3), "tokenizer-a") == with_a  # a fresh model: computed
    assert target_fingerprint(build_tiny_model(seed=3)) == plain
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("kernel", ["weight_major", "streaming"])
def test_the_heads_vocabulary_projection_runs_the_targets_linear_kernel(kernel):
    """The heads projected their rows through the LM head with a plain matrix product, the BLAS
    few-row path the target's own forwards leave for the harness's kernel (9.3 ms for one SmolLM2 row
    on the 2-core machine where the streaming kernel takes 2.8): every head and EAGLE proposal paid
    it per depth. Where the target runs a kernel, the projection calls the LM head's own forward."""
    from harness.heads.models import vocab_projection
    from harness.target.options import apply_linear_kernel

    model = build_tiny_model(seed=0)
    lm = model.get_output_embeddings()
    h = torch.randn(3, lm.weight.shape[1])
    plain = vocab_projection(lm, h)  # no kernel applied: the product
    assert apply_linear_kernel(model, kernel) > 0
    calls = []
    forward = lm.forward

    def spy(x):
        calls.append(x.shape)
        return forward(x)

    lm.forward = spy
    with torch.inference_mode():
        got = vocab_projection(lm, h)
    assert calls == [torch.Size([3, lm.weight.shape[1]])]
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


def test_a_head_bank_runs_the_targets_linear_kernel():
    """The heads' own linear layers took BLAS's few-row path while the target's took the harness's
    kernel (about 10% of a Clover-2 proposal on SmolLM2): a proposer built on a target that runs a
    kernel puts its bank on it; on a target with none the bank stays as it is."""
    from harness.target.options import apply_linear_kernel, linear_kernel_of

    for kernel, expected in (("default", {"default"}), ("weight_major", {"weight_major"})):
        model = build_tiny_model(seed=1)
        apply_linear_kernel(model, kernel)
        cfg = model.config
        spec = HeadSpec(kind="hydra", num_heads=2, hidden_size=cfg.hidden_size, embed_size=cfg.hidden_size)
        p = HydraProposer(
            budget=Budget(shape="sequence", max_nodes=2, max_depth=2),
            manifest_hash="h",
            policy=GREEDY,
            model=model,
            heads=DraftHeads(spec),
            checkpoint=target_fingerprint(model),
        )
        assert linear_kernel_of(p.heads) == expected


def test_a_published_checkpoint_is_a_folder_with_config_and_the_layout_s_weights(tmp_path):
    """Any folder without manifest.json is read by the published loader (which says what it lacks);
    only one with config.json and the layout's weights is a published checkpoint."""
    from harness.heads.published import is_published, is_published_checkpoint

    empty = tmp_path / "empty"
    empty.mkdir()
    assert is_published(str(empty))  # routed to the published loader, which refuses it
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for kind in ("medusa", "hydra", "eagle"):
        assert not is_published_checkpoint(str(empty), kind)
        assert not is_published_checkpoint(str(folder), kind)  # config.json alone
        assert not is_published_checkpoint(None, kind)
        assert is_published_checkpoint("owner/published-heads", kind)  # a hub id no local path shadows
    (folder / "hydra_lm_head.safetensors").write_bytes(b"w")
    assert is_published_checkpoint(str(folder), "hydra") and not is_published_checkpoint(str(folder), "medusa")
    (folder / "model.safetensors").write_bytes(b"w")
    assert is_published_checkpoint(str(folder), "medusa") and is_published_checkpoint(str(folder), "eagle")
    (folder / "manifest.json").write_text("{}")  # an artifact trained here
    assert not any(is_published_checkpoint(str(folder), kind) for kind in ("medusa", "hydra", "eagle"))


# ---------------------------------------------------------------------------------------------- state bytes


def test_a_prefix_layer_hydras_state_bytes_are_its_peak_cache_after_the_requests_finish(env, tmp_path):
    """Hydra's published prefix layer keeps a KV cache of every committed row, dropped when a request
    finishes: ``state_bytes`` (read after the run) is the most it held during any round, over requests
    of different lengths, not the one hidden row left after the last request."""
    from harness.target.backend import cache_bytes

    p = prefix_mlp_hydra(env, tmp_path)
    row = p.spec.hidden_size * torch.tensor([], dtype=p.dtype).element_size()
    held, propose = [], p.propose

    def spy(committed, rng):
        out = propose(committed, rng)
        held.append((cache_bytes(p._prefix_cache) if p._prefix_cache is not None else 0) + row)
        return out

    p.propose = spy
    peaks = []
    for prompt, new in ((env["docs"][33][:6], 24), (env["docs"][34][:4], 6)):
        res, _ = run(env, p, prompt=prompt, new=new)
        assert res.tokens == autoregressive(env, prompt, new=new)
        assert p._prefix_cache is None  # finish dropped the cache
        peaks.append(max(held))
    assert peaks[0] == peaks[1]  # the shorter second request does not lower the peak
    assert p.state_bytes() == max(held) > row
    assert max(held) > 20 * row  # the cache held a key and a value for each committed row


# ---------------------------------------------------------------------------------------------- inline documents


def test_inline_documents_key_the_artifact_and_are_refused_for_another_data_source():
    """The artifact's key held the recipe but not the inline documents (the streams' key did): other
    documents found the artifact trained on the first ones, and documents given with the default
    data.source (sharegpt) trained an artifact where the ShareGPT recipe's is looked for."""
    from harness.heads.artifacts import adapter_artifact_path, eagle_artifact_path, heads_artifact_path

    model = build_tiny_model(seed=1)
    gen = torch.Generator().manual_seed(0)
    docs_a, docs_b = (torch.randint(3, 96, (4, 12), generator=gen).tolist() for _ in range(2))
    a, b = (docs_a[:3], docs_a[3:]), (docs_b[:3], docs_b[3:])
    options = {**OPTIONS, "exit_layer": 1}
    for where in (
        lambda **k: heads_artifact_path("medusa", options, **k),
        lambda **k: eagle_artifact_path(options, **k),
        lambda **k: adapter_artifact_path({"exit_layer": 1, "data": OPTIONS["data"]}, **k),
    ):
        recipe_a, path_a = where(model=model, tokenizer=None, documents=a)
        recipe_b, path_b = where(model=model, tokenizer=None, documents=b)
        recipe, path = where(model=model, tokenizer=None)
        assert len({path_a, path_b, path}) == 3
        assert recipe_a == recipe_b == recipe  # what the manifest records and a load compares
        assert where(model=model, tokenizer=None, documents=a)[1] == path_a
    explicit = {**options, "artifact": "/somewhere"}
    assert heads_artifact_path("medusa", explicit, model=model, tokenizer=None, documents=a)[1].name == "somewhere"
    sharegpt = {**OPTIONS, "data": {k: v for k, v in OPTIONS["data"].items() if k != "source"}}
    with pytest.raises(ArtifactError, match="documents are given but data.source is 'sharegpt'"):
        heads_artifact_path("medusa", sharegpt, model=model, tokenizer=None, documents=a)
    assert heads_artifact_path("medusa", sharegpt, model=model, tokenizer=None)[1] != path


def test_training_on_documents_with_the_sharegpt_source_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    """ensure_heads trained the documents into the ShareGPT recipe's artifact folder, which a later
    run configured for ShareGPT then loaded as its own."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    model = build_tiny_model(seed=1)
    docs = torch.randint(3, 96, (12, 40), generator=torch.Generator().manual_seed(0)).tolist()
    sharegpt = {**OPTIONS, "data": {k: v for k, v in OPTIONS["data"].items() if k != "source"}}
    with pytest.raises(ArtifactError, match="set data.source=inline to train on given documents"):
        ensure_heads("medusa", sharegpt, Target(model, None, "tiny"), documents=(docs[:8], docs[8:]), progress=False)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert written == []
