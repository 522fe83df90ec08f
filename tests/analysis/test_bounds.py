"""Optimal multi-draft acceptance: every fast scan equals brute force over all subsets H and
an independent linear program over couplings, on small vocabularies."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from laws import random_pair
from specula.analysis.bounds import (
    SCHEMES,
    alpha_coupling_lp,
    alpha_greedy,
    alpha_iid,
    alpha_subsets,
    alpha_without_replacement,
    draft_set_law,
    optimal_acceptance,
    wor_prefix_containment,
)

CURVES = {"iid": alpha_iid, "without_replacement": alpha_without_replacement, "greedy": alpha_greedy}


def cases(seed: int, count: int, max_vocab: int = 6):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield random_pair(rng, int(rng.integers(2, max_vocab + 1)))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_scan_equals_brute_force_over_all_subsets(scheme):
    n_max = 4
    for p, q in cases(seed=SCHEMES.index(scheme), count=60):
        curve = CURVES[scheme](p, q, n_max)
        brute = [alpha_subsets(p, q, n, scheme) for n in range(1, n_max + 1)]
        np.testing.assert_allclose(curve, brute, atol=1e-10, rtol=0)


def test_brute_force_tells_the_schemes_apart():
    # The comparison has power: the i.i.d. formula is wrong for draws without replacement.
    gaps = [abs(alpha_iid(p, q, 3)[2] - alpha_subsets(p, q, 3, "without_replacement"))
            for p, q in cases(seed=5, count=20)]
    assert max(gaps) > 0.05


@pytest.mark.parametrize("scheme", SCHEMES)
def test_min_cut_equals_the_coupling_linear_program(scheme):
    for p, q in cases(seed=10 + SCHEMES.index(scheme), count=12, max_vocab=5):
        for n in (1, 2, 3):
            lp = alpha_coupling_lp(p, q, n, scheme)
            assert lp == pytest.approx(optimal_acceptance(p, q, n, scheme), abs=1e-8)
            assert lp == pytest.approx(alpha_subsets(p, q, n, scheme), abs=1e-8)


def test_one_draft_is_one_minus_total_variation():
    for p, q in cases(seed=20, count=30, max_vocab=8):
        overlap = np.minimum(p, q).sum()
        for scheme in SCHEMES:
            assert optimal_acceptance(p, q, 1, scheme) == pytest.approx(overlap, abs=1e-10)


def test_without_replacement_dominates_iid_and_all_grow_with_n():
    # Each draw without replacement lands in H with probability <= q(H), so
    # Q_wor(S in H) <= q(H)^n and alpha*_wor >= alpha*_iid, for any p, q.
    for p, q in cases(seed=21, count=30, max_vocab=30):
        iid, wor = alpha_iid(p, q, 8), alpha_without_replacement(p, q, 8)
        assert (wor >= iid - 1e-10).all()
        for curve in (iid, wor, alpha_greedy(p, q, 8)):
            assert (np.diff(curve) >= -1e-10).all() and curve[-1] <= 1.0


def test_without_replacement_containment_matches_enumeration():
    rng = np.random.default_rng(22)
    for _ in range(20):
        vocab = int(rng.integers(3, 7))
        q = rng.dirichlet(np.ones(vocab) * 0.7)
        order = rng.permutation(vocab)
        k = int(rng.integers(1, vocab))  # first k tokens of the order, the rest outside
        contain = wor_prefix_containment(q[order[:k]], q[order[k:]].sum(), 4, vocab)
        for n in range(1, 5):
            law = draft_set_law(q, n, "without_replacement")
            for j in range(k + 1):
                inside = set(order[:j].tolist())
                exact = sum(prob for s, prob in law.items() if s <= inside)
                assert contain[j, n - 1] == pytest.approx(exact, abs=1e-11)


def test_q_convexity_of_without_replacement_containment():
    """The lemma behind the prefix scan: g(A, y)/q_y >= g(A - x, x)/q_x for x in A, y not in A,
    with g(A, y) = Q(S in A + y) - Q(S in A)."""
    rng = np.random.default_rng(23)
    for _ in range(40):
        vocab, n = int(rng.integers(3, 7)), int(rng.integers(2, 4))
        q = rng.dirichlet(np.ones(vocab) * rng.choice([0.2, 1.0]))
        law = draft_set_law(q, n, "without_replacement")

        def contain(a: set) -> float:
            return sum(prob for s, prob in law.items() if s <= a)

        for size in range(1, vocab):
            for a in itertools.combinations(range(vocab), size):
                a = set(a)
                for x, y in itertools.product(sorted(a), sorted(set(range(vocab)) - a)):
                    gain_y = (contain(a | {y}) - contain(a)) / q[y]
                    gain_x = (contain(a) - contain(a - {x})) / q[x]
                    assert gain_y >= gain_x - 1e-12


def test_greedy_scheme_edge_cases():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.6, 0.4, 0.0, 0.0])
    # Two drafts cover q's whole support: S = {0, 1} surely, alpha* = p(S) = 0.8.
    assert alpha_greedy(p, q, 3).tolist() == pytest.approx([0.8, 0.8, 0.8])
    assert alpha_iid(p, p, 1)[0] == pytest.approx(1.0)
    assert alpha_without_replacement(p, q, 3)[-1] == pytest.approx(0.8)
    for tiny in (1e-310, 5e-324):  # subnormal draw rates: the time grid must not overflow
        assert alpha_without_replacement(np.array([0.5, 0.5]), np.array([1.0, tiny]), 2).tolist() == \
            pytest.approx([0.5, 1.0])  # the second draw is the other token, however rare
        # two rare tokens alike: the second draw is either, half the time each (S = {0, 1} or {0, 2})
        assert alpha_without_replacement(np.array([0.2, 0.3, 0.5]), np.array([1.0, tiny, tiny]), 2).tolist() == \
            pytest.approx([0.2, 1.0], abs=1e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="same vocabulary"):
        alpha_iid(np.ones(3), np.ones(4), 2)
    with pytest.raises(ValueError, match="non-negative"):
        alpha_iid(np.array([1.0, -0.5]), np.ones(2), 2)
    with pytest.raises(ValueError, match=">= 1"):
        alpha_greedy(np.ones(3), np.ones(3), 0)
    with pytest.raises(ValueError, match="unknown draft scheme"):
        optimal_acceptance(np.ones(3), np.ones(3), 1, "beam")  # type: ignore[arg-type]
