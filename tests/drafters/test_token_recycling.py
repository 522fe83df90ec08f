import re

import numpy as np
import pytest
import torch

from tiny import VOCAB, reference_greedy, successor_model, tiny_model
from specula.drafters import make_drafter
from specula.drafters.base import DraftBudget, DraftContext, Proposal, StepResult
from specula.drafters.token_recycling import (
    SAVE_SECONDS, TEMPLATE, TEMPLATE_LEVELS, TokenRecyclingConfig, TokenRecyclingDrafter, fill_template, rows_to_write,
)
from specula.engine import SpeculativeDecoder
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.paths import stale_temps
from specula.sampling import SamplingParams, make_generator
from specula.tree import TokenTree

PROMPTS = [[5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62, 63, 64, 60, 61], [9]]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def ctx(tokens) -> DraftContext:
    return DraftContext(list(tokens), 1, SamplingParams(), DraftBudget(128, 10), make_generator(0))  # the whole template


class Recorder:
    """Wraps a drafter and keeps every StepResult it observes."""

    def __init__(self, inner):
        self.inner, self.steps, self.name = inner, [], inner.name

    def start(self):
        return self.inner.start()

    def propose(self, c, state=None):
        return self.inner.propose(c, state)

    def observe(self, step, state=None):
        self.steps.append(step)
        self.inner.observe(step, state)

    def finish(self, state=None):
        self.inner.finish(state)


def test_template_shape():
    assert [len(level) for level in TEMPLATE_LEVELS] == [8, 21, 25, 15, 8, 3] and len(TEMPLATE) == 80
    assert all(len(path) == d + 1 for d, level in enumerate(TEMPLATE_LEVELS) for path in level)
    assert TEMPLATE_LEVELS[1][:8] == tuple((0, r) for r in range(8))
    assert TEMPLATE_LEVELS[5] == ((0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0))
    assert max(r for path in TEMPLATE for r in path) == 7


def test_full_matrix_fills_all_80_nodes_from_the_right_rows():
    vocab = 50
    drafter = TokenRecyclingDrafter(vocab)
    rng = np.random.default_rng(0)
    drafter.matrix[:] = np.stack([rng.permutation(vocab)[:8] for _ in range(vocab)])
    proposal = drafter.propose(ctx([3, 7]))
    tree = proposal.tree
    assert len(tree) == 80 and proposal.q is None and proposal.sibling_mode == "deterministic"
    assert [sum(1 for d in tree.depth if d == k) for k in range(1, 7)] == [8, 21, 25, 15, 8, 3]
    m = drafter.matrix
    for i in range(len(tree)):
        path = tree.path_to(i)
        parent_token = 7 if len(path) == 1 else tree.tokens[path[-2]]
        assert tree.tokens[i] in m[parent_token].tolist()
    # node path of ranks (0, 0, 1): M[M[M[root][0]][0]][1]
    a = m[7, 0]
    b = m[a, 0]
    nodes = [i for i in range(len(tree)) if tree.tokens_of(tree.path_to(i)) == [a, b, m[b, 1]]]
    assert len(nodes) == 1
    assert set(tree.sources) == {"token-recycling"}
    first = [tree.edge_scores[c] for c in tree.children[0]]
    assert first == sorted(first, reverse=True)  # rank prior: lower rank, higher score


def test_unwritten_rows_are_skipped():
    drafter = TokenRecyclingDrafter(20)
    assert len(drafter.propose(ctx([4])).tree) == 0  # cold start: nothing known
    drafter.matrix[4] = np.arange(8) + 10  # only the root's row
    tree = drafter.propose(ctx([4])).tree
    assert sorted(tree.tokens) == list(range(10, 18)) and tree.max_depth == 1
    tokens, valid = fill_template(drafter.matrix, 4, drafter.template)
    assert valid.sum() == 8 and (tokens[valid] >= 0).all()


