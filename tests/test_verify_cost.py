from harness.target.backend import CausalLMBackend
from harness.target.timing import verify_cost_curve


def test_verify_cost_curve_shape(tiny_model):
    backend = CausalLMBackend(tiny_model)
    prof = verify_cost_curve(backend, list(range(3, 40)), max_rows=10, reps=2)
    t = prof["normalised"]
    assert len(t) == 11 and t[0] == 1.0
    assert all(b >= a for a, b in zip(t, t[1:]))  # monotone: more rows never cost less
    assert prof["measured_rows"][0] == 0 and prof["measured_rows"][-1] == 10
