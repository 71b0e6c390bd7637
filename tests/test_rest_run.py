"""proposer=rest inside `harness run`: datastore opening/building, run-time leakage control,
negotiation before model work, and an end-to-end tiny-model run over a token-id datastore; and the
same datastore searched by prompt lookup (proposer.datastore)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from checkpoint_fixtures import boundary_tokenizer, tiny_checkpoint

from harness.config import compose
from harness.contracts import Budget
from harness.engine.build import BuildContext, build_proposer, plan
from harness.proposers.base import NullProposer
from harness.proposers.rest import RestProposer, cache_datastore_path, open_datastore, release_manifest_hash
from harness.random_source import TorchRandomSource
from harness.verifiers import get_verifier
from harness.verifiers.base import NegotiationError
from harness.verifiers.sampling import SamplingPolicy
from harness.workloads.corpora import make_corpus
from harness.workloads.datastore import (
    LEAKAGE_THRESHOLD,
    SENTINEL,
    DatastoreError,
    LeakageError,
    build_datastore,
    datastore_from_token_ids,
    load_datastore,
    write_datastore,
)
from harness.workloads.prompts import Prompt

PROMPTS = [
    {"id": "p1", "prompt": "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return add(a, add(b, c))\n"},
    {"id": "p2", "prompt": "the quick brown fox jumps over the lazy dog; the quick brown fox"},
]
NEW = 16


def compose_cfg(*overrides: str):
    return compose(overrides)


def tiny_ids(text: str, vocab: int = 96) -> list[int]:
    """The runner's synthetic ids for model=tiny (harness.workloads.prompts.encode_workload)."""
    return [3 + (b % (vocab - 3)) for b in text.encode()]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private cache, a two-prompt workload and each prompt's autoregressive continuation."""
    root = tmp_path_factory.mktemp("rest_run")
    old = os.environ.get("HARNESS_CACHE")
    os.environ["HARNESS_CACHE"] = str(root / "cache")
    workload = root / "wl.jsonl"
    workload.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    from harness.engine.decode import RoundConfig, decode
    from harness.runner import load_models
    from harness.target.backend import CausalLMBackend
    from harness.workloads.conversations import encode_workload

    cfg = compose_cfg("model=tiny", "workload=jsonl", f"workload.path={workload}", "workload.chat=false")
    target, _ = load_models(cfg)
    backend = CausalLMBackend(target.model)
    items = encode_workload(cfg, None)
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    ar = {}
    for prompt, ids in items:
        res = decode(
            target=backend,
            proposer=null,
            verifier=get_verifier("greedy"),
            policy=SamplingPolicy(),
            prompt_ids=ids,
            max_new_tokens=NEW + 8,
            eos_token_ids=frozenset(),
            rng=TorchRandomSource(0),
            round_cfg=RoundConfig(max_nodes=1, max_depth=1),
        )
        ar[prompt.prompt_id] = res.tokens
    yield {"root": root, "workload": workload, "items": items, "ar": ar}
    if old is None:
        os.environ.pop("HARNESS_CACHE", None)
    else:
        os.environ["HARNESS_CACHE"] = old


def write_store(env, name: str, *, leak: str | None = None) -> tuple[Path, object]:
    """A token-id datastore: each prompt's last 6 ids followed by its AR continuation (REST can
    retrieve the target's own next tokens), filler, and with ``leak`` that prompt's whole ids."""
    docs = [list(ids[-6:]) + env["ar"][p.prompt_id] for p, ids in env["items"]]
    docs += [[(7 * i + 11 * j) % 90 + 3 for j in range(40)] for i in range(8)]
    if leak is not None:
        docs += [next(ids for p, ids in env["items"] if p.prompt_id == leak)]
    ds = datastore_from_token_ids(docs)
    path = env["root"] / name
    if not path.exists():
        write_datastore(ds, path)
    return path, ds


def run_overrides(env, store: Path, *extra: str) -> list[str]:
    return [
        "model=tiny",
        "proposer=rest",
        "topology=sequences",
        f"proposer.datastore.path={store}",
        "workload=jsonl",
        f"workload.path={env['workload']}",
        "workload.chat=false",
        f"generation.max_new_tokens={NEW}",
        "generation.warmup_tokens=2",
        "gates.oracle=false",
        "threads=1",
        *extra,
    ]


# ------------------------------------------------------------------------------ end to end


def test_rest_run_end_to_end_on_tiny_with_a_token_id_datastore(env, tmp_path):
    from harness.runner import run_job

    store, ds = write_store(env, "ds_clean")
    record = run_job(compose_cfg(*run_overrides(env, store)), run_dir=tmp_path)
    m = record["metrics"]
    assert m["greedy_identical"] is True
    source = f"rest:{ds.release_id[:12]}"
    # the datastore holds each prompt's AR continuation: REST proposes it and the target accepts
    assert set(m["accepted_by_source"]) == {source} and m["accepted_by_source"][source] > 0
    assert m["mean_accepted_per_round"] > 1.0
    r = m["retrieval"]
    assert r["datastore_release_id"] == ds.release_id and r["datastore_bytes"] == ds.nbytes > 0
    # with a path, the datastore's manifest decides how it was built: build options set to say
    # otherwise are listed as inert, not claimed; those left at their defaults claim nothing (they
    # were listed, as if set)
    assert record["inert_options"] == []
    from harness.proposers.rest import path_inert_options

    why = f"the datastore at {store} was built with {{}} (its manifest decides; nothing is built)"
    set_ = ["proposer.datastore.corpus=sharegpt", "proposer.datastore.max_tokens=1000"]
    node = compose_cfg(*run_overrides(env, store), *set_).proposer.datastore
    assert path_inert_options(node, "proposer.datastore") == [
        "proposer.datastore.corpus=sharegpt: " + why.format("corpus=token-ids"),
        "proposer.datastore.max_tokens=1000: " + why.format("max_tokens=null"),
    ]
    # the measured rounds only: the warm-up's and the gates' rounds are no part of the figures
    assert r["rounds"] == m["rounds"] and r["miss_rate"] == pytest.approx(r["misses"] / r["rounds"])
    assert 0.0 <= r["miss_rate"] < 1.0 and r["mean_match_len"] > 0 and r["mean_retrieval_ms"] > 0
    assert m["round_cost_ms"]["retrieval"] > 0  # split out of the proposal stage
    assert r["manifest_hash"] == release_manifest_hash(record["manifest_hash"], ds.release_id)
    # the run manifest binds the datastore release, so the record's hash changes with it
    assert record["manifest"]["datastores"]["rest"]["release_id"] == ds.release_id
    from harness.manifest import job_manifest_hash

    assert job_manifest_hash(compose_cfg(*run_overrides(env, store))) == record["manifest_hash"]
    gate = record["gates"]["workload_governance"]
    assert gate["status"] == "passed" and gate["leaked"] == [] and gate["allow_leakage"] is False
    assert [i["prompt_id"] for i in gate["items"]] == ["p1", "p2"]
    assert 6 <= gate["max_longest_match"] < 32
    assert json.loads((tmp_path / "record.json").read_text())["run_id"] == record["run_id"]