def test_observe_writes_the_root_and_every_node_with_priority_to_the_accepted_path():
    vocab = 30
    drafter = TokenRecyclingDrafter(vocab)
    # tree: 0:a=5 (root child), 1:b=6 (child of 0), 2:c=5 (child of 1, token repeats a), 3:d=9 (root child)
    tree = TokenTree.build([5, 6, 5, 9], [-1, 0, 1, -1], None, "token-recycling")
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    step = StepResult(root=7, proposal=Proposal(tree), path=(0, 1), next_token=3, logits=logits)
    drafter.observe(step)
    top = logits.topk(8, dim=-1).indices.numpy()
    written = np.flatnonzero((drafter.matrix >= 0).all(axis=1)).tolist()
    assert written == [5, 6, 7, 9]  # root 7 and all node tokens; nothing else
    assert drafter.matrix[7].tolist() == top[0].tolist()  # root row 0
    assert drafter.matrix[6].tolist() == top[2].tolist()  # node 1 (row 2)
    assert drafter.matrix[9].tolist() == top[4].tolist()  # rejected node 3 (row 4) is written too
    assert drafter.matrix[5].tolist() == top[1].tolist()  # token 5: accepted node 0 beats rejected node 2
    assert (drafter.matrix[[0, 1, 2, 3, 4, 8]] == -1).all()
    tokens, rows = rows_to_write(StepResult(7, Proposal(TokenTree.chain([7, 7])), (0,), 1, logits[:3]))
    assert tokens.tolist() == [7] and rows.tolist() == [1]  # deepest accepted occurrence wins over the root


def test_a_step_that_verified_no_draft_writes_its_roots_row_alone():
    """A paused step (no tree) takes the one-row path: the root's top-8, as the general path writes it; a root
    outside the matrix writes nothing."""
    vocab = 30
    drafter = TokenRecyclingDrafter(vocab)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1))
    drafter.observe(StepResult(root=4, proposal=Proposal.empty(), path=(), next_token=2, logits=logits))
    assert drafter.matrix[4].tolist() == logits.topk(8, dim=-1).indices[0].tolist()
    assert np.flatnonzero((drafter.matrix >= 0).all(axis=1)).tolist() == [4] and drafter.dirty
    drafter.observe(StepResult(root=vocab + 3, proposal=Proposal.empty(), path=(), next_token=2, logits=logits))
    assert np.flatnonzero((drafter.matrix >= 0).all(axis=1)).tolist() == [4]


def test_engine_writes_exactly_the_verified_tokens_and_prefill_writes_nothing():
    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target")
    inner = make_drafter("token-recycling", target=target)
    rec = Recorder(inner)
    prompt = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]
    SpeculativeDecoder(target, rec, eos_token_ids=[]).generate(prompt, greedy(12))
    seen = set()
    for step in rec.steps:
        seen.add(step.root)
        seen.update(step.proposal.tree.tokens)
    written = set(np.flatnonzero((inner.matrix >= 0).all(axis=1)).tolist())
    assert written == seen
    untouched_prompt = set(prompt[:-1]) - seen
    assert untouched_prompt and all((inner.matrix[t] == -1).all() for t in untouched_prompt)
    # Each written row holds the target's top-8 at that token's last (priority) occurrence.
    last = {}
    for step in rec.steps:
        tokens, rows = rows_to_write(step)
        for t, r in zip(tokens.tolist(), rows.tolist()):
            last[t] = step.logits[r].topk(8).indices.tolist()
    assert all(inner.matrix[t].tolist() == top for t, top in last.items())


@pytest.mark.parametrize("max_new", [2, 7, 40])
def test_greedy_equals_plain_greedy_cold_and_hot(arch, max_new):
    """2: the shortest request a drafter is asked for (a 1-token request has no room for a draft):
    one level of the template, from the root's row written in the first round."""
    model = tiny_model(arch, seed=3)
    target = HFCausalLM(model, "target")
    dec = SpeculativeDecoder(target, make_drafter("token-recycling", target=target), eos_token_ids=[])
    for _ in range(2):  # second round: the matrix is hot from the first (reset keeps it)
        accepted = 0
        for prompt in PROMPTS:
            out = dec.generate(prompt, greedy(max_new))
            assert out.token_ids == reference_greedy(model, prompt, max_new), (arch, prompt)
            accepted += out.stats.accepted_tokens
    assert accepted > 0  # in the hot round


def test_successor_model_gets_long_accepted_runs():
    model = successor_model(VOCAB)
    target = HFCausalLM(model, "target")
    dec = SpeculativeDecoder(target, make_drafter("token-recycling", target=target), eos_token_ids=[])
    dec.generate([3], greedy(VOCAB + 10))  # learns t -> t+1 for every token
    out = dec.generate([40], greedy(60))
    assert out.token_ids == reference_greedy(model, [40], 60)
    assert out.stats.mean_accepted_tokens > 5  # the depth-6 chain of rank 0 is accepted


