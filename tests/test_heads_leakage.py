"""The workload-governance gate of proposers running an artifact trained here (draft heads, EAGLE
drafts, the early-exit adapter): every workload text the model sees is looked up in the artifact's
training text, and one sharing a 32-token window with it refuses the run (one line, exit 2, no
record) unless allow_leakage=true, which leaves the record ungated. One tiny Hydra artifact, trained
once for the module on a small ShareGPT budget, serves every test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from checkpoint_fixtures import boundary_tokenizer

from harness.heads.artifacts import TrainingLeakage, training_text
from harness.heads.checkpoint import read_config_object
from harness.prepare.heads_data import byte_ids, run_order
from harness.workloads.corpora import sharegpt_conversations
from harness.workloads.datastore import LEAKAGE_THRESHOLD, LeakageError
from harness.workloads.prompts import Prompt

VOCAB = 96  # model=tiny
TRAIN = [
    "model=tiny",
    "model.linear_kernel=default",  # no native kernels to build into the test's own cache
    "proposer=hydra",
    "proposer.data.token_budget=2000",
    "proposer.data.held_out_tokens=200",
]
CLEAN = "Qz7 vx9 Kw3 jq8 Zx2 vq5 Jz4 kx6 Wq1 zj0: a made-up string of letter-digit groups for this test alone."


def stream_documents(cache: Path) -> list[np.ndarray]:
    """The training stream's documents (its tokens cut where the segment id changes)."""
    from harness.prepare.heads_data import load_stream

    (path,) = (cache / "heads" / "streams").glob("*-train.safetensors")
    stream = load_stream(path)
    tokens, segments = stream.tokens.numpy(), stream.segment_ids.numpy()
    return np.split(tokens, np.flatnonzero(segments[1:] != segments[:-1]) + 1)


