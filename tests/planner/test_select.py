import pytest

import itertools

from specula.planner.cost import CostCurve
from specula.planner.select import (AGREED, CONTESTED, chain_lookahead, choose_batch, choose_size, joint_rate,
                                    path_probabilities, probe_nodes, sibling_contexts, tree_kind)
from specula.tree import TokenTree


def linear_cost(base: float, per_token: float):
    return lambda n: base + per_token * (n - 1)


def test_flat_curve_takes_every_useful_node_steep_curve_takes_few():
    probs = [0.9, 0.8, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05]
    n_flat, e_flat, _ = choose_size(probs, 0.0, linear_cost(1.0, 0.0))  # GPU-like: free extra tokens
    n_steep, e_steep, _ = choose_size(probs, 0.0, linear_cost(1.0, 0.5))  # each token costs half a step
    assert n_flat == len(probs) and e_flat == pytest.approx(1 + sum(probs))
    assert 0 < n_steep < n_flat
    # The choice is the exact argmax of E(N) / T(N) over N = 0..8.
    rates = [(1 + sum(probs[:n])) / (1.0 + 0.5 * n) for n in range(len(probs) + 1)]
    assert n_steep == max(range(len(rates)), key=rates.__getitem__)


def test_plain_step_when_nothing_beats_it():
    n, e, rate = choose_size([0.05, 0.01], 0.0, linear_cost(1.0, 1.0))
    assert (n, e) == (0, 1.0) and rate == pytest.approx(1.0)
    # Expensive drafting is sunk in every option: it makes bigger trees more attractive, not fewer.
    n_cheap, _, _ = choose_size([0.6, 0.4, 0.3, 0.2], 0.0, linear_cost(1.0, 0.4))
    n_costly, _, _ = choose_size([0.6, 0.4, 0.3, 0.2], 2.0, linear_cost(1.0, 0.4))
    assert n_costly >= n_cheap


def test_path_probabilities_multiply_edges_along_paths():
    tree = TokenTree.build([1, 2, 3, 4], [-1, 0, 1, 0])
    edges = [0.8, 0.5, 0.5, 0.75]
    assert path_probabilities(tree, edges) == pytest.approx([0.8, 0.4, 0.2, 0.6])
    assert path_probabilities(tree.with_edge_scores(edges), edges) == pytest.approx(tree.with_edge_scores(edges).path_scores)


def test_best_first_order_is_ancestor_closed_at_every_prefix():
    tree = TokenTree.build([1, 2, 3, 4, 5], [-1, 0, -1, 2, 3], edge_scores=[0.3, 0.25 / 0.3, 0.9, 0.85 / 0.9, 0.1 / 0.85])
    order = tree.best_first_order()
    assert order == [2, 3, 0, 1, 4]
    for k in range(len(order) + 1):
        chosen = set(order[:k])
        assert all(tree.parents[i] < 0 or tree.parents[i] in chosen for i in chosen)


def test_chain_lookahead_drafts_runs_that_pay_and_stops_when_they_do_not():
    steep = linear_cost(1.0, 0.5)
    # Cheap tokens accepted 90% of the time: a long run pays.
    m, rate, rate0 = chain_lookahead([], 0.9, 8, 0.05, 0.0, linear_cost(1.0, 0.05))
    assert m == 8 and rate > rate0 == 1.0
    # The same drafter on a steep verify curve: a short run at most.
    assert chain_lookahead([], 0.9, 8, 0.05, 0.0, steep)[0] == 3
    # Tokens that cost as much as a target step never pay.
    assert chain_lookahead([], 0.9, 8, 1.0, 0.0, steep)[0] == 0
    # Mid-chain: once the path is unlikely, stop.
    assert chain_lookahead([0.9, 0.5, 0.2, 0.05], 0.3, 4, 0.05, 0.3, steep)[0] == 0