def test_sampling_is_seeded_and_reproducible():
    model = tiny_model("llama", seed=4)
    params = SamplingParams(max_new_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    outs = []
    for _ in range(2):
        target = HFCausalLM(model, "target")
        dec = SpeculativeDecoder(target, make_drafter("token-recycling", target=target), eos_token_ids=[])
        outs.append(dec.generate(PROMPTS[0], params))
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 30
    assert outs[0].stats.drafted_tokens > 0


def test_state_save_load_hot_start_is_lossless(tmp_path):
    model = tiny_model("gpt2", seed=5)
    state = tmp_path / "tr.npz"
    target = HFCausalLM(model, "target")
    first = make_drafter("token-recycling", target=target, recycling_state=str(state))
    dec = SpeculativeDecoder(target, first, eos_token_ids=[])
    assert not state.exists()
    dec.generate(PROMPTS[0], greedy(30))
    assert state.exists() and stale_temps(state) == []  # saved when the request finished
    before = state.stat().st_mtime_ns
    dec.generate(PROMPTS[1], greedy(5))  # within SAVE_SECONDS: pending (each save writes the whole matrix)
    assert state.stat().st_mtime_ns == before and first.dirty
    first._saved_at -= SAVE_SECONDS
    dec.generate(PROMPTS[2], greedy(5))
    assert state.stat().st_mtime_ns >= before and not first.dirty
    first.save()
    assert state.stat().st_size < 4 * VOCAB * 8 + 4096

    second = make_drafter("token-recycling", target=target, recycling_state=str(state))
    assert np.array_equal(second.matrix, first.matrix)
    root = int(np.flatnonzero((first.matrix >= 0).all(axis=1))[0])  # a written row: a hot start drafts
    hot = second.propose(ctx([root]))
    assert len(hot.tree) > 0 and hot.tree == first.propose(ctx([root])).tree
    dec2 = SpeculativeDecoder(target, second, eos_token_ids=[])
    for prompt in PROMPTS:
        out = dec2.generate(prompt, greedy(30))
        assert out.token_ids == reference_greedy(model, prompt, 30)
    assert out.stats.drafted_tokens > 0


def test_exit_hook_saves_a_dropped_drafter(tmp_path):
    from specula.drafters.token_recycling import save_states

    state = tmp_path / "exit.npz"
    drafter = TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))
    drafter.matrix[3] = np.arange(8)
    drafter.dirty = True
    del drafter  # as a CLI run does before the interpreter exits
    assert state in save_states() and state.exists()
    again = TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))
    assert again.matrix[3].tolist() == list(range(8)) and not again.dirty
    assert state not in save_states()  # nothing new to write


def test_a_state_file_that_cannot_be_written_is_reported_and_the_output_still_returned(tmp_path, capsys):
    model = tiny_model("gpt2", seed=5)
    target = HFCausalLM(model, "target")
    (tmp_path / "afile").write_text("x")
    state = tmp_path / "afile" / "tr.npz"  # under a file: no directory can be made there
    drafter = make_drafter("token-recycling", target=target, recycling_state=str(state))
    out = SpeculativeDecoder(target, drafter, eos_token_ids=[]).generate(PROMPTS[0], greedy(12))
    assert out.token_ids == reference_greedy(model, PROMPTS[0], 12)
    assert "could not save the token-recycling state" in capsys.readouterr().err
    assert drafter.dirty  # still pending
    drafter.dirty = False  # (the exit hook would try again)


def test_hot_start_drafts_from_the_first_step(tmp_path):
    model = successor_model(VOCAB)
    target = HFCausalLM(model, "target")
    trained = make_drafter("token-recycling", target=target)
    SpeculativeDecoder(target, trained, eos_token_ids=[]).generate([3], greedy(VOCAB + 5))
    trained.save(tmp_path / "s.npz")
    fresh = make_drafter("token-recycling", target=target, recycling_state=str(tmp_path / "s.npz"))
    out = SpeculativeDecoder(target, fresh, eos_token_ids=[]).generate([20], greedy(7))
    assert out.token_ids == list(range(21, 28))
    assert out.stats.steps == 1  # 6 drafted tokens accepted + bonus in the very first step


