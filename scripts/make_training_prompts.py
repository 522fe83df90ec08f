"""Write specula/data/training/prompts.jsonl: the prompts the shipped trained drafters learn from.

Every prompt is written here, by templates over topics and facts this script lists, plus
documents taken from the docstrings of Python's standard library (PSF License 2.0, shipped
with every Python): no benchmark's prompts or answers. The target model writes the answers
itself (`specula train` generates them), so the heads learn what the target says.

    python scripts/make_training_prompts.py            # deterministic (seed 0)
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
from pathlib import Path

TOPICS = """photosynthesis; black holes; the water cycle; compound interest; the French Revolution; plate tectonics;
vaccines; machine learning; the stock market; climate change; the immune system; electric cars; the printing press;
DNA replication; the Roman Empire; inflation; volcanoes; the internet; coral reefs; sleep; the moon landing;
renewable energy; blockchains; the human heart; the Renaissance; gravity; bees and pollination; supply and demand;
earthquakes; the Silk Road; antibiotics; quantum computing; the ozone layer; the Industrial Revolution; memory;
rainbows; nuclear fission; tides; the Great Wall of China; neural networks; recycling; the solar system; ocean currents;
democracy; coffee; the periodic table; jazz music; glaciers; credit scores; meditation; the Olympic Games; bridges;
batteries; migration of birds; the theory of evolution; public libraries; tea ceremonies; chess openings; wind turbines;
the Cold War; mushrooms; 3D printing; time zones; the metric system; volunteering; urban gardening; the Amazon rainforest;
honeybees; submarines; telescopes; the Pythagorean theorem; prime numbers; probability; cryptography; deserts;
the human brain; dinosaurs; composting; minimalism; remote work; public speaking; budgeting; first aid; hiking safety;
baking bread; learning a language; photography; marathon training; houseplants; saving for retirement; cloud computing;
open-source software; databases; operating systems; compilers; sorting algorithms; unit testing; version control;
Mount Everest; the Nile river; penguins; wolves; the Eiffel Tower; the Moon's phases; northern lights; hurricanes""".split(";")
TOPICS = [t.strip() for t in TOPICS if t.strip()]

EXPLAIN = ["Explain {t} in simple terms.", "What is {t}? Give a short explanation.", "Give me three interesting facts about {t}.",
           "Write a short paragraph about {t} for a school newsletter.", "What are the main advantages and disadvantages of {t}?",
           "How would you explain {t} to a ten-year-old?", "Write a haiku about {t}.", "Summarize the history of {t} in a few sentences.",
           "List five questions a student might ask about {t}, with brief answers.", "Write a short persuasive essay on why people should learn about {t}.",
           "Compare {t} and {u}.", "Write a blog post introduction about {t}.", "What are common misconceptions about {t}?",
           "Write a dialogue between a teacher and a student about {t}.", "Create a short quiz with answers about {t}."]

CHAT = ["I'm feeling stressed about my exams next week. Any advice?", "Can you suggest a name for my new puppy? She is small and very energetic.",
        "What should I pack for a weekend camping trip?", "How do I politely decline a wedding invitation?",
        "Write a thank-you note to my neighbour who watered my plants.", "Plan a three-day trip to a city by the sea.",
        "What are some healthy breakfast ideas that take under ten minutes?", "Help me write an email asking my manager for a day off.",
        "Suggest a weekly workout plan for a beginner.", "What is a good way to start reading more books?",
        "Write a short bedtime story about a brave little turtle.", "How can I improve my handwriting?",
        "Give me tips for a first job interview.", "What games can a family play on a rainy afternoon?",
        "Write a product description for a reusable water bottle.", "How do I make my small apartment feel bigger?",
        "Write a limerick about a cat who loves cheese.", "Suggest five creative birthday gift ideas for a friend who likes cooking.",
        "Draft a short speech for my sister's graduation.", "What should I consider when buying a used bicycle?",
        "Roleplay as a tour guide welcoming visitors to an old castle.", "Pretend you are a pirate and describe your ship.",
        "Write a motivational message for a team that just lost a big game.", "Rewrite this sentence to sound more formal: hey, can u send me the file asap?",
        "Give me a recipe for a simple vegetable soup.", "Help me organise my week: I have work, a gym habit and a course to study for."]

