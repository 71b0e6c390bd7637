"""topology=sequoia: shaped tree sampling, the tree artifact, staleness, and `harness run` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.contracts import Budget
from harness.gates.oracle import OracleCase, PrefixLaws, check_case
from harness.prepare.profile import StaleArtifactError, write_artifact
from harness.prepare.sequoia import build_tree_artifact, check_tree, cost_model_error, search_bounds
from harness.proposers.sampling import check_shape_parents, sample_shaped_tree_proposal
from harness.random_source import TorchRandomSource
from harness.topology.compiler import compile_tree
from harness.verifiers import get_verifier

TOY_P = [0.82, 0.0864, 0.022464]  # h = [0.82, 0.48, 0.24] converted (the hardware-aware toy)
TOY_T = [1.0, 1.0, 1.03, 1.08, 1.16, 1.28, 1.43, 1.62]

# ---------------------------------------------------------------- shaped sampling


def _const_levels(q: torch.Tensor):
    calls = []

    def q_level(prefixes):
        calls.append(list(prefixes))
        return q.expand(len(prefixes), -1).clone()

    return q_level, calls


def test_shaped_tree_follows_the_parent_array_level_by_level():
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q_level, calls = _const_levels(q)
    shape = [-1, 0, 0, -1, 1]  # frontier: rows 0, 3; row 0: rows 1, 2; row 1: row 4
    res = sample_shaped_tree_proposal(q_level, parents=shape, relation="without_replacement", rng=TorchRandomSource(0))
    assert [n.parent for n in res.nodes] == shape  # shape order kept (no duplicates without replacement)
    assert res.topology == "tree" and res.sampling_relation == "without_replacement"
    assert len(calls) == 3 and [len(c) for c in calls] == [1, 1, 1]  # depth 1: (), depth 2: row 0, depth 3: row 1
    assert calls[0] == [()] and calls[1] == [(res.nodes[0].token_id,)]
    assert calls[2] == [(res.nodes[0].token_id, res.nodes[1].token_id)]
    # siblings are distinct draws; the second sibling's law is q without the first's token
    assert res.nodes[0].token_id != res.nodes[3].token_id
    assert res.nodes[1].token_id != res.nodes[2].token_id
    first = res.nodes[0].token_id
    assert float(res.q_dists[3][first]) == 0.0
    assert float(res.q_dists[3].sum()) == pytest.approx(1.0)
    for node, law in zip(res.nodes, res.q_dists):
        assert node.q == pytest.approx(float(law[node.token_id]))
    # compiled: siblings of one parent are drawn in index order (rank j = j-th draw)
    tree = compile_tree([res], prefix_len=4)
    assert [d.row for d in tree.draws[0]] == [0, 3]
    assert [d.row for d in tree.draws[1]] == [1, 2]


def test_shaped_iid_duplicate_is_kept_as_a_draw_and_not_expanded():
    q = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)  # every draw is token 1
    q_level, _ = _const_levels(q)
    res = sample_shaped_tree_proposal(q_level, parents=[-1, -1, 1, 0], relation="iid", rng=TorchRandomSource(0))
    # node 1 repeats node 0's token: kept (the verifier sees two draws), its child (node 2) absent;
    # node 3 under node 0 stays, renumbered to index 2
    assert [(n.token_id, n.parent) for n in res.nodes] == [(1, -1), (1, -1), (1, 0)]
    tree = compile_tree([res], prefix_len=2)
    assert tree.num_rows == 2 and len(tree.draws[0]) == 2  # one row, two draws


def test_shaped_beam_is_score_only():
    q = torch.tensor([0.1, 0.6, 0.3])
    q_level, _ = _const_levels(q)
    res = sample_shaped_tree_proposal(q_level, parents=[-1, -1], relation="beam", rng=TorchRandomSource(0))
    assert [n.token_id for n in res.nodes] == [1, 2]
    assert res.probability_semantics == "score_only" and res.q_dists is None
    assert [n.score for n in res.nodes] == pytest.approx([0.6, 0.3])


@pytest.mark.parametrize("bad", [[], [0], [-1, 1], [-1, -2]])
def test_shape_parents_refused(bad):
    with pytest.raises(ValueError):
        check_shape_parents(bad)


def test_shaped_tree_with_sequoia_verifier_is_exact():
    """Exactness oracle: every draw and verifier branch enumerated on a Sequoia-shaped tree."""
    shape = [-1, -1, 0, 0, 2]
    q = PrefixLaws(vocab=3, seed=5, zeros=0)
    target = PrefixLaws(vocab=3, seed=11, zeros=1)

    def build(rng):
        return sample_shaped_tree_proposal(
            q.level, parents=shape, relation="without_replacement", rng=rng, source="oracle", manifest_hash="oracle"
        )

    case = OracleCase(name="sequoia-shaped", proposal_builder=build, target=target, length=4)
    row = check_case(get_verifier("sequoia"), case)
    assert row["passed"], row
    assert row["max_abs_error"] < 1e-12


def test_draft_model_samples_an_explicit_tree_and_stays_greedy_exact():
    from harness.engine.decode import RoundConfig, decode
    from harness.proposers.base import NullProposer
    from harness.proposers.draft_model import DraftModelProposer
    from harness.target.backend import CausalLMBackend
    from harness.target.loading import build_tiny_model
    from harness.verifiers.sampling import SamplingPolicy

    target = CausalLMBackend(build_tiny_model(seed=1))
    draft_model = build_tiny_model(seed=1)
    draft_model.model.layers = draft_model.model.layers[:1]
    draft_model.config.num_hidden_layers = 1
    shape = (-1, 0, 1, 0, -1)
    budget = Budget(shape="tree", max_nodes=5, max_depth=3, parents=shape)
    prop = DraftModelProposer(
        budget=budget,
        manifest_hash="h",
        policy=SamplingPolicy(temperature=0.8),
        backend=CausalLMBackend(draft_model),
        sampling="without_replacement",
    )
    prompt = [5, 17, 33, 8, 5, 17]
    prop.start(prompt)
    res = prop.propose(prompt, TorchRandomSource(3))
    assert [n.parent for n in res.nodes] == list(shape)
    assert torch.allclose(res.q_dists.sum(dim=-1), torch.ones(5))
    assert prop.seq.cache_len == len(prompt)  # branching rows dropped from the draft cache

    greedy = SamplingPolicy()
    prop_g = DraftModelProposer(
        budget=budget, manifest_hash="h", policy=greedy, backend=CausalLMBackend(draft_model), sampling="beam"
    )
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    kw = dict(
        target=target,
        verifier=get_verifier("greedy"),
        policy=greedy,
        prompt_ids=prompt,
        max_new_tokens=24,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=5, max_depth=3),
    )
    assert decode(proposer=prop_g, **kw).tokens == decode(proposer=null, **kw).tokens

    with pytest.raises(ValueError, match="over max_nodes=2"):
        DraftModelProposer(
            budget=Budget(shape="tree", max_nodes=2, max_depth=3, parents=shape),
            manifest_hash="h",
            policy=greedy,
            backend=CausalLMBackend(draft_model),
        )


@pytest.mark.parametrize(
    "shape", [(-1, 0, 1), (-1, 0, 1, 0, -1), (-1, -1, 0, 1, 2)], ids=["chain", "branching", "wide-levels"]
)
def test_the_draft_time_model_feeds_what_the_draft_model_feeds(shape):
    """The Sequoia search prices a round's first draft pass by the tokens the draft has not seen
    (harness.topology.sequoia.tree_draft_time): after a branching tree every token the last round
    committed, after a chain the bonus token alone (two where the whole chain was accepted), the
    chain's drafted rows kept. Each deeper level forwards that level's nodes with children, masked
    once the tree branches. Checked against the draft model's own forwards over a greedy run."""
    from harness.engine.decode import RoundConfig, decode
    from harness.proposers.draft_model import DraftModelProposer
    from harness.target.backend import CausalLMBackend
    from harness.target.loading import build_tiny_model
    from harness.topology.sequoia import level_internal_nodes
    from harness.verifiers.sampling import SamplingPolicy

    target = CausalLMBackend(build_tiny_model(seed=1))
    draft_model = build_tiny_model(seed=1)
    draft_model.model.layers = draft_model.model.layers[:1]  # the target's first layer: some paths accepted whole
    draft_model.config.num_hidden_layers = 1
    draft = CausalLMBackend(draft_model)
    forwards = []
    real = draft.forward_rows

    def counting(seq, ids, positions, mask):
        forwards.append((len(list(ids)), mask is not None))
        return real(seq, ids, positions, mask)

    draft.forward_rows = counting
    budget = Budget(shape="tree", max_nodes=len(shape), max_depth=3, parents=shape)
    prop = DraftModelProposer(budget=budget, manifest_hash="h", policy=SamplingPolicy(), backend=draft, sampling="beam")
    rounds = []  # (accepted, the draft's forwards of the round's proposal)
    seen = [0]

    def on_round(**kw):
        rounds.append((len(kw["selections"][0].accepted_rows), forwards[seen[0] :]))
        seen[0] = len(forwards)

    decode(
        target=target,
        proposer=prop,
        verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompt_ids=[5, 17, 33, 8, 5, 17],
        max_new_tokens=60,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=len(shape), max_depth=3),
        on_round=on_round,
    )
    root_parents = [-1, *[u + 1 for u in shape]]  # root-inclusive, as the search's trees
    levels = level_internal_nodes(root_parents)
    chain = len(set(root_parents[1:])) == len(root_parents) - 1
    depth = 1 + len(levels)
    checked = set()
    for (accepted, _), (_, passes) in zip(rounds, rounds[1:]):
        if len(passes) != 1 + len(levels):  # a round whose depth the tokens left capped
            continue
        (fed, masked), *steps = passes
        assert (fed, masked) == ((2 if accepted == depth else 1) if chain else accepted + 1, False), accepted
        # a level is masked once some level at or above it forwards more than one row
        assert steps == [(r, any(x > 1 for x in levels[: i + 1])) for i, r in enumerate(levels)]
        checked.add(accepted == depth)
    assert checked == {True, False}  # whole paths accepted, and cut short


