"""What `harness run` writes: the record's required fields, outputs.jsonl, the t(n) profile of an
adaptive lookup run, and that the store accepts the record."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.config import compose
from harness.runner import run_job
from harness.tracking.store import load_record


def test_adaptive_lookup_run_writes_a_complete_record(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        [
            "model=tiny",
            "topology=sequences",
            "proposer.budget_policy=adaptive",
            "workload.limit=2",
            "generation.max_new_tokens=12",
            "gates.oracle=false",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    record = run_job(cfg, run_dir=tmp_path / "run")
    stored = load_record(tmp_path / "run" / "record.json")  # validates schema and required keys
    assert stored["run_id"] == record["run_id"]
    m = record["metrics"]
    for key in (
        "time_per_committed_token_ms",
        "ar_time_per_token_ms",
        "speedup",
        "ttft_ms",
        "committed_tokens",
        "rounds",
        "mean_committed_per_round",
        "acceptance_by_depth",
        "reach_by_depth",
        "accepted_length_hist",
        "first_child_coverage",
        "fallback_rate",
        "round_cost_ms",
        "temp_kv_bytes_peak",
        "temp_kv_bytes_formula",
        "proposal_state_bytes",
        "peak_rss_bytes",
        "greedy_identical",
        "greedy_near_ties",
    ):
        assert key in m, key
    assert set(m["round_cost_ms"]) == {
        "proposal",
        "retrieval",
        "packing",
        "target_verify",
        "selection",
        "temporary_state",
    }
    assert m["greedy_identical"] is True
    learned = m["retrieval"]["adaptive_budget"]  # what the adaptive budget learned, after the last request
    assert len(learned["verify_cost_ms"]) == cfg.topology.max_nodes + 1  # t(1 .. 1 + max_nodes)
    assert all(b >= a > 0 for a, b in zip(learned["verify_cost_ms"], learned["verify_cost_ms"][1:]))
    assert learned["acceptance_rows_learned"] > 0
    assert m["temp_kv_bytes_peak"] == m["temp_kv_bytes_formula"]
    assert m["decode_speedup"] == m["ar_time_per_token_ms"] / m["time_per_committed_token_ms"]
    assert m["speedup"] == m["ar_end_to_end_time_per_token_ms"] / m["end_to_end_time_per_token_ms"]
    assert record["metric_notes"]["speedup"].startswith("AR end-to-end time per token")
    # at batch 1 a batch's decode time is its request's latency (the note said "a little over" it)
    assert all(
        q["spec_decode_ms"] == q["spec_batch_decode_ms"] and q["ar_decode_ms"] == q["ar_batch_decode_ms"]
        for q in record["per_prompt"]
    )
    assert "its wall time that request's latency" in record["metric_notes"]["time_per_committed_token_ms"]
    assert record["gated"] is False and record["gates"]["oracle"]["status"] == "skipped"  # gates.oracle=false
    prof = record["t_profile"]
    assert prof["n"][0] == 1 and len(prof["n"]) == len(prof["t"]) and all(t > 0 for t in prof["t"])
    # each point against its roofline floor, at the bandwidth the record's floor used
    roof = prof["roofline"]
    assert roof["read_bandwidth_gbs"] == m["read_bandwidth_gbs"] and roof["matmul_peak_gflops"] > 0
    assert roof["matmul_peak_size"] == 2048  # the CPU's product side, recorded beside its rate
    assert roof["prefix_len"] > 0 and roof["batch_size"] == 1
    assert len(prof["floor_ms"]) == len(prof["n"]) and min(prof["floor_ms"]) >= m["weight_stream_floor_ms"]
    assert prof["t_vs_floor"] == [pytest.approx(t / f) for t, f in zip(prof["t"], prof["floor_ms"], strict=True)]
    assert record["hardware"]["torch_threads"] >= 1 and record["manifest_hash"]
    # this job's peak host memory, the CUDA peaks (none on CPU), the counts behind acceptance by depth
    assert m["peak_rss_method"] in {"vmhwm_reset", "sampled"} and m["peak_rss_bytes"] >= m["rss_start_bytes"] > 0
    assert m["cuda_peak_allocated_bytes"] is None and m["ar_cuda_peak_reserved_bytes"] is None
    tried, accepted = m["rounds_tried_by_depth"], m["rounds_accepted_by_depth"]
    with_tree = m["rounds"] - round(m["fallback_rate"] * m["rounds"])
    assert (tried[0] if tried else 0) == with_tree  # every round with a tree tried depth 1
    assert [a / n if n else None for a, n in zip(accepted, tried)] == m["acceptance_by_depth"]
    # the per-round series beside the record: one row per speculative round
    rounds = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    series_bytes = (tmp_path / "run" / "rounds.jsonl").read_bytes()
    assert record["round_series"] == {
        "file": "rounds.jsonl",
        "rows": len(rounds),
        "arm": "spec",
        "sha256": hashlib.sha256(series_bytes).hexdigest(),  # bound as the outputs are
    }
    assert len(rounds) == m["rounds"] and sum(r["committed"] for r in rounds) == m["committed_tokens"]
    assert sum(r["accepted"] for r in rounds) == sum(k * n for k, n in enumerate(m["accepted_length_hist"]))
    assert {r["prompt_id"] for r in rounds} == {"HumanEval/0", "HumanEval/1"}
    assert all(r["ms"] == pytest.approx(sum(r[f"{s}_ms"] for s in m["round_cost_ms"])) for r in rounds)
    # the temporary KV the cache grew by (measured) is the widest round's rows (batch 1) x bytes per token
    widest = max(r["candidate_rows"] for r in rounds)
    assert widest > 0 and m["temp_kv_bytes_peak"] == widest * m["kv_bytes_per_token"]
    assert m["temp_kv_bytes_peak"] <= m["temp_kv_bytes_budget_formula"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert all(x["ar_token_ids"] == x["spec_token_ids"] for x in lines)
    assert {"prompt_id", "prompt_token_ids", "ar_token_ids", "spec_token_ids", "ar_text", "spec_text"} <= set(lines[0])


def test_the_speculative_arm_pays_for_its_drafts_prefill(tmp_path, monkeypatch):
    """A draft model's prompt forward (``proposer.start``) is inside the speculative arm's time: its
    TTFT and end-to-end time per token include it, and the record says which time speedup uses."""
    import time

    from harness.proposers.draft_model import DraftModelProposer

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    real_start = DraftModelProposer.start

    def slow_start(self, prompt_ids):  # a draft whose prefill costs 80 ms
        time.sleep(0.08)
        real_start(self, prompt_ids)

    monkeypatch.setattr(DraftModelProposer, "start", slow_start)
    cfg = compose(
        [
            "model=tiny",
            "proposer=draft_model",
            "proposer.sampling=beam",
            "topology=sequence",
            "topology.max_nodes=2",
            "topology.max_depth=2",
            "workload.limit=2",
            "generation.max_new_tokens=6",
            "gates.enabled=false",
        ]
    )
    m = run_job(cfg, run_dir=tmp_path / "run")["metrics"]
    assert m["prefill_ms_total"] >= 2 * 80 and m["ar_prefill_ms_total"] < 80  # two prompts, draft arm only
    assert m["ttft_ms"] >= 80 > m["ar_ttft_ms"]
    spec_tokens = m["committed_tokens"]
    assert m["end_to_end_time_per_token_ms"] - m["time_per_committed_token_ms"] >= 2 * 80 / spec_tokens
    assert m["speedup"] < m["decode_speedup"]  # the draft's prefill is charged to the speculative arm


def test_a_lookup_run_with_history_reads_earlier_requests_and_stays_exact(tmp_path, monkeypatch):
    """Prompt lookup over earlier requests' outputs (the default experiment's setting) in a whole
    run: warm-up, both arms, gates. Every prompt's speculative output equals its autoregressive one
    and later requests were served candidates from the history."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        [
            "model=tiny",
            "topology=sequences",
            "proposer.budget_policy=adaptive",
            "proposer.verify_cost=[1.0,1.01,1.02,1.03,1.04,1.05,1.06,1.07,1.08,1.09,1.1,1.11,1.12,1.13,1.14,1.15,1.16]",
            "proposer.history_tokens=4096",
            "workload.limit=4",
            "generation.max_new_tokens=24",
            "gates.oracle=false",
        ]
    )
    m = run_job(cfg, run_dir=tmp_path / "run")["metrics"]
    assert m["greedy_identical"] is True
    assert m["retrieval"]["rows_kept_from_history"] > 0
    assert m["proposal_state_bytes"] > 0


