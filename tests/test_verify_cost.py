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
