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