def test_the_record_carries_paired_bootstrap_intervals_of_both_speedups():
    """The record's intervals are the ones `harness compare` draws for the run alone: the same
    resamples over the prompts in compare's order (by prompt key, not by run order)."""
    import json

    import pandas as pd

    from harness.runner import speedup_intervals
    from harness.tracking.compare import ALL, compare

    rows = [
        {
            "prompt_id": pid,
            "prompt_sha256": f"{k:016x}",
            "category": "code",
            "spec_decode_ms": d,
            "spec_tokens": 10,
            "spec_prefill_ms": 5.0 + k,
            "ar_decode_ms": 20.0 + 3 * k,
            "ar_tokens": 10,
            "ar_prefill_ms": 4.0,
        }
        for k, (pid, d) in enumerate((("b", 8.0), ("a10", 10.0), ("a2", 12.0), ("c", 15.0), ("a1", 9.0)))
    ]
    got = speedup_intervals(rows)
    lo, hi = got["decode_speedup_ci95"]
    ar, spec = sum(r["ar_decode_ms"] for r in rows), sum(r["spec_decode_ms"] for r in rows)
    assert lo < ar / spec < hi  # the point (ratio of sums) lies inside
    e_lo, e_hi = got["speedup_ci95"]
    assert e_lo < (ar + 20) / (spec + sum(r["spec_prefill_ms"] for r in rows)) < e_hi
    axes = dict(proposer="p", topology="t", verifier="greedy", temperature=0.0, batch_size=1, workload="w", model="m")
    store = pd.DataFrame([{"run_id": "r", "section": "exact", **axes, "per_prompt": json.dumps(rows)}])
    (row,) = [r for r in compare(store) if r.category == ALL]
    assert [row.speedup.ci_low, row.speedup.ci_high] == [lo, hi]  # the interval harness compare draws
    assert [row.end_to_end_speedup.ci_low, row.end_to_end_speedup.ci_high] == [e_lo, e_hi]
    assert speedup_intervals(rows[:1]) == {"decode_speedup_ci95": None, "speedup_ci95": None}
    # at batch > 1 requests share their batch's time: no interval rather than one around another statistic
    assert speedup_intervals(rows, batch_size=2) == {"decode_speedup_ci95": None, "speedup_ci95": None}


def test_a_draft_tree_at_temperature_0_branches_and_iid_children_there_are_refused(tmp_path, monkeypatch):
    """At temperature 0 a draft model's children are its top-ranked tokens by default (i.i.d. draws
    from its one-hot law would all be the argmax: a set or expansion tree would run as one chain
    under the tree's name); above it, i.i.d. draws. Asking for i.i.d. children of a branching tree
    at temperature 0 is refused with the samplings that branch."""
    from harness.config import checked_plan
    from harness.contracts import ConfigError

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    assert compose(["proposer=draft_model"]).proposer.sampling == "beam"
    assert compose(["proposer=draft_model", "generation.temperature=0.7"]).proposer.sampling == "iid"
    assert compose(["proposer=merged", "generation.temperature=0.7"]).proposer.draft_model.sampling == "iid"
    with pytest.raises(ConfigError, match=r"proposer.sampling=iid at temperature 0 draws the draft's argmax") as info:
        checked_plan(["model=tiny", "proposer=draft_model", "proposer.sampling=iid", "topology=set"])
    assert "topology=set tree would collapse into one chain" in str(info.value)
    assert "try proposer.sampling=beam" in str(info.value)
    checked_plan(["model=tiny", "proposer=draft_model", "proposer.sampling=iid", "topology=sequence"])  # a chain
    # top_k=1 keeps one token at any temperature: the draft's default is its top-ranked tokens there
    # too, and i.i.d. children of a tree are refused as at temperature 0 (they ran as one chain)
    hot = ["model=tiny", "proposer=draft_model", "generation.temperature=0.7", "generation.top_k=1"]
    assert compose(hot).proposer.sampling == "beam"
    with pytest.raises(ConfigError, match=r"proposer.sampling=iid with generation.top_k=1 draws the draft's argmax"):
        checked_plan([*hot, "verifier=specinfer", "proposer.sampling=iid", "topology=expansion"])
    checked_plan([*hot, "verifier=membership", "topology=expansion"])  # the top-ranked tokens branch
    # without replacement from a one-hot law: the argmax, then tokens drawn uniformly from the whole
    # vocabulary (a Sequoia calibration at temperature 0 measured p2 = 0.0008 against 0.087 ranked)
    for argv, when in (
        (["model=tiny", "proposer=draft_model", "topology=set"], "at temperature 0"),
        ([*hot, "verifier=sequoia", "topology=expansion"], "with generation.top_k=1"),
        (["model=tiny", "proposer=draft_model", "topology=sequoia"], "at temperature 0"),
    ):
        with pytest.raises(
            ConfigError, match=rf"proposer.sampling=without_replacement {when} draws the draft's"
        ) as info:
            checked_plan([*argv, "proposer.sampling=without_replacement"])
        assert "siblings would be random tokens" in str(info.value)
        assert str(info.value).endswith("try proposer.sampling=beam") or str(info.value).endswith(
            "try proposer.sampling=beam verifier=membership"  # sequoia's verifier needs sampled siblings
        )
    checked_plan(
        ["model=tiny", "proposer=draft_model", "topology=set", "verifier=sequoia", "generation.temperature=0.7"]
        + ["proposer.sampling=without_replacement"]
    )
    # EAGLE-2's dynamic tree draws its sampled children the same way: refused at temperature 0 too
    with pytest.raises(ConfigError, match="topology=dynamic tree would collapse into one chain"):
        checked_plan(["model=tiny", "proposer=eagle", "proposer.sampling=iid", "topology=dynamic"])
    cfg = compose(
        [
            "model=tiny",
            "proposer=draft_model",
            "topology=set",
            "topology.max_nodes=4",
            "workload.limit=1",
            "generation.max_new_tokens=8",
            "gates.enabled=false",
        ]
    )
    run_job(cfg, run_dir=tmp_path / "run")
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert rounds and all(r["candidate_rows"] == 4 and r["tree_depth"] == 1 for r in rounds)  # four siblings


def test_timing_outliers_flag_a_prompt_whose_round_took_three_times_its_arms_median():
    from harness.runner import timing_outlier_note, timing_outliers

    def row(pid, ar_ms, spec_ms, ar_rounds=10, spec_rounds=4):
        return {
            "prompt_id": pid,
            "ar_decode_ms": ar_ms,
            "ar_rounds": ar_rounds,
            "spec_decode_ms": spec_ms,
            "spec_rounds": spec_rounds,
        }

    rows = [row("a", 100.0, 60.0), row("b", 110.0, 150.0), row("c", 95.0, 55.0), row("d", 400.0, 58.0)]
    got = timing_outliers(rows)
    assert [(o["prompt_id"], o["arm"]) for o in got] == [("d", "ar")]  # 40 ms a round against a median of 10.5
    assert got[0]["ms_per_round"] == 40.0 and got[0]["median_ms_per_round"] == 10.5
    assert abs(got[0]["ratio"] - 40.0 / 10.5) < 1e-12
    assert timing_outliers(rows[:2] + [row("d", 400.0, 58.0)])[0]["prompt_id"] == "d"  # three prompts suffice
    assert timing_outliers([rows[0], rows[3]]) == []  # two prompts have no median worth the name
    # a round 2.7x the median (b's speculative rounds) is within what rows and context explain
    assert timing_outliers(rows, factor=3.0) == got and len(timing_outliers(rows, factor=2.5)) == 2
    # an arm with no rounds (a prompt that ended at once) neither counts nor divides by zero
    assert timing_outliers([*rows, row("e", 0.0, 0.0, 0, 0)]) == got
    note = timing_outlier_note(got)
    assert note.startswith("1 prompt's arm took 3x or more the arm's median time per round: d (ar, 3.8x); ")
    assert "(metrics.timing_outliers)" in note


