"""Spec-Bench conversations through `harness run` on the tiny model: every turn generated in order,
each arm fed its own answers, the greedy gate on every turn, per-turn metrics, the context limit
(refused before any forward, or cut from the left and recorded per turn) and bad files refused
before any model is loaded."""

import json

import pytest
from helpers import spec_bench_questions, write_jsonl

from harness import runner
from harness.app import run_main
from harness.config import compose
from harness.engine.arms import Arms
from harness.workloads.conversations import PromptEncoder
from harness.workloads.prompts import WorkloadError

BASE = ["model=tiny", "generation.max_new_tokens=10", "generation.warmup_tokens=2", "gates.oracle=false", "threads=1"]
CATS = ("writing", "qa", "coding", "rag")  # two two-turn categories, two one-turn ones


@pytest.fixture
def questions(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    return write_jsonl(tmp_path / "question.jsonl", spec_bench_questions(1, categories=CATS))


def spec_bench_cfg(path, *overrides):
    return compose([*BASE, "workload=spec_bench", f"workload.path={path}", *overrides])


def outputs(run_dir):
    return [json.loads(x) for x in (run_dir / "outputs.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("batch_size", [1, 2])
def test_every_turn_runs_in_order_on_each_arms_own_answer(tmp_path, questions, batch_size):
    run_dir = tmp_path / "run"
    record = runner.run_job(spec_bench_cfg(questions, f"generation.batch_size={batch_size}"), run_dir=run_dir)
    m, rows = record["metrics"], record["per_prompt"]
    assert [(r["prompt_id"], r["category"], len(r["turns"])) for r in rows] == [
        ("81", "writing", 2),
        ("82", "qa", 1),
        ("83", "coding", 2),
        ("84", "rag", 1),
    ]
    assert m["conversation_turns"] == 6 and m["per_turn"]["1"]["requests"] == 4 and m["per_turn"]["2"]["requests"] == 2
    # the speculative arm's time and tokens count every turn
    for arm, key in (("spec", "committed_tokens"), ("ar", "ar_tokens")):
        assert m[key] == sum(r[f"{arm}_tokens"] for r in rows) == m["per_turn"]["1"][key] + m["per_turn"]["2"][key]
        assert all(r[f"{arm}_tokens"] == sum(t[f"{arm}_tokens"] for t in r["turns"]) for r in rows)
        assert all(r[f"{arm}_decode_ms"] == pytest.approx(sum(t[f"{arm}_decode_ms"] for t in r["turns"])) for r in rows)
    if batch_size == 1:  # one request per step: the batch wall times are the prompt's own
        total = sum(r["spec_batch_decode_ms"] for r in rows)
        assert m["time_per_committed_token_ms"] == pytest.approx(total / m["committed_tokens"])
    # turn 2's prompt: turn 1's question, that arm's own turn-1 answer (EOS removed), turn 2's question
    enc = PromptEncoder(None, chat=True, vocab_size=96, eos=frozenset({2}))
    by_id = {q["question_id"]: q for q in spec_bench_questions(1, categories=CATS)}
    for o in outputs(run_dir):
        q = by_id[o["question_id"]]
        assert o["category"] == q["category"] and len(o["turns"]) == len(q["turns"])
        # the top-level ids are the first turn's, and the row says so where there are more
        assert o["n_turns"] == len(q["turns"])
        assert o["prompt_token_ids"] == enc.synthetic(q["turns"][0]) == o["turns"][0]["spec_prompt_token_ids"]
        if len(q["turns"]) == 2:
            for arm in ("ar", "spec"):
                own = [t for t in o["turns"][0][f"{arm}_token_ids"] if t != 2]
                want = enc.synthetic(q["turns"][0]) + own + enc.synthetic(q["turns"][1])
                assert o["turns"][1][f"{arm}_prompt_token_ids"] == want
            assert o["turns"][1]["spec_round_tokens"] and sum(o["turns"][1]["spec_round_tokens"]) == len(
                o["turns"][1]["spec_token_ids"]
            )
    gate = record["gates"]["greedy_equality"]
    assert gate["status"] == "passed" and gate["turns"] == 6 and gate["prompts"] == 4
    assert m["context"]["truncated_turns"] == 0 and m["context"]["rule"] == "left"


def test_each_arms_later_turn_holds_its_own_answer_where_the_arms_answers_differ(tmp_path, questions):
    """At temperature 0 both arms answer with the same tokens, so a later turn built from the other
    arm's answer passed every check; here a draft of other weights makes the arms' answers differ."""
    sampled = ["generation.temperature=0.7", "verifier=rejection", "proposer=draft_model", "proposer.model.name=tiny"]
    run_dir = tmp_path / "run"
    cfg = spec_bench_cfg(questions, *sampled, "proposer.model.seed=1", "gates.enabled=false")
    runner.run_job(cfg, run_dir=run_dir)
    enc = PromptEncoder(None, chat=True, vocab_size=96, eos=frozenset({2}))
    by_id = {q["question_id"]: q for q in spec_bench_questions(1, categories=CATS)}
    conversations = [o for o in outputs(run_dir) if o["n_turns"] == 2]
    assert len(conversations) == 2
    for o in conversations:
        (ask, follow), (first, second) = (enc.synthetic(t) for t in by_id[o["question_id"]]["turns"]), o["turns"]
        assert first["ar_token_ids"] != first["spec_token_ids"]  # the arms' first answers differ
        for arm, other in (("ar", "spec"), ("spec", "ar")):
            own, others = ([t for t in first[f"{a}_token_ids"] if t != 2] for a in (arm, other))
            assert second[f"{arm}_prompt_token_ids"] == ask + own + follow
            assert second[f"{arm}_prompt_token_ids"] != ask + others + follow


def test_follow_up_receives_the_arms_own_earlier_answers(tiny_model):
    from harness.contracts import Budget
    from harness.engine.decode import RoundConfig
    from harness.proposers.base import NullProposer
    from harness.random_source import TorchRandomSource
    from harness.target.backend import CausalLMBackend
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    seen = []

    def follow_up(i, turn, arm, answers):
        seen.append((i, turn, arm, [list(a) for a in answers]))
        return [5 + i, 6, 7] + [t for a in answers for t in a]

    nulls = [
        NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h") for _ in range(4)
    ]
    arms = Arms(
        target=CausalLMBackend(tiny_model),
        spec_proposers=nulls[:2],
        null_proposers=nulls[2:],
        spec_verifier=get_verifier("greedy"),
        ar_verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompts=[[3, 4, 5], [6, 7], [8]],
        seed=0,
        batch_size=2,
        max_new_tokens=3,
        eos_token_ids=frozenset(),
        round_cfg=RoundConfig(max_nodes=1, max_depth=1),
        rng_factory=TorchRandomSource,
        turns=[3, 1, 2],
        follow_up=follow_up,
    )
    real_run = arms._run

    def spec_answers_its_own(arm, idx, prompts, turn, max_new_tokens):  # the arms' answers differ
        out = real_run(arm, idx, prompts, turn, max_new_tokens)
        if arm == "spec":
            for i, req in zip(idx, out.requests, strict=True):
                req.tokens[:] = [90 - i - 10 * turn - k for k in range(len(req.tokens))]
        return out

    arms._run = spec_answers_its_own
    assert list(arms.run()) == [0, 1, 2]
    res = arms.result
    assert sorted((i, t, a) for i, t, a, _ in seen) == sorted(
        (i, t, a) for i, t in ((0, 1), (0, 2), (2, 1)) for a in ("ar", "spec")
    )
    for i, turn, arm, answers in seen:
        other = "ar" if arm == "spec" else "spec"
        assert answers == [res.request(arm, i, t).tokens for t in range(turn)]
        assert answers != [res.request(other, i, t).tokens for t in range(turn)]
    assert res.turns_of == {0: 3, 1: 1, 2: 2} and res.step_turn == [0, 1, 2, 0, 1]
    assert [len(res.request("spec", i, t).tokens) for i, t in ((0, 0), (0, 1), (0, 2), (2, 1))] == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="need follow_up"):
        Arms(**{**arms_kwargs(arms), "turns": [2, 1, 1], "follow_up": None})


def test_each_turn_is_started_by_either_arm_alike_over_the_batches(tiny_model):
    """The arms' order alternated per step, so with two-turn conversations every first turn ran the
    baseline first and every second turn the speculative arm first (a run-order effect confounded
    with the turn). Batch j's turn t starts with the baseline where j + t is even, and each turn's
    record names its first arm."""
    from harness.contracts import Budget
    from harness.engine.decode import RoundConfig
    from harness.proposers.base import NullProposer
    from harness.random_source import TorchRandomSource
    from harness.target.backend import CausalLMBackend
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    one = Budget(shape="sequence", max_nodes=1, max_depth=1)
    prompts = [[5 + i, 6, 7] for i in range(4)]
    arms = Arms(
        target=CausalLMBackend(tiny_model),
        spec_proposers=[NullProposer(budget=one, manifest_hash="h")],
        null_proposers=[NullProposer(budget=one, manifest_hash="h")],
        spec_verifier=get_verifier("greedy"),
        ar_verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompts=prompts,
        seed=0,
        batch_size=1,
        max_new_tokens=2,
        eos_token_ids=frozenset(),
        round_cfg=RoundConfig(max_nodes=1, max_depth=1),
        rng_factory=TorchRandomSource,
        turns=[2, 2, 2, 2],
        follow_up=lambda i, turn, arm, answers: prompts[i] + [t for a in answers for t in a] + [9],
    )
    order = []
    real_run = arms._run

    def spy(arm, idx, batch_prompts, turn, max_new_tokens):
        order.append((idx[0], turn, arm))
        return real_run(arm, idx, batch_prompts, turn, max_new_tokens)

    arms._run = spy
    assert list(arms.run()) == [0, 1, 2, 3]
    first = {(i, t): arm for k, (i, t, arm) in enumerate(order) if k % 2 == 0}
    assert first == {(i, t): ("ar" if (i + t) % 2 == 0 else "spec") for i in range(4) for t in range(2)}
    for turn in range(2):
        assert sorted(first[(i, turn)] for i in range(4)) == ["ar", "ar", "spec", "spec"]
        assert [arms.result.turn_fields(i, turn)["first_arm"] for i in range(4)] == [first[(i, turn)] for i in range(4)]


def arms_kwargs(arms):
    return dict(
        target=arms.target,
        spec_proposers=arms.slots["spec"][0],
        null_proposers=arms.slots["ar"][0],
        spec_verifier=arms.slots["spec"][1],
        ar_verifier=arms.slots["ar"][1],
        policy=arms.policy,
        prompts=arms.prompts,
        seed=0,
        batch_size=2,
        max_new_tokens=3,
        eos_token_ids=frozenset(),
        round_cfg=arms.round_cfg,
        rng_factory=arms.rng_factory,
    )


# ------------------------------------------------------------------------------ context limit


@pytest.fixture
def no_forward(monkeypatch):
    """Fail if the run reaches the gates or the measurement (the first forwards of a run)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a forward ran before the refusal")

    monkeypatch.setattr(runner, "run_gates", refuse)
    monkeypatch.setattr(runner, "Arms", refuse)


def test_an_overlong_prompt_is_refused_before_any_forward(tmp_path, questions, no_forward, capsys):
    run_dir = tmp_path / "run"
    small = ["model.tiny.max_position_embeddings=40", "workload.truncate=false"]  # room: 40 - 10 - 8 = 22
    with pytest.raises(WorkloadError) as err:
        runner.run_job(spec_bench_cfg(questions, *small), run_dir=run_dir)
    assert str(err.value).startswith("prompt '81' turn 2: ") and "(each earlier answer counted" in str(err.value)
    assert "> 40 positions of the target (model=tiny)" in str(err.value)
    argv = [*BASE, "workload=spec_bench", f"workload.path={questions}", *small]
    assert run_main([*argv, f"output_dir={run_dir}", f"hydra.run.dir={tmp_path / 'hydra'}"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("harness run: refused: prompt '81' turn 2")
    assert not run_dir.exists()


def test_left_truncation_cuts_each_turn_and_records_it(tmp_path, questions, capsys):
    from harness.tracking.compare import main as compare_main
    from harness.tracking.store import load_record

    run_dir = tmp_path / "run"
    small = ["model.tiny.max_position_embeddings=58", "workload.truncate=left"]  # room 40
    argv = [*BASE, "workload=spec_bench", f"workload.path={questions}", *small]
    assert run_main([*argv, f"output_dir={run_dir}", f"hydra.run.dir={tmp_path / 'hydra'}"]) == 0
    record = load_record(run_dir)
    n_cut = record["metrics"]["context"]["truncated_prompts"]
    assert n_cut >= 1
    # said at the end of the run, and under the comparison: the figures are for cut prompts
    assert (
        f"harness run: note: {n_cut} of {len(record['per_prompt'])} prompts had their oldest text cut to fit 40 "
        "tokens (the 58 positions of the target (model=tiny), less generation.max_new_tokens and the candidate rows)"
    ) in capsys.readouterr().err
    assert compare_main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"note: arms whose prompts were cut to fit the model's positions (prompt_lookup ({n_cut} of " in out
    ctx = record["metrics"]["context"]
    assert ctx["positions"] == 58 and ctx["max_prompt_tokens"] == 40 and ctx["rule"] == "left"
    first_len = {q["question_id"]: len(q["turns"][0].encode()) for q in spec_bench_questions(1, categories=CATS)}
    for row, o in zip(record["per_prompt"], outputs(run_dir), strict=True):
        for t, tr in zip(row["turns"], o["turns"], strict=True):
            assert t["spec_prompt_tokens"] == len(tr["spec_prompt_token_ids"]) <= 40
            if t["turn"] == 1:
                assert t["spec_cut_tokens"] == max(0, first_len[o["question_id"]] - 40)
            assert tr["spec_cut_tokens"] == t["spec_cut_tokens"]
        assert row["cut_tokens"] == sum(t["spec_cut_tokens"] for t in row["turns"])  # each arm once, not summed
        assert row["ar_cut_tokens"] == sum(t["ar_cut_tokens"] for t in row["turns"])
    cut = [(r["prompt_id"], t["turn"]) for r in record["per_prompt"] for t in r["turns"] if t["spec_cut_tokens"]]
    assert ("81", 2) in cut  # a second turn outgrows the room: cut, not refused
    assert ctx["truncated_turns"] == len(cut) and ctx["cut_tokens"] == sum(
        r["cut_tokens"] for r in record["per_prompt"]
    )
    assert ctx["ar_cut_tokens"] == sum(r["ar_cut_tokens"] for r in record["per_prompt"])
    assert record["gates"]["greedy_equality"]["status"] == "passed"


def test_generation_budget_beyond_the_positions_is_refused_at_plan(tmp_path, questions, monkeypatch):
    monkeypatch.setattr(runner, "load_model", lambda **kw: pytest.fail("a model was loaded"))
    with pytest.raises(WorkloadError, match=r"max_new_tokens=2048 \+ 8 candidate rows .* no room .* 2,048 positions"):
        runner.plan_job(spec_bench_cfg(questions, "generation.max_new_tokens=2048"), tmp_path)


def test_the_draft_models_positions_count(tmp_path, questions):
    cfg = spec_bench_cfg(
        questions, "proposer=draft_model", "proposer.model.name=tiny", "proposer.model.tiny.max_position_embeddings=100"
    )
    ctx = runner.plan_job(cfg, tmp_path).context
    assert (ctx.positions, ctx.limited_by) == (100, "the draft model (model=tiny)")


def test_humaneval_prompts_reach_the_tiny_model_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose([*BASE, "workload.limit=6"])
    planned = runner.plan_job(cfg, tmp_path)
    loaded = runner.load(cfg, planned)
    assert [len(ids) for _, ids in loaded.items] == [len(p.text.encode()) for p in planned.prompts]
    assert max(len(ids) for _, ids in loaded.items) > 96  # the old synthetic encoder cut at 96 bytes


# ------------------------------------------------------------------------------ bad files


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"question_id": 1, "category": "qa", "turns": ["a"]}\n{"text": "b"}\n', ":2: neither a Spec-Bench question"),
        ('{"question_id": 1, "category": "qa", "turns": []}\n', ':1: question 1 has empty "turns"'),
        (
            '{"question_id": 1, "category": "qa", "turns": ["a"]}\n'
            '{"question_id": 1, "category": "qa", "turns": ["b"]}\n',
            ":2: duplicate question_id 1 (first on line 1)",
        ),
        (  # a misspelt key was dropped without a word: the line was measured in every split
            '{"question_id": 1, "category": "qa", "turns": ["a"]}\n'
            '{"question_id": 2, "category": "qa", "turns": ["b"], "spilt": "calibration"}\n',
            ":2: unknown key 'spilt' in a Spec-Bench question (did you mean 'split'?); its keys are question_id, "
            "category, turns, reference, split",
        ),
        (
            '{"question_id": 1, "category": "qa", "turns": ["a"], "answer": "b"}\n',
            ":1: unknown key 'answer' in a Spec-Bench question; its keys are question_id, category, turns,",
        ),
        (  # an unknown category was refused naming the file but not the line
            '{"question_id": 1, "category": "qa", "turns": ["a"]}\n'
            '{"question_id": 2, "category": "poetry", "turns": ["b"]}\n',
            ":2: question 2 has category 'poetry', not one of Spec-Bench's",
        ),
    ],
)
def test_bad_files_are_refused_before_any_model_is_loaded(tmp_path, monkeypatch, capsys, content, message):
    monkeypatch.setattr(runner, "load_model", lambda **kw: pytest.fail("a model was loaded"))
    bad = tmp_path / "q.jsonl"
    bad.write_text(content)
    run_dir = tmp_path / "run"
    argv = [*BASE, "workload=spec_bench", f"workload.path={bad}", f"output_dir={run_dir}"]
    assert run_main([*argv, f"hydra.run.dir={tmp_path / 'hydra'}", "tracking=wandb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and str(bad) in err[0]
    assert not run_dir.exists() and not list(tmp_path.rglob("wandb"))


def test_an_unknown_category_is_refused_before_any_model_is_loaded(tmp_path, questions, monkeypatch, capsys):
    monkeypatch.setattr(runner, "load_model", lambda **kw: pytest.fail("a model was loaded"))
    argv = [*BASE, "workload=spec_bench", f"workload.path={questions}", "workload.categories=[qa,sumarization]"]
    assert run_main([*argv, f"output_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "workload.categories: 'sumarization' is not a category of" in err[0]
    assert not (tmp_path / "run").exists()


def test_greedy_gate_checks_a_turn_whose_prompts_differ_at_the_speculative_context(tiny_model):
    import torch

    from harness.gates.greedy import check_prompt, greedy_equality
    from harness.gates.status import GateError

    prompt = [5, 9, 11, 4]
    with torch.inference_mode():  # the target's own greedy continuation of `prompt`
        ids = list(prompt)
        for _ in range(5):
            ids.append(int(tiny_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    spec = ids[len(prompt) :]
    other = [7, 7]  # the AR arm's prompt after an earlier near-tie: its tokens are not comparable
    assert check_prompt(tiny_model, prompt_id="q", prompt=prompt, ar_prompt=other, ar=[1, 1], spec=spec, tol=1e-3) == []
    bad = spec[:2] + [(spec[2] + 1) % 96] + spec[3:]
    with pytest.raises(GateError, match=r"prompt 'q' turn 2 at generated position 2: .*\(the arms' prompts differ"):
        check_prompt(tiny_model, prompt_id="q", prompt=prompt, ar_prompt=other, ar=[1], spec=bad, tol=1e-3, turn=2)
    row = {
        "prompt_id": "q",
        "prompt_token_ids": prompt,
        "ar_token_ids": spec,
        "spec_token_ids": spec,
        "turns": [
            {
                "turn": 1,
                "spec_prompt_token_ids": prompt,
                "ar_prompt_token_ids": prompt,
                "ar_token_ids": spec,
                "spec_token_ids": spec,
            },
            {
                "turn": 2,
                "spec_prompt_token_ids": prompt,
                "ar_prompt_token_ids": other,
                "ar_token_ids": [1],
                "spec_token_ids": spec,
            },
        ],
    }
    entry = greedy_equality(tiny_model, [row], max_fraction=0.01)
    assert (entry["prompts"], entry["turns"], entry["tokens"]) == (1, 2, 10)
    assert entry["identical_turns"] == 1 and entry["turns_with_differing_prompts"] == 1
    with pytest.raises(GateError, match="prompt 'q' turn 2"):
        greedy_equality(
            tiny_model,
            [{**row, "turns": [row["turns"][0], {**row["turns"][1], "spec_token_ids": bad}]}],
            max_fraction=0.01,
        )


def test_greedy_identical_reads_every_turn_not_only_the_first(tmp_path, questions, monkeypatch):
    real = runner.measure

    def second_turn_differs(cfg, planned, loaded, prepared):
        measured = real(cfg, planned, loaded, prepared)
        for o in measured.outputs:
            if len(o["turns"]) > 1:
                o["turns"][1]["spec_token_ids"] = o["turns"][1]["spec_token_ids"] + [3]
                break
        return measured

    monkeypatch.setattr(runner, "measure", second_turn_differs)
    record = runner.run_job(spec_bench_cfg(questions, "gates.enabled=false"), run_dir=tmp_path / "run")
    first_turns = [o["ar_token_ids"] == o["spec_token_ids"] for o in outputs(tmp_path / "run")]
    assert all(first_turns) and record["metrics"]["greedy_identical"] is False


def test_rounds_and_per_turn_metrics_number_turns_from_one_and_name_the_decode_speedup(tmp_path, questions):
    record = runner.run_job(spec_bench_cfg(questions), run_dir=tmp_path / "run")
    rounds = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    per_turn = record["metrics"]["per_turn"]
    shas = [row["prompt_sha256"] for row in record["per_prompt"]]  # what pairs prompts across runs
    assert len(set(shas)) == len(shas) and all(len(x) == 16 for x in shas)
    assert {str(r["turn"]) for r in rounds} == set(per_turn) == {"1", "2"}  # the questions have 1 or 2 turns
    for entry in per_turn.values():
        assert "speedup" not in entry  # the record's speedup is end to end; a turn's is decode only
        assert entry["decode_speedup"] == pytest.approx(
            entry["ar_time_per_token_ms"] / entry["time_per_committed_token_ms"]
        )


def test_a_later_turn_whose_answers_re_tokenize_longer_is_cut_and_said_not_refused_mid_run(
    tmp_path, questions, monkeypatch, capsys
):
    """workload.truncate=false checks every turn before any model work with each earlier answer at
    max_new_tokens tokens; an answer fed back as text can tokenize longer than the tokens generated.
    Such a turn was refused after the gates and the first turns had run (no record); it is cut from
    its oldest text now, recorded and said."""
    from harness.tracking.store import load_record

    real = PromptEncoder.raw

    def retokenized(self, prompt, answers=()):  # each answer fed back comes out three tokens longer
        ids = real(self, prompt, answers)  # (the check's bound feeds empty answers: counted as they are)
        return ids[:1] + [7, 7, 7] * sum(1 for a in answers if len(a)) + ids[1:]

    monkeypatch.setattr(PromptEncoder, "raw", retokenized)
    run_dir = tmp_path / "run"
    argv = [*BASE, "workload=spec_bench", f"workload.path={questions}", "workload.truncate=false"]
    # the longest second turn with its answer at max_new_tokens, exactly at the room: the check passes
    cfg = spec_bench_cfg(questions, "workload.truncate=false")
    encoder = PromptEncoder(None, chat=True, vocab_size=96)
    from harness.workloads.prompts import load_configured

    prompts = load_configured(cfg.workload)
    need = max(len(real(encoder, p, [[]] * (p.n_turns - 1))) + 10 * (p.n_turns - 1) for p in prompts)
    positions = need + 10 + int(cfg.topology.max_nodes)
    argv += [f"model.tiny.max_position_embeddings={positions}"]
    assert run_main([*argv, f"output_dir={run_dir}", f"hydra.run.dir={tmp_path / 'hydra'}"]) == 0
    record = load_record(run_dir)
    ctx = record["metrics"]["context"]
    assert ctx["rule"] == "refuse" and ctx["truncated_turns"] >= 1 and ctx["cut_tokens"] >= 3
    assert all(t["turn"] > 1 for r in record["per_prompt"] for t in r["turns"] if t["spec_cut_tokens"])
    assert "tokenized longer than the tokens generated" in capsys.readouterr().err
