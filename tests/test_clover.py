"""Clover-2 heads (Xiao et al., 2024) as the authors' published code builds them: the cosine-gated
regressive cell, the augmenting block over the committed rows (incremental through its KV cache),
one cell step per depth with the state carried, the proposer's one batched step per tree level,
greedy exactness with trained heads, and the architecture revision in the recipe key."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import round_of_one, tokens_left

import harness.heads.models as M
from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.heads.checkpoint import ArtifactError, artifact_dir, save_artifact, short_hash, target_fingerprint
from harness.heads.recipes import heads_recipe
from harness.prepare.heads import ensure_heads
from harness.prepare.trained import Target
from harness.proposers.base import NullProposer
from harness.proposers.heads import CloverProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy

GREEDY = SamplingPolicy()
OPTIONS = {
    "num_heads": 3,
    "data": {"source": "inline", "token_budget": 1200, "held_out_tokens": 240, "max_len": 40},
    "train": {"epochs": 3, "lr": 3e-3, "batch_size": 32},
}
#: heads_recipe(kind, OPTIONS, build_tiny_model(seed=1)) hashed (short_hash, 16), recorded before the
#: clover network became Clover-2's: Medusa's and Hydra's must not move, clover's must
KEYS_BEFORE = {"medusa": "07ced2f0bd2f1772", "hydra": "3d3334e3a403729a", "clover": "d374c4bdaacb680a"}
#: the clover spec those recipes recorded (no architecture revision)
OLD_CLOVER_SPEC = {
    "attn_heads": 4,
    "embed_size": 32,
    "hidden_size": 32,
    "kind": "clover",
    "mlp_layers": 1,
    "num_heads": 3,
    "prefix_attention": False,
    "prefix_window": 16,
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private cache, the tiny target, documents of its own greedy text, a trained clover artifact."""
    import os

    old = os.environ.get("HARNESS_CACHE")
    os.environ["HARNESS_CACHE"] = str(tmp_path_factory.mktemp("clover_cache"))
    model = build_tiny_model(seed=1)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        starts = torch.randint(3, 96, (36, 3), generator=gen)
        docs = model.generate(starts, do_sample=False, max_new_tokens=37, min_new_tokens=37, pad_token_id=0).tolist()
    art = ensure_heads(
        "clover", OPTIONS, Target(model, None, "tiny seed=1"), documents=(docs[:30], docs[30:]), progress=False
    )
    yield {"model": model, "backend": CausalLMBackend(model), "docs": docs, "art": art}
    if old is None:
        os.environ.pop("HARNESS_CACHE", None)
    else:
        os.environ["HARNESS_CACHE"] = old


def perturbed(d=16, de=16, heads=2, k=3, seed=0):
    """A clover bank with every parameter perturbed (no zero-initialised projection hides an input)."""
    torch.manual_seed(seed)
    bank = M.DraftHeads(M.HeadSpec(kind="clover", num_heads=k, hidden_size=d, embed_size=de, attn_heads=heads))
    with torch.no_grad():
        for p in bank.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return bank.eval()


def proposer(env, heads, budget, *, sampling="beam", policy=GREEDY):
    return CloverProposer(
        budget=budget,
        manifest_hash="h",
        policy=policy,
        model=env["model"],
        heads=heads,
        checkpoint=target_fingerprint(env["model"]),
        sampling=sampling,
    )


# ---------------------------------------------------------------------------------------------- the cell


