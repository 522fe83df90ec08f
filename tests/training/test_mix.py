"""Mixed prompt sets: N prompts from each source, deterministic by seed, never a prompt of an
excluded earlier mix, the sources' manifests carried, benchmark prompts still refused."""

from __future__ import annotations

import json

import pytest

from specula.errors import ConfigError
from specula.training.mix import mix_prompts


def write(path, n, prefix, manifest=None):
    path.write_text("".join(json.dumps({"id": f"m{i:03d}", "prompt": f"{prefix} prompt number {i} about things"}) + "\n"
                            for i in range(n)))
    if manifest is not None:
        path.with_name(path.stem + ".manifest.json").write_text(json.dumps({"sources": manifest}))
    return path


def test_mix_takes_n_from_each_file_with_their_sources(tmp_path):
    a = write(tmp_path / "a.jsonl", 30, "alpha", manifest=[{"source": "magpie:x", "licence": "of x"}])
    b = write(tmp_path / "b.jsonl", 10, "beta")
    rows, sources = mix_prompts([(a, 12), (b, 10)], seed=1)
    assert len(rows) == 22 and len({r["id"] for r in rows}) == 22
    assert sum(r["id"].startswith("a:") for r in rows) == 12
    assert all(r["prompt"].startswith("alpha") == r["id"].startswith("a:") for r in rows)
    assert {r["source"] for r in rows} == {"magpie:x", "b"}
    assert sources[0] == {"file": str(a), "taken": 12, "held": 30, "sources": [{"source": "magpie:x", "licence": "of x"}]}
    assert mix_prompts([(a, 12), (b, 10)], seed=1)[0] == rows
    assert mix_prompts([(a, 12), (b, 10)], seed=2)[0] != rows


def test_mix_never_repeats_an_excluded_mix(tmp_path):
    a = write(tmp_path / "a.jsonl", 30, "alpha")
    first, _ = mix_prompts([(a, 20)])
    (tmp_path / "mix1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    second, sources = mix_prompts([(a, 10)], exclude=[tmp_path / "mix1.jsonl"])
    assert {r["id"] for r in first} & {r["id"] for r in second} == set()
    assert sources[0]["held"] == 10
    with pytest.raises(ConfigError, match="holds 10 prompts not taken before"):
        mix_prompts([(a, 11)], exclude=[tmp_path / "mix1.jsonl"])


def test_mix_refuses_a_source_with_a_benchmark_prompt(tmp_path):
    from tests.training.test_contamination import spec_bench
    a = write(tmp_path / "a.jsonl", 5, "alpha")
    a.write_text(a.read_text() + json.dumps({"id": "bad", "prompt": spec_bench(300)["turns"][0]}) + "\n")
    with pytest.raises(ConfigError, match="Spec-Bench"):
        mix_prompts([(a, 2)])


def test_two_sources_of_one_file_name_are_refused(tmp_path):
    """Ids are "<file stem>:<id>": two files named alike would give the mix one id twice (and the
    mix it wrote could not be read)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one, two = write(tmp_path / "a" / "prompts.jsonl", 5, "alpha"), write(tmp_path / "b" / "prompts.jsonl", 5, "beta")
    with pytest.raises(ConfigError, match="two source files are named 'prompts'"):
        mix_prompts([(one, 2), (two, 2)])
