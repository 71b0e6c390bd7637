"""Memory a record reports: this job's peak host RSS (not the process lifetime's), CUDA peaks per
arm, and the per-round and per-depth counts the round ledger keeps."""

from __future__ import annotations

import resource
import sys
import time

import pytest
import torch

import harness.measure.memory as memory
from harness.measure.ledger import RoundLedger
from harness.measure.memory import DevicePeak, JobHostMemory

MIB = 1 << 20


def _touch(n_bytes: int) -> bytearray:
    buf = bytearray(n_bytes)
    for i in range(0, n_bytes, 4096):  # make every page resident
        buf[i] = 1
    return buf


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel high-water mark is Linux's")
def test_host_peak_is_per_job_when_jobs_share_a_process():
    first = JobHostMemory().start()
    buf = _touch(256 * MIB)
    one = first.stop()
    del buf
    second = JobHostMemory().start()
    two = second.stop()
    assert one["peak_rss_method"] == two["peak_rss_method"] == "vmhwm_reset"
    assert one["peak_rss_bytes"] >= one["rss_start_bytes"] + 200 * MIB
    assert two["peak_rss_bytes"] < one["peak_rss_bytes"] - 150 * MIB  # the first job's peak is not carried over
    # getrusage's ru_maxrss reads the same (now reset) high-water mark: it agrees with this job
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < one["peak_rss_bytes"] - 150 * MIB


def test_host_peak_is_sampled_where_the_high_water_mark_cannot_be_reset(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "_CLEAR_REFS", tmp_path / "no" / "clear_refs")
    job = JobHostMemory(interval_s=0.01).start()
    buf = _touch(128 * MIB)
    time.sleep(0.2)
    del buf
    out = job.stop()
    assert job.stop() is out and not job._thread.is_alive()  # stopped once, the sampler gone
    assert out["peak_rss_method"] == "sampled"
    assert out["peak_rss_bytes"] >= out["rss_start_bytes"] + 100 * MIB
    with pytest.raises(RuntimeError, match="before start"):
        JobHostMemory().stop()


def test_device_peak_measures_nothing_off_cuda():
    peak = DevicePeak(torch.device("cpu"))
    peak.measure()
    assert peak.read() == (None, None) and peak.allocated_now() is None


def test_the_arms_peak_counts_every_cuda_device_their_work_runs_on(monkeypatch):
    """A draft on another GPU than the target's: its weights, cache and activations were left out of
    the arms' peak (only the target's device was reset and read), and with the target on the CPU the
    peak was None though the draft ran on CUDA."""
    import types

    from harness.contracts import Budget
    from harness.engine.arms import Arms
    from harness.engine.decode import RoundConfig
    from harness.proposers.base import NullProposer
    from harness.random_source import TorchRandomSource
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    calls = []
    peaks = {"cuda:0": (100, 150), "cuda:1": (20, 30)}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("sync", str(d))))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append(("reset", str(d))))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: peaks[str(d)][0])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: peaks[str(d)][1])

    class DraftOn(NullProposer):
        def devices(self):
            return {torch.device("cuda:1")}

    def arms(target_device):
        budget = Budget("sequence", 1, 1)
        return Arms(
            target=types.SimpleNamespace(device=torch.device(target_device)),
            spec_proposers=[DraftOn(budget=budget, manifest_hash="x")],
            null_proposers=[NullProposer(budget=budget, manifest_hash="x")],
            spec_verifier=get_verifier("greedy"),
            ar_verifier=get_verifier("greedy"),
            policy=SamplingPolicy(),
            prompts=[[1, 2, 3]],
            seed=0,
            batch_size=1,
            max_new_tokens=4,
            eos_token_ids=frozenset(),
            round_cfg=RoundConfig(max_nodes=1, max_depth=1),
            rng_factory=TorchRandomSource,
        )

    peak = arms("cuda:0").device_peak
    peak.measure()
    assert sorted(calls) == [("reset", "cuda:0"), ("reset", "cuda:1"), ("sync", "cuda:0"), ("sync", "cuda:1")]
    assert peak.read() == (120, 180)  # each device's own peak, summed
    peak = arms("cpu").device_peak  # the target on the CPU, the draft on a GPU
    assert peak.read() == (20, 30)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_peak_on_cuda_sees_a_stretch_and_forgets_the_previous_one():
    dev = torch.device("cuda")
    peak = DevicePeak(dev)
    peak.measure()
    x = torch.empty(64 * MIB, dtype=torch.uint8, device=dev)
    big = peak.read()
    del x
    torch.cuda.empty_cache()
    peak.measure()
    y = torch.empty(MIB, dtype=torch.uint8, device=dev)
    small = peak.read()
    del y
    assert big[0] >= 64 * MIB and big[1] >= big[0]
    assert small[0] < big[0] - 32 * MIB


def test_ledger_keeps_depth_counts_and_the_round_series():
    stage = {"proposal": 1.0, "target_verify": 10.0}
    a, b = RoundLedger(), RoundLedger()
    a.observe_round(
        tree_depth=3, num_rows=3, accepted=2, committed=3, first_child_hit=True, stage_ms=stage, temp_kv_bytes=0
    )
    a.observe_round(
        tree_depth=3, num_rows=3, accepted=0, committed=1, first_child_hit=False, stage_ms=stage, temp_kv_bytes=0
    )
    b.observe_round(
        tree_depth=2, num_rows=4, accepted=1, committed=2, first_child_hit=True, stage_ms=stage, temp_kv_bytes=0
    )
    a.merge(b)
    s = a.summary()
    # depth 1 tried by all three rounds; depth 2 by the two that accepted depth 1; depth 3 by one
    assert s["rounds_tried_by_depth"] == [3, 2, 1]
    assert s["rounds_accepted_by_depth"] == [2, 1, 0]
    assert s["acceptance_by_depth"] == [2 / 3, 1 / 2, 0.0]
    assert s["reach_by_depth"] == [2 / 3, 1 / 3, 0.0]
    table = a.rounds_table()
    assert [r["round"] for r in table] == [0, 1, 2]  # merged series keep their order
    assert [(r["accepted"], r["committed"], r["candidate_rows"], r["tree_depth"]) for r in table] == [
        (2, 3, 3, 3),
        (0, 1, 3, 3),
        (1, 2, 4, 2),
    ]
    assert table[0]["ms"] == 11.0 and table[0]["target_verify_ms"] == 10.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_job_records_device_peaks_per_arm_and_its_own_host_peak(tmp_path, monkeypatch):
    from harness.config import compose
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        [
            "model=tiny",
            "model.device=cuda",
            "workload.limit=2",
            "generation.max_new_tokens=12",
            "gates.oracle=false",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    m = run_job(cfg, run_dir=tmp_path / "run")["metrics"]
    for prefix in ("", "ar_"):
        allocated, reserved = m[f"{prefix}cuda_peak_allocated_bytes"], m[f"{prefix}cuda_peak_reserved_bytes"]
        assert allocated > 0 and reserved >= allocated, (prefix, allocated, reserved)
    assert m["peak_rss_bytes"] >= m["rss_start_bytes"] > 0