def contains(tokens: np.ndarray, ids: list[int]) -> bool:
    n = len(ids)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, n)
    return bool((windows == np.asarray(ids)).all(axis=1).any())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private cache holding the trained Hydra artifact, a training conversation's first user turn
    (its text is in the training stream) and a clean text."""
    from harness.app import train_main

    root = tmp_path_factory.mktemp("heads_leakage")
    old = os.environ.get("HARNESS_CACHE")
    os.environ["HARNESS_CACHE"] = str(root / "cache")
    assert train_main(TRAIN) == 0
    (manifest_path,) = (root / "cache" / "artifacts").glob("hydra-*/manifest.json")
    documents = stream_documents(root / "cache")
    tokens = np.concatenate(documents)
    leaked = next(  # a training conversation's opening text, long enough to hold a window
        text
        for text in (run_order(c.turns)[0].text for c in sharegpt_conversations("train")[:50] if run_order(c.turns))
        if len(text.encode()) >= 2 * LEAKAGE_THRESHOLD
        and contains(tokens, byte_ids(text, vocab_size=VOCAB, max_len=64))
    )
    assert not contains(tokens, byte_ids(CLEAN, vocab_size=VOCAB, max_len=LEAKAGE_THRESHOLD))
    yield {
        "root": root,
        "cache": root / "cache",
        "manifest": read_config_object(manifest_path),
        "tokens": tokens,
        "documents": documents,
        "leaked": leaked,
    }
    if old is None:
        os.environ.pop("HARNESS_CACHE", None)
    else:
        os.environ["HARNESS_CACHE"] = old


def workload(env, name: str, rows: list[dict]) -> Path:
    path = env["root"] / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_args(path: Path, out: Path, *extra: str) -> list[str]:
    return [
        *TRAIN,
        "workload=jsonl",
        f"workload.path={path}",
        "generation.max_new_tokens=4",
        "generation.warmup_tokens=2",
        "threads=1",
        f"output_dir={out}",
        f"hydra.run.dir={out.parent / (out.name + '_hydra')}",
        *extra,
    ]


# ------------------------------------------------------------------------------ runs


def test_a_prompt_copied_from_the_training_text_refuses_the_run(env, tmp_path, capsys):
    from harness.app import run_main

    path = workload(env, "leaked", [{"id": "leak", "prompt": env["leaked"]}, {"id": "clean", "prompt": CLEAN}])
    out = tmp_path / "run"
    assert run_main(run_args(path, out)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "refused" in line]
    assert len(err) == 1 and "harness run: refused: evaluation leakage: 1 of 2" in err[0]
    assert "leak (prompt)" in err[0] and "allow_leakage=true" in err[0] and "clean" not in err[0]
    assert not (out / "record.json").exists()


def test_allow_leakage_runs_ungated_and_names_the_leaked_prompt(env, tmp_path, capsys):
    from harness.app import run_main

    path = workload(env, "leaked", [{"id": "leak", "prompt": env["leaked"]}, {"id": "clean", "prompt": CLEAN}])
    out = tmp_path / "run"
    assert run_main(run_args(path, out, "allow_leakage=true")) == 0
    assert (
        "harness: gate workload_governance let 1 leaked prompt(s) through by allow_leakage=true (leak): the record "
        "will say gated: false"
    ) in capsys.readouterr().err
    record = json.loads((out / "record.json").read_text())
    gate = record["gates"]["workload_governance"]
    assert record["gated"] is False
    assert gate["status"] == "skipped" and gate["override"] == "allow_leakage=true"
    assert gate["kind"] == "training_leakage" and gate["artifact_id"] == env["manifest"]["artifact_id"]
    assert gate["leaked"] == ["leak"] and gate["allow_leakage"] is True and gate["seconds"] >= 0
    rows = {r["prompt_id"]: r for r in gate["items"]}
    assert rows["leak"]["leaked"] is True and rows["leak"]["allowed"] is True
    assert rows["clean"]["leaked"] is False
    assert gate["training_text"]["origin"] == "cache" and gate["training_text"]["tokens"] == len(env["tokens"])


def test_a_clean_workload_passes_the_gate(env, tmp_path):
    from harness.app import run_main

    path = workload(env, "clean", [{"id": "clean", "prompt": CLEAN}])
    out = tmp_path / "run"
    assert run_main(run_args(path, out)) == 0
    record = json.loads((out / "record.json").read_text())
    gate = record["gates"]["workload_governance"]
    assert gate["status"] == "passed" and gate["leaked"] == [] and gate["texts_checked"] == 1
    assert record["gated"] is True


# ------------------------------------------------------------------------------ the window check


def check(env, items, **kw):
    return TrainingLeakage(env["manifest"], tokenizer=None, vocab_size=VOCAB).check(items, **kw)


def test_the_window_check_is_exact_at_the_threshold(env):
    """A prompt holding 31 consecutive tokens of a training document passes; 32 leak. The ids
    around the span (0, 1, 2) are no byte id, so they extend no match."""
    doc = max(env["documents"], key=len)
    assert len(doc) >= 2 * LEAKAGE_THRESHOLD
    for n, leaks in ((LEAKAGE_THRESHOLD - 1, False), (LEAKAGE_THRESHOLD, True)):
        ids = [0, 1, 2, *doc[20 : 20 + n].tolist(), 2, 1, 0]
        entry = check(env, [(Prompt(prompt_id=f"n{n}", category="c"), ids)], allow_leakage=True)  # ids alone
        assert entry["items"][0]["prompt_leaked"] is leaks, n
        assert entry["status"] == ("skipped" if leaks else "passed")
    with pytest.raises(LeakageError, match=r"n32 \(prompt\)"):
        check(env, [(Prompt(prompt_id="n32", category="c"), ids)])


def test_a_later_turn_and_a_reference_answer_are_checked(env):
    leaked = env["leaked"]
    conversation = Prompt(prompt_id="q", category="writing", turns=("Write a sort function.", leaked))
    answered = Prompt(prompt_id="r", category="code", text="x", reference=leaked)
    items = [(conversation, [5, 6, 7]), (answered, [5, 6, 7])]
    with pytest.raises(LeakageError, match=r"q turn 2 \(prompt\), r \(reference\)"):
        check(env, items)
    entry = check(env, items, allow_leakage=True)
    assert entry["prompts"] == 2 and entry["texts_checked"] == 3
    assert entry["leaked"] == ["q turn 2", "r"]
    assert entry["shorter_than_window"] == 2  # the two [5, 6, 7] prompts


def test_a_chat_template_s_fixed_wording_is_no_shared_text(monkeypatch):
    """The training documents and a chat prompt's ids both open with the template's wording (a
    system line, role markers): looked up as those ids, a prompt sharing one opening word with a
    training conversation shared a 32-token window and was refused. Its written text is looked up."""
    import harness.heads.artifacts as artifacts
    from harness.target.loading import cache_root
    from harness.workloads.datastore import ExclusionIndex

    template = "A chat between a curious user and an assistant. USER: "

    def ids(text: str) -> list[int]:
        return byte_ids(text, vocab_size=VOCAB, max_len=10**6)

    trained = "How do I bake sourdough bread with a starter I made last week? ASSISTANT: Feed it first."
    text = artifacts.TrainingText(
        index=ExclusionIndex([np.asarray(ids(template + trained))], LEAKAGE_THRESHOLD),
        origin="cache",
        split="train",
        documents=1,
        tokens=len(ids(template + trained)),
        seconds=0.0,
    )
    manifest = {"artifact_id": "templated", "kind": "hydra"}
    monkeypatch.setitem(artifacts._TRAINING_TEXTS, (str(cache_root()), "templated"), text)
    gate = TrainingLeakage(manifest, tokenizer=None, vocab_size=VOCAB)
    asked = "How can I improve my time management skills?"
    for prompt in (
        Prompt(prompt_id="m", category="c", messages=({"role": "user", "content": asked},)),
        Prompt(prompt_id="t", category="c", turns=(asked, "And at work?")),
    ):
        entry = gate.check([(prompt, ids(template + asked))])  # the ids the template made: 36 shared tokens
        assert entry["status"] == "passed" and entry["items"][0]["prompt_leaked"] is False
    copied = Prompt(prompt_id="c", category="c", messages=({"role": "user", "content": trained},))
    with pytest.raises(LeakageError, match=r"c \(prompt\)"):
        gate.check([(copied, ids(template + trained))])


def test_the_training_text_is_rebuilt_where_its_stream_is_not_cached(env, tmp_path, monkeypatch):
    """An artifact given by path whose streams are in another cache: its ShareGPT documents are
    tokenised again (no model runs) and must give the token digest it recorded."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "elsewhere"))
    text = training_text(env["manifest"], tokenizer=None, vocab_size=VOCAB)
    assert not isinstance(text, str) and text.origin == "rebuilt" and text.tokens == len(env["tokens"])
    ids = byte_ids(env["leaked"], vocab_size=VOCAB, max_len=10**6)
    with pytest.raises(LeakageError, match=r"p \(prompt\)"):
        check(env, [(Prompt(prompt_id="p", category="c", text=env["leaked"]), ids)])
    # a recorded digest no stream or rebuild gives: nothing to check against, said, never passed
    other = {**env["manifest"], "artifact_id": "another", "training_text": {"stream": None, "tokens_sha256": "0" * 64}}
    entry = TrainingLeakage(other, tokenizer=None, vocab_size=VOCAB).check([])
    assert entry["status"] == "not_applicable" and "not the text the hydra artifact recorded" in entry["why"]