@pytest.mark.parametrize("budget_policy", ["fixed", "adaptive"])
def test_prompt_lookup_with_a_datastore_runs_end_to_end_exact_with_its_leakage_gate(env, tmp_path, budget_policy):
    from harness.manifest import job_manifest_hash
    from harness.runner import run_job

    store, ds = write_store(env, "ds_clean")
    overrides = run_overrides(env, store)
    overrides[1:4] = [
        "proposer=prompt_lookup",
        "topology=sequences",
        "+datastore@proposer.datastore=stdlib",
        f"proposer.datastore.path={store}",
        f"proposer.budget_policy={budget_policy}",
    ]
    cfg = compose_cfg(*overrides)
    record = run_job(cfg, run_dir=tmp_path)
    m = record["metrics"]
    assert m["greedy_identical"] is True
    r = m["retrieval"]
    # the datastore holds each prompt's AR continuation: its rows are kept and the target accepts them
    assert r["rows_kept_from_datastore"] > 0 and m["mean_accepted_per_round"] > 1.0
    assert m["round_cost_ms"]["retrieval"] > 0
    searched = r["datastore"]
    assert searched["datastore_release_id"] == ds.release_id and searched["rounds"] == m["rounds"]
    assert m["proposal_state_bytes"] >= ds.nbytes
    gate = record["gates"]["workload_governance"]
    assert gate["status"] == "passed" and gate["kind"] == "datastore_leakage" and gate["leaked"] == []
    assert record["manifest"]["datastores"]["prompt_lookup"]["release_id"] == ds.release_id
    assert job_manifest_hash(cfg) == record["manifest_hash"]
    assert searched["manifest_hash"] == release_manifest_hash(record["manifest_hash"], ds.release_id)
    assert record["inert_options"] == []


def test_prompt_lookup_refuses_a_leaked_prompt_in_its_datastore(env, tmp_path):
    from harness.runner import run_job

    store, _ = write_store(env, "ds_leaked", leak="p1")
    overrides = run_overrides(env, store)
    overrides[1:4] = ["proposer=prompt_lookup", "topology=sequences", "+datastore@proposer.datastore=stdlib"]
    overrides.append(f"proposer.datastore.path={store}")
    with pytest.raises(LeakageError, match=r"p1 \(\d+ tokens\)"):
        run_job(compose_cfg(*overrides), run_dir=tmp_path)
    assert not (tmp_path / "record.json").exists()


def test_batch_slots_share_one_datastore_counted_once(env, tmp_path):
    """At B = 2 the second slot's REST proposer reuses the index the first opened (BuildContext.shared):
    one copy in memory, its bytes counted once in the record, output still exact per request."""
    from harness.runner import run_job

    store, ds = write_store(env, "ds_clean")
    record = run_job(compose_cfg(*run_overrides(env, store, "generation.batch_size=2")), run_dir=tmp_path)
    m = record["metrics"]
    assert m["greedy_identical"] is True
    assert m["proposal_state_bytes"] == ds.nbytes and m["retrieval"]["datastore_bytes"] == ds.nbytes


# ------------------------------------------------------------------------------ leakage


def test_a_leaked_prompt_refuses_the_run_with_no_record(env, tmp_path, capsys):
    from harness.app import run_main as main
    from harness.runner import run_job

    store, _ = write_store(env, "ds_leaked", leak="p1")
    with pytest.raises(LeakageError, match=r"p1 \(\d+ tokens\)"):
        run_job(compose_cfg(*run_overrides(env, store)), run_dir=tmp_path / "direct")
    assert not (tmp_path / "direct" / "record.json").exists()
    out = tmp_path / "via_main"
    rc = main(run_overrides(env, store, f"output_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"))
    assert rc == 2
    assert "refused: evaluation leakage" in capsys.readouterr().err
    assert not (out / "record.json").exists()


def test_allow_leakage_runs_and_the_record_states_it(env, tmp_path, capsys):
    from harness.runner import run_job

    store, _ = write_store(env, "ds_leaked", leak="p1")
    record = run_job(compose_cfg(*run_overrides(env, store, "allow_leakage=true")), run_dir=tmp_path)
    assert (  # said on stderr, as every gate an override switches off is (it was silent)
        "harness: gate workload_governance let 1 leaked prompt(s) through by allow_leakage=true (p1): the record "
        "will say gated: false"
    ) in capsys.readouterr().err
    gate = record["gates"]["workload_governance"]
    p1 = next(i for i in gate["items"] if i["prompt_id"] == "p1")
    assert gate["leaked"] == ["p1"] and gate["allow_leakage"] is True
    assert p1["leaked"] is True and p1["allowed"] is True and p1["prompt_longest_match"] == len(env["items"][0][1])
    assert record["metrics"]["retrieval"]["leakage"]["leaked"] == ["p1"]
    assert record["config"]["allow_leakage"] is True


def test_a_conversation_s_later_turn_in_the_datastore_is_refused():
    """The gate checked a conversation's first turn only: a datastore holding turn 2 word for word
    passed as gated. Every user turn is checked now, each its own row of the evidence."""
    turn2 = "Now rewrite the function so it sorts the values by frequency first, then by value, in place."
    ds = datastore_from_token_ids([[5, 6, 7] + tiny_ids(turn2) + [8, 9]])
    prop = RestProposer(budget=Budget(shape="tree", max_nodes=8, max_depth=4), manifest_hash="h", datastore=ds)
    conversation = Prompt(prompt_id="q", category="writing", turns=("Write a sort function.", turn2))
    items = [(conversation, [5, 6, 7])]
    with pytest.raises(LeakageError, match=r"q turn 2 \(\d+ tokens\)"):
        prop.check_workload(items)
    entry = prop.check_workload(items, allow_leakage=True)
    assert entry["prompts"] == 1 and entry["texts_checked"] == 2 and entry["leaked"] == ["q turn 2"]


def test_a_leaked_reference_answer_is_refused():
    reference = "return sorted(set(values), key=lambda v: (-counts[v], v))  # tie-break by value"
    ds = datastore_from_token_ids([[5, 6, 7] + tiny_ids(reference)[:40] + [8, 9]])
    prop = RestProposer(budget=Budget(shape="tree", max_nodes=8, max_depth=4), manifest_hash="h", datastore=ds)
    items = [(Prompt(prompt_id="q", category="code", text="x", reference=reference), [5, 6, 7])]
    with pytest.raises(LeakageError, match=r"q \(40 tokens\)"):
        prop.check_workload(items)
    entry = prop.check_workload(items, allow_leakage=True)
    assert entry["items"][0]["prompt_longest_match"] == 3 and entry["items"][0]["reference_longest_match"] == 40
    short = [(Prompt(prompt_id="q", category="code", text="x", reference=reference[:20]), [5, 6, 7])]
    assert prop.check_workload(short)["max_longest_match"] == 20


#: 32 tokens encoded alone (:func:`boundary_tokenizer`); its first word codes otherwise mid-text
HELD = "Please sort them by key, then by value."


def boundary_proposer(held: str):
    """A REST proposer over a datastore built with :func:`boundary_tokenizer` from one document that
    holds ``held`` word for word mid-line."""
    from harness.workloads.corpora import Document, InlineCorpus

    tok = boundary_tokenizer()
    corpus = InlineCorpus((Document("d", ("Then the user said: " + held + " and left.",)),))
    ds = build_datastore(corpus, tokenizer=tok, target_family="boundary", progress=False)
    prop = RestProposer(budget=Budget(shape="tree", max_nodes=8, max_depth=4), manifest_hash="h", datastore=ds)
    prop.tokenizer, prop.vocab_size = tok, len(tok)
    return prop, tok


