"""SpecTr membership-cost transport (Sun et al., 2023): exact LP optimum and the bound on every verifier."""

from __future__ import annotations

import pytest
import torch

from harness.gates import oracle as O
from harness.gates.transport import (
    TOY_INSTANCE,
    candidate_set_supply,
    check_transport,
    membership_transport_optimum,
    transport_applies,
    transport_instances,
    verifier_membership_acceptance,
)
from harness.verifiers import VERIFIERS, get_verifier
from harness.verifiers import broken as _broken  # noqa: F401  (registers naive_multi_draft)


def test_toy_optimum_is_one():
    p, q, k = TOY_INSTANCE
    assert membership_transport_optimum(p, q, k) == pytest.approx(1.0, abs=1e-9)


def test_toy_supply_by_candidate_set():
    supply = candidate_set_supply((0.4, 0.4, 0.2), 2)
    assert supply[frozenset({0})] == pytest.approx(0.16, abs=1e-15)  # Q(a,a)
    assert supply[frozenset({0, 1})] == pytest.approx(0.32, abs=1e-15)  # Q(a,b) + Q(b,a)
    assert supply[frozenset({0, 2})] == pytest.approx(0.16, abs=1e-15)  # Q(a,c) + Q(c,a)
    assert supply[frozenset({2})] == pytest.approx(0.04, abs=1e-15)  # Q(c,c)
    assert sum(supply.values()) == pytest.approx(1.0, abs=1e-15)


def test_one_candidate_optimum_is_maximal_coupling():
    gen = torch.Generator().manual_seed(11)
    for vocab in (2, 3, 5):
        p = O.random_law(gen, vocab)
        q = O.random_law(gen, vocab, zeros=1)
        overlap = float(torch.minimum(p, q).sum())  # 1 - TV (one draft is a maximal coupling)
        assert membership_transport_optimum(p.tolist(), q.tolist(), 1) == pytest.approx(overlap, abs=1e-9)


def test_optimum_limited_by_unreachable_demand():
    # every draft is token 1; the target puts 0.5 on token 0: at most 0.5 can be a candidate
    assert membership_transport_optimum((0.5, 0.5), (0.0, 1.0), 3) == pytest.approx(0.5, abs=1e-9)
    # more candidates never lower the optimum
    p, q = (0.5, 0.3, 0.2), (0.6, 0.3, 0.1)
    values = [membership_transport_optimum(p, q, k) for k in (1, 2, 3)]
    assert values[0] == pytest.approx(0.9, abs=1e-9)
    assert values[0] <= values[1] + 1e-12 <= values[2] + 2e-12


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="probability vector"):
        membership_transport_optimum((0.5, 0.6), (0.5, 0.5), 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        membership_transport_optimum((0.5, 0.5), (0.5, 0.5), 0)


def test_no_exact_verifier_exceeds_the_optimum():
    names = [n for n in O.exact_verifier_names() if transport_applies(VERIFIERS[n]())]
    assert {"specinfer", "membership", "rejection"} <= set(names)
    instances = transport_instances(count=4, seed=1)
    checked = 0
    for name in names:
        verifier = VERIFIERS[name]()
        for case_name, p, q, k in instances:
            if ("set" if k > 1 else "sequence") not in verifier.topologies:
                continue
            row = check_transport(verifier, name=case_name, p=p, q=q, k=k)
            assert row["acceptance"] <= row["optimum"] + 1e-9, row
            checked += 1
    assert checked >= 10


def test_one_draft_rejection_attains_the_optimum():
    # with k = 1 the accept/reject rule IS the maximal coupling: acceptance == optimum
    p, q = (0.5, 0.3, 0.2), (0.4, 0.4, 0.2)
    opt = membership_transport_optimum(p, q, 1)
    assert opt == pytest.approx(0.9, abs=1e-9)
    assert verifier_membership_acceptance(get_verifier("rejection"), p, q, 1) == pytest.approx(opt, abs=1e-12)


def test_the_broken_verifier_exceeds_the_optimum():
    # duplicated mass: naive outputs the duplicated draft 1 - 2^-3 of the time; no valid coupling can exceed 0.5
    acc = verifier_membership_acceptance(get_verifier("naive_multi_draft"), (0.5, 0.5), (0.0, 1.0), 3)
    assert acc == pytest.approx(0.875, abs=1e-12)
    assert acc > membership_transport_optimum((0.5, 0.5), (0.0, 1.0), 3) + 0.3


def test_a_non_finite_acceptance_fails_the_transport_row(monkeypatch):
    """``max(0.0, nan)`` is 0.0: a NaN acceptance passed the row."""
    import harness.gates.transport as transport

    monkeypatch.setattr(transport, "verifier_membership_acceptance", lambda *a, **k: float("nan"))
    row = check_transport(get_verifier("specinfer"), name="nan", p=[0.5, 0.5], q=[0.5, 0.5], k=2)
    assert row["passed"] is False and row["max_abs_error"] != row["max_abs_error"]