def test_a_published_checkpoint_is_not_applicable():
    manifest = {"kind": "eagle", "published": True, "source": "owner/draft", "artifact_id": "pub"}
    entry = TrainingLeakage(manifest, tokenizer=None, vocab_size=VOCAB).check([])
    assert entry["status"] == "not_applicable" and "cannot see" in entry["why"]


def test_inline_documents_whose_stream_is_not_cached_are_not_applicable(env, tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "elsewhere"))
    inline = {**env["manifest"], "artifact_id": "inline", "streams": {"train": {"source": "inline"}}}
    entry = TrainingLeakage(inline, tokenizer=None, vocab_size=VOCAB).check([])
    assert entry["status"] == "not_applicable" and "source 'inline'" in entry["why"]


def test_a_text_held_mid_document_shares_its_window_whatever_precedes_it(monkeypatch):
    """A byte-level BPE tokenizer codes a text's first word alone otherwise than after a space: a
    32-token turn, prompt or reference held word for word in a training document shared no 32-token
    window encoded alone, and passed. Each text is looked up after a space and after a newline too."""
    import harness.heads.artifacts as artifacts
    from harness.target.loading import cache_root
    from harness.workloads.datastore import ExclusionIndex

    tok = boundary_tokenizer()

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    held = "Please sort them by key, then by value."
    assert len(ids(held)) == LEAKAGE_THRESHOLD
    document = ids("Then the user said: " + held + " and left.")
    text = artifacts.TrainingText(
        index=ExclusionIndex([np.asarray(document)], LEAKAGE_THRESHOLD),
        origin="cache",
        split="train",
        documents=1,
        tokens=len(document),
        seconds=0.0,
    )
    monkeypatch.setitem(artifacts._TRAINING_TEXTS, (str(cache_root()), "boundary"), text)
    gate = TrainingLeakage({"artifact_id": "boundary", "kind": "hydra"}, tokenizer=tok, vocab_size=len(tok))
    items = [
        (Prompt(prompt_id="q", category="c", turns=("Write a poem.", held)), ids("Write a poem.")),
        (Prompt(prompt_id="m", category="c", messages=({"role": "user", "content": held},)), ids(held)),
        (Prompt(prompt_id="r", category="c", text="x", reference=held), ids("x")),
    ]
    with pytest.raises(LeakageError, match=r"3 of 4 .*: q turn 2 \(prompt\), m \(prompt\), r \(reference\)"):
        gate.check(items)
    entry = gate.check(items, allow_leakage=True)
    assert entry["status"] == "skipped" and entry["leaked"] == ["q turn 2", "m", "r"]
    rows = {r["prompt_id"]: r for r in entry["items"]}
    assert rows["m"]["prompt_tokens"] == rows["m"]["longest_text_tokens"] == LEAKAGE_THRESHOLD
    # one token shorter: no 32-token window wherever it starts
    short = held.removesuffix(".")
    clean = [(Prompt(prompt_id="s", category="c", turns=("Hi.", short)), ids("Hi."))]
    assert gate.check(clean)["status"] == "passed"
