"""Translation training prompts: source sentences in German, French and Spanish written by a
multilingual model of ours on the topics of scripts/make_training_prompts.py, asked to be
translated into English (docs/training.md, "A head that copies what it is asked to translate").

    python3 scripts/make_translation_prompts.py --source-model qwen2.5-coder-0.5b --requests 700 \
        --out specula/data/training/smollm2-135m/translate.jsonl

Writes OUT_STEM-sources.jsonl (the requests: "Schreibe zwei kurze Sätze ... über TOPIC", in the
three languages; labelled `s65-...` or `--label`, the round that made them), has the source model answer them greedily (the corpus cache `specula train`
writes: an earlier `specula train --target MODEL --data SOURCES --max-new-tokens N --stop-after
answers` is reused), splits the answers into sentences (list marks and quotes stripped; sentences of
6-45 words in the language asked for, no phrase of three words repeated, each once), and writes OUT
(JSONL {"id", "prompt", "source"}: one or two sentences under one of five instructions, "Translate
German to English: ..." the most common) and both files' manifests. No benchmark text is read;
prompts a benchmark check flags are dropped and counted.
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

SCRIPT = "scripts/make_translation_prompts.py"
REQUESTS = {
    "de": ["Schreibe zwei kurze Sätze für einen deutschen Nachrichtenartikel über {t}. Antworte nur auf Deutsch.",
           "Schreibe einen kurzen Absatz auf Deutsch über {t}, wie in einer Zeitung.",
           "Erkläre in zwei Sätzen auf Deutsch, was man über {t} wissen sollte.",
           "Schreibe eine kurze deutsche Meldung über {u}, in der {t} vorkommt. Nur auf Deutsch antworten.",
           "Beschreibe auf Deutsch in drei Sätzen eine Neuigkeit aus Sport, Wirtschaft oder Politik zum Thema {t}."],
    "fr": ["Écris deux phrases courtes en français pour un article de presse sur {t}.",
           "Écris un court paragraphe en français sur {t}."],
    "es": ["Escribe dos frases cortas en español para una noticia sobre {t}.",
           "Escribe un párrafo corto en español sobre {t}."],
}
"""Requests to the source model per language (`{t}`, `{u}`: topics)."""
SHARES = (("de", 0.7), ("fr", 0.85), ("es", 1.0))
"""Each language's upper bound on a request's uniform draw: 70% German, 15% French, 15% Spanish."""
MARKERS = {"de": {"der", "die", "das", "und", "ist", "ein", "eine", "nicht", "mit", "für", "auf", "sind", "werden", "wird"},
           "fr": {"le", "la", "les", "et", "est", "une", "des", "dans", "pour", "sur", "qui", "sont"},
           "es": {"el", "la", "los", "las", "y", "es", "una", "de", "en", "para", "que", "son"}}
"""Function words of each language: a sentence with fewer than two of them is not in the language asked."""
LANGUAGE = {"de": "German", "fr": "French", "es": "Spanish"}
INSTRUCTIONS = ["Translate {L} to English: {s}", "Translate {L} to English: {s}",
                "Translate the following {L} text into English: {s}", "Translate into English:\n\n{s}",
                "{s}\n\nTranslate this {L} sentence to English."]
"""The instructions a prompt is written with, drawn uniformly (the first twice as often), except that
half of the German prompts take the first."""


def requests(count: int, seed: int, label: str = "s65") -> list[dict]:
    """`count` source requests, languages by `SHARES`, topics drawn from TOPICS, sources labelled `label`."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        r = rng.random()
        lang = next(name for name, bound in SHARES if r < bound)
        t, u = rng.choice(TOPICS), rng.choice(TOPICS)
        rows.append({"id": f"src{i:05d}", "prompt": rng.choice(REQUESTS[lang]).format(t=t, u=u),
                     "source": f"{label}-source-{lang}"})
    return rows