CODE = ["Write a Python function that checks whether a string is a palindrome.", "Write a Python function to compute the n-th Fibonacci number iteratively.",
        "Write a Python function that interleaves two lists element by element.", "Write a Python class for a simple bank account with deposit and withdraw methods.",
        "Write a Python function that counts the words in a text file.", "Write a function in JavaScript that removes duplicates from an array.",
        "Write a SQL query that lists the products that have never been ordered.", "Write a Python function that flattens a nested list.",
        "Write a bash script that backs up a directory into a dated tar.gz file.", "Explain what a Python decorator is, with an example.",
        "Write a Python function that returns the prime numbers below n using the sieve of Eratosthenes.",
        "Write a C function that reverses a string in place.", "Write a Python function that parses a CSV line and handles quoted fields.",
        "Write unit tests with pytest for a function add(a, b).", "Explain the difference between a list and a tuple in Python.",
        "Write a Python generator that yields the lines of a file that contain a given word.",
        "Write a binary search in Python and explain its complexity.", "Write a Python function to transpose a matrix given as a list of lists.",
        "How do I read a JSON file in Python and print one of its keys?", "Write a recursive function that computes the depth of a binary tree.",
        "Write a Python script that renames all .txt files in a folder to .md.", "Explain big-O notation with two examples.",
        "Write a Rust function that sums the even numbers of a vector.", "Write a Python function that validates an email address with a regular expression.",
        "Write a Python dataclass for a book with title, author and year, and sort a list of books by year."]

NAMES = ["Anna", "Ben", "Carlos", "Dina", "Emil", "Fatima", "George", "Hana", "Ivan", "Julia", "Kofi", "Lena", "Mateo", "Nora"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "cards", "balloons", "oranges"]

GERMAN = ["Das Wetter ist heute sehr schön, und wir gehen in den Park.", "Ich habe gestern ein interessantes Buch über Geschichte gelesen.",
          "Der Zug nach Berlin hat leider zwanzig Minuten Verspätung.", "Könnten Sie mir bitte sagen, wo der Bahnhof ist?",
          "Meine Schwester arbeitet als Ärztin in einem großen Krankenhaus.", "Wir sollten mehr Energie sparen, um die Umwelt zu schützen.",
          "Die Regierung hat neue Regeln für den Straßenverkehr beschlossen.", "Am Wochenende besuchen wir unsere Großeltern auf dem Land.",
          "Das Museum ist montags geschlossen, aber dienstags kostenlos.", "Nach dem Essen trinken viele Menschen einen Kaffee.",
          "Die Firma plant, im nächsten Jahr hundert neue Mitarbeiter einzustellen.", "Kinder lernen Sprachen oft schneller als Erwachsene.",
          "Der Fluss ist nach dem starken Regen über die Ufer getreten.", "Ich möchte gern ein Zimmer für zwei Nächte reservieren.",
          "Die Mannschaft hat das Spiel in der letzten Minute gewonnen.", "Viele Studenten wohnen in kleinen Wohnungen in der Stadtmitte."]
FRENCH = ["Le marché ouvre tous les samedis matin sur la place du village.", "Nous avons visité un château magnifique pendant les vacances.",
          "Il faut arroser les plantes deux fois par semaine.", "La bibliothèque propose des ateliers gratuits pour les enfants.",
          "Mon frère apprend à jouer de la guitare depuis six mois.", "Le restaurant au coin de la rue sert une excellente soupe."]
ENGLISH = ["The meeting has been moved to Thursday afternoon.", "Please remember to close the windows before you leave.",
           "Our team finished the project two days ahead of schedule.", "The children built a sandcastle on the beach.",
           "This recipe needs three eggs and a cup of flour.", "The new library will open to the public next spring."]


