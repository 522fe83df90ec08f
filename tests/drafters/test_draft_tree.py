"""`draft-tree`: greedy exactness for every mode, sampled proposals that satisfy their
acceptance rule's assumptions (q rows, draw laws, budgets), an exact draft cache, seeded
reproducibility, and the engine's output law at temperature > 0."""

from __future__ import annotations

import math

import pytest
import torch

from laws import tv, tv_bound
from tiny import assert_cache_equals_plain_forward, perturbed_copy, reference_greedy, tiny_model
from specula.drafters import make_drafter
from specula.drafters.base import DraftBudget, DraftContext
from specula.drafters.draft_tree import DraftTreeConfig, DraftTreeDrafter, truncated_child_scores
from specula.engine import SpeculativeDecoder
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.sampling import SamplingParams, make_generator, probabilities

PROMPTS = [[5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [9]]
MODES = {  # name -> drafter options
    "deterministic": dict(tree_sampling="deterministic"),
    "iid": dict(tree_sampling="iid"),
    "iid_kseq": dict(tree_sampling="iid", tree_verifier="kseq"),
    "without_replacement": dict(tree_sampling="without_replacement"),
    "beam": dict(tree_sampling="beam"),
}
SAMPLED = ("iid", "iid_kseq", "without_replacement", "beam")


def decoder(model, draft_model, **options) -> SpeculativeDecoder:
    drafter = make_drafter("draft-tree", draft=HFCausalLM(draft_model, "draft"), **options)
    return SpeculativeDecoder(HFCausalLM(model, "target"), drafter, eos_token_ids=[])


def context(tokens, params: SamplingParams, seed: int = 0, nodes: int = 64, depth: int = 8) -> DraftContext:
    return DraftContext(list(tokens), len(tokens), params, DraftBudget(nodes, depth), make_generator(seed))


@torch.inference_mode()
def draft_dist(model, ids: list[int], params: SamplingParams) -> torch.Tensor:
    return probabilities(model(torch.tensor([ids])).logits[0, -1], params)  # [vocab]


# ---------------------------------------------------------------------------- greedy
def test_greedy_output_equals_plain_greedy_in_every_mode(arch):
    model = tiny_model(arch, seed=3)
    draft = perturbed_copy(model, 0.1)
    for name, options in MODES.items():
        dec = decoder(model, draft, **options)
        for prompt in PROMPTS:
            out = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
            assert out.token_ids == reference_greedy(model, prompt, 24), (arch, name, prompt)


def test_top1_chain_from_the_target_itself_is_fully_accepted():
    model = tiny_model("llama", seed=4)
    dec = decoder(model, model, tree_top_k=1, tree_depth=4)
    out = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=25, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, PROMPTS[0], 25)
    assert out.stats.accepted_tokens == out.stats.drafted_tokens > 0
    assert out.stats.steps == 5  # 5 tokens per step (4 drafts + bonus)


def test_greedy_tree_is_eagle2_dynamic_expansion():
    """Candidates are top-k children of the best-k nodes per level, scored by the product of
    draft softmax probabilities along the path, and the best N are kept."""
    draft = tiny_model("qwen2", seed=5)
    drafter = DraftTreeDrafter(HFCausalLM(draft), DraftTreeConfig(tree_top_k=3, tree_depth=3, tree_nodes=7))
    prompt = PROMPTS[0]
    tree = drafter.propose(context(prompt, SamplingParams()), drafter.start()).tree
    assert len(tree) == 7 and tree.max_depth <= 3
    soft = SamplingParams(temperature=1.0)
    for i in range(len(tree)):
        path = tree.tokens_of(tree.path_to(i))
        expected = math.prod(float(draft_dist(draft, prompt + path[:j], soft)[path[j]]) for j in range(len(path)))
        assert tree.path_scores[i] == pytest.approx(expected, rel=1e-4)
        siblings = [tree.tokens[c] for c in tree.children[tree.parents[i] + 1]]
        top = draft_dist(draft, prompt + path[:-1], soft).topk(3).indices.tolist()
        assert set(siblings) <= set(top)
    # Path scores shrink along paths, so the best N form an ancestor-closed tree.
    assert all(tree.path_scores[c] <= tree.path_scores[p] for c, p in enumerate(tree.parents) if p >= 0)


