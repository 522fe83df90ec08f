"""`specula.penalties`: repetition, frequency and presence penalties and a logit bias, per row of a
tree by that row's own history."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specula.errors import ConfigError
from specula.penalties import PenalizedLogits, penalize
from specula.sampling import SamplingParams
from specula.tree import TokenTree


def test_each_penalty_follows_its_rule():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    out = penalize(row, Counter({3: 2, 4: 1}), [0, 1],
                   SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                                  logit_bias={2: 1.0, 4: -1.0}))
    # 0, 1: the prompt's (repetition only); 2: bias only; 3, 4: the output's (all three, bias first)
    assert out.tolist() == pytest.approx([1.0, -2.0, 1.5, 3.0 / 2 - 2 * 0.5 - 0.25, (-2.0 - 1.0) * 2 - 0.5 - 0.25])
    assert row.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # the input is left alone


def test_neutral_parameters_change_nothing():
    row = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(penalize(row, Counter({1: 3}), [2, 5], SamplingParams()), row)
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=0.1).penalized


def test_tree_rows_are_penalised_by_their_own_paths():
    """Row i + 1 counts the output, then the tokens from the root's child to node i."""
    tree = TokenTree.build([7, 7, 3], [-1, 0, -1])  # 7 -> 7, and 3 beside
    logits = torch.zeros(4, 10)
    params = SamplingParams(frequency_penalty=1.0)
    rows = PenalizedLogits(logits, tree, prompt=[1, 2], generated=[3], params=params)
    assert rows[0][3] == -1 and rows[0][7] == 0  # the output so far: one 3
    assert rows[1][7] == -1 and rows[2][7] == -2  # one 7, then two on the path 7 -> 7
    assert rows[3][3] == -2 and rows[3][7] == 0  # 3 twice: the output's and its own
    assert rows.full().shape == (4, 10)


def test_the_greedy_walk_uses_the_penalised_argmax():
    tree = TokenTree.build([4, 4], [-1, 0])
    logits = torch.zeros(3, 6)
    logits[:, 4] = 1.0  # 4 leads every raw row...
    logits[:, 5] = 0.9
    rows = PenalizedLogits(logits, tree, prompt=[0], generated=[], params=SamplingParams(presence_penalty=0.5))
    assert rows.argmax(-1).tolist() == [4, 5, -1]  # ...until the output holds a 4: the walk stops there


@pytest.mark.parametrize("fields, words", [
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be between -2 and 2"),
    ({"presence_penalty": -3}, "presence_penalty must be between -2 and 2"),
    ({"logit_bias": {5: 101}}, "logit_bias values must be numbers between -100 and 100"),
    ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
])
def test_bad_values_are_refused_naming_the_range(fields, words):
    with pytest.raises(ConfigError, match=words):
        SamplingParams(**fields)
