"""Benchmark prompts never reach training: a planted Spec-Bench prompt, exact or lightly
reformatted or inside a longer prompt, is found; ordinary prompts and the shipped training
prompts pass; `specula train --data` with one exits 2 in one line naming file, line,
benchmark and fix."""

from __future__ import annotations

import json

import pytest

from specula.errors import ConfigError
from specula.training.contamination import (BenchmarkPrompt, ContaminationRule, build_index, default_index,
                                            find_contaminated, known_benchmarks, normalise)
from specula.training.corpus import DEFAULT_PROMPTS, read_prompts

MT_81 = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
         "and must-see attractions.")


def spec_bench(qid: int) -> dict:
    return next(p for p in map(json.loads, (DEFAULT_PROMPTS.parents[1] / "spec_bench" / "question.jsonl")
                               .read_text().splitlines()) if p["question_id"] == qid)


def test_normalise_folds_case_punctuation_and_whitespace():
    assert normalise("  Must-See\tATTRACTIONS!\n\n(Hawaii),") == "must see attractions hawaii"
    assert normalise("Ｆｕｌｌｗｉｄｔｈ “quotes”") == "fullwidth quotes"


@pytest.mark.parametrize("text", [
    MT_81,  # exact
    "compose an engaging travel-blog post about a recent trip to HAWAII,\nhighlighting cultural experiences & "
    "must see attractions",  # lightly reformatted
    " ".join(w[:2] + "\u00ad" + w[2:] if i % 5 == 0 and len(w) > 3 else w
             for i, w in enumerate(MT_81.split())),  # soft hyphens (invisible) inside words
    MT_81.replace(" ", " \u200b").replace("post", "po\u2060st"),  # zero-width spaces, a word joiner
    f"Please help me with this. {MT_81} Keep it under 300 words.",  # inside a longer prompt
])
def test_a_planted_spec_bench_prompt_is_found(text):
    [match] = find_contaminated(["Write a haiku about the sea.", text])
    assert match.index == 1 and match.prompt.label == "Spec-Bench question 81 (MT-bench)"


def test_every_benchmark_turn_is_found_and_ordinary_prompts_pass():
    turns = [p.text for p in known_benchmarks()]
    assert len(turns) > 480 and len(find_contaminated(turns)) == len(turns)
    assert {p.benchmark for p in known_benchmarks()} == {"Spec-Bench", "specula everyday bench set",
                                                         "specula structured bench set"}
    ordinary = ["Write a haiku about the sea.", "Explain how a refrigerator keeps food cold.",
                "Translate German to English: Ich trinke gern Tee am Morgen.",  # the benchmark's template, own text
                "Who played the lead in the film you like most?"]
    assert find_contaminated(ordinary) == []


def test_the_rule_short_turns_match_exactly_and_boilerplate_does_not_count():
    bench = [BenchmarkPrompt("B", str(i), f"Answer the question using the passage below carefully and briefly please now. "
                                          f"Topic {i} alpha beta gamma delta epsilon zeta eta theta iota kappa")
             for i in range(3)] + [BenchmarkPrompt("B", "q", "Who wrote Hamlet?")]
    index = build_index(bench, ContaminationRule(shingle_words=12, boilerplate_prompts=3))
    boiler = "Answer the question using the passage below carefully and briefly please now. Topic x"
    assert find_contaminated([boiler], index) == []  # shared by all three prompts: template text
    assert find_contaminated(["Who wrote Hamlet", "Who wrote Hamlet? And why?"], index)[0].index == 0
    assert len(find_contaminated(["Who wrote Hamlet? And why?"], index)) == 0
    [m] = find_contaminated(["Say: topic 2 alpha beta gamma delta epsilon zeta eta theta iota kappa!"], index)
    assert m.kind == "passage" and m.prompt.id == "2"