def test_a_text_held_mid_document_is_matched_whatever_precedes_it():
    """A byte-level BPE tokenizer codes a text's first word alone otherwise than after a space: a
    32-token turn, prompt or reference held word for word in the datastore matched 31 tokens encoded
    alone, and passed. Each text is looked up after a space and after a newline too."""
    from harness.heads.artifacts import text_encodings

    prop, tok = boundary_proposer(HELD)
    alone = tok(HELD, add_special_tokens=False)["input_ids"]
    assert len(alone) == LEAKAGE_THRESHOLD
    # the lead's own token dropped: after a newline it is the lone encoding again (one kept)
    assert text_encodings(HELD, tokenizer=tok, vocab_size=len(tok)) == [
        alone,
        tok(" " + HELD, add_special_tokens=False)["input_ids"],
    ]
    assert text_encodings(HELD, tokenizer=None, vocab_size=96) == [tiny_ids(HELD)]
    turn = Prompt(prompt_id="q", category="writing", turns=("Write a poem.", HELD))
    plain = Prompt(prompt_id="p", category="writing", text=HELD)  # its ids: the text alone, as the model sees it
    answered = Prompt(prompt_id="r", category="code", text="x", reference=HELD)
    items = [(turn, tok("Write a poem.")["input_ids"]), (plain, alone), (answered, tok("x")["input_ids"])]
    with pytest.raises(LeakageError, match=r"q turn 2 \(32 tokens\), p \(32 tokens\), r \(32 tokens\)"):
        prop.check_workload(items)
    entry = prop.check_workload(items, allow_leakage=True)
    assert entry["status"] == "skipped" and entry["leaked"] == ["q turn 2", "p", "r"]
    rows = {r["prompt_id"]: r for r in entry["items"]}
    assert rows["p"]["prompt_longest_match"] == 32 and rows["r"]["reference_longest_match"] == 32
    # one token shorter held whole: 31 wherever it starts, below the threshold
    short = HELD.removesuffix(".")
    prop, tok = boundary_proposer(short)
    entry = prop.check_workload([(Prompt(prompt_id="q", category="c", turns=("Hi.", short)), [5])])
    assert entry["status"] == "passed" and entry["max_longest_match"] == LEAKAGE_THRESHOLD - 1


def test_leakage_threshold_is_never_raised_above_the_standard(env, tmp_path):
    """A leakage_threshold above 32 let a prompt held whole in the datastore pass the gate with the
    run gated. The option goes from 1 (strictest) to 32: a higher one is refused before model work,
    and a proposer given one refuses to check; allow_leakage=true is how a leaked workload runs."""
    from harness.contracts import ConfigError
    from harness.runner import run_job

    store, _ = write_store(env, "ds_leaked", leak="p1")
    for high in (33, 100000):
        with pytest.raises(ConfigError, match=rf"leakage_threshold={high} is out of range: it must be in \[1, 32\]"):
            plan(compose_cfg(*run_overrides(env, store, f"proposer.datastore.leakage_threshold={high}")))
    with pytest.raises(LeakageError, match=r"p1 \(\d+ tokens\)"):  # lower: stricter, and still refuses
        run_job(compose_cfg(*run_overrides(env, store, "proposer.datastore.leakage_threshold=8")), run_dir=tmp_path)
    ds = datastore_from_token_ids([[5, 6, 7] + tiny_ids(PROMPTS[0]["prompt"]) + [8, 9]])
    prop = RestProposer(budget=Budget(shape="tree", max_nodes=8, max_depth=4), manifest_hash="h", datastore=ds)
    prop.leakage_threshold = 100000
    items = [(Prompt(prompt_id="p1", category="c", text=PROMPTS[0]["prompt"]), tiny_ids(PROMPTS[0]["prompt"]))]
    with pytest.raises(ValueError, match=r"leakage_threshold=100000 is out of range: .* from 1 to 32"):
        prop.check_workload(items, allow_leakage=True)


def test_the_refusal_never_advises_a_threshold_above_the_standard():
    """A leaked match shorter than the datastore's exclusion window is advised to be let through by
    raising leakage_threshold to the window; a window wider than 32 (a build through the Python API)
    made that advice a threshold the option refuses. Past 32 tokens a rebuild is advised instead."""
    import string

    from harness.workloads.corpora import Document, InlineCorpus

    tok = boundary_tokenizer()
    held = string.ascii_letters + string.digits  # 62 distinct characters, one token each
    text = tok(held, add_special_tokens=False)["input_ids"]
    corpus = InlineCorpus((Document("d", (held,)),))
    ds = build_datastore(corpus, tokenizer=tok, target_family="boundary", exclusion_window=64, progress=False)
    assert ds.manifest["exclusion"]["window_tokens"] == 64
    prop = RestProposer(budget=Budget(shape="tree", max_nodes=8, max_depth=4), manifest_hash="h", datastore=ds)
    prop.tokenizer, prop.vocab_size, prop.leakage_threshold = tok, len(tok), 20
    items = [
        (Prompt(prompt_id="short", category="c", text="!"), [0] + text[:25] + [0]),
        (Prompt(prompt_id="long", category="c", text="?"), [0] + text[:40] + [0]),
    ]
    with pytest.raises(LeakageError) as e:
        prop.check_workload(items)
    said = str(e.value)
    assert "long (40 tokens): rebuild the datastore excluding them" in said
    assert "short (25 tokens): a build keeps out only matches of 32 tokens or more" in said
    assert "raise leakage_threshold to 32;" in said and "to 64" not in said


def test_check_workload_restarts_the_retrieval_counters():
    ds = datastore_from_token_ids([[1, 2, 3, 4]])
    prop = RestProposer(budget=Budget(shape="tree", max_nodes=8, max_depth=4), manifest_hash="h", datastore=ds)
    prop.propose([1, 2], TorchRandomSource(0))
    prop.propose([9, 9], TorchRandomSource(0))
    assert prop.stats.extras["rounds"] == 2 and prop.stats.extras["miss_rate"] == 0.5
    assert prop.stats.extras["mean_match_len"] == 1.0  # [1, 2] matched (n=2), then a miss (0)
    prop.check_workload([(Prompt(prompt_id="a", category="c", text="t"), [7, 7])])
    assert prop.stats.extras["rounds"] == 0 and prop.stats.retrieval_ms == 0.0
    assert prop.stats.extras["miss_rate"] is None


# ------------------------------------------------------------------------------ negotiation


def test_rest_with_rejection_is_refused_before_model_work(env, tmp_path, monkeypatch, capsys):
    import harness.runner as runner
    from harness.app import run_main

    def no_models(cfg, **_):
        raise AssertionError("models were loaded for a refused combination")

    monkeypatch.setattr(runner, "load_models", no_models)
    missing = tmp_path / "no_such_datastore"  # nothing is opened or built either
    args = run_overrides(env, missing, "verifier=rejection", "generation.temperature=0.7")
    with pytest.raises(NegotiationError, match=r"probability semantics \['frequency'\]"):
        plan(compose_cfg(*args))
    rc = run_main(args + [f"output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'hydra'}"])
    assert rc == 2 and "refused" in capsys.readouterr().err
    assert not missing.exists() and not (tmp_path / "out" / "record.json").exists()
    with pytest.raises(NegotiationError, match="temperature"):  # rejection at T=0 is refused too
        plan(compose_cfg(*run_overrides(env, missing, "verifier=rejection")))
    plan(compose_cfg(*run_overrides(env, missing, "verifier=membership", "generation.temperature=0.7")))


# ------------------------------------------------------------------------------ opening datastores


