import pytest
import torch

from specula.tree import TokenTree


def test_chain_is_a_tree_with_consecutive_parents():
    t = TokenTree.chain([5, 6, 7])
    assert t.parents == (-1, 0, 1)
    assert t.depth == (1, 2, 3)
    assert t.is_chain()
    assert t.paths == ((0, 1, 2),)


def test_invalid_parent_order_is_rejected():
    with pytest.raises(ValueError, match="parent"):
        TokenTree.build([1, 2], [1, -1])
    with pytest.raises(ValueError, match="length"):
        TokenTree((1,), (-1, 0), (1.0,), ("x",))


def test_ancestor_mask_positions_and_paths():
    #      root
    #     /    \
    #    0(a)   3(d)
    #   /  \
    #  1(b) 2(c)
    t = TokenTree.build([10, 11, 12, 13], [-1, 0, 0, -1])
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(t.ancestor_mask, expected)
    assert t.position_offsets.tolist() == [1, 2, 2, 1]
    assert t.paths == ((0, 1), (0, 2), (3,))
    assert t.children[0] == (0, 3) and t.children[1] == (1, 2)


def test_merge_is_a_trie_union_with_duplicates_merged():
    a = TokenTree.chain([1, 2, 3], [0.9, 0.5, 0.2], "a")
    b = TokenTree.from_paths([[1, 2, 4], [5], [1, 2, 3, 6]], source="b")
    m = a.merge(b)
    # Shared prefix 1,2 appears once; 3 and 4 are siblings; 6 hangs below 3.
    assert m.tokens == (1, 2, 3, 4, 5, 6)
    assert m.parents == (-1, 0, 1, 1, -1, 2)
    assert m.sources[:3] == ("a", "a", "a") and m.sources[3:] == ("b", "b", "b")
    # Edge scores of shared nodes are the max of both.
    assert m.edge_scores[:3] == (1.0, 1.0, 1.0) and m.edge_scores[3] == 1.0
    # Duplicate siblings inside one tree are merged too.
    dup = TokenTree.build([7, 7, 8], [-1, -1, 1])
    merged = TokenTree.empty().merge(dup)
    assert merged.tokens == (7, 8) and merged.parents == (-1, 0)
    # Every root-to-node token path of both inputs is present exactly once.
    paths = {tuple(m.tokens_of(m.path_to(i))) for i in range(len(m))}
    assert len(paths) == len(m)
    for src in (a, b):
        for i in range(len(src)):
            assert tuple(src.tokens_of(src.path_to(i))) in paths


def test_merge_credits_every_source_of_a_shared_node_with_its_own_score():
    a = TokenTree.chain([1, 2, 3], [0.9, 0.5, 0.2], "a")
    b = TokenTree.chain([1, 2, 4], [0.3, 0.8, 0.7], "b")
    m = a.merge(b)
    assert m.sources == ("a", "a", "a", "b") and m.edge_scores == (0.9, 0.8, 0.2, 0.7)
    assert m.proposers(0) == (("a", 0.9), ("b", 0.3)) and m.proposers(1) == (("a", 0.5), ("b", 0.8))
    assert m.proposers(2) == (("a", 0.2),) and m.proposers(3) == (("b", 0.7),)
    # a later merge keeps the credits, a subtree carries them, new edge scores leave them
    m3 = m.merge(TokenTree.chain([1], [0.4], "c"))
    assert m3.proposers(0) == (("a", 0.9), ("b", 0.3), ("c", 0.4))
    sub = m.subtree([0, 1, 3])
    assert sub.proposers(1) == (("a", 0.5), ("b", 0.8)) and sub.proposers(2) == (("b", 0.7),)
    assert m.with_edge_scores([1.0] * 4).proposers(1) == (("a", 0.5), ("b", 0.8))
    # one source's duplicate nodes are one proposer (its highest score); no credits are stored
    same = TokenTree.from_paths([[1, 2], [1, 3]], [[0.4, 0.5], [0.6, 0.5]], source="a")
    assert same.credits == () and same.proposers(0) == (("a", 0.6),)
    with pytest.raises(ValueError, match="credits"):
        TokenTree((1,), (-1,), (1.0,), ("a",), ((("a", 1.0),), (("a", 1.0),)))


def test_path_scores_are_products_of_edge_scores():
    t = TokenTree.build([1, 2, 3, 4], [-1, 0, 1, -1], edge_scores=[0.5, 0.8, 0.25, 0.9])
    assert t.path_scores == pytest.approx((0.5, 0.4, 0.1, 0.9))


def test_top_nodes_is_ancestor_closed_and_best_first():
    # A node with a high edge score under a low-scoring parent is only taken after its parent,
    # and by its path score (0.1 * 0.95).
    t = TokenTree.build([1, 2, 3, 4], [-1, -1, 1, 0], edge_scores=[0.9, 0.1, 0.95, 0.5])
    top2 = t.top_nodes(2)
    assert top2.tokens == (1, 4)
    top3 = t.top_nodes(3)
    assert set(top3.tokens) == {1, 4, 2}
    for k in range(len(t) + 1):
        keep = set(t.top_node_indices(k))
        assert len(keep) == k
        assert all(t.parents[i] < 0 or t.parents[i] in keep for i in keep), keep


def test_prune_removes_descendants_and_subtree_requires_closure():
    t = TokenTree.from_paths([[1, 2, 3], [1, 4], [5]])
    pruned = t.prune([1])  # node 1 = token 2, drops 3 as well
    assert sorted(pruned.tokens) == [1, 4, 5]
    with pytest.raises(ValueError, match="ancestor-closed"):
        t.subtree([2])
    assert t.subtree(i for i, d in enumerate(t.depth) if d <= 1).tokens == (1, 5)  # the roots