# ---------------------------------------------------------------- the tree artifact


def _toy(synthetic=False):
    calibration = {"kind": "sequoia_calibration", "acceptance": TOY_P, "hash": "cal0"}
    profile = {
        "kind": "sequoia_hardware_profile",
        "verify_cost": TOY_T,
        "draft_cost": 0.09,
        "draft_base_cost": 0.09,  # c0 = c: Sequoia's d*c, the toy's cost model
        "t1_ms": 30.0,
        "synthetic": synthetic,
        "hash": "prof0",
    }
    return calibration, profile


SEARCH = {"max_rows": 7, "max_nodes": 8, "max_depth": 4, "min_nodes": 2}


def test_tree_artifact_reproduces_the_toy():
    calibration, profile = _toy()
    tree = build_tree_artifact(calibration=calibration, profile=profile, search=SEARCH)
    c = tree["chosen"]
    assert (c["n"], c["d"], c["candidate_rows"]) == (5, 4, 4)  # the five-node chain, not a bushier tree
    assert c["expected_tokens"] == pytest.approx(3.49588976, abs=1e-12)
    assert c["time_per_token"] == pytest.approx((1.16 + 4 * 0.09) / 3.49588976, abs=1e-12)
    assert round(c["time_per_token"], 4) == 0.4348
    assert c["time_per_token_ms"] == pytest.approx(c["time_per_token"] * 30.0)
    assert c["parents"] == [-1, 0, 1, 2, 3] and c["budget_parents"] == [-1, 0, 1, 2]
    assert tree["calibration_hash"] == "cal0" and tree["profile_hash"] == "prof0"
    assert tree["max_expected_tokens_tree"]["n"] == 8
    check_tree(tree, calibration=calibration, profile=profile, search=SEARCH, path="t")


