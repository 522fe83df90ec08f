import numpy as np
import pytest

from specula.drafters.base import DraftBudget, DraftContext
from specula.drafters.prompt_lookup import (PromptLookupConfig, PromptLookupDrafter, continuation_trie,
                                            find_continuations)
from specula.sampling import SamplingParams, make_generator
from specula.tree import TokenTree


def ctx(tokens) -> DraftContext:
    return DraftContext(list(tokens), 1, SamplingParams(), DraftBudget(64, 32), make_generator(0))


def test_longest_suffix_wins_and_most_recent_match_comes_first():
    tokens = np.array([1, 2, 3, 9, 7, 2, 3, 8, 5, 2, 3], dtype=np.int64)
    n, conts = find_continuations(tokens, PromptLookupConfig(num_pred_tokens=2))
    assert n == 2  # "2 3" matched twice; "5 2 3" never occurred before
    assert [c.tolist() for c in conts] == [[8, 5], [9, 7]]
    assert find_continuations(np.array([4, 5, 6], dtype=np.int64), PromptLookupConfig()) == (0, [])


def reference_continuations(tokens: list[int], cfg: PromptLookupConfig) -> tuple[int, list[list[int]]]:
    """`find_continuations` by its definition, position by position: the longest suffix of n tokens (max_ngram down
    to min_ngram) that occurred earlier with a token after it, the continuations of its latest matches first."""
    length = len(tokens)
    for n in range(min(cfg.max_ngram, length - 1), cfg.min_ngram - 1, -1):
        suffix = tokens[length - n:]
        starts = [i for i in range(length - n) if tokens[i:i + n] == suffix]  # i + n <= length - 1: a token after
        if starts:
            return n, [tokens[i + n:i + n + cfg.num_pred_tokens] for i in starts[::-1][:cfg.max_matches]]
    return 0, []


def test_continuations_equal_the_definition_on_random_contexts():
    """The search (one comparison over the context, then narrowing) against the definition, on contexts of few
    distinct tokens (many matches, long repeats) and many, every shape of config."""
    rng = np.random.default_rng(5)
    for _ in range(3000):
        length, vocab = int(rng.integers(1, 80)), int(rng.choice([2, 3, 5, 40]))
        tokens = rng.integers(0, vocab, length).tolist()
        low = int(rng.integers(1, 4))
        cfg = PromptLookupConfig(max_ngram=low + int(rng.integers(0, 3)), min_ngram=low,
                                 num_pred_tokens=int(rng.integers(1, 6)), max_matches=int(rng.integers(1, 5)))
        n, conts = find_continuations(np.array(tokens, dtype=np.int64), cfg)
        assert (n, [c.tolist() for c in conts]) == reference_continuations(tokens, cfg), (tokens, cfg)


def test_edge_scores_carry_the_match_length_at_the_root_and_agreement_below():
    drafter = PromptLookupDrafter(PromptLookupConfig(num_pred_tokens=3))
    three = drafter.propose(ctx([5, 6, 7, 1, 2, 5, 6, 7])).tree  # 3-gram match, one continuation
    one = drafter.propose(ctx([5, 6, 7, 1, 2, 9, 3, 7])).tree  # only "7" matches
    assert three.tokens == (1, 2, 5) and one.tokens == (1, 2, 9)
    assert three.edge_scores == pytest.approx([0.75, 1.0, 1.0])
    assert one.edge_scores == pytest.approx([0.25, 1.0, 1.0])


def test_the_continuations_trie_equals_its_definition():
    """The one-walk trie against its definition: `TokenTree.from_paths` of the continuations (nodes in order of first
    appearance) and, per node, the continuations through it over those through its parent (all at the root, there
    times the weight), exactly; on continuations of few distinct tokens (shared prefixes, repeated tokens, a
    continuation that is another's prefix) and of many."""
    rng = np.random.default_rng(11)
    for _ in range(2000):
        vocab = int(rng.choice([2, 3, 40]))
        conts = [rng.integers(0, vocab, int(rng.integers(1, 7))) for _ in range(int(rng.integers(1, 6)))]
        weight = float(rng.choice([0.25, 0.5, 0.75, 1.0]))
        tokens, parents, edges = continuation_trie(conts, weight)
        paths = [c.tolist() for c in conts]
        tree = TokenTree.from_paths(paths)
        assert (tokens, parents) == (tree.tokens, tree.parents), paths
        for i, edge in enumerate(edges):
            path = tree.tokens_of(tree.path_to(i))
            through = sum(p[:len(path)] == path for p in paths)
            parent = len(paths) if len(path) == 1 else sum(p[:len(path) - 1] == path[:-1] for p in paths)
            assert edge == through / parent * (weight if len(path) == 1 else 1.0), (paths, i)


def test_disagreeing_matches_split_the_edge_score():
    drafter = PromptLookupDrafter(PromptLookupConfig(num_pred_tokens=2, max_ngram=1))
    tree = drafter.propose(ctx([7, 1, 2, 7, 1, 3, 7])).tree  # "7" -> "1 3" (recent), "1 2"
    edges = dict(zip(tree.tokens, tree.edge_scores))
    assert edges[1] == pytest.approx(0.5)  # both continuations start with 1; weight 1 / 2
    assert edges[3] == pytest.approx(0.5) and edges[2] == pytest.approx(0.5)


def test_a_proposal_keeps_within_the_budget_it_is_given():
    """Nodes past the budget can never be verified; in a proposal they are priced by the cost view
    the drafters after it read (an adaptive draft model near a request's end was told not to draft)."""
    drafter = PromptLookupDrafter(PromptLookupConfig(num_pred_tokens=9))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 20, 21, 1, 2, 3]
    whole = drafter.propose(ctx(tokens)).tree
    assert whole.max_depth == 9 and len(whole) > 9
    for nodes, depth in ((1, 1), (4, 2), (64, 3)):
        budget_ctx = DraftContext(tokens, 1, SamplingParams(), DraftBudget(nodes, depth), make_generator(0))
        tree = drafter.propose(budget_ctx).tree
        assert len(tree) <= nodes and tree.max_depth <= depth and len(tree) == min(nodes, len(
            [d for d in whole.depth if d <= depth]))
