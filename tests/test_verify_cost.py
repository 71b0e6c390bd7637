import pytest
from helpers import load_script

from harness.target.backend import CausalLMBackend
from harness.target.timing import monotone_fit, verify_cost_curve


def test_verify_cost_curve_shape(tiny_model):
    backend = CausalLMBackend(tiny_model)
    prof = verify_cost_curve(backend, list(range(3, 40)), max_rows=10, reps=2)
    t = prof["normalised"]
    assert len(t) == 11 and t[0] == 1.0
    assert all(b >= a for a, b in zip(t, t[1:]))  # monotone: more rows never cost less
    assert prof["measured_rows"][0] == 0 and prof["measured_rows"][-1] == 10


def test_a_batched_runs_curve_times_forwards_of_that_many_requests(tiny_model, monkeypatch):
    import harness.target.timing as timing

    seen = []
    real = timing.median_verify_ms
    monkeypatch.setattr(timing, "median_verify_ms", lambda b, **kw: seen.append(kw["batch_size"]) or real(b, **kw))
    prof = verify_cost_curve(CausalLMBackend(tiny_model), list(range(3, 40)), max_rows=4, reps=1, batch_size=3)
    assert seen == [3] and prof["batch_size"] == 3 and prof["t_profile"]["batch_size"] == 3


def test_an_adaptive_run_at_batch_two_prices_rows_on_its_batch_and_learns_from_its_rounds(tmp_path, monkeypatch):
    """At batch 2 the adaptive budget's t(n) is measured over forwards of two requests, and the
    rounds both requests share correct it (the record says how many it observed)."""
    from harness.config import compose
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    overrides = ["model=tiny", "proposer.budget_policy=adaptive", "topology=sequences", "generation.batch_size=2"]
    overrides += ["workload.limit=2", "generation.max_new_tokens=12", "gates.oracle=false", "threads=1"]
    record = run_job(compose([*overrides, f"output_dir={tmp_path / 'run'}"]), run_dir=tmp_path / "run")
    assert record["t_profile"]["batch_size"] == 2
    assert record["metrics"]["retrieval"]["adaptive_budget"]["verify_rounds_observed"] > 0


