"""``proposer=rest``: retrieval drafting from a datastore (REST, He et al., 2024), with a versioned
index release and evaluation-leakage control.

Per round: search the committed tokens' suffix in the datastore with decreasing ``n``
(``max_suffix`` down to ``min_suffix``), take the continuations of the first ``n`` that has
matches (the datastore's declared match-selection rule and ``max_matches``: past ``max_matches``
matches, a sample spread over all of them in the order of what follows them, so the trie's counts
rank continuations as the whole datastore does), merge them into a trie whose nodes count prefix
frequency, prune to the node budget and linearise.

Semantics are ``frequency``: a node's ``score`` is its prefix count, never ``q``. Trie counts are
corpus statistics, not a proposal law, so negotiation allows greedy and membership verification
and refuses p/q verifiers (rejection, SpecInfer, Sequoia).

Declared orders (also written into every datastore manifest):

* siblings: descending prefix count, then ascending token id;
* pruning (global): rank every trie node of depth <= the round's depth (``max_depth``, or the
  round loop's ``depth_cap`` in a request's last rounds, which verify fewer levels) by descending
  count, then by breadth-first position (siblings in declared order); keep the first
  ``max_nodes``. A child's count never exceeds its parent's and a parent comes first
  breadth-first, so the kept set is closed under prefixes;
* output: kept nodes breadth-first, siblings in declared order (parents precede children).

With ``Budget.shape == "sequence"`` the proposal is the single path that follows the first child
in sibling order from the root; ``tree`` and ``sequences`` (several continuations merged by full
prefix, which is what the trie is) give the pruned trie.

In a run (``harness run proposer=rest``, :meth:`RestProposer.from_config`) the datastore comes from
``proposer.datastore`` (conf/datastore/*.yaml, :func:`open_datastore`): ``path`` names an existing
directory whose release manifest is authoritative; with ``path: null`` the cache directory
``$HARNESS_CACHE/datastores/<corpus>[-build-<digest>]-<model>`` (the digest names build options
other than the defaults, so each setting has its own folder; ``<model>`` is ``model.name``, or for
``model=hf`` its ``model.name_or_path``: a plain hub id as it is, an ``owner/name`` id or a folder
as its last part and a digest of where it is) is loaded, or built there on first use (a
progress-barred stage, capped by ``max_tokens``; at the default 2,000,000-token cap the stdlib
build took 13 CPU-seconds with SmolLM2's tokenizer and holds 24 MB). A datastore built with
another tokenizer, from raw token ids for a target that has a tokenizer, from a changed corpus or
with other build options than the configured ones (a cached one that reads its earliest matches
included) is refused (:class:`DatastoreError`), and so is a folder whose ``manifest.json`` no
datastore build wrote.
``model=tiny`` has no tokenizer (synthetic
ids): it takes a token-id datastore (``datastore_from_token_ids`` + ``write_datastore``) through
``proposer.datastore.path``; nothing is built for it.

Run-time leakage control (:meth:`RestProposer.check_workload`): the longest datastore match of
every evaluation prompt and its tokenized reference answer is measured and recorded; a match of
``leakage_threshold`` (32) tokens or more refuses the run
(:class:`~harness.workloads.datastore.LeakageError`, a ``ValueError``: ``harness run`` reports a
refusal and writes no record) unless ``allow_leakage=true``, which the record then states (the run
is then not gated). ``leakage_threshold`` may be lowered (stricter), never raised above
:data:`~harness.workloads.datastore.LEAKAGE_THRESHOLD`: a longer threshold would pass as gated a
prompt the datastore holds whole. A workload text is looked up as encoded alone and as encoded
after a space and after a newline (:func:`~harness.workloads.corpora.text_encodings`), the longest
match counting: a byte-level BPE tokenizer codes a text's first word apart from what precedes it in
the corpus. The
retrieval counters in ``stats.extras`` (the record's ``metrics.retrieval``: rounds, miss rate,
mean match length, retrieval latency, datastore bytes and release id) restart there and again
after the warm-up request (``Arms.warmup``), so they cover the measured rounds only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from harness.contracts import (
    PREFIX_FRONTIER,
    Budget,
    ProposalNode,
    ProposalResult,
    ProposalStateHandle,
    budget_topology,
)
from harness.files import artifact_lock, temporary_sibling
from harness.heads.artifacts import written_texts
from harness.proposers.base import Proposer
from harness.random_source import RandomSource
from harness.target.loading import checkpoint_fingerprint, checkpoint_ref, load_tokenizer_of
from harness.workloads.corpora import Corpus, FilesCorpus, make_corpus, text_encodings
from harness.workloads.datastore import (
    DEFAULT_CONTEXT_LEN,
    DEFAULT_CONTINUATION_LEN,
    DEFAULT_MAX_MATCHES,
    DEFAULT_MAX_TOKENS,
    LEAKAGE_THRESHOLD,
    MANIFEST_FILE,
    Datastore,
    DatastoreError,
    build_datastore,
    built_exclusion,
    cache_folder_name,
    cached_datastore_dir,
    check_release_manifest,
    corpus_check,
    default_exclusion,
    exclusion_fingerprints,
    exclusions_for,
    foreign_manifest,
    leakage_record,
    load_datastore,
    longest_match,
    match_selection_of,
    read_manifest,
    refuse_leakage,
)


@dataclass
class TrieNode:
    token: int
    count: int = 0
    children: dict[int, TrieNode] = field(default_factory=dict)

    def ordered_children(self) -> list[TrieNode]:
        """Siblings in declared order: descending count, then ascending token id."""
        return sorted(self.children.values(), key=lambda c: (-c.count, c.token))


def build_trie(continuations: Sequence[Sequence[int]]) -> TrieNode:
    """Merge continuations by full prefix; each node counts the continuations through it."""
    root = TrieNode(token=-1)
    for cont in continuations:
        node = root
        node.count += 1
        for tok in cont:
            child = node.children.get(int(tok))
            if child is None:
                child = node.children[int(tok)] = TrieNode(token=int(tok))
            child.count += 1
            node = child
    return root


def linearize_trie(root: TrieNode, *, max_nodes: int, max_depth: int) -> list[tuple[int, int, int]]:
    """Prune (global policy above) and linearise: ``[(token, parent_index, count)]`` breadth-first."""
    if max_nodes < 1 or max_depth < 1:
        raise ValueError(f"max_nodes and max_depth must be >= 1; got {max_nodes}, {max_depth}")
    # breadth-first enumeration, siblings in declared order: (node, parent_bfs, depth)
    bfs: list[tuple[TrieNode, int, int]] = []
    frontier = [(child, PREFIX_FRONTIER, 1) for child in root.ordered_children()]
    while frontier:
        nxt = []
        for node, parent, depth in frontier:
            idx = len(bfs)
            bfs.append((node, parent, depth))
            if depth < max_depth:
                nxt.extend((c, idx, depth + 1) for c in node.ordered_children())
        frontier = nxt
    ranked = sorted(range(len(bfs)), key=lambda i: (-bfs[i][0].count, i))
    kept = sorted(ranked[:max_nodes])  # breadth-first order again
    new_index = {old: new for new, old in enumerate(kept)}
    out = []
    for old in kept:
        node, parent, _ = bfs[old]
        out.append((node.token, PREFIX_FRONTIER if parent == PREFIX_FRONTIER else new_index[parent], node.count))
    return out


def best_path(root: TrieNode, *, max_len: int) -> list[tuple[int, int, int]]:
    """The chain following the first child in sibling order: ``[(token, parent_index, count)]``."""
    out, node = [], root
    while len(out) < max_len and node.children:
        node = node.ordered_children()[0]
        out.append((node.token, len(out) - 1, node.count))
    return out


def ranked_continuations(continuations: Sequence[Sequence[int]]) -> list[Sequence[int]]:
    """``continuations`` best first, as REST's trie ranks them: the depth-first order of their trie
    (:func:`build_trie`'s prefix counts), siblings in declared order (descending count, then
    ascending token id), a continuation that ends at a node before those that go on below it. The
    first runs along :func:`best_path`'s chain (all of it, unless a continuation ends on it),
    identical continuations stay together (in their input order), and every prefix's most frequent
    continuations come before the rarer ones, so a row limit filled continuation by continuation
    keeps the frequent ones. Returns every continuation, reordered. The prefix counts are taken
    once per distinct continuation (with its multiplicity), without the trie's node objects."""
    groups: dict[tuple[int, ...], list[Sequence[int]]] = {}
    for cont in continuations:
        groups.setdefault(tuple(cont), []).append(cont)
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; the root is -1
    count: list[int] = []  # continuations through each node
    paths: dict[tuple[int, ...], list[int]] = {}
    for seq, members in groups.items():
        node, path = -1, []
        for tok in seq:
            nxt = child.get((node, tok))
            if nxt is None:
                nxt = child[node, tok] = len(count)
                count.append(0)
            count[nxt] += len(members)
            path.append(nxt)
            node = nxt
        paths[seq] = path
    order = sorted(groups, key=lambda seq: [(-count[n], tok) for n, tok in zip(paths[seq], seq, strict=True)])
    return [cont for seq in order for cont in groups[seq]]


