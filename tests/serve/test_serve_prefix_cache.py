"""The server's prefix cache (`EngineConfig.prefix_cache_mib`) over HTTP: a chat's next turn reads the first
turn's cache, says so in OpenAI's `usage.prompt_tokens_details.cached_tokens`, and its answer equals offline
decoding; `n` choices count their prompt's cached tokens once."""

from __future__ import annotations

import pytest

from serve_helpers import MODEL, chat_ids, native_spec, running

from specula.models.base import common_prefix_length
from specula.models.native import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels do not run here")

FIRST = [{"role": "user", "content": "w05 w06 w07 w10 w11 w12 w10 w11 w40 w03 w77 w08 w09 w30 w60 w61 w62"}]


@pytest.fixture(scope="module")
def native_server(target_model, tokenizer):
    with running(native_spec(target_model, tokenizer, "prompt-lookup", prefix_cache_mib=16)) as srv:
        yield srv


@pytest.fixture(scope="module")
def native_client(native_server):
    from openai import OpenAI

    return OpenAI(base_url=native_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_chats_next_turn_reports_its_cached_tokens_and_answers_as_offline(native_client, tokenizer, reference):
    first = native_client.chat.completions.create(model=MODEL, messages=FIRST, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    answer = first.choices[0].message.content
    turn = [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": "w20 w21"}]
    ids = chat_ids(tokenizer, turn)
    second = native_client.chat.completions.create(model=MODEL, messages=turn, max_tokens=12, temperature=0)
    first_ids = chat_ids(tokenizer, FIRST)
    held = list(first_ids) + list(reference.tokens(first_ids, 12))[:-1]  # what the first request's cache holds
    assert second.usage.prompt_tokens_details.cached_tokens == common_prefix_length(held, ids) > 10
    assert second.choices[0].message.content == reference(ids, 12)
    # n choices of a new prompt: the first prefills it, the others copy it from that one; none came from the cache
    fresh = [{"role": "user", "content": "w44 w45 w46 w47 w48 w49 w50 w51 w52 w53 w54 w55 w56 w57 w58 w59 w60"}]
    three = native_client.chat.completions.create(model=MODEL, messages=fresh, max_tokens=4, temperature=0, n=3)
    assert three.usage.prompt_tokens_details.cached_tokens == 0
    assert len({c.message.content for c in three.choices}) == 1  # greedy: the copies answer alike
    # n choices of one prompt: its cached tokens counted once, as its prompt tokens are
    again = native_client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, temperature=0, n=3)
    assert again.usage.prompt_tokens == len(ids)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    chunks = list(native_client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(ids) - 1