def sentences(text: str, lang: str, seen: set[str]) -> list[str]:
    """The usable sentences of one answer (see the module docstring); adds them to `seen`."""
    out = []
    for part in re.split(r"(?<=[.!?])\s+|\n+", text):
        part = re.sub(r"^\s*(\d+\.|[-*•])\s*", "", part).strip().strip('"“”„').strip()
        words = part.split()
        if not 6 <= len(words) <= 45 or part in seen:
            continue
        grams = [tuple(words[j:j + 3]) for j in range(len(words) - 2)]
        if len(set(grams)) < len(grams):
            continue  # a phrase repeated: the source model looping
        if len({w.lower().strip(",.;:!?") for w in words} & MARKERS[lang]) < 2:
            continue  # not in the language asked for
        seen.add(part)
        out.append(part)
    return out


def compose(pool: list[tuple[str, str]], seed: int) -> list[dict]:
    """Prompts of one or two sentences (60% one) of one language each, in a seeded order."""
    rng = random.Random(seed + 1)  # its own stream: the sentences' order does not move the requests
    pool = list(pool)
    rng.shuffle(pool)
    rows, i = [], 0
    while pool:
        k = 1 if rng.random() < 0.6 else 2
        group, pool = pool[:k], pool[k:]
        lang = group[0][0]
        text = " ".join(s for l, s in group if l == lang)
        form = INSTRUCTIONS[0] if lang == "de" and rng.random() < 0.5 else rng.choice(INSTRUCTIONS)
        rows.append({"id": f"t{i:05d}", "prompt": form.format(L=LANGUAGE[lang], s=text), "lang": lang})
        i += 1
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_request_args(p, writes="the sentences (multilingual)", requests=700, max_new_tokens=96, seed=65)
    p.add_argument("--label", default="s65", help="the round named in every prompt's source (default s65, the first)")
    p.add_argument("--exclude", nargs="*", default=[], metavar="FILE",
                   help="prompt files of earlier rounds: a sentence any of their prompts holds is left out")
    args = p.parse_args(argv)

    from specula.training.corpus import read_prompts

    out = Path(args.out)
    asked = requests(args.requests, args.seed, args.label)
    try:
        sources = sources_path(out, asked)  # before the slow load
        lang_of = {f"{sources.stem}:{r['id']}": r["source"].rsplit("-", 1)[1] for r in asked}
        seen: set[str] = set()
        pool = []
        for prompt_id, text in source_answers(args, sources, asked, SCRIPT, {
                "source": "translation-source", "built_from": ["scripts/make_training_prompts.py (TOPICS)"],
                "licence": "requests written for specula (topics of scripts/make_training_prompts.py)",
                "languages": dict(Counter(lang_of.values())),
                "note": f"not SmolLM2 training prompts: the requests {args.source_model} answered (greedy, "
                        f"{args.max_new_tokens} new tokens) to write the sentences of {out.name}"}):
            lang = lang_of[prompt_id]
            pool += [(lang, s) for s in sentences(text, lang, seen)]
    except SpeculaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    earlier = "\n".join(text for _, text in read_prompts(args.exclude)) if args.exclude else ""
    fresh = [(lang, sentence) for lang, sentence in pool if sentence not in earlier]
    repeated = len(pool) - len(fresh)
    rows = compose(fresh, args.seed)
    kept, flagged = unflagged(rows)
    languages = Counter(r["lang"] for r in kept)
    entry = {"source": "translation", "built_from": [sources.name],
             "licence": f"sentences written by {args.source_model} on requests written for specula; "
                         "instructions written for specula",
             "requests": len(asked), "composed": len(rows), "dropped_benchmark": flagged,
             "dropped_earlier_rounds": repeated, "earlier_rounds": [Path(f).name for f in args.exclude],
             "languages": dict(languages)}
    write_made(out, args, SCRIPT, entry,
               [{"id": r["id"], "prompt": r["prompt"], "source": f"{args.label}-translate-{r['lang']}"} for r in kept])
    return 0


if __name__ == "__main__":
    sys.exit(main())
