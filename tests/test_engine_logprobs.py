"""Logprobs from the decode loop: the target's own log-probabilities of every emitted and prompt
token, whatever drafted them, equal to a plain causal forward's; asking for them changes nothing."""

from __future__ import annotations

import pytest
import torch

import specula.prefill
from test_engine import PROMPTS, decoder
from tiny import perturbed_copy, tiny_model
from specula.api import build_decoder
from specula.drafters.heads.runtime import new_head
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.sampling import SamplingParams


@torch.inference_mode()
def causal_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row j is log p(. | ids[: j + 1]) by one plain forward."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def assert_logprobs_are_causal(model, prompt: list[int], out, top: int, prompt_top: int | None = None) -> None:
    ref = causal_logprobs(model, prompt + out.token_ids)  # [len(prompt) + new - 1, vocab]
    assert [e.token_id for e in out.logprobs] == out.token_ids
    for i, entry in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert entry.rank == 1 + int((row > row[entry.token_id] + 1e-5).sum())
        assert len(entry.top) == top
        assert [t for t, _ in entry.top] == row.topk(top).indices.tolist()
    if prompt_top is None:
        assert out.prompt_logprobs is None
        return
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j, entry in enumerate(out.prompt_logprobs[1:]):
        assert entry.token_id == prompt[j + 1]
        assert entry.logprob == pytest.approx(float(ref[j, prompt[j + 1]]), abs=1e-4)
        assert len(entry.top) == prompt_top


@pytest.mark.parametrize("method", ["none", "prompt-lookup", "draft-model"])
def test_logprobs_of_every_emitted_token_are_the_targets_whatever_drafted_it(method):
    model = tiny_model("qwen2", seed=3)
    dec = decoder(model, method, perturbed_copy(model, 0.05) if method == "draft-model" else None)
    for prompt in PROMPTS:
        out = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2))
        assert out.token_ids == dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
        assert_logprobs_are_causal(model, prompt, out, top=3, prompt_top=2)
    if method == "draft-model":
        assert out.stats.accepted_tokens > 0  # steps that emitted several tokens were checked


def test_sampled_tokens_get_the_raw_distributions_logprobs_and_the_same_sample():
    model = tiny_model("llama", seed=5)
    dec = decoder(model, "draft-model", perturbed_copy(model, 0.05))
    params = dict(max_new_tokens=20, ignore_eos=True, temperature=0.7, top_k=10, seed=11)
    out = dec.generate(PROMPTS[0], SamplingParams(**params, logprobs=0))
    assert out.token_ids == dec.generate(PROMPTS[0], SamplingParams(**params)).token_ids
    assert_logprobs_are_causal(model, PROMPTS[0], out, top=0)


def test_a_stream_carries_each_steps_logprobs_and_the_prompts_first():
    model = tiny_model("qwen2", seed=3)
    dec = decoder(model, "prompt-lookup")
    chunks = list(dec.stream(PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=1,
                                                        prompt_logprobs=0)))
    assert [len(c.logprobs) for c in chunks] == [len(c.token_ids) for c in chunks]
    assert chunks[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in chunks[1:])
    assert len(chunks[0].prompt_logprobs) == len(PROMPTS[0])
    plain = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == plain.token_ids
    assert plain.logprobs is None and plain.prompt_logprobs is None


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_prompt_longer_than_a_chunk_keeps_the_heads_features_and_its_logprobs(backend, monkeypatch):
    """The prompt's logprobs prefill in chunks; a head reads the hidden states of every chunk."""
    monkeypatch.setattr(specula.prefill, "PROMPT_CHUNK", 4)
    model = tiny_model("llama", "eager", seed=4)
    target = (NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native",
                             eos_token_ids=[]) if backend == "native" else HFCausalLM(model, "hf", eos_token_ids=[]))
    head = new_head("eagle3", target, torch.arange(0, model.config.vocab_size, 2), seed=1)
    dec = build_decoder("eagle3", target, None, head=head, planner=False)
    seen = []  # the prompt's features each request handed the head
    observe = dec.drafters[0].observe_prompt
    monkeypatch.setattr(dec.drafters[0], "observe_prompt", lambda p, h, s: (seen.append(h.clone()), observe(p, h, s)))
    prompt = PROMPTS[0] + PROMPTS[1]  # 18 tokens: 5 chunks of the 17 prefilled
    out = dec.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2, prompt_logprobs=1))
    plain = dec.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert out.token_ids == plain.token_ids
    assert seen[0].shape == seen[1].shape and seen[0].shape[0] == len(prompt) - 1
    torch.testing.assert_close(seen[0], seen[1], atol=1e-4, rtol=1e-4)
    assert_logprobs_are_causal(model, prompt, out, top=2, prompt_top=1)


def test_a_one_token_prompt_has_one_empty_prompt_logprob():
    model = tiny_model("qwen2", seed=3)
    out = decoder(model, "none").generate([9], SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=0,
                                                              prompt_logprobs=5))
    assert out.prompt_logprobs == [None]
    assert_logprobs_are_causal(model, [9], out, top=0, prompt_top=5)
