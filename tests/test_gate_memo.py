"""The statistical gate's sharing (the fixed-prefix memo, the draft's law tables, the target's rows
by path) changes nothing but time: for every parametric proposer kind, on tiny models, the gate with
and without it gives identical observed counts, distinct trees and prefix for the same seed, and
the same statistic up to the rounding of rows computed in other forwards; the prefix scan finds a cut where the proposer
proposes, and reports none when it never does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.config import compose
from harness.gates.statistical import choose_prefix, statistical_gate
from harness.proposers.base import NullProposer
from harness.proposers.memo import FixedPrefixMemo
from harness.runner import load, plan_job, prepare_job

PROMPTS = [
    {"id": "p0", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"},
    {"id": "p1", "prompt": "for i in range(3):\n    print(i)\nfor i in range(3):\n"},
]

#: (label, overrides, verifier): every parametric proposer kind the runner admits at T > 0
KINDS = [
    ("draft_model iid chain", ["proposer=draft_model", "proposer.sampling=iid", "topology=sequence"], "rejection"),
    (
        "draft_model wor [2,2]",
        [
            "proposer=draft_model",
            "proposer.sampling=without_replacement",
            "topology=expansion",
            "topology.widths=[2,2]",
        ],
        "sequoia",
    ),
    ("draft_model beam chain", ["proposer=draft_model", "proposer.sampling=beam", "topology=sequence"], "membership"),
    ("medusa iid chain", ["proposer=medusa", "proposer.sampling=iid", "topology=sequence"], "rejection"),
    ("hydra iid chain", ["proposer=hydra", "proposer.sampling=iid", "topology=sequence"], "specinfer"),
    ("clover beam chain", ["proposer=clover", "proposer.sampling=beam", "topology=sequence"], "membership"),
    ("eagle iid chain", ["proposer=eagle", "proposer.sampling=iid", "topology=sequence"], "rejection"),
    ("eagle wor dynamic", ["proposer=eagle", "proposer.sampling=without_replacement", "topology=dynamic"], "sequoia"),
    (
        "early_exit iid",
        [
            "proposer=early_exit",
            "proposer.sampling=iid",
            "proposer.exit_layer=1",
            "proposer.eta=0",
            "topology=sequence",
        ],
        "rejection",
    ),
    ("eagle beam dynamic", ["proposer=eagle", "proposer.sampling=beam", "topology=dynamic"], "membership"),
    (
        "merged draft+lookup",
        ["proposer=merged", "topology=merged", "proposer.sources=[draft_model,prompt_lookup]"],
        "membership",
    ),
    (
        "layer_skip iid",
        [
            "proposer=layer_skip",
            "proposer.sampling=iid",
            "proposer.skip=[1]",
            "proposer.threshold.gamma=0",
            "topology=sequence",
        ],
        "rejection",
    ),
]

TRAINED = ("medusa", "hydra", "clover", "eagle", "early_exit")


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate_memo")
    path = root / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return root, path


def prepared(root: Path, path: Path, overrides: list[str], verifier: str):
    ov = [
        "model=tiny",
        "workload=jsonl",
        f"workload.path={path}",
        "workload.chat=false",
        *overrides,
        f"verifier={verifier}",
        "generation.temperature=1.0",
        "threads=1",
        "tracking=none",
    ]
    if any(o.startswith(f"proposer={k}") for k in TRAINED for o in overrides):
        ov.append("proposer.data.token_budget=400")
    cfg = compose(ov)
    planned = plan_job(cfg, root / "run")
    loaded = load(cfg, planned)
    prep = prepare_job(cfg, planned, loaded)
    return loaded, prep


@pytest.mark.parametrize("label,overrides,verifier", KINDS, ids=[k[0] for k in KINDS])
def test_the_memo_changes_nothing_but_time(workload, monkeypatch, label, overrides, verifier):
    root, path = workload
    monkeypatch.setenv("HARNESS_CACHE", str(root / "cache"))
    loaded, prep = prepared(root, path, overrides, verifier)
    prompts = [list(item[1]) for item in loaded.items]
    proposer = prep.proposers[0]
    before = (repr(proposer.stats), proposer.state_bytes())
    runs = []
    for memo in (True, False):
        torch.manual_seed(123)  # nothing may read the global generator; a change here must not matter
        runs.append(
            statistical_gate(
                backend=loaded.backend,
                proposer=proposer,
                verifier=prep.plan.verifier,
                policy=prep.plan.policy,
                prompts=prompts,
                samples=200,
                top_m=8,
                alpha=1e-3,
                seed=0,
                max_nodes=prep.plan.budget.max_nodes,
                max_depth=prep.plan.budget.max_depth,
                confirm=False,
                memo=memo,
            )
        )
    with_memo, without = runs
    # the run measures this proposer next: the gate's proposals leave its counters as they were
    assert (repr(proposer.stats), proposer.state_bytes()) == before
    assert with_memo["status"] in ("passed", "failed")
    for k in ("observed", "distinct_trees", "prefix_len"):
        assert with_memo[k] == without[k], k
    for k in ("p_value", "statistic"):  # the expected counts come from a frontier row computed in another forward
        assert with_memo[k] == pytest.approx(without[k], rel=1e-5, abs=1e-9), k
    timeless = [{k: v for k, v in r["prefix"].items() if k != "seconds"} for r in runs]
    assert timeless[0] == timeless[1]
    served = with_memo["memo_hits"] + with_memo.get("law_hits", 0)
    assert served > 0 and without["memo"] is False
    assert with_memo["prefix"]["probe_rows"] > 0
    assert with_memo["draft_calls"] + served >= 200  # every sample made a draft call
    # the target side by path: no row twice, so never more rows than the distinct trees hold
    assert 1 <= with_memo["target_rows"] <= without["target_rows"]


def test_the_prefix_scan_reports_a_proposer_that_never_proposes(workload, monkeypatch):
    from harness.contracts import Budget
    from harness.target.backend import CausalLMBackend
    from harness.target.loading import build_tiny_model

    backend = CausalLMBackend(build_tiny_model(seed=0))
    proposer = NullProposer(budget=Budget(shape="sequence", max_nodes=4, max_depth=4), manifest_hash="none")
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    prefix, how = choose_prefix(backend, proposer, prompts, stream=0, max_nodes=4, max_depth=4)
    assert prefix is None and how["probes"] == 4 + 2 and how["prompts_scanned"] == 2


def test_a_memo_serves_one_prefix_only():
    memo = FixedPrefixMemo()
    memo.begin([1, 2, 3])
    assert memo.run("a", lambda: 1) == 1 and memo.run("b", lambda: 2) == 2
    memo.end()
    memo.begin([1, 2, 3])
    assert memo.run("a", lambda: 10) == 1 and memo.run("c", lambda: 3) == 3  # a hit, then a new history
    assert (memo.hits, memo.misses) == (1, 3)
    with pytest.raises(ValueError, match="one prefix"):
        memo.begin([1, 2])


@pytest.mark.parametrize("memo", [True, False], ids=["by_path", "whole_trees"])
def test_the_statistical_gate_selects_through_the_verifiers_own_logits_path(workload, monkeypatch, memo):
    """A round calls the verifier's ``select_logits``; the gate must sample that path, not ``select``.
    A verifier whose own logits path drops the run's top-p passes a gate that calls ``select`` on the
    policy's law, and fails one that selects as the round does."""
    from harness.verifiers.builtin import RejectionVerifier
    from harness.verifiers.sampling import SamplingPolicy

    class UntruncatedFastPath(RejectionVerifier):  # WRONG: its logits path ignores top-k and top-p
        def select_logits(self, tree, logits, policy, rng):
            return self.select(tree, SamplingPolicy(temperature=policy.temperature).probs(logits), rng)

    root, path = workload
    monkeypatch.setenv("HARNESS_CACHE", str(root / "cache"))
    loaded, prep = prepared(
        root, path, ["proposer=draft_model", "proposer.sampling=iid", "topology=sequence"], "rejection"
    )
    policy = SamplingPolicy(temperature=1.0, top_p=0.3)
    prompts = [list(item[1]) for item in loaded.items]

    def gate(verifier):
        return statistical_gate(
            backend=loaded.backend,
            proposer=prep.proposers[0],
            verifier=verifier,
            policy=policy,
            prompts=prompts,
            samples=400,
            top_m=8,
            alpha=1e-3,
            seed=0,
            max_nodes=prep.plan.budget.max_nodes,
            max_depth=prep.plan.budget.max_depth,
            confirm=False,
            memo=memo,
        )

    assert gate(RejectionVerifier())["status"] == "passed"
    wrong = gate(UntruncatedFastPath())
    assert wrong["status"] == "failed", {k: wrong.get(k) for k in ("status", "p_value", "reason")}