def word_tokenizer(words: list[str]):
    """A tiny real HF fast tokenizer: whitespace-split words, one id each ([UNK] = 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


WORDS = ["def", "return", "self", "import", "class", "if", "else", "for", "in", "None"]


def test_open_datastore_refuses_another_tokenizer_and_token_id_mismatches(tmp_path):
    from harness.workloads.corpora import Document, InlineCorpus

    tok = word_tokenizer(WORDS)
    corpus = InlineCorpus(docs=(Document("d", ("def f in None return self",)),))
    build_datastore(corpus, tokenizer=tok, target_family="toy", out_dir=tmp_path / "words", progress=False)
    cfg = {"path": str(tmp_path / "words"), "verify_corpus": False}
    ds, info = open_datastore(cfg, tokenizer=word_tokenizer(WORDS), model="toy", vocab_size=11)
    assert ds.n_tokens == 7 and info["built_now"] is False
    with pytest.raises(DatastoreError, match="built with tokenizer"):
        open_datastore(cfg, tokenizer=word_tokenizer(WORDS[::-1]), model="toy")
    with pytest.raises(DatastoreError, match="has no tokenizer"):  # model=tiny: synthetic ids
        open_datastore(cfg, tokenizer=None, model="tiny")
    with pytest.raises(DatastoreError, match="outside the target vocabulary"):
        open_datastore(cfg, tokenizer=tok, model="toy", vocab_size=5)
    write_datastore(datastore_from_token_ids([[1, 2, 3]]), tmp_path / "ids")
    with pytest.raises(DatastoreError, match="no tokenizer fingerprint"):
        open_datastore({"path": str(tmp_path / "ids")}, tokenizer=tok, model="toy")
    _, info = open_datastore({"path": str(tmp_path / "ids")}, tokenizer=None, model="tiny")
    assert info["corpus_check"] == "not applicable: token ids given directly, no corpus"
    _, info = open_datastore({"path": str(tmp_path / "words")}, tokenizer=tok, model="toy")
    assert info["corpus_check"].startswith("not applicable: corpus 'inline' cannot be re-read")
    with pytest.raises(DatastoreError, match="is not a datastore"):
        open_datastore({"path": str(tmp_path / "absent")}, tokenizer=tok, model="toy")
    # a model without a tokenizer is not told to build from a corpus (its build would be refused)
    with pytest.raises(DatastoreError) as info:
        open_datastore({"path": str(tmp_path / "absent")}, tokenizer=None, model="tiny")
    assert "has no tokenizer to build one from a corpus" in str(info.value)
    assert "datastore build" not in str(info.value)
    # a file, or a folder of other files, was offered a build into it, which the build refuses
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(DatastoreError, match=r"path='.*a.json' is a file; a datastore is a folder"):
        open_datastore({"path": str(tmp_path / "a.json")}, tokenizer=tok, model="toy")
    with pytest.raises(DatastoreError, match=r"holds other files: give a datastore folder, build one into a new "):
        open_datastore({"path": str(tmp_path)}, tokenizer=tok, model="toy")


def test_a_cached_datastore_of_another_tokenizer_is_refused_with_the_command_that_rebuilds_it(tmp_path, monkeypatch):
    """The cache folder is named by the model, not its tokenizer: a model whose tokenizer changed
    finds the datastore built with the old one, and is given the line that rebuilds it as the other
    refusals of a cached datastore are; a hand-edited manifest too."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.py").write_text("def return self import\nclass if else\n")
    cfg = {"corpus": "files", "corpus_path": str(mine), "glob": "**/*.py", "path": None, "exclude": "none"}
    ds, info = open_datastore(cfg, tokenizer=word_tokenizer(WORDS), model="toy")
    assert info["built_now"]
    rebuild = (
        f"`harness datastore build corpus=files corpus_path={mine.resolve()} glob=**/*.py model=toy exclude=none "
        "overwrite=true`"
    )
    with pytest.raises(DatastoreError) as err:
        open_datastore(cfg, tokenizer=word_tokenizer(WORDS[::-1]), model="toy")
    said = str(err.value)
    assert "retrieved token spans would be wrong" in said
    assert said.endswith(f"Rebuild the datastore for this model's tokenizer with {rebuild}."), said
    # given by its path, the datastore is the user's: no rebuild over it is offered
    with pytest.raises(DatastoreError) as err:
        open_datastore({"path": str(ds.path)}, tokenizer=word_tokenizer(WORDS[::-1]), model="toy")
    assert "overwrite=true" not in str(err.value)
    # a field of the wrong type in a hand-edited manifest (its release id recomputed)
    from harness.workloads.datastore import _release_id

    m = json.loads((ds.path / "manifest.json").read_text())
    m["context_len"] = 2.5
    m["release_id"] = _release_id(m)
    (ds.path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatastoreError) as err:
        open_datastore(cfg, tokenizer=word_tokenizer(WORDS), model="toy")
    assert str(err.value).endswith(
        f"field context_len must be an integer >= 1; got 2.5: the manifest was changed after the build; "
        f"rebuild it with {rebuild}"
    ), str(err.value)


def test_a_folder_of_another_kind_is_not_opened_as_a_datastore(tmp_path):
    """A trained-heads folder given as proposer.datastore.path was read as a datastore "built by None"
    and told to rebuild it (a build over it would replace the artifact's manifest)."""
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "manifest.json").write_text(json.dumps({"kind": "medusa", "heads": 4}))
    (heads / "heads.safetensors").write_bytes(b"weights")
    for tokenizer, model in ((word_tokenizer(WORDS), "toy"), (None, "tiny")):
        with pytest.raises(DatastoreError) as err:
            open_datastore({"path": str(heads)}, tokenizer=tokenizer, model=model)
        said = str(err.value)
        assert said.startswith(
            f"proposer.datastore.path={str(heads)!r} is not a datastore: its manifest.json is no datastore's "
            "(a 'medusa' artifact's): give a datastore folder"
        ), said
        assert "rebuild" not in said and "overwrite=true" not in said


def test_a_cached_datastore_that_reads_its_earliest_matches_is_built_again(tmp_path, monkeypatch, capsys):
    """A datastore cached when a suffix's earliest matches were read keeps reading them (its release
    id stands for them): given by its path it opens as released; as a run's cache, the harness's own
    folder, it is built again under the rule of this code, said on stderr."""
    import shutil

    from harness.workloads.datastore import LOWEST_OFFSETS_MATCH_RULE, _release_id

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    tok = word_tokenizer(WORDS)
    cfg = {"corpus": "stdlib", "path": None, "max_tokens": 500, "exclude": "none", "verify_corpus": False}
    ds, _ = open_datastore(cfg, tokenizer=tok, model="toy")
    assert ds.match_selection == "spread"
    manifest = json.loads((ds.path / "manifest.json").read_text())
    manifest["match_selection"]["rule"] = LOWEST_OFFSETS_MATCH_RULE
    manifest["release_id"] = _release_id(manifest)
    (ds.path / "manifest.json").write_text(json.dumps(manifest))
    kept = tmp_path / "kept"
    shutil.copytree(ds.path, kept)
    with pytest.raises(DatastoreError, match=r"reads its lowest_offsets matches, a rule this harness no longer"):
        open_datastore(cfg, tokenizer=tok, model="toy", build=False)
    capsys.readouterr()
    again, info = open_datastore(cfg, tokenizer=tok, model="toy")
    assert again.match_selection == "spread" and again.release_id != manifest["release_id"] and info["built_now"]
    assert "reads its lowest_offsets matches, a rule this harness no longer builds: it is built again" in (
        capsys.readouterr().err
    )
    old, _ = open_datastore({"path": str(kept), "verify_corpus": False}, tokenizer=tok, model="toy")
    assert old.match_selection == "lowest_offsets" and old.release_id == manifest["release_id"]


def test_tiny_without_a_datastore_path_gets_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    with pytest.raises(DatastoreError, match="token-id datastore"):
        open_datastore({"corpus": "stdlib", "path": None}, tokenizer=None, model="tiny")


#: a small stdlib datastore built into the cache on first use (a word tokenizer, no exclusion)
SMALL_STDLIB_DATASTORE = {
    "corpus": "stdlib",
    "path": None,
    "max_tokens": 3000,
    "context_len": 8,
    "continuation_len": 4,
    "max_matches": 16,
    "exclude": "none",
    "verify_corpus": False,
}


