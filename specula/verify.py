"""Acceptance rules of speculative decoding, as pure functions (no model, cache or drafter).

Notation, used throughout this module: ``p`` is always the *target* distribution (after
temperature / top-k / top-p, i.e. ``specula.sampling.probabilities``), and ``q`` is always
the *draft* distribution from which the drafter drew the tree's children.

Row convention (shared with ``specula.tree``): ``p`` has shape ``[n + 1, vocab]`` for a tree
of ``n`` nodes; row ``0`` is the target distribution at the root (the token after the last
emitted token) and row ``i + 1`` the target distribution after tree node ``i``. ``q``, when
given, has the same shape; row ``r`` is the draft distribution from which the children of
row ``r`` were drawn (rows of leaves are unused).

Every rule returns a `VerifyResult`: the accepted node indices (root to deepest) and one
more token (a correction after a rejection, or a bonus token after a leaf), so a step
always emits ``len(path) + 1`` tokens. All sampling rules are lossless: the emitted tokens
are distributed exactly as if sampled one at a time from ``p`` - provided the children
really were drawn by the scheme the rule assumes (see each function).

Numerics: only the rows on the visited path are touched; each is copied once to float64
on the generator's device (one row, never an ``[n + 1, vocab]`` copy). Randomness: one
``torch.rand(n + 1)`` call with the caller's generator per verification - uniform ``i`` for
node ``i``'s acceptance test, the last one for the final sample (inverse CDF; a zero-mass
token is never picked). ``torch.multinomial`` (without replacement) is avoided on purpose:
on CPU one draw from a 150k vocabulary took ~4.6 ms against ~0.35 ms for cumsum + searchsorted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from .sampling import SamplingParams
from .tree import TokenTree

SiblingMode = Literal["deterministic", "iid", "without_replacement", "iid_kseq"]
"""How the children of one node were drafted: fixed candidates (one-hot q), i.i.d. draws
from q, or draws without replacement from q (e.g. `sample_without_replacement`).
"iid_kseq" is i.i.d. draws verified by SpecTr K-SEQ (`verify_kseq`) instead of RRS."""

__all__ = [
    "SiblingMode",
    "VerifyResult",
    "gumbel_keys",
    "kseq_acceptance",
    "kseq_rho",
    "sample_iid",
    "sample_without_replacement",
    "verify",
    "verify_chain",
    "verify_deterministic",
    "verify_greedy",
    "verify_kseq",
    "verify_rrs",
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


# ---------------------------------------------------------------------------- helpers
def _device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")


def _check_rows(t: torch.Tensor, n: int, name: str) -> None:
    # t: [n + 1, vocab]
    if t.dim() != 2 or t.shape[0] != n + 1:
        raise ValueError(f"{name} must have shape [n + 1, vocab] = [{n + 1}, vocab] for a tree of {n} nodes, got {tuple(t.shape)}")


def _uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    """n + 1 U[0, 1) in one call: one per tree node (its acceptance test), then one for the
    final sample."""
    return torch.rand(n + 1, generator=generator, dtype=torch.float64, device=_device(generator)).tolist()


def _row_copy(t: torch.Tensor, r: int, device: torch.device) -> torch.Tensor:
    """Row r of t ([n + 1, vocab]) as a fresh float64 [vocab] tensor we may modify in place."""
    return t[r].to(device=device, dtype=torch.float64, copy=True)


def _normalised_row(t: torch.Tensor, r: int, device: torch.device, name: str) -> torch.Tensor:
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


# ---------------------------------------------------------------------------- draft sampling
def sample_iid(q_row: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k i.i.d. draws from q_row ([vocab], need not be normalised) -> LongTensor [k]
    (on q_row's device). Pair with sibling mode "iid"."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=q_row.device)
    q = q_row.to(device=_device(generator), dtype=torch.float64)  # [vocab]
    return torch.multinomial(q, k, replacement=True, generator=generator).to(q_row.device)


def sample_without_replacement(q_row: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k draws without replacement from q_row ([vocab]) by the Gumbel-top-k trick:
    argtopk(log q + Gumbel), in draw order (the i-th token is distributed as q with the
    first i - 1 removed and renormalised). Returns LongTensor [min(k, |support of q|)] on
    q_row's device: tokens with q = 0 are never drawn. Pair with sibling mode
    "without_replacement"."""
    k = min(int(k), int((q_row > 0).sum()))
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=q_row.device)
    return gumbel_keys(q_row, generator).topk(k).indices.to(q_row.device)