class RestProposer(Proposer):
    """Retrieval drafting over a :class:`~harness.workloads.datastore.Datastore`."""

    name: ClassVar[str] = "rest"
    probability_semantics: ClassVar[str] = "frequency"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"sequence", "sequences", "tree"})

    def __init__(
        self,
        *,
        budget: Budget,
        manifest_hash: str,
        datastore: Datastore,
        max_suffix: int | None = None,
        min_suffix: int = 1,
        max_matches: int | None = None,
        continuation_len: int | None = None,
        policy=None,
        owns_datastore: bool = True,
    ) -> None:
        super().__init__(budget=budget, manifest_hash=manifest_hash, policy=policy)
        released = release_limits(datastore.manifest)
        self.max_suffix = released["context_len"] if max_suffix is None else int(max_suffix)
        self.max_matches = released["max_matches"] if max_matches is None else int(max_matches)
        self.continuation_len = released["continuation_len"] if continuation_len is None else int(continuation_len)
        self.min_suffix = int(min_suffix)
        check_release_limits(
            {"max_suffix": self.max_suffix, "max_matches": self.max_matches, "continuation_len": self.continuation_len},
            datastore.manifest,
        )
        if not 1 <= self.min_suffix <= self.max_suffix:
            raise ValueError(f"need 1 <= min_suffix <= max_suffix; got {self.min_suffix}, {self.max_suffix}")
        if self.max_matches < 1 or self.continuation_len < 1:
            raise ValueError(
                f"max_matches and continuation_len must be >= 1; got {self.max_matches}, {self.continuation_len}"
            )
        self.datastore = datastore
        # False: another batch slot's proposer opened this index (from_config); its bytes count once
        self.owns_datastore = owns_datastore
        self.source_id = f"rest:{datastore.release_id[:12]}"
        self.stats.proposal_state_bytes = self.state_bytes()
        self.stats.extras.update(
            {
                "datastore_bytes": self.state_bytes(),
                "datastore_release_id": datastore.release_id,
                "datastore_tokens": datastore.n_tokens,
                "datastore_path": None if datastore.path is None else str(datastore.path),
            }
        )
        self.reset_counters()
        # run-time settings (from_config): tokenizer for reference answers, leakage threshold
        self.tokenizer = None
        self.vocab_size: int | None = None
        self.leakage_threshold = LEAKAGE_THRESHOLD

    def counters(self) -> dict:
        """The per-round retrieval counters."""
        return dict(
            {
                "rounds": 0,
                "misses": 0,
                "miss_rate": None,
                "match_len_sum": 0,
                "mean_match_len": None,
                "retrieval_ms_total": 0.0,
                "mean_retrieval_ms": None,
                "max_retrieval_ms": 0.0,
                "trie_ms": 0.0,
                "last_match_len": 0,
                "last_retrieval_ms": 0.0,
            }
        )

    # ------------------------------------------------------------------ run wiring

    @classmethod
    def from_config(cls, *, options: dict, budget: Budget, manifest_hash: str, policy, context) -> RestProposer:
        """Open (or build) ``options["datastore"]`` for the target's tokenizer, then the proposer.

        The proposals carry ``manifest_hash`` folded with the datastore's release id
        (:func:`release_manifest_hash`): a round is only reproducible with the same index.
        """
        opts = dict(options)
        ds_cfg = dict(opts.pop("datastore", None) or {})
        cfg = getattr(context, "cfg", None)
        model = target_reference(cfg) if cfg is not None else "unknown"
        tokenizer = getattr(context, "tokenizer", None)
        backend = getattr(context, "target_backend", None)
        vocab = _vocab_size(backend)
        shared = getattr(context, "shared", None)
        key = ("rest_datastore", json.dumps([ds_cfg, model, vocab], sort_keys=True, default=str))
        owner = shared is None or key not in shared
        if owner:
            ds, info = open_datastore(ds_cfg, tokenizer=tokenizer, model=model, vocab_size=vocab)
            if shared is not None:
                shared[key] = (ds, info)
        else:  # another batch slot of this run opened it: one index in memory, counted once
            ds, first = shared[key]
            info = {**first, "built_now": False, "build_s": None, "load_s": 0.0}
        prop = cls(
            budget=budget,
            manifest_hash=release_manifest_hash(manifest_hash, ds.release_id),
            datastore=ds,
            policy=policy,
            owns_datastore=owner,
            **opts,
        )
        prop.tokenizer, prop.vocab_size = tokenizer, vocab
        prop.leakage_threshold = checked_threshold(ds_cfg.get("leakage_threshold", LEAKAGE_THRESHOLD))
        prop.stats.extras.update(
            {
                "run_manifest_hash": manifest_hash,
                "manifest_hash": prop.manifest_hash,
                "datastore_built_now": info["built_now"],
                "datastore_build_s": info.get("build_s"),
                "datastore_load_s": info["load_s"],
                "datastore_corpus_check": info.get("corpus_check"),
            }
        )
        return prop

    def manifest_extra(self) -> dict:
        """What the run manifest should carry about this proposer's index (its release)."""
        m = self.datastore.manifest
        return {
            "datastore": {
                "release_id": self.datastore.release_id,
                "n_tokens": self.datastore.n_tokens,
                "corpus": m.get("corpus", {}).get("name"),
                "path": None if self.datastore.path is None else str(self.datastore.path),
            }
        }

    def encodings(self, text: str) -> list[list[int]]:
        """A workload text (a user turn, a reference answer) in target token ids as the corpus may
        hold it: the target tokenizer's (no special tokens) alone, after a space and after a newline
        (:func:`~harness.workloads.corpora.text_encodings`), or for a target without one
        (``model=tiny``) the runner's synthetic byte ids ``3 + b % (V - 3)``."""
        return text_encodings(text, tokenizer=self.tokenizer, vocab_size=self.vocab_size or 96)

    def longest_of(self, encodings: Sequence[Sequence[int]]) -> int:
        """The longest datastore match of any of ``encodings`` (each distinct one looked up once)."""
        distinct = {tuple(int(t) for t in ids) for ids in encodings}
        return max((longest_match(self.datastore, ids) for ids in distinct), default=0)

    def check_workload(self, items: list, *, allow_leakage: bool = False) -> dict:
        """Evaluation-leakage gate: longest datastore match of every prompt (each of a conversation's
        user turns) and reference answer.

        ``items``: ``[(Prompt, prompt_ids)]``. A prompt's match is the longest of its ids (what the
        model sees) and of its first turn's texts as written; every text (those, a later user turn,
        the reference answer) is looked up in each of its :meth:`encodings`. Raises
        :class:`~harness.workloads.datastore.LeakageError` (:func:`refuse_leakage`) when one reaches
        ``leakage_threshold`` tokens unless ``allow_leakage``; returns the gate entry (every
        item's match lengths; ``leaked`` and ``allow_leakage`` state what was let through).
        A ``leakage_threshold`` outside ``[1, LEAKAGE_THRESHOLD]`` is refused (``ValueError``).
        Restarts the retrieval counters: everything measured after the gates starts from zero.
        """
        threshold = checked_threshold(self.leakage_threshold)
        texts = []  # (row id, the prompt's encodings, the reference's or None)
        for prompt, ids in items:
            ref = getattr(prompt, "reference", None)
            prompt_id = getattr(prompt, "prompt_id", str(len(texts)))
            first = [list(ids)] + [e for t in written_texts(prompt) or () for e in self.encodings(t)]
            texts.append((prompt_id, first, self.encodings(ref) if ref else None))
            # a conversation's later user turns reach the model too (after its own answers): each is checked
            for k, turn in enumerate((getattr(prompt, "turns", None) or ())[1:], start=2):
                texts.append((f"{prompt_id} turn {k}", self.encodings(turn), None))
        t0 = time.perf_counter()
        records = []
        for prompt_id, prompt_encodings, reference_encodings in texts:
            p = self.longest_of(prompt_encodings)
            r = None if reference_encodings is None else self.longest_of(reference_encodings)
            records.append(leakage_record(self.datastore, prompt_id, p, r, threshold=threshold, allow=allow_leakage))
        seconds = time.perf_counter() - t0
        if not allow_leakage:
            refuse_leakage(
                records,
                threshold=threshold,
                release_id=self.datastore.release_id,
                manifest=_advised_window(self.datastore.manifest),
            )
        leaked = [r for r in records if r["leaked"]]
        longest = max((r["longest_match"] for r in records), default=0)
        entry = {
            # leaked prompts let through by the allow_leakage override leave the run ungated
            "status": "skipped" if leaked else "passed",
            **({"override": "allow_leakage=true"} if leaked else {}),
            "kind": "datastore_leakage",
            "datastore_release_id": self.datastore.release_id,
            "threshold": self.leakage_threshold,
            "prompts": len(items),
            "texts_checked": len(records),  # every prompt's turns (and reference), one row each
            "max_longest_match": longest,
            "leaked": [r["prompt_id"] for r in leaked],
            "allow_leakage": bool(allow_leakage),
            "evidence": (
                f"{len(leaked)} leaked prompt(s) let through by allow_leakage=true"
                if leaked
                else f"every prompt/reference matches < {self.leakage_threshold} tokens"
            ),
            "seconds": seconds,
            "items": records,
        }
        self.stats.extras["leakage"] = {
            k: entry[k] for k in ("threshold", "max_longest_match", "leaked", "allow_leakage")
        }
        self.reset_counters()
        return entry

    def state_bytes(self) -> int:
        """The index's bytes, counted by the slot that opened it (0 for slots sharing it)."""
        return self.datastore.nbytes if self.owns_datastore else 0

    @property
    def miss_rate(self) -> float | None:
        rounds = self.stats.extras["rounds"]
        return None if rounds == 0 else self.stats.extras["misses"] / rounds

    def note_retrieval(self, match_len: int, found: int, retrieval_ms: float) -> None:
        """Count one round's retrieval in the counters: the suffix length it matched, how many rows
        (or continuations) it found (none: a miss) and its time."""
        ex = self.stats.extras
        ex["rounds"] += 1
        ex["misses"] += int(not found)
        ex["match_len_sum"] += match_len
        ex["last_match_len"], ex["last_retrieval_ms"] = match_len, retrieval_ms
        ex["retrieval_ms_total"] += retrieval_ms
        ex["max_retrieval_ms"] = max(ex["max_retrieval_ms"], retrieval_ms)
        ex["miss_rate"] = ex["misses"] / ex["rounds"]
        ex["mean_match_len"] = ex["match_len_sum"] / ex["rounds"]
        ex["mean_retrieval_ms"] = ex["retrieval_ms_total"] / ex["rounds"]

    def retrieve(self, committed: Sequence[int]) -> tuple[int, list[list[int]]]:
        """``(match_len, continuations)`` for the longest matching suffix (``(0, [])`` on a miss).

        A suffix's occurrences continue into occurrences of every shorter suffix, so the longest
        length with any occurrence is found from the shortest up, stopping at the first length that
        has none (a count each, no offsets read: a round's search mostly ends after two or three
        lengths instead of trying every length from the longest down); from there down, the first
        length whose occurrences have a continuation is the match."""
        depth = min(self.continuation_len, self.round_max_depth())  # rows the round can commit
        longest = self.datastore.longest_suffix(committed, min_len=self.min_suffix, max_len=self.max_suffix)
        for n in range(longest, self.min_suffix - 1, -1):
            suffix = committed[len(committed) - n :]
            starts = self.datastore.occurrences(suffix, max_matches=self.max_matches, need_continuation=True)
            if len(starts):
                return n, self.datastore.continuations(starts, offset=n, length=depth)
        return 0, []

    def propose(self, committed: list[int], rng: RandomSource) -> ProposalResult:
        handle = ProposalStateHandle(owner=self.name, committed_len=len(committed))
        # a request's last rounds are compiled to fewer levels (depth_cap): the node budget goes to
        # the rows those levels hold
        depth = self.round_max_depth()
        if depth < 1:  # the round commits the target's own token only: no search, no retrieval counted
            return self.empty_proposal(handle)
        t0 = time.perf_counter()
        match_len, conts = self.retrieve(committed)
        t1 = time.perf_counter()
        root = build_trie(conts)
        if self.budget.shape == "sequence":
            rows = best_path(root, max_len=min(self.budget.max_nodes, depth))
        else:
            rows = linearize_trie(root, max_nodes=self.budget.max_nodes, max_depth=depth)
        nodes = tuple(
            ProposalNode(token_id=tok, parent=parent, score=float(count), source=self.source_id)
            for tok, parent, count in rows
        )
        t2 = time.perf_counter()
        retrieval_ms, trie_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        self.note_retrieval(match_len, len(conts), retrieval_ms)  # a miss: the datastore held no continuation
        self.stats.extras["trie_ms"] += trie_ms
        self.stats.retrieval_ms += retrieval_ms  # decode() reports it as the round's retrieval stage
        extras = {
            "retrieval_ms": retrieval_ms,
            "trie_ms": trie_ms,
            "match_len": match_len,
            "n_matches": len(conts),
            "miss": not conts,
            "datastore_release_id": self.datastore.release_id,
        }
        return ProposalResult(
            nodes=nodes,
            probability_semantics="frequency",
            sampling_relation="deterministic_lookup",
            topology=budget_topology(self.budget),
            state_handle=handle,
            manifest_hash=self.manifest_hash,
            source=self.name,
            extras=extras,
        )