def test_top_children_score_by_softmax_and_stop_at_the_support():
    """A frontier's children: greedy requests score the top-k logits by the full softmax (computed for
    the picks only); a sampled request's processed distribution may hold fewer than k tokens, and a
    row then keeps only those."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))  # [F, vocab]
    probs, idx = DraftTreeDrafter._top_children(logits, SamplingParams(), 4)
    top = torch.softmax(logits, -1).topk(4, dim=-1)
    assert idx == top.indices.tolist()
    assert torch.allclose(torch.tensor(probs), top.values, rtol=1e-5)
    narrow = SamplingParams(temperature=0.7, top_k=2)
    probs, idx = DraftTreeDrafter._top_children(logits, narrow, 4)
    expected = probabilities(logits, narrow).topk(2, dim=-1)
    assert idx == expected.indices.tolist() and all(len(row) == 2 for row in probs)
    assert torch.allclose(torch.tensor(probs), expected.values)


@pytest.mark.parametrize("c_pass", [True, False])
def test_top_children_of_a_row_with_plus_inf_logits_share_its_mass(c_pass, monkeypatch):
    """softmax's limit where a logit is +inf (torch's softmax gives NaN, and a NaN child ended the row:
    the certain token was never drafted): the +inf logits split the mass, in the C pass and in torch's."""
    from specula.drafters import draft_tree

    if not c_pass:
        monkeypatch.setattr(draft_tree, "_kernel_top_k", lambda: None)
    elif draft_tree._kernel_top_k() is None:
        pytest.skip("specula's CPU kernels cannot run here")
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))  # [F, vocab]
    logits[0, 7] = logits[0, 30] = float("inf")
    probs, idx = DraftTreeDrafter._top_children(logits, SamplingParams(), 4)
    assert sorted(idx[0]) == [7, 30] and probs[0] == [0.5, 0.5]  # the finite ones get nothing: the support ends
    assert len(probs[1]) == 4 and idx[1] == logits[1].topk(4).indices.tolist()


# ---------------------------------------------------------------------------- sampled proposals
@pytest.mark.parametrize("name", SAMPLED)
def test_sampled_proposals_match_their_declared_scheme(name):
    """q rows are the draft's processed distribution at each node's context; children have
    q > 0, are distinct without replacement, never exceed k per node; budgets hold."""
    draft = tiny_model("qwen2", seed=6)
    drafter = DraftTreeDrafter(HFCausalLM(draft), DraftTreeConfig(**MODES[name], tree_top_k=3, tree_nodes=10))
    params = SamplingParams(temperature=1.2, top_k=40)
    prompt = PROMPTS[0]
    state = drafter.start()
    for seed in range(3):
        prop = drafter.propose(context(prompt, params, seed, nodes=9, depth=3), state)
        tree = prop.tree
        assert prop.sibling_mode == DraftTreeConfig(**MODES[name]).sibling_mode
        assert 0 < len(tree) <= 9 and tree.max_depth <= 3
        for row, kids in enumerate(tree.children):
            if not kids:
                continue
            path = tree.tokens_of(tree.path_to(row - 1)) if row else []
            torch.testing.assert_close(prop.q[row], draft_dist(draft, prompt + path, params), atol=1e-5, rtol=1e-4)
            toks = [tree.tokens[c] for c in kids]
            assert len(kids) <= 3 and all(float(prop.q[row, t]) > 0 for t in toks)
            if name in ("without_replacement", "beam"):
                assert len(set(toks)) == len(toks)
        state.finish(())  # as observe() would: the draft cache drops the drafted tree


def test_without_replacement_root_children_follow_the_sequential_law():
    draft = tiny_model("llama", seed=7, vocab=8)
    drafter = DraftTreeDrafter(HFCausalLM(draft), DraftTreeConfig(tree_sampling="without_replacement",
                                                                 tree_top_k=2, tree_depth=1))
    params = SamplingParams(temperature=1.5)
    q = draft_dist(draft, [3, 5, 1], params).double()
    exact = q[:, None] * q[None, :] / (1 - q[:, None])
    exact.fill_diagonal_(0)
    n = 1500
    pairs = torch.empty(n, dtype=torch.long)
    state = drafter.start()
    for s in range(n):
        tree = drafter.propose(context([3, 5, 1], params, seed=s), state).tree
        pairs[s] = tree.tokens[0] * 8 + tree.tokens[1]
        state.finish(())
    assert tv(pairs, exact) < tv_bound(exact, n)


