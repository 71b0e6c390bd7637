"""On the embedded SmolLM2 (8,192 positions): a 75,600-token prompt is refused before any forward
(or cut from the left to what fits), and a conversation's second turn is the chat template over the
first question, the decoded first answer and the second question."""

import json

import pytest

from harness import runner
from harness.config import compose
from harness.workloads.prompts import WorkloadError

pytestmark = pytest.mark.model


@pytest.fixture
def no_forward(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(runner, "run_gates", refuse)
    monkeypatch.setattr(runner, "Arms", refuse)


def test_an_overlong_prompt_is_refused_or_cut_on_smollm2(tmp_path, no_forward):
    wl = tmp_path / "long.jsonl"
    wl.write_text(json.dumps({"id": "long", "prompt": " x" * 75_600}) + "\n")
    base = ["model=smollm2", "workload=jsonl", f"workload.path={wl}", "workload.chat=false"]
    cfg = compose([*base, "workload.truncate=false"])
    planned = runner.plan_job(cfg, tmp_path)
    assert planned.context.positions == 8192
    with pytest.raises(WorkloadError) as err:
        runner.load(cfg, planned)
    tok = runner.load_models(cfg)[0].tokenizer
    n = len(tok(" x" * 75_600, add_special_tokens=False)["input_ids"])
    assert n >= 75_600
    msg = str(err.value)
    assert msg.startswith(f"prompt 'long' turn 1: {n:,} prompt tokens + generation.max_new_tokens=64 + 8 ")
    assert msg.endswith(
        "> 8,192 positions of the target (model=smollm2); workload.truncate=left cuts the oldest "
        "text, keeping a chat template's opening (recorded per prompt)"
    )
    cfg = compose([*base, "workload.truncate=left"])
    loaded = runner.load(cfg, runner.plan_job(cfg, tmp_path))
    (first,) = loaded.first_turns
    assert len(first.ids) == 8192 - 64 - 8 and first.cut_tokens == n - len(first.ids)
    # through the chat template the system block and the user header stay; the question's start goes
    chat = compose([*base[:-1], "workload.chat=true", "workload.truncate=left"])
    (turn,) = runner.load(chat, runner.plan_job(chat, tmp_path)).first_turns
    text = tok.decode(turn.ids)
    assert len(turn.ids) == 8192 - 64 - 8 and text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\n x x" in text and text.endswith("<|im_start|>assistant\n")


def test_smollm2_second_turn_carries_the_first_answer(tmp_path):
    from helpers import spec_bench_questions, write_jsonl

    path = write_jsonl(tmp_path / "q.jsonl", spec_bench_questions(1, categories=("writing",)))
    cfg = compose(["model=smollm2", "workload=spec_bench", f"workload.path={path}"])
    planned = runner.plan_job(cfg, tmp_path)
    tok = runner.load_models(cfg)[0].tokenizer
    from harness.workloads.conversations import PromptEncoder

    enc = PromptEncoder(tok, chat=True, eos=frozenset({tok.eos_token_id}), limit=planned.context)
    (prompt,) = planned.prompts
    answer = tok("Hawaii is lovely.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    text = tok.decode(enc.turn(prompt, [answer]).ids)
    assert (
        f"<|im_start|>user\n{prompt.turns[0]}<|im_end|>\n<|im_start|>assistant\nHawaii is lovely.<|im_end|>\n"
        f"<|im_start|>user\n{prompt.turns[1]}<|im_end|>\n<|im_start|>assistant\n"
    ) in text
