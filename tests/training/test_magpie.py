"""Magpie prompt synthesis: the user-turn prefix comes from the chat template (a real-looking
ChatML one), the filters keep and drop what they say, and a tiny target writes a prompt file
and its manifest through the engine's batched step, resumably and reproducibly."""

from __future__ import annotations

import json

import pytest

from tiny import tiny_model, word_tokenizer
from specula.errors import ConfigError
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.training.corpus import read_prompts
from specula.training.magpie import (DROP_REASONS, FilterConfig, MagpieConfig, clean, drop_reason, filter_prompts,
                                     generate_user_turns, manifest_path, synthesise, user_turn)

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""SmolLM2-Instruct's chat template (ChatML with a default system turn)."""

WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", *(f"a{i:02d}" for i in range(90))]


@pytest.fixture(scope="module")
def chatml_tokenizer():
    return word_tokenizer(WORDS, decoder=True, chat_template=CHATML, unk_token="<unk>", eos_token="<|im_end|>",
                          additional_special_tokens=["<|im_start|>"])


def test_user_turn_prefix_is_cut_from_the_chat_template(chatml_tokenizer):
    turn = user_turn(chatml_tokenizer)
    assert turn.prefix == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                           "Face<|im_end|>\n<|im_start|>user\n")
    assert turn.end == "<|im_end|>" and turn.end_ids == (2,)
    assert turn.prefix_ids == tuple(chatml_tokenizer.encode(turn.prefix, add_special_tokens=False))
    assert turn.prefix_ids[-2:] == (1, 4)  # <|im_start|> user: the model's next words are the user's


def test_user_turn_after_a_steering_system_message(chatml_tokenizer):
    turn = user_turn(chatml_tokenizer, "Users ask a02 a03.")
    assert turn.prefix == "<|im_start|>system\nUsers ask a02 a03.<|im_end|>\n<|im_start|>user\n"
    assert turn.end == "<|im_end|>"
    with pytest.raises(ConfigError, match="system message is empty"):
        user_turn(chatml_tokenizer, "  ")


def test_user_turn_refuses_a_tokenizer_without_a_template():
    with pytest.raises(ConfigError, match="needs a chat template"):
        user_turn(word_tokenizer(8))


def test_drop_reason_of_single_messages():
    f = FilterConfig(min_words=3, max_words=10)
    assert drop_reason("How do I bake rye bread at home?", True, f) is None
    assert drop_reason("   ", True, f) == "empty"
    assert drop_reason("How do I bake rye bread at home?", False, f) == "unfinished"
    assert drop_reason("How do I bake rye bread at home?", False, FilterConfig(require_end=False)) is None
    assert drop_reason("Hi there", True, f) == "too_short"
    assert drop_reason("one two three four five six seven eight nine ten eleven", True, f) == "too_long"
    assert drop_reason("What is \x07 this thing here?", True, f) == "garbage"  # non-printable
    assert drop_reason("Tell me a joke <|im_start|> now", True, f, specials=["<|im_start|>"]) == "garbage"
    assert drop_reason("}}{{ ]]]] ((( ;;; %%%% a b c", True, f) == "garbage"  # mostly symbols
    assert drop_reason("yes yes yes yes yes yes yes no", True, f) == "garbage"  # one word repeated
    assert clean("  Write a poem<|im_end|> junk", "<|im_end|>") == "Write a poem"


def test_filter_prompts_dedups_and_refuses_benchmark_prompts():
    items = [("1", "Explain how tides work on the coast.", True),
             ("2", "explain how TIDES work on the coast!", True),  # exact after normalisation
             ("3", "Explain how tides work on the coast, please.", True),  # near duplicate
             ("4", "Write a short poem about autumn leaves falling.", True),
             ("5", "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
                   "experiences and must-see attractions.", True),  # Spec-Bench 81
             ("6", "ok", True), ("7", "Give me a recipe for lentil soup with carrots", False)]
    kept, dropped = filter_prompts(items)
    assert [pid for pid, _ in kept] == ["1", "4"]
    assert dropped == {**dict.fromkeys(DROP_REASONS, 0), "duplicate": 1, "near_duplicate": 1, "benchmark": 1,
                       "too_short": 1, "unfinished": 1}


@pytest.fixture(scope="module")
def tiny_target():
    model = tiny_model("llama", "eager", seed=5)
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native",
                          eos_token_ids=[])


LOOSE = FilterConfig(min_words=2, max_repeat=1.0)
"""A random tiny model's words are short messages of random words: keep two words and more."""