def test_a_job_that_fails_before_its_proposer_opens_its_datastore_leaves_no_build_to_the_next(tmp_path, monkeypatch):
    """A job built its datastore when its manifest was frozen, then failed before its proposer opened
    it (a model that would not load): the next job of the process (a sweep's) using that datastore
    recorded datastore_built_now with the first job's build time."""
    from harness import runner

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    tok = word_tokenizer(WORDS)
    cfg = dict(SMALL_STDLIB_DATASTORE)
    assert open_datastore(cfg, tokenizer=tok, model="toy")[1]["built_now"] is True  # as a manifest's freeze

    def fail(*_a, **_k):
        raise ValueError("the model would not load")

    monkeypatch.setattr(runner, "load", fail)
    with pytest.raises(ValueError, match="would not load"):
        runner.run_job(compose(["model=tiny", "workload.limit=1"]), run_dir=tmp_path / "run")
    assert open_datastore(cfg, tokenizer=tok, model="toy")[1]["built_now"] is False


def test_cache_datastore_is_built_on_first_use_then_checked_against_the_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    tok = word_tokenizer(WORDS)
    cfg = dict(SMALL_STDLIB_DATASTORE)
    ds, info = open_datastore(cfg, tokenizer=tok, model="toy")
    # build options other than the defaults name the folder: each setting has its own
    where = cache_datastore_path(cfg, make_corpus("stdlib"), "toy")
    assert (
        where.parent == tmp_path / "datastores"
        and where.name.startswith("stdlib-build-")
        and where.name.endswith("-toy")
    )
    # the packaged datastore configs (their defaults) keep the corpus's own name, as before
    for group, corpus in (("stdlib", "stdlib"), ("sharegpt", "sharegpt")):
        node = compose_cfg("proposer=rest", f"datastore@proposer.datastore={group}").proposer.datastore
        assert cache_datastore_path(node, make_corpus(corpus), "toy") == tmp_path / "datastores" / f"{corpus}-toy"
    assert info["built_now"] is True and ds.path == where and (where / "manifest.json").is_file()
    assert ds.n_tokens == 3000 and ds.manifest["corpus"]["max_tokens"] == 3000
    assert "building REST datastore 'stdlib'" in capsys.readouterr().err
    assert not list(tmp_path.glob("datastores/*.building-*"))
    # the job's next open (its proposer's, after the manifest's) reports the build; later ones do not
    again, info = open_datastore(cfg, tokenizer=tok, model="toy")
    assert info["built_now"] is True and info["build_s"] > 0 and again.release_id == ds.release_id
    again, info = open_datastore(cfg, tokenizer=tok, model="toy")
    assert info["built_now"] is False and again.release_id == ds.release_id
    # a sweep over a build option: the other value builds its own folder, and neither refuses the other
    other, info = open_datastore({**cfg, "max_tokens": 5000}, tokenizer=tok, model="toy")
    assert info["built_now"] is True and other.n_tokens == 5000 and other.path != where
    assert open_datastore(cfg, tokenizer=tok, model="toy")[0].release_id == ds.release_id
    # a folder whose manifest says otherwise (placed there by hand, or built before folders were named
    # by their options) is refused, with the rebuild line and the way to use it as built
    shutil.rmtree(other.path)
    shutil.copytree(where, other.path)
    with pytest.raises(DatastoreError, match=r"max_tokens: config 5000 vs built 3000") as err:
        open_datastore({**cfg, "max_tokens": 5000}, tokenizer=tok, model="toy")
    # the rebuild line carries every build option as configured: following it ends the refusal
    assert (
        "`harness datastore build corpus=stdlib model=toy max_tokens=5000 context_len=8 continuation_len=4 "
        "max_matches=16 exclude=none overwrite=true`" in str(err.value)
    )
    assert f"use it as built (proposer.datastore.path={other.path}: its manifest decides)" in str(err.value)
    # the exclusion is a build option too: another one builds its own folder; an exclusion file
    # edited since the build refuses it (the index may hold the texts the file now names)
    assert ds.manifest["exclusion"]["spec"] == "none"
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"id": "q", "prompt": "def keep_me_out(): pass"}) + "\n")
    kept, info = open_datastore({**cfg, "exclude": str(held)}, tokenizer=tok, model="toy")
    assert info["built_now"] is True and kept.path not in (where, other.path)
    held.write_text(json.dumps({"id": "q", "prompt": "def keep_me_out_too(): pass"}) + "\n")
    with pytest.raises(
        DatastoreError,
        match=r"exclude: config '.*held.jsonl' vs built '.*held.jsonl as it read then \(the exclusion file changed",
    ):
        open_datastore({**cfg, "exclude": str(held)}, tokenizer=tok, model="toy")
    with pytest.raises(DatastoreError, match=r"^proposer.datastore.path is empty: give a datastore folder, or null"):
        open_datastore({**cfg, "path": ""}, tokenizer=tok, model="toy")
    with pytest.raises(DatastoreError, match=r"^proposer.datastore.exclude must be humaneval, .* got 'foo.txt'"):
        open_datastore({**cfg, "exclude": "foo.txt"}, tokenizer=tok, model="toy")
    # a model with synthetic token ids (model=tiny) given a datastore built with a tokenizer: told how to write its own
    with pytest.raises(DatastoreError) as err:
        open_datastore({**cfg, "path": str(where)}, tokenizer=None, model="tiny")
    assert str(err.value).endswith(
        "model='tiny' has no tokenizer (synthetic token ids), so its spans would be wrong: write a token-id "
        "datastore (harness.workloads.datastore.datastore_from_token_ids + write_datastore) and pass "
        "proposer.datastore.path=<dir>."
    )
    capsys.readouterr()
    with pytest.raises(DatastoreError, match=r"^proposer.datastore.exclude=.*missing.jsonl: cannot read"):
        open_datastore({**cfg, "exclude": str(tmp_path / "missing.jsonl")}, tokenizer=tok, model="toy")
    assert "building REST datastore" not in capsys.readouterr().err  # refused before a build is announced


def test_from_config_folds_the_release_id_into_the_proposals_manifest_hash(env):
    store, ds = write_store(env, "ds_clean")
    cfg = compose_cfg(*run_overrides(env, store))
    plan_ = plan(cfg)
    context = BuildContext(cfg=cfg, target_backend=None, tokenizer=None)
    prop = build_proposer(cfg, plan_, manifest_hash="run0", context=context)
    assert isinstance(prop, RestProposer) and prop.datastore.release_id == ds.release_id
    result = prop.propose(list(env["items"][0][1]), TorchRandomSource(0))
    assert result.manifest_hash == release_manifest_hash("run0", ds.release_id) != "run0"
    assert not result.empty and result.nodes[0].source == f"rest:{ds.release_id[:12]}"
    assert prop.manifest_extra()["datastore"]["release_id"] == ds.release_id
    assert plan_.capabilities.probability_semantics == frozenset({"frequency"})


def test_manifest_datastores_puts_the_release_id_into_the_manifest_hash(env, tmp_path):
    import shutil

    from harness.manifest import freeze_manifest, manifest_hash
    from harness.proposers.rest import manifest_datastores

    store, versions = tmp_path / "ds", {"torch": "x"}
    cfg = compose_cfg(*run_overrides(env, store))
    with_release, without = [], []
    for docs in ([[5, 6, 7, 8]], [[5, 6, 7, 9]]):  # the same directory rebuilt with other content
        shutil.rmtree(store, ignore_errors=True)
        ds = datastore_from_token_ids(docs)
        write_datastore(ds, store)
        extra = manifest_datastores(cfg)
        assert extra == {
            "datastores": {
                "rest": {"release_id": ds.release_id, "corpus": "token-ids", "n_tokens": 5, "path": str(store)}
            }
        }
        with_release.append(manifest_hash(freeze_manifest(cfg, versions=versions, extra=extra)))
        without.append(manifest_hash(freeze_manifest(cfg, versions=versions)))
    assert without[0] == without[1] and with_release[0] != with_release[1]
    merged = compose_cfg("model=tiny", "proposer=merged", "topology=merged", f"proposer.rest.datastore.path={store}")
    assert manifest_datastores(merged)["datastores"]["rest"]["release_id"] == ds.release_id
    assert manifest_datastores(compose_cfg("model=tiny", "proposer=prompt_lookup")) == {}
    # options the release cannot serve are refused here, before any model work (it was after loading)
    with pytest.raises(DatastoreError, match=r"^proposer.max_suffix=32 exceeds the datastore release's context_len=16"):
        manifest_datastores(compose_cfg(*run_overrides(env, store), "proposer.max_suffix=32"))
    over = compose_cfg(
        "model=tiny",
        "proposer=merged",
        "topology=merged",
        f"proposer.rest.datastore.path={store}",
        "proposer.rest.continuation_len=100",
    )
    with pytest.raises(DatastoreError, match=r"^proposer.rest.continuation_len=100 exceeds .* continuation_len=8"):
        manifest_datastores(over)


