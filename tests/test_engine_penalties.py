"""Penalties and a logit bias through the decode loop: greedy output equals plain greedy decoding
with the same penalties (an independent reference: Hugging Face's repetition processor and
OpenAI's frequency / presence rule), on both backends and every kind of drafter; sampled output
follows the penalised law exactly."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from laws import tv, tv_bound
from test_engine import PROMPTS, decoder
from test_engine_laws import PROMPT, TEMP, TRIALS, V, steady_clock  # noqa: F401 (a fixture)
from tiny import perturbed_copy, successor_model, tiny_model
from specula.api import build_decoder
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.sampling import SamplingParams

PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, logit_bias={7: 2.0, 9: -5.0})


def reference_logits(model, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """The penalised next-token logits after prompt + output ([vocab] float64), by full recomputation."""
    with torch.inference_mode():
        row = model(torch.tensor([prompt + output])).logits[0, -1].double()
    row = row.clone()  # a normal tensor, to change in place
    for token, bias in params.logit_bias:
        row[token] += bias
    if params.repetition_penalty != 1.0:
        row = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([prompt + output]), row[None])[0]
    for token, count in Counter(output).items():
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    return row


def reference_greedy_penalized(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    output: list[int] = []
    for _ in range(n):
        output.append(int(reference_logits(model, prompt, output, params).argmax()))
    return output


def echo_model():
    """A model whose greedy next token repeats the last one by a margin of about 5 logits, which the
    penalties overturn after a run of ~8 (`successor_model` with its output head set to its embeddings,
    scaled down): prompt lookup copies the run, and its copies are accepted until the penalties of
    the output and of the path before each row end the run."""
    model = successor_model()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * 0.05)
    return model


@pytest.mark.parametrize("method", ["none", "prompt-lookup", "draft-model"])
def test_penalised_greedy_output_equals_plain_penalised_greedy(method):
    # a random model's output seldom repeats what came before: prompt lookup would propose, never be accepted
    model = echo_model() if method == "prompt-lookup" else tiny_model("qwen2", seed=3)
    dec = decoder(model, method, perturbed_copy(model, 0.05) if method == "draft-model" else None)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, **PENALTIES)
    accepted = 0
    for prompt in PROMPTS:
        out = dec.generate(prompt, params)
        assert out.token_ids == reference_greedy_penalized(model, prompt, 30, params), (method, prompt)
        accepted += out.stats.accepted_tokens
    plain = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert plain.token_ids != dec.generate(PROMPTS[0], params).token_ids  # the penalties do bite
    if method != "none":
        assert accepted > 0  # multi-token steps were checked row by row


def test_the_native_backend_and_a_head_stay_exact_under_penalties():
    from specula.drafters.heads.runtime import new_head

    model = tiny_model("llama", "eager", seed=4)
    target = NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native",
                            eos_token_ids=[])
    head = new_head("eagle3", target, torch.arange(0, model.config.vocab_size, 2), seed=1)
    dec = build_decoder("fusion", target, None, head=head, planner=False)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5)
    for prompt in PROMPTS[:2]:
        assert dec.generate(prompt, params).token_ids == reference_greedy_penalized(model, prompt, 24, params)


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused():
    dec = decoder(tiny_model("qwen2", seed=3), "none")
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        dec.generate(PROMPTS[0], SamplingParams(logit_bias={10_000: 1.0}))


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_sampled_output_follows_the_penalised_law(method):
    model = tiny_model("llama", seed=8, vocab=V)
    target = HFCausalLM(model, "target")
    options = {"greedy_proposals": False} if method == "draft-model" else {}  # chains drawn from q
    dec = build_decoder(method, target, None, HFCausalLM(perturbed_copy(model, 0.3), "draft")
                        if method == "draft-model" else None, planner=False, **options)
    params = dict(temperature=TEMP, max_new_tokens=3, ignore_eos=True, repetition_penalty=3.0, presence_penalty=1.5,
                  frequency_penalty=0.5, logit_bias={2: 2.0})
    exact = _exact_first_two(model, SamplingParams(**params))
    codes = torch.empty(TRIALS, dtype=torch.long)
    accepted = 0
    for s in range(TRIALS):
        out = dec.generate(PROMPT, SamplingParams(**params, seed=s))
        codes[s] = out.token_ids[0] * V + out.token_ids[1]
        accepted += out.stats.accepted_tokens
    assert accepted > TRIALS // 20, accepted
    assert tv(codes, exact) < tv_bound(exact, TRIALS, c=2.0)
    unpenalised = _exact_first_two(model, SamplingParams(temperature=TEMP))
    # the check tells the laws apart: ignoring the penalties would fail it
    assert 0.5 * float((exact - unpenalised).abs().sum()) > 2 * tv_bound(exact, TRIALS, c=2.0)


def _exact_first_two(model, params: SamplingParams) -> torch.Tensor:
    """P(first = a, second = b) of plain penalised sampling: [V * V]."""
    p1 = torch.softmax(reference_logits(model, PROMPT, [], params) / params.temperature, -1)
    rows = [torch.softmax(reference_logits(model, PROMPT, [a], params) / params.temperature, -1) for a in range(V)]
    return (p1[:, None] * torch.stack(rows)).flatten()
