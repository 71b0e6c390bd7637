import pytest
from helpers import load_script

from harness.target.backend import CausalLMBackend
from harness.target.timing import monotone_fit, verify_cost_curve


def test_verify_cost_curve_shape(tiny_model):
    backend = CausalLMBackend(tiny_model)
    prof = verify_cost_curve(backend, list(range(3, 40)), max_rows=10, reps=2)
    t = prof["normalised"]
    assert len(t) == 11 and t[0] == 1.0
    assert all(b >= a for a, b in zip(t, t[1:]))  # monotone: more rows never cost less
    assert prof["measured_rows"][0] == 0 and prof["measured_rows"][-1] == 10


def test_the_monotone_fit_averages_a_dip_instead_of_carrying_a_slow_sample_forward():
    assert monotone_fit([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]  # a running max: [1, 3, 3, 4]
    assert monotone_fit([5.0, 1.0, 1.0, 1.0]) == [2.0, 2.0, 2.0, 2.0]
    assert monotone_fit([1.0, 2.0, 2.0, 7.0]) == [1.0, 2.0, 2.0, 7.0]  # already monotone: unchanged


def test_one_round_calls_rotate_the_order_by_the_callers_count(tiny_model, monkeypatch):
    import harness.target.timing as timing

    order = []
    monkeypatch.setattr(
        timing,
        "timed_verify_ms",
        lambda b, s, *, pending, tree, clock: order.append(0 if tree is None else tree.num_rows) or 1.0,
    )
    backend = CausalLMBackend(tiny_model)
    for sweep in range(3):
        timing.verify_times(backend, prefix_ids=list(range(3, 20)), ns=[1, 2, 3], warmup=0, repeats=1, rotation=sweep)
    # the tree holds the candidate rows (n - 1): each sweep starts one size further on
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_the_regimes_script_splits_sweeps_by_bandwidth_quartile():
    script = load_script("verify_cost_regimes")
    # a slow state (20 GB/s: one row 15 ms, rows nearly free) and a fast one (60 GB/s: 10 ms, rows cost)
    slow = [{"read_bandwidth_gbs": 20.0 + i / 10, "ms": [15.0, 15.5, 14.9, 18.0]} for i in range(4)]
    fast = [{"read_bandwidth_gbs": 60.0 + i / 10, "ms": [10.0, 12.0, 14.0, 17.0]} for i in range(4)]
    mid = [{"read_bandwidth_gbs": 40.0, "ms": [99.0] * 4} for _ in range(4)]
    got = script.state_curves(slow + mid + fast)
    low, high = got["low_bandwidth"], got["high_bandwidth"]
    assert low["sweeps"] == 3 and high["sweeps"] == 3  # the quartiles: the middle sweeps are in neither
    assert low["median_ms"] == [15.0, 15.5, 14.9, 18.0]
    assert low["t_of_n_ms"] == pytest.approx([15.0, 15.2, 15.2, 18.0])  # made non-decreasing
    assert high["t_of_n_ms"] == [10.0, 12.0, 14.0, 17.0]
    assert high["read_bandwidth_gbs"] == [60.1, 60.3]
    with pytest.raises(ValueError, match="no sweeps"):
        script.state_curves([])
