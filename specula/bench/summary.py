"""Aggregates of benchmark run records (pure functions over the `runs` of results.json).

Rates are ratios of totals: tokens/s = total new tokens / total seconds; speedup = a method's
tokens/s over the baseline's tokens/s on the same prompts (decode_speedup: the same over the seconds
after each request's prefill, where the prefill was timed); mean accepted tokens = total
tokens per step over all steps (bonus token included: plain decoding = 1.00). With several
rounds (`bench --repeats`), those are over every round together, and `rounds` gives each round's
figures and their min / median / max.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

from specula.bench.methods import BASELINE
from specula.bench.peers import HF_BASELINE
from specula.stats import tokens_per_drafting_step


def _sum(values: Iterable[float | int | None]) -> float:
    return sum(v for v in values if v is not None)


def _ratio(num: float | None, den: float | None, digits: int = 4) -> float | None:
    if num is None or not den:
        return None
    return round(num / den, digits)


def _sum_lists(lists: Iterable[Sequence[int] | None]) -> list[int]:
    total: list[int] = []
    for values in lists:
        for i, v in enumerate(values or ()):
            if i == len(total):
                total.append(0)
            total[i] += v
    return total


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Totals and rates of a set of run records (one method; all prompts or one category)."""
    new_tokens = int(_sum(r["new_tokens"] for r in runs))
    seconds = _sum(r["seconds"] for r in runs)
    stepped = [r for r in runs if r.get("steps") is not None]
    steps = int(_sum(r["steps"] for r in stepped))
    emitted = _sum(sum(r["accepted_lengths"]) for r in stepped)
    drafted = _sum(r["drafted_tokens"] for r in stepped)
    proposed = _sum(r.get("proposed_tokens") for r in stepped)
    accepted = _sum(r["accepted_tokens"] for r in stepped)
    depth_drafted = _sum_lists(r["depth_drafted"] for r in stepped)
    depth_accepted = _sum_lists(r["depth_accepted"] for r in stepped)
    drafting_steps = int(depth_drafted[0]) if depth_drafted else 0  # steps whose verified tree had a node
    per_drafting = tokens_per_drafting_step(emitted, steps, drafting_steps)
    identical = [r["identical"] for r in runs if r.get("identical") is not None]
    timed = [r for r in stepped if r.get("time")]
    # the time after each request's prefill: where every output was timed with its prefill (older records lack it)
    prefilled = bool(runs) and len(timed) == len(runs) and all("prefill" in r["time"] for r in timed)
    prefill_s = _sum(r["time"]["prefill"] for r in timed) if prefilled else None
    draft_s = _sum(r["time"]["draft"] for r in timed)
    verify_s = _sum(r["time"]["verify"] for r in timed)
    timed_total = _sum(r["seconds"] for r in timed)
    memory = [r["memory_bytes"] for r in runs if r.get("memory_bytes") is not None]
    planned = [r for r in stepped if r.get("predicted_accepted")]
    judged = [r for r in stepped if r.get("paused_steps") is not None]  # requests a planner with a back-off ran
    judged_steps = _sum(r["steps"] for r in judged)
    planned_steps = _sum(r["steps"] for r in planned)
    return {
        "outputs": len(runs),
        "prompts": len({r["id"] for r in runs}),
        "new_tokens": new_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": _ratio(new_tokens, seconds, 3) if runs else None,
        "speedup": None,
        "prefill_fraction": _ratio(prefill_s, seconds) if prefilled and seconds else None,
        "decode_seconds": round(seconds - prefill_s, 4) if prefilled else None,
        "decode_speedup": None,
        "speedup_vs_hf": None,
        "mean_accepted_tokens": _ratio(emitted, steps) if steps else None,
        "mean_accepted_per_drafting_step": None if per_drafting is None else round(per_drafting, 4),
        "drafting_step_fraction": _ratio(drafting_steps, steps) if steps else None,
        "paused_step_fraction": _ratio(_sum(r["paused_steps"] for r in judged), judged_steps) if judged_steps else None,
        "held_step_fraction": _held_fractions(stepped),
        "predicted_mean_accepted_tokens": _ratio(_sum(r["predicted_accepted"] for r in planned), planned_steps)
        if planned_steps else None,
        "acceptance_rate": _ratio(accepted, drafted) if stepped else None,
        "acceptance_by_depth": [round(a / d, 4) if d else None for a, d in zip(depth_accepted, depth_drafted)]
        if stepped else None,
        "identical_fraction": round(sum(identical) / len(identical), 4) if identical else None,
        "schema_valid_fraction": _fraction([r.get("schema_valid") for r in runs]),
        "time_split": {
            "draft": _ratio(draft_s, timed_total),
            "verify": _ratio(verify_s, timed_total),
            "other": _ratio(max(0.0, timed_total - draft_s - verify_s), timed_total),
        } if timed and timed_total else None,
        "draft_ms_per_step": round(1000 * draft_s / steps, 4) if timed and steps else None,
        "verify_ms_per_step": round(1000 * verify_s / steps, 4) if timed and steps else None,
        "draft_ms_per_proposed_token": _ratio(1000 * draft_s, proposed) if timed and proposed else None,
        "draft_fraction_of_plain_step": None,
        "draft_fraction_of_plain_step_per_token": None,
        "memory_bytes": max(memory) if memory else None,
    }