def test_beam_children_are_a_gumbel_prefix_independent_of_their_count():
    """Stochastic beam search keeps, under each beam node, a prefix of its Gumbel order whose
    length depends on key values only, which are independent of the tokens holding them: the
    first child of the best root child follows q at its context whatever its child count."""
    draft = tiny_model("llama", seed=7, vocab=8)
    drafter = DraftTreeDrafter(HFCausalLM(draft), DraftTreeConfig(tree_sampling="beam", tree_top_k=2, tree_depth=2))
    params = SamplingParams(temperature=1.5)
    groups: dict[tuple[int, int], list[int]] = {}
    state = drafter.start()
    for s in range(800):
        tree = drafter.propose(context([3, 5, 1], params, seed=s), state).tree
        state.finish(())
        assert len(tree.children[0]) == 2 and sum(1 for d in tree.depth if d == 2) == 2  # width per level
        best = tree.children[0][0]
        kids = tree.children[best + 1]  # never empty: the best root child's best child keeps its score
        groups.setdefault((tree.tokens[best], len(kids)), []).append(tree.tokens[kids[0]])
    a = max(range(8), key=lambda t: len(groups.get((t, 1), [])) + len(groups.get((t, 2), [])))
    q = draft_dist(draft, [3, 5, 1, a], params).double()
    for count in (1, 2):
        toks = groups.get((a, count), [])
        assert len(toks) >= 80, (a, count, len(toks))  # the count really varies
        assert tv(torch.tensor(toks), q) < tv_bound(q, len(toks)), count


def test_truncated_gumbel_child_scores():
    keys = torch.tensor([3.0, 1.5, -0.2, -4.0], dtype=torch.float64)
    g = truncated_child_scores(0.7, keys, float(keys.max()))
    assert float(g[0]) == pytest.approx(0.7)  # the best child inherits the parent's score
    assert bool((g[1:] < g[:-1]).all()) and bool((g <= 0.7).all())
    exact = -torch.log(math.exp(-0.7) - math.exp(-3.0) + torch.exp(-keys))
    torch.testing.assert_close(g, exact)


# ---------------------------------------------------------------------------- cache and seeds
def test_draft_cache_stays_exact_across_steps():
    model = tiny_model("qwen2", seed=3)
    draft = perturbed_copy(model, 0.1)
    draft_lm = HFCausalLM(draft, "draft")
    drafter = make_drafter("draft-tree", draft=draft_lm, tree_sampling="without_replacement")
    dec = SpeculativeDecoder(HFCausalLM(model, "target"), drafter, eos_token_ids=[])
    session = dec.start(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=30, seed=3, ignore_eos=True))
    while not session.finished:
        dec.step([session])
        seq = session.drafter_states[0].seq  # the request's draft cache, before finish() frees it
        full = PROMPTS[0] + session.generated
        assert seq.tokens == full[: len(seq.tokens)] and len(seq.tokens) >= len(PROMPTS[0])
        assert_cache_equals_plain_forward(draft, seq, list(seq.tokens))
    dec.finish(session)
    assert seq.tokens == []  # freed with the session


@pytest.mark.parametrize("name", ["deterministic", *SAMPLED])
def test_sampling_is_reproducible_with_a_seed(name):
    model = tiny_model("qwen2", seed=7)
    dec = decoder(model, perturbed_copy(model, 0.3), **MODES[name])

    def run(seed: int) -> list[int]:
        return dec.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=16, seed=seed,
                                                       ignore_eos=True)).token_ids

    assert run(123) == run(123)
    assert len({tuple(run(s)) for s in range(4)}) > 1


# ---------------------------------------------------------------------------- the output law
def test_sampled_output_follows_the_target_distribution_in_every_mode():
    """End to end through the loop on a vocabulary of 8 (temperature 1.5, depth-2 trees in the
    first step): the first two tokens, pooled over all modes (one mode per seed), follow the
    target's joint law; each mode's first token follows p."""
    model = tiny_model("llama", seed=8, vocab=8)
    draft = tiny_model("llama", seed=9, vocab=8)
    prompt, temp = [3, 5, 1], 1.5
    with torch.inference_mode():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temp, -1).double()
        joint = torch.stack([
            p1[a] * torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1] / temp, -1) for a in range(8)
        ]).flatten()  # [64]
    names = list(MODES)
    decoders = [decoder(model, draft, **MODES[n], tree_top_k=3, tree_depth=2, tree_nodes=8) for n in names]
    trials = 1500
    pairs = torch.empty(trials, dtype=torch.long)
    for s in range(trials):
        ids = decoders[s % len(names)].generate(
            prompt, SamplingParams(temperature=temp, max_new_tokens=3, seed=s, ignore_eos=True)).token_ids
        pairs[s] = ids[0] * 8 + ids[1]
    assert tv(pairs, joint) < tv_bound(joint, trials, c=2.0)
    assert tv(pairs, torch.roll(joint, 1)) > 0.3  # the check has power
    # 300 draws a mode: c = 2.5 is passed by exact draws with probability 1 - 5e-5, and failed by a K-SEQ
    # with rho fixed at 1 (TV ~0.23) with probability 0.9996; c = 4 (bound 0.22) let that rule pass by chance
    for m, name in enumerate(names):
        firsts = pairs[m :: len(names)] // 8
        assert tv(firsts, p1) < tv_bound(p1, len(firsts), c=2.5), name


