"""The equivalence gates' chain rounds (a verify over a chain takes the unmasked forward every
topology=sequence run takes), the gate cache keys' machine identity, and the end-to-end gate's
coverage wording."""

from __future__ import annotations

import json

import pytest
import torch

from harness.gates.equivalence import batched_equivalence_gate, equivalence_gate
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model

PROMPTS = [
    {"id": "p0", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"},
    {"id": "p1", "prompt": "for i in range(3):\n    print(i)\nfor i in range(3):\n"},
]


def _hide_the_last_cached_slot(hits: list):
    """WRONG (test-only): a causal mask for an unmasked forward of several rows over a non-empty
    cache in which every row after the first misses the last cached slot (an off-by-one causal
    offset in that forward alone); every other forward (prefills, masked trees, one-row steps) is
    untouched."""

    def mask(ids: torch.Tensor, start: int) -> torch.Tensor:
        b, r = ids.shape
        allowed = torch.zeros((b, 1, r, start + r), dtype=torch.bool)  # [B, 1, R, L + R]
        allowed[:, :, :, :start] = True
        allowed[:, :, :, start:] = torch.tril(torch.ones((r, r), dtype=torch.bool))
        allowed[:, :, 1:, start - 1] = False
        hits.append((b, r, start))
        return allowed.to(ids.device)

    return mask


def _break_the_chain_forward(monkeypatch, hits: list) -> None:
    """Patch the backend's forward with :func:`_hide_the_last_cached_slot`'s bug."""
    real = CausalLMBackend._forward
    wrong = _hide_the_last_cached_slot(hits)

    def chain_bug(self, cache, ids, pos, allowed, start, *, last_only=False, output_hidden=False):
        if allowed is None and start > 0 and ids.shape[1] > 1 and not last_only:
            allowed = wrong(ids, start)[:, 0]  # [B, R, L + R]
        return real(self, cache, ids, pos, allowed, start, last_only=last_only, output_hidden=output_hidden)

    monkeypatch.setattr(CausalLMBackend, "_forward", chain_bug)


def test_a_broken_unmasked_chain_forward_fails_both_equivalence_gates(monkeypatch):
    """Every gate round verified a branching tree (a masked forward), so a bug in the unmasked
    forward of several rows over a cache, the one every topology=sequence verify takes, passed."""
    backend = CausalLMBackend(build_tiny_model(seed=0))
    prompt = list(range(3, 40))
    prompts = [list(range(3, 40)), list(range(5, 30)), list(range(7, 50))]
    single, batched = equivalence_gate(backend, prompt), batched_equivalence_gate(backend, prompts)
    assert single["status"] == "passed" and single["chain_rows"] == 3
    assert batched["status"] == "passed" and batched["chain_rows"] == 3
    hits: list = []
    _break_the_chain_forward(monkeypatch, hits)
    broken = equivalence_gate(backend, prompt)
    assert broken["status"] == "failed" and broken["tree_max_abs_logit_diff"] > broken["tolerance"]
    assert hits and all(b == 1 and r == 4 for b, r, _ in hits)  # the chain round's verify alone
    hits.clear()
    broken = batched_equivalence_gate(backend, prompts)
    assert broken["status"] == "failed" and broken["max_abs_logit_diff"] > broken["tolerance"]
    assert hits and all(b == 3 and r == 4 for b, r, _ in hits)  # the batch's equal chains, no holes


def test_a_broken_native_chain_forward_fails_a_sequence_run_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """A topology=sequence run on a fused CPU target verifies its chains through the native stack
    without a mask; an off-by-one there alone passed every gate and the run was recorded."""
    from harness.cli import main
    from harness.target import backend as backend_module
    from harness.target import fused_layers, native

    if native.native_kernels_problem() is not None:
        pytest.skip(f"no native kernels here: {native.native_kernels_problem()}")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    real = fused_layers.stack_logits
    hits: list = []
    wrong = _hide_the_last_cached_slot(hits)

    def chain_bug(model, ids, pos, mask, cache, *, last_only=False):
        start = cache.get_seq_length() if cache is not None else 0
        if mask is None and start > 0 and ids.shape[1] > 1 and not last_only:
            out = real(model, ids, pos, wrong(ids, start), cache, last_only=last_only)
            if out is not None:
                return out
            hits.pop()
        return real(model, ids, pos, mask, cache, last_only=last_only)

    monkeypatch.setattr(backend_module, "stack_logits", chain_bug)
    run_dir = tmp_path / "run"
    argv = ["run", "model=tiny", "topology=sequence", "proposer=prompt_lookup", "workload=jsonl"]
    argv += [f"workload.path={workload}", "workload.chat=false", "generation.max_new_tokens=8", "threads=1"]
    assert main([*argv, f"output_dir={run_dir}"]) == 2
    assert hits  # the native stack ran the broken forward
    err = capsys.readouterr().err
    assert "gate 'equivalence' failed" in err and "tree_max_abs_logit_diff" in err
    assert not (run_dir / "record.json").exists() and not (run_dir / "outputs.jsonl").exists()


def test_a_gate_cache_shared_across_machines_keys_the_machines_kernels(tmp_path, monkeypatch):
    """The gates' cache keys named the device as torch spells it ("cpu", "cuda:0") and nothing of the
    machine, so a cache shared across machines served passes computed on another CPU's or GPU's
    kernels, or under another CPU dispatch (ATEN_CPU_CAPABILITY=default)."""
    from harness.config import compose
    from harness.measure import hardware
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    overrides = ["model=tiny", "workload=jsonl", f"workload.path={workload}", "workload.chat=false"]
    config = compose([*overrides, "generation.max_new_tokens=4", "threads=1", "gates.oracle=false"])

    def equivalence(name: str) -> dict:
        return run_job(config, run_dir=tmp_path / name)["gates"]["equivalence"]

    first, again = equivalence("first"), equivalence("again")
    assert not first["cached"] and again["cached"] and again["key"] == first["key"]
    with monkeypatch.context() as m:
        m.setattr(hardware, "cpu_capability", lambda: "DEFAULT")
        dispatch = equivalence("dispatch")
    assert not dispatch["cached"] and dispatch["key"] != first["key"]
    with monkeypatch.context() as m:
        m.setattr(hardware, "cpu_name", lambda *a, **k: "Another CPU")
        cpu = equivalence("cpu")
    assert not cpu["cached"] and len({cpu["key"], dispatch["key"], first["key"]}) == 3


def test_the_machine_identity_names_the_gpu_and_the_native_kernels_where_they_apply(monkeypatch):
    """A CUDA device's model and compute capability, and the native kernels' code paths only where
    they are loaded."""
    from harness.gates import stages
    from harness.measure import hardware
    from harness.target import native

    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(native, "native_kernels_loaded", lambda: False)
    h100 = stages.machine_identity(["cuda:0"])
    assert h100["devices"] == [["cuda:0", "NVIDIA H100 80GB HBM3", [9, 0]]]
    assert "cpu_capability" not in h100 and "native_code_paths" not in h100  # nothing on the CPU decides
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert stages.machine_identity(["cuda:0"]) != h100
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert stages.machine_identity(["cuda:0"]) != h100
    cpu = stages.machine_identity(["cpu", "cpu"])
    assert cpu["devices"] == [["cpu", hardware.cpu_name()]] and cpu["cpu_capability"] == hardware.cpu_capability()
    assert "native_code_paths" not in cpu
    monkeypatch.setattr(native, "native_kernels_loaded", lambda: True)
    monkeypatch.setattr(native, "code_paths", lambda: {"float32_width": 512, "avx512": True})
    wide = stages.machine_identity(["cpu"])
    monkeypatch.setattr(native, "code_paths", lambda: {"float32_width": 256, "avx512": False})
    assert wide["native_code_paths"]["avx512"] and stages.machine_identity(["cpu"]) != wide


def test_the_fourth_tier_says_what_this_proposer_lacks_not_that_it_has_no_cases():
    """A greedy draft_model run drafting without replacement enumerates another proposer's cases
    (tier 4), whose entry said draft_model had no end-to-end case of its own: it has many, only none
    with that relation at temperature 0."""
    from harness.gates import e2e as E

    tier, cases = E.gate_tier("draft_model", ["without_replacement"], "greedy", greedy=True)
    assert tier == 4 and cases and all(c.proposer != "draft_model" for c in cases)
    own = [c for c in E.e2e_cases() if c.proposer == "draft_model"]
    assert any("without_replacement" in E.case_relations(c) and c.policy.temperature > 0 for c in own)
    covers = E.GATE_TIERS[4]
    assert "no end-to-end case of its own" not in covers
    assert "no case of this proposer has any of them at this kind of temperature" in covers
