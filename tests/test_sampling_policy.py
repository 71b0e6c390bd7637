"""The sampling policy's greedy distribution and the row argmax it is built on."""

import pytest
import torch

from harness.verifiers.sampling import SamplingPolicy, argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_row_argmax_is_torchs_first_maximum_ties_and_nans_included(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1000, generator=g).to(dtype)
    x[1, 10] = x[1, 500] = x[1].max() + 1  # a tie: the first index wins
    x[2, 7] = float("nan")  # a NaN counts as the maximum
    x[3, :] = 0.0  # all equal: index 0
    x[4, -1] = float("inf")
    for rows in (x, x[5], x[:, ::3], x.T.contiguous().T):  # 2-D, 1-D, strided, transposed storage
        got = argmax_rows(rows)
        assert got.dtype == torch.long and torch.equal(got, rows.argmax(dim=-1))
    with torch.inference_mode():
        assert torch.equal(argmax_rows(x.clone()), x.argmax(dim=-1))


def test_the_greedy_distribution_is_the_one_hot_of_the_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [5.0, 1.0, 0.0, 4.0]])
    probs = SamplingPolicy().probs(logits)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert probs.dtype == torch.float32
    assert SamplingPolicy().probs(logits.double()).dtype == torch.float64


def _random_tree(g: torch.Generator, rows: int):
    """A tree of ``rows`` rows whose tokens are drawn from a few ids, so that argmaxes hit it."""
    from harness.contracts import ProposalResult
    from harness.topology.compiler import compile_tree

    paths, seen = [], set()
    while sum(len(p) for p in paths) < rows:
        depth = int(torch.randint(1, 4, (1,), generator=g))
        path = tuple(int(t) for t in torch.randint(0, 3, (depth,), generator=g))
        if path not in seen:
            seen.add(path)
            paths.append(list(path))
    proposal = ProposalResult.from_paths(paths, source="t", manifest_hash="h", probability_semantics="score_only")
    return compile_tree([proposal], prefix_len=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_selection_from_logits_is_selection_on_the_policys_law(dtype):
    """The round selects with ``select_logits``; the greedy verifier walks the logits' argmax there
    instead of building the one-hot. It must select exactly what ``select`` does on
    ``policy.probs(logits)``, ties (the first index) and NaN rows included."""
    from harness.random_source import TorchRandomSource
    from harness.verifiers import get_verifier

    greedy, policy = get_verifier("greedy"), SamplingPolicy()
    g = torch.Generator().manual_seed(1)
    accepted_somewhere = False
    for case in range(200):
        tree = _random_tree(g, int(torch.randint(1, 9, (1,), generator=g)))
        logits = torch.randn(1 + tree.num_rows, 8, generator=g)
        logits[:, :3] += 3.0  # argmaxes mostly among the tree's tokens: paths get accepted
        if case % 7 == 0:
            logits[0, 1] = logits[0, 2] = logits[0].max() + 1  # a tie at the frontier
        if case % 11 == 0:
            logits[-1, 5] = float("nan")
        if case % 13 == 0:
            logits[0, 6] = float("nan")  # at the frontier: a NaN counts as the maximum, nothing is accepted
        logits = logits.to(dtype)
        rng = TorchRandomSource(0)
        got = greedy.select_logits(tree, logits, policy, rng)
        want = greedy.select(tree, policy.probs(logits), rng)
        assert got == want
        accepted_somewhere |= len(got.accepted_rows) > 1
    assert accepted_somewhere


def test_select_logits_is_select_on_the_policys_law_for_every_verifier():
    """Every registered verifier but greedy selects through the base class's ``select_logits``, which
    is ``select`` on ``policy.probs``: the same draws from the same source give the same selection."""
    from harness.random_source import TorchRandomSource
    from harness.verifiers import get_verifier
    from harness.verifiers.base import VERIFIERS, Verifier

    overriding = {name for name, cls in VERIFIERS.items() if cls.select_logits is not Verifier.select_logits}
    assert overriding == {"greedy"}  # another override needs its own equivalence test, as greedy's above

    g = torch.Generator().manual_seed(2)
    tree = _random_tree(g, 6)
    logits = torch.randn(1 + tree.num_rows, 8, generator=g)
    for name, temperature in (("membership", 0.8), ("membership", 0.0), ("greedy", 0.0)):
        verifier, policy = get_verifier(name), SamplingPolicy(temperature=temperature)
        for seed in range(20):
            got = verifier.select_logits(tree, logits, policy, TorchRandomSource(seed))
            assert got == verifier.select(tree, policy.probs(logits), TorchRandomSource(seed))