def test_a_chain_is_valued_by_what_it_adds_to_the_tree_it_joins():
    """Beside another drafter's tree (path probabilities 0.5, 0.4, 0.3, 0.2: 1.91 plain-step rates),
    a cheap chain accepted half the time is worth drafting: alone it rates only 1.5, below that
    tree, but the two together rate 2.21 (siblings: 0.5 + 0.5 of root mass, nothing to scale)."""
    cpu = CostCurve((1, 2, 4, 8, 16), (1.0, 1.08, 1.19, 1.45, 1.58), 64).latency
    costs = [0.0] + [cpu(n) for n in range(1, 40)]
    beside = [0.5, 0.4, 0.3, 0.2]
    assert joint_rate([], beside, 0.5, 0.0, costs) == pytest.approx(1.9124, abs=1e-3)
    m, rate, rate0 = chain_lookahead([], 0.5, 8, 0.02, 0.0, cpu)
    assert rate == pytest.approx(1.5) and rate < joint_rate([], beside, 0.5, 0.0, costs)  # alone: worse than the tree
    m, rate, rate0 = chain_lookahead([], 0.5, 8, 0.02, 0.0, cpu, beside=beside, beside_root=0.5)
    assert m == 2 and rate == pytest.approx(2.2105, abs=1e-3) and rate0 == pytest.approx(1.9124, abs=1e-3)
    # The others' drafting time counts against every option alike.
    assert chain_lookahead([], 0.5, 8, 0.02, 0.0, cpu, beside=beside, beside_root=0.5, beside_seconds=0.5)[2] < rate0


def test_beside_a_sure_token_a_chain_that_is_no_surer_is_not_drafted():
    """Siblings exclude each other: the others' root children already sum to 0.99, so a chain
    whose first token is accepted 80% of the time could only take their place (their nodes are
    scaled to the 0.2 it leaves them), and drafting it costs time."""
    cpu = CostCurve((1, 2, 4, 8, 16), (1.0, 1.08, 1.19, 1.45, 1.58), 64).latency
    costs = [0.0] + [cpu(n) for n in range(1, 40)]
    sure = [0.99, 0.9, 0.8]
    m, rate, rate0 = chain_lookahead([], 0.8, 8, 0.1, 0.0, cpu, beside=sure, beside_root=0.99)
    assert m == 0 and rate == rate0 == pytest.approx(joint_rate([], sure, 0.99, 0.0, costs))
    # The joint tree at a first-token probability of 0.8: the others' nodes count 0.2 / 0.99 of theirs,
    # and the best N of all five nodes is verified.
    nodes = sorted([0.8, 0.8 ** 2] + [p * 0.2 / 0.99 for p in sure], reverse=True)
    best = max((1 + sum(nodes[:n])) / cpu(n + 1) for n in range(len(nodes) + 1))
    assert joint_rate([0.8, 0.8 ** 2], sure, 0.99, 0.0, costs) == pytest.approx(best)


def test_lookahead_values_runs_and_one_time_costs():
    """A draft token costing 40% of a plain step, accepted 90% of the time, on a flat-ish CPU curve:
    a run of three is best (1.41 plain-step rates); a one-time cost of three plain steps (a draft
    cache catching up a whole prompt) vetoes any run this step, which is why the planner's view
    spreads it over the request's future steps."""
    cpu = lambda n: 1.0 + 0.08 * (n - 1)  # noqa: E731
    m, rate, rate0 = chain_lookahead([], 0.9, 12, 0.4, 0.0, cpu)
    assert m == 3 and rate == pytest.approx(1.4094, abs=1e-3) and rate0 == 1.0
    assert chain_lookahead([], 0.9, 12, 0.4, 0.0, cpu, one_time_seconds=3.0)[0] == 0
    assert chain_lookahead([], 0.9, 12, 0.4, 0.0, cpu, one_time_seconds=3.0 / 20)[0] == 4  # longer, to spread it


