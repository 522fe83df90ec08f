"""Several choices in one request: completions' list of prompts (a batch) and `n`, streamed and
not; each choice equals what it gets alone (greedy: offline decoding; sampled: offline sampling
with seed + j, as vLLM seeds the choices of a request), in OpenAI's order."""

from __future__ import annotations

import pytest

from serve_helpers import MODEL, chat_ids, http_call, make_spec, running, text_ids

from specula.sampling import SamplingParams

PROMPTS = ["w05 w06 w07", "w10 w11 w12 w10 w11", "w40 w03 w77 w08 w09 w30"]


@pytest.fixture(scope="module")
def offline(target_model, draft_model, tokenizer):
    """The server's decoder, offline (the same seeded samples)."""
    return make_spec(target_model, tokenizer, "draft-model", draft_model)


def test_a_batch_of_prompts_gets_one_choice_each_in_order(client, tokenizer, reference):
    prompts = [PROMPTS[0], list(text_ids(tokenizer, PROMPTS[1])), PROMPTS[2]]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    ids = [text_ids(tokenizer, p) for p in PROMPTS]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [reference(i, 10) for i in ids]
    assert out.usage.prompt_tokens == sum(len(i) for i in ids)
    assert out.usage.completion_tokens == sum(len(reference.tokens(i, 10)) for i in ids)
    assert out.speculative_decoding["steps"] >= 3  # summed over the choices


def test_n_sampled_choices_are_the_offline_samples_with_seed_plus_j(client, tokenizer, offline):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=40, n=3)
    ids = text_ids(tokenizer, PROMPTS[0])
    expected = [offline.generate(list(ids), raw=True, params=SamplingParams(temperature=1.0, seed=40 + j,
                                                                            max_new_tokens=12)).text for j in range(3)]
    assert [c.text for c in out.choices] == expected
    assert len(set(expected)) > 1  # the choices are different draws


def test_choice_seeds_wrap_round_past_64_bits(client, tokenizer, offline):
    """seed 2**64 - 1 with n = 2: choice 1's seed + 1 wraps round to 0 (a generator takes 64 bits)."""
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=2**64 - 1,
                                    n=2)
    ids = text_ids(tokenizer, PROMPTS[0])
    expected = [offline.generate(list(ids), raw=True, params=SamplingParams(temperature=1.0, seed=s,
                                                                            max_new_tokens=8)).text
                for s in (2**64 - 1, 0)]
    assert [c.text for c in out.choices] == expected


def test_n_times_a_batch_orders_choices_prompt_by_prompt(client, tokenizer, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=2)
    texts = [reference(text_ids(tokenizer, p), 6) for p in PROMPTS[:2]]
    assert [c.text for c in out.choices] == [texts[0], texts[0], texts[1], texts[1]]


def test_streamed_chat_choices_each_start_with_the_role_and_finish_on_their_own(client, tokenizer, offline):
    messages = [{"role": "user", "content": "w09 w09 w09 w20"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.9,
                                                 seed=3, n=2, stream=True, stream_options={"include_usage": True}))
    texts, finished, roles = {0: "", 1: ""}, [], []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        if choice.delta.role:
            roles.append(choice.index)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.append(choice.index)
            assert chunk.speculative_decoding["method"] == "draft-model"
    assert sorted(roles) == [0, 1] and sorted(finished) == [0, 1]
    ids = chat_ids(tokenizer, messages)
    expected = [offline.generate(list(ids), raw=True, params=SamplingParams(temperature=0.9, seed=3 + j,
                                                                            max_new_tokens=10)).text for j in range(2)]
    assert [texts[0], texts[1]] == expected
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == sum(
        len(offline.generate(list(ids), raw=True, params=SamplingParams(temperature=0.9, seed=3 + j,
                                                                         max_new_tokens=10)).token_ids) for j in range(2))


def test_echo_and_logprobs_follow_each_choices_own_prompt(client, tokenizer):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=3, temperature=0, echo=True,
                                    logprobs=0)
    for choice, prompt in zip(out.choices, PROMPTS[:2]):
        n = len(text_ids(tokenizer, prompt))
        assert choice.text.startswith(prompt)
        assert choice.logprobs.tokens[:n] == [tokenizer.decode([t]) for t in text_ids(tokenizer, prompt)]
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == n + 3


def test_more_choices_than_the_batch_holds_wait_their_turn(target_model, tokenizer, reference):
    """A request of 5 choices on a server decoding 2 sequences at once: all answered, in order."""
    with running(make_spec(target_model, tokenizer, "prompt-lookup"), max_batch_size=2) as server:
        prompts = [PROMPTS[i % 3] for i in range(5)]
        status, _, body = http_call(server, "POST", "/v1/completions",
                                    {"model": MODEL, "prompt": prompts, "max_tokens": 8, "temperature": 0})
    assert status == 200
    assert [c["text"] for c in body["choices"]] == [reference(text_ids(tokenizer, p), 8) for p in prompts]