def test_a_stalled_prompt_is_flagged_in_the_record_and_on_the_console(tmp_path, monkeypatch, capsys):
    """A stall injected into one prompt's AR arm (a sleep in every round, as another process would
    cause) is named in the record's timing_outliers, counted in the printed summary and noted on stderr."""
    import time

    from harness.app import run_main
    from harness.engine.arms import Arms
    from harness.proposers.base import NullProposer
    from harness.runner import past_rounds_speedup_note

    stalled = {"on": False}
    real_run, real_propose = Arms._run, NullProposer.propose

    def run(self, arm, idx, prompts, turn, max_new_tokens):
        stalled["on"] = arm == "ar" and idx == [2]
        try:
            return real_run(self, arm, idx, prompts, turn, max_new_tokens)
        finally:
            stalled["on"] = False

    def propose(self, committed, rng):
        if stalled["on"]:
            time.sleep(0.05)
        return real_propose(self, committed, rng)

    monkeypatch.setattr(Arms, "_run", run)
    monkeypatch.setattr(NullProposer, "propose", propose)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    argv = ["model=tiny", "workload.limit=4", "generation.max_new_tokens=8", "gates.oracle=false", "threads=1"]
    argv += [f"hydra.run.dir={tmp_path / 'hydra'}", f"output_dir={tmp_path / 'run'}"]
    assert run_main(argv) == 0
    captured = capsys.readouterr()
    record = load_record(tmp_path / "run" / "record.json")
    stalled_id = record["per_prompt"][2]["prompt_id"]
    flagged = {(o["prompt_id"], o["arm"]): o for o in record["metrics"]["timing_outliers"]}
    assert (stalled_id, "ar") in flagged and flagged[(stalled_id, "ar")]["ratio"] >= 3.0
    summary = json.loads(captured.out[captured.out.index("{") :])
    assert summary["timing_outliers"] == len(flagged)
    notes = [line for line in captured.err.splitlines() if line.startswith("harness run: note: ")]
    note = [line for line in notes if "a stall, not the method" in line]
    assert len(note) == 1 and f"{stalled_id} (ar, " in note[0]
    # the stalled baseline made a speculative arm that accepts nothing look faster: said too
    assert record["metrics"]["mean_committed_per_round"] == 1.0
    assert [n for n in notes if n not in note] == [f"harness run: note: {past_rounds_speedup_note(record['metrics'])}"]


def test_a_sampling_policy_that_keeps_one_token_has_its_outputs_compared_as_greedy_ones(tmp_path, monkeypatch):
    """top_k = 1 at a temperature above 0 leaves the target one token per position (ties aside):
    decoding is the argmax, so the greedy gate compares both arms' outputs token for token instead
    of calling them sampled, and the record says whether they were identical."""
    from harness.verifiers.sampling import SamplingPolicy

    assert SamplingPolicy(temperature=0.7, top_k=1).deterministic and SamplingPolicy().deterministic
    assert not SamplingPolicy(temperature=0.7, top_k=2).deterministic
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    overrides = ["model=tiny", "verifier=membership", "generation.temperature=0.7", "generation.top_k=1"]
    overrides += ["workload.limit=2", "generation.max_new_tokens=12", "gates.oracle=false", "threads=1"]
    record = run_job(compose([*overrides, f"output_dir={tmp_path / 'run'}"]), run_dir=tmp_path / "run")
    assert record["gates"]["greedy_equality"]["status"] == "passed"
    assert record["metrics"]["greedy_identical"] is True
    sampled = compose([*overrides[:3], "generation.top_k=2", *overrides[4:], f"output_dir={tmp_path / 'two'}"])
    record = run_job(sampled, run_dir=tmp_path / "two")
    assert record["gates"]["greedy_equality"]["status"] == "not_applicable"
    assert record["metrics"]["greedy_identical"] is None


def test_options_that_change_nothing_here_are_noted_at_start_and_listed_in_the_record(tmp_path, monkeypatch, capsys):
    """An option set where the combination ignores it (top-p at temperature 0, widths on a chain, a
    verify-cost curve under the fixed budget) is accepted, a sweep may cross it with such a
    setting, but noted on stderr at start and listed in the record: no record claims its effect."""
    from harness.app import run_main
    from harness.runner import inert_options

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    argv = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=8", "gates.oracle=false", "threads=1"]
    argv += ["generation.top_p=0.5", "topology=sequence", "topology.widths=[2,2]", "proposer.verify_cost=[1.0,1.1]"]
    argv += [f"hydra.run.dir={tmp_path / 'hydra'}", f"output_dir={tmp_path / 'run'}"]
    assert run_main(argv) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "option(s) with no effect here" in line]
    expected = [
        "generation.top_p=0.5: temperature 0 decodes the argmax",
        "topology.widths=[2,2]: topology=sequence does not read it (only expansion, cartesian)",
        "proposer.verify_cost=[1.0,1.1]: the fixed budget prices no rows (proposer.budget_policy=adaptive reads it)",
    ]
    assert notes == [f"harness: note: option(s) with no effect here: {'; '.join(expected)}"]
    assert load_record(tmp_path / "run" / "record.json")["inert_options"] == expected
    # where they apply they are no note: top-p when sampling, widths on an expansion tree
    sampled = compose(["model=tiny", "generation.temperature=0.7", "generation.top_p=0.5", "verifier=membership"])
    assert inert_options(sampled) == [] and inert_options(compose(["model=tiny", "topology=expansion"])) == []
    # prompt lookup's verify cost under proposer=merged, with its fixed budget: noted by its own key
    merged = ["model=tiny", "proposer=merged", "topology=merged", "proposer.prompt_lookup.verify_cost=[1.0,1.1]"]
    assert inert_options(compose(merged)) == [
        "proposer.prompt_lookup.verify_cost=[1.0,1.1]: the fixed budget prices no rows "
        "(proposer.prompt_lookup.budget_policy=adaptive reads it)"
    ]


def test_model_options_a_model_ignores_are_listed_as_inert():
    """The tiny model's seed and shape on a checkpoint model, remote code on a built-in model, cuDNN
    attention off CUDA and the statistical gate's switch at temperature 0 change nothing: listed,
    not claimed. On the tiny model (or a derived draft, whose fields follow the target's) they apply."""
    from harness.runner import inert_options

    why = "model.name=smollm2 loads its weights; the tiny model's options shape only model.name=tiny"
    assert inert_options(
        compose(["model=smollm2", "model.seed=7", "model.trust_remote_code=true", "model.tiny.vocab_size=16"])
    ) == [
        f"model.seed=7: {why}",
        f"model.tiny.vocab_size=16: {why}",
        "model.trust_remote_code=true: model.name=smollm2 runs no code from a checkpoint",
    ]
    assert inert_options(compose(["model=tiny", "gates.statistical=false", "model.cudnn_attention=false"])) == [
        "gates.statistical=false: the statistical gate tests sampled rounds (temperature > 0)",
        "model.cudnn_attention=false: cuDNN attention is a CUDA kernel",
    ]
    assert (
        inert_options(compose(["model=tiny", "model.seed=3", "model.tiny.vocab_size=64", "proposer=draft_model"])) == []
    )
    # a checkpoint draft's seed and tiny shape that only follow the target's are not noted for the draft
    followed = ["model=tiny", "model.seed=7", "model.tiny.vocab_size=64", "proposer=draft_model"]
    assert inert_options(compose([*followed, "proposer.model.name=smollm2"])) == []
    # a derived draft's own seed: its weights are the target's (the run, gate and record were the same)
    assert inert_options(compose(["model=tiny", "proposer=draft_model", "proposer.model.seed=5"])) == [
        "proposer.model.seed=5: a derived draft copies the target's first layers, weights included"
    ]


def test_the_threshold_s_ema_settings_are_inert_with_a_fixed_threshold():
    """Layer skip's threshold adapts by an acceptance EMA (beta1, beta2, epsilon, target_acceptance);
    with ``adaptive=false`` gamma stays put and those settings change nothing: they are listed."""
    from harness.runner import inert_options

    base = ["model=tiny", "proposer=layer_skip", "proposer.skip=[1]"]
    fixed = [*base, "proposer.threshold.adaptive=false", "proposer.threshold.gamma=0.5"]
    assert inert_options(compose([*fixed, "proposer.threshold.epsilon=0.2", "proposer.threshold.beta1=0.7"])) == [
        "proposer.threshold.beta1=0.7: proposer.threshold.adaptive=false keeps gamma fixed",
        "proposer.threshold.epsilon=0.2: proposer.threshold.adaptive=false keeps gamma fixed",
    ]
    assert inert_options(compose([*base, "proposer.threshold.epsilon=0.2"])) == []  # adaptive: it reads them


def test_options_of_a_merged_proposer_s_left_out_sources_are_listed_as_inert():
    """``proposer=merged`` carries every source's options; those of a proposer that is not a source
    (a sweep crossing ``proposer.sources`` with a draft's options) change nothing and are listed, while
    a source's own options, and the packaged defaults, are not."""
    from harness.runner import inert_options

    base = ["model=tiny", "proposer=merged", "topology=merged"]
    assert inert_options(compose(base)) == []
    assert inert_options(compose([*base, "proposer.sources=[draft_model,rest]"])) == []
    changed = [
        "proposer.prompt_lookup.max_ngram=4",
        "proposer.draft_model.sampling=iid",
        "proposer.draft_model.model.num_layers=1",
        "proposer.depths.draft_model=2",
        "proposer.rest.max_matches=5",
    ]
    left_out = "proposer.sources=[rest,prompt_lookup] leaves it out"
    assert inert_options(compose([*base, *changed])) == [
        f"proposer.draft_model.sampling=iid: {left_out}",
        f"proposer.draft_model.model.num_layers=1: {left_out}",
        f"proposer.depths.draft_model=2: {left_out}",
    ]
    with_draft = compose([*base, *changed, "proposer.sources=[rest,draft_model]"])
    assert inert_options(with_draft) == [
        "proposer.prompt_lookup.max_ngram=4: proposer.sources=[rest,draft_model] leaves it out"
    ]


