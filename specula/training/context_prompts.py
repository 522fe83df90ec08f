"""Long-context training prompts built from the target's own answers: summaries, key points,
simplification, titles, translation, proofreading and questions over several documents.

Magpie prompts are short (a user message of up to ~120 words), while much of what users send a
deployed model carries a passage: a text to summarise, documents to answer from. A head trained
only on short prompts has never read positions past a few hundred tokens nor copied from a long
context. `compose` turns the target's own answers to earlier training prompts (the corpus
`specula train` caches) into such prompts: an instruction we wrote around one passage, or up to
`max_documents` passages as numbered documents with the question that produced one of them. No
dataset's text enters: the passages are the target's, the instructions are ours, and every
prompt still passes `specula train`'s benchmark check.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Sequence

ONE_PASSAGE = {
    "summary": "Summarize the following text in two or three sentences.\n\n{a}",
    "key_points": "What are the main points of the text below? Answer with a short list.\n\n{a}",
    "simplify": "Rewrite this text in simpler words, for someone new to the topic:\n\n{a}",
    "title": "Give the text below a short title, then say in one sentence what it is about.\n\n{a}",
    "translate": "Translate the following text into {language}.\n\n{a}",
    "proofread": "Correct any spelling or grammar mistakes in the text below and return the whole corrected text.\n\n{a}",
}
"""Instructions around one passage (`{a}`), by task name. `translate` and `proofread` are the
copy-heavy ones: a small target answers them by repeating much of the passage, which is what a head
has to learn to follow (prompt lookup copies such answers; a head that cannot is idle there)."""

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
"""Languages a `translate` prompt asks for (drawn per prompt)."""

DOCUMENTS = "Answer the question using the documents below.\n\n{documents}\n\nQuestion: {question}"
"""Several passages as numbered documents, then the question whose answer is one of them."""

TASKS = (*ONE_PASSAGE, "documents")
"""Every task."""

DEFAULT_TASKS = ("summary", "key_points", "simplify", "title", "documents")
"""The tasks `compose` cycles through by default (those of the shipped head's `context.jsonl`)."""


@dataclass(frozen=True)
class Passage:
    """One answer of the target, as text, with the prompt it answered."""

    question: str
    """The prompt the target answered."""
    text: str
    """The answer (cut back to its last full sentence when the answer was cut off)."""


def clean_passage(text: str, finished: bool, min_words: int = 40) -> str | None:
    """The answer as a passage: cut to its last full sentence when unfinished; None if under
    `min_words` words after that (too short to be a context worth reading)."""
    text = text.strip()
    if not finished:
        ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
        text = text[: ends[-1]] if ends else ""
    return text if len(text.split()) >= min_words else None


OPENER = re.compile(r"^(Sure|Certainly|Of course|Absolutely|Great|Yes)\b[^.!?:\n]*[.!?:]\s*")
"""An assistant's opening line ("Sure, I can help you plan the event!"), left out of a passage."""


def prose_passage(text: str, finished: bool, min_words: int = 40) -> str | None:
    """Another model's answer as a passage to summarise (`clean_passage`'s cut, then: None when it
    holds a code fence, its assistant opener and a list item cut after its number removed; None if
    under `min_words` words after that). Such passages are text the target did not write, which its
    head cannot guess and has to copy."""
    if "```" in text:
        return None
    text = clean_passage(text, finished, min_words)
    if text is None:
        return None
    text = re.sub(r"\n+\s*\d+\.$", "", OPENER.sub("", text)).strip()
    return text if len(text.split()) >= min_words else None


def check_tasks(tasks: Sequence[str]) -> None:
    """A ValueError naming the problem unless `tasks` is a non-empty list of names in `TASKS`."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"{'unknown context task(s) ' + ', '.join(unknown) if unknown else 'no context task given'}"
                         f"; the tasks are {', '.join(TASKS)}")


def compose(passages: Sequence[Passage], count: int, seed: int = 0, max_documents: int = 4,
            tasks: Sequence[str] = DEFAULT_TASKS, min_documents: int = 2,
            text_passages: tuple[int, int] = (1, 1)) -> list[dict]:
    """`count` prompts `{"id", "prompt", "task"}`, cycling through `tasks` (names in `TASKS`): a
    one-passage task wraps one text (each passage leads one per round; `translate` names a
    language drawn from `LANGUAGES`), `documents` lists `min_documents`..`max_documents` distinct
    passages in random order and asks the question that produced one of them. A text is one
    passage, or with `text_passages` = (lo, hi) the leading passage and lo - 1 .. hi - 1 others as
    paragraphs: long texts, of the length users paste (an article to summarise is 500-1,000
    tokens, a passage of 128-token answers a fifth of that). Deterministic given `seed` (the
    defaults draw what they drew before these options existed)."""
    check_tasks(tasks)
    lo, hi = text_passages
    if not 2 <= min_documents <= max(2, max_documents) or not 1 <= lo <= hi:
        raise ValueError(f"documents per prompt {min_documents}..{max_documents} and passages per text {lo}..{hi} "
                         "must be ranges of at least 2 and 1")
    need = max(2, max_documents, hi)
    if len(passages) < need:
        raise ValueError(f"composing needs at least {need} passages, got {len(passages)}")
    rng = random.Random(seed)
    order = list(range(len(passages)))
    rng.shuffle(order)
    out = []
    for i in range(count):
        task = tasks[i % len(tasks)]
        main = passages[order[i % len(order)]]
        if task == "documents":
            others = rng.sample([p for j, p in enumerate(passages) if j != order[i % len(order)]],
                                rng.randint(min_documents - 1, max_documents - 1))
            docs = [main, *others]
            rng.shuffle(docs)
            listed = "\n\n".join(f"Document {k}:\n{d.text}" for k, d in enumerate(docs, 1))
            prompt = DOCUMENTS.format(documents=listed, question=main.question)
        else:
            text = main.text
            if hi > 1:
                more = rng.sample([p for j, p in enumerate(passages) if j != order[i % len(order)]],
                                  rng.randint(lo - 1, hi - 1))
                text = "\n\n".join(p.text for p in [main, *more])
            if task == "translate":
                prompt = ONE_PASSAGE[task].format(a=text, language=rng.choice(LANGUAGES))
            else:
                prompt = ONE_PASSAGE[task].format(a=text)
        out.append({"id": f"c{i:06d}", "prompt": prompt, "task": task})
    return out
