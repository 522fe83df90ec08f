"""Long-context prompts composed from the target's answers: every task, the passages inside,
the question of a documents prompt answered by one of its documents, deterministic by seed."""

from __future__ import annotations

import hashlib
import json

import pytest

from specula.training.context_prompts import (DEFAULT_TASKS, LANGUAGES, TASKS, Passage, clean_passage, compose,
                                               prose_passage)


def passages(n: int) -> list[Passage]:
    return [Passage(f"Question number {i}?", " ".join(f"word{i}x{k}" for k in range(45)) + ".") for i in range(n)]


def test_clean_passage_cuts_an_unfinished_answer_to_its_last_sentence():
    text = "One two three. " * 20 + "and then it was cut"
    cut = clean_passage(text, finished=False)
    assert cut.endswith("three.") and "cut" not in cut
    assert clean_passage(text, finished=True) == text.strip()
    assert clean_passage("Too short. Really.", finished=True) is None
    assert clean_passage("no sentence end at all " * 20, finished=False) is None


def test_prose_passage_keeps_another_models_prose_only():
    body = " ".join(["The harbour town grew around its fish market."] * 6)
    # the assistant's opener goes, and a list item cut after its number
    assert prose_passage(f"Sure, I can help you with that!\n\n{body}\n\n2.", True, min_words=20) == body
    assert prose_passage(f"Certainly: {body}", True, min_words=20) == body
    # code is not a text to summarise
    assert prose_passage(f"{body}\n\n```python\nprint(1)\n```", True, min_words=20) is None
    # an unfinished answer is cut back to its last sentence, then measured
    assert prose_passage(f"{body} And then the", False, min_words=20) == body
    assert prose_passage(f"Sure! {body}", True, min_words=50) is None  # 48 words once the opener is gone
    assert prose_passage("Yesterday the market opened early. " * 8, True, min_words=20).startswith("Yesterday")


def test_compose_cycles_tasks_and_holds_the_passages():
    ps = passages(10)
    rows = compose(ps, 20, seed=3)
    assert [r["task"] for r in rows] == [DEFAULT_TASKS[i % len(DEFAULT_TASKS)] for i in range(20)]
    assert len({r["id"] for r in rows}) == 20
    for r in rows:
        inside = [p for p in ps if p.text in r["prompt"]]
        if r["task"] == "documents":
            assert 2 <= len(inside) <= 4 and r["prompt"].count("Document ") == len(inside)
            question = r["prompt"].rsplit("Question: ", 1)[1]
            assert question in {p.question for p in inside}  # one of its documents answers it
        else:
            assert len(inside) == 1
    assert compose(ps, 20, seed=3) == rows and compose(ps, 20, seed=4) != rows


def test_compose_needs_enough_passages():
    with pytest.raises(ValueError, match="at least 4 passages"):
        compose(passages(3), 5)


def test_compose_takes_the_copy_heavy_tasks_on_request():
    ps = passages(10)
    rows = compose(ps, 21, seed=3, tasks=TASKS)
    assert [r["task"] for r in rows] == [TASKS[i % len(TASKS)] for i in range(21)]
    assert {"translate", "proofread"} <= set(DEFAULT_TASKS) ^ set(TASKS)
    translated = [r["prompt"] for r in rows if r["task"] == "translate"]
    assert len(translated) == 3
    for prompt in translated:
        language = prompt.split("into ", 1)[1].split(".", 1)[0]
        assert language in LANGUAGES and sum(p.text in prompt for p in ps) == 1


def test_compose_refuses_unknown_tasks():
    with pytest.raises(ValueError, match="unknown context task.*poem.*the tasks are summary"):
        compose(passages(10), 5, tasks=("summary", "poem"))
    with pytest.raises(ValueError, match="no context task given"):
        compose(passages(10), 5, tasks=())


def test_compose_makes_long_texts_and_many_documents_on_request():
    ps = passages(12)
    rows = compose(ps, 30, seed=5, max_documents=8, min_documents=5, text_passages=(3, 5))
    for r in rows:
        inside = [p for p in ps if p.text in r["prompt"]]
        if r["task"] == "documents":
            assert 5 <= len(inside) <= 8 and r["prompt"].count("Document ") == len(inside)
        else:
            assert 3 <= len(inside) <= 5 and r["prompt"].count("\n\n") == len(inside)  # instruction + paragraphs
    assert {len([p for p in ps if p.text in r["prompt"]]) for r in rows if r["task"] != "documents"} == {3, 4, 5}
    # the defaults compose what they composed before the options existed (digest taken then), so a
    # committed prompt file is rebuilt from its manifest's settings
    made = compose(ps, 14, seed=5, tasks=TASKS)
    assert hashlib.sha256(json.dumps(made).encode()).hexdigest() == \
        "8897569ec390eb70aeced443f76604602d17931e97713004ce26cf0a3cc3482e"
    with pytest.raises(ValueError, match="passages per text 3..2"):
        compose(ps, 5, text_passages=(3, 2))
    with pytest.raises(ValueError, match="at least 13 passages"):
        compose(ps, 5, text_passages=(1, 13))