def test_state_for_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    state = tmp_path / "s.npz"
    TokenRecyclingDrafter(VOCAB, fingerprint="sha256:aaa").save(state)
    with pytest.raises(ConfigError, match=f"vocabulary of {VOCAB} tokens .* this target has 64"):
        TokenRecyclingDrafter(64, TokenRecyclingConfig(state_path=str(state)))
    with pytest.raises(ConfigError, match="another tokenizer"):
        TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)), fingerprint="sha256:bbb")
    TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)), fingerprint="sha256:aaa")
    keeper = TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))  # no tokenizer given ...
    keeper.save()
    with pytest.raises(ConfigError, match="another tokenizer"):  # ... the file keeps its fingerprint
        TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)), fingerprint="sha256:bbb")
    state.write_bytes(b"not a zip file")  # the fix names the option as Python does (was --recycling-state)
    with pytest.raises(ConfigError, match="not a readable token-recycling state .*; delete .* or pass another "
                                          "recycling_state file$"):
        TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))
    state.write_bytes(b"")  # empty (EOFError), an array saved with np.save, a float matrix
    with pytest.raises(ConfigError, match="not a readable token-recycling state"):
        TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))
    array = tmp_path / "a.npy"
    np.save(array, np.zeros((VOCAB, 8), dtype=np.int32))
    with pytest.raises(ConfigError, match="an array file, not a saved state"):
        TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(array)))


def test_a_state_learned_on_another_model_with_the_tokenizer_is_loaded_with_a_note(tmp_path, capsys):
    """The state recorded no model: the 0.5B's matrix hot-started the 1.5B (one tokenizer) without a word."""
    state = tmp_path / "s.npz"
    small = HFCausalLM(tiny_model("gpt2", seed=5), "small")
    learned = make_drafter("token-recycling", target=small, recycling_state=str(state))
    learned.matrix[3] = np.arange(8)
    learned.save()
    again = make_drafter("token-recycling", target=small, recycling_state=str(state))
    assert capsys.readouterr().err == "" and again.matrix[3].tolist() == list(range(8))
    other = HFCausalLM(tiny_model("gpt2", seed=6), "other")
    assert other.cost_key()["model"] != small.cost_key()["model"]
    loaded = make_drafter("token-recycling", target=other, recycling_state=str(state))
    err = capsys.readouterr().err
    assert f"was learned on {small.cost_key()['model']}, not {other.cost_key()['model']}" in err
    assert loaded.matrix[3].tolist() == list(range(8))  # still drafts from it
    keeper = TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))  # no target given ...
    assert keeper.model == small.cost_key()["model"]  # ... the file keeps its model


def test_a_target_whose_cost_key_names_no_model_records_none_and_an_unknown_model_gets_no_note(tmp_path, capsys):
    """A backend whose cost key had no model recorded the model "None" in the state file (str(None)); a target
    that names its model then loaded it with a note that it was learned on "None", another model."""
    import json

    state = tmp_path / "s.npz"
    nameless = HFCausalLM(tiny_model("gpt2", seed=5), "nameless")
    nameless.cost_key = lambda: {"backend": "hf"}  # a backend that names no model
    learned = make_drafter("token-recycling", target=nameless, recycling_state=str(state))
    assert learned.model is None
    learned.matrix[3] = np.arange(8)
    learned.save()
    with np.load(state) as data:
        assert json.loads(str(data["meta"]))["model"] is None
    named = HFCausalLM(tiny_model("gpt2", seed=6), "named")
    loaded = make_drafter("token-recycling", target=named, recycling_state=str(state))
    assert capsys.readouterr().err == "" and loaded.model == named.cost_key()["model"]
    assert loaded.matrix[3].tolist() == list(range(8))
    with np.load(state) as data:  # a state saved before: it recorded the model "None"
        matrix, meta = data["matrix"], json.loads(str(data["meta"]))
    np.savez(state, matrix=matrix, meta=np.array(json.dumps({**meta, "model": "None"})))
    again = make_drafter("token-recycling", target=named, recycling_state=str(state))
    assert capsys.readouterr().err == "" and again.model == named.cost_key()["model"]
    assert TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state))).model is None


