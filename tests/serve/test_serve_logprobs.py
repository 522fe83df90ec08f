"""Logprobs over HTTP with the official `openai` client: chat's and completions' shapes, `echo`
with the prompt's logprobs (how evaluation harnesses score text), streamed and not; every value
is the target's own log-probability from a plain causal forward."""

from __future__ import annotations

import copy

import pytest
import torch

from serve_helpers import MODEL, chat_ids, text_ids


@pytest.fixture(scope="module")
def causal(target_model):
    """causal(ids) -> [len(ids) - 1, vocab]: row j is log p(. | ids[: j + 1]), one HF forward."""
    model = copy.deepcopy(target_model)

    @torch.inference_mode()
    def logprobs(ids) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([list(ids)])).logits[0, :-1].float(), dim=-1)

    return logprobs


def test_completion_logprobs_are_the_targets_with_the_chosen_token_among_the_alternatives(
        client, tokenizer, reference, causal):
    prompt = "w10 w11 w12 w10 w11"
    ids = text_ids(tokenizer, prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    new = list(reference.tokens(ids, 12))
    lp = out.choices[0].logprobs
    assert out.choices[0].text == reference(ids, 12)
    assert lp.tokens == [tokenizer.decode([t]) for t in new]
    rows = causal(list(ids) + new)[len(ids) - 1:]
    assert lp.token_logprobs == pytest.approx([float(r[t]) for r, t in zip(rows, new)], abs=1e-4)
    for row, token, top in zip(rows, new, lp.top_logprobs):
        best = row.topk(2).indices.tolist()
        assert set(top) == {tokenizer.decode([t]) for t in [*best, token]}  # the chosen one is always there
        assert top[tokenizer.decode([best[0]])] == pytest.approx(float(row[best[0]]), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_logprobs_scores_the_prompt_as_an_evaluation_harness_asks(client, tokenizer, causal):
    """lm-evaluation-harness's loglikelihood request: token ids, max_tokens 1, echo, logprobs 1."""
    ids = list(text_ids(tokenizer, "w40 w03 w77 w08 w09 w30"))
    out = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    new = lp.tokens[len(ids):]
    assert len(new) == 1 and out.usage.completion_tokens == 1
    assert out.choices[0].text.startswith(tokenizer.decode(ids))
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = causal(ids + [tokenizer.convert_tokens_to_ids(new[0])])
    expected = [float(rows[j, t]) for j, t in enumerate(ids[1:])]
    assert lp.token_logprobs[1: len(ids)] == pytest.approx(expected, abs=1e-4)
    greedy = [row.argmax().item() for row in rows]
    assert [max(top, key=top.get) for top in lp.top_logprobs[1:]] == [tokenizer.decode([t]) for t in greedy]


def test_echo_with_max_tokens_0_returns_the_prompt_alone_as_vllm_does(client, tokenizer):
    """OpenAI's and vLLM's echo with max_tokens 0: the prompt and its logprobs, no completion (it was a
    400 "'max_tokens' must be >= 1"); the prompt's logprobs are those max_tokens 1 gives, streamed or not."""
    ids = list(text_ids(tokenizer, "w40 w03 w77 w08 w09 w30"))
    one = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, echo=True, logprobs=1)
    out = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, temperature=0, echo=True, logprobs=1)
    choice, lp = out.choices[0], out.choices[0].logprobs
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    assert lp.tokens == one.choices[0].logprobs.tokens[: len(ids)]
    assert lp.token_logprobs == one.choices[0].logprobs.token_logprobs[: len(ids)]
    assert lp.top_logprobs == one.choices[0].logprobs.top_logprobs[: len(ids)]
    chunks = list(client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=0, echo=True, stream=True))
    assert sorted((c.choices[0].index, c.choices[0].text) for c in chunks if c.choices and c.choices[0].text) == [
        (0, choice.text), (1, choice.text)]
    plain = client.completions.create(model=MODEL, prompt="w05 w06", max_tokens=0, echo=True)
    assert plain.choices[0].text == "w05 w06" and plain.choices[0].logprobs is None


def test_max_tokens_0_without_echo_is_refused(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be >= 1"):
        client.completions.create(model=MODEL, prompt="w05 w06", max_tokens=0)


def test_echo_without_logprobs_returns_the_prompt_then_the_completion(client, tokenizer, reference):
    prompt = "w05 w06 w07"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert out.choices[0].text == prompt + reference(text_ids(tokenizer, prompt), 6)
    assert out.choices[0].logprobs is None


def test_chat_logprobs_carry_bytes_and_top_alternatives(client, tokenizer, reference, causal):
    messages = [{"role": "user", "content": "w05 w06 w07"}]
    ids = chat_ids(tokenizer, messages)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=3)
    new = list(reference.tokens(ids, 10))
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in new]
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    rows = causal(list(ids) + new)[len(ids) - 1:]
    assert [c.logprob for c in content] == pytest.approx([float(r[t]) for r, t in zip(rows, new)], abs=1e-4)
    for c, row in zip(content, rows):
        assert [a.token for a in c.top_logprobs] == [tokenizer.decode([t]) for t in row.topk(3).indices.tolist()]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content
    no_top = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True)
    assert all(c.top_logprobs == [] for c in no_top.choices[0].logprobs.content)


def test_streamed_logprobs_add_up_to_the_whole_responses(client):
    messages = [{"role": "user", "content": "w09 w09 w09 w20"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=14, temperature=0.8, seed=5,
                                           logprobs=True, top_logprobs=1)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=14, temperature=0.8,
                                                 seed=5, logprobs=True, top_logprobs=1, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in whole.choices[0].logprobs.content]
    assert len(streamed) == whole.usage.completion_tokens


def test_a_streamed_echo_sends_the_prompt_first_and_offsets_run_on(client, tokenizer):
    prompt = "w10 w11 w12"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True, logprobs=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True,
                                            logprobs=0, stream=True))
    assert chunks[0].choices[0].text == prompt
    assert chunks[0].choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in text_ids(tokenizer, prompt)]
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.choices[0].logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == whole.choices[0].logprobs.text_offset
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
