"""`specula.logprobs`: each token's log-probability, rank and alternatives under its logit row."""

from __future__ import annotations

import math

import pytest
import torch

from specula.errors import ConfigError
from specula.logprobs import MAX_LOGPROBS, step_rows, step_rows_of, token_logprobs
from specula.sampling import SamplingParams


def test_logprob_rank_and_alternatives_follow_the_softmax_of_the_row():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0],
                           [0.5, 0.5, 3.0, 0.0]])  # [2, vocab 4]
    out = token_logprobs(logits, [2, 1], top=2)
    z0 = math.log(sum(math.exp(v) for v in (2.0, 0.0, 1.0, -1.0)))
    z1 = math.log(sum(math.exp(v) for v in (0.5, 0.5, 3.0, 0.0)))
    assert [e.token_id for e in out] == [2, 1]
    assert out[0].logprob == pytest.approx(1.0 - z0, abs=1e-6)
    assert out[1].logprob == pytest.approx(0.5 - z1, abs=1e-6)
    assert [e.rank for e in out] == [2, 2]  # token 0 beats token 2; only token 2 beats token 1 (a tie with 0)
    assert [t for t, _ in out[0].top] == [0, 2]
    assert out[0].top[0][1] == pytest.approx(2.0 - z0, abs=1e-6)
    assert out[1].top[0] == (2, pytest.approx(3.0 - z1, abs=1e-6))


def test_no_alternatives_asked_gives_none_and_any_dtype_is_read_as_float32():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    half = token_logprobs(logits.to(torch.bfloat16), [4, 0, 49], top=0)
    assert all(e.top == () for e in half)
    full = token_logprobs(logits.to(torch.bfloat16).float(), [4, 0, 49], top=0)
    assert half == full
    assert sum(math.exp(v) for _, v in token_logprobs(logits[:1], [0], top=50)[0].top) == pytest.approx(1.0, abs=1e-5)


def test_the_most_likely_token_has_rank_one_and_leads_its_alternatives():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(-1).tolist()
    for entry, tok in zip(token_logprobs(logits, best, top=3), best):
        assert entry.rank == 1 and entry.top[0][0] == tok
        assert entry.top[0][1] == pytest.approx(entry.logprob)
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def test_step_rows_are_the_root_then_each_accepted_node():
    assert step_rows(()) == [0]
    assert step_rows((0, 3, 7)) == [0, 1, 4, 8]


def test_rows_and_tokens_must_agree():
    with pytest.raises(ValueError, match=r"\[2, vocab\]"):
        token_logprobs(torch.zeros(3, 5), [1, 2], top=0)
    assert token_logprobs(torch.zeros(0, 5), [], top=3) == []


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True])
def test_sampling_params_refuse_a_bad_count(field, value):
    with pytest.raises(ConfigError, match=f"{field} must be an integer from 0 to {MAX_LOGPROBS}"):
        SamplingParams(**{field: value})


def test_sampling_params_take_zero_to_the_limit():
    params = SamplingParams(logprobs=0, prompt_logprobs=MAX_LOGPROBS)
    assert (params.logprobs, params.prompt_logprobs) == (0, MAX_LOGPROBS)


def test_a_steps_rows_are_a_view_on_a_chain_and_a_gather_elsewhere() -> None:
    """`step_rows_of` gives `rows[step_rows(path)]`: for every path of random trees, the same values; a view of the
    first rows where the path is the tree's first nodes (nothing accepted, a chain), else a copy."""
    import random

    from specula.tree import TokenTree

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(0, 9)
        parents = [rng.randrange(-1, i) for i in range(n)]  # each node after its parent
        tree = TokenTree.build(list(range(n)), parents, [0.5] * n, "x")
        rows = torch.randn(n + 1, 3)  # [n + 1, width]
        node = rng.randrange(-1, n)
        path = list(tree.path_to(node)) if node >= 0 else []
        got = step_rows_of(rows, path)
        assert torch.equal(got, rows[step_rows(path)])
        prefix = path == list(range(len(path)))
        assert (got.data_ptr() == rows.data_ptr() and got._base is not None) == prefix
