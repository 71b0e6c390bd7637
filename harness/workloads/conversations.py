"""Token ids of every turn of a workload prompt, and the context limit each turn must fit.

A prompt is a conversation of one or more user turns (Spec-Bench's MT-bench categories have two).
Turn k's prompt is the conversation so far through the tokenizer's chat template: the user turns
1..k with the arm's OWN answers to turns 1..k-1 between them, as MT-bench does (Zheng et al.,
2023): each answer's text (special tokens removed, whitespace stripped; under
``workload.chat_template=vicuna`` cut at its first ``</s>``, as Spec-Bench's eval.py cuts it) goes
back as the assistant message, and every turn is a full prefill of the conversation. A model
without a tokenizer (``model=tiny``) uses synthetic ids: a text's bytes as ``3 + b % (V - 3)``, and
a conversation as each user turn's byte ids followed by the answer's token ids (EOS ids removed).
Nothing is cut silently: a synthetic prompt is as long as its text.

Context limit. A turn's prompt plus ``generation.max_new_tokens`` plus the largest candidate tree
(the ``topology.max_nodes`` rows a verify forward appends) must fit the position limit of the
target and of a separate draft model. ``workload.truncate`` declares what happens when it does
not: ``false`` refuses before any model work with one line naming the prompt and the numbers (a
conversation's later turns are bounded by counting each earlier answer at ``max_new_tokens``);
``left`` cuts the oldest text: through a chat template, the template's opening (its system blocks and
the first message's header) stays and the start of that message's text goes, so the model still
reads a conversation; where that text is shorter than the cut, the oldest messages go whole (a later
turn's earlier exchanges, question and answer; a ``messages`` prompt's earlier messages, up to a user
message, system messages kept) and the rest is rendered again, down to the last user message alone,
whose text is then cut as the first message's is. Without a template, or where the opening alone
would take half the room and no whole message can go, the first tokens go.
The record says, per prompt and turn, how many tokens were cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.target.loading import CHAT_TEMPLATE_OPTION
from harness.workloads.prompts import Prompt, WorkloadError, load_configured

TRUNCATE_LEFT = "left"
TRUNCATE_REFUSE = "refuse"


def truncate_rule(value) -> str:
    """``workload.truncate`` as ``left`` or ``refuse`` (``false``, ``none`` or ``refuse``)."""
    v = "false" if value is None else str(value).strip().lower()
    if v == TRUNCATE_LEFT:
        return TRUNCATE_LEFT
    if v in {"false", "none", "no", "off", "0", "", TRUNCATE_REFUSE}:
        return TRUNCATE_REFUSE
    given = str(value).lower() if isinstance(value, bool) else repr(value)  # YAML's true, as typed
    raise WorkloadError(f"workload.truncate must be left or false; got {given}")


@dataclass(frozen=True)
class ContextLimit:
    """What every turn's prompt must fit: ``positions - max_new_tokens - tree_rows`` tokens."""

    positions: int | None  # the smallest position limit of the models that see the prompt (None: unknown)
    limited_by: str  # which model sets it, e.g. "the target (model=smollm2)"
    max_new_tokens: int
    tree_rows: int  # candidate rows a verify forward appends (at most topology.max_nodes)
    rule: str = TRUNCATE_REFUSE

    @property
    def max_prompt_tokens(self) -> int | None:
        return None if self.positions is None else self.positions - self.max_new_tokens - self.tree_rows

    def check_config(self) -> None:
        """Refuse a generation budget that leaves no room for any prompt."""
        room = self.max_prompt_tokens
        if room is not None and room < 1:
            raise WorkloadError(
                f"generation.max_new_tokens={self.max_new_tokens} + {self.tree_rows} candidate rows "
                f"(the most a round verifies) leave no room for a prompt in the {self.positions:,} positions of "
                f"{self.limited_by}"
            )

    def overflow(self, prompt: Prompt, turn: int, tokens: int, *, bounded: bool = False) -> str:
        """One line: the prompt, its turn and the numbers that do not fit."""
        how = f" (each earlier answer counted at generation.max_new_tokens={self.max_new_tokens})" if bounded else ""
        total = tokens + self.max_new_tokens + self.tree_rows
        return (
            f"prompt {prompt.prompt_id!r} turn {turn}: {tokens:,} prompt tokens{how} + generation.max_new_tokens="
            f"{self.max_new_tokens} + {self.tree_rows} candidate rows (the most a round verifies) = {total:,} > "
            f"{self.positions:,} positions of {self.limited_by}; workload.truncate=left cuts the oldest text, "
            "keeping a chat template's opening (recorded per prompt)"
        )

    def summary(self) -> dict:
        return {
            "rule": self.rule,
            "positions": self.positions,
            "limited_by": self.limited_by,
            "max_new_tokens": self.max_new_tokens,
            "tree_rows": self.tree_rows,
            "max_prompt_tokens": self.max_prompt_tokens,
        }


