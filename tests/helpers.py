"""Helpers shared by tests (importable because pytest puts this folder on sys.path)."""

import copy
import json
from pathlib import Path

#: the fixture sweep: records written by the runner on the tiny model (tests/fixtures/records/make_fixtures.py)
FIXTURE_ROOT = Path(__file__).parent / "fixtures" / "records"
FIXTURE_SWEEP = FIXTURE_ROOT / "fixture-sweep"


def fixture_run(number: int) -> Path:
    """The fixture sweep's job folder ``fx<number>-...`` (folders are named by their overrides; run
    ids are the runner's own and change with every regeneration)."""
    (found,) = FIXTURE_SWEEP.glob(f"fx{number:02d}-*")
    return found


def fixture_record(number: int) -> dict:
    return json.loads((fixture_run(number) / "record.json").read_text())


def fixture_run_id(number: int) -> str:
    return fixture_record(number)["run_id"]


def round_of_one(kw: dict) -> dict:
    """An ``on_round`` call of a batch of one as {tree, selection, emitted, state} (the state copied
    as it was after the round's commit: a finished request leaves the batch right after)."""
    return {
        "tree": kw["trees"][0],
        "selection": kw["selections"][0],
        "emitted": kw["emitted"][0],
        "state": copy.deepcopy(kw["state"]),
    }


def tokens_left(rounds: list[dict], new: int) -> list[int]:
    """The tokens each round's request had left to commit when the round began (``new`` the
    request's max_new_tokens; ``rounds`` as :func:`round_of_one` gives them, no EOS)."""
    out, done = [], 0
    for r in rounds:
        out.append(new - done)
        done += len(r["emitted"])
    return out


def rounds_with_room(rounds: list[dict], new: int) -> list[dict]:
    """The rounds that could commit a candidate: not a round with one token left, whose tree the
    round loop cuts to nothing (it commits the bonus token alone)."""
    return [r for r, left in zip(rounds, tokens_left(rounds, new)) if left > 1]


#: Spec-Bench's categories in its file order (the eight MT-bench ones have two turns)
SB_MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SB_CATEGORIES = (*SB_MT_BENCH, "translation", "summarization", "qa", "math_reasoning", "rag")


def spec_bench_questions(per_category: int = 3, categories=SB_CATEGORIES, first_id: int = 81) -> list[dict]:
    """Questions in Spec-Bench's question.jsonl format (question_id, category, turns[, reference]),
    written from its published field names and shapes: two turns for the MT-bench categories, one
    otherwise; ``reference`` absent, a list of strings, or (rag) a list holding a list of strings."""
    out, qid = [], first_id
    for cat in categories:
        for k in range(per_category):
            turns = [f"{cat} question {k}: say something about item {k}."]
            if cat in SB_MT_BENCH:
                turns.append(f"Now rewrite your answer about item {k} in one line.")
            q = {"question_id": qid, "category": cat, "turns": turns}
            if cat == "rag":
                q["reference"] = [[f"answer {k}", f"another answer {k}"]]
            elif cat in ("translation", "summarization", "math_reasoning"):
                q["reference"] = [f"reference {k} #### {k}"]
            elif cat == "math":
                q["reference"] = ["first turn reference", ""]
            out.append(q)
            qid += 1
    return out