def test_workload_options_the_workload_does_not_read_are_listed_as_inert():
    from harness.runner import inert_options

    assert inert_options(compose(["model=tiny", "workload=humaneval", "workload.path=q.jsonl"])) == [
        "workload.path=q.jsonl: workload=humaneval reads its own prompts (jsonl and spec_bench read a file)"
    ]
    assert inert_options(compose(["model=tiny", "workload=sharegpt", "workload.chat=false"])) == [
        "workload.chat=false: ShareGPT prompts are chat messages, always put through the chat template"
    ]
    assert inert_options(compose(["model=tiny", "workload=jsonl", "workload.path=q.jsonl"])) == []


def test_a_refusal_at_the_gates_puts_the_folder_s_earlier_record_back(tmp_path, monkeypatch):
    """A leakage refusal comes before any measurement, like a refusal while loading; it left the
    earlier record in .previous/. (A failed gate does not put it back: its evidence refutes the
    round the earlier record measured; tests/test_job_folder.py.)"""
    import harness.runner as runner
    from harness.workloads.datastore import LeakageError

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    base = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.oracle=false", f"output_dir={out}"]
    earlier = run_job(compose(base), run_dir=out)

    def leak(*args, **kwargs):
        raise LeakageError("evaluation leakage: prompt 'HumanEval/0' matches the datastore for 40 tokens")

    monkeypatch.setattr(runner, "gate", leak)
    with pytest.raises(LeakageError):
        run_job(compose([*base, "seed=1"]), run_dir=out)
    assert load_record(out / "record.json")["run_id"] == earlier["run_id"] and not (out / ".previous").exists()

    def crash(*args, **kwargs):  # an artifact that fails to load (not a refusal): nothing was measured either
        raise RuntimeError("Error(s) in loading state_dict for Eagle3Draft")

    monkeypatch.setattr(runner, "prepare_job", crash)
    with pytest.raises(RuntimeError):
        run_job(compose([*base, "seed=2"]), run_dir=out)
    assert load_record(out / "record.json")["run_id"] == earlier["run_id"] and not (out / ".previous").exists()
    monkeypatch.undo()
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    from harness.gates.status import GateError

    def out_of_memory(*args, **kwargs):  # while measuring: no more evidence against the earlier record
        raise RuntimeError("CUDA out of memory")

    def inconsistent(*args, **kwargs):  # a load-time consistency check, no gate's evidence
        raise GateError("KV bytes per token 1 != config-derived 2")

    for stage, failure in (("measure", out_of_memory), ("load", inconsistent)):
        monkeypatch.setattr(runner, stage, failure)
        with pytest.raises((RuntimeError, GateError)):
            run_job(compose([*base, "seed=3"]), run_dir=out)
        assert load_record(out / "record.json")["run_id"] == earlier["run_id"] and not (out / ".previous").exists()
        monkeypatch.undo()
        monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))


def test_an_interrupted_run_puts_the_folder_s_earlier_record_back(tmp_path, monkeypatch, caplog):
    """Ctrl-C while a re-run measured left the earlier record in .previous/, and compare then found
    no record in the folder; an interrupt is no evidence against it, so it goes back."""
    import harness.runner as runner

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    base = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.oracle=false", f"output_dir={out}"]
    earlier = run_job(compose(base), run_dir=out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_job(compose([*base, "seed=1"]), run_dir=out)
    assert load_record(out / "record.json")["run_id"] == earlier["run_id"] and not (out / ".previous").exists()
    assert f"the job was interrupted: the earlier files are back in {out}" in caplog.text
    # a sweep moves a job's earlier files aside itself before run_job: they go back all the same
    from harness.tracking.job_folder import set_aside

    aside = set_aside(out)
    assert not (out / "record.json").exists()
    with pytest.raises(KeyboardInterrupt):
        run_job(compose([*base, "seed=1"]), run_dir=out, aside=aside)
    assert load_record(out / "record.json")["run_id"] == earlier["run_id"] and not (out / ".previous").exists()


def _terminal_lines(err: str) -> list[str]:
    """What a terminal shows of ``err``, line by line: a carriage return starts its line again, so
    each line is its text after the last one (blank lines dropped)."""
    return [line.split("\r")[-1].strip() for line in err.split("\n") if line.split("\r")[-1].strip()]


@pytest.mark.parametrize(
    "failure, said",
    [(KeyboardInterrupt, "harness run: interrupted"), (RuntimeError("boom"), "harness run: error: RuntimeError: boom")],
)
def test_a_run_stopped_while_measuring_ends_on_its_one_line_not_on_the_progress_bar(
    tmp_path, monkeypatch, capsys, failure, said
):
    """The progress bar of the timed prompts is closed before the one line that says why the run
    stopped: that line starts a line of its own, and no redraw of the bar follows it."""
    import gc

    from harness.app import run_main
    from harness.engine.arms import Arms

    def stopped(*args, **kwargs):
        raise failure

    def timed(self):  # the warm-up runs; the timed arms stop at their first batch
        self._run = stopped
        yield from real_run(self)

    real_run = Arms.run
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "false")  # no native kernels to compile into the fresh cache
    monkeypatch.setattr(Arms, "run", timed)
    out = tmp_path / "run"
    argv = ["model=tiny", "model.linear_kernel=default", "model.fused_layers=false", "workload.limit=2"]
    argv += ["generation.max_new_tokens=4", "gates.oracle=false", f"output_dir={out}", f"hydra.run.dir={out}"]
    assert run_main(argv) in (1, 130)
    gc.collect()  # a bar left open would redraw itself when collected
    err = capsys.readouterr().err
    assert "prompts:" in err, err  # the bar was drawn
    assert said in err and err.split(said)[0].endswith("\n"), err  # on a line of its own
    assert _terminal_lines(err)[-1].startswith(said), err
    assert "prompts:" not in err.split(said)[-1], err


REPO = Path(__file__).resolve().parents[1]