def context_limit(
    *, limits: Sequence[tuple[str, int | None]], max_new_tokens: int, tree_rows: int, rule: str
) -> ContextLimit:
    """The tightest of ``limits`` (``(model description, positions or None)``)."""
    known = [(n, who) for who, n in limits if n is not None]
    if not known:
        who = " and ".join(w for w, _ in limits) or "the target"
        return ContextLimit(None, f"{who} (position limit unknown)", max_new_tokens, tree_rows, rule)
    n, who = min(known, key=lambda x: x[0])
    return ContextLimit(int(n), who, int(max_new_tokens), int(tree_rows), rule)


@dataclass(frozen=True)
class TurnPrompt:
    """One turn's prompt ids as fed to the model, and how long it was before any cut."""

    ids: list[int]
    prompt_tokens: int

    @property
    def cut_tokens(self) -> int:
        return self.prompt_tokens - len(self.ids)


def _ids(out) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


#: FastChat's Vicuna v1.1 conversation (Zheng et al., 2023): its system line, then ``USER: <question>
#: ASSISTANT: <answer></s>`` per turn, ending ``ASSISTANT:`` where the model answers. Spec-Bench (Xia et
#: al., 2024) builds every model's prompt text so and tokenizes it with the model's tokenizer.
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


def vicuna_template(*, bos: bool) -> str:
    """FastChat's Vicuna v1.1 conversation as a chat template: the literal ``</s>`` after each answer
    (an EOS where the tokenizer has that token, text elsewhere, as in Spec-Bench's prompts), and the
    tokenizer's BOS first where ``bos`` (where ``tokenizer(text)`` adds one: a chat template's text is
    tokenized without special tokens). A leading system message replaces the system line. An empty
    message is its role and a colon alone (``ASSISTANT:``, no space and no separator after it), as
    FastChat's ``ADD_COLON_TWO`` style writes one."""
    return (
        ("{{ bos_token }}" if bos else "")
        + "{% if messages and messages[0]['role'] == 'system' %}"
        + "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
        + '{% else %}{% set system = "'
        + VICUNA_SYSTEM
        + '" %}{% set turns = messages %}{% endif %}'
        + "{{ system }} "
        + "{% for m in turns %}"
        + "{% if not m['content'] %}{{ 'USER' if m['role'] == 'user' else 'ASSISTANT' }}:"
        + "{% elif m['role'] == 'user' %}USER: {{ m['content'] }} "
        + "{% else %}ASSISTANT: {{ m['content'] }}</s>{% endif %}"
        + "{% endfor %}"
        + "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    )


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer(text)`` puts the tokenizer's BOS first (Llama's and Vicuna's do; SmolLM2's not)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos is not None and _ids(tokenizer("x"))[:1] == [bos]


#: ``workload.chat_template`` names: each builds its template for a tokenizer
NAMED_CHAT_TEMPLATES = {"vicuna": lambda tokenizer: vicuna_template(bos=adds_bos(tokenizer))}
#: FastChat's stop string of the Vicuna conversation, which Spec-Bench's eval.py sets (``conv.stop_str``):
#: each answer's text is cut at its first one before it is stored and fed back (generation does not stop there)
VICUNA_STOP = "</s>"
#: the stop string each named template's answers are cut at
NAMED_STOP_STRINGS = {"vicuna": VICUNA_STOP}


def chat_template_of(value: str | None, tokenizer=None) -> str | None:
    """The Jinja text ``workload.chat_template`` names for ``tokenizer``: None (the tokenizer's own), a
    named template (:data:`NAMED_CHAT_TEMPLATES`) or a file's text; a file that cannot be read is
    refused."""
    if value is None:
        return None
    if value in NAMED_CHAT_TEMPLATES:
        return NAMED_CHAT_TEMPLATES[value](tokenizer)
    path = Path(str(value)).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = "no such file" if not path.exists() else getattr(exc, "strerror", None) or str(exc)
        raise WorkloadError(
            f"workload.chat_template={value}: {why}; give {' or '.join(NAMED_CHAT_TEMPLATES)} or a Jinja file"
        ) from None
    if not text.strip():
        raise WorkloadError(f"workload.chat_template={value}: the file is empty; a Jinja chat template is needed")
    return text


