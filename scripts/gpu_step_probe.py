"""The autoregressive step of a SmolLM2-shaped random model on one CUDA device, configuration by
configuration, in one process: t(1..8) through the runs' timing function, and decode's time per token
(32 tokens after 8 warm ones) with the stock and the grouped tree attention, the preallocated and the
concatenating cache, under inference mode and under no_grad, in bf16 then fp32; a torch.profiler
table of a few bf16 steps; and bf16 with ``torch.compile`` (dynamic shapes). Every result is written
to ``$OUT/probe.json`` as it ends (the profile to ``$OUT/profile_bf16_ar.txt``), so a run stopped by a
time limit keeps the earlier ones. It leaves PyTorch's cuDNN attention switch as it finds it (allowed
by default): run it with ``--no-cudnn`` to forbid it as the runs do.

    OUT=results/gpu python3 scripts/gpu_step_probe.py [--no-cudnn]
"""

import json
import os
import sys
import time
import traceback

import torch

from harness.gpu_check import ar_proposer, greedy_decode, smollm2_shaped, t_of_n
from harness.target import attention
from harness.target.backend import CausalLMBackend
from harness.target.options import apply_static_cache, compile_model

if any(a in ("-h", "--help") for a in sys.argv[1:]) or any(a != "--no-cudnn" for a in sys.argv[1:]):
    print("usage: OUT=results/gpu python3 scripts/gpu_step_probe.py [--no-cudnn]", file=sys.stderr)
    sys.exit(0 if any(a in ("-h", "--help") for a in sys.argv[1:]) else 2)
if not torch.cuda.is_available():
    print("gpu_step_probe: no CUDA device", file=sys.stderr)
    sys.exit(2)
OUT = os.environ.get("OUT", "results/gpu")
os.makedirs(OUT, exist_ok=True)
if "--no-cudnn" in sys.argv[1:]:
    torch.backends.cuda.enable_cudnn_sdp(False)
rep = {"cudnn_attention_allowed": torch.backends.cuda.cudnn_sdp_enabled()}


def save() -> None:
    with open(f"{OUT}/probe.json", "w") as f:
        f.write(json.dumps(rep, indent=1, default=str))


def ar(model, n=32, inference=True):
    backend = CausalLMBackend(model, device=torch.device("cuda"))
    base = torch.randint(3, 49000, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    prompt = base * 8
    prop = ar_proposer()
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        for warm in (True, False):
            t0 = time.perf_counter()
            res = greedy_decode(backend, prop, prompt, 8 if warm else n)
            wall = time.perf_counter() - t0
    return {
        "ms_per_token": res.decode_ms / len(res.tokens),
        "wall_ms_per_token": 1000 * wall / len(res.tokens),
        "verify_ms": res.ledger.summary()["round_cost_ms"]["target_verify"],
    }


def step(name, fn):
    t0 = time.perf_counter()
    try:
        rep[name] = fn()
    except Exception as e:
        rep[name] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-2000:]}
    rep.setdefault("seconds", {})[name] = time.perf_counter() - t0
    print(name, json.dumps(rep[name], default=str)[:600], flush=True)
    save()


def configurations(dt: torch.dtype) -> None:
    tag = str(dt).split(".")[-1]
    m = smollm2_shaped(dt, "cuda")

    def t() -> dict:
        return {k: v["median_ms"] for k, v in t_of_n(m, "cuda", [1, 2, 8], reps=10).items()}

    step(f"{tag}_stock_t", t)
    step(f"{tag}_stock_ar", lambda: ar(m))
    step(f"{tag}_stock_ar_nograd", lambda: ar(m, inference=False))
    m.set_attn_implementation(attention.NAME)
    step(f"{tag}_grouped_ar", lambda: ar(m))
    apply_static_cache(m, False)
    step(f"{tag}_grouped_dynamic_ar", lambda: ar(m))
    apply_static_cache(m, True)
    step(f"{tag}_grouped_t", t)
    step(f"{tag}_grouped_ar_again", lambda: ar(m))
    if dt == torch.bfloat16:

        def prof() -> dict:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                ar(m, n=6)
            ka = p.key_averages()
            tables = ka.table(sort_by="cpu_time_total", row_limit=30) + "\n\n"
            tables += ka.table(sort_by="self_cpu_time_total", row_limit=25)
            with open(f"{OUT}/profile_bf16_ar.txt", "w") as f:
                f.write(tables)
            return {"written": True}

        step("bf16_profile", prof)


def compiled() -> dict:
    m = smollm2_shaped(torch.bfloat16, "cuda")
    m.set_attn_implementation(attention.NAME)
    apply_static_cache(m, False)
    compile_model(m)
    t0 = time.perf_counter()
    first = ar(m, n=8)
    first_s = time.perf_counter() - t0
    again = ar(m, n=32)
    t = {k: v["median_ms"] for k, v in t_of_n(m, "cuda", [1, 2, 8], reps=10).items()}
    return {"first": first, "first_s": first_s, "again": again, "t": t}


if __name__ == "__main__":
    attention.register()
    for dt in (torch.bfloat16, torch.float32):
        configurations(dt)
        torch.cuda.empty_cache()
    step("bf16_compiled_dynamic_cache", compiled)
    print("done", flush=True)
