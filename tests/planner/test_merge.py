"""RASD tree fusion (`specula.planner.merge`): retrieval branches judged by a draft model's q."""
import torch

from specula.api import build_decoder
from specula.models.hf import HFCausalLM
from specula.planner import CostCurve, HardwarePlanner
from specula.planner.merge import merge_proposals, rasd_prune
from specula.sampling import SamplingParams
from specula.step import Proposal
from specula.tree import TokenTree
from tiny import successor_model, tiny_model

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1e-3,) * 7, 64)


def _model_chain(tokens, vocab):
    """A draft model's chain with q rows: the root row puts 0.9 on `tokens[0]` and 0.1 on token 1;
    the node rows are left without mass (never computed)."""
    q = torch.zeros(len(tokens) + 1, vocab)  # [n + 1, vocab]
    q[0, tokens[0]], q[0, 1] = 0.9, 0.1
    return Proposal(TokenTree.chain(tokens, [0.9] * len(tokens), "draft-model"), q=q)


def _sources(tree):
    return sorted(zip(tree.tokens, tree.sources))


def test_a_retrieval_branch_the_model_finds_unlikely_is_dropped_whole_and_a_likely_one_kept():
    """At the root the model gives token 1 0.1 and token 2 nothing: a copy starting with 1 stays (with
    its deeper nodes, which are judged by their first), one starting with 2 goes with its children."""
    model = _model_chain([3, 4], vocab=8)
    likely = Proposal(TokenTree.chain([1, 5, 6], [0.8] * 3, "prompt-lookup"))
    unlikely = Proposal(TokenTree.chain([2, 7], [0.8] * 2, "prompt-lookup"))
    merged = merge_proposals([model, likely, unlikely], rasd_min_prob=0.02).tree
    assert _sources(merged) == [(1, "prompt-lookup"), (3, "draft-model"), (4, "draft-model"),
                                (5, "prompt-lookup"), (6, "prompt-lookup")]
    assert merge_proposals([model, likely, unlikely], rasd_min_prob=0.0).tree.tokens.count(2) == 1  # off: kept


def test_a_branch_below_a_model_row_without_mass_is_not_judged():
    """Node rows of the model's q were never computed (zero): a copy leaving the model's chain below
    its first token is kept whatever its token."""
    model = _model_chain([3, 4], vocab=8)
    below = Proposal(TokenTree.chain([3, 7], [0.8] * 2, "prompt-lookup"))  # 7 leaves the chain after 3
    tree = merge_proposals([model, below], rasd_min_prob=0.5).tree
    assert (7, "prompt-lookup") in _sources(tree)


def test_a_retrieval_token_outside_a_narrower_draft_vocabulary_is_dropped_not_an_index_error():
    """A draft model whose logits are narrower than the target's (a padded vocabulary of another
    size) never gives the ids past its width: prompt lookup's copy of one is dropped like any token
    the model gives nothing. Before: IndexError in the planner's merge."""
    model = _model_chain([3, 4], vocab=8)
    wide = TokenTree.chain([9, 10], [0.8] * 2, "prompt-lookup")  # ids past the draft's 8
    pruned = rasd_prune(model.tree.merge(wide), model, {"prompt-lookup"}, 0.02)
    assert _sources(pruned) == [(3, "draft-model"), (4, "draft-model")]


def test_fusion_with_a_narrower_draft_model_and_prompt_lookup_equals_plain_greedy():
    """The engine end to end: a target of 96 ids (next token = last + 1), a random draft of 80,
    a prompt whose copy prompt lookup drafts past id 80 (found by a fuzzing review: fusion raised
    IndexError where plain decoding and the draft model alone ran)."""
    target = HFCausalLM(successor_model(96), "target")
    draft = HFCausalLM(tiny_model("llama", seed=5, layers=1, vocab=80), "draft")
    prompt = list(range(80, 95)) + [80, 81]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = build_decoder("none", target, None).generate(prompt, params)
    fused = build_decoder("fusion", target, None, draft, planner=HardwarePlanner(curve=FLAT)).generate(prompt, params)
    assert fused.token_ids == plain.token_ids
    assert fused.stats.source_accepted["prompt-lookup"] > 0  # the copy was drafted, not all pruned