def test_a_run_ended_by_sigterm_puts_the_earlier_record_back_and_exits_143(tmp_path):
    """A timeout, a kill or a scheduler's time limit sends SIGTERM: the run ends as on Ctrl-C, the
    folder's earlier record back in place (not left in .previous/), exit status 128 + 15."""
    out = tmp_path / "run"
    env = {
        **os.environ,
        "HARNESS_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": str(REPO),
        "WANDB_MODE": "offline",
        "CXX": "false",  # no native kernels to compile into the fresh cache: the Python search serves
    }
    base = ["model=tiny", "model.linear_kernel=default", "model.fused_layers=false", "gates.oracle=false"]
    base += [f"output_dir={out}", f"hydra.run.dir={out}"]
    harness_run = [sys.executable, "-m", "harness.cli", "run", *base]
    first = subprocess.run(
        [*harness_run, "workload.limit=1", "generation.max_new_tokens=4"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr
    earlier = (out / "record.json").read_bytes()
    proc = subprocess.Popen(
        [*harness_run, "workload.limit=4", "generation.max_new_tokens=256", "seed=1"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ((out / ".previous").is_dir() and not (out / "record.json").exists()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never set the earlier record aside"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "harness run: terminated (SIGTERM)" in err and "Traceback" not in err
    assert (out / "record.json").read_bytes() == earlier
    assert not (out / ".previous").exists()


def test_a_new_folder_of_a_run_ended_by_sigterm_is_removed_and_the_handlers_restored(tmp_path, monkeypatch, capsys):
    """A run ended by SIGTERM (or Ctrl-C) before writing anything leaves no folder behind, as a
    refused run does; the signal handlers the process had are back afterwards."""
    import harness.runner as runner
    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["model=tiny", "model.linear_kernel=default", "model.fused_layers=false", "workload.limit=1"]
    argv += ["generation.max_new_tokens=4", f"output_dir={out}", f"hydra.run.dir={out}"]
    sent = []

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), sent[-1])
        time.sleep(2)  # the handler raises before this ends
        raise AssertionError("the signal did not end the run")

    def outside(signum, frame):  # the test process's own handler: SIGTERM outside the run changes nothing
        pass

    monkeypatch.setattr(runner, "load", signalled)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, outside)
    try:
        for signum, status, said in (
            (signal.SIGTERM, 143, "terminated (SIGTERM)"),
            (signal.SIGINT, 130, "interrupted"),
        ):
            sent.append(signum)
            assert run_main(argv) == status
            assert f"harness run: {said}" in capsys.readouterr().err
            assert not out.exists(), sorted(p.name for p in out.iterdir())
        assert signal.getsignal(signal.SIGTERM) is outside
    finally:
        signal.signal(signal.SIGTERM, before[signal.SIGTERM])
    assert signal.getsignal(signal.SIGHUP) == before[signal.SIGHUP]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_while_the_earlier_files_move_aside_waits_for_the_move_and_they_go_back(
    tmp_path, monkeypatch, signum
):
    """A signal that came after the earlier record was moved aside, before the run's clean-up could
    see where, left it in .previous/: it is held until the move is done, then puts the files back."""
    import harness.runner as runner
    from harness.cli import Terminated, signals_interrupt

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "record.json").write_text('{"run_id": "earlier"}')
    moves = []

    def move_then_signal(*args, **kwargs):
        moved = real_clear(*args, **kwargs)
        moves.append(moved[0])
        os.kill(os.getpid(), signum)
        return moved

    def no_model(*args, **kwargs):
        raise AssertionError("the run went on past the signal")

    real_clear = runner.clear_for_run
    monkeypatch.setattr(runner, "clear_for_run", move_then_signal)
    monkeypatch.setattr(runner, "load", no_model)
    expected = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    with signals_interrupt(), pytest.raises(expected):
        run_job(compose(["model=tiny", "workload.limit=1", f"output_dir={out}"]), run_dir=out)
    assert moves and moves[0] is not None  # the record was moved aside before the signal
    assert (out / "record.json").read_text() == '{"run_id": "earlier"}'
    assert not (out / ".previous").exists()


def test_gate_exactness_chat_topology_and_lookup_options_that_change_nothing_are_listed_as_inert():
    from harness.runner import inert_options

    base = ["model=tiny"]

    def inert(*overrides):
        return inert_options(compose([*base, *overrides]))

    assert inert("gates.chi2_samples=10", "gates.chi2_top_m=1") == [
        "gates.chi2_samples=10: the statistical gate tests sampled rounds (temperature > 0)",
        "gates.chi2_top_m=1: the statistical gate tests sampled rounds (temperature > 0)",
    ]
    assert inert("generation.temperature=0.7", "gates.chi2_samples=500") == []  # read when sampling
    assert inert("gates.enabled=false", "gates.chi2_samples=500", "gates.oracle=false") == [
        "gates.oracle=false: gates.enabled=false runs no gate",
        "gates.chi2_samples=500: gates.enabled=false runs no gate",
    ]
    assert inert("generation.exact=false") == [
        "generation.exact=false: verifier=greedy is exact (the option admits a heuristic verifier)"
    ]
    typical = ["generation.exact=false", "verifier=typical", "generation.temperature=0.7", "proposer=draft_model"]
    assert inert(*typical) == []
    assert inert("topology.sources=[a,b]") == [
        "topology.sources=[a,b]: no topology reads it (proposer=merged takes proposer.sources)"
    ]
    assert inert("proposer=prompt_lookup", "topology=sequence", "proposer.max_matches=2") == [
        "proposer.max_matches=2: topology=sequence takes one match (one chain)"
    ]
    assert inert("proposer=prompt_lookup", "topology=sequences", "proposer.max_matches=2") == []
    # a set is one level of siblings: a depth asked of it never runs (the manifest said max_depth 3)
    assert inert("proposer=draft_model", "topology=set", "topology.max_depth=3") == [
        "topology.max_depth=3: topology=set drafts one level of siblings (depth 1)"
    ]
    assert inert("proposer=draft_model", "topology=set") == []
    # at a temperature: top_k=1 leaves the temperature's value nothing to change, and a top_k past the vocabulary
    sampled = ["generation.temperature=0.7", "verifier=membership"]
    assert inert(*sampled, "generation.top_k=1") == [
        "generation.temperature=0.7: top_k=1 keeps the argmax at any temperature"
    ]
    assert inert(*sampled, "generation.top_k=1000") == [
        "generation.top_k=1000: the vocabulary has 96 ids, so top-k truncates nothing"
    ]
    assert inert(*sampled, "generation.top_k=50") == []
    # levels of an expansion the node budget fills before, with distinct siblings (the draft's top-k at T=0): a
    # sweep crossing budgets runs them, noted; iid draws that repeat a sibling merge and may reach deeper
    expansion = ["proposer=draft_model", "topology=expansion", "topology.widths=[4,4,4]"]
    assert inert(*expansion, "topology.max_nodes=16") == [
        "topology.widths=[4,4,4]: topology.max_nodes=16 candidate rows are filled before depth 3, so its levels "
        "from there are never drafted"
    ]
    assert inert(*expansion, "topology.max_nodes=21") == []
    assert inert(*expansion, "topology.max_nodes=16", "proposer.sampling=iid", *sampled) == []
    merged = ["proposer=merged", "topology=merged", "proposer.sources=[prompt_lookup,draft_model]"]
    assert inert(*merged, "proposer.depths.draft_model=100") == [
        "proposer.depths.draft_model=100: topology.max_depth=8 caps every source"
    ]
    assert inert(*merged, "topology.max_depth=3") == []  # the default depth (4), not set: nothing listed
    assert inert("gates.enabled=false", "gates.skip_statistical=true") == [
        "gates.skip_statistical=true: gates.enabled=false runs no gate"
    ]
    sequoia = ["topology=sequoia", "proposer=draft_model", "verifier=sequoia", "topology.tree_artifact=tree.json"]
    assert inert(*sequoia, "topology.reuse=false") == [
        "topology.reuse=false: topology.tree_artifact names the tree, nothing is measured or searched"
    ]


def test_a_run_whose_proposer_never_proposed_warns_that_it_measured_overhead_only(tmp_path, monkeypatch, capsys):
    """A proposer that offers nothing in any round (an n-gram longer than any repeat) left a gated
    record that read like a measurement of the method; the run now warns."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        [
            "model=tiny",
            "proposer=prompt_lookup",
            "topology=sequence",
            "proposer.min_ngram=6",
            "proposer.max_ngram=6",
            "workload.limit=1",
            "generation.max_new_tokens=8",
            "gates.oracle=false",
        ]
    )
    record = run_job(cfg, run_dir=tmp_path / "run")
    assert record["metrics"]["fallback_rate"] == 1.0
    assert (
        f"harness: warning: the proposer offered no candidate in any of {record['metrics']['rounds']} rounds"
    ) in capsys.readouterr().err


def test_a_speedup_with_nothing_accepted_is_noted_whatever_the_prompt_count():
    """A one-prompt run timed under load showed a 1.3x decode speedup while every round committed one
    token, and no note said so (the stall check needs three prompts). Nothing accepted now notes any
    speedup from 1.05x; a speedup earned by accepted tokens, or a slowdown, is not noted."""
    from harness.runner import past_rounds_speedup_note, run_notes

    def record(speedup, per_round):
        return {"metrics": {"decode_speedup": speedup, "mean_committed_per_round": per_round}, "per_prompt": [{}]}

    note = past_rounds_speedup_note(record(1.3, 1.0)["metrics"])
    assert note.startswith("decode speedup 1.30x with no proposed token accepted (one token per round")
    assert run_notes(record(1.3, 1.0)) == [note]
    assert (
        run_notes(record(1.3, 1.4)) == [] and run_notes(record(0.9, 1.0)) == [] and run_notes(record(1.04, 1.0)) == []
    )
    assert run_notes(record(None, None)) == []
    # a Sequoia run timed under load: 2.14x from 1.04 tokens per round, recorded with no word. A round
    # runs at least one verify forward, so a speedup past the tokens per round is noted too
    past = past_rounds_speedup_note(record(2.14, 1.043)["metrics"])
    assert past.startswith(
        "decode speedup 2.14x from 1.04 tokens committed per round: each round runs at least one verify forward"
    )
    assert run_notes(record(2.14, 1.043)) == [past]
    assert run_notes(record(2.0, 2.2)) == [] and run_notes(record(2.09, 2.0)) == []  # within 5% of the rounds
    # end to end: a 3.66x speedup with nothing accepted, its decode 0.48x, from an AR prefill of 204 ms
    # against the speculative arm's 14 ms for the same prompt under load: said too
    e2e = record(0.48, 1.0)
    e2e["metrics"].update(speedup=3.656, prefill_ms_total=14.0, ar_prefill_ms_total=204.0)
    assert run_notes(e2e) == [
        "end-to-end speedup 3.66x from 1.00 tokens committed per round, past what speculation gives: the "
        "speculative arm's prefills took 14.0 ms against the baseline's 204.0 ms for the same prompts; the "
        "prefills' timing (a first forward's one-time costs, the machine's load), not speculation (metrics.speedup)"
    ]
    e2e["metrics"]["speedup"] = 1.02
    assert run_notes(e2e) == []


def test_a_heuristic_run_says_so_and_its_summary_carries_exact_and_gated(tmp_path, monkeypatch, capsys):
    """verifier=typical with generation.exact=false printed nothing about being heuristic, and the stdout
    summary carried neither exact nor gated: a heuristic or ungated run read as any other."""
    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    common = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "generation.warmup_tokens=0"]
    heuristic = [*common, "proposer=draft_model", "verifier=typical", "generation.exact=false"]
    assert run_main([*heuristic, "generation.temperature=0.7", f"output_dir={tmp_path / 'h'}"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["exact"] is False and summary["gated"] is True
    assert (
        "harness run: note: verifier=typical is heuristic (exact: false): its outputs do not follow the target's law"
    ) in err
    assert run_main([*common, "gates.enabled=false", f"output_dir={tmp_path / 'u'}"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["exact"] is True and summary["gated"] is False and "is heuristic" not in err


def test_the_job_log_beside_the_record_holds_the_run_s_notes(tmp_path, monkeypatch, capsys):
    """app.log (Hydra's job log) was empty in every run folder: the harness's notes and refusals went
    to stderr alone. Its lines are in the log too; progress bars are not."""
    from harness.app import run_main

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    argv = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "generation.top_p=0.5"]
    assert run_main([*argv, "gates.enabled=false", f"output_dir={run}"]) == 0  # the gates are not what is tested
    log = (run / "app.log").read_text()
    assert "harness: note: option(s) with no effect here: generation.top_p=0.5: temperature 0 decodes" in log
    assert "\r" not in log and "it/s" not in log
    assert "generation.top_p=0.5" in capsys.readouterr().err  # and still on the console


def test_a_device_without_room_for_the_peak_product_keeps_the_record_without_floors(tmp_path, monkeypatch, capsys):
    """The matrix-product rate behind the roofline is measured after the arms: where it cannot run
    (out of memory on a full GPU), the record is still written, its t(n) without floors."""
    import torch

    import harness.runner as runner

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB")

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "matmul_peak", out_of_memory)
    cfg = compose(
        [
            "model=tiny",
            "topology=sequences",
            "proposer.budget_policy=adaptive",
            "workload.limit=1",
            "generation.max_new_tokens=8",
            "gates.oracle=false",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    record = run_job(cfg, run_dir=tmp_path / "run")
    prof = record["t_profile"]
    assert prof["t"] and "floor_ms" not in prof and "roofline" not in prof
    assert load_record(tmp_path / "run" / "record.json")["t_profile"] == prof
    assert "t(n) recorded without its roofline floors: CUDA out of memory" in capsys.readouterr().err
    # the read-bandwidth probe beside it, out of memory too: the record was lost in the summary stage
    monkeypatch.setattr(runner, "read_bandwidth_gbs", out_of_memory)
    record = run_job(cfg, run_dir=tmp_path / "run2")
    m = record["metrics"]
    assert m["read_bandwidth_gbs"] is None and m["weight_stream_floor_ms"] is None and m["ar_step_vs_floor"] is None
    assert record["t_profile"]["t"] and "floor_ms" not in record["t_profile"]
    assert load_record(tmp_path / "run2" / "record.json")["metrics"]["read_bandwidth_gbs"] is None
    assert "the record has no weight-streaming floor: CUDA out of memory" in capsys.readouterr().err


def test_a_gpu_reads_its_bandwidth_from_a_buffer_its_free_memory_holds(monkeypatch):
    import torch

    from harness.target.timing import BANDWIDTH_BUFFER_BYTES, bandwidth_buffer_bytes

    class Properties:
        L2_cache_size = 50 << 20  # an H100's

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties())
    pool = {"reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: pool["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: pool["allocated"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    assert bandwidth_buffer_bytes("cuda") == BANDWIDTH_BUFFER_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (900 << 20, 80 << 30))
    assert bandwidth_buffer_bytes("cuda:1") == 225 << 20  # a quarter of what is free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (400 << 20, 80 << 30))
    with pytest.raises(ValueError, match="400 MiB free: too little for a read-bandwidth buffer of 200 MiB"):
        bandwidth_buffer_bytes("cuda")  # 100 MiB would be read partly from the 50 MB L2
    pool.update(reserved=3 << 30, allocated=2 << 30)  # the allocator's unused gigabyte serves it
    assert bandwidth_buffer_bytes("cuda") == BANDWIDTH_BUFFER_BYTES


def test_a_limit_above_the_workloads_prompts_is_said_at_plan(tmp_path, monkeypatch, capsys):
    """workload.limit=500 on HumanEval's 80 eval prompts ran the 80 with nothing said, the record keeping
    limit: 500 as if it had been met."""
    from harness.runner import plan_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    planned = plan_job(compose(["model=tiny", "workload.limit=500"]), run_dir=tmp_path / "run")
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"harness: note: workload.limit=500 asks for more prompts than the workload gives ({len(planned.prompts)}): "
        f"all {len(planned.prompts)} run"
    )
    plan_job(compose(["model=tiny", "workload.limit=5"]), run_dir=tmp_path / "run2")
    assert "workload.limit" not in capsys.readouterr().err


def test_a_per_category_above_what_a_task_holds_is_said_at_plan(tmp_path, monkeypatch, capsys):
    """workload.per_category=5 over a question file holding 2 writing questions and 1 summarization ran
    an unbalanced sample with nothing said (workload.limit is said)."""
    from helpers import write_jsonl

    from harness.runner import plan_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"question_id": 1, "category": "writing", "turns": ["Write a poem."]},
            {"question_id": 2, "category": "writing", "turns": ["Write a story."]},
            {"question_id": 3, "category": "summarization", "turns": ["Summarise this text."]},
            {"question_id": 4, "category": "qa", "turns": ["What is two plus two?"]},
        ],
    )
    base = ["model=tiny", "workload=spec_bench", f"workload.path={path}"]
    plan_job(compose([*base, "workload.per_category=2"]), run_dir=tmp_path / "run")
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "harness: note: workload.per_category=2 asks for more prompts than 'qa' gives (1), 'summarization' "
        "gives (1): all of those run"
    )
    plan_job(compose([*base, "workload.per_category=1"]), run_dir=tmp_path / "run2")
    plan_job(compose([*base, "workload.per_category=2", "workload.limit=2"]), run_dir=tmp_path / "run3")
    assert "workload.per_category" not in capsys.readouterr().err  # met, or cut by the limit anyway


def test_the_recorded_seed_rule_reproduces_a_sampled_runs_autoregressive_tokens(tmp_path, monkeypatch):
    """The manifest said each arm drew from TorchRandomSource(seed + prompt index): at seed 1 that
    reproduced none of a sampled run's tokens. It states the engine's rule now, and a plain sampling
    loop seeded by it gives the recorded autoregressive tokens."""
    import torch

    from harness.engine.arms import SEED_RULE
    from harness.random_source import TorchRandomSource
    from harness.target.loading import build_tiny_model
    from harness.verifiers.sampling import SamplingPolicy

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    overrides = ["model=tiny", "verifier=membership", "generation.temperature=0.7", "seed=1", "workload.limit=2"]
    overrides += ["generation.max_new_tokens=8", "gates.oracle=false", "gates.statistical=false"]
    record = run_job(compose([*overrides, f"output_dir={run_dir}"]), run_dir=run_dir)
    assert record["manifest"]["rng_policy"] == {"seed": 1, "source": SEED_RULE}
    assert "seeded seed * 1000003 + prompt index + turn * 1000000007" in SEED_RULE  # the rule drawn below
    model = build_tiny_model(seed=0, max_position_embeddings=2048)
    policy = SamplingPolicy(temperature=0.7)
    rows = [json.loads(line) for line in (run_dir / "outputs.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        rng = TorchRandomSource(1 * 1_000_003 + i + 0 * 1_000_000_007)  # the rule, first turn
        ids, drawn = list(row["prompt_token_ids"]), []
        with torch.inference_mode():
            for _ in row["ar_token_ids"]:
                token = rng.categorical(policy.probs(model(torch.tensor([ids])).logits[0, -1][None])[0])
                drawn.append(token)
                ids.append(token)
        assert drawn == row["ar_token_ids"]


def test_an_adaptive_budget_is_timed_over_the_first_prompt_with_a_prefix(tmp_path, monkeypatch):
    """The adaptive budget's verify cost was timed over the first prompt, refused after the model
    loaded when that prompt was one token; it is timed over the first prompt with a prefix."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"id": "one", "prompt": "a"}) + "\n" + json.dumps({"id": "two", "prompt": "ab ab ab"}) + "\n"
    )
    run_dir = tmp_path / "run"
    overrides = ["model=tiny", "proposer.budget_policy=adaptive", "workload=jsonl", f"workload.path={path}"]
    overrides += ["workload.chat=false", "generation.max_new_tokens=8", "gates.oracle=false", f"output_dir={run_dir}"]
    record = run_job(compose(overrides), run_dir=run_dir)
    assert record["metrics"]["greedy_identical"] is True
    assert record["t_profile"]["prefix_len"] == 8  # the second prompt's tokens


def test_prompt_lookup_history_at_a_batch_above_one_is_noted():
    """At batch B a request searches only the outputs finished before it started: the requests of its batch
    start together and never read each other, so a batch-size sweep with history measured lost history
    beside batching's cost, and nothing said so."""
    from harness.runner import run_notes

    def record(proposer, batch):
        config = {"proposer": proposer, "generation": {"batch_size": batch}}
        return {"metrics": {}, "per_prompt": [{}], "config": config}

    lookup = {"name": "prompt_lookup", "history_tokens": 65536}
    (note,) = run_notes(record(lookup, 4))
    assert note.startswith("at generation.batch_size=4 prompt lookup's history (proposer.history_tokens) serves")
    assert run_notes(record(lookup, 1)) == []
    assert run_notes(record({**lookup, "history_tokens": 0}, 4)) == []
    merged = {"name": "merged", "sources": ["prompt_lookup", "rest"], "prompt_lookup": lookup}
    assert len(run_notes(record(merged, 2))) == 1
    assert run_notes(record({"name": "rest"}, 4)) == []


def test_a_job_runs_with_its_own_thread_count_never_an_earlier_job_s(tmp_path, monkeypatch):
    """``threads=1,null`` in one multirun: the ``threads=null`` job ran with the first job's 1 thread,
    under the manifest hash of a standalone run with the process's own 2."""
    import torch

    import harness.measure.hardware as hardware
    from harness.manifest import job_manifest_hash

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "PROCESS_THREADS", 2)
    base = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.enabled=false"]
    records = {}
    try:
        for threads in ("1", "null"):
            run_dir = tmp_path / f"threads-{threads}"
            cfg = compose([*base, f"threads={threads}", f"output_dir={run_dir}"])
            records[threads] = run_job(cfg, run_dir=run_dir)
    finally:
        torch.set_num_threads(1)  # the suite's own count (conftest)
    assert records["1"]["metrics"]["torch_threads"] == records["1"]["manifest"]["backend"]["threads"] == 1
    assert records["null"]["metrics"]["torch_threads"] == records["null"]["manifest"]["backend"]["threads"] == 2
    assert records["null"]["hardware"]["torch_threads"] == 2
    assert records["null"]["manifest_hash"] == job_manifest_hash(compose([*base, "threads=2"]))
    assert records["null"]["manifest_hash"] != records["1"]["manifest_hash"]