def _rate(entry: dict[str, Any] | None) -> float | None:
    """Tokens per second of an aggregate, from its totals (not its rounded `tokens_per_s`)."""
    return entry["new_tokens"] / entry["seconds"] if entry and entry.get("seconds") else None


def _decode_rate(entry: dict[str, Any] | None) -> float | None:
    """Tokens per second after each request's prefill, from the totals (None where the prefill was not timed)."""
    return entry["new_tokens"] / entry["decode_seconds"] if entry and entry.get("decode_seconds") else None


def _set_speedups(entry: dict[str, Any], base: dict[str, Any] | None, hf: dict[str, Any] | None) -> None:
    rate = _rate(entry)
    entry["speedup"] = _ratio(rate, _rate(base)) if base else None
    # the same ratio over the time after each prompt's prefill, which every method spends alike: on long prompts
    # (Spec-Bench's summaries and RAG) it is half of plain decoding's time and dilutes `speedup`
    entry["decode_speedup"] = _ratio(_decode_rate(entry), _decode_rate(base)) if base else None
    entry["speedup_vs_hf"] = _ratio(rate, _rate(hf)) if hf else None
    plain_step = base.get("verify_ms_per_step") if base else None  # one plain target step, same prompts
    entry["draft_fraction_of_plain_step"] = _ratio(entry.get("draft_ms_per_step"), plain_step)
    entry["draft_fraction_of_plain_step_per_token"] = _ratio(entry.get("draft_ms_per_proposed_token"), plain_step)


def summarize(runs: Sequence[dict[str, Any]], methods: Sequence[dict[str, Any]],
              categories: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`summary` of results.json: per method (in `methods` order), overall and by category.

    methods: [{"name", "kind", "lossless"}]; speedups are against `none` and `hf:greedy`
    on the same outputs' categories (None where the reference did not run)."""
    summary: dict[str, dict[str, Any]] = {}
    for method in methods:
        name = method["name"]
        mine = [r for r in runs if r["method"] == name]
        entry = aggregate(mine)
        entry["kind"] = method["kind"]
        entry["lossless"] = method["lossless"]
        entry["by_category"] = {c: aggregate([r for r in mine if r["category"] == c])
                                for c in categories if any(r["category"] == c for r in mine)}
        summary[name] = entry
    base, hf = summary.get(BASELINE), summary.get(HF_BASELINE)
    for entry in summary.values():
        _set_speedups(entry, base, hf)
        for category, sub in entry["by_category"].items():
            _set_speedups(sub, base["by_category"].get(category) if base else None,
                          hf["by_category"].get(category) if hf else None)
    spreads = round_spreads(runs, [m["name"] for m in methods])
    for name, entry in summary.items():
        entry["rounds"] = spreads.get(name)
    return summary


ROUND_KEYS = ("speedup", "tokens_per_s", "mean_accepted_tokens")
"""The figures `round_spreads` gives per round."""


def round_spreads(runs: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, dict[str, Any] | None]:
    """Per method, each round's `ROUND_KEYS` (a round's speedup: its tokens/s over `none`'s in the
    same round) as {count, key: {min, median, max, values}, partial}; None for every method when the
    runs hold fewer than two whole rounds (records without a `round` are round 1). A round that did
    not run every prompt (an interrupted run's last) is left out, its number listed in `partial`: one
    prompt's figures read as a round's."""
    numbers = sorted({r.get("round", 1) for r in runs})
    covered = {n: {r["id"] for r in runs if r.get("round", 1) == n} for n in numbers}
    everyone = set().union(*covered.values())
    rounds = [n for n in numbers if covered[n] == everyone]
    partial = [n for n in numbers if n not in rounds]
    if len(rounds) < 2:
        return {name: None for name in names}
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for number in rounds:
        mine = [r for r in runs if r.get("round", 1) == number]
        entries = {name: aggregate(own) for name in names if (own := [r for r in mine if r["method"] == name])}
        for name in names:
            entry = entries.get(name)
            if entry is not None:
                _set_speedups(entry, entries.get(BASELINE), None)
            per_round[name].append({key: entry[key] if entry else None for key in ROUND_KEYS})
    return {name: {"count": len(rounds), **{key: _spread([r[key] for r in figures]) for key in ROUND_KEYS},
                   "partial": partial}
            for name, figures in per_round.items()}


def _spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    """{min, median, max, values} of per-round figures (the median of the known ones); None when
    no round has one."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"min": min(known), "median": round(statistics.median(known), 4), "max": max(known),
            "values": list(values)}


def first_difference(reference: Sequence[int], output: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(reference, output)):
        if a != b:
            return i
    return None if len(reference) == len(output) else min(len(reference), len(output))


def _fraction(flags) -> float | None:
    """Share of True among the flags that are not None (None when all are)."""
    known = [bool(f) for f in flags if f is not None]
    return round(sum(known) / len(known), 4) if known else None


def _held_fractions(runs: list[dict]) -> dict[str, float] | None:
    """Per drafter, the share of steps it sat out in the planner's hold-back, over the requests whose
    planner counted them (`held_steps`); None where no such request ran; drafters never held left out."""
    judged = [r for r in runs if r.get("held_steps") is not None]
    steps = _sum(r["steps"] for r in judged)
    if not steps:
        return None
    held: dict[str, int] = {}
    for r in judged:
        for name, n in r["held_steps"].items():
            held[name] = held.get(name, 0) + n
    return {name: _ratio(n, steps) for name, n in sorted(held.items()) if n}
