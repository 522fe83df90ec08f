"""Acceptance rules: greedy exactness, losslessness (distribution tests), edge cases.

The distribution tests (helpers in `laws.py`) simulate decoding on a small Markov "language":
each step drafts a tree by the rule's own sampling scheme, verifies it, and decoding continues
until two tokens are emitted; the empirical law of the first token and of the first two tokens
jointly must match the exact target law. The bound shrinks with the number of trials, and a
planted wrong rule must fail the same check.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from laws import EXACT_FIRST, N, P, Q, V, assert_detected, assert_lossless, draft_tree, rows_for, simulate, tv, tv_bound
from specula import sampling
from specula.errors import ConfigError
from specula.sampling import (
    MIN_NOISE, SamplingParams, TargetRows, clear_noise_cache, make_generator, position_noise, probabilities, race_token,
    reserve_noise_width, sample_iid, sample_without_replacement,
)
from specula.tree import TokenTree
from specula.verify import (
    VerifyResult,
    _residual,
    verify_deterministic,
    verify_greedy,
    verify_kseq,
    verify_rrs,
    verify_step,
)

SAMPLE = SamplingParams(temperature=1.0)
"""Plain softmax: `verify_step` on log P samples from P."""


def chain_sampling(tree, p, q, gen):
    """Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023): RRS with one child per node."""
    assert tree.is_chain()
    return verify_rrs(tree, p, q, gen, without_replacement=False)

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
        res = verify_greedy(tree, P[idx].argmax(-1))
        emitted = res.tokens(tree)
        ctx = 0
        for tok in emitted:
            assert tok == int(greedy_next[ctx])
            ctx = tok + 1


def test_greedy_step_on_cpu_rows_reads_only_the_accepted_path_and_agrees_with_every_row():
    """verify_step's greedy rule on CPU logits takes the argmax of the rows a greedy walk reads
    (numpy's, `tree_rows.row_argmax`): the root's and the accepted path's; its result is the rule on every row's torch argmax:
    random trees and logits with planted ties (the first maximal index wins), +/-inf and NaN rows,
    in float32 and float64, contiguous or not."""
    from specula.tree_rows import greedy_argmax, row_argmax

    gen = torch.Generator().manual_seed(5)
    greedy = SamplingParams(temperature=0.0)
    for trial in range(300):
        vocab = 6
        n = int(torch.randint(0, 9, (1,), generator=gen))
        parents = [-1 if i == 0 else int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
        tokens, seen = [], set()
        for par in parents:  # unique siblings
            tok = int(torch.randint(0, vocab, (1,), generator=gen))
            while (par, tok) in seen:
                tok = (tok + 1) % vocab
            seen.add((par, tok))
            tokens.append(tok)
        tree = TokenTree.build(tokens=tokens, parents=parents)
        logits = torch.randint(0, 3, (n + 1, vocab), generator=gen).double()  # many ties
        if trial % 7 == 0:
            logits[0, 2] = math.inf
        if trial % 11 == 0:
            logits[-1, 1] = math.nan
        if trial % 13 == 0:
            logits[0] = -math.inf
        if trial % 2:
            logits = logits.float()
        if trial % 3 == 0:  # a non-contiguous view with the same values
            logits = torch.cat([logits, logits], dim=1)[:, :vocab]
        full = logits.argmax(-1)
        reads = []
        fast = row_argmax(logits)
        lazy = greedy_argmax(tree, lambda r: reads.append(r) or fast(r))
        assert all(int(lazy[r]) == int(full[r]) for r in reads) and all(int(lazy[r]) == -1 for r in set(
            range(n + 1)) - set(reads))
        expected = verify_greedy(tree, full)
        assert verify_step(tree, logits, greedy) == expected
        assert reads == [0, *(i + 1 for i in expected.path)]  # unique siblings: the accepted nodes are one path


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
    assert_lossless(simulate(chain_sampling, "chain", 4 * N, seed=4), N)


def test_chain_correction_from_p_is_detected():
    assert_detected(simulate(wrong_rrs_correction_from_p, "chain", 4 * N, seed=4), N)


def test_empty_tree_is_a_plain_sampling_step():
    gen = make_generator(5)
    empty = TokenTree.empty()
    p, q = P[:1], Q[:1]
    rules = {
        "greedy": lambda: verify_greedy(empty, p.argmax(-1)),
        "deterministic": lambda: verify_deterministic(empty, p, gen),
        "iid": lambda: verify_rrs(empty, p, q, gen, without_replacement=False),
        "wor": lambda: verify_rrs(empty, p, q, gen, without_replacement=True),
        "chain": lambda: chain_sampling(empty, p, q, gen),
        "step": lambda: verify_step(empty, p.log(), SAMPLE, seed=int(torch.randint(2**62, (1,), generator=gen))),
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
            out.append(tuple(verify_rrs(tree, P[idx], Q[idx], gen, without_replacement=True).tokens(tree)))
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
        res = verify_step(tree, logits, params, q=p.clone(), mode="iid", generator=gen)
        assert res.path == tuple(range(k))
        assert chain_sampling(tree, p, p, gen).path == tuple(range(k))


def test_deterministic_rejects_duplicate_siblings():
    tree = TokenTree.build(tokens=[1, 2, 1], parents=[-1, -1, -1])
    p = P[[0, 2, 3, 2]]
    with pytest.raises(ValueError, match="unique sibling"):
        verify_deterministic(tree, p, make_generator(0))
    with pytest.raises(ValueError, match="unique sibling"):
        verify_step(tree, p.log(), SAMPLE, seed=0)


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
        res = chain_sampling(tree, p.expand(k + 1, -1), q.expand(k + 1, -1), gen)
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


def test_verify_step_modes_and_shape_errors():
    gen = make_generator(10)
    tree = TokenTree.build(tokens=[1, 2], parents=[-1, -1])
    p, q = P[[0, 2, 3]], Q[[0, 2, 3]]
    with pytest.raises(ValueError, match="unknown sibling mode"):
        verify_step(tree, p.log(), SAMPLE, q=q, mode="bogus", generator=gen)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need the draft distributions q"):
        verify_step(tree, p.log(), SAMPLE, mode="iid", generator=gen)
    with pytest.raises(ValueError, match="shape"):
        verify_rrs(tree, p[:2], q, gen, without_replacement=False)
    with pytest.raises(ValueError, match="shape"):
        verify_step(tree, p.log(), SAMPLE, q=q[:2], mode="iid", generator=gen)


def test_verify_step_dispatch():
    """`verify_step` is the one entry of the loop: greedy is the argmax walk; deterministic
    candidates give plain sampling with the same seed (one noise vector per output position); sampled
    children go to RRS (i.i.d. / without replacement) or K-SEQ by mode, with the same generator
    draws; a draft vocabulary narrower or wider than the target's is fitted to it."""
    torch.manual_seed(5)
    params = SamplingParams(temperature=0.9, top_k=40)
    gen = make_generator(14)
    for trial in range(60):
        logits = torch.randn(7, 50) * 3  # [n + 1, vocab]
        tree = TokenTree.build([3, 4, 5, 6, 7, 8], [-1, -1, 0, 0, 2, 4])
        q = torch.softmax(torch.randn(7, 50), -1)
        greedy = verify_step(tree, logits, SamplingParams(), q=q, mode="iid", generator=gen)
        assert greedy == verify_greedy(tree, logits.argmax(-1))
        seed, position = trial, trial % 5
        det = verify_step(tree, logits, params, seed=seed, position=position)
        noise = [position_noise(seed, position + d, 50) for d in range(tree.max_depth + 1)]
        assert det == verify_deterministic(tree, probabilities(logits, params), noise)
        plain = [race_token(probabilities(logits[0 if d == 0 else det.path[d - 1] + 1], params), noise[d])
                 for d in range(len(det.path) + 1)]  # plain sampling along the accepted path, same seed
        assert det.tokens(tree) == plain
        p = TargetRows(logits, params)
        for mode, rule in (("iid", lambda g: verify_rrs(tree, p, q, g, without_replacement=False)),
                           ("without_replacement", lambda g: verify_rrs(tree, p, q, g, without_replacement=True)),
                           ("iid_kseq", lambda g: verify_kseq(tree, p, q, g))):
            assert verify_step(tree, logits, params, q=q, mode=mode, generator=make_generator(trial)) == \
                rule(make_generator(trial)), mode
        narrow = verify_step(tree, logits, params, q=q[:, :45] / q[:, :45].sum(-1, keepdim=True), mode="iid",
                             generator=make_generator(trial))
        padded = torch.nn.functional.pad(q[:, :45] / q[:, :45].sum(-1, keepdim=True), (0, 5))
        assert narrow == verify_rrs(tree, p, padded, make_generator(trial), without_replacement=False)
        wide = torch.nn.functional.pad(q, (0, 3))  # extra ids with no mass are cut
        assert verify_step(tree, logits, params, q=wide, mode="iid", generator=make_generator(trial)) == \
            verify_rrs(tree, p, q, make_generator(trial), without_replacement=False)
    with pytest.raises(ConfigError, match="token ids the target does not have"):
        verify_step(tree, logits, params, q=torch.ones(7, 53), mode="iid", generator=gen)
    # On the random rows above the i.i.d. and without-replacement rules gave the same result on every
    # trial, so a dispatch of one sampled mode to the other's rule passed. Here q puts 0.7 on the first
    # root child (token 3, which p never takes) and 0.25 on the second (token 4): once 3 is rejected,
    # the i.i.d. rule accepts 4 always, the without-replacement rule (q renormalised) with probability 0.4.
    logits = torch.full((7, 50), -30.0)
    logits[:, 4] = logits[:, 10] = 0.0  # p: half on token 4, half on token 10
    q = torch.full((7, 50), 1e-3)
    q[:, 3], q[:, 4] = 0.7, 0.25
    q = q / q.sum(-1, keepdim=True)
    sample = SamplingParams(temperature=1.0)
    p = TargetRows(logits, sample)
    rules = {"iid": lambda g: verify_rrs(tree, p, q, g, without_replacement=False),
             "without_replacement": lambda g: verify_rrs(tree, p, q, g, without_replacement=True),
             "iid_kseq": lambda g: verify_kseq(tree, p, q, g)}
    results = {mode: [verify_step(tree, logits, sample, q=q, mode=mode, generator=make_generator(s))
                      for s in range(100)] for mode in rules}
    for mode, rule in rules.items():
        assert results[mode] == [rule(make_generator(s)) for s in range(100)], mode
    for other in ("iid", "iid_kseq"):  # (the random rows above already tell K-SEQ from i.i.d.)
        differ = sum(x != y for x, y in zip(results["without_replacement"], results[other]))
        assert differ > 20, (other, differ)  # the rules really differ here


def test_rules_read_lazy_target_rows_as_tensors():
    """`TargetRows` (the engine's p: rows processed on demand) gives the same results as the
    processed tensor, and processes only the rows on the walked path."""
    torch.manual_seed(1)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    logits = torch.randn(5, 30) * 3  # [n + 1, vocab]
    tree = TokenTree.build([3, 4, 5, 6], [-1, -1, 0, 2])
    dense = probabilities(logits, params)
    for seed in range(30):
        lazy = TargetRows(logits, params)
        assert verify_deterministic(tree, lazy, make_generator(seed)) == \
            verify_deterministic(tree, dense, make_generator(seed))
        path = verify_deterministic(tree, lazy, make_generator(seed)).path
        assert len(lazy._rows) <= len(path) + 1


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


def test_batched_target_tokens_give_the_deterministic_rule():
    """The accelerator path (every row's raced token at once, then greedy matching) returns what the lazy walk
    returns, for the same noise; and `verify_step` on a device's rows takes it."""
    from specula.verify import target_tokens

    torch.manual_seed(3)
    gen = make_generator(4)
    for _ in range(200):
        tree = draft_tree(0, "det", gen)
        idx = rows_for(tree, 0)
        noise = torch.empty(tree.max_depth + 1, V).exponential_(generator=gen)
        by_row = noise[torch.tensor((0, *tree.depth))]  # [n + 1, V]
        batched = verify_greedy(tree, target_tokens(P[idx], by_row))
        assert batched == verify_deterministic(tree, P[idx], list(noise))
    short = list(torch.ones(2, V))  # a tree of depth 2 reads three depths' noise
    with pytest.raises(ValueError, match="needs 3 noise vectors"):
        verify_deterministic(TokenTree.build([1, 2], [-1, 0]), P[:3], short)
    zero = torch.tensor([[0.0, 0.5, 0.5, 0.0]])  # tokens with no mass never win, whatever their noise
    assert target_tokens(zero, torch.tensor([[MIN_NOISE, 1.0, 2.0, MIN_NOISE]])).tolist() == [1]



def test_the_race_in_logit_form_is_the_softmaxs_race_and_its_batched_path_the_walk():
    """At a temperature alone the target's token is the argmax of logits / T - log E (`verify_raced_logits`): on
    random rows the softmax's race (`verify_deterministic` over p at T) picks the same tokens for the same noise,
    the batched path (`raced_tokens`, every row at once) returns what the walk returns, and a row with no finite
    logit is refused."""
    from specula.verify import raced_tokens, verify_raced_logits

    gen = make_generator(6)
    for trial in range(200):
        tree = draft_tree(0, "det", gen)
        logits = torch.randn(len(tree) + 1, V, generator=gen) * 3  # [n + 1, V]
        temperature = (0.5, 1.0, 1.7)[trial % 3]
        noise = torch.empty(tree.max_depth + 1, V).exponential_(generator=gen)
        walked = verify_raced_logits(tree, logits, SamplingParams(temperature=temperature), lambda d: noise[d])
        by_row = noise[torch.tensor((0, *tree.depth))]  # [n + 1, V]
        assert verify_greedy(tree, raced_tokens(logits, temperature, by_row)) == walked
        p = torch.softmax(logits / temperature, -1)
        assert verify_deterministic(tree, p, list(noise)) == walked
    dead = torch.full((1, V), float("-inf"))
    with pytest.raises(ValueError, match="no finite logit"):
        verify_raced_logits(TokenTree.build([], []), dead, SamplingParams(temperature=1.0), lambda d: torch.ones(V))


TRUNCATIONS = [SamplingParams(temperature=0.8, top_k=3), SamplingParams(temperature=1.3, top_k=3, top_p=0.7),
               SamplingParams(temperature=1.1, top_k=5, top_p=0.8),
               SamplingParams(temperature=0.6, min_p=0.2),
               SamplingParams(temperature=1.0, top_k=6, top_p=0.9, min_p=0.1),
               SamplingParams(temperature=0.9, top_k=1), SamplingParams(temperature=0.9, top_p=0.8),
               SamplingParams(temperature=1.2, top_p=0.6, min_p=0.05)]


@pytest.mark.parametrize("params", TRUNCATIONS)
def test_the_truncated_race_in_logit_form_is_the_processed_distributions_race(params):
    """top-k, top-p within it and min-p raced in logit form (`verify_raced_logits` over `truncated_race`): on random
    rows the race over `probabilities` (`verify_deterministic`) picks the same tokens for the same noise, so the
    law is the processed distribution's; and the token is the same from any set of ids that holds the kept ones
    (what a screen's candidates are), the whole row's."""
    from specula.sampling import truncated_race
    from specula.verify import verify_raced_logits

    assert params.races_logits and params.truncates
    gen = make_generator(8)
    for trial in range(150):
        tree = draft_tree(0, "det", gen)
        logits = torch.randn(len(tree) + 1, V, generator=gen) * 2  # [n + 1, V]
        noise = torch.empty(tree.max_depth + 1, V).exponential_(generator=gen)
        walked = verify_raced_logits(tree, logits, params, lambda d: noise[d])
        assert verify_deterministic(tree, probabilities(logits, params), list(noise)) == walked
        row, e = logits[0], noise[0]
        kept = probabilities(row[None], params)[0] > 0  # [V]
        if 0 < params.top_k < V:  # top-p's normaliser is over the top k: the set holds them all
            kept = row >= row.topk(params.top_k).values[-1]
        elif params.top_p < 1.0:  # top-p ranks every id
            kept[:] = True
        extra = torch.rand(V, generator=gen) < 0.3  # any other ids beside the kept ones
        ids = (kept | extra).nonzero().view(-1)
        assert truncated_race(ids, row[ids], e[ids], params) == truncated_race(None, row, e, params)
    masked = torch.tensor([float("-inf")] * (V - 1) + [0.0])  # a masked row: the one finite id, whatever top-k
    assert truncated_race(None, masked, noise[0], params) == V - 1
    with pytest.raises(ValueError, match="no finite logit"):
        truncated_race(None, torch.full((V,), float("-inf")), noise[0], params)


def test_every_sampled_request_is_raced_in_logit_form_and_top_p_alone_ranks_every_id():
    assert SamplingParams(temperature=0.8).races_logits and not SamplingParams(temperature=0.8).truncates
    assert SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05).races_logits
    assert SamplingParams(temperature=0.8, top_p=0.9).races_logits
    assert not SamplingParams(temperature=0.0, top_k=5).races_logits
    assert SamplingParams(temperature=0.8, top_p=0.9).ranks_every_id
    assert SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1).ranks_every_id
    assert not SamplingParams(temperature=0.8, top_k=20, top_p=0.9).ranks_every_id
    assert not SamplingParams(temperature=0.8, min_p=0.1).ranks_every_id
    assert not SamplingParams(temperature=0.0, top_p=0.9).ranks_every_id


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_p=0.8),
                                    SamplingParams(temperature=1.3, top_p=0.95),
                                    SamplingParams(temperature=0.7, top_p=0.5, min_p=0.05)])
