"""Acceptance rules of speculative decoding, as pure functions (no model, cache or drafter).

Notation, used throughout this module: ``p`` is always the *target* distribution (after
temperature / top-k / top-p, i.e. ``specula.sampling.probabilities``), and ``q`` is always
the *draft* distribution from which the drafter drew the tree's children.

Row convention (shared with ``specula.tree``): ``p`` has shape ``[n + 1, vocab]`` for a tree
of ``n`` nodes (a tensor, or any `Rows` object that yields rows on demand, such as
``specula.sampling.TargetRows``, which processes only the rows a rule touches); row ``0`` is the target distribution at the root (the token after the last
emitted token) and row ``i + 1`` the target distribution after tree node ``i``. ``q``, when
given, has the same shape; row ``r`` is the draft distribution from which the children of
row ``r`` were drawn (rows of leaves are unused).

Every rule returns a `VerifyResult`: the accepted node indices (root to deepest) and one
more token (a correction after a rejection, or a bonus token after a leaf), so a step
always emits ``len(path) + 1`` tokens. All sampling rules are lossless: the emitted tokens
are distributed exactly as if sampled one at a time from ``p`` - provided the children
really were drawn by the scheme the rule assumes (see each function).

Numerics: only the rows on the visited path are touched; each is copied once to float64
on the generator's device (one row, never an ``[n + 1, vocab]`` copy). Randomness: the
rules for sampled children make one ``torch.rand(n + 1)`` call with the caller's generator per
verification - uniform ``i`` for node ``i``'s acceptance test, the last one for the final sample
(inverse CDF; a zero-mass token is never picked); the rule for deterministic candidates takes
one Exp(1) noise vector per depth and races p against it (`verify_step` seeds it by request and position,
`sampling.position_noise`). ``torch.multinomial`` (without replacement) is avoided on purpose:
on CPU one draw from a 150k vocabulary took ~4.6 ms against ~0.35 ms for cumsum + searchsorted.

`verify_step` is the one entry of the decode loop: from the target's logits of a step and the
request's sampling parameters it picks the rule (greedy; deterministic candidates; children
sampled from q, by how they were drawn) and where it runs (the rows on the path on CPU, every
row at once on an accelerator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from specula.errors import ConfigError
from specula.sampling import (MIN_NOISE, SamplingParams, TargetRows, gumbel_of, position_noise, probabilities, race,
                              race_scores, race_token, truncated_race)
from specula.tree import SiblingMode, TokenTree
from specula.tree_rows import RowEdit, greedy_argmax, row_argmax

__all__ = [
    "Rows",
    "VerifyResult",
    "kseq_acceptance",
    "kseq_rho",
    "raced_tokens",
    "target_tokens",
    "verify_deterministic",
    "verify_raced_logits",
    "verify_greedy",
    "verify_kseq",
    "verify_rrs",
    "verify_step",
]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one tree."""

    path: tuple[int, ...]
    """Accepted node indices, root to deepest, in order (empty if nothing was accepted)."""
    next_token: int
    """Token emitted after the path (bonus or correction); always present."""

    def tokens(self, tree: TokenTree) -> list[int]:
        """All emitted tokens of this step: the accepted tree tokens, then `next_token`."""
        return [tree.tokens[i] for i in self.path] + [self.next_token]


class Rows(Protocol):
    """Row access to an ``[n + 1, vocab]`` distribution: a tensor, or a lazy row source."""

    @property
    def shape(self) -> torch.Size: ...

    def dim(self) -> int: ...

    def __getitem__(self, row: int) -> torch.Tensor: ...


# ---------------------------------------------------------------------------- helpers
def _device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")


def _check_rows(t: Rows, n: int, name: str) -> None:
    # t: [n + 1, vocab]
    if t.dim() != 2 or t.shape[0] != n + 1:
        raise ValueError(f"{name} must have shape [n + 1, vocab] = [{n + 1}, vocab] for a tree of {n} nodes, got {tuple(t.shape)}")


def _uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    """n + 1 U[0, 1) in one call: one per tree node (its acceptance test), then one for the
    final sample."""
    return torch.rand(n + 1, generator=generator, dtype=torch.float64, device=_device(generator)).tolist()