def test_the_cell_gates_each_head_by_a_cosine_similarity():
    """cell(x, y) = x + V(y) ⊙ cos_h(Q(RMSNorm(x)), K(y)), against a reference written out here:
    per head, F.cosine_similarity of the query's and the key's slices scales the value's slice."""
    torch.manual_seed(0)
    d, de, heads = 12, 10, 3
    cell = M.CosineGateCell(d, de, heads)
    with torch.no_grad():
        for p in cell.parameters():
            p.add_(0.5 * torch.randn_like(p))
    x, y = torch.randn(5, d), torch.randn(5, de)
    with torch.no_grad():
        got = cell(x, y)
        gates = cell.gate(x, y)
    w = {name: t.detach() for name, t in cell.named_parameters()}
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w["norm.weight"]
    q = xn @ w["q.weight"].T + w["q.bias"]
    k = y @ w["k.weight"].T + w["k.bias"]
    v = y @ w["v.weight"].T + w["v.bias"]
    hd = d // heads
    want_gates = torch.stack(
        [
            torch.nn.functional.cosine_similarity(
                q[:, h * hd : (h + 1) * hd], k[:, h * hd : (h + 1) * hd], dim=-1, eps=1e-6
            )
            for h in range(heads)
        ],
        dim=-1,
    )
    want = x + torch.cat([v[:, h * hd : (h + 1) * hd] * want_gates[:, h : h + 1] for h in range(heads)], dim=-1)
    torch.testing.assert_close(gates, want_gates, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a gate, not a softmax: H values in [-1, 1] that need not sum to one, some of them negative
    assert gates.shape == (5, heads) and gates.abs().max() <= 1 + 1e-6 and (gates < 0).any()
    assert not torch.allclose(gates.sum(-1), torch.ones(5))
    # one key per query: the output reads y alone, not other rows' tokens
    with torch.no_grad():
        y2 = y.clone()
        y2[1:] = torch.randn(4, de)
        assert torch.equal(cell(x[:1], y2[:1]), cell(x[:1], y[:1]))
    assert not hasattr(cell, "o")  # no output projection


# ---------------------------------------------------------------------------------------------- the recurrence


def test_each_depth_carries_the_state_one_cell_step_further():
    """Depth 1 is Norm(W_1 s0); depth i >= 2 steps the state once more with the token drafted at depth
    i - 1 and reads Norm(W_2 [s; e]): depth i's output is s0 (the augmenting block's merge cell is the
    first application) then i - 1 steps of the regressive cell, and teacher-forced training makes one
    step per depth, not one recurrence from s0 per depth."""
    bank = perturbed(k=4)
    s0 = torch.randn(2, 16)
    path = torch.randn(2, 4, 16)  # E(x_t), E(x̂_{t+1}), E(x̂_{t+2}), E(x̂_{t+3})
    with torch.no_grad():
        want, s = [bank.out_norm(bank.first(s0))], s0
        for i in range(2, 5):
            s = bank.regress(s, path[:, i - 1])
            want.append(bank.out_norm(bank.deeper(torch.cat([s, path[:, i - 1]], dim=-1))))
        for i in range(1, 5):
            torch.testing.assert_close(bank.depth(i, s0, path), want[i - 1])
        calls = []
        hook = bank.regress.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
        try:
            every = bank.all_depths(s0, path)
        finally:
            hook.remove()
    torch.testing.assert_close(every, torch.stack(want, dim=1))
    assert calls == [2, 2, 2]  # K - 1 steps for K depths (recomputing from s0 would take 1 + 2 + 3)


def test_the_proposer_steps_each_tree_level_once_from_its_parents_states(env):
    """A Cartesian tree (3, 2, 2): depth 1 from s0, then one batched cell step per level (3 rows,
    then 6), each node's law the one its own path gives from scratch."""
    bank = perturbed(d=32, de=32, heads=4)
    prompt = env["docs"][31][:8]
    policy = SamplingPolicy(temperature=1.0)
    budget = Budget(shape="cartesian", max_nodes=21, max_depth=3, widths=(3, 2, 2))
    for sampling in ("beam", "iid"):
        p = proposer(env, bank, budget, sampling=sampling, policy=policy)
        steps, fed = [], []
        hooks = [
            bank.regress.register_forward_hook(lambda mod, args, out, seen=steps: seen.append(args[0].shape[0])),
            bank.augment.register_forward_hook(lambda mod, args, out, seen=fed: seen.append(args[0].shape[1])),
        ]
        try:
            env["backend"].prefill_one(prompt)
            p.start(prompt)
            assert fed == [len(prompt) - 1]  # the prompt's rows, at the request's start
            result = p.propose(prompt, TorchRandomSource(0))
        finally:
            for h in hooks:
                h.remove()
        assert fed == [len(prompt) - 1]  # the first round feeds nothing more
        ex = p.stats.extras
        assert ex["head_stages"] == 3 and ex["cell_steps"] == 2 and ex["augment_passes"] == 0
        nodes = result.nodes
        depth = [1 if n.parent == -1 else 2 if nodes[n.parent].parent == -1 else 3 for n in nodes]
        parents = {n.parent for n in nodes}
        expanded = [sum(1 for i, dp in enumerate(depth) if dp == level and i in parents) for level in (1, 2)]
        if sampling == "beam":
            assert expanded == [3, 6]
        assert steps == expanded and ex["cell_rows"] == sum(expanded)  # one step per level, each node's row once
        if sampling != "iid":
            continue
        # every node's law, recomputed from s0 along its own path
        s0 = p._prefix_out
        with torch.inference_mode():
            for i, n in enumerate(nodes):
                path, j = [], n.parent
                while j >= 0:
                    path.insert(0, nodes[j].token_id)
                    j = nodes[j].parent
                emb = p.embed(torch.tensor([[prompt[-1], *path]])).float()
                law = policy.probs(p.lm_head(bank.depth(len(path) + 1, s0, emb)), dtype=torch.float32)[0]
                torch.testing.assert_close(result.q_dists[i], law, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- the augmenting block


def test_the_augmenting_block_fed_incrementally_equals_one_causal_pass():
    bank = perturbed()
    rows, nxt = torch.randn(1, 7, 16), torch.randn(1, 7, 16)
    with torch.no_grad():
        whole = bank.augment_rows(rows, nxt, torch.arange(7)[None])[0]  # [7, d]
        cache = bank.new_prefix_cache()
        parts = [
            bank.prefix_step(rows[0, lo:hi], torch.arange(lo, hi), cache, nxt[0, lo:hi])
            for lo, hi in ((0, 4), (4, 5), (5, 7))
        ]
        # causal: the first rows' states do not see the later rows
        head = bank.augment_rows(rows[:, :4], nxt[:, :4], torch.arange(4)[None])[0]
    assert cache.length == 7
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head, whole[:4], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prompt_len", [6, 1])
def test_each_rounds_context_is_the_augmenting_block_over_every_committed_row(env, prompt_len):
    """In a decode, each round's s0 equals one causal pass of the augmenting block over the target's
    rows of every committed token before the pending one, each with the token after it. A one-token
    prompt (no prefill forward) has no such row in its first round only: h_0 comes from that round's
    verify forward, and every later round reads the block from position 0."""
    model, bank = env["model"], env["art"].heads
    p = proposer(env, bank, Budget(shape="sequence", max_nodes=3, max_depth=3))
    seen, now = [], {}
    context, propose = p._round_context, p.propose

    def spy_propose(committed, rng):
        now["ids"] = list(committed)
        return propose(committed, rng)

    def spy_context(pos):
        seen.append((pos, list(now["ids"]), context(pos)))
        return seen[-1][2]

    p.propose, p._round_context = spy_propose, spy_context
    prompt = env["docs"][34][:prompt_len]
    rounds = []
    decode(
        target=env["backend"],
        proposer=p,
        verifier=get_verifier("greedy"),
        policy=GREEDY,
        prompt_ids=prompt,
        max_new_tokens=16,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=3, max_depth=3),
        on_round=lambda **kw: rounds.append(round_of_one(kw)),
    )
    ex = p.stats.extras
    if prompt_len > 1:
        assert len(seen) >= 3 and ex["hidden_misses"] == 0
        assert ex["augment_passes"] == len(seen) - 1  # every round but the first (fed at start)
    else:  # the first round reads no context; each later round feeds the rows it committed
        assert len(seen) >= 3 and ex["hidden_misses"] == 1 and ex["augment_passes"] == len(seen)
        room = sum(left > 1 for left in tokens_left(rounds, 16))  # a round with one token left runs no head
        assert seen[0][0] == 0 and len(seen) == room - 1
    for pos, ids, ctx in seen:
        with torch.inference_mode():
            rows = model.model(input_ids=torch.tensor([ids])).last_hidden_state[:, : pos + 1]  # h_0 .. h_{t-1}
            nxt = model.get_input_embeddings()(torch.tensor([ids[1 : pos + 2]]))  # x_1 .. x_t
            want = bank.augment_rows(rows, nxt, torch.arange(pos + 1)[None])[0, -1]
        torch.testing.assert_close(ctx[0], want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize(
    "budget",
    [
        Budget(shape="sequence", max_nodes=3, max_depth=3),
        Budget(shape="cartesian", max_nodes=21, max_depth=3, widths=(3, 2, 2)),
    ],
    ids=["sequence", "cartesian"],
)
def test_trained_clover_heads_keep_greedy_output_exact(env, budget):
    art = env["art"]
    assert art.manifest["recipe"]["spec"]["version"] == M.CLOVER_VERSION
    assert any(k.startswith("augment.layers.") for k in art.heads.state_dict())
    prompt = env["docs"][33][:6]
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    cfg = dict(
        target=env["backend"],
        verifier=get_verifier("greedy"),
        policy=GREEDY,
        prompt_ids=prompt,
        max_new_tokens=24,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=budget.max_nodes, max_depth=budget.max_depth),
    )
    expected = decode(proposer=null, **cfg).tokens
    p = proposer(env, art.heads, budget)
    rounds = []
    res = decode(proposer=p, on_round=lambda **kw: rounds.append(round_of_one(kw)), **cfg)
    assert res.tokens == expected
    assert len(rounds) < len(expected)  # some round committed more than one token
    ex = p.stats.extras
    assert ex["hidden_misses"] == 0 and ex["refused_reuse"] == 0
    depths = [min(3, n - 1) for n in tokens_left(rounds, 24)]  # a last token: no head
    assert ex["head_stages"] == sum(depths) and ex["cell_steps"] == sum(max(d - 1, 0) for d in depths)
    assert ex["augment_passes"] == len(rounds) - 1
    assert ex["critical_path_stages_per_round"] == pytest.approx(sum(depths) / len(rounds))


# ---------------------------------------------------------------------------------------------- artifacts


def test_the_clover_revision_moves_only_clovers_recipe_key(env, tmp_path):
    model = env["model"]

    def before_loss_tokens(recipe: dict) -> dict:  # the keys were pinned before the data recipe named them
        return {**recipe, "data": {k: v for k, v in recipe["data"].items() if k != "loss_tokens"}}

    keys = {k: short_hash(before_loss_tokens(heads_recipe(k, OPTIONS, model)), 16) for k in KEYS_BEFORE}
    assert keys["medusa"] == KEYS_BEFORE["medusa"] and keys["hydra"] == KEYS_BEFORE["hydra"]
    assert keys["clover"] != KEYS_BEFORE["clover"]
    spec = heads_recipe("clover", OPTIONS, model)["spec"]
    assert spec == {**OLD_CLOVER_SPEC, "version": M.CLOVER_VERSION}
    for kind in ("medusa", "hydra"):
        assert "version" not in heads_recipe(kind, OPTIONS, model)["spec"]
    with pytest.raises(ValueError, match="clover architecture"):
        M.HeadSpec(**{**OLD_CLOVER_SPEC, "version": "clover-1"})

    # an artifact of the earlier network (its recipe without the revision, its weights another
    # network's) is refused by its recipe, and the cache looks for the new one elsewhere
    art = env["art"]
    manifest = json.loads((art.path / "manifest.json").read_text())
    for k in ("artifact_id", "weights_sha256", "version"):
        manifest.pop(k)
    manifest["recipe"]["spec"].pop("version")
    old_state = {"state_norm.weight": torch.ones(32), "regress.q.weight": torch.zeros(32, 32)}
    old = save_artifact(tmp_path / "old", manifest=manifest, state=old_state)
    with pytest.raises(ArtifactError, match=r"another recipe: \(spec.version\): artifact null, configured clover-2"):
        ensure_heads("clover", {**OPTIONS, "artifact": str(old)}, Target(model, None, "tiny"), progress=False)
    assert artifact_dir("clover", target_hash=manifest["target_hash"], recipe=manifest["recipe"]) != art.path
    # and weights of another network never load into this one (strict)
    with pytest.raises(RuntimeError, match="Missing key"):
        M.DraftHeads(M.HeadSpec(**spec)).load_state_dict(old_state, strict=True)


def test_clover_refuses_switches_it_does_not_have():
    """Hydra's switches (per-depth MLP blocks, the Hydra++ prefix layer) are refused before any model
    work, and by the spec itself."""
    chain = Budget(shape="sequence", max_nodes=3, max_depth=3)
    with pytest.raises(ValueError, match=r"^proposer.mlp_layers=4 and proposer.prefix_attention=true: clover heads"):
        CloverProposer.declare({"mlp_layers": 4, "prefix_attention": True}, chain)
    CloverProposer.declare({"mlp_layers": 1, "prefix_attention": False}, chain)
    with pytest.raises(ValueError, match="mlp_layers=1 and prefix_attention=false"):
        M.HeadSpec(kind="clover", num_heads=3, hidden_size=16, embed_size=16, mlp_layers=4)
    with pytest.raises(ValueError, match="mlp_layers=1 and prefix_attention=false"):
        M.HeadSpec(kind="clover", num_heads=3, hidden_size=16, embed_size=16, prefix_attention=True)
    with pytest.raises(ValueError, match="version names a clover"):
        M.HeadSpec(kind="hydra", num_heads=3, hidden_size=16, embed_size=16, version="clover-2")


# ---------------------------------------------------------------------------------------------- training


def test_training_reads_each_anchors_state_from_its_own_documents_rows():
    """A clover training step: pieces of consecutive anchors of one run (several short ones packed),
    each anchor's s0 the augmenting block over its run's rows from the start to t - 1, each with the
    token after it, as a decode over that document would compute it."""
    from harness.prepare.heads_data import PackedStream
    from harness.prepare.heads_training import clover_context, clover_pieces, gather_clover_batch, pack_pieces
    from harness.prepare.teacher_rows import max_head, run_lengths

    torch.manual_seed(0)
    bank = perturbed(k=2)
    seg = torch.tensor([0] * 9 + [1] * 4 + [2] * 7)
    n = seg.numel()
    stream = PackedStream(
        tokens=torch.randint(3, 50, (n,)),
        segment_ids=seg,
        valid=torch.ones(n, dtype=torch.bool),
        hidden=torch.randn(n, 16).half(),
        meta={},
    )
    heads_max = max_head(stream.segment_ids, stream.valid, max_future=2)
    run = run_lengths(stream.segment_ids, stream.valid)
    anchors = torch.nonzero(heads_max >= 1).flatten()
    pieces = clover_pieces(anchors, run, 3)
    by_run = [(0, [1, 2, 3]), (0, [4, 5, 6]), (0, [7]), (9, [10, 11]), (13, [14, 15, 16]), (13, [17, 18])]
    assert [(s, a.tolist()) for s, a in pieces] == by_run
    steps = pack_pieces(pieces, 5)
    packed = [[[1, 2, 3]], [[4, 5, 6], [7]], [[10, 11], [14, 15, 16]], [[17, 18]]]
    assert [[a.tolist() for _, a in step] for step in steps] == packed
    embed = torch.nn.Embedding(50, 16)
    for step in steps:
        batch = gather_clover_batch(stream, step, heads=heads_max, run=run, num_heads=2)
        with torch.no_grad():
            got = clover_context(bank, batch, embed=embed)
            for row, t in enumerate(batch.anchors.tolist()):
                start = int(t - run[t - 1])
                rows = stream.hidden[start:t].float()[None]
                nxt = embed(stream.tokens[start + 1 : t + 1])[None]
                want = bank.augment_rows(rows, nxt, torch.arange(t - start)[None])[0, -1]
                torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- state bytes


def test_state_bytes_report_the_augmenting_blocks_peak_cache_after_the_requests_finish(env):
    """The augmenting block's KV cache grows with every committed row and is dropped when a request
    finishes: ``state_bytes`` (read after the run) is the most it held during any round, over
    requests of different lengths, not the one hidden row left after the last request."""
    p = proposer(env, env["art"].heads, Budget(shape="sequence", max_nodes=3, max_depth=3))
    row = p.spec.hidden_size * torch.tensor([], dtype=p.dtype).element_size()
    held, propose = [], p.propose

    def spy(committed, rng):
        out = propose(committed, rng)
        held.append(p._prefix_cache.nbytes() + row if p._prefix_cache is not None else row)
        return out

    p.propose = spy
    peaks = []
    for prompt, new in ((env["docs"][33][:6], 24), (env["docs"][34][:4], 6)):
        decode(
            target=env["backend"],
            proposer=p,
            verifier=get_verifier("greedy"),
            policy=GREEDY,
            prompt_ids=prompt,
            max_new_tokens=new,
            eos_token_ids=frozenset(),
            rng=TorchRandomSource(0),
            round_cfg=RoundConfig(max_nodes=3, max_depth=3),
        )
        assert p._prefix_cache is None  # finish dropped the cache
        peaks.append(max(held))
    assert peaks[0] == peaks[1]  # the shorter second request does not lower the peak
    assert p.state_bytes() == max(held) > row
    assert max(held) > 20 * row  # the cache held a key and a value per layer for each committed row
