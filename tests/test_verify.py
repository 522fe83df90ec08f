"""Acceptance rules: greedy exactness, losslessness (distribution tests), edge cases.

The distribution tests simulate decoding on a small Markov "language": the target
distribution after token t is P[t + 1] (P[0] at the start), the draft's is Q[t + 1]. Each
step drafts a tree by the rule's own sampling scheme, verifies it, and decoding continues
until two tokens are emitted; the empirical law of the first token and of the first two
tokens jointly must match the exact target law P[0][a] * P[a + 1][b]. The bound shrinks
with the number of trials, and a planted wrong rule must fail the same check.
"""

from __future__ import annotations

import math

import pytest
import torch

from specula.sampling import SamplingParams, make_generator, probabilities
from specula.tree import TokenTree
from specula.verify import (
    VerifyResult,
    _residual,
    sample_iid,
    sample_without_replacement,
    verify,
    verify_chain,
    verify_deterministic,
    verify_greedy,
    verify_rrs,
)

V = 5
# Row 0: start; row t + 1: after token t. Zeros in P; Q puts mass where P has none.
P = torch.tensor(
    [
        [0.35, 0.25, 0.20, 0.20, 0.00],
        [0.10, 0.50, 0.00, 0.15, 0.25],
        [0.40, 0.05, 0.30, 0.25, 0.00],
        [0.00, 0.20, 0.20, 0.10, 0.50],
        [0.30, 0.30, 0.10, 0.00, 0.30],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ],
    dtype=torch.float64,
)
Q = torch.tensor(
    [
        [0.05, 0.12, 0.45, 0.08, 0.30],
        [0.30, 0.20, 0.30, 0.10, 0.10],
        [0.10, 0.40, 0.10, 0.10, 0.30],
        [0.25, 0.25, 0.25, 0.05, 0.20],
        [0.05, 0.45, 0.20, 0.20, 0.10],
        [0.40, 0.10, 0.10, 0.10, 0.30],
    ],
    dtype=torch.float64,
)
EXACT_FIRST = P[0]  # [V]
EXACT_JOINT = P[0][:, None] * P[1:]  # [V, V]: P(first = a, second = b)


# ---------------------------------------------------------------------------- simulation
WIDTHS = {"iid": (3, 2), "wor": (3, 2), "det": (4, 2)}  # children at depth 1, per depth-1 node


def draft_tree(ctx: int, scheme: str, gen: torch.Generator) -> TokenTree:
    """Draft a depth-2 tree (or a chain of 3) after context row `ctx` of Q by the scheme's own
    sampling: iid (sample_iid) | wor (sample_without_replacement) | det (fixed top-q tokens)
    | chain (each token drawn from q after the previous one)."""
    widths = WIDTHS.get(scheme, (1, 1))
    tokens: list[int] = []
    parents: list[int] = []

    def children(row: int, k: int) -> list[int]:
        if scheme == "iid":
            return sample_iid(Q[row], k, gen).tolist()
        if scheme == "wor":
            return sample_without_replacement(Q[row], k, gen).tolist()
        if scheme == "det":  # fixed candidates: the top-k tokens of q (may include p = 0 tokens)
            return Q[row].topk(k).indices.tolist()
        raise AssertionError(scheme)

    if scheme == "chain":  # chain of 3, each token drawn from q after the previous one
        row = ctx
        for i in range(3):
            tok = int(sample_iid(Q[row], 1, gen))
            tokens.append(tok)
            parents.append(i - 1)
            row = tok + 1
        return TokenTree.build(tokens, parents)
    for tok in children(ctx, widths[0]):
        tokens.append(tok)
        parents.append(-1)
    for node in range(len(tokens)):
        for tok in children(tokens[node] + 1, widths[1]):
            tokens.append(tok)
            parents.append(node)
    return TokenTree.build(tokens, parents)


def rows_for(tree: TokenTree, ctx: int) -> list[int]:
    return [ctx] + [t + 1 for t in tree.tokens]


def simulate(rule, scheme: str, trials: int, seed: int) -> torch.Tensor:
    """First two emitted tokens of `trials` decodes: LongTensor [trials, 2]."""
    gen = make_generator(seed)
    out = torch.empty((trials, 2), dtype=torch.long)
    for t in range(trials):
        emitted: list[int] = []
        ctx = 0
        while len(emitted) < 2:
            tree = draft_tree(ctx, scheme, gen)
            idx = rows_for(tree, ctx)
            res = rule(tree, P[idx], Q[idx], gen)
            emitted += res.tokens(tree)
            ctx = emitted[-1] + 1
        out[t] = torch.tensor(emitted[:2])
    return out