def test_a_datastore_of_the_user_s_files_is_built_into_its_own_cache_folder_and_checked(tmp_path, monkeypatch, capsys):
    """``corpus=files`` builds from the user's folder on first use, into a cache folder named by the
    corpus options (another folder or glob never reuses it); an edited file refuses it, and
    ``corpus_path`` without ``corpus=files`` is refused naming the option."""
    from harness.workloads.corpora import FilesCorpus, corpus_cache_name

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.py").write_text("def return self import\nclass if else\n")
    (mine / "notes.md").write_text("for in None\n")
    cfg = {"corpus": "files", "corpus_path": str(mine), "glob": "**/*.py", "roles": ["assistant"], "path": None}
    cfg |= {"max_tokens": 1000, "context_len": 8, "continuation_len": 4, "max_matches": 16, "exclude": "none"}
    tok = word_tokenizer(WORDS)
    ds, info = open_datastore(cfg, tokenizer=tok, model="toy")
    name = corpus_cache_name(FilesCorpus(path=str(mine), glob="**/*.py"))
    assert info["built_now"] and ds.path == cache_datastore_path(
        cfg, FilesCorpus(path=str(mine), glob="**/*.py"), "toy"
    )
    assert ds.path.parent == tmp_path / "cache" / "datastores" and ds.path.name.startswith(f"{name}-build-")
    assert ds.manifest["corpus"]["source"]["path"] == str(mine.resolve()) and ds.n_tokens == 7 + 1  # and a sentinel
    err = capsys.readouterr().err
    assert "building REST datastore 'files'" in err
    # an exclusion other than the corpus's own default is said (corpus=sharegpt kept stdlib's humaneval)
    assert (
        "harness run: note: proposer.datastore.exclude=none keeps out other texts than corpus=files's own default "
        "(exclude=humaneval, as `harness datastore build corpus=files` builds it)"
    ) in err
    again, info = open_datastore(cfg, tokenizer=tok, model="toy")  # the proposer's open: it reports the build
    again, info = open_datastore(cfg, tokenizer=tok, model="toy")
    assert not info["built_now"] and again.release_id == ds.release_id and info["corpus_check"] == "verified"
    _, info = open_datastore({**cfg, "verify_corpus": False}, tokenizer=tok, model="toy")
    assert info["corpus_check"] == "not verified: verify_corpus=false"
    every, info = open_datastore({**cfg, "glob": "**/*"}, tokenizer=tok, model="toy")
    assert info["built_now"] and every.path != ds.path and every.n_tokens > ds.n_tokens  # its own folder
    (mine / "a.py").write_text("def return\n")
    with pytest.raises(DatastoreError, match=r"corpus 'files' changed since the") as err:
        open_datastore(cfg, tokenizer=tok, model="toy")
    assert str(err.value).endswith(  # the line to follow, as the other cached-datastore refusals give it
        f"rebuild it with `harness datastore build corpus=files corpus_path={mine.resolve()} glob=**/*.py model=toy "
        "max_tokens=1000 context_len=8 continuation_len=4 max_matches=16 exclude=none overwrite=true`"
    )
    with pytest.raises(
        DatastoreError, match=r"^proposer.datastore.corpus_path is read with corpus=files; corpus=stdlib"
    ):
        open_datastore({**cfg, "corpus": "stdlib"}, tokenizer=tok, model="toy")
    with pytest.raises(DatastoreError, match=r"^proposer.datastore.corpus=files needs proposer.datastore.corpus_path"):
        open_datastore({**cfg, "corpus_path": None}, tokenizer=tok, model="toy")
    with pytest.raises(DatastoreError, match=r"^proposer.datastore.corpus_path=.*nowhere: no such file or folder"):
        open_datastore({**cfg, "corpus_path": str(tmp_path / "nowhere")}, tokenizer=tok, model="toy")
    with pytest.raises(
        DatastoreError, match=r"^proposer.datastore.corpus_path=.*no text file matches glob=\*\*/\*\.rs"
    ):
        open_datastore({**cfg, "glob": "**/*.rs"}, tokenizer=tok, model="toy")