# --------------------------------------------------------------------------------------------
# datastores for runs


def release_manifest_hash(manifest_hash: str, release_id: str) -> str:
    """The run manifest hash folded with a datastore release id (16 hex digits)."""
    return hashlib.sha256(f"{manifest_hash}:datastore:{release_id}".encode()).hexdigest()[:16]


def _vocab_size(backend) -> int | None:
    model = getattr(backend, "model", None)
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    return None if size is None else int(size)


def configured_exclusions(spec, prefix: str = "proposer.datastore") -> list:
    """The texts ``<prefix>.exclude`` names (refused naming the option when it names none)."""
    try:
        return exclusions_for(str(spec))
    except DatastoreError as exc:
        raise DatastoreError(f"{prefix}.{exc}") from None
    except OSError as exc:
        raise DatastoreError(f"{prefix}.exclude={spec}: cannot read {exc.filename or ''} ({exc.strerror})") from None


def _files_state(spec: str) -> tuple:
    """The exclusion files a spec names, as (path, size, mtime): a changed file is read again. The
    spec's parts are read as :func:`exclusions_for` reads them (stripped, each once)."""
    out = []
    for part in dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()):
        if part.endswith(".jsonl") and Path(part).is_file():
            st = Path(part).stat()
            out.append((part, st.st_size, st.st_mtime_ns))
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _configured_fingerprints(spec: str, files: tuple) -> frozenset:
    """The fingerprints of the texts ``spec`` names, read once per process (ShareGPT's held-out
    turns take seconds to read); ``files``: :func:`_files_state`, part of the cache key."""
    return frozenset(exclusion_fingerprints(configured_exclusions(spec)))