def tv(samples: torch.Tensor, exact: torch.Tensor) -> float:
    """Total variation between the empirical law of `samples` (int codes) and `exact`."""
    counts = torch.bincount(samples, minlength=exact.numel()).double()
    return 0.5 * float((counts / counts.sum() - exact.flatten()).abs().sum())


def tv_bound(exact: torch.Tensor, n: int, c: float = 4.0) -> float:
    """c times the expected TV of n exact samples (sum sqrt(p(1-p)) / sqrt(2 pi n)): c' / sqrt(n)."""
    e = exact.flatten()
    return c * float((e * (1 - e)).sqrt().sum()) / math.sqrt(2 * math.pi * n)


def law_checks(samples: torch.Tensor, n: int) -> dict[str, bool]:
    """TV of first-token and joint laws at n and 4n trials against bounds ~ 1/sqrt(trials)."""
    first = samples[:, 0]
    joint = samples[:, 0] * V + samples[:, 1]
    checks = {}
    for m in (n, 4 * n):
        checks[f"first@{m}"] = tv(first[:m], EXACT_FIRST) < tv_bound(EXACT_FIRST, m)
        checks[f"joint@{m}"] = tv(joint[:m], EXACT_JOINT) < tv_bound(EXACT_JOINT, m)
    return checks


def assert_lossless(samples: torch.Tensor, n: int) -> None:
    checks = law_checks(samples, n)
    assert all(checks.values()), checks
    # Tokens with target probability 0 are never emitted.
    joint = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V).view(V, V)
    assert (joint[EXACT_JOINT == 0] == 0).all()


def assert_detected(samples: torch.Tensor, n: int) -> None:
    checks = law_checks(samples, n)
    assert not checks[f"joint@{4 * n}"] or not checks[f"first@{4 * n}"], checks


N = 2500  # checks at N and 4N trials


# ---------------------------------------------------------------------------- planted wrong rules
def wrong_rrs_correction_from_p(tree, p, q, gen):
    """RRS (iid) that samples the correction from the unmodified p instead of the residual."""
    u = torch.rand(len(tree), generator=gen, dtype=torch.float64).tolist()
    path, r = [], 0
    while True:
        kids = tree.children[r]
        accepted = -1
        for c in kids:
            x = tree.tokens[c]
            if u[c] < float(p[r, x] / q[r, x]):
                accepted = c
                break
        if accepted < 0:
            return VerifyResult(tuple(path), int(torch.multinomial(p[r], 1, generator=gen)))
        path.append(accepted)
        r = accepted + 1


def wrong_deterministic_no_renorm(tree, p, q, gen):
    """Deterministic rule that accepts x_j with the original P(x_j) (no renormalisation)."""
    u = torch.rand(len(tree), generator=gen, dtype=torch.float64).tolist()
    path, r = [], 0
    while True:
        row = p[r].clone()
        accepted = -1
        for c in tree.children[r]:
            x = tree.tokens[c]
            if u[c] < float(p[r, x]):
                accepted = c
                break
            row[x] = 0
        if accepted < 0:
            return VerifyResult(tuple(path), int(torch.multinomial(row, 1, generator=gen)))
        path.append(accepted)
        r = accepted + 1


def rrs_iid(tree, p, q, gen):
    return verify_rrs(tree, p, q, gen, without_replacement=False)


def rrs_wor(tree, p, q, gen):
    return verify_rrs(tree, p, q, gen, without_replacement=True)


def deterministic(tree, p, q, gen):
    return verify_deterministic(tree, p, gen)


# ---------------------------------------------------------------------------- greedy
def test_greedy_branch_accepted_at_depth_3():
    # Row argmaxes: root -> 5; node 1 (tok 5) -> 7; node 3 (tok 7) -> 9; node 5 (tok 9) -> 11.
    tree = TokenTree.build(
        tokens=[4, 5, 6, 7, 8, 9, 3],
        parents=[-1, -1, 0, 1, 1, 3, 5],
    )
    am = torch.full((len(tree) + 1,), 99, dtype=torch.long)
    am[0] = 5
    am[1 + 0] = 6  # node 0 (rejected) would accept 6: must not count
    am[1 + 1] = 7
    am[1 + 3] = 9
    am[1 + 5] = 11  # node 6 (tok 3) rejected
    res = verify_greedy(tree, am)
    assert res == VerifyResult((1, 3, 5), 11)
    assert res.tokens(tree) == [5, 7, 9, 11]


def test_greedy_picks_deepest_of_several_accepted_branches():
    # Two accepted branches (duplicates allowed in greedy): depth 1 via node 0, depth 2 via node 1.
    tree = TokenTree.build(tokens=[2, 2, 3, 1], parents=[-1, -1, 1, 0])
    am = torch.tensor([2, 0, 3, 8, 4])  # rows: root, n0, n1, n2, n3
    res = verify_greedy(tree, am)
    assert res.path == (1, 2) and res.next_token == 8