def test_top_p_over_every_id_from_a_set_and_bounds_on_the_rest_is_the_whole_rows_or_undecided(params):
    """top-p without top-k from a set of a row's ids and bounds on the others' values (`truncated_race`'s `rest`, as a
    screen gives them): the whole row's token wherever it decides; it decides most rows when the bounds are tight and
    the set holds the likely ids, and never claims a row whose bounds leave the nucleus open (a cut on a boundary,
    one of the rest that could rank within the nucleus, a set whose mass is all kept)."""
    from specula.sampling import truncated_race

    W = 200  # a vocabulary with room for a nucleus, a set and a rest
    gen = make_generator(12)
    decided = 0
    for trial in range(400):
        row = torch.randn(W, generator=gen) * (1 + trial % 3)  # [W]: a few likely ids over a flat tail, as real rows
        row[torch.randperm(W, generator=gen)[: 1 + trial % 4]] += 12.0
        if trial % 5 == 0:
            row[torch.rand(W, generator=gen) < 0.3] = float("-inf")  # masked ids
        e = torch.empty(W).exponential_(generator=gen)  # [W]: the position's noise
        want = truncated_race(None, row, e, params)
        width = (0.01, 0.1, 1.0)[trial % 3]
        lower = row - width * torch.rand(W, generator=gen)  # [W]: intervals that hold each value
        upper = row + width * torch.rand(W, generator=gen)
        inside = upper >= lower.topk(1 + trial % 12).values[-1]  # the set: every id that could reach the j-th largest
        inside |= torch.rand(W, generator=gen) < 0.1  # and any others
        ids = inside.nonzero().view(-1)
        rest = (lower.masked_fill(inside, float("-inf")), upper.masked_fill(inside, float("-inf")))
        got = truncated_race(ids, row[ids], e[ids], params, rest)
        if got is not None:
            assert got == want, trial
            decided += 1
    assert 150 <= decided < 400
    # two ids in the set, the first holding p1 of their mass: the rest's bounds decide whether the second is kept
    s = torch.tensor([0.0, -1.0]) * params.temperature  # s = [0, -1]
    p1, e = 1.0 / (1.0 + math.exp(-1.0)), torch.tensor([1.0, math.exp(-5.0)])  # the second wins the race if kept
    t = params.temperature  # bounds on the rest's logits, s T
    loose = (torch.full((W - 2,), -60.0 * t), torch.full((W - 2,), -3.0 * t))  # up to 198 e^-3: 7 times the set's mass
    tight = (torch.full((W - 2,), -80.0 * t), torch.full((W - 2,), -79.0 * t))  # nothing that could move a cut
    row = torch.cat([s, torch.full((W - 2,), -79.5 * t)])  # a whole row within the tight bounds
    for top_p, kept_second in ((p1 * (1 - 1e-3), False), (p1 * (1 + 1e-6), True)):
        edge = replace(params, top_p=top_p, min_p=0.0)
        assert truncated_race(None, row, torch.cat([e, torch.ones(W - 2)]), edge) == int(kept_second)
        assert truncated_race(torch.arange(2), s, e, edge, tight) == int(kept_second)
        assert truncated_race(torch.arange(2), s, e, edge, loose) is None  # the second kept or the rest next
    on_the_cut = replace(params, top_p=p1, min_p=0.0)  # within the sums' margin of the cut: only the row says
    assert truncated_race(torch.arange(2), s, e, on_the_cut, tight) is None
    above = (torch.full((W - 2,), -60.0 * t), torch.full((W - 2,), 1.0 * t))  # one of the rest could outrank the best
    assert truncated_race(torch.arange(2), s, e, replace(params, top_p=0.5, min_p=0.0), above) is None
    one = (torch.full((W - 2,), float("-inf")), torch.full((W - 2,), float("-inf")))
    one[0][0], one[1][0] = -30.0 * t, 0.5 * t  # one of the rest might rank first, and alone be kept at top-p 0.3
    assert truncated_race(torch.arange(2), s, e, replace(params, top_p=0.3, min_p=0.0), one) is None
    heavy = (torch.full((W - 2,), -5.01 * t), torch.full((W - 2,), -5.0 * t))  # 1.33 times the set's mass, known
    half = replace(params, top_p=0.5, min_p=0.0)  # the rest's lower ends keep the second: both kept, none after
    assert truncated_race(torch.arange(2), s, e, half, heavy) == 1 == truncated_race(
        None, torch.cat([s, torch.full((W - 2,), -5.005 * t)]), torch.cat([e, torch.ones(W - 2)]), half)
    masked = (torch.full((W - 2,), float("-inf")), torch.full((W - 2,), float("-inf")))  # the set holds every finite id
    assert truncated_race(torch.arange(2), s, e, replace(params, top_p=0.999, min_p=0.0), masked) == 1


