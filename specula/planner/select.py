"""Pure functions that size a tree to the hardware.

Expected accepted tokens of a tree (bonus included) = 1 + Σ_nodes P(node accepted), with
P(node accepted) = Π over its path of per-edge acceptance estimates. Because estimates
shrink along paths, the best N nodes form an ancestor-closed tree, and the tree size is
N* = argmax_N E(N) / (T_draft + T_verify(N + 1)); N = 0 is a plain decoding step.
"""

from __future__ import annotations

from typing import Callable, Sequence

from specula.tree import TokenTree


def path_probabilities(tree: TokenTree, edge_probs: Sequence[float]) -> list[float]:
    """P(node reached and accepted) = product of edge probabilities along its path."""
    probs: list[float] = []
    for i, par in enumerate(tree.parents):
        probs.append(edge_probs[i] * (probs[par] if par >= 0 else 1.0))
    return probs


def best_children(tree: TokenTree) -> set[tuple[int, str]]:
    """(node, source) pairs where the node is its parent's highest-scored child among the children
    that source proposed, by that source's own score (ties: the first): what a chain of that source
    would have extended the parent by. A node several sources proposed counts for each of them."""
    best: dict[tuple[int, str], tuple[int, float]] = {}
    for i, par in enumerate(tree.parents):
        for source, raw in tree.proposers(i):
            top = best.get((par, source))
            if top is None or raw > top[1]:
                best[(par, source)] = (i, raw)
    return {(i, source) for (_, source), (i, _) in best.items()}


AGREED = "agreed"
"""Sibling context of a node several sources proposed (see `sibling_contexts`)."""
CONTESTED = "contested"
"""Sibling context of a one-source node with a sibling only other sources proposed."""


def sibling_contexts(tree: TokenTree) -> list[str | None]:
    """Per node: `AGREED` when two or more sources proposed it, `CONTESTED` when one source did and
    a sibling of it comes from another source, else None (every child of its parent is one
    source's: the case each source's calibration describes).

    A source's calibration says how often its nodes are accepted given their scores, whatever
    else the merged tree holds; but siblings exclude each other, so where two sources disagree
    about the next token each is less likely than its own score says (measured on SmolLM2's
    everyday prompts with fusion: where a parent's two or more children came from several
    sources, their estimates summed to 0.86-1.07 against 0.60-0.72 realised), and where they agree
    more likely.
    The planner learns one correction factor per context (`HardwarePlanner.context_factor`)."""
    children: dict[int, list[int]] = {}
    for i, par in enumerate(tree.parents):
        children.setdefault(par, []).append(i)
    out: list[str | None] = []
    for i, par in enumerate(tree.parents):
        mine = {source for source, _ in tree.proposers(i)}
        if len(mine) > 1:
            out.append(AGREED)
        elif any(source not in mine for j in children[par] if j != i for source, _ in tree.proposers(j)):
            out.append(CONTESTED)
        else:
            out.append(None)
    return out


def choose_size(
    ordered_probs: Sequence[float], draft_seconds: float, verify_seconds: Callable[[int], float],
    min_gain: float = 0.0,
) -> tuple[int, float, float]:
    """Best number of nodes to verify.

    ordered_probs: path probabilities in best-first (ancestor-closed) order.
    verify_seconds(n): latency of a target pass over n tokens (root + n - 1 nodes).
    min_gain: a tree is chosen only if its expected rate beats a plain step's by this fraction.
    Returns (N, expected accepted tokens incl. bonus, expected tokens per second)."""
    plain = 1.0 / (draft_seconds + verify_seconds(1))
    best_n, best_e, best_rate = 0, 1.0, plain
    expected = 1.0
    for n, prob in enumerate(ordered_probs, start=1):
        expected += prob
        rate = expected / (draft_seconds + verify_seconds(n + 1))
        if rate > best_rate and rate >= (1.0 + min_gain) * plain:
            best_n, best_e, best_rate = n, expected, rate
    return best_n, best_e, best_rate


def chain_lookahead(
    path_probs: Sequence[float], alpha: float, max_more: int, token_seconds: float, spent_seconds: float,
    verify_seconds: Callable[[int], float], one_time_seconds: float = 0.0,
) -> tuple[int, float, float]:
    """How many more tokens a chain should draft (SpecDec++ with lookahead, derived from the cost
    model): after k drafted tokens with path probabilities `path_probs` (P(first i all accepted)),
    in `spent_seconds`, drafting m more costs m * token_seconds (+ `one_time_seconds` once, when
    m >= 1: e.g. a draft cache catching up) and each new token keeps the chain alive with
    probability `alpha`. Expected tokens E(m) = 1 + sum(path_probs) + p_k (alpha + ... + alpha^m),
    time T(m) = spent + m token_seconds + T_verify(k + m + 1).

    Returns (m*, rate(m*), rate(0)) with m* = argmax_m E(m) / T(m) over m = 0..max_more. Looking
    ahead matters: one more token alone rarely pays for a draft pass (its gain is at most alpha),
    while a run of them, accepted together once the first is, does."""
    k = len(path_probs)
    expected = 1.0 + sum(path_probs)
    last = path_probs[-1] if path_probs else 1.0
    rate0 = expected / (spent_seconds + verify_seconds(k + 1))
    best_m, best_rate = 0, rate0
    gain, step = expected, last
    for m in range(1, max_more + 1):
        step *= alpha
        gain += step
        rate = gain / (spent_seconds + one_time_seconds + m * token_seconds + verify_seconds(k + m + 1))
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m, best_rate, rate0


def choose_batch(
    ordered_probs: Sequence[Sequence[float]], fixed_tokens: int, fixed_expected: float, draft_seconds: float,
    pass_seconds: Callable[[int], float], min_gain: float = 0.0,
) -> tuple[list[int], float, float]:
    """Every session's number of nodes in one packed pass, maximising the batch's goodput
    (SmartSpec): expected accepted tokens of all sessions per second of the step.

    ordered_probs[i]: session i's path probabilities in best-first (ancestor-closed, so
    non-increasing) order. fixed_tokens: tokens in the pass whatever is chosen (every session's
    root, and trees that must be verified as drawn); fixed_expected: their expected accepted
    tokens (one per root, plus what the fixed trees add). pass_seconds(total): latency of the pass
    with `total` tokens. Nodes are taken greedily by path probability across sessions (the best
    prefix of each session's order), so a session whose next node is worth less than the pass
    time it adds at this load gets zero. With one session and fixed_tokens = 1 this is
    `choose_size`. Returns (nodes per session, expected tokens, expected tokens per second)."""
    plain = fixed_expected / (draft_seconds + pass_seconds(fixed_tokens))
    merged = sorted(((p, i) for i, probs in enumerate(ordered_probs) for p in probs), key=lambda item: -item[0])
    best_k, best_e, best_rate = 0, fixed_expected, plain
    expected = fixed_expected
    for k, (prob, _) in enumerate(merged, start=1):
        expected += prob
        rate = expected / (draft_seconds + pass_seconds(fixed_tokens + k))
        if rate > best_rate and rate >= (1.0 + min_gain) * plain:
            best_k, best_e, best_rate = k, expected, rate
    counts = [0] * len(ordered_probs)
    for _, i in merged[:best_k]:
        counts[i] += 1
    return counts, best_e, best_rate