def test_greedy_nothing_accepted_and_empty_tree():
    tree = TokenTree.build(tokens=[1, 2, 3], parents=[-1, -1, 0])
    res = verify_greedy(tree, torch.tensor([0, 3, 3, 3]))
    assert res == VerifyResult((), 0)
    assert verify_greedy(TokenTree.empty(), torch.tensor([7])) == VerifyResult((), 7)


def test_greedy_matches_plain_greedy_decoding():
    # Output of greedy verification = argmax decoding on the Markov target, for random trees.
    gen = make_generator(0)
    greedy_next = P.argmax(-1)  # [V + 1]
    for _ in range(200):
        tree = draft_tree(0, "iid", gen)
        idx = rows_for(tree, 0)
        res = verify(tree, P[idx], Q[idx], "iid", SamplingParams(temperature=0.0), gen)
        emitted = res.tokens(tree)
        ctx = 0
        for tok in emitted:
            assert tok == int(greedy_next[ctx])
            ctx = tok + 1


# ---------------------------------------------------------------------------- losslessness
def test_deterministic_rule_is_lossless():
    assert_lossless(simulate(deterministic, "det", 4 * N, seed=1), N)


def test_deterministic_without_renormalisation_is_detected():
    assert_detected(simulate(wrong_deterministic_no_renorm, "det", 4 * N, seed=1), N)


def test_rrs_iid_is_lossless():
    assert_lossless(simulate(rrs_iid, "iid", 4 * N, seed=2), N)


def test_rrs_correction_from_p_is_detected():
    assert_detected(simulate(wrong_rrs_correction_from_p, "iid", 4 * N, seed=2), N)


def test_rrs_without_replacement_is_lossless():
    assert_lossless(simulate(rrs_wor, "wor", 4 * N, seed=3), N)


def test_iid_rule_on_without_replacement_draws_is_detected():
    assert_detected(simulate(rrs_iid, "wor", 4 * N, seed=3), N)


def test_chain_speculative_sampling_is_lossless():
    assert_lossless(simulate(lambda t, p, q, g: verify_chain(t, p, q, g), "chain", 4 * N, seed=4), N)


def test_chain_correction_from_p_is_detected():
    assert_detected(simulate(wrong_rrs_correction_from_p, "chain", 4 * N, seed=4), N)


def test_empty_tree_is_a_plain_sampling_step():
    gen = make_generator(5)
    empty = TokenTree.empty()
    p, q = P[:1], Q[:1]
    params = SamplingParams(temperature=1.0)
    rules = {
        "greedy": lambda: verify(empty, p, q, "iid", SamplingParams(temperature=0.0), gen),
        "deterministic": lambda: verify_deterministic(empty, p, gen),
        "iid": lambda: verify_rrs(empty, p, q, gen, without_replacement=False),
        "wor": lambda: verify_rrs(empty, p, q, gen, without_replacement=True),
        "chain": lambda: verify_chain(empty, p, q, gen),
        "dispatch": lambda: verify(empty, p, None, None, params, gen),
    }
    assert rules["greedy"]() == VerifyResult((), 0)
    n = 4000
    for name, rule in list(rules.items())[1:]:
        results = [rule() for _ in range(n)]
        assert all(r.path == () for r in results), name
        first = torch.tensor([r.next_token for r in results])
        assert tv(first, EXACT_FIRST) < tv_bound(EXACT_FIRST, n), name
        assert int((first == 4).sum()) == 0, name


# ---------------------------------------------------------------------------- draft samplers
def test_sample_without_replacement_law():
    gen = make_generator(6)
    q = Q[0]
    n = 20000
    draws = torch.stack([sample_without_replacement(q, 2, gen) for _ in range(n)])  # [n, 2]
    assert (draws[:, 0] != draws[:, 1]).all()
    exact = q[:, None] * q[None, :] / (1 - q[:, None])  # P(x1 = a, x2 = b)
    exact.fill_diagonal_(0)
    assert tv(draws[:, 0] * V + draws[:, 1], exact) < tv_bound(exact, n)
    # Never more than the support, never a zero-probability token.
    q0 = torch.tensor([0.5, 0.0, 0.5, 0.0])
    assert sorted(sample_without_replacement(q0, 4, gen).tolist()) == [0, 2]


def test_sample_iid_law():
    gen = make_generator(7)
    n = 20000
    draws = sample_iid(Q[0], n, gen)
    assert draws.shape == (n,)
    assert tv(draws, Q[0]) < tv_bound(Q[0], n)