# ---------------------------------------------------------------------------- configuration
class _CostView:
    """A planner's cost view under which drafting pays up to depth `pays` (and records the asks)."""

    def __init__(self, pays: int) -> None:
        self.pays = pays
        self.asks: list[tuple[list[float], int]] = []

    def plan_chain(self, source, edge_scores, seconds_per_token, spent_seconds, max_more, *rest) -> int:
        self.asks.append((list(edge_scores), max_more))
        return max(0, min(self.pays - len(edge_scores), max_more))


def test_expansion_reads_the_cost_view():
    """Once a level's pass is timed, the drafter asks the cost view before drafting and before each
    level: nothing pays -> no drafting pass at all (probes are the view's to ask for); one
    level more pays -> the tree stops one level later; output stays plain greedy under a planner."""
    from dataclasses import replace

    model = tiny_model("llama", seed=3)
    drafter = DraftTreeDrafter(HFCausalLM(perturbed_copy(model, 0.1), "draft"),
                               DraftTreeConfig(tree_top_k=2, tree_depth=4))
    state = drafter.start()
    greedy = SamplingParams()
    ctx = context(PROMPTS[0], greedy)
    first = drafter.propose(replace(ctx, cost=_CostView(0)), state)  # untimed: drafted in full, timed
    assert max(first.tree.depth) == 4 and drafter._level_seconds.value is not None
    state.finish([])
    never = _CostView(0)
    runs = []
    for i in range(20):
        prop = drafter.propose(replace(ctx, cost=never), state)
        runs.append(len(prop.tree))
        state.finish([])
    assert runs == [0] * 20
    assert never.asks[0] == ([], 4)
    some = _CostView(2)
    prop = drafter.propose(replace(ctx, cost=some), state)
    assert max(prop.tree.depth) == 2  # levels 1 (the root's pass) and 2 (one level pass): then 0 more pay
    assert [len(edges) for edges, _ in some.asks] == [0, 1, 2]  # before drafting, then along the best path
    state.finish([])
    from specula.planner import CostCurve, HardwarePlanner

    dec = SpeculativeDecoder(HFCausalLM(model, "target"), drafter, eos_token_ids=[],
                             planner=HardwarePlanner(curve=CostCurve((1, 2, 4, 8, 16, 32, 64), (1e-3,) * 7, 64)))
    out = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, PROMPTS[0], 24)


def test_configuration_errors():
    draft = HFCausalLM(tiny_model("llama"))
    with pytest.raises(ConfigError, match="pass draft=MODEL"):
        make_drafter("draft-tree")
    with pytest.raises(ConfigError, match='tree_verifier="kseq" needs i.i.d.'):
        make_drafter("draft-tree", draft=draft, tree_sampling="beam", tree_verifier="kseq")
    with pytest.raises(ConfigError, match="tree_sampling"):
        make_drafter("draft-tree", draft=draft, tree_sampling="greedy")
    with pytest.raises(ConfigError, match="tree_depth"):
        make_drafter("draft-tree", draft=draft, tree_depth=0)
    with pytest.raises(ConfigError, match="does not take num_draft_tokens"):
        make_drafter("draft-tree", draft=draft, num_draft_tokens=3)
    drafter = make_drafter("draft-tree", draft=draft)
    assert drafter.propose(context([1, 2], SamplingParams(), nodes=0), drafter.start()).tree.tokens == ()