def test_min_gain_leaves_marginal_trees_unverified():
    from specula.planner.select import choose_size

    def cost(n):
        return 1.0 + 0.1 * (n - 1)

    # One node at 0.15: rate 1.15 / 1.1 = 1.045 plain steps, a 4.5% predicted gain.
    assert choose_size([0.15], 0.0, cost)[0] == 1
    n, expected, rate = choose_size([0.15], 0.0, cost, min_gain=0.1)
    assert (n, expected, rate) == (0, 1.0, 1.0)  # plain step, at the plain rate
    assert choose_size([0.5], 0.0, cost, min_gain=0.1)[0] == 1  # 1.36 plain steps: worth it


def test_choose_batch_of_one_session_is_choose_size():
    probs = [0.9, 0.8, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05]
    for per_token in (0.0, 0.2, 0.5, 2.0):
        cost = linear_cost(1.0, per_token)
        counts, expected, rate = choose_batch([probs], 1, 1.0, 0.3, cost, 0.1)
        assert (counts[0], expected, rate) == pytest.approx(choose_size(probs, 0.3, cost, 0.1))


def test_a_tree_beside_other_sessions_roots_must_beat_the_batch_rate():
    """Beside 7 other roots in a pass that costs 1.0 whatever the roots and 0.3 a node, a node
    accepted 60% of the time pays alone (1.6 tokens for 1.3 of a step) but not in the batch (8.6
    for 1.3 against 8 for 1.0); at 0.05 a node a sure chain does. A session's choice is the batch
    plan's for that session (choose_batch with the others' trees empty)."""
    cost = linear_cost(1.0, 0.3)
    assert choose_size([0.6], 0.0, cost)[0] == 1
    assert choose_size([0.6], 0.0, cost, others=7.0) == (0, 1.0, pytest.approx(8.0))
    probs = [0.99, 0.98, 0.97]
    for per_token, nodes in ((0.3, 0), (0.05, 3)):
        counts, _, rate = choose_batch([probs] + [[]] * 7, 8, 8.0, 0.0, lambda total: 1.0 + per_token * (total - 8))
        n, _, alone_rate = choose_size(probs, 0.0, linear_cost(1.0, per_token), others=7.0)
        assert counts[0] == n == nodes and rate == pytest.approx(alone_rate)
    chain = [0.6, 0.36]
    costs = [0.0] + [cost(n) for n in range(1, 4)]
    assert joint_rate(chain, [], 0.0, 0.0, costs) > 1.0  # alone the chain beats a plain step ...
    assert joint_rate(chain, [], 0.0, 0.0, costs, others=7.0) == pytest.approx(8.0)  # ... in the batch none of it
    assert chain_lookahead([], 0.6, 4, 0.0, 0.0, cost)[0] >= 1
    assert chain_lookahead([], 0.6, 4, 0.0, 0.0, cost, others=7.0)[0] == 0


def test_choose_batch_is_the_best_combination_of_prefixes():
    """The greedy pick by path probability equals the brute-force optimum over every combination of
    per-session prefixes (the batch's expected tokens / the pass's seconds)."""
    sessions = [[0.9, 0.6, 0.3], [0.5, 0.45, 0.1], [0.2, 0.05]]
    cost = lambda total: 1.0 + 0.12 * (total - 3) + 0.02 * (total - 3) ** 2  # noqa: E731  convex, CPU-like
    counts, expected, rate = choose_batch(sessions, 3, 3.0, 0.0, cost)
    best = max(itertools.product(*(range(len(s) + 1) for s in sessions)),
               key=lambda c: (3 + sum(sum(s[:n]) for s, n in zip(sessions, c))) / cost(3 + sum(c)))
    assert counts == list(best)
    assert expected == pytest.approx(3 + sum(sum(s[:n]) for s, n in zip(sessions, counts)))
    assert rate == pytest.approx(expected / cost(3 + sum(counts)))