def test_tree_artifact_refuses_synthetic_costs_and_foreign_bindings():
    calibration, profile = _toy(synthetic=True)
    with pytest.raises(StaleArtifactError, match="synthetic"):
        build_tree_artifact(calibration=calibration, profile=profile, search=SEARCH)
    calibration, profile = _toy()
    tree = build_tree_artifact(calibration=calibration, profile=profile, search=SEARCH)
    with pytest.raises(StaleArtifactError, match="binds calibration 'cal0'"):
        check_tree(tree, calibration={**calibration, "hash": "other"}, profile=profile, search=SEARCH, path="t")
    with pytest.raises(StaleArtifactError, match="binds profile"):
        check_tree(tree, calibration=calibration, profile={**profile, "hash": "other"}, search=SEARCH, path="t")
    with pytest.raises(StaleArtifactError, match="searched under"):
        check_tree(tree, calibration=calibration, profile=profile, search={**SEARCH, "max_depth": 3}, path="t")
    tampered = {**tree, "chosen": {**tree["chosen"], "parents": [-1, 0, 0]}}
    with pytest.raises(StaleArtifactError, match="optimiser now chooses"):
        check_tree(tampered, calibration=calibration, profile=profile, search=SEARCH, path="t")


def test_search_bounds_count_the_root():
    from omegaconf import OmegaConf

    assert search_bounds(OmegaConf.create({"max_nodes": 8, "max_depth": 6, "min_nodes": 2})) == {
        "max_rows": 8,
        "max_nodes": 9,
        "max_depth": 6,
        "min_nodes": 2,
    }