def test_position_noise_is_a_function_of_seed_and_position_and_narrower_vocabularies_read_its_prefix():
    """What seeded sampling reproduces a run by, and what a draft of a narrower vocabulary couples with."""
    a = position_noise(7, 3, 1000)
    assert torch.equal(a, position_noise(7, 3, 1000)) and a.dtype == torch.float32 and bool((a >= MIN_NOISE).all())
    assert not torch.equal(a, position_noise(7, 4, 1000)) and not torch.equal(a, position_noise(8, 3, 1000))
    clear_noise_cache()  # computed again, not read from the cache
    assert torch.equal(position_noise(7, 3, 400), a[:400]) and torch.equal(position_noise(7, 3, 1000), a)
    assert abs(float(position_noise(1, 0, 200_000).mean()) - 1.0) < 0.01  # Exp(1)



def test_position_noise_is_drawn_once_a_position_as_wide_as_its_seed_asked(monkeypatch):
    """A drafter racing positions ahead with a narrower vocabulary draws the noise the target then reads."""
    clear_noise_cache()
    draws = []
    real = sampling._draw_noise
    monkeypatch.setattr(sampling, "_draw_noise", lambda *args: draws.append(args) or real(*args))
    wide = position_noise(5, 0, 1000)  # the target's token at position 0
    ahead = position_noise(5, 1, 300)  # a draft's candidate one position ahead: drawn 1000 wide
    assert draws == [(5, 0, 1000), (5, 1, 1000)] and ahead.shape == (300,)
    assert torch.equal(position_noise(5, 1, 1000)[:300], ahead) and len(draws) == 2  # the target's read: no draw
    assert position_noise(6, 1, 300).shape == (300,) and draws[-1] == (6, 1, 300)  # another seed: its own width
    assert torch.equal(position_noise(5, 0, 1000), wide) and len(draws) == 3
    clear_noise_cache()
    assert torch.equal(position_noise(5, 1, 1000), real(5, 1, 1000))