def test_more_threads_than_the_process_may_run_on_are_noted_at_start(tmp_path, monkeypatch, capsys):
    """``threads`` above the CPUs of the process's affinity mask oversubscribed them, and every time
    counted the threads' waits without a word; the run says so (a note: the machine that composes a
    job need not be the one that runs it)."""
    import os

    import torch

    import harness.runner as runner
    from harness.measure.hardware import usable_cpus

    assert usable_cpus() == len(os.sched_getaffinity(0))
    assert runner.oversubscribed_threads_note(None, 2, cpus=2) is None
    assert runner.oversubscribed_threads_note(None, 4, cpus=2) == (
        "torch's default of 4 threads (threads=null) exceeds the 2 CPU(s) this process may run on: the threads take "
        "turns on them, and every time recorded counts their waits (threads=2 runs one per CPU)"
    )
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "usable_cpus", lambda: 1)
    run_dir = tmp_path / "run"
    overrides = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.enabled=false", "threads=2"]
    try:
        record = run_job(compose([*overrides, f"output_dir={run_dir}"]), run_dir=run_dir)
    finally:
        torch.set_num_threads(1)  # the suite's own count (conftest)
    assert record["metrics"]["torch_threads"] == 2  # a note, not a refusal
    notes = [line for line in capsys.readouterr().err.splitlines() if "CPU(s) this process may run on" in line]
    assert notes == [
        "harness: note: threads=2 exceeds the 1 CPU(s) this process may run on: the threads take turns on them, "
        "and every time recorded counts their waits (threads=1 runs one per CPU)"
    ]