def test_search_bounds_key_the_depth_the_search_reaches():
    from omegaconf import OmegaConf

    # a tree of 7 candidate rows is at most 7 deep: max_depth=30 searches the trees max_depth=7 does
    deep = search_bounds(OmegaConf.create({"max_nodes": 7, "max_depth": 30, "min_nodes": 2}))
    assert deep == search_bounds(OmegaConf.create({"max_nodes": 7, "max_depth": 7, "min_nodes": 2}))
    assert deep["max_depth"] == 7
    calibration, profile = _toy()
    tree = build_tree_artifact(calibration=calibration, profile=profile, search=deep)
    check_tree(tree, calibration=calibration, profile=profile, search=deep, path="t")
    # an artifact that recorded the raw, deeper bound still binds the same search
    recorded_raw = {**tree, "search": {**deep, "max_depth": 30}}
    check_tree(recorded_raw, calibration=calibration, profile=profile, search=deep, path="t")
    with pytest.raises(StaleArtifactError, match="searched under"):
        check_tree(recorded_raw, calibration=calibration, profile=profile, search=SEARCH, path="t")


def test_cost_model_error_from_a_record():
    rec = {
        "metrics": {
            "sequoia_predicted_time_per_token_ms": 10.0,
            "time_per_committed_token_ms": 12.5,
            "sequoia_predicted_expected_tokens": 2.0,
            "mean_committed_per_round": 1.5,
        }
    }
    err = cost_model_error(rec)
    assert err["time_relative_error"] == pytest.approx(0.25)
    assert err["tokens_relative_error"] == pytest.approx(-0.25)
    assert err["measured_basis"] == "time_per_committed_token_ms"
    with pytest.raises(ValueError, match="not a topology=sequoia run"):
        cost_model_error({"metrics": {}})
    # at batch 8 the record's time per token is a batch's time over 8 requests' tokens; the model
    # predicts one request's: the measured figure compared is per request too
    batched = {"metrics": {**rec["metrics"], "time_per_committed_token_ms": 7.92, "mean_live_requests": 8.0}}
    err = cost_model_error(batched)
    assert err["measured_time_per_token_ms"] == pytest.approx(63.36)
    assert err["time_relative_error"] == pytest.approx(5.336)
    assert "per request" in err["measured_basis"]


# ---------------------------------------------------------------- `harness run` end to end

