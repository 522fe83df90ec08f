import pytest

from specula.planner.select import chain_should_extend, choose_size, path_probabilities
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


def test_chain_rule_stops_when_the_next_token_does_not_pay():
    steep = linear_cost(1.0, 0.5)
    assert chain_should_extend([0.95], 0.05, 0.05, steep)
    assert not chain_should_extend([0.9, 0.5, 0.2, 0.05], 0.05, 0.3, steep)
    # A flat verify curve and free drafting: keep drafting while anything may be accepted.
    assert chain_should_extend([0.9, 0.5, 0.2, 0.05], 0.0, 0.0, linear_cost(1.0, 0.0))


def test_chain_rule_before_the_first_token_weighs_the_drafter_against_the_baseline():
    steep = linear_cost(1.0, 0.1)
    # A cheap draft token with a typical acceptance pays against plain decoding ...
    assert chain_should_extend([], 0.2, 0.0, steep, first_gain=0.7)
    # ... an expensive one does not,
    assert not chain_should_extend([], 0.9, 0.0, steep, first_gain=0.7)
    # and a proposal already reaching 2.5 tokens/s (vs 0.7 / 0.3 s for the draft token) raises the bar.
    assert not chain_should_extend([], 0.2, 0.0, steep, baseline_rate=2.5, first_gain=0.7)
    # Once drafting, a baseline above the chain's own rate stops it earlier.
    assert chain_should_extend([0.9, 0.8], 0.1, 0.2, steep)
    assert not chain_should_extend([0.9, 0.8], 0.1, 0.2, steep, baseline_rate=5.0)


def test_min_gain_leaves_marginal_trees_unverified():
    from specula.planner.select import choose_size

    def cost(n):
        return 1.0 + 0.1 * (n - 1)

    # One node at 0.15: rate 1.15 / 1.1 = 1.045 plain steps, a 4.5% predicted gain.
    assert choose_size([0.15], 0.0, cost)[0] == 1
    n, expected, rate = choose_size([0.15], 0.0, cost, min_gain=0.1)
    assert (n, expected, rate) == (0, 1.0, 1.0)  # plain step, at the plain rate
    assert choose_size([0.5], 0.0, cost, min_gain=0.1)[0] == 1  # 1.36 plain steps: worth it