def set_chat_template(tokenizer, value: str | None) -> None:
    """Give ``tokenizer`` the chat template ``workload.chat_template`` names (nothing for None)."""
    if value is None or tokenizer is None:
        chat_template_of(value)  # a file that cannot be read is refused all the same
        return
    tokenizer.chat_template = chat_template_of(value, tokenizer)
    setattr(tokenizer, CHAT_TEMPLATE_OPTION, value)  # artifacts trained on its chats are keyed by it


def chat_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of chat messages through the tokenizer's chat template, generation prompt added."""
    return _ids(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))


def first_turn_messages(prompt: Prompt, *, chat: bool) -> list[dict] | None:
    """The chat messages of a prompt's first turn, or None where its text is tokenized as it is
    (``chat=false``; a prompt given as messages always goes through the template)."""
    if prompt.turns is not None:
        return [{"role": "user", "content": prompt.turns[0]}] if chat else None
    if prompt.messages is not None and (chat or prompt.text is None):
        return [dict(m) for m in prompt.messages]
    return [{"role": "user", "content": prompt.text}] if chat else None


def encode_prompt(prompt: Prompt, tokenizer, *, chat: bool) -> list[int]:
    """Token ids of a prompt's first turn; chat messages through the tokenizer's chat template. A
    text taken as it is gets the tokenizer's own special tokens, as ``tokenizer(text)`` gives them
    to ``generate``: a BOS for the models that start every sequence with one (Llama, Mistral,
    Gemma), nothing for those that add none (SmolLM2, GPT-2, Qwen)."""
    messages = first_turn_messages(prompt, chat=chat)
    if messages is not None:
        return chat_ids(tokenizer, messages)
    text = prompt.turns[0] if prompt.turns is not None else prompt.text
    return _ids(tokenizer(text)["input_ids"])