#: build options checked against a cached datastore's manifest: (config key, manifest getter)
_BUILD_KEYS = (
    ("corpus", lambda m: m.get("corpus", {}).get("name")),
    ("max_tokens", lambda m: m.get("corpus", {}).get("max_tokens")),
    ("context_len", lambda m: m.get("context_len")),
    ("continuation_len", lambda m: m.get("continuation_len")),
    ("max_matches", lambda m: m.get("match_selection", {}).get("max_matches")),
)


#: a corpus option's value when it is not set (``corpus_path`` has none)
_CORPUS_OPTION_DEFAULTS = {"glob": "**/*", "roles": ["assistant"]}
#: a build option's value when it is not set: left at it beside ``path``, it claims nothing of the
#: datastore there, whatever that was built with
_BUILD_DEFAULTS = {
    "corpus": "stdlib",
    "max_tokens": DEFAULT_MAX_TOKENS,
    "context_len": DEFAULT_CONTEXT_LEN,
    "continuation_len": DEFAULT_CONTINUATION_LEN,
    "max_matches": DEFAULT_MAX_MATCHES,
    "exclude": "humaneval",
    **_CORPUS_OPTION_DEFAULTS,
}


def _unset(node, key: str) -> bool:
    """Whether ``node``'s build option ``key`` holds its value when not set (:data:`_BUILD_DEFAULTS`)."""
    return key in _BUILD_DEFAULTS and _plain(node.get(key)) == _BUILD_DEFAULTS[key]