RUN = [
    "model=tiny",
    "proposer=draft_model",
    "proposer.sampling=without_replacement",
    "proposer.model.num_layers=1",
    "topology=sequoia",
    "verifier=sequoia",
    "generation.temperature=0.7",
    "threads=1",
    "topology.max_nodes=4",
    "topology.max_depth=3",
    "topology.calibration.parents=24",
    "topology.calibration.branches=4",
    "topology.calibration.max_new_tokens=12",
    "topology.profile.repeats=2",
    "topology.profile.warmup=1",
    "topology.profile.prefix_len=24",
    "gates.chi2_samples=150",
    "workload.limit=1",
    "generation.max_new_tokens=8",
    "generation.warmup_tokens=2",
]


def compose(overrides):
    from harness.app import with_sequoia
    from harness.config import compose as compose_config

    return compose_config(with_sequoia(overrides))


def test_negotiation_sees_a_tree_before_model_work():
    from harness.engine.build import plan

    p = plan(compose(RUN))
    assert p.budget == Budget(shape="tree", max_nodes=4, max_depth=3)
    assert p.capabilities.topology == "tree" and p.verifier.name == "sequoia"
    assert p.capabilities.sampling_relations == frozenset({"without_replacement"})


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One `harness run ... topology=sequoia` from an empty cache (measures every artifact)."""
    from harness.runner import run_job

    tmp = tmp_path_factory.mktemp("sequoia_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", str(tmp / "cache"))
        record = run_job(compose(RUN), run_dir=tmp / "run")
        yield tmp, record


def test_harness_run_topology_sequoia_end_to_end(first_run):
    tmp, record = first_run
    arts = record["artifacts"]
    paths = {"sequoia_tree", "sequoia_calibration", "sequoia_profile", "sequoia_profile_plot"}
    assert set(arts) == paths | {"sequoia_tree_hash", "sequoia_calibration_hash", "sequoia_profile_hash"}
    for key in paths:
        assert Path(arts[key]).parent == tmp / "cache" / "sequoia"
    for key in ("sequoia_tree", "sequoia_calibration", "sequoia_profile"):  # the artifact this run used
        assert arts[f"{key}_hash"] == json.loads(Path(arts[key]).read_text())["hash"]
    assert Path(arts["sequoia_profile_plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp / "run" / "record.json").exists()
    tree = json.loads(Path(arts["sequoia_tree"]).read_text())
    m = record["metrics"]
    assert m["sequoia_stages"] == {"calibration": "measured", "profile": "measured", "tree": "built"}
    assert m["sequoia_predicted_time_per_token_ms"] == pytest.approx(tree["chosen"]["time_per_token_ms"])
    assert m["sequoia_tree_candidate_rows"] == tree["chosen"]["candidate_rows"] <= 4
    assert m["sequoia_calibration_parents"] >= 24
    assert 0 < m["mean_candidate_rows"] <= tree["chosen"]["candidate_rows"]
    err = cost_model_error(record)
    assert err["measured_time_per_token_ms"] == m["time_per_committed_token_ms"] > 0
    assert err["time_relative_error"] == pytest.approx(
        (m["time_per_committed_token_ms"] - m["sequoia_predicted_time_per_token_ms"])
        / m["sequoia_predicted_time_per_token_ms"]
    )
    gates = record["gates"]
    assert all(gates[g]["status"] == "passed" for g in ("oracle", "end_to_end_oracle", "equivalence", "statistical"))
    assert record["gated"] is True
    assert gates["negotiation"]["topology"] == "tree" and gates["negotiation"]["verifier"] == "sequoia"


def test_next_run_reuses_the_matching_artifacts(first_run, monkeypatch):
    from harness.runner import run_job

    tmp, record = first_run
    monkeypatch.setenv("HARNESS_CACHE", str(tmp / "cache"))
    record2 = run_job(compose(RUN), run_dir=tmp / "run2")
    assert record2["metrics"]["sequoia_stages"] == {
        "calibration": "loaded (cache)",
        "profile": "loaded (cache)",
        "tree": "loaded (cache)",
    }
    assert record2["artifacts"] == record["artifacts"]


def test_stale_artifacts_are_refused(first_run, monkeypatch):
    from harness.runner import run_job

    tmp, record = first_run
    monkeypatch.setenv("HARNESS_CACHE", str(tmp / "cache"))
    arts = record["artifacts"]
    tree = json.loads(Path(arts["sequoia_tree"]).read_text())
    # a profile measured with another thread count is stale: refused, naming the field
    profile = json.loads(Path(arts["sequoia_profile"]).read_text())
    profile["provenance"]["threads"] = 2
    write_artifact({k: v for k, v in profile.items() if k != "hash"}, tmp / "stale-threads.json")
    with pytest.raises(StaleArtifactError, match=r"threads differs .*artifact 2, this run 1"):
        run_job(compose(RUN + [f"topology.profile_artifact={tmp / 'stale-threads.json'}"]), run_dir=tmp / "run3")
    # a tree artifact whose profile has another dtype
    profile["provenance"]["threads"] = 1
    profile["provenance"]["dtype"] = "float64"
    write_artifact({k: v for k, v in profile.items() if k != "hash"}, tmp / "stale-dtype.json")
    tree_stale = {**tree, "profile_path": str(tmp / "stale-dtype.json")}
    write_artifact({k: v for k, v in tree_stale.items() if k != "hash"}, tmp / "tree.json")
    with pytest.raises(StaleArtifactError, match=r"dtype differs .*'float64', this run 'float32'"):
        run_job(compose(RUN + [f"topology.tree_artifact={tmp / 'tree.json'}"]), run_dir=tmp / "run4")
    # the untouched tree artifact, given explicitly, is accepted
    ok = run_job(compose(RUN + [f"topology.tree_artifact={arts['sequoia_tree']}"]), run_dir=tmp / "run5")
    assert ok["metrics"]["sequoia_stages"]["tree"] == "loaded (topology.tree_artifact)"
    assert not (tmp / "run3" / "record.json").exists() and not (tmp / "run4" / "record.json").exists()


def test_relative_artifact_paths_are_recorded_absolute_and_the_tracked_job_is_logged(first_run, monkeypatch):
    """A relative ``topology.tree_artifact`` (or ``$HARNESS_CACHE``) went into the record as given,
    relative to the working directory, while W&B read it relative to the run folder: the file was
    "not found", the W&B run discarded and the record left untracked on every launch; and a sweep's
    complete job read from another folder was seen as "artifact gone" and run again."""
    from helpers import inspect_run

    from harness.runner import run_job
    from harness.tracking.job_folder import inspect_job

    tmp, record = first_run
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp / "wandb-home" / var.lower()))
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("HARNESS_CACHE", "cache")  # relative, as the tree below
    tree = Path(record["artifacts"]["sequoia_tree"])
    relative = tree.relative_to(tmp).as_posix()
    runs = {
        "given": RUN + [f"topology.tree_artifact={relative}", "tracking=wandb", "output_dir=rel-tree"],
        "cached": RUN + ["tracking=wandb", "output_dir=rel-cache"],
    }
    for name, overrides in runs.items():
        out = tmp / overrides[-1].split("=", 1)[1]
        done = run_job(compose(overrides), run_dir=out)
        arts = done["artifacts"]
        assert arts["sequoia_tree"] == str(tree), name  # absolute, the file the relative path named
        assert all(Path(arts[k]).is_absolute() and Path(arts[k]).is_file() for k in arts if not k.endswith("_hash"))
        assert done["tracking"] is not None and done["tracking"]["run_id"] == done["run_id"], name  # logged
        info, records = inspect_run(out, sync_dir=out / done["tracking"]["dir"])
        assert info["state"] == "finished"
        (artifact,) = [
            r["artifact"] for r in records if r.get("type") == "artifact" and r["artifact"]["type"] == "run-record"
        ]
        assert f"artifacts/sequoia_tree/{tree.name}" in {c["path"] for c in artifact["manifest"]["contents"]}
    # the complete jobs, inspected from another folder (a relaunch elsewhere), are complete
    monkeypatch.chdir(tmp / "rel-tree")
    for out in (tmp / "rel-tree", tmp / "rel-cache"):
        state = inspect_job(out, manifest_hash=json.loads((out / "record.json").read_text())["manifest_hash"])
        assert state.record is not None, state.reason
