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


def chain_should_extend(
    path_probs: Sequence[float], draft_step_seconds: float, draft_seconds: float,
    verify_seconds: Callable[[int], float], baseline_rate: float | None = None, first_gain: float = 1.0,
) -> bool:
    """SpecDec++-style stop rule for a chain, derived from the cost model: after k drafted
    tokens with path probabilities `path_probs` (P(first i all accepted)), draft one more only
    if its expected gain per extra second beats the step's current tokens per second.

    The current rate is the chain's own, or `baseline_rate` when higher (what the rest of the
    proposal already reaches without this drafter, e.g. retrieval trees in fusion). The next
    token's path probability is unknown before drafting it; it is bounded by the last one, so
    the rule uses path_probs[-1] as the optimistic estimate of the gain, and `first_gain` (the
    drafter's mean acceptance) before the first token: with k = 0, False means "do not run the
    drafter this step at all"."""
    k = len(path_probs)
    expected = 1.0 + sum(path_probs)
    rate = max(expected / (draft_seconds + verify_seconds(k + 1)), baseline_rate or 0.0)
    gain = path_probs[-1] if path_probs else first_gain
    extra = draft_step_seconds + max(0.0, verify_seconds(k + 2) - verify_seconds(k + 1))
    return extra <= 0 or gain / extra >= rate