def test_corpus_options_a_datastore_does_not_read_are_listed_as_inert(tmp_path):
    from harness.runner import inert_options

    base = ["model=tiny", "proposer=rest"]
    assert inert_options(compose(base)) == []
    assert inert_options(compose([*base, "proposer.datastore.glob=**/*.py", "proposer.datastore.roles=[user]"])) == [
        "proposer.datastore.glob=**/*.py: corpus=stdlib does not read it",
        "proposer.datastore.roles=[user]: corpus=stdlib does not read it",
    ]
    assert (
        inert_options(compose([*base, "proposer.datastore.corpus=sharegpt", "proposer.datastore.roles=[user]"])) == []
    )
    # corpus=files: glob with a single file, roles where no .jsonl file is read
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def f(): pass\n")
    files = [*base, "proposer.datastore.corpus=files", "proposer.datastore.roles=[user]"]
    assert inert_options(compose([*files, f"proposer.datastore.corpus_path={tmp_path / 'src'}"])) == [
        "proposer.datastore.roles=[user]: no .jsonl file is read, so there are no conversation turns"
    ]
    one = [*files, f"proposer.datastore.corpus_path={tmp_path / 'src' / 'a.py'}", "proposer.datastore.glob=*.py"]
    assert inert_options(compose(one)) == [
        "proposer.datastore.glob=*.py: corpus_path is one file, not a folder",
        "proposer.datastore.roles=[user]: no .jsonl file is read, so there are no conversation turns",
    ]
    (tmp_path / "src" / "talk.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    assert inert_options(compose([*files, f"proposer.datastore.corpus_path={tmp_path / 'src'}"])) == []


def test_a_merged_tree_s_datastore_refusals_name_its_own_options(tmp_path, monkeypatch):
    from harness.proposers.rest import manifest_datastores

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    base = ["model=tiny", "proposer=merged", "topology=merged"]
    with pytest.raises(
        DatastoreError, match=r"^proposer.rest.datastore.corpus=files needs proposer.rest.datastore.corpus_path"
    ):
        manifest_datastores(compose_cfg(*base, "proposer.rest.datastore.corpus=files"))
    with pytest.raises(
        DatastoreError,
        match=r"^proposer.rest.datastore.corpus_path is read with corpus=files; .*"
        r"\(set proposer.rest.datastore.corpus=files\)",
    ):
        manifest_datastores(compose_cfg(*base, f"proposer.rest.datastore.corpus_path={tmp_path}"))


def test_a_files_corpus_with_nothing_to_index_and_a_moved_one_are_refused(tmp_path, monkeypatch):
    """A corpus whose turns are all of other roles built an empty index (every round proposed
    nothing, the record said ~1x); a datastore whose corpus folder moved was refused naming
    corpus_path, an option the user may never have set."""
    from harness.workloads.corpora import FilesCorpus
    from harness.workloads.datastore import load_datastore

    tok = word_tokenizer(WORDS)
    mine = tmp_path / "mine"
    mine.mkdir()
    talk = {"messages": [{"role": "user", "content": "def return"}, {"role": "model", "content": "self import"}]}
    (mine / "talk.jsonl").write_text(json.dumps(talk) + "\n")
    with pytest.raises(
        DatastoreError,
        match=r"gave no text to index: 0 document\(s\) read, 0 excluded \(check corpus_path, glob and roles",
    ):
        build_datastore(FilesCorpus(path=str(mine)), tokenizer=tok, target_family="toy", progress=False)
    (mine / "a.py").write_text("def return self\n")
    build_datastore(
        FilesCorpus(path=str(mine)), tokenizer=tok, target_family="toy", out_dir=tmp_path / "ds", progress=False
    )
    mine.rename(tmp_path / "moved")
    with pytest.raises(
        DatastoreError,
        match=r"^datastore '.*ds': the corpus it was built from cannot be read to verify it "
        r"\(corpus_path=.*mine: no such file or folder\); rebuild it, or open it unverified",
    ):
        load_datastore(tmp_path / "ds", tokenizer=tok)
    assert load_datastore(tmp_path / "ds", tokenizer=tok, verify_corpus=False).n_tokens > 0


def test_a_working_folder_named_like_the_cached_datastore_is_left_alone(tmp_path, monkeypatch):
    """``proposer.datastore.path=null`` and a folder ``stdlib`` in the working directory: the run
    took that folder for the cache's, found no manifest, deleted it and built there."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    for name in ("stdlib", "stdlib-toy"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.py").write_text("mine\n")
    cfg = {"corpus": "stdlib", "path": None, "max_tokens": 500, "exclude": "none", "verify_corpus": False}
    ds, info = open_datastore(cfg, tokenizer=word_tokenizer(WORDS), model="toy")
    assert info["built_now"] and ds.path.parent == tmp_path / "cache" / "datastores"
    for name in ("stdlib", "stdlib-toy"):
        assert [p.name for p in (tmp_path / name).iterdir()] == ["notes.py"]


# ------------------------------------------------------------------------------ refusals before model work


def refused_run(tmp_path, capsys, monkeypatch, *overrides: str) -> str:
    """`harness run` over ``overrides`` (model=tiny, a one-prompt workload) is refused: exit 2, one
    line, no model loaded and no run folder written. Returns the line."""
    import harness.runner as runner
    from harness.app import run_main

    def no_models(cfg, **_):
        raise AssertionError("models were loaded for a refused run")

    monkeypatch.setattr(runner, "load_models", no_models)
    workload = tmp_path / "wl.jsonl"
    workload.write_text(json.dumps({"id": "p1", "prompt": "hello world hello world"}) + "\n")
    argv = [
        "model=tiny",
        "workload=jsonl",
        f"workload.path={workload}",
        "workload.chat=false",
        "generation.max_new_tokens=4",
        "gates.oracle=false",
        "threads=1",
        f"output_dir={tmp_path / 'run'}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        *overrides,
    ]
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("harness: gate(s)")]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("harness run: refused: "), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "hydra").exists()
    return lines[0]


def test_a_merged_tree_s_prompt_lookup_datastore_is_bound_into_the_manifest(tmp_path):
    """``proposer=merged`` bound only ``proposer.rest``'s datastore: its prompt-lookup source's
    release was in neither the manifest hash nor ``manifest.datastores``, and was opened only after
    the models loaded (another datastore at the same path gave the same job hash)."""
    from harness.manifest import job_manifest, manifest_hash
    from harness.proposers.rest import manifest_datastores

    store, rest_store = tmp_path / "pl", tmp_path / "rest"
    write_datastore(datastore_from_token_ids([[3, 4, 5, 6]]), rest_store)
    base = [
        "model=tiny",
        "proposer=merged",
        "topology=merged",
        "+datastore@proposer.prompt_lookup.datastore=stdlib",
        f"proposer.prompt_lookup.datastore.path={store}",
        f"proposer.rest.datastore.path={rest_store}",
    ]
    hashes = []
    for docs in ([[5, 6, 7, 8]], [[9, 10, 11, 12, 13]]):  # the same folder holding another release
        shutil.rmtree(store, ignore_errors=True)
        ds = datastore_from_token_ids(docs)
        write_datastore(ds, store)
        manifest = job_manifest(compose_cfg(*base, "proposer.sources=[prompt_lookup]"), versions={"torch": "x"})
        bound = {"release_id": ds.release_id, "corpus": "token-ids", "n_tokens": len(docs[0]) + 1, "path": str(store)}
        assert manifest["datastores"] == {"prompt_lookup": bound}
        hashes.append(manifest_hash(manifest))
        both = manifest_datastores(compose_cfg(*base, "proposer.sources=[rest,prompt_lookup]"))["datastores"]
        assert both["prompt_lookup"] == bound and set(both) == {"rest", "prompt_lookup"}
    assert hashes[0] != hashes[1]
    # a source left out binds nothing, and a prompt-lookup source without a datastore has none to bind
    assert set(manifest_datastores(compose_cfg(*base, "proposer.sources=[rest]"))["datastores"]) == {"rest"}
    plain = ["model=tiny", "proposer=merged", "topology=merged", "proposer.sources=[prompt_lookup]"]
    assert manifest_datastores(compose_cfg(*plain)) == {}
    # a build option set beside the path is listed as inert, as for the REST source's datastore
    from harness.runner import inert_options

    inert = inert_options(compose_cfg(*base, "proposer.prompt_lookup.datastore.max_tokens=1000"))
    assert any(i.startswith("proposer.prompt_lookup.datastore.max_tokens=1000: the datastore at") for i in inert)
    # opened before any model work: a missing one is refused there, naming its option
    shutil.rmtree(store)
    with pytest.raises(DatastoreError, match=r"^proposer.prompt_lookup.datastore.path=.* is not a datastore"):
        manifest_datastores(compose_cfg(*base, "proposer.sources=[prompt_lookup]"))


def test_a_merged_prompt_lookup_datastore_refusal_comes_before_model_work(tmp_path, monkeypatch, capsys):
    line = refused_run(
        tmp_path,
        capsys,
        monkeypatch,
        "proposer=merged",
        "topology=merged",
        "proposer.sources=[prompt_lookup]",
        "+datastore@proposer.prompt_lookup.datastore=stdlib",
        f"proposer.prompt_lookup.datastore.path={tmp_path / 'absent'}",
    )
    assert "proposer.prompt_lookup.datastore.path=" in line and "is not a datastore" in line


@pytest.mark.parametrize(("text", "said"), [("{bad", "is not valid JSON"), ("[]", "holds a JSON list")])
def test_a_damaged_datastore_manifest_is_refused_naming_the_file(tmp_path, monkeypatch, capsys, text, said):
    """A manifest.json that is not JSON was refused with the JSON parser's words alone, and a JSON
    list ended in an AttributeError (exit 1)."""
    from harness.proposers.rest import path_inert_options

    store = tmp_path / "ds"
    store.mkdir()
    (store / "manifest.json").write_text(text)
    where = f"{str(store / 'manifest.json')!r}"
    with pytest.raises(DatastoreError, match=re.escape(f"{where} ") + re.escape(said)):
        open_datastore({"path": str(store)}, tokenizer=None, model="tiny")
    cfg = compose_cfg("model=tiny", "proposer=rest", f"proposer.datastore.path={store}")
    with pytest.raises(DatastoreError, match=re.escape(f"{where} ") + re.escape(said)):
        path_inert_options(cfg.proposer.datastore, "proposer.datastore")
    line = refused_run(tmp_path, capsys, monkeypatch, "proposer=rest", f"proposer.datastore.path={store}")
    assert f"{where} {said}" in line


def test_prompt_lookup_refuses_a_datastore_too_short_for_its_suffixes_before_model_work(tmp_path, monkeypatch, capsys):
    """Prompt lookup searches a datastore with suffixes of 2 tokens or more; one released with
    context_len=1 was refused after the models loaded as "need 1 <= min_suffix <= max_suffix; got
    2, 1", options the user never set. It is refused first, naming the datastore's context_len."""
    import harness.proposers.rest as rest_module
    from harness.proposers.rest import manifest_datastores

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    store = tmp_path / "ctx1"
    write_datastore(datastore_from_token_ids([[5, 6, 7, 8, 9]], context_len=1), store)
    lookup = ["model=tiny", "proposer=prompt_lookup", "topology=sequences", "+datastore@proposer.datastore=stdlib"]
    with pytest.raises(
        DatastoreError,
        match=re.escape(f"proposer.datastore {str(store)!r} was released with context_len=1: it serves suffixes of ")
        + r"at most 1 token\(s\), and prompt lookup searches a datastore with suffixes of 2 tokens or more; "
        r"write one with datastore_from_token_ids\(\.\.\., context_len=2\)",
    ):
        manifest_datastores(compose_cfg(*lookup, f"proposer.datastore.path={store}"))
    merged = ["model=tiny", "proposer=merged", "topology=merged", "proposer.sources=[prompt_lookup]"]
    merged += ["+datastore@proposer.prompt_lookup.datastore=stdlib", f"proposer.prompt_lookup.datastore.path={store}"]
    with pytest.raises(DatastoreError, match=r"^proposer.prompt_lookup.datastore '.*' was released with context_len=1"):
        manifest_datastores(compose_cfg(*merged))
    line = refused_run(tmp_path, capsys, monkeypatch, *lookup[1:], f"proposer.datastore.path={store}")
    assert "was released with context_len=1" in line and "min_suffix" not in line
    # a target with a tokenizer: a cached datastore configured so is refused before it is built, and
    # one at a path is told how to rebuild it
    monkeypatch.setattr(rest_module, "load_tokenizer_of", lambda model, revision=None: word_tokenizer(WORDS))
    with pytest.raises(
        DatastoreError,
        match=r"^proposer.datastore is configured with context_len=1: .*; set proposer.datastore.context_len=2 or "
        r"more \(built into the cache on first use\)$",
    ):
        manifest_datastores(compose_cfg(*lookup, "proposer.datastore.context_len=1"))
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------ the target's tokenizer

#: a tokenizer class of a checkpoint's own: whitespace-split letters a..z, one id each ([UNK] = 0)
LETTER_TOKENIZER = """
from transformers import PreTrainedTokenizer

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class LetterTokenizer(PreTrainedTokenizer):
    vocab_files_names = {}

    def __init__(self, **kwargs):
        self._ids = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(LETTERS)}}
        self._tokens = {i: t for t, i in self._ids.items()}
        kwargs.setdefault("unk_token", "[UNK]")
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self._ids)

    def get_vocab(self):
        return dict(self._ids)

    def _tokenize(self, text):
        return text.split()

    def _convert_token_to_id(self, token):
        return self._ids.get(token, 0)

    def _convert_id_to_token(self, index):
        return self._tokens.get(index, "[UNK]")

    def convert_tokens_to_string(self, tokens):
        return " ".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
"""


def remote_code_checkpoint(path: Path) -> Path:
    """A tiny checkpoint (:func:`tiny_checkpoint`'s weights) whose tokenizer is a class of its own in a
    file beside its config (``auto_map``): transformers loads it only with ``trust_remote_code``."""
    tiny_checkpoint(path)
    for f in list(path.iterdir()):
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    (path / "letter_tokenizer.py").write_text(LETTER_TOKENIZER)
    config = {
        "tokenizer_class": "LetterTokenizer",
        "unk_token": "[UNK]",
        "auto_map": {"AutoTokenizer": [None, "letter_tokenizer.LetterTokenizer"]},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_a_target_whose_tokenizer_runs_its_own_code_plans_a_rest_run_with_trust_remote_code(tmp_path, monkeypatch):
    """``model.trust_remote_code=true`` lets the target's tokenizer run its own code; the datastore's
    tokenizer was loaded without it, so such a target was refused once ``proposer=rest`` opened a
    datastore. The plan freezes the datastore's release (built from that tokenizer) into the
    manifest; without the option the target is refused naming it, and nothing is built."""
    from harness.runner import plan_job
    from harness.target.loading import CheckpointError

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    checkpoint = remote_code_checkpoint(tmp_path / "letters")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a b c d e f g h i j k l m n o p q r s t u v w x y z\n" * 3)
    workload = tmp_path / "wl.jsonl"
    workload.write_text(json.dumps({"id": "p1", "prompt": "q r s t"}) + "\n")
    overrides = [
        "model=hf",
        f"model.name_or_path={checkpoint}",
        "proposer=rest",
        "topology=sequences",
        "proposer.datastore.corpus=files",
        f"proposer.datastore.corpus_path={corpus}",
        "proposer.datastore.exclude=none",
        "workload=jsonl",
        f"workload.path={workload}",
        "workload.chat=false",
        "gates.oracle=false",
        "threads=1",
    ]
    with pytest.raises(CheckpointError, match=re.escape("set model.trust_remote_code=true")):
        plan_job(compose_cfg(*overrides, "model.trust_remote_code=false"), None)
    assert not (tmp_path / "cache" / "datastores").exists()
    planned = plan_job(compose_cfg(*overrides, "model.trust_remote_code=true"), None)
    entry = planned.manifest["datastores"]["rest"]
    ds = load_datastore(entry["path"], tokenizer=None)
    assert entry["release_id"] == ds.release_id and entry["corpus"] == "files"
    assert ds.manifest["tokenizer"]["class"] == "LetterTokenizer"
    assert [t for t in ds.tokens.tolist() if t != SENTINEL] == list(range(1, 27)) * 3  # the letters' own ids


def test_the_datastore_tokenizer_is_read_at_the_revision_the_manifest_binds(env, tmp_path, monkeypatch):
    """A hub id resolves to a commit the manifest records (``target_checkpoint.revision``) and the
    run reads its tokenizer at; the datastore's tokenizer is read at the same commit, with the
    target's ``trust_remote_code``."""
    import harness.proposers.rest as rest_module
    from harness.proposers.rest import manifest_datastores

    seen = []

    def tokenizer_of(model_cfg, revision=None):
        seen.append((str(model_cfg.name_or_path), bool(model_cfg.trust_remote_code), revision))
        return word_tokenizer(WORDS)

    monkeypatch.setattr(rest_module, "load_tokenizer_of", tokenizer_of)
    monkeypatch.setattr(
        rest_module, "checkpoint_fingerprint", lambda ref: {"ref": ref, "revision": "c0ffee", "bound_by": "revision"}
    )
    from harness.workloads.corpora import Document, InlineCorpus

    store = tmp_path / "ds"
    corpus = InlineCorpus((Document("d", ("def return self import class if else for in None",)),))
    write_datastore(
        build_datastore(corpus, tokenizer=word_tokenizer(WORDS), target_family="owner/model", progress=False), store
    )
    cfg = compose_cfg(
        "model=hf",
        "model.name_or_path=owner/model",
        "model.trust_remote_code=true",
        "proposer=rest",
        "topology=sequences",
        f"proposer.datastore.path={store}",
    )
    assert manifest_datastores(cfg)["datastores"]["rest"]["path"] == str(store)
    assert seen == [("owner/model", True, "c0ffee")]
