"""A training prompt set drawn from others: a seeded sample of N prompts from each source file
(`scripts/mix_prompts.py`), so one target can answer prompts another model wrote, and successive
mixes never repeat a prompt."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

from specula.errors import ConfigError
from specula.training.corpus import read_prompts


def mix_prompts(takes: Sequence[tuple[Path, int]], exclude: Sequence[Path] = (),
                seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(rows, sources): `rows` are {"id", "prompt", "source"} lines, N drawn without replacement
    from each (file, N) of `takes` (ids "<file stem>:<id>", unique across files), none of those
    already in an `exclude` mix; `sources` records per file its path, the prompts taken and held,
    and the sources its own manifest (<stem>.manifest.json) lists. Every prompt passes the
    benchmark check (`read_prompts`); a file short of prompts is a ConfigError."""
    seen = {pid.split(":", 1)[1] for f in exclude for pid, _ in read_prompts([f])}  # drop the mix's stem
    rows: list[dict] = []
    sources: list[dict] = []
    stems = [Path(path).stem for path, _ in takes]
    twice = sorted({stem for stem in stems if stems.count(stem) > 1})
    if twice:  # ids are "<stem>:<id>": two files of one name would give the mix one id twice
        raise ConfigError(f"two source files are named {twice[0]!r}: ids are made of file names, so rename "
                          "one (or copy it under another name)")
    for path, n in takes:
        path = Path(path)
        prompts = [(pid, text) for pid, text in read_prompts([path]) if pid not in seen]
        if n < 1 or n > len(prompts):
            raise ConfigError(f"{path} holds {len(prompts)} prompts not taken before; asked for {n}: ask for "
                              f"1 to {len(prompts)}")
        picked = random.Random(f"{seed}:{path.name}").sample(prompts, n)
        manifest = path.with_name(path.stem + ".manifest.json")
        own = json.loads(manifest.read_text(encoding="utf-8"))["sources"] if manifest.is_file() else []
        label = ",".join(s["source"] for s in own) or path.stem
        rows += [{"id": pid, "prompt": text, "source": label} for pid, text in picked]
        sources.append({"file": str(path), "taken": n, "held": len(prompts), "sources": own})
    return rows, sources