def test_the_context_and_temporary_kv_count_the_rows_a_round_can_verify(tmp_path):
    """topology=sequence drafts one chain of max_depth rows, whatever max_nodes says: a run of 8 rows
    with topology.max_nodes=1900 was refused for 1900 rows over the target's context (and over a
    temporary-KV budget that its 8 rows fit). An expansion verifies the rows its widths make."""
    from harness.contracts import ContractError
    from harness.runner import plan_job, verified_rows
    from harness.target.loading import model_kv_bytes_per_token

    base = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4"]
    planned = plan_job(compose([*base, "topology.max_nodes=1900"]), None)
    assert planned.context.tree_rows == 8 and planned.context.max_prompt_tokens == planned.context.positions - 12
    # and each request's cache reserves those rows past its tokens, not max_nodes (1900 rows of KV per request)
    assert planned.round_cfg.max_nodes == 8
    assert verified_rows(planned.plan.budget) == (
        8,
        "topology=sequence drafts one chain of topology.max_depth=8",
    )
    expansion = ["proposer=draft_model", "topology=expansion", "topology.widths=[2,2,1]", "topology.max_nodes=40"]
    assert plan_job(compose([*base, *expansion]), None).context.tree_rows == 10  # 2 + 4 + 4
    assert plan_job(compose([*base, *expansion]), None).round_cfg.max_nodes == 10
    assert plan_job(compose([*base, "topology=sequences", "topology.max_nodes=40"]), None).context.tree_rows == 40
    bpt = model_kv_bytes_per_token(compose(base).model)
    fits = plan_job(compose([*base, "topology.max_nodes=1900", f"generation.temp_kv_budget_bytes={8 * bpt}"]), None)
    assert fits.temp_kv_budget_formula_bytes == 8 * bpt
    with pytest.raises(ContractError) as refused:
        plan_job(compose([*base, "topology.max_nodes=1900", f"generation.temp_kv_budget_bytes={8 * bpt - 1}"]), None)
    assert str(refused.value) == (
        f"8 candidate rows (topology=sequence drafts one chain of topology.max_depth=8) x generation.batch_size=1 "
        f"need {8 * bpt} bytes of temporary KV ({bpt} bytes per candidate row), over "
        f"generation.temp_kv_budget_bytes={8 * bpt - 1}"
    )
    run_dir = tmp_path / "run"  # the run the context check refused
    record = run_job(
        compose([*base, "topology.max_nodes=1900", "gates.enabled=false", f"output_dir={run_dir}"]), run_dir=run_dir
    )
    assert record["inert_options"] == [
        "topology.max_nodes=1900: topology=sequence drafts one chain of topology.max_depth=8 (a round verifies at "
        "most 8 rows)"
    ]