def math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 30), rng.randint(2, 9)
    n1, n2 = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    forms = [f"{n1} has {a} {item}. {n1} gives {b} to {n2} and then buys {c} times as many as {n1} has left. How many {item} does {n1} have now? Think step by step.",
             f"A shop sells {item} at {c} dollars each. {n1} buys {a} and pays with a {a * c + b} dollar note. How much change does {n1} get? Explain your reasoning.",
             f"{n1} reads {b} pages a day. The book has {a * b + c} pages. How many days does {n1} need to finish it? Show your work.",
             f"A train travels {a * c} kilometres in {c} hours. At the same speed, how far does it travel in {b} hours? Solve step by step.",
             f"{n1} and {n2} share {a * 2} {item} so that {n1} gets {b % a + 1} more than {n2}. How many does each get? Explain.",
             f"What is {a} multiplied by {b}, minus {c}? Show each step.",
             f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?"]
    return rng.choice(forms)


def stdlib_documents(rng: random.Random, count: int) -> list[tuple[str, str]]:
    """(name, docstring) pairs of standard-library functions and classes with substantial docstrings."""
    modules = ["json", "os.path", "collections", "itertools", "functools", "string", "textwrap", "shutil", "random",
               "statistics", "datetime", "pathlib", "heapq", "bisect", "csv", "re", "subprocess", "argparse", "logging",
               "threading", "tempfile", "zipfile", "urllib.parse", "difflib", "fractions", "decimal", "calendar"]
    docs = []
    for name in modules:
        mod = importlib.import_module(name)
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            doc = inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isclass(obj)) else None
            if doc and 200 <= len(doc) <= 1500 and getattr(obj, "__module__", "").split(".")[0] == name.split(".")[0]:
                docs.append((f"{name}.{attr}", doc))
    rng.shuffle(docs)
    return docs[:count]


NEAR_BENCHMARK = frozenset({
    "Rewrite this sentence to sound more formal: hey, can u send me the file asap?",  # everyday e07's paraphrase
    "Write a Python function to compute the n-th Fibonacci number iteratively.",  # everyday e13's paraphrase
})
"""Prompts of the lists above that paraphrase a prompt of the bench's everyday set (word overlap
0.48 and 0.62; found in session 104): left out of the file after the shuffle, so the others keep
their ids and order. The heads shipped before were trained with them."""


def main() -> None:
    rng = random.Random(0)
    prompts: list[dict] = []

    def add(category: str, text: str) -> None:
        prompts.append({"id": f"t{len(prompts):04d}", "category": category, "turns": [text]})

    for t in TOPICS:
        for form in rng.sample(EXPLAIN, 3):
            add("explain", form.format(t=t, u=rng.choice(TOPICS)))
    for text in CHAT:
        add("chat", text)
    for text in CODE:
        add("code", text)
    for _ in range(90):
        add("math", math_prompt(rng))
    for s in GERMAN:
        add("translate", f"Translate German to English:\n\n{s}")
    for s in FRENCH:
        add("translate", f"Translate French to English:\n\n{s}")
    for s in ENGLISH:
        add("translate", f"Translate to German: {s}")
        add("translate", f"Translate to French: {s}")
    for name, doc in stdlib_documents(rng, 120):
        short = name.rsplit(".", 1)[-1]
        form = rng.choice([f"Summarize the following documentation in two or three sentences.\n\n{doc}",
                           f"Read the documentation below and answer the question.\n\n{doc}\n\nQuestion: what does {short} do, and what arguments does it take?",
                           f"Here is the documentation of {short}:\n\n{doc}\n\nWrite a short example of how to use it.",
                           f"Extract the key points of this text as a bullet list.\n\n{doc}"])
        add("documents", form)
    rng.shuffle(prompts)
    prompts = [p for p in prompts if p["turns"][0] not in NEAR_BENCHMARK]
    out = Path(__file__).resolve().parents[1] / "specula" / "data" / "training" / "prompts.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    os.replace(tmp, out)
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p["category"]] = counts.get(p["category"], 0) + 1
    print(f"{len(prompts)} prompts -> {out}: {counts}")


if __name__ == "__main__":
    main()
