"""REST datastore: suffix index vs brute force, release manifest, refusals, exclusion, leakage."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time

import numpy as np
import pytest

from harness.target.loading import tokenizer_fingerprint
from harness.workloads import corpora
from harness.workloads.corpora import Document, InlineCorpus, StdlibCorpus
from harness.workloads.datastore import (
    SENTINEL,
    DatastoreError,
    ExclusionItem,
    LeakageError,
    build_datastore,
    build_suffix_array,
    check_leakage,
    datastore_from_token_ids,
    load_datastore,
    longest_match,
    main,
)

WORDS = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()


def word_tokenizer(words=WORDS):
    """A tiny real HF fast tokenizer: whitespace-split words, one id each ([UNK] = 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def ids(text: str) -> list[int]:
    return [WORDS.index(w) + 1 for w in text.split()]


def brute_occurrences(tokens: np.ndarray, pattern: list[int]) -> list[int]:
    n = len(pattern)
    return [i for i in range(len(tokens) - n + 1) if tokens[i : i + n].tolist() == pattern]


def brute_spread(tokens: np.ndarray, pattern: list[int], max_matches: int) -> list[int]:
    """The matches the datastore reads for ``pattern`` (ascending): those followed by a token of their
    segment, ordered by the text that follows them; past ``max_matches``, the middle one of each of
    ``max_matches`` equal strata of that order."""
    n = len(pattern)
    held = sorted(
        (i for i in brute_occurrences(tokens, pattern) if tokens[i + n] != SENTINEL), key=lambda i: tokens[i:].tolist()
    )
    if len(held) > max_matches:
        held = [held[(2 * j + 1) * len(held) // (2 * max_matches)] for j in range(max_matches)]
    return sorted(held)


def brute_longest(tokens: np.ndarray, query: list[int]) -> int:
    best = 0
    for i in range(len(query)):
        for j in range(i + 1, len(query) + 1):
            if brute_occurrences(tokens, query[i:j]):
                best = max(best, j - i)
    return best


# ---------------------------------------------------------------------------- suffix index


def test_suffix_array_matches_sorted_suffixes_with_sentinels():
    rng = np.random.default_rng(0)
    for _ in range(30):
        tokens = rng.integers(-1, 5, size=int(rng.integers(1, 200))).astype(np.int32)
        expected = sorted(range(len(tokens)), key=lambda i: tokens[i:].tolist())
        assert build_suffix_array(tokens).tolist() == expected


def test_occurrences_agree_with_brute_force_scan():
    rng = np.random.default_rng(1)
    for _ in range(20):
        docs = [rng.integers(0, 4, size=int(rng.integers(0, 60))).tolist() for _ in range(4)]
        ds = datastore_from_token_ids(docs)
        for n in (1, 2, 3, 5):
            for _ in range(6):
                pattern = rng.integers(0, 4, size=n).tolist()
                want = brute_occurrences(ds.tokens, pattern)
                assert ds.occurrences(pattern).tolist() == want
                assert ds.count(pattern) == len(want)
                # with a continuation inside the segment, spread over what follows them
                for cap in (1, 3, 7):
                    got = ds.occurrences(pattern, max_matches=cap, need_continuation=True).tolist()
                    assert got == brute_spread(ds.tokens, pattern, cap), (docs, pattern, cap)


def test_the_longest_suffix_held_agrees_with_trying_every_length():
    rng = np.random.default_rng(2)
    for _ in range(20):
        docs = [rng.integers(0, 4, size=int(rng.integers(0, 60))).tolist() for _ in range(4)]
        ds = datastore_from_token_ids(docs)
        for _ in range(8):
            tokens = rng.integers(0, 4, size=int(rng.integers(0, 12))).tolist()
            for lo, hi in ((1, 16), (2, 5), (3, 3)):
                held = [n for n in range(lo, min(hi, len(tokens)) + 1) if ds.count(tokens[len(tokens) - n :])]
                assert ds.longest_suffix(tokens, min_len=lo, max_len=hi) == max(held, default=0)
    with pytest.raises(ValueError, match="token ids"):
        ds.longest_suffix([1, -2], min_len=1, max_len=4)


def test_matches_past_max_matches_are_a_sample_of_all_of_them_by_what_follows():
    """A suffix with more matches than ``max_matches`` read its earliest ones in the corpus: where
    those all continued one way (the first files of the stdlib), that way was proposed first
    whatever the rest of the datastore said. The sample is spread over every match in the order of
    the text that follows, so each continuation's count is within one of its share of all of them."""
    ds = datastore_from_token_ids([[1, 2, 3]] * 4 + [[1, 2, 4]] * 12, max_matches=4)
    starts = ds.occurrences([1, 2], max_matches=4, need_continuation=True)
    assert sorted(ds.continuations(starts, offset=2, length=1)) == [[3], [4], [4], [4]]  # 4 : 12
    rng = np.random.default_rng(3)
    for _ in range(40):
        docs = [rng.integers(0, 5, size=int(rng.integers(1, 80))).tolist() for _ in range(6)]
        ds = datastore_from_token_ids(docs)
        pattern = rng.integers(0, 5, size=int(rng.integers(1, 3))).tolist()
        every = ds.occurrences(pattern, need_continuation=True)
        for cap in (1, 2, 5, 16):
            sample = ds.occurrences(pattern, max_matches=cap, need_continuation=True)
            assert len(sample) == min(cap, len(every)) and set(sample.tolist()) <= set(every.tolist())
            for length in (1, 2, 3):  # every prefix of the continuations, not only their first token
                whole = [tuple(c) for c in ds.continuations(every, offset=len(pattern), length=length)]
                part = [tuple(c) for c in ds.continuations(sample, offset=len(pattern), length=length)]
                for cont in set(whole):
                    share = whole.count(cont) * len(part) / len(whole)
                    assert abs(part.count(cont) - share) < 1, (docs, pattern, cap, cont)


def test_a_release_keeps_the_match_selection_its_manifest_declares(tmp_path, capsys):
    """A release built when the earliest matches were read keeps reading them (its release id stands
    for the continuations it retrieves); ``harness datastore info`` names the selection; a rule this
    harness does not know is refused, never read as another."""
    from harness.workloads.datastore import LOWEST_OFFSETS_MATCH_RULE, Datastore, _release_id, write_datastore

    new = datastore_from_token_ids([[1, 2, 3]] * 4 + [[1, 2, 4]] * 12, max_matches=4)

    def declaring(rule: str) -> dict:
        manifest = json.loads(json.dumps(new.manifest))
        manifest["match_selection"]["rule"] = rule
        manifest["release_id"] = _release_id(manifest)
        return manifest

    old = Datastore(tokens=new.tokens, sa=new.sa, manifest=declaring(LOWEST_OFFSETS_MATCH_RULE))
    write_datastore(old, tmp_path / "old")
    old = load_datastore(tmp_path / "old", tokenizer=None)
    starts = old.occurrences([1, 2], max_matches=4, need_continuation=True)
    assert starts.tolist() == [0, 4, 8, 12] and old.continuations(starts, offset=2, length=1) == [[3]] * 4
    write_datastore(new, tmp_path / "new")
    for name, selection in (("old", "lowest_offsets"), ("new", "spread")):
        assert main(["info", str(tmp_path / name)]) == 0
        assert json.loads(capsys.readouterr().out)["match_selection"] == selection
    (tmp_path / "new" / "manifest.json").write_text(json.dumps(declaring("keep whichever matches you like")))
    assert main(["info", str(tmp_path / "new")]) == 2
    assert "declares a match-selection rule this harness does not apply" in capsys.readouterr().err


def test_toy_trace_continuations_read_forward_to_the_boundary():
    ds = datastore_from_token_ids([[4, 5, 6, 9, 4, 5, 6, 10, 11]])
    starts = ds.occurrences([4, 5, 6], need_continuation=True)
    assert starts.tolist() == [0, 4]
    assert ds.continuations(starts, offset=3, length=8) == [[9, 4, 5, 6, 10, 11], [10, 11]]


def test_matches_never_cross_documents():
    ds = datastore_from_token_ids([[1, 2, 3], [4, 5]])
    assert ds.tokens.tolist() == [1, 2, 3, SENTINEL, 4, 5, SENTINEL]
    assert ds.count([3, 4]) == 0  # adjacent only through the sentinel
    assert ds.count([2, 3]) == 1
    # a match at a document end has no continuation
    assert ds.occurrences([2, 3], need_continuation=True).tolist() == []
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31"):
        ds.count([-1])


def test_longest_match_agrees_with_brute_force():
    rng = np.random.default_rng(2)
    for _ in range(15):
        docs = [rng.integers(0, 3, size=int(rng.integers(1, 40))).tolist() for _ in range(3)]
        ds = datastore_from_token_ids(docs)
        query = rng.integers(0, 4, size=int(rng.integers(0, 25))).tolist()
        assert longest_match(ds, query) == brute_longest(ds.tokens, query)


# ---------------------------------------------------------------------------- builder + manifest


def _corpus(*texts: str) -> InlineCorpus:
    return InlineCorpus(docs=tuple(Document(doc_id=f"d{i}", segments=(t,)) for i, t in enumerate(texts)))


def test_build_writes_tokens_sa_and_a_complete_manifest(tmp_path):
    tok = word_tokenizer()
    corpus = InlineCorpus(docs=(Document("d0", ("a b c", "d e")), Document("d1", ("a b f",))))
    ds = build_datastore(
        corpus,
        tokenizer=tok,
        target_family="toy",
        out_dir=tmp_path / "ds",
        context_len=4,
        continuation_len=3,
        max_matches=5,
        progress=False,
    )
    assert ds.tokens.tolist() == ids("a b c") + [-1] + ids("d e") + [-1] + ids("a b f") + [-1]
    assert np.load(tmp_path / "ds" / "tokens.npy").dtype == np.dtype("<i4")
    m = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    # the index release fields: corpus snapshot and license note, exclusion policy
    assert m["corpus"]["snapshot"]["kind"] == "inline" and m["corpus"]["license_note"]
    assert m["exclusion"]["items"] == [] and "window" in m["exclusion"]["policy"]
    assert m["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    assert (m["context_len"], m["continuation_len"]) == (4, 3)
    assert "big-endian" in m["key_encoding"]["search_keys"] and "little-endian" in m["key_encoding"]["tokens_file"]
    assert m["counter_width"] == "uint32"
    assert m["match_selection"]["max_matches"] == 5 and "spread evenly" in m["match_selection"]["rule"]
    assert m["pruning"]["sibling_order"] == "descending prefix count, then ascending token id"
    assert len(m["index"]["sha256"]) == 64 and m["index"]["n_tokens"] == 11
    assert m["builder_version"] == "harness-datastore/1" and m["target_family"] == "toy"
    assert m["corpus"]["documents_used"] == 2
    loaded = load_datastore(tmp_path / "ds", tokenizer=tok, corpus=corpus)
    assert loaded.tokens.tolist() == ds.tokens.tolist() and loaded.release_id == ds.release_id
    assert loaded.occurrences(ids("a b")).tolist() == [0, 7]


def test_load_refuses_another_tokenizer(tmp_path):
    tok = word_tokenizer()
    build_datastore(_corpus("a b c"), tokenizer=tok, target_family="toy", out_dir=tmp_path, progress=False)
    other = word_tokenizer(list(reversed(WORDS)))  # same words, different ids
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(word_tokenizer()) == tokenizer_fingerprint(tok)  # a fresh equal copy
    with pytest.raises(DatastoreError, match="built with tokenizer") as err:
        load_datastore(tmp_path, tokenizer=other, verify_corpus=False)
    # the remedy is a rebuild: the error says where its message tells so (a cached datastore's
    # refusal names the command after those words)
    assert err.value.rebuild == "Rebuild the datastore for this model's tokenizer"
    assert str(err.value).endswith("spans would be wrong. Rebuild the datastore for this model's tokenizer.")
    load_datastore(tmp_path, tokenizer=word_tokenizer(), verify_corpus=False)


def _edited(path, field: str, value) -> None:
    """``path``'s manifest with ``field`` (dotted) set to ``value`` (``...``: removed) and its
    release id recomputed, as a hand edit that knows the hash would leave it."""
    from harness.workloads.datastore import _release_id

    m = json.loads((path / "manifest.json").read_text())
    *parents, leaf = field.split(".")
    node = m
    for part in parents:
        node = node[part]
    if value is ...:
        del node[leaf]
    else:
        node[leaf] = value
    m["release_id"] = _release_id(m)
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("index", "abc", "index must be a JSON object; got 'abc'"),
        ("index", ..., "index must be a JSON object; got missing"),
        ("index.sha256", 5, "index.sha256 must be a string; got 5"),
        ("index.n_tokens", -1, "index.n_tokens must be an integer >= 0; got -1"),
        ("tokenizer", "abc", "tokenizer must be a JSON object; got 'abc'"),
        ("tokenizer.fingerprint", 123, "tokenizer.fingerprint must be a string; got 123"),
        ("tokenizer.fingerprint", ..., "tokenizer.fingerprint must be a string; got missing"),
        ("tokenizer", {}, "tokenizer.fingerprint must be a string; got missing"),
        ("context_len", 2.5, "context_len must be an integer >= 1; got 2.5"),
        ("context_len", "16", "context_len must be an integer >= 1; got '16'"),
        ("context_len", 0, "context_len must be an integer >= 1; got 0"),
        ("context_len", True, "context_len must be an integer >= 1; got True"),
        ("continuation_len", None, "continuation_len must be an integer >= 1; got missing"),
        ("match_selection", [], "match_selection must be a JSON object; got []"),
        ("match_selection.max_matches", -3, "match_selection.max_matches must be an integer >= 1; got -3"),
        ("match_selection.rule", 1, "match_selection.rule must be a string; got 1"),
        ("corpus", [1], "corpus must be a JSON object; got [1]"),
        ("corpus.snapshot", "x", "corpus.snapshot must be a JSON object; got 'x'"),
    ],
)
def test_load_refuses_a_manifest_field_of_another_type_naming_it(tmp_path, capsys, field, value, said):
    tok = word_tokenizer()
    build_datastore(_corpus("a b c d"), tokenizer=tok, target_family="toy", out_dir=tmp_path, progress=False)
    _edited(tmp_path, field, value)
    for tokenizer in (tok, None):
        with pytest.raises(DatastoreError) as err:
            load_datastore(tmp_path, tokenizer=tokenizer, verify_corpus=False)
        assert f"manifest.json field {said}: the manifest was changed after the build; rebuild it" in str(err.value)
        assert err.value.rebuild == "rebuild it"
    assert main(["info", str(tmp_path)]) == 2
    assert f"field {said}" in capsys.readouterr().err


def test_load_refuses_a_manifest_whose_token_count_is_not_the_index_s(tmp_path):
    tok = word_tokenizer()
    build_datastore(_corpus("a b c d"), tokenizer=tok, target_family="toy", out_dir=tmp_path, progress=False)
    _edited(tmp_path, "index.n_tokens", 3)
    with pytest.raises(DatastoreError, match=r"field index.n_tokens is 3, but tokens.npy holds 5 tokens: rebuild it"):
        load_datastore(tmp_path, tokenizer=tok, verify_corpus=False)


def test_load_refuses_a_changed_corpus(tmp_path):
    tok = word_tokenizer()
    build_datastore(_corpus("a b c", "d e"), tokenizer=tok, target_family="toy", out_dir=tmp_path, progress=False)
    with pytest.raises(DatastoreError, match="changed since the build"):
        load_datastore(tmp_path, tokenizer=tok, corpus=_corpus("a b c", "d e f"))


def test_load_refuses_a_changed_stdlib_tree(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "b.py").write_text("a b c\n")
    (root / "pkg" / "a.py").write_text("d e f\n")
    (root / "test" / "test_x.py").write_text("z z z\n")  # skipped: test directory
    corpus = StdlibCorpus(root=str(root))
    assert [d.doc_id for d in corpus.documents()] == ["b.py", "pkg/a.py"]
    tok = word_tokenizer()
    build_datastore(corpus, tokenizer=tok, target_family="toy", out_dir=tmp_path / "ds", progress=False)
    load_datastore(tmp_path / "ds", tokenizer=tok)  # rebuilt from the manifest's source: unchanged
    (root / "pkg" / "a.py").write_text("d e g\n")
    with pytest.raises(DatastoreError, match="files_sha256"):
        load_datastore(tmp_path / "ds", tokenizer=tok)


def test_load_refuses_checksum_mismatch_and_edited_manifest(tmp_path):
    tok = word_tokenizer()
    build_datastore(_corpus("a b c d"), tokenizer=tok, target_family="toy", out_dir=tmp_path, progress=False)
    tokens = np.load(tmp_path / "tokens.npy")
    tokens[1] = 7
    np.save(tmp_path / "tokens.npy", tokens)
    with pytest.raises(DatastoreError, match="checksum mismatch"):
        load_datastore(tmp_path, tokenizer=tok, verify_corpus=False)
    tokens[1] = ids("b")[0]
    np.save(tmp_path / "tokens.npy", tokens)
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["match_selection"]["max_matches"] = 1000
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatastoreError, match="edited after release"):
        load_datastore(tmp_path, tokenizer=tok, verify_corpus=False)


def test_max_tokens_caps_the_build():
    tok = word_tokenizer()
    ds = build_datastore(
        _corpus("a b c d", "e f g h", "i j"), tokenizer=tok, target_family="toy", max_tokens=7, progress=False
    )
    # 5 tokens for doc 0 (4 + sentinel), doc 1 cut to 1 token + sentinel
    assert ds.tokens.tolist() == ids("a b c d") + [-1] + ids("e") + [-1]
    assert ds.manifest["corpus"]["stopped_by_max_tokens"] is True
    assert ds.manifest["corpus"]["documents_used"] == 2


def test_exclusion_drops_documents_sharing_a_window():
    tok = word_tokenizer()
    prompt = "c d e f g"
    corpus = _corpus("a b c d e f g h", "c d e x y", "p q r s", "q r")
    ds = build_datastore(
        corpus,
        tokenizer=tok,
        target_family="toy",
        progress=False,
        exclude=[ExclusionItem("task/1", prompt), ExclusionItem("short", "q r")],
        exclusion_window=4,
    )
    m = ds.manifest
    # d0 contains a 4-token window of the prompt; d1 shares only 3 tokens; "q r" is shorter than
    # the window and drops nothing
    assert m["exclusion"]["dropped_documents"] == [{"doc_id": "d0", "item_id": "task/1"}]
    assert [it["id"] for it in m["exclusion"]["items"]] == ["task/1", "short"]
    assert m["corpus"]["documents_used"] == 3
    assert longest_match(ds, ids(prompt)) == 3  # < window: the exclusion's guarantee


def test_the_build_keeps_out_an_excluded_text_held_mid_document_as_the_leakage_gate_reads_it():
    """A byte-level BPE tokenizer codes a text's first word alone otherwise than after a space: the
    build's exclusion looked up the lone encoding only, so a document holding the text mid-line was
    kept, and the run-time gate (which looks up the text after a space too) refused it. The build
    indexes every encoding the gate reads (:func:`~harness.workloads.corpora.text_encodings`)."""
    from checkpoint_fixtures import boundary_tokenizer

    from harness.heads.artifacts import text_encodings
    from harness.workloads.datastore import LEAKAGE_THRESHOLD

    tok = boundary_tokenizer()
    held = "Please sort them by key, then by value."
    other = "Quietly count the apples, then the pears."  # listed first: its encodings come before held's
    alone = tok(held, add_special_tokens=False)["input_ids"]
    forms = text_encodings(held, tokenizer=tok, vocab_size=len(tok))
    assert len(alone) == LEAKAGE_THRESHOLD and len(forms) == 2 and forms[1][0] != alone[0]
    corpus = InlineCorpus(
        (
            Document("mid", ("Then the user said: " + held + " and left.",)),
            Document("line", ("A first line.\n" + held + "\n",)),
            Document("clean", ("Nothing here is held out at all.",)),
        )
    )
    exclude = [ExclusionItem("q/other", other), ExclusionItem("q/held", held)]
    ds = build_datastore(corpus, tokenizer=tok, target_family="boundary", exclude=exclude, progress=False)
    m = ds.manifest
    assert m["exclusion"]["dropped_documents"] == [
        {"doc_id": "mid", "item_id": "q/held"},
        {"doc_id": "line", "item_id": "q/held"},
    ]
    assert m["corpus"]["documents_used"] == 1 and m["corpus"]["documents_excluded"] == 2
    assert [it["n_tokens"] for it in m["exclusion"]["items"]] == [
        len(tok(t, add_special_tokens=False)["input_ids"]) for t in (other, held)
    ]
    # what the build kept, the gate passes: every encoding it reads stays below the threshold
    assert max(longest_match(ds, ids) for ids in forms) < LEAKAGE_THRESHOLD


# ---------------------------------------------------------------------------- leakage gate


def test_check_leakage_refuses_a_leaked_prompt_unless_allowed():
    rng = np.random.default_rng(3)
    leaked = rng.integers(0, 1000, size=40).tolist()
    ds = datastore_from_token_ids([rng.integers(0, 1000, size=100).tolist() + leaked])
    clean = [2000 + i for i in range(40)]
    items = [("clean/0", clean, None), ("leak/1", [5000] + leaked[:33], None), ("ref/2", clean, leaked[:32])]
    with pytest.raises(LeakageError, match=r"leak/1 \(33 tokens\), ref/2 \(32 tokens\)"):
        check_leakage(ds, items)
    records = check_leakage(ds, items, allow=True)
    assert [(r["prompt_id"], r["longest_match"], r["leaked"], r["allowed"]) for r in records] == [
        ("clean/0", 0, False, False),  # allowed: a leak let through
        ("leak/1", 33, True, True),
        ("ref/2", 32, True, True),
    ]
    assert records[2]["prompt_longest_match"] == 0 and records[2]["reference_longest_match"] == 32
    # 31 tokens is below the threshold: not refused
    assert check_leakage(ds, [("near", leaked[:31], None)])[0]["leaked"] is False


# ---------------------------------------------------------------------------- CLI


def test_cli_build_and_info(tmp_path, monkeypatch, capsys):
    import harness.workloads.datastore as datastore_module

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    root = tmp_path / "lib"
    root.mkdir()
    (root / "m.py").write_text("a b c d e f\n")
    monkeypatch.setattr(corpora, "stdlib_root", lambda: root)
    out = tmp_path / "ds"
    assert (
        main(
            [
                "build",
                "corpus=stdlib",
                f"out={out}",
                "model=owner/toy",  # a hub id's form (its tokenizer is the test's)
                "datastore.max_tokens=100",
                "exclude=none",
                "progress=false",
            ]
        )
        == 0
    )
    built = json.loads(capsys.readouterr().out)
    assert built["n_tokens"] == 7 and built["corpus"] == "stdlib" and built["target_family"] == "owner/toy"
    assert main(["info", str(out), "verify_corpus=true"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["release_id"] == built["release_id"]
    # building again into it said only "not empty": it says what is there and how to use it
    assert main(["build", "corpus=stdlib", f"out={out}", "model=owner/toy", "exclude=none"]) == 2
    err = capsys.readouterr().err
    assert f"{str(out)!r} already holds a datastore (release {built['release_id'][:12]}): a run opens it" in err
    assert main(["build", "corpus=nope", f"out={tmp_path / 'x'}"]) == 2
    assert "corpus must be one of" in capsys.readouterr().err
    # options refused in one line naming the option, before any tokenizer or corpus work
    (tmp_path / "afile").write_text("")
    bad = tmp_path / "bad.jsonl"
    for lines, said in (
        (['{"prompt": "a"}', "5"], f'{bad}:2: an exclusion record is a JSON object with a "prompt"; got 5'),
        (["{nope"], f"{bad}:1: malformed JSON"),
        (['{"prompt": 5}'], f"{bad}:1: \"prompt\" of record '0' must be a string; got 5"),
        (['{"id": "x"}'], f"{bad}:1: an exclusion record needs a 'prompt', chat 'messages' or Spec-Bench 'turns'"),
    ):
        bad.write_text("\n".join(lines) + "\n")
        assert main(["build", "corpus=stdlib", "model=owner/toy", f"exclude={bad}", f"out={tmp_path / 'y'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"harness datastore: refused: {said}"), err
    for args, said in (
        (["out="], "out= is empty; give a folder or leave the option out"),
        ([f"out={out}", f"path={out}"], "give one of out=DIR and path=DIR"),
        (["max_tokens=abc"], "max_tokens='abc': expected a whole number >= 1"),
        (["max_tokens=0"], "max_tokens=0 is out of range: it must be >= 1"),
        (["max_tokens=1000", "max_tokens=500"], "max_tokens= given twice: '1000' and '500'"),  # the last one won
        (["overwrite=maybe"], "overwrite='maybe': expected true or false"),
        (["exclude=missing.jsonl"], "exclude=missing.jsonl: cannot read missing.jsonl (No such file or directory)"),
        ([f"out={tmp_path / 'afile'}"], "a file is in the way; an output folder is needed there"),
        (["model=nope"], "model='nope': no such directory (and not a hub id of the form owner/name)"),
        (
            ["roles=user"],
            "roles= picks the turns of a conversation corpus (corpus=sharegpt or files); corpus=stdlib has none",
        ),
        (["corpus_path=."], "corpus_path= is read with corpus=files; corpus=stdlib"),
        (["glob=*.py"], "glob= is read with corpus=files; corpus=stdlib"),
    ):
        model = [] if args[0].startswith("model=") else ["model=owner/toy"]
        assert main(["build", "corpus=stdlib", *model, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], (args, err)
    # roles of a folder with no conversation lines were written into the manifest, and read nothing
    assert main(["build", "corpus=files", f"corpus_path={root}", "roles=user", "model=owner/toy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and f"roles= picks the turns of conversation lines (.jsonl files); corpus_path={root}" in err[0]
    )
    assert main(["build", "--help"]) == 0 and capsys.readouterr().out.startswith("usage:")
    # the default cap is the run's: a store built here is the one `harness run proposer=rest` opens
    from harness.config import DatastoreConfig

    assert datastore_module.DEFAULT_MAX_TOKENS == DatastoreConfig().max_tokens
    # a damaged datastore is refused naming what is wrong, never a raw library error
    (out / "sa.npy").write_bytes(b"")
    assert main(["info", str(out)]) == 2
    assert "sa.npy is damaged" in capsys.readouterr().err
    (out / "sa.npy").unlink()
    assert main(["info", str(out)]) == 2
    assert "sa.npy is missing; rebuild it" in capsys.readouterr().err
    (out / "manifest.json").write_text("[]")
    assert main(["info", str(out)]) == 2
    assert "holds a JSON list, not a datastore manifest" in capsys.readouterr().err
    (out / "manifest.json").write_text("{")
    assert main(["info", str(out)]) == 2
    assert "manifest.json' is not valid JSON" in capsys.readouterr().err
    assert main(["info", str(out), "foo=1"]) == 2
    assert "info: unknown option(s) ['foo']" in capsys.readouterr().err


# ---------------------------------------------------------------------------- corpora


def _user_corpus(tmp_path):
    """A user's folder: text files (one nested), a hidden folder, a cache folder, a binary file and a
    .jsonl of text, ShareGPT and chat-message lines."""
    root = tmp_path / "mine"
    (root / "pkg").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "__pycache__").mkdir()
    (root / "b.txt").write_text("d e f\n")
    (root / "pkg" / "a.py").write_text("a b c\n")
    (root / ".git" / "HEAD").write_text("x y z\n")
    (root / "__pycache__" / "a.pyc").write_text("x y z\n")
    (root / "blob.bin").write_bytes(b"g h\0i")
    lines = [
        {"text": "j k l"},
        {"conversations": [{"from": "human", "value": "m n"}, {"from": "gpt", "value": "o p q"}]},
        {"messages": [{"role": "user", "content": "r s"}, {"role": "assistant", "content": "t u"}]},
        {"text": "   "},
    ]
    (root / "talk.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    return root


def test_a_files_corpus_reads_a_folder_s_text_files_and_jsonl_lines(tmp_path):
    root = _user_corpus(tmp_path)
    corpus = corpora.make_corpus("files", path=str(root))
    docs = list(corpus.documents())
    assert [(d.doc_id, d.segments) for d in docs] == [
        ("b.txt", ("d e f\n",)),
        ("pkg/a.py", ("a b c\n",)),
        ("talk.jsonl:1", ("j k l",)),
        ("talk.jsonl:2", ("o p q",)),  # the assistant turns (roles) of a ShareGPT line
        ("talk.jsonl:3", ("t u",)),  # and of a chat-messages line
    ]
    both = corpora.FilesCorpus(path=str(root / "talk.jsonl"), roles=("user", "assistant"))
    assert [d.segments for d in both.documents()][1:] == [("m n", "o p q"), ("r s", "t u")]
    only_py = corpora.FilesCorpus(path=str(root), glob="**/*.py")
    assert [d.doc_id for d in only_py.documents()] == ["pkg/a.py"]
    assert only_py.describe() == {
        "name": "files",
        "path": str(root.resolve()),
        "glob": "**/*.py",
        "roles": ["assistant"],
    }
    snap = corpus.snapshot()
    assert snap["n_files"] == 3 and snap["kind"] == "files"
    (root / "b.txt").write_text("d e f g\n")  # an edit changes the snapshot: the datastore is refused
    assert corpus.snapshot()["files_sha256"] != snap["files_sha256"]
    assert corpora.corpus_from_description(only_py.describe()) == only_py
    # two folders, or other roles, never share a cache folder; the default corpora keep their names
    names = {corpora.corpus_cache_name(c) for c in (corpus, only_py, both, corpora.FilesCorpus(path=str(root / "pkg")))}
    assert len(names) == 4 and all(n.startswith("files-") for n in names)
    assert corpora.corpus_cache_name(corpora.make_corpus("stdlib")) == "stdlib"
    assert corpora.corpus_cache_name(corpora.make_corpus("sharegpt")) == "sharegpt"
    assert corpora.corpus_cache_name(corpora.make_corpus("sharegpt", roles=("user",))).startswith("sharegpt-")


@pytest.mark.parametrize(
    "line, said",
    [
        ("{nope", "talk.jsonl line 1: not JSON"),
        ("[1]", "talk.jsonl line 1: expected an object with text, conversations or messages"),
        ('{"prompt": "a"}', "talk.jsonl line 1: expected a text string, or a conversations or messages list"),
        ('{"conversations": [{"from": "gpt"}]}', "talk.jsonl line 1: a turn must be an object with from/value"),
    ],
)
def test_a_bad_jsonl_line_of_a_files_corpus_is_named(tmp_path, line, said):
    (tmp_path / "talk.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match=said):
        list(corpora.FilesCorpus(path=str(tmp_path / "talk.jsonl")).documents())


def test_a_files_corpus_refuses_a_missing_path_an_empty_folder_and_bad_options(tmp_path):
    with pytest.raises(ValueError, match=r"^corpus_path=.*nowhere: no such file or folder"):
        corpora.FilesCorpus(path=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"^corpus_path is empty"):
        corpora.FilesCorpus(path=" ")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no text file matches glob=\*\*/\*"):
        corpora.FilesCorpus(path=str(tmp_path / "empty")).files()
    with pytest.raises(ValueError, match=r"^glob=/abs must be a pattern relative to the corpus folder"):
        corpora.FilesCorpus(path=str(tmp_path), glob="/abs")
    with pytest.raises(ValueError, match=r"^roles must be a non-empty subset"):
        corpora.FilesCorpus(path=str(tmp_path), roles=("bot",))


def test_cli_builds_a_datastore_from_the_user_s_files(tmp_path, monkeypatch, capsys):
    import harness.workloads.datastore as datastore_module
    from harness.proposers.rest import cache_datastore_path

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    root = _user_corpus(tmp_path)
    args = ["build", "corpus=files", f"corpus_path={root}", "glob=**/*.py", "model=owner/toy", "progress=false"]
    assert main(args) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["corpus"] == "files" and built["n_tokens"] == 4 and built["documents_used"] == 1
    expected = corpora.corpus_cache_name(corpora.FilesCorpus(path=str(root), glob="**/*.py"))
    from harness.workloads.datastore import datastore_model_key

    key = datastore_model_key("owner/toy")  # one folder per hub id or checkpoint, not a subfolder "owner/"
    assert key.startswith("toy-") and built["path"] == str(tmp_path / "cache" / "datastores" / f"{expected}-{key}")
    assert main(["info", built["path"], "verify_corpus=true"]) == 0  # rebuilt from the manifest's source
    capsys.readouterr()
    # other build options: the folder a run with the same options opens (each setting has its own)
    assert main([*args, "context_len=8", "exclude=none"]) == 0
    other = json.loads(capsys.readouterr().out)["path"]
    run_cfg = {"corpus": "files", "corpus_path": str(root), "glob": "**/*.py", "context_len": 8, "exclude": "none"}
    run_cfg["max_tokens"] = datastore_module.DEFAULT_MAX_TOKENS
    corpus = corpora.FilesCorpus(path=str(root), glob="**/*.py")
    assert other != built["path"] and other == str(cache_datastore_path(run_cfg, corpus, "owner/toy"))
    (root / "pkg" / "a.py").write_text("a b c d\n")
    assert main(["info", built["path"], "verify_corpus=true"]) == 2
    assert "changed since the" in capsys.readouterr().err
    for extra, said in (
        ([], "corpus=files needs corpus_path=: a folder, a text file or a .jsonl file"),
        ([f"corpus_path={tmp_path / 'nowhere'}"], "nowhere: no such file or folder"),
        ([f"corpus_path={root}", "glob=*.md"], "no text file matches glob=*.md"),
        # a glob beside one file was read by nothing and written into the manifest
        (
            [f"corpus_path={root / 'b.txt'}", "glob=*.py"],
            f"glob= picks the files of a folder; corpus_path={root / 'b.txt'} is one file, read whole: drop glob=",
        ),
    ):
        assert main(["build", "corpus=files", "model=owner/toy", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], (extra, err)
    # a line refused while the tokenizing bar runs: the bar is ended first, the refusal on a line of its own
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b c"}\nnot json\n')
    assert main(["build", "corpus=files", f"corpus_path={bad}", "model=owner/toy", f"out={tmp_path / 'o'}"]) == 2
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1]  # a bar's carriage returns do not end a line
    assert last.startswith("harness datastore: refused: ") and "line 2: not JSON" in last, last


def test_sharegpt_split_is_deterministic_disjoint_and_keeps_parts_together():
    ids_ = [f"conv{i}_{part}" for i in range(2000) for part in (0, 1, 7)]
    splits = [corpora.sharegpt_split(c) for c in ids_]
    assert splits == [corpora.sharegpt_split(c) for c in ids_]
    for i in range(0, len(ids_), 3):  # all parts of one conversation share a split
        assert len(set(splits[i : i + 3])) == 1
    share = {s: splits.count(s) / len(splits) for s in corpora.SPLITS}
    assert 0.86 < share["train"] < 0.94 and 0.03 < share["eval"] < 0.07 and share["calibration"] > 0.005
    assert corpora.sharegpt_base_id("hRPPgZT_11") == "hRPPgZT"
    with pytest.raises(ValueError, match="non-empty string"):
        corpora.sharegpt_split("")


def test_truncated_sharegpt_json_keeps_complete_conversations():
    full = json.dumps(
        [
            {"id": "x_0", "conversations": [{"from": "human", "value": "hi"}]},
            {"id": "y_0", "conversations": [{"from": "gpt", "value": "hello there"}]},
        ]
    )
    items, cut = corpora.parse_sharegpt_bytes(full.encode()[:-12])
    assert [o["id"] for o in items] == ["x_0"] and cut is not None
    items, cut = corpora.parse_sharegpt_bytes(full.encode())
    assert [o["id"] for o in items] == ["x_0", "y_0"] and cut is None


def test_stdlib_files_are_sorted_and_skip_tests():
    files = corpora.stdlib_files()
    rel = [f.relative_to(corpora.stdlib_root()).as_posix() for f in files]
    assert rel == sorted(rel) and "os.py" in rel
    assert not any(set(r.split("/")[:-1]) & corpora.STDLIB_SKIP_DIRS for r in rel)


@pytest.mark.slow
def test_real_sharegpt_splits_are_disjoint():
    seen = {}
    for split in corpora.SPLITS:
        for conv in corpora.sharegpt_conversations(split):
            assert seen.setdefault(corpora.sharegpt_base_id(conv.conv_id), split) == split
    counts = {s: sum(1 for v in seen.values() if v == s) for s in corpora.SPLITS}
    assert counts["train"] > 10 * counts["eval"] > 0


@pytest.mark.slow
def test_cli_builds_the_real_sharegpt_datastore_excluding_held_out_conversations(tmp_path, monkeypatch, capsys):
    """`harness datastore build corpus=sharegpt` over the packaged ShareGPT train split (capped),
    with the held-out conversations' turns excluded at build time (index release manifest
    fields)."""
    import harness.workloads.datastore as datastore_module

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    out = tmp_path / "ds"
    assert (
        main(
            [
                "build",
                "corpus=sharegpt",
                f"out={out}",
                "model=owner/toy",
                "datastore.max_tokens=20000",
                "progress=false",
            ]
        )
        == 0
    )
    built = json.loads(capsys.readouterr().out)
    assert built["corpus"] == "sharegpt" and 0 < built["n_tokens"] <= 20000
    assert built["exclusion_items"] > 100  # every non-train conversation's first user and assistant turn
    assert main(["info", str(out), "verify_corpus=true"]) == 0
    assert json.loads(capsys.readouterr().out)["release_id"] == built["release_id"]


def test_an_exclusion_source_named_twice_is_read_once(tmp_path):
    from harness.workloads.datastore import exclusions_for

    f = tmp_path / "held.jsonl"
    f.write_text('{"id": "a", "prompt": "keep me out"}\n')
    once = exclusions_for(f"{f}")
    assert exclusions_for(f"{f},{f}, {f}") == once and len(once) == 1


# ---------------------------------------------------------------------------- REST's index files


def _rest_index(path, *chunks):
    """An index file in the layout REST's draftretriever writer produces: per chunk, a little-endian
    uint32 byte count, the int32 token ids, a uint32 byte count and the chunk's suffix array."""
    out = bytearray()
    for chunk in chunks:
        tokens = np.asarray(chunk, dtype="<i4")
        sa = np.array(sorted(range(len(chunk)), key=lambda i: list(chunk[i:])), dtype="<i4")
        out += np.uint32(tokens.nbytes).astype("<u4").tobytes() + tokens.tobytes()
        out += np.uint32(sa.nbytes).astype("<u4").tobytes() + sa.tobytes()
    path.write_bytes(bytes(out))
    return path


def test_a_rest_index_file_imports_as_a_datastore_with_the_same_matches(tmp_path):
    from harness.workloads.datastore import import_rest_index, read_rest_index

    tok = word_tokenizer()
    first, second = ids("a b c d a b e"), ids("f a b c")
    index = _rest_index(tmp_path / "ds.idx", first, second)
    assert [c.tolist() for c in read_rest_index(index)] == [first, second]
    ds = import_rest_index(index, tokenizer=tok, target_family="toy", out_dir=tmp_path / "ds", progress=False)
    assert ds.tokens.tolist() == [*first, SENTINEL, *second, SENTINEL]  # a chunk is a segment
    assert ds.count(ids("a b")) == 3 and ds.count(ids("a b c")) == 2 and ds.count(ids("e f")) == 0
    m = ds.manifest
    assert m["corpus"]["name"] == "rest-index" and m["corpus"]["snapshot"]["chunks"] == 2
    assert m["corpus"]["snapshot"]["file_sha256"] == __import__("hashlib").sha256(index.read_bytes()).hexdigest()
    assert "declared at import" in m["tokenizer"]["declared"] and m["exclusion"]["items"] == []
    again = load_datastore(tmp_path / "ds", tokenizer=tok)  # verifies; the source file is not re-read
    assert again.release_id == ds.release_id
    index.unlink()
    load_datastore(tmp_path / "ds", tokenizer=tok)  # the datastore holds its own tokens
    # a run's open says what it checked of the corpus: nothing can be re-read for an imported index
    from harness.proposers.rest import open_datastore

    _, info = open_datastore({"path": str(tmp_path / "ds")}, tokenizer=tok, model="toy")
    assert info["corpus_check"].startswith("not applicable: an imported REST index")


@pytest.mark.parametrize(
    "content, said",
    [
        (b"", "is empty: not a REST index file"),
        (b"\x03\x00\x00\x00abc", "chunk 0 at byte 0 declares 3 bytes of tokens (not a positive multiple of 4)"),
        (
            b"\x08\x00\x00\x00\x01\x00\x00\x00",
            "chunk 0 at byte 0 declares 8 bytes of tokens (past the end of the file)",
        ),
        (
            b"\x04\x00\x00\x00\x01\x00\x00\x00\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
            "chunk 0's suffix array at byte 8 declares 8 bytes for 1 tokens",
        ),
    ],
)
def test_a_file_that_is_not_a_rest_index_is_refused_naming_the_byte(tmp_path, content, said):
    from harness.workloads.datastore import read_rest_index

    (tmp_path / "bad.idx").write_bytes(content)
    with pytest.raises(DatastoreError, match=re.escape(said)):
        read_rest_index(tmp_path / "bad.idx")


def test_cli_imports_a_rest_index_and_refuses_another_tokenizer_s_ids(tmp_path, monkeypatch, capsys):
    import harness.workloads.datastore as datastore_module

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    index = _rest_index(tmp_path / "ds.idx", ids("a b c a b d"))
    assert main(["import", str(index), "model=owner/toy", "max_matches=4", "progress=false"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["corpus"] == "rest-index" and built["n_tokens"] == 7 and built["max_matches"] == 4
    assert built["path"].startswith(str(tmp_path / "cache" / "datastores" / "rest-index-"))
    assert main(["info", built["path"]]) == 0
    capsys.readouterr()
    # other retrieval sizes over the same file: a folder of their own, not "already holds a datastore"
    assert main(["import", str(index), "model=owner/toy", "max_matches=2", "progress=false"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["max_matches"] == 2 and other["path"] != built["path"]
    assert main(["import", str(index), "model=owner/toy", "max_matches=4", "progress=false"]) == 2
    assert "already holds a datastore" in capsys.readouterr().err
    wide = _rest_index(tmp_path / "wide.idx", [1, 2, 32000])  # a Llama-2 index for a 27-word tokenizer
    (tmp_path / "junk.idx").write_bytes(b"\x03\x00\x00\x00abc")
    for args, said in (
        (
            [str(wide), "model=owner/toy", f"out={tmp_path / 'w'}"],
            "chunk 0 holds token id 32000, outside the vocabulary [0, 27)",
        ),
        ([str(index)], "import needs model=: the target whose tokenizer built the index"),
        ([str(tmp_path / "none.idx"), "model=owner/toy"], "none.idx': no such index file"),
        (["model=owner/toy"], "import needs an index file first"),
        ([str(index), "model=owner/toy", "foo=1"], "import: unknown option(s) ['foo']"),
        ([str(tmp_path / "junk.idx"), "model=owner/toy"], "is not a REST index file: chunk 0 at byte 0"),
        ([str(index), "model=owner/toy", "max_matches=0"], "max_matches=0 is out of range: it must be >= 1"),
    ):
        assert main(["import", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], (args, err)
    assert not (tmp_path / "w").exists()


def test_a_datastore_is_never_written_into_a_run_folder_or_beside_other_files(tmp_path, monkeypatch, capsys):
    import harness.workloads.datastore as datastore_module

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    index = _rest_index(tmp_path / "ds.idx", ids("a b c a b d"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "record.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    for out, said in ((run, "holds a run folder (its record.json)"), (other, "holds files that are no datastore")):
        assert main(["import", str(index), "model=owner/toy", f"out={out}", "overwrite=true", "progress=false"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
    assert sorted(p.name for p in run.iterdir()) == ["record.json"]
    cut = tmp_path / "cut.idx"
    cut.write_bytes(index.read_bytes()[:-4])
    assert main(["import", str(cut), "model=owner/toy", f"out={tmp_path / 'c'}"]) == 2
    assert (
        "is cut short: chunk 0's suffix array at byte 28 runs 4 bytes past the end of the file"
        in capsys.readouterr().err
    )
    root = _user_corpus(tmp_path)  # roles written as harness run writes a list
    assert (
        main(
            [
                "build",
                "corpus=files",
                f"corpus_path={root / 'talk.jsonl'}",
                "roles=[user,assistant]",
                "model=owner/toy",
                f"out={tmp_path / 'r'}",
                "progress=false",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["documents_used"] == 3


@contextlib.contextmanager
def another_build(out, then=lambda: None):
    """Another process's build into ``out``: its lock held (from another thread, which takes it as a
    process would) while ``then`` runs after a moment, then released."""
    from harness.files import artifact_lock

    holding = threading.Event()

    def build():
        with artifact_lock(out, purpose="a build in another process"):
            holding.set()
            time.sleep(0.5)
            then()

    thread = threading.Thread(target=build)
    thread.start()
    try:
        assert holding.wait(10)
        yield
    finally:
        thread.join()


def test_a_build_into_a_folder_another_build_holds_waits_for_it(tmp_path, monkeypatch, capsys):
    """Two builds into one folder each checked that it held no datastore, then both wrote into it:
    both said they succeeded and one was lost. A build holds the folder's lock from that check to the
    rename of its temporary folder into place, as a run's build does: the second one waits, then is
    refused, or with overwrite=true replaces the first's."""
    import harness.workloads.datastore as datastore_module

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    root = tmp_path / "lib"
    root.mkdir()
    (root / "m.py").write_text("a b c d e f\n")
    monkeypatch.setattr(corpora, "stdlib_root", lambda: root)
    out = tmp_path / "ds"
    first = {}

    def first_build():
        first["ds"] = build_datastore(
            _corpus("g h i"), tokenizer=word_tokenizer(), target_family="toy", out_dir=out, progress=False
        )

    args = ["build", "corpus=stdlib", f"out={out}", "model=owner/toy", "exclude=none", "progress=false"]
    with another_build(out, first_build):
        assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    release = first["ds"].release_id
    assert len(err) == 2 and f"{out} is being built by pid {os.getpid()}" in err[0] and "waiting" in err[0], err
    assert f"already holds a datastore (release {release[:12]})" in err[1], err
    assert load_datastore(out, tokenizer=None).release_id == release
    with another_build(out):
        assert main([*args, "overwrite=true"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["release_id"] != release and second["path"] == str(out)
    assert load_datastore(out, tokenizer=None).release_id == second["release_id"]
    # an import waits as a build does
    index = _rest_index(tmp_path / "ds.idx", ids("a b c a b d"))
    with another_build(out):
        assert main(["import", str(index), "model=owner/toy", f"out={out}", "progress=false"]) == 2
    assert f"already holds a datastore (release {second['release_id'][:12]})" in capsys.readouterr().err
    # a build refused while it reads leaves no folder behind
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b c"}\nnot json\n')
    assert main(["build", "corpus=files", f"corpus_path={bad}", "model=owner/toy", f"out={tmp_path / 'o'}"]) == 2
    # nothing but the folders, the lock files beside them and the test's own files
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ds.lock", ".o.lock", "bad.jsonl", "ds", "ds.idx", "lib"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "sa.npy", "tokens.npy"]


def test_a_folder_of_another_kind_is_never_taken_for_a_datastore(tmp_path, monkeypatch, capsys):
    """Any folder holding a manifest.json was taken for a datastore: a trained-heads folder was told it
    "already holds a datastore", and overwrite=true replaced its manifest and wrote the index beside
    its weights. A datastore is a folder whose manifest a datastore build wrote; nothing else is
    written over, and a datastore with other files beside it is not replaced (they would go with it)."""
    import harness.workloads.datastore as datastore_module

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    index = _rest_index(tmp_path / "ds.idx", ids("a b c a b d"))
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "manifest.json").write_text(json.dumps({"kind": "medusa", "heads": 4}))
    (heads / "heads.safetensors").write_bytes(b"weights")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "manifest.json").write_text(json.dumps({"name": "mine"}))
    for out, said in (
        (heads, "holds a manifest.json that is no datastore's (a 'medusa' artifact's)"),
        (bare, "holds a manifest.json that is no datastore's (no builder_version 'harness-datastore/"),
    ):
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        for overwrite in ("false", "true"):
            for command in (
                ["build", "corpus=files", f"corpus_path={index}", f"overwrite={overwrite}"],
                ["import", str(index), f"overwrite={overwrite}"],
            ):
                assert main([*command, "model=owner/toy", f"out={out}", "progress=false"]) == 2
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and f"out={out} {said}" in err[0], err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert main(["info", str(out)]) == 2
        assert f"{str(out)!r} is not a datastore: its manifest.json" in capsys.readouterr().err
    # a datastore with other files beside it: overwrite=true would take them with it
    ds = tmp_path / "ds"
    assert main(["import", str(index), "model=owner/toy", f"out={ds}", "progress=false"]) == 0
    capsys.readouterr()
    (ds / "notes.txt").write_text("mine")
    assert main(["import", str(index), "model=owner/toy", f"out={ds}", "overwrite=true", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"out={ds} holds a datastore and other files (notes.txt)" in err[0], err
    (ds / "notes.txt").unlink()
    # a damaged datastore (its files only) is rebuilt with overwrite=true, as its refusal says
    (ds / "manifest.json").write_text("{")
    assert main(["import", str(index), "model=owner/toy", f"out={ds}", "progress=false"]) == 2
    assert f"{str(ds)!r} already holds a datastore" in capsys.readouterr().err
    assert main(["import", str(index), "model=owner/toy", f"out={ds}", "overwrite=true", "progress=false"]) == 0
    assert load_datastore(ds, tokenizer=None).n_tokens == 7


def test_a_chat_or_spec_bench_prompt_file_is_an_exclusion_list_as_a_prompt_file_is(tmp_path):
    """The leakage refusal offers ``exclude=<workload>.jsonl``, but only files of ``{"prompt"}`` lines were
    read: a Spec-Bench question file or a chat ``messages`` file was refused. Every text either format
    gives the model (each turn, each message) and each reference is excluded now."""
    from harness.workloads.datastore import jsonl_exclusions

    path = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 7, "category": "writing", "turns": ["first turn", "second turn"], "reference": ["r1", "r2"]},
        {"id": "c", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]},
        {"id": "p", "prompt": "def f():", "reference": "return 1"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = {(it.item_id, it.text) for it in jsonl_exclusions(path)}
    assert got == {
        ("7/turn1", "first turn"),
        ("7/turn2", "second turn"),
        ("7/reference1", "r1"),
        ("7/reference2", "r2"),
        ("c/message0", "be brief"),
        ("c/message1", "hello"),
        ("p/prompt", "def f():"),
        ("p/reference", "return 1"),
    }
    # a Spec-Bench reference may nest lists or hold numbers, as the workload reads it
    nested = tmp_path / "nested.jsonl"
    nested.write_text(json.dumps({"question_id": 9, "category": "math", "turns": ["t"], "reference": [["a", "b"], 42]}))
    got = {(it.item_id, it.text) for it in jsonl_exclusions(nested)}
    assert got == {("9/turn1", "t"), ("9/reference1", "a\nb"), ("9/reference2", "42")}


def test_a_rebuild_of_the_same_data_is_the_same_release_and_an_older_release_still_loads(tmp_path):
    """The release id hashed the build's wall times: every rebuild (or a build on another machine)
    was another release, and the run's manifest hash, which folds it in, made a finished job look
    like another one. The id now leaves the times out; a release written under the old rule loads."""
    tok = word_tokenizer()
    a = build_datastore(_corpus("a b c", "d e"), tokenizer=tok, target_family="toy", out_dir=tmp_path / "a")
    b = build_datastore(_corpus("a b c", "d e"), tokenizer=tok, target_family="toy", out_dir=tmp_path / "b")
    assert a.manifest["build"] is not None and a.release_id == b.release_id
    other = build_datastore(_corpus("a b c", "d f"), tokenizer=tok, target_family="toy", out_dir=tmp_path / "c")
    assert other.release_id != a.release_id  # the content still names the release
    # a release stamped with its build times (as written before) still loads; an edited one does not
    import hashlib

    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    body = {k: v for k, v in manifest.items() if k != "release_id"}
    manifest["release_id"] = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(manifest))
    assert load_datastore(tmp_path / "a", tokenizer=tok, verify_corpus=False).release_id == manifest["release_id"]
    manifest["context_len"] += 1
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatastoreError, match="manifest.json was edited after release"):
        load_datastore(tmp_path / "a", tokenizer=tok, verify_corpus=False)


def test_a_leak_shorter_than_the_builds_exclusion_window_is_not_sent_to_a_rebuild():
    """leakage_threshold below the build's exclusion window (32 tokens): the refusal said to rebuild
    excluding the prompt, which keeps the same shorter match every time. It now says to raise the
    threshold to the window (or allow the leak)."""
    rng = np.random.default_rng(5)
    leaked = rng.integers(0, 1000, size=40).tolist()
    ds = datastore_from_token_ids([rng.integers(0, 1000, size=100).tolist() + leaked])
    ds.manifest["exclusion"] = {"window_tokens": 32, "items": []}
    with pytest.raises(
        LeakageError, match=r"p \(20 tokens\): a build keeps out only matches of 32 tokens or more"
    ) as e:
        check_leakage(ds, [("p", leaked[:20], None)], threshold=16)
    assert "raise leakage_threshold to 32; or set allow_leakage=true" in str(e.value)
    assert "rebuild the datastore" not in str(e.value)
    with pytest.raises(LeakageError, match=r"p \(36 tokens\): rebuild the datastore excluding them") as e:
        check_leakage(ds, [("p", leaked[:36], None)], threshold=16)  # a rebuild does drop this one
    assert "raise leakage_threshold" not in str(e.value)
    # both kinds at once: each named with its own remedy (following one alone left the other refused)
    with pytest.raises(LeakageError) as e:
        check_leakage(ds, [("short", leaked[:20], None), ("long", leaked[:36], None)], threshold=16)
    said = str(e.value)
    assert "long (36 tokens): rebuild the datastore excluding them" in said
    assert "short (20 tokens): a build keeps out only matches of 32 tokens" in said


def test_info_on_a_token_id_datastore(tmp_path, capsys):
    """The documented datastore for model=tiny (token ids, no corpus or tokenizer in its manifest):
    `harness datastore info` ended in a KeyError."""
    from harness.workloads.datastore import write_datastore

    write_datastore(datastore_from_token_ids([[5, 6, 7, 8], [5, 6, 9]]), tmp_path / "ids")
    assert main(["info", str(tmp_path / "ids")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["corpus"] == "token-ids" and info["n_tokens"] == 9 and info["tokenizer"] is None
    assert info["exclusion_items"] is None and info["max_matches"] == 64


def test_cached_datastore_folders_are_under_the_cache_and_one_per_checkpoint(tmp_path, monkeypatch):
    """A folder of the working directory named as a cached datastore (``stdlib``) was taken for it:
    a run built over it, deleting the user's files. And every ``model=hf`` checkpoint shared one
    folder (``stdlib-hf``). The folder is now always the cache's, named per checkpoint."""
    from harness.workloads.datastore import cached_datastore_dir, datastore_model_key

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stdlib-smollm2").mkdir()
    (tmp_path / "stdlib").mkdir()
    assert cached_datastore_dir("stdlib", model="smollm2") == tmp_path / "cache" / "datastores" / "stdlib-smollm2"
    assert datastore_model_key("tiny") == "tiny" and datastore_model_key("gpt2") == "gpt2"
    (tmp_path / "ckpt" / "a").mkdir(parents=True)
    (tmp_path / "ckpt" / "b").mkdir()
    a, b = datastore_model_key("ckpt/a"), datastore_model_key(str(tmp_path / "ckpt" / "b"))
    assert a.startswith("a-") and b.startswith("b-") and a != datastore_model_key("other/a")
    assert datastore_model_key(str(tmp_path / "ckpt" / "a")) == a  # a folder named relative or absolute: one key
    assert datastore_model_key("owner/name").startswith("name-") and "/" not in datastore_model_key("owner/name")


def test_info_verify_corpus_on_a_token_id_datastore_says_there_is_nothing_to_verify(tmp_path, capsys):
    """A token-id datastore records no corpus: ``verify_corpus=true`` ended in a KeyError (exit 1)."""
    from harness.workloads.datastore import write_datastore

    write_datastore(datastore_from_token_ids([[5, 6, 7, 8], [5, 6, 9]]), tmp_path / "ids")
    assert main(["info", str(tmp_path / "ids"), "verify_corpus=true"]) == 0
    captured = capsys.readouterr()
    info = json.loads(captured.out)
    assert info["corpus_check"] == "not applicable: token ids given directly, no corpus" and not captured.err
    load_datastore(tmp_path / "ids", tokenizer=None, verify_corpus=True)  # nothing to verify: no error
    assert main(["info", str(tmp_path / "ids")]) == 0
    assert json.loads(capsys.readouterr().out)["corpus_check"] == "not applicable: token ids given directly, no corpus"


def test_a_cap_leaves_no_document_as_a_lone_separator(tmp_path):
    """``max_tokens=1`` built an index of one separator (exit 0), and a cut that left a document no
    token added a separator alone: a cut document keeps a token, or is left out."""
    tok = word_tokenizer()
    corpus = _corpus("a b c", "d e")  # 3 tokens + separator, 2 + separator
    with pytest.raises(DatastoreError, match=r"^max_tokens=1 leaves no token of corpus 'inline' to index") as err:
        build_datastore(
            corpus, tokenizer=tok, target_family="toy", max_tokens=1, out_dir=tmp_path / "one", progress=False
        )
    assert "raise max_tokens" in str(err.value) and not (tmp_path / "one").exists()
    a, b, c, d = (ids(w)[0] for w in "a b c d".split())
    for cap, held in (
        (2, [a, SENTINEL]),
        (4, [a, b, c, SENTINEL]),
        (5, [a, b, c, SENTINEL]),  # the second document would keep no token: left out
        (6, [a, b, c, SENTINEL, d, SENTINEL]),
    ):
        ds = build_datastore(corpus, tokenizer=tok, target_family="toy", max_tokens=cap, progress=False)
        assert ds.tokens.tolist() == held, cap
        assert ds.manifest["corpus"]["documents_used"] == held.count(SENTINEL)
        assert ds.manifest["corpus"]["stopped_by_max_tokens"]


def test_cli_builds_and_imports_for_a_tokenizer_with_its_own_code_only_with_trust_remote_code(
    tmp_path, monkeypatch, capsys
):
    """A target whose tokenizer runs code of its own (``model.trust_remote_code=true`` in a run) could
    not be built for: ``trust_remote_code=true`` lets ``build`` and ``import`` load it; without it the
    tokenizer is refused naming that option, before any folder is written; another value, and the
    option beside a built-in model (whose tokenizer runs no checkpoint code), are refused in one line."""
    from test_rest_run import remote_code_checkpoint

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    checkpoint = remote_code_checkpoint(tmp_path / "letters")
    capsys.readouterr()  # what saving the checkpoint printed
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a b c d e f\n")
    out = tmp_path / "ds"
    build = ["build", "corpus=files", f"corpus_path={corpus}", f"model={checkpoint}", "exclude=none", f"out={out}"]
    assert main([*build, "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "set trust_remote_code=true to run it" in err[0], err
    assert not out.exists()
    assert main([*build, "progress=false", "trust_remote_code=true"]) == 0
    built = json.loads(capsys.readouterr().out)
    ds = load_datastore(out, tokenizer=None)
    assert built["release_id"] == ds.release_id and ds.tokens.tolist() == [1, 2, 3, 4, 5, 6, SENTINEL]
    assert ds.manifest["tokenizer"]["class"] == "LetterTokenizer"
    index = _rest_index(tmp_path / "ds.idx", [1, 2, 3, 1, 2, 4])
    imported = ["import", str(index), f"model={checkpoint}", f"out={tmp_path / 'imported'}", "progress=false"]
    assert main([*imported, "trust_remote_code=true"]) == 0
    assert json.loads(capsys.readouterr().out)["n_tokens"] == 7
    for args, said in (
        ([*build, "trust_remote_code=maybe"], "trust_remote_code='maybe': expected true or false"),
        ([*imported, "trust_remote_code=maybe"], "trust_remote_code='maybe': expected true or false"),
        (
            ["build", "corpus=stdlib", "model=smollm2", f"out={tmp_path / 'x'}", "trust_remote_code=true"],
            "trust_remote_code=true: model=smollm2 runs no code from a checkpoint; drop it",
        ),
    ):
        assert main(args) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"harness datastore: refused: {said}"]
    assert not (tmp_path / "x").exists()
    assert main(["build", "--help"]) == 0
    assert capsys.readouterr().out.count("[trust_remote_code=false]") == 2  # build's and import's


def test_an_empty_exclusion_is_refused_naming_the_values(tmp_path, monkeypatch, capsys):
    """``exclude=`` built with no evaluation exclusion at all; ``none`` is how no exclusion is said."""
    import harness.workloads.datastore as datastore_module
    from harness.workloads.datastore import exclusions_for

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    root = tmp_path / "lib"
    root.mkdir()
    (root / "m.py").write_text("a b c d e f\n")
    for spec in ("", " ", ","):
        out = tmp_path / "ds"
        args = ["build", "corpus=files", f"corpus_path={root}", "model=owner/toy", f"exclude={spec}", f"out={out}"]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            "harness datastore: refused: exclude is empty; give humaneval, sharegpt_heldout, none or a .jsonl path "
            "(exclude=none keeps nothing out)"
        ]
        assert not out.exists()
        with pytest.raises(DatastoreError, match=r"^exclude is empty"):
            exclusions_for(spec)
    assert exclusions_for("none") == []


def test_a_build_ended_by_sigterm_leaves_no_half_built_folder_and_exits_143(tmp_path, monkeypatch, capsys):
    """A scheduler's time limit or ``kill`` (SIGTERM) during ``harness datastore build`` ended the
    process where it was: the half-written ``.<name>.<id>.building`` folder stayed beside the cache's
    datastores. Every command now ends on SIGTERM as on Ctrl-C (its clean-up runs), exit 128 + 15."""
    import os
    import signal

    import harness.workloads.datastore as datastore_module
    from harness.cli import main as cli_main

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    root = _user_corpus(tmp_path)
    real = datastore_module.write_datastore
    seen = []

    def terminated(ds, out_dir):
        real(ds, out_dir)
        seen.append(sorted(p.name for p in (tmp_path / "cache" / "datastores").iterdir()))
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(datastore_module, "write_datastore", terminated)
    before = signal.getsignal(signal.SIGTERM)
    args = ["datastore", "build", "corpus=files", f"corpus_path={root}", "model=owner/toy", "progress=false"]
    assert cli_main(args) == 128 + signal.SIGTERM
    assert "harness datastore: terminated (SIGTERM)" in capsys.readouterr().err
    assert any(name.endswith(".building") for name in seen[0]), seen  # the signal came while the folder was half built
    left = sorted(p.name for p in (tmp_path / "cache" / "datastores").iterdir())
    assert not [name for name in left if name.endswith(".building")], left
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_the_process_ignores_stays_ignored_while_a_command_runs():
    """``nohup harness datastore build ...`` ignores SIGHUP; every command's SIGTERM/SIGHUP handling
    replaced that with its own, so closing the terminal ended the build (status 129)."""
    import signal

    from harness.cli import Terminated, signals_interrupt

    before = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals_interrupt():
            signal.raise_signal(signal.SIGHUP)  # ignored, as nohup asked
            with pytest.raises(Terminated):
                signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_cap_the_corpus_fits_exactly_did_not_stop_the_build():
    """``stopped_by_max_tokens`` says the cap ended the build before the corpus did: a corpus that
    fits the cap exactly is whole, and a document after the one that fills it was left out."""
    tok = word_tokenizer()
    corpus = _corpus("a b c", "d e")  # 3 tokens + separator, 2 + separator: 7 in all
    for batch_docs in (32, 1):  # the next document in the same batch, or read from the corpus after it
        for cap, stopped in ((7, False), (8, False), (4, True), (6, True)):
            ds = build_datastore(
                corpus, tokenizer=tok, target_family="toy", max_tokens=cap, batch_docs=batch_docs, progress=False
            )
            held = ds.manifest["corpus"]
            assert held["stopped_by_max_tokens"] is stopped, (batch_docs, cap)
            assert held["documents_used"] == (2 if cap >= 6 else 1) and held["documents_seen"] <= 2
    # a document that follows but leaves nothing to index (excluded) still follows the cap
    excluded = build_datastore(
        _corpus("a b c", "x y z"),
        tokenizer=tok,
        target_family="toy",
        max_tokens=4,
        batch_docs=1,
        exclude=[ExclusionItem("held-out", "x y z")],
        exclusion_window=3,
        progress=False,
    )
    assert excluded.manifest["corpus"]["stopped_by_max_tokens"] is True


def _files_datastore(tmp_path, monkeypatch, capsys):
    """A ``corpus=files`` datastore built by the CLI from the folder ``tmp_path/proj``: (corpus, out)."""
    import harness.workloads.datastore as datastore_module

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "main.txt").write_text("a b c d\n")
    out = tmp_path / "ds"
    args = ["build", "corpus=files", f"corpus_path={proj}", f"out={out}", "model=owner/toy", "exclude=none"]
    assert main([*args, "progress=false"]) == 0
    capsys.readouterr()
    return proj, out


def test_a_files_datastore_whose_corpus_went_opens_unverified_and_says_so(tmp_path, monkeypatch, capsys):
    from harness.proposers.rest import open_datastore
    from harness.workloads.datastore import corpus_check

    proj, out = _files_datastore(tmp_path, monkeypatch, capsys)
    proj.rename(tmp_path / "moved")
    # info verifies nothing by default: it opens, and says the corpus can no longer be read
    assert main(["info", str(out)]) == 0
    said = json.loads(capsys.readouterr().out)["corpus_check"]
    assert said.startswith("not verified: verify_corpus=false") and "can no longer be read" in said, said
    assert "no such file or folder" in said
    # verifying refuses, naming the way to open it unverified, which a run then takes
    assert main(["info", str(out), "verify_corpus=true"]) == 2
    err = capsys.readouterr().err
    assert "cannot be read to verify it" in err and "verify_corpus=false" in err
    ds, info = open_datastore({"path": str(out), "verify_corpus": False}, tokenizer=word_tokenizer(), model="owner/toy")
    assert ds.tokens.tolist() == ids("a b c d") + [SENTINEL]
    assert "can no longer be read" in info["corpus_check"]
    assert corpus_check(ds.manifest, False) == info["corpus_check"]
    # a corpus still in place, unverified: said plainly
    (tmp_path / "moved").rename(proj)
    assert corpus_check(ds.manifest, False) == "not verified: verify_corpus=false"
    assert corpus_check(ds.manifest, True) == "verified"


def test_a_datastore_is_never_built_inside_the_corpus_it_reads(tmp_path, monkeypatch, capsys):
    proj, _ = _files_datastore(tmp_path, monkeypatch, capsys)
    for out in (proj / "datastores" / "mine", proj, proj / "sub" / ".." / "x"):
        args = ["build", "corpus=files", f"corpus_path={proj}", f"out={out}", "model=owner/toy", "exclude=none"]
        assert main([*args, "progress=false"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"out={out} is inside corpus_path={proj.resolve()}" in err[0], err
    assert sorted(p.name for p in proj.iterdir()) == ["main.txt"]  # nothing was written
    # a symlink into the corpus is the corpus too
    (tmp_path / "link").symlink_to(proj, target_is_directory=True)
    link_out = tmp_path / "link" / "ds"
    args = ["build", "corpus=files", f"corpus_path={proj}", f"out={link_out}", "model=owner/toy", "exclude=none"]
    assert main([*args, "progress=false"]) == 2
    assert "is inside corpus_path" in capsys.readouterr().err
    # under a hidden folder the corpus never reads, a datastore may be kept
    hidden = proj / ".cache" / "ds"
    args = ["build", "corpus=files", f"corpus_path={proj}", f"out={hidden}", "model=owner/toy", "exclude=none"]
    assert main([*args, "progress=false"]) == 0
    capsys.readouterr()
    assert main(["info", str(hidden), "verify_corpus=true"]) == 0


def test_a_files_corpus_skips_a_folder_holding_a_datastore(tmp_path):
    """A datastore written under the corpus folder (a library build, a run's cache there) is no text
    of it: the datastore verifies, and a rebuild over it reads the same documents."""
    tok = word_tokenizer()
    proj = tmp_path / "proj"
    (proj / "notes").mkdir(parents=True)
    (proj / "main.txt").write_text("a b c d\n")
    (proj / "notes" / "manifest.json").write_text(json.dumps({"builder_version": "mine/2", "text": "e f"}))
    (proj / "notes" / "n.txt").write_text("g h\n")
    corpus = corpora.FilesCorpus(path=str(proj))
    before = [d.doc_id for d in corpus.documents()]
    assert before == ["main.txt", "notes/manifest.json", "notes/n.txt"]  # another tool's manifest is text
    out = proj / "stores" / "mine"
    ds = build_datastore(corpus, tokenizer=tok, target_family="toy", out_dir=out, exclude=(), progress=False)
    (out / "extra.txt").write_text("x y z\n")  # all a datastore's folder holds is skipped with it
    (out / "deeper").mkdir()
    (out / "deeper" / "more.txt").write_text("x y z\n")
    assert [d.doc_id for d in corpus.documents()] == before
    assert corpus.snapshot() == ds.manifest["corpus"]["snapshot"]
    load_datastore(out, tokenizer=tok, verify_corpus=True)  # its own manifest did not change its corpus
    again = build_datastore(
        corpus, tokenizer=tok, target_family="toy", out_dir=out, exclude=(), progress=False, overwrite=True
    )
    assert again.tokens.tolist() == ds.tokens.tolist()
    # what the datastore builder names its manifest and version by
    import harness.workloads.datastore as datastore_module

    assert datastore_module.BUILDER_VERSION.startswith(corpora.DATASTORE_BUILDER_FAMILY)
    assert datastore_module.MANIFEST_FILE == corpora.DATASTORE_MANIFEST


def test_a_refused_build_or_import_leaves_no_folder_and_no_lock_file(tmp_path, monkeypatch, capsys):
    """A build or import refused for its model's tokenizer leaves neither the folders above ``out``
    nor a ``.<name>.lock`` file: the tokenizer is refused before the folder's lock is taken."""
    import harness.workloads.datastore as datastore_module

    text = tmp_path / "corpus.txt"
    text.write_text("a b c d\n")
    index = _rest_index(tmp_path / "ds.idx", ids("a b c a b d"))
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "new" / "deep" / "ds"
    build = ["build", "corpus=files", f"corpus_path={text}", f"out={out}", "model=owner/toy", "progress=false"]
    imports = ["import", str(index), f"out={out}", "model=owner/toy", "progress=false"]
    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: None)
    for command in (build, imports):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model 'owner/toy' has no tokenizer" in err[0], err
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    assert main(build) == 0  # a build that succeeds keeps its lock file beside the datastore
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "new" / "deep").iterdir()) == [".ds.lock", "ds"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_between_the_renames_of_an_overwrite_puts_the_earlier_datastore_back(
    tmp_path, monkeypatch, capsys, interrupt
):
    """overwrite=true moves the datastore there aside, then renames the new one in: an interrupt
    between the two renames puts the earlier datastore back at its path, whole, and leaves no hidden
    folder beside it."""
    import pathlib

    import harness.workloads.datastore as datastore_module

    monkeypatch.setattr(datastore_module, "load_tokenizer", lambda name: word_tokenizer())
    first = _rest_index(tmp_path / "first.idx", ids("a b c a b d"))
    second = _rest_index(tmp_path / "second.idx", ids("e f g e f"))
    ds = tmp_path / "ds"
    assert main(["import", str(first), "model=owner/toy", f"out={ds}", "progress=false"]) == 0
    release = json.loads(capsys.readouterr().out)["release_id"]
    before = {p.name: p.read_bytes() for p in ds.iterdir()}
    rename = pathlib.Path.rename
    moved = []

    def interrupted(self, target):
        if self.name.endswith(".building"):  # the new datastore's rename into place
            raise interrupt()
        moved.append(self.name)
        return rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", interrupted)
    overwrite = ["import", str(second), "model=owner/toy", f"out={ds}", "overwrite=true", "progress=false"]
    with pytest.raises(interrupt):
        main(overwrite)
    assert moved[0] == "ds"  # the earlier datastore was moved aside before the interrupt
    assert {p.name: p.read_bytes() for p in ds.iterdir()} == before
    assert load_datastore(ds, tokenizer=None).release_id == release
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ds.lock", "ds", "first.idx", "second.idx"]
    monkeypatch.setattr(pathlib.Path, "rename", rename)
    assert main(overwrite) == 0  # uninterrupted, the new datastore takes its place and the earlier one goes
    assert load_datastore(ds, tokenizer=None).release_id == json.loads(capsys.readouterr().out)["release_id"] != release
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ds.lock", "ds", "first.idx", "second.idx"]