def test_one_drafter_a_state_file_is_kept_for_the_exit_save(tmp_path):
    """Drafters are kept alive for the exit save: one a file (the latest, the one before saved if it
    had changes), not every one a process made (each holds its matrix)."""
    from specula.drafters import token_recycling

    state = tmp_path / "s.npz"
    first = TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))
    first.matrix[3, 0] = 7
    first.dirty = True
    second = TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))
    assert token_recycling._WITH_STATE[state.resolve()] is second and first not in token_recycling._WITH_STATE.values()
    assert not first.dirty and TokenRecyclingDrafter(VOCAB).load(state) is None
    reread = TokenRecyclingDrafter(VOCAB)
    reread.load(state)
    assert reread.matrix[3, 0] == 7


def test_a_new_drafter_of_a_state_file_starts_from_the_earlier_ones_latest_matrix(tmp_path):
    """The earlier drafter's changes pending (saves come at most every 30 s) reach the file before
    the new one reads it: it loaded the file as last saved, and its saves then dropped them."""
    state = tmp_path / "s.npz"
    first = TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))
    first.matrix[3, 0] = 7
    first.save()
    first.matrix[4, 0] = 9  # learnt after the last save
    first.dirty = True
    second = TokenRecyclingDrafter(VOCAB, TokenRecyclingConfig(state_path=str(state)))
    assert second.matrix[3, 0] == 7 and second.matrix[4, 0] == 9
    assert np.array_equal(second.matrix, first.matrix)


def test_a_proposal_keeps_within_the_budget_it_is_given():
    drafter = TokenRecyclingDrafter(VOCAB)
    drafter.matrix[:] = np.arange(8)[None, :] + 10  # every row full: the whole template fills
    full = drafter.propose(DraftContext([5], 1, SamplingParams(), DraftBudget(128, 16), make_generator(0))).tree
    assert len(full) > 16 and full.max_depth > 2
    for nodes, depth in ((1, 1), (16, 2), (128, 3)):
        tree = drafter.propose(DraftContext([5], 1, SamplingParams(), DraftBudget(nodes, depth),
                                            make_generator(0))).tree
        assert len(tree) <= nodes and tree.max_depth <= depth and len(tree) > 0


def test_a_top_k_wider_than_the_vocabulary_is_refused_when_made():
    with pytest.raises(ConfigError, match="top_k \\(16\\) exceeds the vocabulary \\(12\\)"):
        make_drafter("token-recycling", vocab_size=12, top_k=16)


def test_fusion_with_a_head_refuses_the_recycling_state_it_would_ignore(tmp_path):
    """fusion leaves token recycling out when a trained head drafts: --recycling-state would be
    ignored without a word, so it is refused naming the fix: as Python names the options (the message named the
    flags, where a bench variant writes fusion:recycling_state=FILE), which the command line writes as flags."""
    from specula.drafters import make_drafters
    from specula.drafters.heads.runtime import new_head
    from specula.methods import flag_spellings, in_flags

    target = HFCausalLM(tiny_model("llama", seed=3), "target")
    head = new_head("eagle", target, torch.arange(VOCAB))
    message = ("recycling_state is for token-recycling, which fusion leaves out when a trained head drafts; pass "
               'head="none" to keep token-recycling (or drop recycling_state)')
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        make_drafters("fusion", target=target, head=head, recycling_state=str(tmp_path / "s.npz"))
    assert in_flags(str(caught.value), flag_spellings()) == (
        "--recycling-state is for token-recycling, which fusion leaves out when a trained head drafts; pass --head "
        "none to keep token-recycling (or drop --recycling-state)")
    assert make_drafters("fusion", target=target, head=head)  # without it: fine


def test_finishing_a_request_keeps_the_matrix_and_bad_config_is_refused():
    drafter = TokenRecyclingDrafter(20)
    drafter.matrix[3] = np.arange(8)
    drafter.finish(drafter.start())
    assert drafter.matrix[3].tolist() == list(range(8))
    with pytest.raises(ConfigError, match="top_k >= 8"):
        TokenRecyclingConfig(top_k=4)
    with pytest.raises(ConfigError, match="target model"):
        make_drafter("token-recycling")


def test_memory_footprint_is_the_matrix_whatever_the_context():
    drafter = TokenRecyclingDrafter(1000)
    assert drafter.memory_bytes == 1000 * 8 * 4  # [vocab, k = 8] int32
    drafter.matrix[5] = np.arange(8)
    assert drafter.memory_bytes == 1000 * 8 * 4
