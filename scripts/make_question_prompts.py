"""Short factual questions as training prompts: a model of ours writes trivia and search-engine
questions (who, when, where, how many) on topics of its own list and of scripts/make_training_prompts.py,
which the target then answers (docs/training.md, "Short factual questions").

    python3 scripts/make_question_prompts.py --source-model qwen2.5-coder-0.5b --requests 1500 \
        --out specula/data/training/smollm2-135m/questions.jsonl

Writes OUT_STEM-sources.jsonl (the requests: "Write one short trivia question about TOPIC whose answer is ..."),
has the source model answer them greedily (the corpus cache `specula train` writes, so a rerun
reuses its answers), splits the answers into questions (list marks stripped; 4-25 words, a question
word, a question mark, no phrase of three words repeated, each once), and writes OUT (JSONL {"id",
"prompt", "source"}: each question as written, or typed the way a search box gets it, lowercase with
no question mark, or under a short instruction) and both files' manifests. No benchmark text is
read; prompts a benchmark check flags are dropped and counted.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_training_prompts import TOPICS  # noqa: E402
from source_requests import add_request_args, source_answers, sources_path, unflagged, write_made  # noqa: E402
from specula.errors import SpeculaError  # noqa: E402

SCRIPT = "scripts/make_question_prompts.py"
FACT_TOPICS = [
    "the Olympic Games", "World War II", "the Beatles", "the river Nile", "Shakespeare's plays", "the Moon landing",
    "the FIFA World Cup", "films of the 1990s", "American presidents", "Nobel Prize winners", "the periodic table",
    "famous painters", "the Titanic", "fantasy novels", "the Eiffel Tower", "national parks", "Broadway musicals",
    "the Grammy Awards", "science fiction films", "ancient Egypt", "the Great Wall of China", "European capitals",
    "American football", "the Academy Awards", "the solar system", "famous inventors", "television sitcoms",
    "the Cold War", "Formula One", "the British monarchy", "Mount Everest", "the Amazon rainforest",
    "classical composers", "the Roman emperors", "basketball", "the Tour de France", "pop music charts",
    "famous bridges", "the Renaissance", "world languages", "the human body", "famous explorers",
    "the American Civil War", "Canadian provinces", "Australian history", "Japanese history", "opera",
    "the United Nations", "famous scientists", "video games", "comic books", "animated films", "tennis",
    "the Industrial Revolution", "deserts of the world", "famous novels", "rock bands", "country music",
    "the Middle Ages", "world religions", "space exploration", "famous ships", "islands of the world",
]
"""Topics of facts (people, places, dates, works), beside the general topics of TOPICS."""
ANSWER_KINDS = ["a person's name", "a year", "a city", "a country", "a number", "a title", "a date", "a place"]
"""What a requested question's answer is."""
REQUESTS = [
    "Write one short trivia question about {t} whose answer is {k}. Write only the question.",
    "Write a question someone might type into a search engine about {t}, asking for {k}. Only the question.",
    "Ask one quiz question about {t} with a short answer ({k}). Reply with the question alone.",
    "Write one factual question a student might look up about {t}; its answer is {k}. Just the question.",
]
"""Requests to the source model (`{t}`: a topic, `{k}`: an answer kind), one question each: asked for
five at once, the source model (greedy) repeated one question."""
QUESTION_WORDS = {"who", "whom", "whose", "when", "where", "which", "what", "how", "why", "in", "on", "at",
                  "name", "is", "are", "was", "were", "did", "does", "do", "can"}
"""A question starts with one of these (`in which year`, `on what date`, `name the ...`)."""
FORMS = [("as_written", 0.5), ("search", 0.8), ("instruction", 1.0)]
"""How a question becomes a prompt, by a uniform draw's upper bound: as written (50%), typed into a
search box (lowercase, no question mark; 30%), under a short instruction (20%)."""
INSTRUCTIONS = ["Answer the question: {q}", "{q} Answer briefly.", "Question: {q}\nAnswer:", "Quick question: {q}"]


def requests(count: int, seed: int) -> list[dict]:
    """`count` requests, topics drawn from FACT_TOPICS (two thirds) and TOPICS."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        topic = rng.choice(FACT_TOPICS) if rng.random() < 2 / 3 else rng.choice(TOPICS)
        prompt = rng.choice(REQUESTS).format(t=topic, k=rng.choice(ANSWER_KINDS))
        rows.append({"id": f"q{i:05d}", "prompt": prompt, "source": "s69-question-source"})
    return rows


def questions(text: str, seen: set[str]) -> list[str]:
    """The usable questions of one answer (see the module docstring); adds them (lowercased) to `seen`."""
    out = []
    for line in text.splitlines():
        q = re.sub(r"^\s*(\d+[.)]|[-*•]|Q\d*[:.])\s*", "", line).strip().strip('"“”').strip()
        q = re.sub(r"\s*\(.*?\)\s*$", "", q).strip()  # a trailing "(answer)"
        if not q.endswith("?") or "?" in q[:-1]:
            continue  # not one question, or an answer after it
        words = q.split()
        key = q.lower()
        if not 4 <= len(words) <= 25 or key in seen or words[0].lower().strip(",") not in QUESTION_WORDS:
            continue
        grams = [tuple(words[j:j + 3]) for j in range(len(words) - 2)]
        if len(set(grams)) < len(grams):
            continue  # a phrase repeated: the source model looping
        seen.add(key)
        out.append(q)
    return out


def compose(pool: list[str], seed: int) -> list[dict]:
    """One prompt per question in a seeded order, its form drawn by FORMS."""
    rng = random.Random(seed + 1)  # its own stream: the questions' order does not move the requests
    pool = list(pool)
    rng.shuffle(pool)
    rows = []
    for i, q in enumerate(pool):
        r = rng.random()
        form = next(name for name, bound in FORMS if r < bound)
        if form == "search":
            text = q[:-1].rstrip().lower()
        elif form == "instruction":
            text = rng.choice(INSTRUCTIONS).format(q=q)
        else:
            text = q
        rows.append({"id": f"fq{i:05d}", "prompt": text, "form": form})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_request_args(p, writes="the questions", requests=1500, max_new_tokens=48, seed=69)
    args = p.parse_args(argv)

    out = Path(args.out)
    asked = requests(args.requests, args.seed)
    try:
        sources = sources_path(out, asked)  # before the slow load
        seen: set[str] = set()
        pool: list[str] = []
        for _, text in source_answers(args, sources, asked, SCRIPT, {
                "source": "question-source",
                "built_from": [f"{SCRIPT} (FACT_TOPICS)", "scripts/make_training_prompts.py (TOPICS)"],
                "licence": "requests written for specula",
                "note": f"not training prompts: the requests {args.source_model} answered (greedy, "
                        f"{args.max_new_tokens} new tokens) to write the questions of {out.name}"}):
            pool += questions(text, seen)
    except SpeculaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = compose(pool, args.seed)
    kept, flagged = unflagged(rows)
    entry = {"source": "questions", "built_from": [sources.name],
             "licence": f"questions written by {args.source_model} on requests written for specula; "
                         "instructions written for specula",
             "requests": len(asked), "composed": len(rows), "dropped_benchmark": flagged,
             "forms": dict(Counter(r["form"] for r in kept))}
    write_made(out, args, SCRIPT, entry,
               [{"id": r["id"], "prompt": r["prompt"], "source": f"s69-question-{r['form']}"} for r in kept])
    return 0


if __name__ == "__main__":
    sys.exit(main())