def test_choose_batch_gives_zero_to_sessions_whose_drafts_do_not_pay_under_load():
    """SmartSpec: on a compute-bound pass (each token costs 5% of a full batch step) a session
    with confident drafts keeps its nodes, one with poor drafts gets none; on a cheap pass both draft."""
    good, poor = [0.95, 0.9, 0.85, 0.8], [0.04, 0.02]
    steep = lambda total: 1.0 + 0.05 * (total - 8)  # noqa: E731
    counts, _, _ = choose_batch([good, poor] + [[]] * 6, 8, 8.0, 0.0, steep)
    assert counts[0] == 4 and counts[1] == 0
    flat = lambda total: 1.0  # noqa: E731
    counts, _, _ = choose_batch([good, poor] + [[]] * 6, 8, 8.0, 0.0, flat)
    assert counts[:2] == [4, 2]
    # A load at which nothing pays: every session gets zero (continuous batching without speculation).
    counts, expected, _ = choose_batch([[0.3], [0.2]] + [[]] * 6, 8, 8.0, 0.0, steep)
    assert counts == [0] * 8 and expected == 8.0


def test_sibling_contexts_mark_agreeing_and_disagreeing_sources():
    # "a" drafts 5 -> 6 and a sibling 8; "b" drafts 5 and 7 at the root, 9 under 6.
    a = TokenTree.from_paths([[5, 6], [8]], [[0.6, 0.5], [0.2]], source="a")
    b = TokenTree.from_paths([[5, 6, 9], [7]], [[0.7, 0.4, 0.3], [0.3]], source="b")
    merged = a.merge(b)
    context = {tuple(merged.tokens_of(merged.path_to(i))): c for i, c in enumerate(sibling_contexts(merged))}
    assert context == {
        (5,): AGREED, (5, 6): AGREED,  # both proposed them
        (8,): CONTESTED,  # a's alone, while "b" proposed its siblings 5 and 7
        (7,): CONTESTED,
        (5, 6, 9): None,  # no sibling: the source's own calibration holds
    }
    # One source's tree, siblings or not: no context (what its calibration was learned on).
    assert sibling_contexts(a) == [None] * len(a)


def test_a_trees_kind_is_the_set_of_its_sources_and_none_where_a_token_is_forced():
    a = TokenTree.from_paths([[5, 6], [8]], [[0.6, 0.5], [0.2]], source="a")
    b = TokenTree.from_paths([[5, 6, 9], [7]], [[0.7, 0.4, 0.3], [0.3]], source="b")
    assert tree_kind(a.merge(b), "grammar") == frozenset({"a", "b"})
    assert tree_kind(a, "grammar") == frozenset({"a"})
    assert tree_kind(TokenTree.empty(), "grammar") == frozenset()
    forced = TokenTree.chain([5], [1.0], "grammar")
    assert tree_kind(forced.merge(b), "grammar") is None  # a certain token is never scaled


def test_probe_nodes_follow_each_sources_chain_from_its_best_root_child():
    a = TokenTree.from_paths([[10, 11, 12], [30, 31]], [[0.5] * 3, [0.4] * 2], source="a")
    merged = a.merge(TokenTree.from_paths([[20, 21], [10, 40]], [[0.9] * 2, [0.9] * 2], source="b"))
    ids = {tuple(merged.tokens_of(merged.path_to(i))): i for i in range(len(merged))}
    # by index where no order is given; a node both proposed is on each one's chain
    assert probe_nodes(merged, ["a"]) == {"a": [ids[(10,)], ids[(10, 11)], ids[(10, 11, 12)]]}
    order = [ids[(30,)], ids[(20,)], ids[(10,)]]  # best first: a's later root child ranks first
    assert probe_nodes(merged, ["a", "b", "c"], order) == {"a": [ids[(30,)], ids[(30, 31)]],
                                                          "b": [ids[(20,)], ids[(20, 21)]]}
