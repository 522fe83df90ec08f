"""A minimum output length (`min_new_tokens`): each tree row masked by its own output position;
greedy output equals transformers' `generate(min_new_tokens=...)` for every kind of drafter on both
backends; stop strings end no shorter output, speculative or plain."""

from __future__ import annotations

import pytest
import torch

from laws import tv, tv_bound
from test_engine import PROMPTS, decoder
from test_engine_laws import PROMPT, TEMP, TRIALS, V, steady_clock  # noqa: F401 (a fixture)
from tiny import perturbed_copy, tiny_model
from specula.api import build_decoder
from specula.errors import ConfigError
from specula.min_tokens import EndsMasked, ending_ids
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.sampling import SamplingParams
from specula.tree import TokenTree


def test_each_row_is_masked_by_its_own_output_position():
    # root -> a(1) -> b(2) -> c(3); root -> d(1)
    tree = TokenTree.build(tokens=[4, 5, 6, 7], parents=[-1, 0, 1, -1])
    logits = torch.randn(5, 12)
    params = SamplingParams(min_new_tokens=6, stop_token_ids=(3,))
    rows = EndsMasked(logits, tree, generated=4, params=params, eos_token_ids=[2, 50])  # 50: outside the rows
    for row in range(5):
        depth = tree.depth[row - 1] if row else 0  # row decides output position 4 + depth
        masked = 4 + depth < 6
        assert bool((rows[row][[2, 3]] == float("-inf")).all()) == masked
        keep = [t for t in range(12) if t not in (2, 3) or not masked]
        assert torch.equal(rows[row][keep], logits[row][keep])
    assert ending_ids(SamplingParams(ignore_eos=True, stop_token_ids=(3,)), [2], 12) == [3]
    assert ending_ids(SamplingParams(), [2, 50], 12) == [2]


def _hf_reference(model, prompt: list[int], eos: int, n: int, least: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=least, eos_token_id=eos,
                             pad_token_id=eos, do_sample=False)
    return out[0, len(prompt):].tolist()


def _eos_early(model, prompt: list[int]) -> int:
    """A token plain greedy decoding emits third: as EOS it ends the output at 3 tokens."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    return int(out[0, -1])


@pytest.mark.parametrize("method", ["none", "prompt-lookup", "draft-model"])
def test_greedy_output_equals_transformers_min_new_tokens(method):
    model = tiny_model("qwen2", seed=3)
    for prompt in PROMPTS:
        eos = _eos_early(model, prompt)
        dec = decoder(model, method, perturbed_copy(model, 0.02) if method == "draft-model" else None)
        dec.eos_token_ids = frozenset([eos])
        out = dec.generate(prompt, SamplingParams(max_new_tokens=20, min_new_tokens=12))
        assert out.token_ids == _hf_reference(model, prompt, eos, 20, 12), (method, prompt)
        assert len(out.token_ids) >= 12 and eos not in out.token_ids[:12]
        early = dec.generate(prompt, SamplingParams(max_new_tokens=20))
        assert len(early.token_ids) <= 3 and early.token_ids[-1] == eos  # without the minimum it ends at once
        as_stop_id = dec.generate(prompt, SamplingParams(max_new_tokens=20, min_new_tokens=12, ignore_eos=True,
                                                         stop_token_ids=(eos,)))
        assert as_stop_id.token_ids == out.token_ids


def test_the_native_backend_and_a_head_stay_exact_under_a_minimum():
    from specula.drafters.heads.runtime import new_head

    model = tiny_model("llama", "eager", seed=4)
    prompt = PROMPTS[0]
    eos = _eos_early(model, prompt)
    target = NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native",
                            eos_token_ids=[eos])
    head = new_head("eagle3", target, torch.arange(0, model.config.vocab_size, 2), seed=1)
    dec = build_decoder("fusion", target, None, head=head, planner=False)
    out = dec.generate(prompt, SamplingParams(max_new_tokens=24, min_new_tokens=10))
    assert out.token_ids == _hf_reference(model, prompt, eos, 24, 10)


def test_a_drafted_end_token_under_the_minimum_is_rejected_not_emitted():
    """The draft is the target itself, so every step drafts the EOS that plain decoding would emit:
    under the minimum its node is rejected and the output goes on as transformers' does."""
    model = tiny_model("qwen2", seed=3)
    prompt = PROMPTS[1]
    eos = _eos_early(model, prompt)
    dec = build_decoder("draft-model", HFCausalLM(model, "target"), None, HFCausalLM(model, "draft"), planner=False,
                        num_draft_tokens=6)
    dec.eos_token_ids = frozenset([eos])
    out = dec.generate(prompt, SamplingParams(max_new_tokens=16, min_new_tokens=8))
    assert out.token_ids == _hf_reference(model, prompt, eos, 16, 8)
    assert out.stats.proposed_tokens > out.stats.accepted_tokens > 0


def test_bad_minimums_are_refused():
    with pytest.raises(ConfigError, match="min_new_tokens must be an integer from 0 to max_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(ConfigError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=-1)
    with pytest.raises(ConfigError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=2.5)


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_sampled_output_follows_the_law_with_the_end_masked(method):
    """Over a vocabulary of 8, the first two tokens sampled with EOS masked at both (min_new_tokens=2)
    follow that law exactly; the check tells it from the unmasked law."""
    model = tiny_model("llama", seed=8, vocab=V)
    options = {"greedy_proposals": False} if method == "draft-model" else {}  # chains drawn from q
    dec = build_decoder(method, HFCausalLM(model, "target"), None, HFCausalLM(perturbed_copy(model, 0.3), "draft")
                        if method == "draft-model" else None, planner=False, **options)
    with torch.inference_mode():
        first = model(torch.tensor([PROMPT])).logits[0, -1]
        rows = model(torch.tensor([[*PROMPT, a] for a in range(V)])).logits[:, -1]  # [V, V]
    eos = int(first.argmax())  # the likeliest first token, as EOS: masking it moves much mass
    dec.eos_token_ids = frozenset([eos])

    def law(mask: bool) -> torch.Tensor:  # P(first = a, second = b): [V * V]
        f, r = first.double().clone(), rows.double().clone()
        if mask:
            f[eos], r[:, eos] = float("-inf"), float("-inf")
        return (torch.softmax(f / TEMP, -1)[:, None] * torch.softmax(r / TEMP, -1)).flatten()

    codes = torch.empty(TRIALS, dtype=torch.long)
    accepted = 0
    for s in range(TRIALS):
        out = dec.generate(PROMPT, SamplingParams(temperature=TEMP, max_new_tokens=3, min_new_tokens=2, seed=s))
        codes[s] = out.token_ids[0] * V + out.token_ids[1]
        accepted += out.stats.accepted_tokens
    exact = law(True)
    assert accepted > TRIALS // 20, accepted
    assert tv(codes, exact) < tv_bound(exact, TRIALS, c=2.0)
    assert 0.5 * float((exact - law(False)).abs().sum()) > 2 * tv_bound(exact, TRIALS, c=2.0)
