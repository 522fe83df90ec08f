"""The drafting loop's C ops (`kernels/draft.c`): each row's top-k children with their softmax
probabilities, as torch's topk and logsumexp give them, and each row's top-k ids alone (what token
recycling learns from a verified pass)."""

from __future__ import annotations

import pytest
import torch

from specula.models.native import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")


@pytest.mark.parametrize("rows,vocab,k", [(1, 8192, 8), (8, 8192, 8), (3, 13, 5), (2, 7, 7), (2, 151936, 4), (4, 20, 1)])
def test_top_k_probs_equals_torchs_topk_and_softmax(rows, vocab, k):
    torch.manual_seed(rows * vocab + k)
    logits = torch.randn(rows, vocab) * 4  # [n, V]
    probs, idx = kernels.top_k_probs(logits, k)
    top = logits.topk(k, dim=-1)
    assert torch.equal(idx, top.indices)
    want = (top.values - logits.logsumexp(-1, keepdim=True)).exp()
    torch.testing.assert_close(probs, want, rtol=5e-5, atol=1e-8)


@pytest.mark.parametrize("rows,vocab,k", [(1, 49152, 8), (9, 49152, 8), (3, 13, 5), (2, 7, 7), (2, 151936, 16),
                                         (4, 20, 1), (3, 100, 8)])
def test_top_k_ids_equals_torchs_topk(rows, vocab, k):
    torch.manual_seed(rows * vocab + k)
    logits = torch.randn(rows, vocab) * 4  # [n, V]; 100 = three 32-value blocks and a tail of 4
    assert torch.equal(kernels.top_k_ids(logits, k), logits.topk(k, dim=-1).indices)
    ascending = torch.arange(vocab, dtype=torch.float32).repeat(rows, 1)  # every block beats the k-th best so far
    assert torch.equal(kernels.top_k_ids(ascending, k), ascending.topk(k, dim=-1).indices)


def test_top_k_ids_breaks_ties_by_the_lower_index_and_never_picks_nan_wherever_it_lies():
    logits = torch.zeros(3, 84)  # two 32-value blocks, two vectors of 8, a tail of 4
    logits[0, 70] = 2.0
    logits[1, :3] = float("nan")
    logits[2, 33] = float("nan")  # a NaN in the same vector as the best value must not hide it
    logits[2, 34] = 5.0
    logits[2, 83] = 4.0
    assert kernels.top_k_ids(logits, 4).tolist() == [[70, 0, 1, 2], [3, 4, 5, 6], [34, 83, 0, 1]]
    with pytest.raises(ValueError, match="k <= 5"):
        kernels.top_k_ids(torch.zeros(1, 5), 6)
    with pytest.raises(ValueError, match="float32"):
        kernels.top_k_ids(torch.zeros(1, 5, dtype=torch.float64), 2)


def test_top_k_probs_breaks_ties_by_the_lower_index_and_never_picks_nan():
    logits = torch.zeros(2, 16)
    logits[0, 9] = 2.0
    logits[1, :3] = float("nan")
    probs, idx = kernels.top_k_probs(logits, 4)
    assert idx.tolist() == [[9, 0, 1, 2], [3, 4, 5, 6]]
    torch.testing.assert_close(probs[1], torch.full((4,), 1 / 13))  # the 13 non-NaN logits share the mass
    assert probs[0, 0] > probs[0, 1] == probs[0, 3]


def test_top_k_probs_shares_the_mass_among_the_plus_inf_logits_as_softmaxs_limit():
    logits = torch.randn(2, 21)  # 21: the 8-lane loop and the tail both see an inf
    logits[0, 3] = logits[0, 19] = float("inf")
    logits[1, 5] = float("inf")
    probs, idx = kernels.top_k_probs(logits, 3)
    assert idx[:, 0].tolist() == [3, 5] and idx[0, 1] == 19
    assert probs.tolist()[0][:2] == [0.5, 0.5] and probs.tolist()[1][0] == 1.0
    assert probs[0, 2] == probs[1, 1] == probs[1, 2] == 0.0  # never NaN


def test_top_k_probs_refuses_a_k_beyond_the_row_and_other_dtypes():
    with pytest.raises(ValueError, match="k <= 5"):
        kernels.top_k_probs(torch.zeros(1, 5), 6)
    with pytest.raises(ValueError, match="float32"):
        kernels.top_k_probs(torch.zeros(1, 5, dtype=torch.float64), 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_before_quantizing(bad):
    """A NaN weight reached an int8 cast in C (undefined behaviour; gcc gave 0), an infinite one
    zeroed its group with an infinite scale: a one-line error instead."""
    from specula.errors import ConfigError
    from specula.models.native.kernels.packing import quantize_groups, quantize_rows

    weight = torch.randn(4, 70)
    weight[2, 5] = bad
    for quantize in (quantize_rows, lambda w: quantize_groups(w, 64)):
        with pytest.raises(ConfigError, match="NaN or infinite"):
            quantize(weight)