def test_a_reserved_width_draws_a_seeds_first_narrow_positions_at_it(monkeypatch):
    """A sampled request reserves its target's width: a drafter racing its first positions over a narrower
    vocabulary draws them once, as wide as verification then reads them, and the values are the same."""
    clear_noise_cache()
    draws = []
    real = sampling._draw_noise
    monkeypatch.setattr(sampling, "_draw_noise", lambda *args: draws.append(args) or real(*args))
    reserve_noise_width(9, 1000)
    first = position_noise(9, 0, 300)  # a head's draft vocabulary, before the target read anything
    assert draws == [(9, 0, 1000)] and torch.equal(first, real(9, 0, 300))
    assert torch.equal(position_noise(9, 0, 1000), real(9, 0, 1000)) and len(draws) == 1
    reserve_noise_width(9, 500)  # never narrower than what the seed was already drawn at
    assert position_noise(9, 1, 10).shape == (10,) and draws[-1] == (9, 1, 1000)
    assert position_noise(10, 0, 300).shape == (300,) and draws[-1] == (10, 0, 300)  # another seed: its own width
    clear_noise_cache()  # forgets the reservations too
    assert position_noise(9, 2, 300).shape == (300,) and draws[-1] == (9, 2, 300)

def test_the_exponential_race_samples_p_exactly():
    """`race_token` with fresh Exp(1) noise: each token's frequency is its probability (a row need not be
    normalised), a token with no mass is never drawn, and a row with no mass is refused."""
    p = torch.tensor([0.0, 0.1, 0.6, 0.05, 0.25]) * 3
    gen = make_generator(0)
    n = 40_000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[race_token(p, torch.empty(5).exponential_(generator=gen))] += 1
    freq = counts / n
    want = p / p.sum()
    assert counts[0] == 0
    assert torch.allclose(freq, want, atol=4 * float((want * (1 - want) / n).sqrt().max()))
    with pytest.raises(ValueError, match="no mass"):
        race_token(torch.zeros(5), torch.ones(5))