def test_synthesise_writes_prompts_and_manifest_and_resumes_to_the_same_file(tiny_target, chatml_tokenizer, tmp_path):
    config = MagpieConfig(count=10, max_new_tokens=12, batch_size=4, seed=3)
    manifest = synthesise(tiny_target, chatml_tokenizer, "tiny", tmp_path / "a" / "prompts.jsonl", config, LOOSE)
    out = tmp_path / "a" / "prompts.jsonl"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["source"] == "magpie:tiny" and r["prompt"].strip() for r in rows)
    assert all("<|im" not in r["prompt"] for r in rows)
    assert len({r["id"] for r in rows}) == len(rows) and not out.with_name("prompts.jsonl.partial").exists()
    on_disk = json.loads(manifest_path(out).read_text())
    assert on_disk == manifest and manifest["prompts"] == len(rows)
    [src] = manifest["sources"]
    assert src["source"] == "magpie:tiny" and src["licence"] == "generated by tiny; licence of the model"
    assert src["generated"] == 10 and src["kept"] + sum(src["dropped"].values()) == 10 == len(rows) + sum(
        src["dropped"].values())
    assert src["dropped"]["unfinished"] > 0  # some did not close their turn within 12 tokens
    assert manifest["user_turn"]["end"] == "<|im_end|>" and manifest["sampling"]["temperature"] == 1.0
    assert len(read_prompts([out])) == len(rows)  # usable as `specula train --data`

    # interrupted after 3 requests, then resumed: the same file
    resumed = tmp_path / "b" / "prompts.jsonl"
    resumed.parent.mkdir()
    partial = resumed.with_name("prompts.jsonl.partial")
    seen = []

    def stop_after_three(n):
        seen.append(n)
        if sum(seen) >= 3:
            raise KeyboardInterrupt

    from specula.training.magpie import _settings_key

    turn = user_turn(chatml_tokenizer)
    with pytest.raises(KeyboardInterrupt):
        generate_user_turns(tiny_target, chatml_tokenizer, turn, partial, config,
                            _settings_key("tiny", turn, config), stop_after_three)
    assert 1 + 3 <= len(partial.read_text().splitlines()) < 1 + 10
    synthesise(tiny_target, chatml_tokenizer, "tiny", resumed, config, LOOSE)
    assert resumed.read_text() == out.read_text()

    # a run of 10 stopped after 3, finished with a count of 6: the first 6 requests of the full run
    from dataclasses import replace

    smaller = tmp_path / "d" / "prompts.jsonl"
    smaller.parent.mkdir()
    seen.clear()
    with pytest.raises(KeyboardInterrupt):
        generate_user_turns(tiny_target, chatml_tokenizer, turn, smaller.with_name("prompts.jsonl.partial"), config,
                            _settings_key("tiny", turn, config), stop_after_three)
    part = synthesise(tiny_target, chatml_tokenizer, "tiny", smaller, replace(config, count=6), LOOSE)
    assert part["sources"][0]["generated"] == 6
    assert smaller.read_text().splitlines() == [line for line in out.read_text().splitlines()
                                                if json.loads(line)["id"] < "m000006"]

    with pytest.raises(ConfigError, match="exists"):
        synthesise(tiny_target, chatml_tokenizer, "tiny", out, config, LOOSE)
    other = tmp_path / "c" / "p.jsonl"
    other.parent.mkdir()
    other.with_name("p.jsonl.partial").write_text(json.dumps({"settings": "something else"}) + "\n")
    with pytest.raises(ConfigError, match="other settings"):
        synthesise(tiny_target, chatml_tokenizer, "tiny", other, config, LOOSE)


def test_drop_repeats_removes_prompts_an_earlier_file_holds(tmp_path):
    """A new round keeps only prompts no earlier file holds, exactly or nearly; the manifest counts
    what was dropped and the prompt count follows."""
    from specula.training.magpie import drop_repeats

    earlier = tmp_path / "old.jsonl"
    earlier.write_text("".join(json.dumps({"id": f"o{i}", "prompt": t}) + "\n" for i, t in enumerate([
        "How do I bake a loaf of sourdough bread at home with a simple starter?",
        "Write a short poem about the autumn rain falling on a quiet city street at night.",
        "How do I bake a loaf of sourdough bread at home with a simple starter?"])))  # a repeat among the earlier
    new = tmp_path / "new.jsonl"
    texts = ["how do I bake a loaf of sourdough bread at home with a simple starter?",  # exact after normalising
             "Write a short poem about the autumn rain falling on a quiet city street at night, please.",  # near
             "Explain the difference between a list and a tuple in Python with a small example."]
    new.write_text("".join(json.dumps({"id": f"n{i}", "prompt": t, "source": "magpie:x"}) + "\n" for i, t in enumerate(texts)))
    manifest_path(new).write_text(json.dumps({"file": "new.jsonl", "prompts": 3}))
    manifest = drop_repeats(new, [earlier])
    assert [json.loads(line)["id"] for line in new.read_text().splitlines()] == ["n2"]
    assert manifest["prompts"] == 1 and manifest["repeats_of_earlier_files"]["dropped"] == 2
    # counted over the new file's prompts only, not the earlier files' repeats of each other
    assert manifest["repeats_of_earlier_files"]["duplicate_or_near"] == {"duplicate": 1, "near_duplicate": 1}
    assert json.loads(manifest_path(new).read_text()) == manifest