# ---------------------------------------------------------------------------- other properties
def test_seeded_reproducibility():
    def run(seed: int) -> list[tuple]:
        gen = make_generator(seed)
        out = []
        for _ in range(50):
            tree = draft_tree(0, "wor", gen)
            idx = rows_for(tree, 0)
            params = SamplingParams(temperature=1.0, seed=seed)
            out.append(tuple(verify(tree, P[idx], Q[idx], "without_replacement", params, gen).tokens(tree)))
        return out

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_draft_equal_target_accepts_everything():
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.7, top_k=50)
    gen = make_generator(8)
    vocab, k = 100, 6
    for _ in range(100):
        logits = torch.randn(k + 1, vocab) * 2
        p = probabilities(logits, params)  # [k + 1, vocab]
        toks = []
        for i in range(k):
            toks.append(int(sample_iid(p[i], 1, gen)))
        tree = TokenTree.chain(toks)
        res = verify(tree, p, p.clone(), "iid", params, gen)
        assert res.path == tuple(range(k))
        assert verify_chain(tree, p, p, gen).path == tuple(range(k))


def test_deterministic_rejects_duplicate_siblings():
    tree = TokenTree.build(tokens=[1, 2, 1], parents=[-1, -1, -1])
    p = P[[0, 2, 3, 2]]
    with pytest.raises(ValueError, match="unique sibling"):
        verify_deterministic(tree, p, make_generator(0))
    with pytest.raises(ValueError, match="unique sibling"):
        verify(tree, p, None, None, SamplingParams(temperature=1.0), make_generator(0))


def test_chain_expected_accepted_length():
    # Same p, q at every position: i.i.d. acceptance alpha = 1 - TV(p, q) = sum min(p, q).
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.3, 0.3, 0.1, 0.2])
    alpha = float(torch.minimum(p, q).sum())  # 0.6
    k, n = 4, 20000
    gen = make_generator(9)
    emitted = torch.empty(n)
    for t in range(n):
        tree = TokenTree.chain(sample_iid(q, k, gen).tolist())
        res = verify_chain(tree, p.expand(k + 1, -1), q.expand(k + 1, -1), gen)
        emitted[t] = len(res.path) + 1
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    stderr = float(emitted.std()) / math.sqrt(n)
    assert abs(float(emitted.mean()) - expected) < 4 * stderr, (float(emitted.mean()), expected)
    # The same check tells alpha = 0.6 from a neighbouring alpha.
    wrong = (1 - 0.65 ** (k + 1)) / (1 - 0.65)
    assert abs(float(emitted.mean()) - wrong) > 4 * stderr


def test_residual_fallback_when_p_equals_q():
    p = torch.tensor([0.25, 0.75, 0.0], dtype=torch.float64)
    assert torch.equal(_residual(p, p.clone()), p)
    q = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert torch.allclose(_residual(p, q), torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))


def test_rrs_rejects_children_not_drawn_from_q():
    tree = TokenTree.build(tokens=[1, 1], parents=[-1, -1])  # duplicate: impossible without replacement
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5], [0.5, 0.5]])
    # First child is always accepted here (p = q); force a rejection with p putting no mass on 1.
    p[0] = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_rrs(tree, p, q, make_generator(0), without_replacement=True)
    # i.i.d. mode accepts duplicates (both rejected, correction from the residual).
    res = verify_rrs(tree, p, q, make_generator(0), without_replacement=False)
    assert res == VerifyResult((), 0)


def test_dispatcher_modes_and_shape_errors():
    gen = make_generator(10)
    tree = TokenTree.build(tokens=[1, 2], parents=[-1, -1])
    p, q = P[[0, 2, 3]], Q[[0, 2, 3]]
    with pytest.raises(ValueError, match="sibling mode"):
        verify(tree, p, q, None, SamplingParams(temperature=1.0), gen)
    with pytest.raises(ValueError, match="unknown sibling mode"):
        verify(tree, p, q, "bogus", SamplingParams(temperature=1.0), gen)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shape"):
        verify_rrs(tree, p[:2], q, gen, without_replacement=False)
    with pytest.raises(ValueError, match="chain"):
        verify_chain(tree, p, q, gen)
    chain = TokenTree.chain([1])
    assert isinstance(verify(chain, P[[0, 2]], Q[[0, 2]], None, SamplingParams(temperature=1.0), gen), VerifyResult)


def test_deterministic_certain_and_impossible_children():
    # Root: p puts no mass on child 0's token and all on child 1's; node 1's only child is certain too.
    tree = TokenTree.build(tokens=[0, 2, 3], parents=[-1, -1, 1])
    p = torch.tensor(
        [
            [0.0, 0.0, 1.0, 0.0],
            [0.25, 0.25, 0.25, 0.25],
            [0.0, 0.0, 0.0, 1.0],
            [0.0, 0.5, 0.0, 0.5],
        ]
    )
    gen = make_generator(13)
    for _ in range(200):
        res = verify_deterministic(tree, p, gen)
        assert res.path == (1, 2) and res.next_token in (1, 3)
