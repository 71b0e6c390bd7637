"""The measured round loop and the gates that test sampled rounds run one round step
(:func:`~harness.engine.decode.propose_round`, ``compile_round``, ``select_round``, ``round_tokens``):
a step that selects under another policy than the run's fails the statistical gate, and each piece
of the step is what ``decode_batch``, the statistical gate and the end-to-end oracle call."""

from __future__ import annotations

import json

import pytest

from harness.config import compose
from harness.contracts import Budget, ContractError, ProposalResult
from harness.engine import decode as engine_decode
from harness.engine.decode import RoundConfig, decode, propose_round
from harness.gates.e2e import E2E_PROMPT, E2EModels, e2e_output_law
from harness.gates.statistical import statistical_gate
from harness.proposers.base import NullProposer
from harness.proposers.draft_model import DraftModelProposer
from harness.random_source import TorchRandomSource
from harness.runner import load, plan_job, prepare_job
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy

PROMPTS = [
    {"id": "p0", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"},
    {"id": "p1", "prompt": "for i in range(3):\n    print(i)\nfor i in range(3):\n"},
]

POLICY = SamplingPolicy(temperature=1.0)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("round_step")
    path = root / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("HARNESS_CACHE", str(root / "cache"))
    cfg = compose(
        [
            "model=tiny",
            "workload=jsonl",
            f"workload.path={path}",
            "workload.chat=false",
            "proposer=draft_model",
            "proposer.sampling=iid",
            "proposer.model.num_layers=1",  # a draft that differs from the target: both ways to a first token
            "topology=sequence",
            "verifier=rejection",
            "generation.temperature=1.0",
            "threads=1",
            "tracking=none",
        ]
    )
    planned = plan_job(cfg, root / "run")
    loaded = load(cfg, planned)
    prep = prepare_job(cfg, planned, loaded)
    yield loaded, prep
    mp.undo()


def gate(loaded, prep, *, memo=True):
    return statistical_gate(
        backend=loaded.backend,
        proposer=prep.proposers[0],
        verifier=get_verifier("rejection"),
        policy=POLICY,
        prompts=[list(item[1]) for item in loaded.items],
        samples=400,
        top_m=8,
        alpha=1e-3,
        seed=0,
        max_nodes=prep.plan.budget.max_nodes,
        max_depth=prep.plan.budget.max_depth,
        confirm=False,
        memo=memo,
    )


def _cold_select_round(verifier, tree, logits, policy, rng):  # WRONG: selects under temperature 0.25
    return verifier.select_logits(tree, logits, SamplingPolicy(temperature=0.25), rng)


def _step_called(*args, **kwargs):  # raises: shows who calls the step
    raise LookupError("the shared round step was called")


def replace_body(monkeypatch, fn, body) -> None:
    """``fn`` runs ``body``'s code wherever it is called from (whoever imported it by name)."""
    monkeypatch.setattr(fn, "__code__", body.__code__)


@pytest.mark.parametrize("memo", [True, False], ids=["memo", "whole_trees"])
def test_a_round_step_that_selects_under_another_temperature_fails_the_statistical_gate(prepared, monkeypatch, memo):
    """The gate sampled its own compile-and-select loop: a round step handing the verifier another
    policy than the run's passed every gate."""
    loaded, prep = prepared
    ok = gate(loaded, prep, memo=memo)
    assert ok["status"] == "passed", {k: ok.get(k) for k in ("status", "p_value", "observed", "expected")}
    assert 0 < ok["first_token_accepted"] < ok["samples"]  # both ways to a first token were sampled
    replace_body(monkeypatch, engine_decode.select_round, _cold_select_round)
    wrong = gate(loaded, prep, memo=memo)
    assert wrong["status"] == "failed", {k: wrong.get(k) for k in ("status", "p_value", "observed", "expected")}


@pytest.mark.parametrize("piece", ["propose_round", "compile_round", "select_round", "round_tokens"])
def test_the_measured_loop_and_both_sampled_round_gates_call_each_piece_of_the_step(prepared, monkeypatch, piece):
    """Each piece of the step is on the measured path (``decode``), the statistical gate's sampler and the
    end-to-end oracle's round."""
    loaded, prep = prepared
    models = E2EModels.build()
    oracle_proposer = DraftModelProposer(
        budget=Budget(shape="sequence", max_nodes=2, max_depth=2),
        manifest_hash="e2e",
        policy=POLICY,
        backend=models.draft,
        sampling="iid",
    )
    budget = prep.plan.budget
    replace_body(monkeypatch, getattr(engine_decode, piece), _step_called)
    with pytest.raises(LookupError, match="the shared round step was called"):
        decode(
            target=loaded.backend,
            proposer=prep.proposers[0],
            verifier=get_verifier("rejection"),
            policy=POLICY,
            prompt_ids=list(loaded.items[0][1]),
            max_new_tokens=4,
            eos_token_ids=frozenset(),
            rng=TorchRandomSource(0),
            round_cfg=RoundConfig(max_nodes=budget.max_nodes, max_depth=budget.max_depth),
        )
    with pytest.raises(LookupError, match="the shared round step was called"):
        gate(loaded, prep)
    with pytest.raises(LookupError, match="the shared round step was called"):
        e2e_output_law(
            target=models.target,
            proposer=oracle_proposer,
            verifier=get_verifier("rejection"),
            policy=POLICY,
            prompt_ids=E2E_PROMPT,
            length=1,
        )


class _DepthReader(NullProposer):
    """Proposes nothing, and notes the depth cap it proposed under."""

    def __init__(self, manifest_hash: str = "h") -> None:
        super().__init__(budget=Budget(shape="sequence", max_nodes=4, max_depth=4), manifest_hash=manifest_hash)
        self.seen: list[int | None] = []

    def propose(self, committed, rng):
        self.seen.append(self.depth_cap)
        return ProposalResult.empty_result(source=self.name, manifest_hash="h")


@pytest.mark.parametrize(
    "max_depth,tokens_left,depth,cap",
    [(4, None, 4, None), (4, 9, 4, None), (4, 5, 4, None), (4, 3, 2, 2), (4, 1, 0, 0), (None, 3, 2, 2)],
)
def test_the_round_step_caps_the_depth_at_what_the_round_can_commit(max_depth, tokens_left, depth, cap):
    proposer = _DepthReader()
    _, got = propose_round(proposer, [1, 2], TorchRandomSource(0), max_depth=max_depth, tokens_left=tokens_left)
    assert (got, proposer.seen, proposer.depth_cap) == (depth, [cap], None)  # the cap is the round's only


def test_a_proposal_bound_to_another_manifest_is_refused_by_the_round_step():
    proposer = _DepthReader(manifest_hash="other")
    with pytest.raises(ContractError, match="bound to manifest 'h', not its own 'other'"):
        propose_round(proposer, [1, 2], TorchRandomSource(0), max_depth=4, tokens_left=2)
    assert proposer.seen == [1] and proposer.depth_cap is None
