"""Pure functions that size a tree to the hardware.

Expected accepted tokens of a tree (bonus included) = 1 + Σ_nodes P(node accepted), with
P(node accepted) = Π over its path of per-edge acceptance estimates. Because estimates
shrink along paths, the best N nodes form an ancestor-closed tree, and the tree size is
N* = argmax_N E(N) / (T_draft + T_verify(N + 1)); N = 0 is a plain decoding step.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

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


def tree_kind(tree: TokenTree, forced: str) -> frozenset[str] | None:
    """The sources that proposed a tree's nodes (`HardwarePlanner.tree_factor` learns one factor per
    kind); None where the request's grammar forced a node (a certain token is not scaled)."""
    kind = frozenset(source for i in range(len(tree)) for source, _ in tree.proposers(i))
    return None if forced in kind else kind


AGREED = "agreed"
"""Sibling context of a node several sources proposed (see `sibling_contexts`)."""
CONTESTED = "contested"
"""Sibling context of a one-source node with a sibling only other sources proposed."""


def probe_nodes(tree: TokenTree, sources: Iterable[str], order: Sequence[int] = ()) -> dict[str, list[int]]:
    """Per source in `sources` that proposed a root child of `tree`: the path of its chain, from the
    first of its root children in `order` (best first; a node missing from it after those in it, by
    index) down through the first of that source's children of each node."""
    rank = {node: k for k, node in enumerate(order)}
    children: dict[int, list[int]] = {}
    for i, par in enumerate(tree.parents):
        children.setdefault(par, []).append(i)
    paths: dict[str, list[int]] = {}
    for source in sources:
        path, parent = [], -1
        while True:
            own = [i for i in children.get(parent, ()) if any(s == source for s, _ in tree.proposers(i))]
            if not own:
                break
            parent = min(own, key=lambda i: (rank.get(i, len(rank)), i))
            path.append(parent)
        if path:
            paths[source] = path
    return paths


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
    if not tree.credits and len(set(tree.sources)) <= 1:  # one drafter's tree (a lone head's: most steps)
        return [None] * len(tree)
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
    min_gain: float = 0.0, others: float = 0.0,
) -> tuple[int, float, float]:
    """Best number of nodes to verify.

    ordered_probs: path probabilities in best-first (ancestor-closed) order.
    verify_seconds(n): latency of the target pass holding n tokens of this tree (root + n - 1 nodes).
    min_gain: a tree is chosen only if its expected rate beats a plain step's by this fraction.
    others: tokens the pass yields besides this tree's (in a batch: the other sessions' roots).
    Returns (N, expected accepted tokens of this tree incl. bonus, expected tokens per second of
    the pass)."""
    plain = (1.0 + others) / (draft_seconds + verify_seconds(1))
    best_n, best_e, best_rate = 0, 1.0, plain
    expected = 1.0
    for n, prob in enumerate(ordered_probs, start=1):
        expected += prob
        rate = (expected + others) / (draft_seconds + verify_seconds(n + 1))
        if rate > best_rate and rate >= (1.0 + min_gain) * plain:
            best_n, best_e, best_rate = n, expected, rate
    return best_n, best_e, best_rate


def chain_lookahead(
    path_probs: Sequence[float], alpha: float, max_more: int, token_seconds: float, spent_seconds: float,
    verify_seconds: Callable[[int], float], one_time_seconds: float = 0.0, beside: Sequence[float] = (),
    beside_root: float = 0.0, beside_seconds: float = 0.0, others: float = 0.0,
) -> tuple[int, float, float]:
    """How many more tokens a chain should draft (SpecDec++ with lookahead, derived from the cost
    model): after k drafted tokens with path probabilities `path_probs` (P(first i all accepted)),
    in `spent_seconds`, drafting m more costs m * token_seconds (+ `one_time_seconds` once, when
    m >= 1: e.g. a draft cache catching up) and each new token keeps the chain alive with
    probability `alpha`.

    The chain is valued by what it adds to the tree it joins: `beside` holds the path
    probabilities of the nodes other drafters proposed this step (best first, drafted in
    `beside_seconds`), `beside_root` the sum of those of their root children. Siblings exclude
    each other, so where the chain's first token and the others' root children would together
    be accepted with probability above 1, the others' nodes are scaled down to the mass the
    chain leaves them (1 - its first token's probability). Expected tokens of the joint tree at N
    nodes: 1 + the N best of the chain's and the others' nodes; its rate E(N) / (beside_seconds +
    spent + m token_seconds [+ one_time] + T_verify(N + 1)), at the best N (0: a plain step).

    In a batch the pass also verifies the other sessions' roots: `others` tokens it yields besides
    this session's, and `verify_seconds(n)` the packed pass holding n of this session's tokens.

    Returns (m*, rate(m*), rate(0)) with m* = argmax_m over m = 0..max_more. Looking ahead
    matters: one more token alone rarely pays for a draft pass (its gain is at most alpha),
    while a run of them, accepted together once the first is, does. Valuing the chain beside
    the others matters too: judged alone against their tree, a strong drafter that runs after a
    weaker one declined to draft whenever the weaker tree looked as good as its own chain, and
    the two together were worth more than either (the README main job with Qwen2.5-Coder-1.5B's
    trained head in `fusion`: the 0.5B draft model drafted 37 tokens in 40 steps instead of 126
    in 22)."""
    chain = list(path_probs)
    step = chain[-1] if chain else 1.0
    costs = [0.0] + [verify_seconds(n) for n in range(1, len(chain) + max_more + len(beside) + 2)]  # costs[n]: n tokens
    best_m, best_rate, rate0 = 0, 0.0, 0.0
    for m in range(max_more + 1):
        if m:
            step *= alpha
            chain.append(step)
        seconds = beside_seconds + spent_seconds + (one_time_seconds + m * token_seconds if m else 0.0)
        rate = joint_rate(chain, beside, beside_root, seconds, costs, others)
        if m == 0:
            rate0 = best_rate = rate
        elif rate > best_rate:
            best_m, best_rate = m, rate
    return best_m, best_rate, rate0


def joint_rate(chain: Sequence[float], beside: Sequence[float], beside_root: float, seconds: float,
               costs: Sequence[float], others: float = 0.0) -> float:
    """Expected tokens per second of the best tree made of a chain's nodes (path probabilities
    `chain`, non-increasing) and other drafters' (`beside`, best first; their root children summing
    to `beside_root`), verified after `seconds` of drafting; `costs[n]`: latency of the target pass
    holding n tokens of this tree, for n up to len(chain) + len(beside) + 1, which yields `others`
    tokens besides. See `chain_lookahead`."""
    first = chain[0] if chain else 0.0
    scale = 1.0 if beside_root <= 0.0 or first + beside_root <= 1.0 else max(0.0, 1.0 - first) / beside_root
    expected, best_rate = 1.0 + others, (1.0 + others) / (seconds + costs[1])
    n_chain, n_beside = len(chain), len(beside)
    i = j = 0
    for n in range(2, n_chain + n_beside + 2):  # n tokens in the pass: the root and n - 1 nodes
        if j < n_beside and (i >= n_chain or scale * beside[j] > chain[i]):
            expected += scale * beside[j]
            j += 1
        else:
            expected += chain[i]
            i += 1
        rate = expected / (seconds + costs[n])
        if rate > best_rate:
            best_rate = rate
    return best_rate


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