class PromptEncoder:
    """Each turn's prompt ids under the context limit (see the module docstring)."""

    def __init__(
        self,
        tokenizer,
        *,
        chat: bool,
        vocab_size: int = 96,
        eos: frozenset[int] = frozenset(),
        limit: ContextLimit | None = None,
    ) -> None:
        self.tokenizer, self.chat, self.vocab_size = tokenizer, bool(chat), int(vocab_size)
        self.eos, self.limit = frozenset(eos), limit

    # ----------------------------------------------------------------- ids before any cut

    def synthetic(self, text: str) -> list[int]:
        """A model without a tokenizer: one id per byte of the text."""
        return [3 + (b % (self.vocab_size - 3)) for b in text.encode()]

    def raw(self, prompt: Prompt, answers: Sequence[Sequence[int]] = ()) -> list[int]:
        """Turn ``len(answers) + 1``'s prompt ids, ``answers`` being the arm's own answers so far."""
        k = len(answers)
        if k >= prompt.n_turns:
            raise ValueError(f"prompt {prompt.prompt_id!r} has {prompt.n_turns} turn(s); asked for turn {k + 1}")
        if self.tokenizer is None:
            if prompt.turns is not None:
                ids: list[int] = []
                for q, a in zip(prompt.turns, [*answers, []]):
                    ids += self.synthetic(q) + [int(t) for t in a if int(t) not in self.eos]
            elif prompt.text is not None:
                ids = self.synthetic(prompt.text)
            else:
                ids = self.synthetic(" ".join(m["content"] for m in prompt.messages))
            return ids or [3]
        if k == 0:
            return encode_prompt(prompt, self.tokenizer, chat=self.chat)
        return chat_ids(self.tokenizer, self.messages(prompt, answers))

    def messages(self, prompt: Prompt, answers: Sequence[Sequence[int]] = ()) -> list[dict] | None:
        """The chat messages behind turn ``len(answers) + 1``'s prompt, or None where no chat template
        renders it (no tokenizer, ``workload.chat=false`` on a single turn)."""
        if self.tokenizer is None:
            return None
        k = len(answers)
        if k == 0:
            return first_turn_messages(prompt, chat=self.chat)
        messages = []
        for q, a in zip(prompt.turns, answers):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": self.answer_text(a)}]
        messages.append({"role": "user", "content": prompt.turns[k]})
        return messages

    def first_text(self, prompt: Prompt, answers: Sequence[Sequence[int]], ids: Sequence[int]) -> tuple[int, int]:
        """Where the first non-system message's text lies in ``ids`` (turn ``len(answers) + 1``'s
        prompt): ``(start, end)``, the template's opening (every leading system block, that message's
        header) before ``start``. Found as the tokens the conversation shares, at each end, with the
        same one whose first non-system message is empty. A text tokenized as it is (no template)
        has the tokenizer's own special tokens around it (a BOS) as its opening; ``(0, 0)`` where
        it has none, or without a tokenizer."""
        return self.text_span(prompt, answers, ids)[1:]

    def text_span(
        self, prompt: Prompt, answers: Sequence[Sequence[int]], ids: Sequence[int]
    ) -> tuple[list[int], int, int]:
        """``(opening, start, end)``: the first non-system message's text lies in ``ids[start:end]``
        (:meth:`first_text`), and ``opening`` is the template's opening as it renders with that text
        empty. That is ``ids[:start]``, and more where the text's first token merged with the header's
        last one (a text opening with a blank line after a header ending in a newline: the tokens the
        two renderings share stop before that newline): the emptied rendering's tokens after ``start``
        that the text in ``ids`` begins with, decoded, belong to the opening (:meth:`turn` leaves them
        out where the text it keeps opens with them itself). ``([], 0, 0)`` where there is no
        opening."""
        emptied = self._emptied(prompt, answers, ids)
        if emptied is None:
            return [], 0, 0
        start = 0
        for a, b in zip(ids, emptied):
            if int(a) != int(b):
                break
            start += 1
        end = len(ids)
        for a, b in zip(reversed(ids), reversed(emptied)):
            if end <= start or int(a) != int(b):
                break
            end -= 1
        header = start  # the opening's end in ``emptied``
        closing = len(emptied) - (len(ids) - end)  # where the tokens shared at the end begin in ``emptied``
        if header < closing:
            text = self.tokenizer.decode([int(t) for t in ids[start:end]])
            while header < closing and text.startswith(self.tokenizer.decode(list(emptied[start : header + 1]))):
                header += 1
        return [int(t) for t in emptied[:header]], start, end

    def _emptied(self, prompt: Prompt, answers: Sequence[Sequence[int]], ids: Sequence[int]) -> list[int] | None:
        """Turn ``len(answers) + 1``'s prompt with its first non-system message's text empty (a text
        tokenized as it is: the tokenizer's own special tokens around an empty text), or None where
        the prompt has no opening (no tokenizer, no special token first, no non-system message)."""
        messages = self.messages(prompt, answers)
        if messages is None:
            if self.tokenizer is None or answers:
                return None
            emptied = _ids(self.tokenizer("")["input_ids"])  # a BOS the tokenizer adds, say
            if not emptied or not ids or int(ids[0]) != int(emptied[0]):
                return None
            return emptied
        first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), None)
        if first is None:
            return None
        return chat_ids(self.tokenizer, [*messages[:first], {**messages[first], "content": ""}, *messages[first + 1 :]])

    @property
    def stop_str(self) -> str | None:
        """The text an answer is cut at: ``</s>`` where ``workload.chat_template=vicuna`` gave the
        tokenizer its template (:data:`NAMED_STOP_STRINGS`), else None."""
        return NAMED_STOP_STRINGS.get(getattr(self.tokenizer, CHAT_TEMPLATE_OPTION, None))

    def answer(self, ids: Sequence[int]) -> tuple[str, bool]:
        """An answer as text, and whether the stop string cut it: decoded with special tokens removed,
        cut at the first :attr:`stop_str` after its first character (FastChat's rule: one that opens the
        answer cuts nothing), whitespace stripped. Both arms' answers go through it. Without a
        tokenizer: every generated id as a decimal word."""
        if self.tokenizer is None:
            return " ".join(str(int(t)) for t in ids), False
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        at = text.find(self.stop_str) if self.stop_str else -1
        return (text[:at] if at > 0 else text).strip(), at > 0

    def answer_text(self, ids: Sequence[int]) -> str:
        """An answer's text (:meth:`answer`): what goes back into the conversation and into the outputs."""
        return self.answer(ids)[0]

    def worst_case_tokens(self, prompt: Prompt) -> int:
        """The last turn's prompt length with every earlier answer at ``max_new_tokens`` tokens.

        Under a chat template each earlier answer is rendered as a one-word placeholder and its
        remaining tokens added: a template may write an answer with separators it leaves out of an
        empty one (Vicuna's ``ASSISTANT: <answer></s>`` against ``ASSISTANT:``)."""
        k = prompt.n_turns - 1
        if k == 0:
            return len(self.raw(prompt))
        answer = self.limit.max_new_tokens if self.limit is not None else 0
        if self.tokenizer is None or answer == 0:
            return len(self.raw(prompt, [[] for _ in range(k)])) + k * answer
        word = self.tokenizer.encode("a", add_special_tokens=False)
        return len(self.raw(prompt, [word for _ in range(k)])) + k * max(0, answer - len(word))

    # ----------------------------------------------------------------- under the limit

    def check(self, prompts: Sequence[Prompt]) -> None:
        """Refuse (``workload.truncate=false``), before any model work, the first prompt whose last
        turn cannot fit; a conversation needs the chat template (a model without one is refused)."""
        if self.tokenizer is not None and not self.chat:
            multi = next((p for p in prompts if p.n_turns > 1), None)
            if multi is not None:
                raise WorkloadError(
                    f"prompt {multi.prompt_id!r} has {multi.n_turns} turns: conversations go through the chat "
                    "template; set workload.chat=true"
                )
        as_messages = any(p.messages is not None and p.text is None for p in prompts)  # templated whatever chat says
        if (
            self.tokenizer is not None
            and (self.chat or as_messages)
            and not getattr(self.tokenizer, "chat_template", None)
        ):
            plain_text = self.chat and not as_messages and all(p.n_turns == 1 for p in prompts)
            raise WorkloadError(
                "the target's tokenizer has no chat template: set workload.chat_template=vicuna (the prompt format "
                "Spec-Bench builds for every model) or a Jinja file"
                + (", or workload.chat=false to tokenize prompts as they are" if plain_text else "")
            )
        if self.tokenizer is not None and (self.chat or as_messages):
            self.check_template(prompts)
        room = self.limit.max_prompt_tokens if self.limit is not None else None
        if room is None or self.limit.rule != TRUNCATE_REFUSE:
            return
        for p in prompts:
            n = self.worst_case_tokens(p)
            if n > room:
                raise WorkloadError(self.limit.overflow(p, p.n_turns, n, bounded=p.n_turns > 1))

    def check_template(self, prompts: Sequence[Prompt]) -> None:
        """Refuse, naming the prompt, one whose first turn the chat template refuses (a template may
        raise on a role it does not take, a system message for one), or, for a conversation, its last
        turn (earlier answers in place: a template may refuse an assistant message): the run stopped on
        the template's bare error after the models had loaded, a later turn's mid-run. So is one the
        template renders as no token at all (a template that writes only some roles' messages): the
        run stopped after the weights loaded, naming the prompt by its place in the batch."""
        from jinja2.exceptions import TemplateError  # what a template's raise_exception raises

        for p in prompts:
            messages = first_turn_messages(p, chat=self.chat)
            if messages is None:
                continue
            try:
                ids = chat_ids(self.tokenizer, messages)
            except TemplateError as exc:
                raise WorkloadError(
                    f"prompt {p.prompt_id!r}: the chat template refuses it ({' '.join(str(exc).split())}); "
                    "give workload.chat_template a template that takes its messages"
                ) from None
            if p.n_turns > 1:  # its last turn, earlier answers as a placeholder word: the shape later turns take
                word = self.tokenizer.encode("a", add_special_tokens=False)
                try:
                    chat_ids(self.tokenizer, self.messages(p, [word] * (p.n_turns - 1)))
                except TemplateError as exc:
                    raise WorkloadError(
                        f"prompt {p.prompt_id!r}: the chat template refuses its turn {p.n_turns} (the user's and the "
                        f"assistant's earlier messages before it: {' '.join(str(exc).split())}); give "
                        "workload.chat_template a template that takes a conversation"
                    ) from None
            if not ids:
                roles = ", ".join(dict.fromkeys(m.get("role") for m in messages))
                raise WorkloadError(
                    f"prompt {p.prompt_id!r}: {self.template_name()} renders its messages ({roles}) as no token "
                    "at all: there is nothing to prefill; give workload.chat_template a template that writes them"
                )

    def template_name(self) -> str:
        """The chat template the prompts go through, as the run was told it."""
        option = getattr(self.tokenizer, CHAT_TEMPLATE_OPTION, None)
        return f"the chat template workload.chat_template={option}" if option else "the tokenizer's own chat template"

    def turn(self, prompt: Prompt, answers: Sequence[Sequence[int]] = ()) -> TurnPrompt:
        """Turn ``len(answers) + 1``'s prompt, cut from the left under ``workload.truncate=left``.

        Under ``workload.truncate=false`` the prompts were checked before any model work with every
        earlier answer counted at ``max_new_tokens`` tokens; an answer fed back as text can still
        tokenize longer than the tokens it was decoded from (whitespace stripped, merges at the
        template's seams, bytes of a split character). Such a turn is cut from the left as under
        ``left``, and its cut tokens are recorded (the run says so): refusing it would throw away
        the gates and the turns already measured."""
        ids = self.raw(prompt, answers)
        room = self.limit.max_prompt_tokens if self.limit is not None else None
        if room is None or len(ids) <= room:
            return TurnPrompt(ids, len(ids))
        opening, start, end = self.text_span(prompt, answers, ids)
        if 0 < len(opening) <= room // 2:  # the template's opening stays
            keep = room - len(opening)  # the tokens after the opening that fit
            merged = self.tokenizer.decode(opening[start:]) if len(opening) > start else None  # see text_span
            if merged and self.tokenizer.decode(ids[len(ids) - keep :]).startswith(merged):
                opening = opening[:start]  # the kept text opens with them itself (a word's leading space)
                if self.tokenizer.decode(ids[len(ids) - (room - start) :]).startswith(merged):
                    keep = room - start  # and so does the text a token longer, which fits now
            if len(ids) - keep <= end:  # the first message's oldest text goes, nothing around it
                return TurnPrompt(opening + ids[len(ids) - keep :], len(ids))
        messages = self.messages(prompt, answers)
        if messages is not None:  # through a template: the oldest messages go whole (cutting into them
            # after the first one left an answer's words under the first user header)
            shorter = self.without_oldest_messages(messages, room)
            if shorter is not None:
                return TurnPrompt(shorter, len(ids))
            last = last_question(messages)
            if last != messages:  # the last user message alone does not fit: it is cut as a first message is
                alone = Prompt(prompt_id=prompt.prompt_id, category=prompt.category, messages=tuple(last))
                return TurnPrompt(self.turn(alone).ids, len(ids))
        return TurnPrompt(ids[-room:], len(ids))

    def without_oldest_messages(self, messages: Sequence[dict], room: int) -> list[int] | None:
        """``messages`` without their oldest non-system messages, rendered again through the template:
        the fewest that bring the prompt within ``room``, cut so that a user message comes first after
        the system messages (whole exchanges, question and answer, where they alternate). The last
        user message and what follows it stay; None where even they do not fit (see
        :func:`last_question`)."""
        older = older_messages(messages)
        for n in range(1, len(older) + 1):
            if n < len(older) and messages[older[n]].get("role") != "user":
                continue  # what is left opens with a question (after all of them: the last user message)
            gone = set(older[:n])
            kept = chat_ids(self.tokenizer, [m for i, m in enumerate(messages) if i not in gone])
            if len(kept) <= room:
                return kept
        return None


def older_messages(messages: Sequence[dict]) -> list[int]:
    """The indices of the non-system messages before the last user message (none without one)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
    return [i for i in range(last) if messages[i].get("role") != "system"]


def last_question(messages: Sequence[dict]) -> list[dict]:
    """``messages`` without :func:`older_messages`: the system messages, the last user message and
    what follows it."""
    gone = set(older_messages(messages))
    return [dict(m) for i, m in enumerate(messages) if i not in gone]


def encode_workload(cfg, tokenizer, *, vocab_size: int | None = None) -> list[tuple[Prompt, list[int]]]:
    """``[(Prompt, first-turn ids)]`` of the configured workload, no context limit applied (the
    runner applies it; calibration, the datastore gate and tests use this)."""
    vocab = vocab_size or (int(cfg.model.tiny.get("vocab_size", 96)) if cfg.model.get("tiny") else 96)
    enc = PromptEncoder(tokenizer, chat=bool(cfg.workload.chat), vocab_size=vocab)
    return [(p, enc.raw(p)) for p in load_configured(cfg.workload)]