def path_inert_options(node, prefix: str) -> list[str]:
    """The datastore options (``node``, at ``prefix``) that change nothing, as ``key=value: why``
    (the runner's inert options): a corpus option the configured corpus does not read (``roles``
    for stdlib, ``glob`` outside ``corpus=files``) and, with ``path`` set, every build option its
    manifest states otherwise (the manifest says how it was built, and nothing is built)."""
    out = []
    reads = CORPUS_OPTIONS.get(str(node.get("corpus", "stdlib")), ())
    for key, default in _CORPUS_OPTION_DEFAULTS.items():
        value = node.get(key)
        if key not in reads and value is not None and _plain(value) != default:
            out.append(f"{prefix}.{key}={_override(value)}: corpus={node.get('corpus')} does not read it")
    path = node.get("path")
    if path is None and str(node.get("corpus")) == "files":
        out += _unread_file_options(node, prefix)
    if path is None or not (Path(str(path)) / MANIFEST_FILE).is_file() or foreign_manifest(Path(str(path))):
        return out  # no path, or one that is refused when opened
    manifest = read_manifest(Path(str(path)))
    why = f"the datastore at {path} was built with {{}} (its manifest decides; nothing is built)"
    out += [
        f"{prefix}.{key}={node.get(key)}: " + why.format(f"{key}={'null' if get(manifest) is None else get(manifest)}")
        for key, get in _BUILD_KEYS
        if key in node and node.get(key) != get(manifest) and not _unset(node, key)
    ]
    source = manifest.get("corpus", {}).get("source") or {}
    for key, built in (
        ("corpus_path", source.get("path")),
        ("glob", source.get("glob")),
        ("roles", source.get("roles")),
    ):
        value = node.get(key)
        if (
            key in reads
            and value is not None
            and not _unset(node, key)
            and _plain(value) != built
            and not (
                key == "corpus_path" and built is not None and str(Path(str(value)).expanduser().resolve()) == built
            )
        ):
            shown = "unset" if built is None else f"{key}={_override(built)}"
            out.append(f"{prefix}.{key}={_override(value)}: " + why.format(shown))
    if node.get("exclude") is not None and not _unset(node, "exclude"):
        spec, built = built_exclusion(manifest)
        if spec is not None and spec != str(node.get("exclude")):
            out.append(f"{prefix}.exclude={node.get('exclude')}: " + why.format(f"exclude={spec}"))
        elif spec is None and _configured_fingerprints(str(node.exclude), _files_state(str(node.exclude))) != built:
            out.append(f"{prefix}.exclude={node.get('exclude')}: " + why.format(f"{len(built)} other texts excluded"))
    return out


def _unread_file_options(node, prefix: str) -> list[str]:
    """``corpus=files`` options its ``corpus_path`` gives nothing to: ``glob`` for a single file,
    ``roles`` where no ``.jsonl`` file is read (roles pick the turns of conversation lines)."""
    try:
        corpus = configured_corpus(node, prefix)
        files = corpus.files()
    except DatastoreError:
        return []  # refused when the datastore is opened
    out = []
    glob, roles = node.get("glob"), node.get("roles")
    if Path(corpus.path).is_file() and glob is not None and glob != _CORPUS_OPTION_DEFAULTS["glob"]:
        out.append(f"{prefix}.glob={glob}: corpus_path is one file, not a folder")
    if (
        roles is not None
        and _plain(roles) != _CORPUS_OPTION_DEFAULTS["roles"]
        and not any(f.suffix == ".jsonl" for f in files)
    ):
        out.append(f"{prefix}.roles={_override(roles)}: no .jsonl file is read, so there are no conversation turns")
    return out


#: each corpus's options beyond its name (datastore config keys; ``roles`` read by conversation corpora)
CORPUS_OPTIONS = {"stdlib": (), "sharegpt": ("roles",), "files": ("corpus_path", "glob", "roles")}


def configured_corpus(cfg: dict, prefix: str = "proposer.datastore") -> Corpus:
    """The corpus ``cfg`` (a datastore config) names, with its options; refused (naming the
    option) when ``corpus_path`` is given to a corpus that does not read it, or the corpus cannot be
    opened (a missing path, bad roles)."""
    name = str(cfg.get("corpus", "stdlib"))
    if cfg.get("corpus_path") is not None and name != "files":
        raise DatastoreError(
            f"{prefix}.corpus_path is read with corpus=files; corpus={name} (set {prefix}.corpus=files)"
        )
    if name == "files" and cfg.get("corpus_path") is None:
        raise DatastoreError(
            f"{prefix}.corpus=files needs {prefix}.corpus_path: a folder, a text file or a .jsonl file"
        )
    options = {}
    for key in CORPUS_OPTIONS.get(name, ()):
        if cfg.get(key) is not None:
            options["path" if key == "corpus_path" else key] = tuple(cfg[key]) if key == "roles" else str(cfg[key])
    try:
        corpus = make_corpus(name, **options)
        if isinstance(corpus, FilesCorpus):
            corpus.files()  # a folder with nothing to read is refused now, not after the tokenizer loads
        return corpus
    except ValueError as exc:
        raise DatastoreError(f"{prefix}.{exc}") from None  # each corpus names its option first


def build_command(cfg: dict, model: str, **extra) -> str:
    """The ``harness datastore build`` line that builds what ``cfg`` configures."""
    name = str(cfg.get("corpus", "stdlib"))
    parts = [f"corpus={name}"]
    for key in CORPUS_OPTIONS.get(name, ()):
        value = cfg.get(key)
        if (
            value is not None
            and not (key == "glob" and value == "**/*")
            and not (key == "roles" and list(value) == ["assistant"])
        ):
            parts.append(f"{key}={','.join(value) if key == 'roles' else value}")
    parts.append(f"model={model}")
    parts += [f"{k}={v}" for k, v in extra.items()]
    return "harness datastore build " + " ".join(parts)


def _plain(value):
    """A config value as plain Python (a list node as a list)."""
    from omegaconf import OmegaConf  # configs only: the proposer itself runs without omegaconf

    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _override(value) -> str:
    """A config value as an override spells it."""
    value = _plain(value)
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, (list, tuple)) else str(value)


#: the options a build reads beyond the corpus's, as ``harness datastore build`` takes them
_BUILD_OPTIONS = ("max_tokens", "context_len", "continuation_len", "max_matches", "exclude")


def cache_datastore_path(cfg: dict, corpus: Corpus, model: str) -> Path:
    """Where the datastore ``cfg`` configures (``path`` null) is cached: named by its corpus and by
    the build options that differ from their defaults (:func:`cache_folder_name`), as
    ``harness datastore build`` names it."""
    return cached_datastore_dir(
        cache_folder_name(corpus, exclude=str(cfg.get("exclude", "none")), **_build_sizes(cfg)), model=model
    )


def target_reference(cfg) -> str:
    """The target as ``harness datastore build model=`` names it: a built-in model's name, or a
    checkpoint's folder or hub id (``model.name_or_path`` of ``model=hf``)."""
    name = str(cfg.model.name)
    return str(cfg.model.name_or_path) if name == "hf" and cfg.model.get("name_or_path") else name


def _build_sizes(cfg: dict) -> dict:
    """The sizes a build of ``cfg`` reads (the cap and the index's limits): one reading for the
    build and for the name of its cache folder."""
    max_tokens = cfg.get("max_tokens")
    return {
        "max_tokens": None if max_tokens is None else int(max_tokens),
        "context_len": int(cfg.get("context_len", 16)),
        "continuation_len": int(cfg.get("continuation_len", 8)),
        "max_matches": int(cfg.get("max_matches", 64)),
    }