def test_the_monotone_fit_averages_a_dip_instead_of_carrying_a_slow_sample_forward():
    assert monotone_fit([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]  # a running max: [1, 3, 3, 4]
    assert monotone_fit([5.0, 1.0, 1.0, 1.0]) == [2.0, 2.0, 2.0, 2.0]
    assert monotone_fit([1.0, 2.0, 2.0, 7.0]) == [1.0, 2.0, 2.0, 7.0]  # already monotone: unchanged


def test_one_round_calls_rotate_the_order_by_the_callers_count(tiny_model, monkeypatch):
    import harness.target.timing as timing

    order = []
    monkeypatch.setattr(
        timing,
        "timed_verify_ms",
        lambda b, s, *, pending, tree, clock: order.append(0 if tree is None else tree.num_rows) or 1.0,
    )
    backend = CausalLMBackend(tiny_model)
    for sweep in range(3):
        timing.verify_times(backend, prefix_ids=list(range(3, 20)), ns=[1, 2, 3], warmup=0, repeats=1, rotation=sweep)
    # the tree holds the candidate rows (n - 1): each sweep starts one size further on
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_shapes_timed_together_run_each_size_back_to_back_and_take_turns_going_first(tiny_model, monkeypatch):
    import harness.target.timing as timing

    order, prefills = [], []
    monkeypatch.setattr(
        timing,
        "timed_verify_ms",
        lambda b, s, *, pending, tree, clock: (
            order.append(
                (0, "-") if tree is None else (tree.num_rows, "chain" if tree.num_rows == 1 or _chain(tree) else "heap")
            )
            or 1.0
        ),
    )
    backend = CausalLMBackend(tiny_model)
    real_prefill = backend.prefill
    monkeypatch.setattr(backend, "prefill", lambda ids: prefills.append(len(ids)) or real_prefill(ids))
    got = timing.verify_times_by_shape(
        backend, prefix_ids=list(range(3, 20)), ns=[3, 4], shapes=("chain", "heap"), warmup=1, repeats=2
    )
    assert prefills == [1]  # one cache for every shape
    # round 0 (warm-up): 3 then 4, chain first; round 1: 4 then 3, heap first; round 2: as round 0
    assert order == [
        (2, "chain"), (2, "heap"), (3, "chain"), (3, "heap"),
        (3, "heap"), (3, "chain"), (2, "heap"), (2, "chain"),
        (2, "chain"), (2, "heap"), (3, "chain"), (3, "heap"),
    ]  # fmt: skip
    assert {s: {n: len(v) for n, v in by_n.items()} for s, by_n in got.items()} == {
        "chain": {3: 2, 4: 2},
        "heap": {3: 2, 4: 2},
    }  # warm-up left out
    with pytest.raises(ValueError, match="a shape"):
        timing.verify_times_by_shape(backend, prefix_ids=list(range(3, 20)), ns=[1], shapes=())


def _chain(tree) -> bool:
    """Whether a compiled tree's candidate rows form one chain (each row's parent the row before it)."""
    return all(p == k - 1 for k, p in enumerate(tree.parents.tolist()))


def test_the_regimes_script_splits_sweeps_by_bandwidth_quartile():
    script = load_script("verify_cost_regimes")
    # a slow state (20 GB/s: one row 15 ms, rows nearly free) and a fast one (60 GB/s: 10 ms, rows cost)
    slow = [{"read_bandwidth_gbs": 20.0 + i / 10, "ms": [15.0, 15.5, 14.9, 18.0]} for i in range(4)]
    fast = [{"read_bandwidth_gbs": 60.0 + i / 10, "ms": [10.0, 12.0, 14.0, 17.0]} for i in range(4)]
    mid = [{"read_bandwidth_gbs": 40.0, "ms": [99.0] * 4} for _ in range(4)]
    got = script.state_curves(slow + mid + fast)
    low, high = got["low_bandwidth"], got["high_bandwidth"]
    assert low["sweeps"] == 3 and high["sweeps"] == 3  # the quartiles: the middle sweeps are in neither
    assert low["median_ms"] == [15.0, 15.5, 14.9, 18.0]
    assert low["t_of_n_ms"] == pytest.approx([15.0, 15.2, 15.2, 18.0])  # made non-decreasing
    assert high["t_of_n_ms"] == [10.0, 12.0, 14.0, 17.0]
    assert high["read_bandwidth_gbs"] == [60.1, 60.3]
    with pytest.raises(ValueError, match="no sweeps"):
        script.state_curves([])


def test_the_roofline_script_sets_each_shapes_t_of_n_against_the_floors(tmp_path):
    import json

    script = load_script("verify_roofline")
    assert script.main(["--model", "tiny", "--rows", "1", "3", "--rounds", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "roofline.json").read_text())
    assert len(result["bandwidth_samples_gbs"]) == 2 and len(result["peak_samples_gflops"]) == 2
    for shape in ("chain", "heap"):
        assert all(len(v) == 2 for v in result["samples_ms"][shape].values())  # one forward a round
        roof = result["shapes"][shape]
        assert roof["rows"] == [1, 3] and roof["prefix_len"] == 256
        assert roof["t_vs_floor"] == [pytest.approx(t / f) for t, f in zip(roof["t_ms"], roof["floor_ms"], strict=True)]
    text = (tmp_path / "roofline.md").read_text()
    assert "| n | chain ms | tree ms |" in text and text.count("\n| 3 |") == 1
    assert (tmp_path / "roofline.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        script.main(["--rows", "0", "--out", str(tmp_path)])


def test_an_adaptive_chain_prices_the_rows_its_rounds_can_verify_not_max_nodes(tmp_path, monkeypatch):
    """topology=sequence drafts one chain of max_depth rows whatever topology.max_nodes says (a run
    calls max_nodes inert there), but the prepare stage timed forwards of up to max_nodes + 1 rows
    (max_nodes=4000: a 4,001-row forward past the model's positions, kept in the record's t(n)). It
    times t(1..max_depth + 1) now; the proposer asks that many values, and a shorter verify_cost
    given by hand is refused before any model work (it was refused once the models had loaded)."""
    import harness.prepare.verify_cost as prepare_vc
    from harness.config import compose
    from harness.contracts import Budget, ConfigError
    from harness.proposers.prompt_lookup import PromptLookupProposer
    from harness.runner import run_job
    from harness.topology.budgets import verified_rows

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    asked = []
    real = prepare_vc.verify_cost_curve
    monkeypatch.setattr(prepare_vc, "verify_cost_curve", lambda b, ids, **kw: asked.append(kw) or real(b, ids, **kw))
    overrides = ["model=tiny", "proposer.budget_policy=adaptive", "topology=sequence", "topology.max_nodes=4000"]
    overrides += ["topology.max_depth=4", "workload.limit=1", "generation.max_new_tokens=8", "gates.enabled=false"]
    record = run_job(compose([*overrides, f"output_dir={tmp_path / 'run'}"]), run_dir=tmp_path / "run")
    assert [kw["max_rows"] for kw in asked] == [4] and max(record["t_profile"]["n"]) == 5

    chain = Budget(shape="sequence", max_nodes=4000, max_depth=4)
    assert verified_rows(chain)[0] == 4
    PromptLookupProposer(
        budget=chain, manifest_hash="h", budget_policy="adaptive", verify_cost=[1.0, 1.1, 1.2, 1.3, 1.4]
    )
    with pytest.raises(ValueError, match=r"needs verify_cost t\(1\.\.5\)"):
        PromptLookupProposer(
            budget=chain, manifest_hash="h", budget_policy="adaptive", verify_cost=[1.0, 1.1, 1.2, 1.3]
        )
    from harness.runner import plan_job

    short = ["model=tiny", "proposer.budget_policy=adaptive", "topology=sequences", "proposer.verify_cost=[1.0,1.1]"]
    with pytest.raises(ConfigError) as refused:
        plan_job(compose(short), None)
    assert str(refused.value).startswith(
        "proposer.verify_cost=[1.0,1.1] prices 2 row count(s): a round verifies up to 16 candidate rows, so the "
        "adaptive budget needs t(1..17) (17 values), or none (the run measures it)"
    )
    # prompt lookup as a merged source: its own key, refused before model work as alone
    merged = ["model=tiny", "proposer=merged", "topology=merged", "proposer.sources=[prompt_lookup]"]
    merged += ["proposer.prompt_lookup.budget_policy=adaptive"]
    with pytest.raises(ConfigError) as refused:
        plan_job(compose([*merged, "proposer.prompt_lookup.verify_cost=[1.0,1.1]"]), None)
    assert str(refused.value).startswith("proposer.prompt_lookup.verify_cost=[1.0,1.1] prices 2 row count(s)")
    assert refused.value.suggestions == (("proposer.prompt_lookup.verify_cost=null",),)
    plan_job(compose([*merged, f"proposer.prompt_lookup.verify_cost={[1.0] * 40}"]), None)


def test_a_dynamic_tree_verifies_at_most_the_rows_its_pool_holds():
    """EAGLE-2's dynamic tree reranks a pool of topk rows at its first level and topk**2 at each later
    one: topology.max_nodes above that was reserved (cache rows, temporary KV) for rows no round drafts."""
    from harness.contracts import Budget
    from harness.topology.budgets import verified_rows

    rows, why = verified_rows(Budget(shape="dynamic", max_nodes=100, max_depth=3, topk=2))
    assert rows == 2 + 2 * 4 and "topology=dynamic's pool holds" in why
    assert verified_rows(Budget(shape="dynamic", max_nodes=6, max_depth=3, topk=2)) == (6, None)