def _row_copy(t: Rows, r: int, device: torch.device) -> torch.Tensor:
    """Row r of t ([n + 1, vocab]) as a fresh float64 [vocab] tensor we may modify in place."""
    return t[r].to(device=device, dtype=torch.float64, copy=True)


def _normalised_row(t: Rows, r: int, device: torch.device, name: str) -> torch.Tensor:
    row = _row_copy(t, r, device)  # [vocab] float64
    mass = row.sum()
    if not bool(mass > 0):
        raise ValueError(f"{name} row {r} has no probability mass (sum = {float(mass)})")
    return row.div_(mass)


def _sample(row: torch.Tensor, u: float) -> int:
    """One token from the (not necessarily normalised) distribution row ([vocab]) by inverse
    CDF with the uniform u in [0, 1): the first token whose cumulative mass exceeds u * mass,
    which always has positive probability."""
    cdf = row.to(torch.float64).cumsum(0)  # [vocab]
    mass = float(cdf[-1])
    if not mass > 0:
        raise ValueError(f"cannot sample from a distribution with no mass (sum = {mass})")
    tok = int(torch.searchsorted(cdf, torch.tensor([u * mass], dtype=torch.float64, device=cdf.device), right=True))
    if tok >= cdf.shape[0]:  # u * mass rounded up to mass: take the last token with mass
        tok = int(torch.nonzero(row > 0)[-1])
    return tok