def test_unreachable_rows_and_levels_a_tiny_model_s_chat_unread_datastore_domains_and_top_p_are_inert():
    """Options that changed nothing and were not listed: topology.max_nodes past a chain's depth or an
    expansion's widths, topology.max_depth past the widths' levels, workload.chat on a model without a
    tokenizer, the workload's datastore domain with no datastore reading it, and top-p where top_k=1
    keeps the argmax. Where they apply they are no note."""
    from harness.runner import inert_options

    def inert(*overrides):
        return inert_options(compose(["model=tiny", *overrides]))

    assert inert("topology.max_nodes=1900") == [
        "topology.max_nodes=1900: topology=sequence drafts one chain of topology.max_depth=8 (a round verifies at "
        "most 8 rows)"
    ]
    assert inert("topology.max_depth=4") == []  # topology.max_nodes=8 is the packaged value, not set
    assert inert("topology.max_nodes=4") == []  # four rows of the eight-deep chain
    assert inert("topology=sequences", "topology.max_nodes=40") == []  # several chains fill them
    expansion = ["proposer=draft_model", "topology=expansion"]
    assert inert(*expansion, "topology.max_nodes=40", "topology.max_depth=5") == [
        "topology.max_nodes=40: topology.widths=[2,2,1] make 10 candidate rows (a round verifies at most 10 rows)",
        "topology.max_depth=5: topology=expansion drafts the 3 levels of topology.widths=[2,2,1]",
    ]
    assert inert(*expansion, "topology.max_nodes=10", "topology.max_depth=3") == []
    assert inert("proposer=draft_model", "topology=cartesian", "topology.max_depth=4") == [
        "topology.max_depth=4: topology=cartesian drafts the 3 levels of topology.widths=[3,2,2]"
    ]
    assert inert("proposer=draft_model", "topology=cartesian") == []  # its packaged max_depth, not set
    # no tokenizer: no chat template is applied
    assert inert("workload.chat=true") == ["workload.chat=true: model=tiny has no tokenizer (prompts are token ids)"]
    assert inert("workload=jsonl", "workload.path=q.jsonl") == []  # the workload's own chat=true, not set
    assert inert_options(compose(["model=smollm2", "workload.chat=true"])) == []
    # the datastore domain of the workload reaches a run only through a datastore option that reads it
    assert inert("workload.rest_corpus=sharegpt", "workload.rest_exclude=sharegpt_heldout") == [
        "workload.rest_corpus=sharegpt: proposer=prompt_lookup searches no datastore",
        "workload.rest_exclude=sharegpt_heldout: proposer=prompt_lookup searches no datastore",
    ]
    assert inert("experiment=sources/rest_T0", "workload.rest_corpus=sharegpt") == []
    assert inert("experiment=sources/rest_T0", "workload.rest_corpus=sharegpt", "proposer.datastore.corpus=stdlib") == [
        "workload.rest_corpus=sharegpt: no datastore the proposer searches reads it (one does where its corpus or "
        "exclude is ${workload.rest_corpus})"
    ]
    sampled = ["generation.temperature=0.7", "verifier=membership", "generation.top_p=0.9"]
    assert inert(*sampled, "generation.top_k=1") == [
        "generation.temperature=0.7: top_k=1 keeps the argmax at any temperature",
        "generation.top_p=0.9: top_k=1 keeps the argmax, which every nucleus holds",
    ]
    assert inert(*sampled, "generation.top_k=2") == []


def test_a_tracker_that_cannot_close_a_failed_run_leaves_the_job_s_own_error_and_the_earlier_record(
    tmp_path, monkeypatch, capsys
):
    """W&B failing while the failed job's run was closed (its service gone, tags that cannot be set)
    raised from the clean-up: that error replaced the job's own, and the earlier record stayed in
    .previous/. The job's error stands, the record goes back, and a warning names W&B's."""
    import harness.runner as runner
    from harness.tracking.wandb_tracker import NullTracker

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    base = ["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "gates.oracle=false", f"output_dir={out}"]
    earlier = run_job(compose(base), run_dir=out)

    class Broken(NullTracker):
        def fail(self, **kwargs):
            raise RuntimeError("wandb service process exited")

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(runner, "start_tracker", lambda cfg, planned: Broken())
    monkeypatch.setattr(runner, "measure", out_of_memory)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        run_job(compose([*base, "seed=1"]), run_dir=out)
    assert load_record(out / "record.json")["run_id"] == earlier["run_id"] and not (out / ".previous").exists()
    err = capsys.readouterr().err
    assert (
        "harness: warning: W&B could not close the failed job's run (RuntimeError: wandb service process exited)" in err
    )


def test_the_gates_leave_the_proposer_as_they_found_it(tmp_path, monkeypatch):
    """The gates run the measured proposer on the workload's first prompts: what it learned there (an
    adaptive draft threshold, an adaptive budget's acceptance) and the requests it remembered carried
    into the measurement, which a run whose gates came from the cache started without. The proposer
    leaves the gates with the learning, memory and counters it came with."""
    import harness.runner as runner

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(["model=tiny", "workload.limit=1", "generation.max_new_tokens=4", "proposer.budget_policy=adaptive"])
    cfg.proposer.verify_cost = [1.0 + 0.1 * k for k in range(cfg.topology.max_nodes + 1)]
    planned = runner.plan_job(cfg, tmp_path / "run")
    loaded = runner.load(cfg, planned)
    prepared = runner.prepare_job(cfg, planned, loaded)
    proposer = prepared.proposers[0]
    learned, forgotten = proposer.snapshot_learning(), []

    def learning_gates(cfg, *, proposer, **kwargs):
        proposer.acceptance = "learned in the gates"
        proposer.stats.extras["rows_proposed"] = 7
        return {}

    monkeypatch.setattr(runner, "run_gates", learning_gates)
    monkeypatch.setattr(type(proposer), "forget_requests", lambda self: forgotten.append(self))
    runner.gate(cfg, planned, loaded, prepared)
    assert type(proposer.acceptance) is type(learned["acceptance"])  # put back, not what the gates left
    assert vars(proposer.acceptance).keys() == vars(learned["acceptance"]).keys()
    assert forgotten == [proposer] and proposer.stats.extras["rows_proposed"] == 0


def test_a_batched_speedup_is_bounded_by_the_arms_batch_rounds_not_a_requests_tokens_per_round():
    """At batch size B > 1 one verify forward serves a batch round's live requests: the decode speedup
    speculation gives is bounded by the baseline's batch steps per token over the speculative arm's
    batch rounds per token, which a request's tokens per round can fall below (a B=4 run: 32 baseline
    steps against 4 batch rounds, 8.00x, from 7.36 tokens per request round) or rise above."""
    from harness.runner import past_rounds_speedup_note, run_notes

    def metrics(decode, *, per_round, rounds, ar_rounds, sizes=(4, 2), tokens=81, **more):
        return {
            "decode_speedup": decode,
            "mean_committed_per_round": per_round,
            "batch_rounds": rounds,
            "ar_batch_rounds": ar_rounds,
            "committed_tokens": tokens,
            "ar_tokens": tokens,
            "batch_requests": list(sizes),
            **more,
        }

    # 7.9x from 7.36 tokens per request round: within the 8.00x the batch rounds allow, no note
    real = metrics(7.9, per_round=81 / 11, rounds=4, ar_rounds=32)
    assert past_rounds_speedup_note(real) is None
    assert run_notes({"metrics": real, "per_prompt": [{}]}) == []
    # past the batch rounds' 8.00x: noted, naming that bound
    past = past_rounds_speedup_note(metrics(8.5, per_round=81 / 11, rounds=4, ar_rounds=32))
    assert past.startswith(
        "decode speedup 8.50x, past the 8.00x its batch rounds allow (the baseline's 32 batch steps for 81 tokens, "
        "the speculative arm's 4 batch rounds for 81): each batch round runs at least one verify forward"
    )
    # the batch rounds' bound below the tokens per request round (32 / 25 = 1.28 against 1.40): noted
    low = past_rounds_speedup_note(metrics(1.36, per_round=81 / 58, rounds=25, ar_rounds=32, sizes=(3, 3)))
    assert low is not None and "past the 1.28x its batch rounds allow" in low
    # arms committing different tokens: the bound is in steps per token
    uneven = metrics(2.2, per_round=2.5, rounds=25, ar_rounds=60, tokens=100, ar_tokens=120)
    assert "past the 2.00x its batch rounds allow" in past_rounds_speedup_note(uneven)  # not 60 / 25 = 2.40x
    assert past_rounds_speedup_note({**uneven, "decode_speedup": 2.05}) is None
    # nothing accepted at B > 1: every batch round as long as a baseline step
    none = metrics(1.3, per_round=1.0, rounds=32, ar_rounds=32, sizes=(3, 3))
    assert past_rounds_speedup_note(none).startswith("decode speedup 1.30x with no proposed token accepted")
    # end to end likewise
    e2e = metrics(7.0, per_round=81 / 11, rounds=4, ar_rounds=32, speedup=7.9)
    assert past_rounds_speedup_note(e2e) is None
    e2e_past = past_rounds_speedup_note({**e2e, "speedup": 9.0, "prefill_ms_total": 1.0, "ar_prefill_ms_total": 9.0})
    assert e2e_past.startswith("end-to-end speedup 9.00x, past the 8.00x its batch rounds allow")
    # a batched record without its batch figures is not judged by the requests' tokens per round
    bare = {"decode_speedup": 7.9, "mean_committed_per_round": 7.36, "batch_requests": [4, 2]}
    assert past_rounds_speedup_note(bare) is None
    # batch 1 is judged by the tokens per round as before, whatever the batch figures say
    one = metrics(2.14, per_round=1.043, rounds=76, ar_rounds=200, sizes=(1, 1, 1))
    assert past_rounds_speedup_note(one).startswith("decode speedup 2.14x from 1.04 tokens committed per round")