def gumbel_keys(q_row: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """log q + Gumbel(0, 1) noise for q_row ([vocab], need not be normalised): float64
    [vocab] on the generator's device, -inf where q = 0. Its descending order is a sample
    without replacement from q; stochastic beam search also needs the key values."""
    q = q_row.to(device=_device(generator), dtype=torch.float64)  # [vocab]
    u = torch.rand(q.shape, generator=generator, dtype=torch.float64, device=q.device)  # [vocab]
    u.clamp_(min=torch.finfo(torch.float64).tiny)
    return q.log() - (-u.log()).log()


# ---------------------------------------------------------------------------- rules
def verify_greedy(tree: TokenTree, target_argmax: torch.Tensor) -> VerifyResult:
    """Greedy verification. target_argmax: [n + 1] long, argmax of the target at each row.

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


def _walk(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None, row_rule: RowRule) -> VerifyResult:
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


def verify_deterministic(
    tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None
) -> VerifyResult:
    """Verification of deterministic candidates (one-hot q: retrieval, n-gram, recycling,
    top-k drafts). p: [n + 1, vocab] target distributions (rows need not be normalised).

    At a row with target distribution P and children x_1..x_m in node order: accept x_j
    with probability P(x_j) / (current mass of P) and descend; otherwise set P(x_j) = 0
    (the next child is tested against the renormalised residual). If no child is accepted,
    the next token is sampled from the current P. This is recursive rejection sampling with
    one-hot q, hence lossless for any fixed choice of children.

    Sibling tokens must be unique (ValueError otherwise): a duplicate would be tested
    against a P in which its token already has probability 0."""
    _check_rows(p, len(tree), "p")
    _check_unique_siblings(tree)

    def row_rule(r: int, kids: list[int], u: list[float], dev: torch.device):
        kid_tokens = [tree.tokens[c] for c in kids]
        rest_row = _row_copy(p, r, dev)  # [vocab] float64, P with the children's tokens zeroed
        vals = rest_row[kid_tokens].tolist()  # P(x_1..x_m)
        rest_row[kid_tokens] = 0.0
        # Mass of the current (residual) P before child j = rest + P(x_j) + ... + P(x_m): sums of
        # non-negative terms only (no cancellation), so it is 0 iff every term is 0, and it equals
        # P(x_j) exactly when nothing else is left - then the ratio is 1.0 and u < 1 accepts.
        # Hence after any rejection the remaining mass is positive. One O(vocab) pass per row.
        suffix = [0.0] * (len(kids) + 1)
        for j in range(len(kids) - 1, -1, -1):
            suffix[j] = vals[j] + suffix[j + 1]
        rest = float(rest_row.sum())
        if not rest + suffix[0] > 0:
            raise ValueError(f"p row {r} has no probability mass")
        for j, c in enumerate(kids):
            if vals[j] > 0 and u[c] < vals[j] / (rest + suffix[j]):
                return c, None
        return -1, rest_row  # all children rejected

    return _walk(tree, p, generator, row_rule)


def verify_rrs(
    tree: TokenTree,
    p: torch.Tensor,
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


def verify_chain(
    tree: TokenTree, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None
) -> VerifyResult:
    """Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023). tree must be a
    chain (node i's parent is i - 1) whose token i was drawn from q[i] ([n + 1, vocab]);
    p: [n + 1, vocab]. Accept x_i w.p. min(1, p(x_i)/q(x_i)); at the first rejection emit a
    sample of norm(max(0, p - q)); if all are accepted emit a bonus sample from p[n]."""
    if not tree.is_chain():
        raise ValueError("verify_chain needs a chain (node i's parent must be i - 1); use verify_rrs for trees")
    return verify_rrs(tree, p, q, generator, without_replacement=False)


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
    tree: TokenTree, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None
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


def verify(
    tree: TokenTree,
    p: torch.Tensor,
    q: torch.Tensor | None,
    mode: SiblingMode | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Pick the acceptance rule. p: [n + 1, vocab] target (probabilities, or logits when
    params.greedy); q: [n + 1, vocab] draft or None.

    greedy params -> `verify_greedy` on p.argmax(-1); q None or mode "deterministic" ->
    `verify_deterministic`; "iid" / "without_replacement" -> `verify_rrs`; "iid_kseq" ->
    `verify_kseq`. mode None with a
    q is accepted only when no row has more than one child (then both sampling modes are the
    same rule); otherwise it raises ValueError. An empty tree is a plain decoding step."""
    if params.greedy:
        return verify_greedy(tree, p.argmax(-1))
    if q is None or mode == "deterministic":
        return verify_deterministic(tree, p, generator)
    if mode == "iid":
        return verify_rrs(tree, p, q, generator, without_replacement=False)
    if mode == "without_replacement":
        return verify_rrs(tree, p, q, generator, without_replacement=True)
    if mode == "iid_kseq":
        return verify_kseq(tree, p, q, generator)
    if mode is None:
        if all(len(kids) <= 1 for kids in tree.children):
            return verify_rrs(tree, p, q, generator, without_replacement=False)
        raise ValueError(
            "verify: a draft distribution q was given for a tree with sibling nodes but no sibling mode; "
            "pass mode='iid' or 'without_replacement' (how the children were drawn) or 'deterministic'"
        )
    raise ValueError(f"verify: unknown sibling mode {mode!r}; expected 'deterministic', 'iid', 'without_replacement' or 'iid_kseq'")