def _residual(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for normalised float64 rows p_row, q_row: [vocab].

    Fallback: if the residual has no mass then p <= q everywhere, i.e. p == q as
    distributions; a rejection then has probability 0 in exact arithmetic and can only
    come from rounding, so any choice is correct to rounding error. We return p itself
    (it keeps the output inside p's support)."""
    res = (p_row - q_row).clamp_(min=0.0)  # [vocab]
    mass = res.sum()
    if bool(mass > 0):
        return res.div_(mass)
    return p_row


def _check_unique_siblings(tree: TokenTree) -> None:
    for r, kids in enumerate(tree.children):
        if len(kids) > 1:
            toks = [tree.tokens[c] for c in kids]
            if len(set(toks)) != len(toks):
                raise ValueError(
                    f"deterministic verification needs unique sibling tokens, but row {r} has children "
                    f"with tokens {toks}; merge duplicates first (TokenTree.merge does)"
                )


# ---------------------------------------------------------------------------- rules
def verify_greedy(tree: TokenTree, target_argmax: torch.Tensor) -> VerifyResult:
    """Greedy verification. target_argmax: [n + 1] long, argmax of the target at each row (or
    only at the rows a greedy walk reads, -1 at the others: `tree_rows.greedy_argmax`).

    A node is accepted iff its token equals the argmax at its parent's row and its parent
    is accepted. Returns the deepest accepted node's path (ties: the first in node order)
    and the argmax at that node's row. Output equals plain greedy decoding."""
    n = len(tree)
    if target_argmax.dim() != 1 or target_argmax.shape[0] != n + 1:
        raise ValueError(f"target_argmax must have shape [{n + 1}], got {tuple(target_argmax.shape)}")
    am = target_argmax.tolist()  # one device sync, then plain Python over <= ~128 nodes
    accepted = [False] * n
    best, best_depth = -1, 0
    depth = tree.depth
    for i, (tok, par) in enumerate(zip(tree.tokens, tree.parents)):
        if tok == am[par + 1] and (par < 0 or accepted[par]):
            accepted[i] = True
            if depth[i] > best_depth:
                best, best_depth = i, depth[i]
    if best < 0:
        return VerifyResult((), int(am[0]))
    return VerifyResult(tree.path_to(best), int(am[best + 1]))


RowRule = Callable[[int, list[int], list[float], torch.device], tuple[int, torch.Tensor | None]]
"""rule(row, children, uniforms, device) -> (accepted child, None) or (-1, distribution [vocab]
of the next token, need not be normalised)."""


def _walk(tree: TokenTree, p: Rows, generator: torch.Generator | None, row_rule: RowRule) -> VerifyResult:
    """The tree walk every stochastic rule shares: from the root, let `row_rule` accept one child
    (descend) or reject them all (emit a sample of the distribution it returns); at a leaf emit
    the bonus token from p. One uniform per node (u[c]) and one for the emitted token (u[n])."""
    n = len(tree)
    dev = _device(generator)
    u = _uniforms(n, generator)
    path: list[int] = []
    r = 0
    while True:
        kids = tree.children[r]
        if not kids:  # leaf (or empty tree): bonus token from p at this row
            return VerifyResult(tuple(path), _sample(p[r], u[n]))
        accepted, residual = row_rule(r, kids, u, dev)
        if accepted < 0:
            return VerifyResult(tuple(path), _sample(residual, u[n]))
        path.append(accepted)
        r = accepted + 1


Noise = Callable[[int], torch.Tensor]
"""noise(d) -> the Exp(1) noise [>= vocab] that decides the target's token at depth d (`sampling.race_token`)."""


def target_tokens(p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`sampling.race_token` of every row at once, on p's device: p [n + 1, vocab] (rows need not be
    normalised), noise [n + 1, vocab] (row r gets the noise of its depth) -> LongTensor [n + 1]. For
    accelerators: one pass over the rows, no host synchronisation; then `verify_greedy` on the result is
    `verify_deterministic` (the same race, the same noise)."""
    return race(p, noise).argmax(-1)


def raced_tokens(logits: torch.Tensor, temperature: float, noise: torch.Tensor) -> torch.Tensor:
    """`verify_raced_logits`' token of every row at once, on the logits' device: logits [n + 1, vocab], noise
    [n + 1, vocab] (row r gets the noise of its depth, on the CPU: its Gumbel values are taken there, as the walk
    takes them) -> LongTensor [n + 1]; `target_tokens` for the race in logit form."""
    return race_scores(logits.float(), temperature, gumbel_of(noise).to(logits.device)).argmax(-1)


def _noise_of(noise: Noise | Sequence[torch.Tensor] | torch.Generator | None, vocab: int) -> Noise:
    """`verify_deterministic`'s noise as a function of the depth: as given, one tensor per depth, or fresh Exp(1)
    draws from a generator (None: torch's default one), each depth's drawn once."""
    if callable(noise) and not isinstance(noise, torch.Generator):
        return noise
    if noise is not None and not isinstance(noise, torch.Generator):
        return lambda d: noise[d]
    drawn: dict[int, torch.Tensor] = {}

    def draw(d: int) -> torch.Tensor:
        if d not in drawn:
            dev = _device(noise)
            drawn[d] = torch.empty(vocab, device=dev).exponential_(generator=noise).clamp_(min=MIN_NOISE)
        return drawn[d]
    return draw


def verify_deterministic(
    tree: TokenTree, p: Rows, noise: Noise | Sequence[torch.Tensor] | torch.Generator | None
) -> VerifyResult:
    """Verification of deterministic candidates (one-hot q: retrieval, n-gram, recycling,
    greedy or top-k model drafts, coupled candidates). p: [n + 1, vocab] target distributions (rows need
    not be normalised); noise: the Exp(1) noise [vocab] of each depth - a function of the depth d (d = 0:
    the token after the root), a sequence of them, or a generator to draw them from.

    The walk: at a row of depth d the target's token is `race_token(p[row], noise(d))` (an exact
    sample of p, the exponential race); the child holding that token, if any, is accepted and the
    walk descends; otherwise that token is emitted and the step ends (after a leaf, it is the
    bonus token). Lossless: every emitted token is exactly what sampling p one position at a
    time with the same noise would emit, so the output law is the target's whatever the tree.
    A row's children are accepted with probability sum_j p(x_j) for candidates fixed before the noise
    was seen, and more often for candidates raced with the same noise over a q close to p
    (`step.DraftContext.coupled_candidate`). And the output depends on the noise alone, not on what was drafted:
    with noise seeded by (request seed, position), a sampled run returns the same tokens as plain
    decoding with the same seed.

    Sibling tokens must be unique (ValueError otherwise): duplicates are a drafter bug (merge
    them with `TokenTree.merge`)."""
    _check_rows(p, len(tree), "p")
    _check_unique_siblings(tree)
    if isinstance(noise, Sequence) and len(noise) < tree.max_depth + 1:
        raise ValueError(f"verify_deterministic needs {tree.max_depth + 1} noise vectors (one per depth), "
                         f"got {len(noise)}")
    noise_at = _noise_of(noise, p.shape[-1])
    return _deterministic_walk(tree, lambda r, d: race_token(p[r], noise_at(d)))


def verify_raced_logits(tree: TokenTree, logits: Rows, params: SamplingParams, noise: Noise) -> VerifyResult:
    """`verify_deterministic` for a request whose token is raced in logit form (`SamplingParams.races_logits`):
    the target's token at a row of depth d is the argmax of logits / T - log E (`sampling.race_scores`, noise(d) =
    E [vocab]), the same sample as the race over the softmax, over the ids top-k / top-p / min-p keep where they
    truncate (`sampling.truncated_race`). A row source that can take it without the row (a screened pass, under
    any grammar or penalties above it: `tree_rows.TreeRows.exact_argmax`, or for a truncated request the kept
    ids' exact values, `TreeRows.exact_top`, with bounds on the others' for top-p over every id) does, so no float32
    logits are computed; else, or where those bounds leave top-p's nucleus open, the whole row."""
    _check_rows(logits, len(tree), "logits")
    _check_unique_siblings(tree)
    vocab, temperature = logits.shape[-1], params.temperature
    exact = getattr(logits, "exact_top" if params.truncates else "exact_argmax", None)

    def truncated_at(r: int, d: int) -> int:
        kept = None if exact is None else exact(r, RowEdit(), params.top_k, params.kept_within, params.ranks_every_id)
        if kept is not None:
            ids, values, rest = kept  # rest: bounds on the other ids' values, for top-p over every id
            token = truncated_race(ids, values, noise(d)[ids], params, rest)  # their noise alone
            if token is not None:
                return token
        return truncated_race(None, logits[r], noise(d)[:vocab], params)

    def token_at(r: int, d: int) -> int:
        gumbel = gumbel_of(noise(d)[:vocab])  # [vocab]

        def change(values: torch.Tensor) -> torch.Tensor:
            return race_scores(values, temperature, gumbel)
        token = None if exact is None else exact(r, RowEdit(change=change))
        if token is None:
            scores = change(logits[r].float())  # [vocab]
            token = int(scores.argmax())
            if not bool(scores[token] > float("-inf")):
                raise ValueError("cannot sample from a row with no finite logit (every token at -inf, or NaN)")
        return token
    return _deterministic_walk(tree, truncated_at if params.truncates else token_at)


def _deterministic_walk(tree: TokenTree, token_at: Callable[[int, int], int]) -> VerifyResult:
    """The walk of deterministic candidates: from the root's row, the target's token at row r of depth d
    (`token_at(r, d)`); the child holding it is accepted and the walk descends, else that token ends the step."""
    path: list[int] = []
    r, d = 0, 0
    while True:
        token = token_at(r, d)
        child = next((c for c in tree.children[r] if tree.tokens[c] == token), -1)
        if child < 0:
            return VerifyResult(tuple(path), token)
        path.append(child)
        r, d = child + 1, d + 1


def verify_rrs(
    tree: TokenTree,
    p: Rows,
    q: torch.Tensor,
    generator: torch.Generator | None,
    *,
    without_replacement: bool,
) -> VerifyResult:
    """Recursive rejection sampling. p: [n + 1, vocab] target, q: [n + 1, vocab] draft
    (rows are normalised here; rows of leaves of q are unused).

    At a row, with p_1 = p[row], q_1 = q[row] and children x_1..x_m in node order: accept x_j
    with probability min(1, p_j(x_j) / q_j(x_j)) and descend; on rejection
    p_{j+1} = norm(max(0, p_j - q_j)) and q_{j+1} = q_j with x_j removed and renormalised
    (without_replacement=True) or q_{j+1} = q (i.i.d.). If all are rejected the next token
    is sampled from p_{m+1}. Lossless when the children of each row were drawn from q[row]
    i.i.d. (`sample_iid`) or sequentially without replacement (`sample_without_replacement`),
    matching `without_replacement`. With one child per node this is exactly chain
    speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Edge cases: a child whose token has q_j(x) = 0 cannot have been drawn from q_j (e.g. a
    duplicate sibling in without-replacement mode, or a deterministic candidate) and raises
    ValueError. If the residual max(0, p_j - q_j) has no mass (p_j == q_j up to rounding, so
    the rejection itself was a rounding artefact), p_j is kept as p_{j+1}."""
    _check_rows(p, len(tree), "p")
    _check_rows(q, len(tree), "q")

    def row_rule(r: int, kids: list[int], u: list[float], dev: torch.device):
        pj = _normalised_row(p, r, dev, "p")  # [vocab] float64
        qj = _normalised_row(q, r, dev, "q")  # [vocab] float64
        for c in kids:
            x = tree.tokens[c]
            px, qx = float(pj[x]), float(qj[x])
            if not qx > 0:
                raise ValueError(
                    f"node {c} (token {x}) has draft probability 0 at row {r} after the earlier siblings; "
                    f"its children were not drawn from q by the declared scheme "
                    f"({'without replacement' if without_replacement else 'i.i.d.'}); "
                    f"use the deterministic rule for fixed candidates"
                )
            if u[c] < px / qx:  # min(1, .) is implicit: u < 1
                return c, None
            pj = _residual(pj, qj)
            if without_replacement:
                qj[x] = 0.0
                mass = qj.sum()
                if bool(mass > 0):
                    qj.div_(mass)
                # else q is exhausted: a further sibling raises above (it cannot have been drawn)
        return -1, pj

    return _walk(tree, p, generator, row_rule)


# ---------------------------------------------------------------------------- SpecTr K-SEQ
_KSEQ_TOL = 1e-12
"""Residual entries above -_KSEQ_TOL count as non-negative (rounding); they are clamped to 0."""


def _kseq_parts(p_row: torch.Tensor, q_row: torch.Tensor, k: int, rho: float) -> tuple[torch.Tensor, float, float]:
    """K-SEQ quantities at rho for normalised float64 rows p_row, q_row ([vocab]):
    m = min(q, p / rho) ([vocab], the per-draft acceptance mass), beta = sum(m) (probability
    that one draft is accepted) and c = (1 - (1 - beta)^k) / beta (= k in the limit beta -> 0),
    so that the accepted output has law m * c and the residual is p - m * c."""
    m = torch.minimum(q_row, p_row / rho)  # [vocab]
    beta = min(float(m.sum()), 1.0)
    c = (1.0 - (1.0 - beta) ** k) / beta if beta > 0 else float(k)
    return m, beta, c


def kseq_rho(p_row: torch.Tensor, q_row: torch.Tensor, k: int) -> float:
    """The smallest feasible rho in [1, k] of SpecTr K-SEQ for k i.i.d. drafts, for
    normalised float64 rows p_row (target) and q_row (draft), both [vocab].

    rho is feasible when the residual p - min(q, p / rho) * c(rho) is non-negative, with
    beta(rho) = sum min(q, p / rho) and c = (1 - (1 - beta)^k) / beta. For a token with
    q >= p / rho that reads c <= rho, i.e. h(rho) = g(rho) - 1 + (1 - beta)^k >= 0 with
    g(rho) = sum min(rho q, p) = rho beta; for a token with q < p / rho it reads
    c <= p / q, implied by c <= rho. g grows and beta shrinks with rho, so h is
    non-decreasing and c(rho) non-decreasing: the feasible set is [1, rho'] (when c(1) is
    below every ratio p/q, i.e. rho = 1 is feasible) or [rho*, k] (c(k) <= k always). rho*
    is found exactly up to 1e-13: g is piecewise linear with breakpoints at the ratios p/q,
    h is evaluated at every breakpoint in one vectorised pass, then bisected inside the
    bracketing piece, where g = A + rho B. The acceptance probability 1 - (1 - beta)^k
    falls as rho grows, so the smallest feasible rho is the best one."""
    if k < 1:
        raise ValueError(f"K-SEQ needs k >= 1 drafts, got {k}")
    m, beta, c = _kseq_parts(p_row, q_row, k, 1.0)
    if k == 1 or beta <= 0 or bool((p_row - m * c).min() >= -_KSEQ_TOL):
        return 1.0
    pos = q_row > 0
    ratio = torch.full_like(q_row, float("inf"))
    ratio[pos] = p_row[pos] / q_row[pos]  # [vocab]; tokens with q = 0 never enter g
    low = pos & (ratio <= 1.0)
    a0 = float(p_row[low].sum())  # g(rho) = a0 + rho b0 just above rho = 1
    b0 = float(q_row[pos & ~low].sum())
    inner = pos & (ratio > 1.0) & (ratio < k)
    r_in, order = ratio[inner].sort()
    a_at = a0 + p_row[inner][order].cumsum(0)  # A right of each breakpoint
    b_at = b0 - q_row[inner][order].cumsum(0)  # B right of each breakpoint
    # h at each breakpoint (g is continuous there; use the piece on its left).
    a_left = torch.cat([torch.tensor([a0], dtype=a_at.dtype, device=a_at.device), a_at[:-1]])
    b_left = torch.cat([torch.tensor([b0], dtype=b_at.dtype, device=b_at.device), b_at[:-1]])
    g_left = a_left + r_in * b_left  # g at each breakpoint
    ok = (g_left - 1.0 + (1.0 - g_left / r_in).clamp(min=0.0) ** k >= 0).nonzero()
    if len(ok):  # rho* lies in the piece left of the first breakpoint where h >= 0
        j = int(ok[0])
        lo = float(r_in[j - 1]) if j > 0 else 1.0
        hi, a, b = float(r_in[j]), float(a_left[j]), float(b_left[j])
    else:  # in the last piece, up to rho = k (h(k) >= 0)
        lo = float(r_in[-1]) if len(r_in) else 1.0
        hi = float(k)
        a, b = (float(a_at[-1]), float(b_at[-1])) if len(r_in) else (a0, b0)
    for _ in range(200):
        if hi - lo <= 1e-13 * hi:
            break
        mid = 0.5 * (lo + hi)
        g = a + mid * b
        if g - 1.0 + max(0.0, 1.0 - g / mid) ** k >= 0:  # h(mid)
            hi = mid
        else:
            lo = mid
    return hi


def kseq_acceptance(p_row: torch.Tensor, q_row: torch.Tensor, k: int) -> float:
    """Probability that K-SEQ with k i.i.d. drafts from q accepts one of them: 1 - (1 - beta)^k
    at the smallest feasible rho. p_row, q_row: [vocab] (normalised here)."""
    p_row = p_row.to(torch.float64) / p_row.sum()
    q_row = q_row.to(torch.float64) / q_row.sum()
    _, beta, _ = _kseq_parts(p_row, q_row, k, kseq_rho(p_row, q_row, k))
    return 1.0 - (1.0 - beta) ** k


def verify_kseq(
    tree: TokenTree, p: Rows, q: torch.Tensor, generator: torch.Generator | None
) -> VerifyResult:
    """SpecTr K-SEQ (Sun et al. 2023) applied at every node over its children, which must be
    k i.i.d. draws from q[row] (`sample_iid`). p, q: [n + 1, vocab] (rows normalised here).

    At a row with k children: rho = `kseq_rho` (smallest feasible), m = min(q, p / rho),
    beta = sum(m); try the children in node order, accepting x_i with probability
    m(x_i) / q(x_i) = min(1, p(x_i) / (rho q(x_i))) and descending. One draft is accepted with
    probability beta, so token x comes out accepted with probability
    m(x) (1 - (1 - beta)^k) / beta; if all k are rejected (probability (1 - beta)^k) the
    next token is sampled from the residual p - m (1 - (1 - beta)^k) / beta (normalised), which
    makes the output law exactly p. With one child this is chain speculative sampling.

    A child with q(x) = 0 cannot have been drawn from q: ValueError."""
    _check_rows(p, len(tree), "p")
    _check_rows(q, len(tree), "q")

    def row_rule(r: int, kids: list[int], u: list[float], dev: torch.device):
        pj = _normalised_row(p, r, dev, "p")  # [vocab] float64
        qj = _normalised_row(q, r, dev, "q")  # [vocab] float64
        m, _, c = _kseq_parts(pj, qj, len(kids), kseq_rho(pj, qj, len(kids)))
        for child in kids:
            x = tree.tokens[child]
            qx = float(qj[x])
            if not qx > 0:
                raise ValueError(
                    f"node {child} (token {x}) has draft probability 0 at row {r}: K-SEQ needs children "
                    f"drawn i.i.d. from q; use the deterministic rule for fixed candidates"
                )
            if u[child] < float(m[x]) / qx:
                return child, None
        residual = (pj - m * c).clamp_(min=0.0)  # [vocab]
        if not bool(residual.sum() > 0):  # all rejected has probability 0 up to rounding
            residual = pj
        return -1, residual

    return _walk(tree, p, generator, row_rule)


# ---------------------------------------------------------------------------- the step
def verify_step(
    tree: TokenTree,
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    q: torch.Tensor | None = None,
    mode: SiblingMode = "deterministic",
    seed: int = 0,
    position: int = 0,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """One decode step's verification: the rule for how the tree was drafted, applied to the
    target's logits. logits: [n + 1, vocab] raw target logits (row 0 at the root, row i + 1
    after node i), or a row source shaped like them (a request's grammar masks rows lazily:
    `specula.constraints.MaskedLogits`, whose `argmax` covers the rows a greedy walk reaches); p
    is `probabilities(logits, params)`, processed only where a rule looks.

    - greedy (`params.greedy`): `verify_greedy` on the argmax of the rows a greedy walk reads
      (`tree_rows.greedy_argmax`; on a device every row's, one synchronisation); q and mode unused.
    - deterministic candidates (mode "deterministic": retrieval, n-grams, recycling, top-k
      and coupled model drafts): the race of `verify_deterministic` in logit form over the ids the
      truncation keeps (`verify_raced_logits`, every sampled request: `SamplingParams.races_logits`)
      with the noise of each output position, `position_noise(seed, position + d)` at depth d
      (`position` = tokens generated before this step), so the output is exactly plain sampling
      with the same seed whatever was drafted. On an accelerator every row's token is computed at
      once (`raced_tokens`, or `target_tokens` over `probabilities` for a truncated request; one
      host synchronisation), then matched greedily: the same tokens for the same noise.
    - children sampled from q ([n + 1, vocab'], its vocabulary axis padded or cut to the
      target's): "iid" / "without_replacement" -> `verify_rrs`, "iid_kseq" -> `verify_kseq`,
      with the request's `generator`.

    An empty tree is a plain decoding step. A sampled mode without q, or an unknown mode, raises
    ValueError."""
    if params.greedy:
        if isinstance(logits, torch.Tensor) and logits.device.type == "cpu":  # the accepted path's rows only
            return verify_greedy(tree, greedy_argmax(tree, row_argmax(logits)))
        return verify_greedy(tree, logits.argmax(-1))  # a device: every row at once, one synchronisation
    if mode == "deterministic":
        vocab = logits.shape[-1]
        if logits.device.type != "cpu":  # every row at once on the device: one synchronisation
            by_depth = torch.stack([position_noise(seed, position + d, vocab) for d in range(tree.max_depth + 1)])
            by_row = by_depth[torch.tensor((0, *tree.depth))]  # [n + 1, vocab]
            if not params.truncates:
                return verify_greedy(tree, raced_tokens(logits, params.temperature, by_row))
            return verify_greedy(tree, target_tokens(probabilities(logits, params), by_row.to(logits.device)))
        # rows on the path only, their noise only, through a pass's output screen where it has one
        return verify_raced_logits(tree, logits, params, lambda d: position_noise(seed, position + d, vocab))
    if mode not in ("iid", "without_replacement", "iid_kseq"):
        raise ValueError(f"verify_step: unknown sibling mode {mode!r}; expected 'deterministic', 'iid', "
                         "'without_replacement' or 'iid_kseq'")
    if q is None:
        raise ValueError(f"verify_step: children sampled ({mode!r}) need the draft distributions q they were drawn from")
    p = TargetRows(logits, params)  # [n + 1, vocab], rows processed only where the rule looks
    if q.shape[-1] != p.shape[-1]:
        q = _fit_vocab(q, p.shape[-1])
    if mode == "iid_kseq":
        return verify_kseq(tree, p, q, generator)
    return verify_rrs(tree, p, q, generator, without_replacement=mode == "without_replacement")


def _fit_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Pad (with zeros) or cut the draft's vocabulary axis ([..., vocab']) to the target's."""
    if q.shape[-1] > vocab:
        if q[..., vocab:].sum() > 0:
            raise ConfigError("the draft puts probability on token ids the target does not have")
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
