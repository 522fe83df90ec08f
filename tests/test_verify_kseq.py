"""SpecTr K-SEQ: the reconstructed formula is proven by the same distribution tests as the
other rules (the Markov simulation of tests/laws.py), a planted wrong variant is
caught by them, and the smallest feasible rho is checked against a scan."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from laws import N, P, Q, assert_detected, assert_lossless, random_pair, simulate
from specula.sampling import make_generator, sample_iid
from specula.tree import TokenTree
from specula.verify import (
    VerifyResult,
    _kseq_parts,
    kseq_acceptance,
    kseq_rho,
    verify_kseq,
    verify_rrs,
)


def kseq(tree, p, q, gen):
    return verify_kseq(tree, p, q, gen)


def torch_pair(rng: np.random.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`laws.random_pair` as float64 tensors."""
    p, q = random_pair(rng, vocab)
    return torch.from_numpy(p), torch.from_numpy(q)


def min_residual(p: torch.Tensor, q: torch.Tensor, k: int, rho: float) -> float:
    m, _, c = _kseq_parts(p, q, k, rho)
    return float((p - m * c).min())


# ---------------------------------------------------------------------------- losslessness
def test_kseq_is_lossless_on_iid_trees():
    # Depth-2 trees with 3 i.i.d. children at the root and 2 under each (test_verify.WIDTHS).
    assert_lossless(simulate(kseq, "iid", 4 * N, seed=21), N)


def test_kseq_with_rho_fixed_at_one_is_detected(monkeypatch):
    """Planted wrong rule: rho = 1 even where it is infeasible (the negative residual is
    clamped), i.e. accepting too eagerly. The same check must fail."""
    infeasible = sum(
        min_residual(P[r] / P[r].sum(), Q[r], 3, 1.0) < -1e-3 for r in range(len(P))
    )
    assert infeasible >= 2  # the Markov rows really need rho > 1 for 3 drafts
    monkeypatch.setattr("specula.verify.kseq_rho", lambda p, q, k: 1.0)
    assert_detected(simulate(kseq, "iid", 4 * N, seed=21), N)


def test_kseq_on_without_replacement_draws_is_detected():
    # K-SEQ assumes i.i.d. drafts; fed without-replacement siblings it is biased (TV ~0.24,
    # far above the bound even at 500 trials).
    assert_detected(simulate(kseq, "wor", 4 * 500, seed=23), 500)


# ---------------------------------------------------------------------------- rho and acceptance
def test_smallest_feasible_rho_matches_a_scan():
    rng = np.random.default_rng(0)
    moved = 0
    for _ in range(150):
        vocab, k = int(rng.integers(2, 12)), int(rng.integers(1, 9))
        p, q = torch_pair(rng, vocab)
        rho = kseq_rho(p, q, k)
        assert 1.0 <= rho <= k
        assert min_residual(p, q, k, rho) >= -1e-12  # feasible
        if rho > 1.0:
            moved += 1
            # Every rho below it (by more than rounding) is infeasible.
            for g in np.linspace(1.0, rho * (1 - 1e-6), 60):
                assert min_residual(p, q, k, float(g)) < 0, (rho, g, k)
    assert moved > 40  # the test exercised the search, not only rho = 1


def test_kseq_acceptance_formula_and_single_draft():
    rng = np.random.default_rng(1)
    for _ in range(50):
        p, q = torch_pair(rng, 7)
        # One draft: rho = 1 and acceptance is 1 - TV(p, q), as for chain speculative sampling.
        assert kseq_rho(p, q, 1) == 1.0
        assert kseq_acceptance(p, q, 1) == pytest.approx(float(torch.minimum(p, q).sum()), abs=1e-12)
        # More drafts never hurt: acceptance is non-decreasing in k and at most 1.
        acc = [kseq_acceptance(p, q, k) for k in range(1, 7)]
        assert all(b >= a - 1e-12 for a, b in zip(acc, acc[1:])) and acc[-1] <= 1 + 1e-12
    # q == p: every draft is accepted.
    assert kseq_acceptance(P[0], P[0], 4) == pytest.approx(1.0)


def test_empirical_root_acceptance_matches_the_formula():
    p, q = P[0], Q[0]
    k, trials = 3, 6000
    gen = make_generator(24)
    root = p.expand(k + 1, -1)
    hits = 0
    for _ in range(trials):
        tree = TokenTree.build(sample_iid(q, k, gen).tolist(), [-1] * k)
        hits += len(verify_kseq(tree, root, q.expand(k + 1, -1), gen).path) > 0
    expected = kseq_acceptance(p, q, k)
    stderr = math.sqrt(expected * (1 - expected) / trials)
    assert abs(hits / trials - expected) < 4 * stderr, (hits / trials, expected)


# ---------------------------------------------------------------------------- plumbing
def test_chain_equivalence():
    """With one child per node K-SEQ is chain speculative sampling: same uniforms, same result,
    on many random chains (so the chain rule's distribution tests cover this case)."""
    gen, gen_a, gen_b = make_generator(4), make_generator(5), make_generator(5)
    for _ in range(300):
        toks = sample_iid(Q[0], 3, gen).tolist()
        tree = TokenTree.chain(toks)
        rows = [0] + [t + 1 for t in toks]
        a = verify_kseq(tree, P[rows], Q[rows], gen_a)
        assert a == verify_rrs(tree, P[rows], Q[rows], gen_b, without_replacement=False)


def test_kseq_rejects_children_not_drawn_from_q():
    tree = TokenTree.build([0, 1], [-1, -1])
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    q = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.5, 0.5]])
    p[0] = torch.tensor([0.0, 1.0])  # force a rejection of child 0 so child 1 is tested
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_kseq(tree, p, q, make_generator(0))


def test_kseq_empty_tree_and_certain_acceptance():
    gen = make_generator(6)
    res = verify_kseq(TokenTree.empty(), P[:1], Q[:1], gen)
    assert res.path == () and P[0, res.next_token] > 0
    tree = TokenTree.build([1, 1], [-1, -1])
    one_hot = torch.tensor([[0.0, 1.0, 0.0]] * 3)
    assert verify_kseq(tree, one_hot, one_hot, gen) == VerifyResult((0,), 1)