@pytest.mark.parametrize("text", ["Question: Who played Anna in Once Upon a Time?",
                                  "who played anna in once upon a time? Answer in one sentence.",
                                  "Quick trivia for you -- who played anna in 'Once Upon a Time'? Thanks!"])
def test_a_short_spec_bench_question_inside_a_prompt_is_found(text):
    """Spec-Bench's qa questions are mostly under 12 words: one found whole inside a prompt (a word
    or an instruction around it) is the benchmark's."""
    [match] = find_contaminated(["Write a haiku about the sea.", text])
    assert match.index == 1 and match.prompt.label == "Spec-Bench question 321" and match.kind == "passage"


def test_the_rule_short_turns_inside_a_prompt():
    """A turn of 4 to 11 words matches a prompt holding it whole; a shorter one only exactly; one
    that 3 benchmark prompts share is template text."""
    bench = [BenchmarkPrompt("B", "q", "Who painted the Mona Lisa?"), BenchmarkPrompt("B", "w", "Who wrote Hamlet?")]
    bench += [BenchmarkPrompt("B", f"t{i}", "Rewrite your previous answer please.") for i in range(3)]
    index = build_index(bench, ContaminationRule(shingle_words=12, boilerplate_prompts=3, contained_words=4))
    [m] = find_contaminated(["Tell me: who painted the Mona Lisa, and when?"], index)
    assert m.prompt.id == "q" and m.passage == "who painted the mona lisa"
    assert find_contaminated(["Who wrote Hamlet and Macbeth?", "Now rewrite your previous answer please, shorter."],
                             index) == []
    assert find_contaminated(["Rewrite your previous answer please."], index)[0].kind == "exact"


def test_the_shipped_training_prompts_pass():
    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines()]
    assert find_contaminated([t for r in rows for t in r["turns"]], default_index()) == []
    assert len(read_prompts([DEFAULT_PROMPTS])) == len(rows)


def test_the_shipped_heads_training_data_passes_and_has_a_manifest_per_file():
    """The prompt files a shipped head was trained on (specula/data/training/<target>/): no
    benchmark prompt, and each file's manifest names it, its sources and their licences."""
    files = sorted(DEFAULT_PROMPTS.parent.glob("*/*.jsonl"))
    assert files
    for f in files:
        texts = [r["prompt"] for r in map(json.loads, f.read_text().splitlines())]
        assert find_contaminated(texts, default_index()) == [], f
        manifest = json.loads(f.with_name(f.stem + ".manifest.json").read_text())
        assert manifest["file"] == f.name and manifest["prompts"] == len(texts) == len(read_prompts([f]))
        assert all(src["licence"] for src in manifest["sources"])


def test_read_prompts_refuses_a_file_with_a_benchmark_prompt(tmp_path):
    data = tmp_path / "mine.jsonl"
    q = spec_bench(300)["turns"][0]
    data.write_text(json.dumps({"prompt": "Write a haiku about the sea."}) + "\n"
                    + json.dumps({"turns": ["Hello there, how are you today?", MT_81]}) + "\n"
                    + json.dumps({"prompt": q.upper()}) + "\n")
    with pytest.raises(ConfigError) as err:
        read_prompts([data])
    msg = str(err.value)
    assert f"{data}:2:" in msg and "Spec-Bench question 81 (MT-bench)" in msg and "and 1 more line" in msg
    assert "remove those lines" in msg and "\n" not in msg


def test_train_command_exits_2_in_one_line_on_a_planted_spec_bench_prompt(tmp_path, capsys):
    from specula.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Write a haiku about the sea."}) + "\n"
                    + json.dumps({"prompt": "  " + MT_81.replace(",", " ,").lower() + "  "}) + "\n")
    code = main(["train", "--target", str(tmp_path / "no-model-needed"), "--data", str(data),
                 "--out", str(tmp_path / "h"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{data}:2:" in err and "Spec-Bench question 81" in err and "remove those lines" in err
    assert not (tmp_path / "h").exists()