def test_cli_options_reach_the_drafter():
    from specula.cli import build_parser
    from specula.commands.common import drafter_options

    args = build_parser().parse_args(["generate", "--target", "x", "--prompt", "hi", "--method", "draft-tree",
                                      "--tree-sampling", "iid", "--tree-verifier", "kseq", "--tree-top-k", "2",
                                      "--tree-depth", "3", "--tree-nodes", "9", "--draft-window", "128"])
    opts = drafter_options(args, "draft-tree")
    assert opts == dict(tree_sampling="iid", tree_verifier="kseq", tree_top_k=2, tree_depth=3, tree_nodes=9,
                        draft_window=128)
    drafter = make_drafter("draft-tree", draft=HFCausalLM(tiny_model("llama")), **opts)
    assert drafter.config.sibling_mode == "iid_kseq" and drafter.config.tree_nodes == 9
    assert drafter.draft_window == 128


@pytest.mark.parametrize("method", ["draft-tree", "draft-model", "prompt-lookup"])
def test_output_near_the_context_window_is_plain_decodings(method):
    """Greedy output of a prompt a few tokens short of the window: exactly plain decoding's tokens,
    never past the window (a whole accepted path adds its depth plus the bonus token), and a tree
    drafter whose frontier would overflow its draft cache drafts less instead of failing."""
    from specula.api import build_decoder
    from tiny import reference_greedy

    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target", eos_token_ids=[])
    draft = HFCausalLM(perturbed_copy(model, 0.05), "draft") if method != "prompt-lookup" else None
    dec = build_decoder(method, target, None, draft, planner=False)
    for n in (200, 245, 250):
        prompt = (list(range(2, 90)) * 3)[:n]
        out = dec.generate(prompt, SamplingParams(max_new_tokens=100, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, target.max_context - n), (method, n)
        assert out.stats.finish_reason == "length"


def test_a_sampled_tree_beside_deterministic_drafters_is_verified_alone_and_keeps_the_law():
    """A decoder of prompt lookup and a sampled draft tree: on a step where both propose, the
    sampled tree is verified alone (as drawn); the merge raised there, on whichever step that was.
    Greedy output stays plain greedy's and the sampled law the target's."""
    from laws import exact_first_two, sample_first_two, tv, tv_bound
    from specula.drafters import make_drafter
    from specula.engine import SpeculativeDecoder
    from specula.planner import PassThroughPlanner

    vocab, temp, trials, prompt = 8, 1.5, 1500, [3, 5, 1, 3, 5, 1, 3]
    model = tiny_model("llama", seed=8, vocab=vocab)
    target = HFCausalLM(model, "target")
    draft = HFCausalLM(perturbed_copy(model, 0.2), "draft")
    drafters = [make_drafter("prompt-lookup", target=target),
                make_drafter("draft-tree", target=target, draft=draft, tree_sampling="iid", tree_top_k=3, tree_depth=2,
                             adaptive=False)]
    dec = SpeculativeDecoder(target, drafters, planner=PassThroughPlanner(), eos_token_ids=[])
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert dec.generate(prompt, greedy).token_ids == reference_greedy(model, prompt, 20)
    exact = exact_first_two(model, prompt, temp)
    codes, accepted = sample_first_two(dec, prompt, temp, vocab, trials)
    assert accepted > trials // 10, accepted
    assert tv(codes, exact) < tv_bound(exact, trials, c=2.0)


def test_beam_search_asks_the_cost_view_like_the_other_sampled_trees():
    """Where any pass of more than one token costs 50 plain steps, beam search drafts about as little
    as iid sampling does (it timed no level and never asked whether a level pays, so it drafted its
    whole tree on every step)."""
    from specula.api import build_decoder
    from specula.planner import CostCurve, HardwarePlanner

    model = tiny_model("llama", seed=8, vocab=8)
    target, draft = HFCausalLM(model, "target"), HFCausalLM(perturbed_copy(model, 0.3), "draft")
    dear = CostCurve((1, 2, 4, 8, 16, 32, 64), (1e-3, 5e-2, 5e-2, 5e-2, 5e-2, 5e-2, 5e-2), 64)
    proposed = {}
    for mode in ("iid", "beam"):
        dec = build_decoder("draft-tree", target, None, draft, planner=HardwarePlanner(curve=dear), tree_sampling=mode,
                            tree_top_k=3, tree_depth=3, tree_nodes=12)
        stats = [dec.generate([3, 5, 1, 3, 5], SamplingParams(temperature=1.0, max_new_tokens=40, seed=s,
                                                              ignore_eos=True)).stats for s in range(6)]
        proposed[mode] = sum(s.proposed_tokens for s in stats) / sum(s.steps for s in stats)
        assert dec.drafters[0]._level_seconds.value is not None  # its levels are timed
    assert proposed["beam"] < 0.2 and proposed["beam"] < 3 * proposed["iid"] + 0.05, proposed