def _earlier_rule(path: Path) -> str | None:
    """The match-selection rule of the cached datastore at ``path`` where it is one this harness no
    longer builds (its earliest matches: ``lowest_offsets``), else None. The cache is the harness's
    own folder, so such a build is replaced; one given by ``proposer.datastore.path`` keeps its rule."""
    if not (path / MANIFEST_FILE).is_file() or foreign_manifest(path):
        return None
    try:
        selection = match_selection_of(read_manifest(path))
    except DatastoreError:
        return None  # refused when it is opened, with its own reason
    return selection if selection not in (None, "spread") else None


def _build_into(path: Path, cfg: dict, *, tokenizer, model: str, prefix: str = "proposer.datastore") -> float:
    """Build the configured datastore into ``path`` (via a temporary directory no other process
    names, renamed into place, so concurrent jobs never see a half-written index). The caller
    holds its lock. Returns seconds."""

    corpus = configured_corpus(cfg, prefix)
    exclusions = configured_exclusions(cfg.get("exclude", "none"), prefix)  # a bad exclusion is refused first
    max_tokens = cfg.get("max_tokens")
    print(
        f"harness run: building REST datastore {corpus.name!r} for {model!r} into {path} "
        f"(max_tokens={max_tokens}; once, then cached)",
        file=sys.stderr,
    )
    exclude, own = str(cfg.get("exclude", "none")), default_exclusion(corpus.name)
    if exclude != own:  # e.g. corpus=sharegpt over the stdlib config's exclude=humaneval
        print(
            f"harness run: note: {prefix}.exclude={exclude} keeps out other texts than corpus={corpus.name}'s own "
            f"default (exclude={own}, as `harness datastore build corpus={corpus.name}` builds it)",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    tmp = temporary_sibling(path, "building")
    try:
        build_datastore(
            corpus,
            tokenizer=tokenizer,
            target_family=model,
            out_dir=tmp,
            **_build_sizes(cfg),
            exclude=exclusions,
            exclude_spec=str(cfg.get("exclude", "none")),
            progress=True,
        )
        if path.exists():  # no manifest (a build that never finished), or a cached build of an earlier rule
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return time.perf_counter() - t0


#: datastores built by this process and not yet opened again: a job builds its datastore when its
#: manifest is frozen (before any model work), then its proposer opens it; that open reports the build
_BUILT_BY_THIS_JOB: dict[str, float] = {}


def forget_datastore_builds() -> None:
    """Forget the builds no proposer opened: a job that fails between its manifest's freeze (which
    built a datastore) and its proposer's open leaves none for the next job of its process to report
    as built by it."""
    _BUILT_BY_THIS_JOB.clear()


def open_datastore(
    cfg: dict,
    *,
    tokenizer,
    model: str,
    vocab_size: int | None = None,
    build: bool = True,
    prefix: str = "proposer.datastore",
) -> tuple[Datastore, dict]:
    """The datastore ``proposer.datastore`` (``cfg``) names, checked against the target.

    ``path`` set: that directory (must exist; its release manifest is authoritative). ``path``
    null: ``$HARNESS_CACHE/datastores/<corpus>[-build-<digest>]-<model>``
    (:func:`cache_datastore_path`), built there when absent (with ``build``) and otherwise checked
    against the configured build options. Refuses (raises :class:`DatastoreError`) another
    tokenizer, a token-id datastore for a target with a tokenizer (or the reverse), token ids
    outside the target vocabulary, a changed corpus and a checksum mismatch. Returns
    ``(datastore, info)`` with ``built_now``, ``build_s``, ``load_s`` and ``corpus_check``
    (:func:`corpus_check`).
    """
    explicit = cfg.get("path")
    info: dict = {"built_now": False, "build_s": None}
    if explicit is not None and not str(explicit).strip():
        raise DatastoreError(
            f"{prefix}.path is empty: give a datastore folder, or null to build into the cache on first use"
        )
    if explicit is not None:
        path = Path(str(explicit))
        if path.is_file():  # a build into it would be refused too: no command to offer
            raise DatastoreError(
                f"{prefix}.path={str(path)!r} is a file; a datastore is a folder (give one, or set {prefix}.path=null "
                "to build into the cache on first use)"
            )
        other = foreign_manifest(path)
        if other:  # a trained artifact's folder, the user's: nothing is read as a datastore, or built over it
            remedy = (
                "write a token-id datastore into a new folder (harness.workloads.datastore.datastore_from_token_ids "
                "+ write_datastore)"
                if tokenizer is None
                else f"build one into a new folder (`{build_command(cfg, model, out='NEW_DIR')}`), or set "
                f"{prefix}.path=null to build into the cache on first use"
            )
            raise DatastoreError(
                f"{prefix}.path={str(path)!r} is not a datastore: its {MANIFEST_FILE} is {other}: give a datastore "
                f"folder, or {remedy}"
            )
        if not (path / MANIFEST_FILE).is_file() and path.is_dir() and any(path.iterdir()):
            raise DatastoreError(
                f"{prefix}.path={str(path)!r} is not a datastore ({MANIFEST_FILE} missing) and holds other files: "
                f"give a datastore folder, build one into a new folder (`{build_command(cfg, model, out='NEW_DIR')}`), "
                f"or set {prefix}.path=null to build into the cache on first use"
            )
        if not (path / MANIFEST_FILE).is_file():
            if tokenizer is None:  # no corpus can be tokenized for it: only a token-id datastore serves
                raise DatastoreError(
                    f"{prefix}.path={str(path)!r} is not a datastore ({MANIFEST_FILE} missing), and "
                    f"model={model!r} has no tokenizer to build one from a corpus: write a token-id datastore there "
                    "(harness.workloads.datastore.datastore_from_token_ids + write_datastore)"
                )
            raise DatastoreError(
                f"{prefix}.path={str(path)!r} is not a datastore ({MANIFEST_FILE} missing). Build it with "
                f"`{build_command(cfg, model, out=path)}`, or set "
                f"{prefix}.path=null to build into the cache on first use."
            )
    else:
        corpus = configured_corpus(cfg, prefix)
        path = cache_datastore_path(cfg, corpus, model)
        outdated = _earlier_rule(path)
        if not (path / MANIFEST_FILE).is_file() or outdated:
            if tokenizer is None:
                raise DatastoreError(
                    f"model={model!r} has no tokenizer (synthetic token ids), so no corpus datastore can be built "
                    "for it: write a token-id datastore (harness.workloads.datastore.datastore_from_token_ids + "
                    f"write_datastore) and pass {prefix}.path=<dir>."
                )
            if not build:
                options = {k: cfg.get(k) for k in _BUILD_OPTIONS if k in cfg}
                if outdated:
                    raise DatastoreError(
                        f"the datastore at {str(path)!r} reads its {outdated} matches, a rule this harness no longer "
                        f"builds; build it again with `{build_command(cfg, model, **options, overwrite=True)}`"
                    )
                raise DatastoreError(
                    f"no datastore at {str(path)!r}; build it with `{build_command(cfg, model, **options)}`"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            # jobs starting together build once: the others wait here, then load the first's build
            if outdated:
                print(
                    f"harness run: note: the cached datastore {str(path)!r} reads its {outdated} matches, a rule "
                    "this harness no longer builds: it is built again",
                    file=sys.stderr,
                )
            with artifact_lock(path, purpose=f"building REST datastore {path.name}"):
                if not (path / MANIFEST_FILE).is_file() or _earlier_rule(path):
                    info["build_s"] = _build_into(path, cfg, tokenizer=tokenizer, model=model, prefix=prefix)
                    info["built_now"] = True
                    _BUILT_BY_THIS_JOB[str(path)] = info["build_s"]
        if not info["built_now"] and str(path) in _BUILT_BY_THIS_JOB:  # built when the manifest was frozen
            info.update(built_now=True, build_s=_BUILT_BY_THIS_JOB.pop(str(path)))

    def refused(exc: DatastoreError) -> DatastoreError:
        """``exc``; where a rebuild of a cached datastore mends it, naming the command that does."""
        if explicit is not None or exc.rebuild is None:
            return exc
        # a cached datastore is built from these options: the refusal names the line that rebuilds it
        rebuild = build_command(cfg, model, **{k: cfg.get(k) for k in _BUILD_OPTIONS if k in cfg}, overwrite="true")
        return DatastoreError(str(exc).replace(exc.rebuild, f"{exc.rebuild} with `{rebuild}`", 1))

    t0 = time.perf_counter()
    try:
        manifest = check_release_manifest(path, read_manifest(path))
    except DatastoreError as exc:
        raise refused(exc) from None
    built_with = manifest.get("tokenizer")
    if tokenizer is None and built_with is not None:
        raise DatastoreError(
            f"datastore {str(path)!r} was built with tokenizer {built_with.get('name_or_path')!r} "
            f"({str(built_with.get('fingerprint'))[:16]}...); model={model!r} has no tokenizer (synthetic token "
            "ids), so its spans would be wrong: write a token-id datastore (harness.workloads.datastore."
            f"datastore_from_token_ids + write_datastore) and pass {prefix}.path=<dir>."
        )
    if tokenizer is not None and built_with is None:
        raise DatastoreError(
            f"datastore {str(path)!r} holds raw token ids with no tokenizer fingerprint "
            f"(corpus {manifest.get('corpus', {}).get('name')!r}); the target {model!r} has a tokenizer: rebuild "
            f"it with `harness datastore build corpus=... model={model}`."
        )
    if explicit is None:
        diff = [
            (key, cfg.get(key), get(manifest))
            for key, get in _BUILD_KEYS
            if key in cfg and cfg.get(key) != get(manifest)
        ]
        built_from = manifest.get("corpus", {}).get("source")
        if built_from is not None and built_from.get("name") == corpus.name and built_from != corpus.describe():
            diff.append(("corpus source", corpus.describe(), built_from))
        selection = match_selection_of(manifest)
        if selection not in (None, "spread"):  # a build spreads its matches (a rule not applied here: refused on load)
            diff.append(("match selection", "spread", selection))
        if "exclude" in cfg:  # the evaluation texts kept out at build time, compared item by item
            spec, built = built_exclusion(manifest)
            if _configured_fingerprints(str(cfg["exclude"]), _files_state(str(cfg["exclude"]))) != built:
                if spec == str(cfg["exclude"]):  # the same files, edited since the build
                    spec = f"{spec} as it read then (the exclusion file changed since)"
                diff.append(("exclude", cfg["exclude"], spec if spec is not None else f"<{len(built)} items>"))
        if diff:
            said = ", ".join(f"{k}: config {want!r} vs built {got!r}" for k, want, got in diff)
            # every option the build reads, as configured: following the line ends the refusal
            rebuild = build_command(cfg, model, **{k: cfg.get(k) for k in _BUILD_OPTIONS if k in cfg}, overwrite="true")
            raise DatastoreError(
                f"the cached datastore {str(path)!r} was built with other options ({said}). Rebuild it with "
                f"`{rebuild}`, use it as built ({prefix}.path={path}: its manifest decides), or point "
                f"{prefix}.path at another datastore."
            )
    verify = bool(cfg.get("verify_corpus", True)) and built_with is not None
    try:
        ds = load_datastore(path, tokenizer=tokenizer, verify_corpus=verify)
    except DatastoreError as exc:
        raise refused(exc) from None
    info["corpus_check"] = corpus_check(manifest, verify)
    if vocab_size is not None and ds.n_tokens:
        top = int(ds.tokens.max())
        if top >= vocab_size:
            raise DatastoreError(
                f"datastore {str(path)!r} holds token id {top}, outside the target vocabulary "
                f"[0, {vocab_size}): it was built for another model"
            )
    info["load_s"] = time.perf_counter() - t0
    return ds, info


#: the shortest committed suffix prompt lookup searches its datastore with (``proposer.datastore``
#: of ``proposer=prompt_lookup``; not an option)
LOOKUP_MIN_SUFFIX = 2


def checked_threshold(value) -> int:
    """``leakage_threshold`` as an int in ``[1, LEAKAGE_THRESHOLD]``: it may be lowered (a shorter
    match refuses: stricter), never raised, which would let a prompt the datastore holds whole pass
    as gated (``allow_leakage=true`` is how a leaked workload runs, ungated). Anything else raises
    ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LEAKAGE_THRESHOLD:
        raise ValueError(
            f"leakage_threshold={value!r} is out of range: it must be a whole number from 1 to "
            f"{LEAKAGE_THRESHOLD} (a match that long refuses the run; allow_leakage=true runs a leaked "
            "workload, ungated)"
        )
    return value


def _advised_window(manifest: dict) -> dict:
    """``manifest`` as :func:`refuse_leakage` reads it for its advice, its exclusion window capped at
    :data:`LEAKAGE_THRESHOLD`: a leaked match shorter than the window is advised to be let through by
    raising ``leakage_threshold`` to it, and the threshold goes no higher; a longer match is advised
    a rebuild (a build's standard window keeps it out)."""
    exclusion = manifest.get("exclusion") or {}
    window = exclusion.get("window_tokens")
    if not isinstance(window, int) or window <= LEAKAGE_THRESHOLD:
        return manifest
    return {**manifest, "exclusion": {**exclusion, "window_tokens": LEAKAGE_THRESHOLD}}


def release_limits(manifest: dict) -> dict[str, int]:
    """What a datastore release was built to serve: suffixes up to ``context_len``, ``max_matches``
    continuations of ``continuation_len`` tokens."""
    return {
        "context_len": int(manifest.get("context_len", 16)),
        "max_matches": int(manifest.get("match_selection", {}).get("max_matches", 64)),
        "continuation_len": int(manifest.get("continuation_len", 8)),
    }


def check_release_limits(options: dict, manifest: dict, prefix: str = "proposer") -> None:
    """Refuse REST options (``max_suffix``, ``max_matches``, ``continuation_len``; None: the
    release's) above what the release serves (:func:`release_limits`)."""
    released = release_limits(manifest)
    for key in ("max_suffix", "max_matches", "continuation_len"):
        value = options.get(key)
        limit_key = "context_len" if key == "max_suffix" else key
        if value is not None and int(value) > released[limit_key]:
            raise DatastoreError(
                f"{prefix}.{key}={value} exceeds the datastore release's {limit_key}={released[limit_key]}; "
                "rebuild the datastore or lower it"
            )


def datastore_sources(cfg) -> dict:
    """The datastores a composed config's proposer searches, by source: ``{source: (datastore
    node, the options node of the proposer that searches it, its prefix)}``. ``rest`` for
    ``proposer=rest`` or a ``proposer=merged`` with ``rest`` among its sources, ``prompt_lookup``
    for ``proposer=prompt_lookup`` or a merged ``prompt_lookup`` source whose ``datastore`` is set;
    ``{}`` when the proposer searches none."""
    p = cfg.proposer
    out = {}
    if p.name == "rest":
        out["rest"] = (p.datastore, p, "proposer")
    elif p.name == "prompt_lookup" and p.get("datastore") is not None:
        out["prompt_lookup"] = (p.datastore, p, "proposer")
    elif p.name == "merged":
        sources = list(p.get("sources") or [])
        if "rest" in sources:
            out["rest"] = (p.rest.datastore, p.rest, "proposer.rest")
        if "prompt_lookup" in sources and p.prompt_lookup.get("datastore") is not None:
            out["prompt_lookup"] = (p.prompt_lookup.datastore, p.prompt_lookup, "proposer.prompt_lookup")
    return out


def check_lookup_release(ds_cfg: dict, manifest: dict | None, *, prefix: str, model: str, token_ids: bool) -> None:
    """Refuse a datastore prompt lookup (at ``prefix``) cannot search: one that serves suffixes
    shorter than :data:`LOOKUP_MIN_SUFFIX` (its ``context_len``). ``ds_cfg``: the datastore's
    config; ``manifest``: its release manifest, or None before it is built (the configured
    ``context_len`` is what the build would release); ``token_ids``: the target has no tokenizer
    (a token-id datastore is written, not built). The refusal says how to get one that serves it."""
    least = LOOKUP_MIN_SUFFIX
    if manifest is None:
        context_len, where = int(ds_cfg.get("context_len", DEFAULT_CONTEXT_LEN)), "is configured"
    else:
        context_len, where = release_limits(manifest)["context_len"], "was released"
        if ds_cfg.get("path") is not None:
            where = f"{str(ds_cfg['path'])!r} {where}"
    if context_len >= least:
        return
    if token_ids:
        remedy = (
            f"write one with datastore_from_token_ids(..., context_len={least}) + write_datastore and pass "
            f"{prefix}.datastore.path=<dir>"
        )
    elif ds_cfg.get("path") is None:
        remedy = f"set {prefix}.datastore.context_len={least} or more (built into the cache on first use)"
    else:
        path = ds_cfg["path"]
        remedy = (
            f"rebuild it with context_len={least} or more (`harness datastore info {path}` says what it was built "
            f"from; `harness datastore build ... model={model} context_len={least} out={path} overwrite=true`)"
        )
    raise DatastoreError(
        f"{prefix}.datastore {where} with context_len={context_len}: it serves suffixes of at most {context_len} "
        f"token(s), and prompt lookup searches a datastore with suffixes of {least} tokens or more; {remedy}"
    )


def _plain_resolved(node) -> dict:
    """A config node as a plain dict, interpolations resolved."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)


def target_revision(cfg) -> str | None:
    """The hub commit the run manifest binds the target to (``target_checkpoint.revision``, from
    :func:`~harness.target.loading.checkpoint_fingerprint`), whose files the run's tokenizer is read
    at; None for a built-in model, a checkpoint folder, or a hub id no commit was found for."""
    ref = checkpoint_ref(cfg.model)
    return None if ref is None else checkpoint_fingerprint(ref).get("revision")


def manifest_datastores(cfg) -> dict:
    """The datastore releases a composed config's proposer uses, for the run manifest.

    Opens (building on first use, a tokenizer-only stage) every datastore :func:`datastore_sources`
    names (``proposer=rest``'s, ``proposer=prompt_lookup``'s, each ``proposer=merged`` source's)
    before any model is loaded, refuses what a release cannot serve (:func:`check_release_limits`,
    :func:`check_lookup_release`), and returns
    ``{"datastores": {source: {release_id, corpus, n_tokens, path}}}`` (``{}`` when the proposer
    uses none). Passed as ``freeze_manifest(cfg, versions=..., extra=manifest_datastores(cfg))``
    it puts each release id into the manifest hash; call it after negotiation (``plan``). The
    tokenizer is the one the run loads: ``model.trust_remote_code`` honoured, a hub id read at the
    commit the manifest binds (:func:`target_revision`).
    """
    nodes = datastore_sources(cfg)
    if not nodes:
        return {}

    model = target_reference(cfg)
    tokenizer = load_tokenizer_of(cfg.model, revision=target_revision(cfg))
    out = {}
    for source, (node, opts, prefix) in nodes.items():
        ds_cfg = _plain_resolved(node)
        lookup = {"prefix": prefix, "model": model, "token_ids": tokenizer is None}
        if source == "prompt_lookup" and ds_cfg.get("path") is None:  # before a build it could not search
            check_lookup_release(ds_cfg, None, **lookup)
        ds, _ = open_datastore(ds_cfg, tokenizer=tokenizer, model=model, prefix=f"{prefix}.datastore")
        # before any model work: what the release cannot serve
        if source == "rest":
            check_release_limits(
                {k: opts.get(k) for k in ("max_suffix", "max_matches", "continuation_len")},
                ds.manifest,
                prefix,
            )
        else:
            check_lookup_release(ds_cfg, ds.manifest, **lookup)
        out[source] = {
            "release_id": ds.release_id,
            "corpus": ds.manifest.get("corpus", {}).get("name"),
            "n_tokens": ds.n_tokens,
            "path": None if ds.path is None else str(ds.path),
        }
    return {"datastores": out}