def write_jsonl(path, rows) -> str:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def word_chat_tokenizer(n_words: int = 40):
    """A small word-level fast tokenizer with a chat template (no download): ids 0-5 are <pad>,
    <s>, </s> (EOS), <unk>, <user>, <bot>; then w0..w{n-1} and a few plain words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "<bot>"] + [f"w{i}" for i in range(n_words)]
    words += ["hello", "world", "again", "say", "more"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<user>", "<bot>"],
    )
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<user> {{ m['content'] }} "
        "{% else %}<bot> {{ m['content'] }} </s> {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<bot>{% endif %}"
    )
    return tok


# --------------------------------------------------------------------------------------------
# W&B offline runs read back with W&B's own reader (`wandb leet inspect` parses the run's .wandb
# transaction log through wandb-core; no server)


def inspect_run(path, sync_dir=None) -> tuple[dict, list[dict]]:
    """(state/summary/config, every record of the transaction log) of the one W&B run under ``path``
    (or of the run in ``sync_dir``, one ``wandb/*run-*`` folder)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if sync_dir is not None:
        (run_file,) = list(Path(sync_dir).glob("run-*.wandb"))
    else:
        (run_file,) = list(Path(path).glob("wandb/*run-*/run-*.wandb"))
    cli = Path(sys.executable).parent / "wandb"

    def call(*flags: str) -> str:
        args = [str(cli), "leet", "inspect", *flags, "--json", str(run_file)]
        return subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout

    summary = json.loads(call("--summary"))
    records = [json.loads(line) for line in call().splitlines() if line.strip()]
    return summary, records


def run_info(records: list[dict]) -> dict:
    """The last run record of a transaction log (name, group, job type, tags as they were at the end)."""
    return [r["run"] for r in records if r.get("type") == "run"][-1]


def history(records: list[dict]) -> list[dict]:
    """The history steps of a transaction log, in order."""
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


def greedy_tokens(backend, prompt: list[int], new: int, proposer) -> list[int]:
    """Greedy output of the round loop on ``backend`` with ``proposer`` (its budget sets the tree)."""
    from harness.engine.decode import RoundConfig, decode
    from harness.random_source import TorchRandomSource
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    res = decode(
        target=backend,
        proposer=proposer,
        verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompt_ids=prompt,
        max_new_tokens=new,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=proposer.budget.max_nodes, max_depth=proposer.budget.max_depth),
    )
    return res.tokens


def greedy_lookup_tokens(backend, prompt: list[int], new: int = 40, *, matches: int = 8) -> list[int]:
    """Greedy prompt lookup (8-row trees of depth 4) decoded by the round loop on ``backend``."""
    from harness.contracts import Budget
    from harness.proposers.prompt_lookup import PromptLookupProposer

    lookup = PromptLookupProposer(budget=Budget("sequences", 8, 4), manifest_hash="t", max_matches=matches)
    return greedy_tokens(backend, prompt, new, lookup)


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts folder is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: a tiny target with a one-layer parametric draft, sampled at T = 0.7 and verified by Sequoia's
#: verifier, over a small calibration: the Sequoia preparation tests' base
SEQUOIA_TINY = [
    "model=tiny",
    "proposer=draft_model",
    "proposer.sampling=without_replacement",
    "verifier=sequoia",
    "generation.temperature=0.7",
    "threads=1",
    "topology.calibration.parents=20",
    "topology.calibration.branches=3",
    "topology.calibration.max_new_tokens=10",
]

#: a one-layer draft, a 3-row tree and a quick profile: `harness calibrate` in seconds
SEQUOIA_SMALL_TREE = [
    *SEQUOIA_TINY,
    "proposer.model.num_layers=1",
    "topology.max_nodes=3",
    "topology.max_depth=3",
    "topology.profile.repeats=2",
    "topology.profile.warmup=1",
    "topology.profile.prefix_len=16",
]


def build_context_of(cfg):
    """The models of ``cfg`` loaded (the target and its separate draft model) and its workload encoded:
    the :class:`~harness.engine.build.BuildContext` a preparer or proposer is built from."""
    from harness.engine.build import BuildContext
    from harness.runner import load_models
    from harness.target.backend import CausalLMBackend
    from harness.workloads.conversations import encode_workload

    target, draft = load_models(cfg)
    return BuildContext(
        cfg=cfg,
        target_backend=CausalLMBackend(target.model),
        tokenizer=target.tokenizer,
        draft_backend=CausalLMBackend(draft.model),
        items=encode_workload(cfg, None),
        model_source=target.source,
    )
