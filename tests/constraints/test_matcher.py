"""The grammar state: forced chains, pruning, masked rows and argmax, and rollback to the
committed state (tiny byte-level tokenizer)."""

from __future__ import annotations

import random

import pytest
import torch

from grammar_kit import VOCAB
from specula.constraints import Constraint, GrammarState
from specula.constraints.drafting import allowed_proposal, constrained_proposals
from specula.step import FORCED_SOURCE, DraftBudget, Proposal
from specula.tree import TokenTree

SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ab", "cd"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture
def state(json_tokenizer):
    return GrammarState(Constraint.json_schema(SCHEMA), json_tokenizer, VOCAB, [1])


def test_forced_chain_is_what_the_grammar_alone_decides(state, json_tokenizer):
    state.commit(ids(json_tokenizer, '{"name'))
    forced = state.forced(10)
    assert json_tokenizer.decode(forced) == '": "'  # the key's end and the separator: one token allowed at each
    before = state.state_bitmask()
    state.forced(10)
    assert state.state_bitmask() == before  # forcing consumed nothing
    assert state.forced(1) == forced[:1]


def test_every_forced_token_is_the_only_one_allowed(state, json_tokenizer):
    state.commit(ids(json_tokenizer, '{"name": "ab", "'))
    forced = state.forced(10)
    assert forced
    for tok in forced:
        allowed = state.mask().nonzero().flatten().tolist()
        assert allowed == [tok]
        state.commit([tok])


def test_allowed_tree_drops_forbidden_nodes_and_their_subtrees(state, json_tokenizer):
    t = {s: ids(json_tokenizer, s)[0] for s in ('{"', "{", "a", "name", "age", "x")}
    # root -> {" -> name / x ; root -> a -> name
    tree = TokenTree.build([t['{"'], t["name"], t["x"], t["a"], t["name"]], [-1, 0, 0, -1, 3])
    assert state.allowed_tree(tree) == [0, 1]
    sampled = Proposal(tree, torch.full((6, VOCAB), 1.0 / VOCAB), "iid")
    assert allowed_proposal(state, sampled) is sampled  # children drawn from q are verified as drawn


def test_constrained_proposals_put_the_forced_chain_first(state, json_tokenizer):
    state.commit(ids(json_tokenizer, '{"name'))
    budget = DraftBudget(max_nodes=8, max_depth=8)
    out = constrained_proposals(state, [Proposal.empty()], budget, forced=True)
    assert out[0].tree.sources[0] == FORCED_SOURCE and len(out) == 2
    assert constrained_proposals(state, [Proposal.empty()], budget, forced=False)[0].tree.sources == ()
    assert len(constrained_proposals(state, [], DraftBudget(8, 1), forced=True)[0].tree) == 1  # depth budget


def test_a_sampled_proposal_gives_way_to_the_forced_chain(state, json_tokenizer):
    """A sampled proposal cannot share a tree: on a step the grammar forces tokens it is dropped (a
    choice by the grammar state alone, not by the draws); deterministic ones stay beside the chain."""
    state.commit(ids(json_tokenizer, '{"name'))
    budget = DraftBudget(max_nodes=8, max_depth=8)
    tree = TokenTree.chain(state.forced(1), [0.5], "draft-model")  # a draw the grammar allows
    sampled, fixed = Proposal(tree, torch.full((2, VOCAB), 1.0 / VOCAB), "iid"), Proposal(tree)
    out = constrained_proposals(state, [sampled, fixed], budget, forced=True)
    assert [p.tree.sources[0] for p in out] == [FORCED_SOURCE, "draft-model"] and not out[1].sampled
    free = GrammarState(state.constraint, json_tokenizer, VOCAB, [1])
    free.commit(ids(json_tokenizer, '{"name": "'))  # the value's first token is free: nothing forced
    assert constrained_proposals(free, [sampled], budget, forced=True) == [sampled]


def test_every_row_of_a_sampled_tree_is_built_under_forbidden_draws(state, json_tokenizer):
    """A sampled draft keeps the draws the grammar forbids; rows under them are unreachable (p = 0
    at their node) but `full()`, which a device's rules take, still builds them."""
    tree = TokenTree.chain([ids(json_tokenizer, '{"')[0], ids(json_tokenizer, "x")[0], ids(json_tokenizer, "a")[0]],
                           [1.0] * 3, "draft-model")
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    masked = state.masked(logits, tree)
    full = masked.full()  # [4, VOCAB]
    for r in (0, 1):  # the root's row and the allowed node's
        assert torch.equal(full[r], masked[r]) and bool(torch.isinf(full[r]).any())
    assert bool(torch.isinf(full[1, ids(json_tokenizer, "x")[0]]))  # the forbidden draw has p = 0 there


def test_masked_rows_and_argmax_equal_the_whole_mask(state, json_tokenizer):
    rng = random.Random(0)
    state.commit(ids(json_tokenizer, '{"name": "ab", "age": '))
    digits = [ids(json_tokenizer, str(d))[0] for d in range(10)]
    for trial in range(30):
        # a tree of digits and junk: the grammar allows some nodes
        n = 6
        tokens = [rng.choice(digits + [5, 7, 9]) for _ in range(n)]
        parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
        tree = TokenTree.build(tokens, parents).merge(TokenTree.empty())
        tree = tree.subtree(state.allowed_tree(tree))
        logits = torch.randn(len(tree) + 1, VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
        if trial % 3 == 0:
            logits[:, digits[4]] = 50.0  # the allowed top token: found among the top candidates
        masked = state.masked(logits, tree)
        before = state.state_bitmask()
        am = masked.argmax(-1)
        for r in range(len(tree) + 1):
            path = tree.tokens_of(tree.path_to(r - 1)) if r else []
            fresh = GrammarState(state.constraint, json_tokenizer, VOCAB, [1])
            fresh.commit(ids(json_tokenizer, '{"name": "ab", "age": ') + path)
            allowed = fresh.mask()
            expect = logits[r].masked_fill(~allowed, float("-inf"))
            assert torch.equal(masked[r], expect)
            if am[r] >= 0:
                assert int(am[r]) == int(expect.argmax())
        assert state.state_bitmask() == before  # every scratch walk rolled back
        assert am[0] >= 0


def test_state_after_commits_equals_a_fresh_matcher_fed_the_same_tokens(state, json_tokenizer):
    text = '{"name": "cd", "age": 42}'
    committed: list[int] = []
    for tok in ids(json_tokenizer, text):
        state.forced(5)
        state.allowed_tree(TokenTree.chain([tok, tok]))
        state.masked(torch.zeros(2, VOCAB), TokenTree.chain([tok]))[1]
        state.commit([tok])
        committed.append(tok)
        fresh = GrammarState(state.constraint, json_tokenizer, VOCAB, [1])
        fresh.commit(committed)
        assert state.state_bitmask() == fresh.state_bitmask()
        assert state.accepting == fresh.accepting
    assert state.accepting
    assert state.mask().nonzero().flatten().tolist() == [1]  # only EOS is left
