"""Statistical helpers shared by the tests of sampling laws (rules, drafters, the engine end to end).

A small Markov "language": the target distribution after token t is P[t + 1] (P[0] at the
start), the draft's is Q[t + 1]. `simulate` drafts trees by a sampling scheme, verifies them with
a rule and decodes until two tokens are emitted; the empirical law of the first token and of the
first two tokens jointly must match the exact target law P[0][a] * P[a + 1][b] (`assert_lossless`),
with bounds that shrink with the number of trials, and a planted wrong rule must fail the same
check (`assert_detected`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specula.sampling import SamplingParams, make_generator, sample_iid, sample_without_replacement
from specula.tree import TokenTree

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




def random_pair(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """p, q with a mix of flat and peaked shapes, exact zeros and tiny (1e-12..1e-17) masses."""
    p = rng.dirichlet(np.ones(vocab) * rng.choice([0.1, 0.5, 2.0]))
    q = rng.dirichlet(np.ones(vocab) * rng.choice([0.1, 0.5, 2.0]))
    if rng.random() < 0.3:
        p[rng.integers(vocab)] = 0.0
    if rng.random() < 0.3:
        q[rng.integers(vocab)] = 0.0
    return p / p.sum(), q / q.sum()


def joint_law_tv(samples: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(TV of `samples` [trials] (int codes) against `exact`, the bound `tv_bound` gives for that many
    trials) - for end-to-end law tests on other languages than P."""
    return tv(samples, exact), tv_bound(exact, len(samples))


# ---------------------------------------------------------------------------- end to end through the engine
def exact_first_two(model, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(first = a, second = b) of plain sampling from a Hugging Face model: [V * V], a * V + b."""
    with torch.inference_mode():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        rows = [torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1].double() / temperature, -1)
                for a in range(p1.shape[-1])]
    return (p1[:, None] * torch.stack(rows)).flatten()


def sample_first_two(dec, prompt: list[int], temperature: float, vocab: int, trials: int) -> tuple[torch.Tensor, int]:
    """Codes first * vocab + second of `trials` seeded generations by decoder `dec`, and the draft
    tokens accepted along the way (to show drafts really were verified)."""
    codes = torch.empty(trials, dtype=torch.long)
    accepted = 0
    for s in range(trials):
        out = dec.generate(prompt, SamplingParams(temperature=temperature, max_new_tokens=3, seed=s, ignore_eos=True))
        codes[s] = out.token_ids[0] * vocab + out.token_ids[1]
        accepted += out.stats.accepted_tokens
    return codes, accepted
