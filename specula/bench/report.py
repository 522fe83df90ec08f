"""results.json (the document) and report.md (its tables), both written atomically.

The schema is documented in docs/bench.md; bump SCHEMA_VERSION when a key changes meaning.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from specula.bench.machine import machine_line
from specula.bench.methods import BASELINE
from specula.bench.peers import HF_BASELINE
from specula.bench.summary import summarize
from specula.models.loading import DraftInfo
from specula.paths import atomic_write_json, atomic_write_text

SCHEMA_VERSION = 1
RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def build_document(
    header: dict[str, Any], runs: Sequence[dict[str, Any]], mismatches: Sequence[dict[str, Any]],
    *, prompts_done: int, prompts_total: int, status: str,
) -> dict[str, Any]:
    """The results.json document. header: methods, categories, greedy, machine, config,
    cost_curve, started_at (fixed for the run)."""
    return {
        "schema_version": SCHEMA_VERSION,
        **header,
        "status": status,
        "prompts_done": prompts_done,
        "prompts_total": prompts_total,
        "updated_at": now_iso(),
        "summary": summarize(runs, header["methods"], header["categories"]),
        "mismatches": list(mismatches),
        "runs": list(runs),
    }


def write_results(out_dir: str | Path, document: dict[str, Any]) -> Path:
    # Compact JSON: the runs hold every output's token ids.
    return atomic_write_json(Path(out_dir) / RESULTS_FILE, document, indent=None)


# --------------------------------------------------------------------------- markdown


def _num(value: float | int | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _bytes(value: int | None) -> str:
    from specula.paths import format_bytes

    return format_bytes(value) if value is not None else "-"


def _prediction(e: dict[str, Any] | None) -> str:
    if not e or not e.get("predicted_mean_accepted_tokens") or not e.get("mean_accepted_tokens"):
        return "-"
    predicted, realized = e["predicted_mean_accepted_tokens"], e["mean_accepted_tokens"]
    return f"{predicted:.2f} / {realized:.2f} ({100 * (predicted - realized) / realized:+.0f}%)"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _label(name: str, entry: dict[str, Any]) -> str:
    return name if entry.get("lossless", True) or entry.get("kind") != "specula" else f"{name} (LOSSY)"


def _split(entry: dict[str, Any]) -> str:
    split = entry.get("time_split")
    if not split:
        return "-"
    return f"{_pct(split['draft'])} / {_pct(split['verify'])} / {_pct(split['other'])}"


def ordered(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, summary entry) in the run's method order (JSON files sort the summary's keys)."""
    return [(m["name"], doc["summary"][m["name"]]) for m in doc["methods"] if m["name"] in doc["summary"]]


def _matrix(entries: Sequence[tuple[str, dict[str, Any]]], categories: Sequence[str], key: str, fmt) -> list[str]:
    rows = []
    for name, entry in entries:
        cells = [fmt(entry.get(key))]
        cells += [fmt(entry["by_category"][c].get(key)) if c in entry["by_category"] else "-" for c in categories]
        rows.append([_label(name, entry), *cells])
    return _table(["method", "overall", *categories], rows)


def _round_lines(entries: Sequence[tuple[str, dict[str, Any]]], fresh: bool = True) -> list[str]:
    """The table of each method's figures across rounds (`bench --repeats`); nothing for one round.
    `fresh`: each round's methods were built afresh (else what they learned carried over)."""
    rounded = [(name, e) for name, e in entries if e.get("rounds")]
    if not rounded:
        return []

    def cell(spread: dict[str, Any] | None, fmt) -> str:
        return "-" if not spread else " / ".join(fmt(spread[k]) for k in ("min", "median", "max"))

    count = rounded[0][1]["rounds"]["count"]
    partial = rounded[0][1]["rounds"].get("partial") or []
    built = ("on methods built afresh (nothing a drafter or an assisted peer's schedule learned in an earlier "
             "round carried over)" if fresh else
             "on the same methods (what their drafters learned in earlier rounds carried over)")
    lines = ["", f"## Across {count} rounds", "",
             f"Each round ran every prompt again {built}, after its own warm-up; a round's speedup is its "
             "tokens/s over `none`'s in the same round. Cells are min / median / max over the rounds; the "
             "tables above are over all rounds together."
             + (f" Round {', '.join(map(str, partial))} did not run every prompt (the run was interrupted) and is "
                "left out here." if partial else ""), ""]
    return lines + _table(["method", f"speedup vs {BASELINE}", "tokens/s", "mean accepted"],
                          [[_label(name, e), cell(e["rounds"]["speedup"], _x), cell(e["rounds"]["tokens_per_s"], _num),
                            cell(e["rounds"]["mean_accepted_tokens"], _num)] for name, e in rounded])


def render_markdown(doc: dict[str, Any]) -> str:
    """report.md: setup, overall table, per-category tables, acceptance by depth, cost curve."""
    cfg, categories = doc["config"], doc["categories"]
    entries = ordered(doc)
    ran = {**cfg, **doc.get("run", {})}  # what the run used (older results: the command line's config)
    sampling = "greedy (temperature 0)" if doc["greedy"] else (
        f"sampling (temperature {ran.get('temperature')}, top-k {ran.get('top_k')}, top-p {ran.get('top_p')})")
    penalties = [f"{name.replace('_', ' ')} {ran[name]}" for name, off in
                 (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0))
                 if ran.get(name, off) != off]
    if ran.get("logit_bias"):
        penalties.append(f"logit bias {ran['logit_bias']}")
    if penalties:
        sampling += ", " + ", ".join(penalties)
    status = {"complete": "complete", "running": "running",
              "interrupted": "INTERRUPTED: partial results"}.get(doc["status"], doc["status"])
    lines = [
        "# specula bench",
        "",
        f"- target `{cfg.get('target')}`" + (f", draft `{cfg['draft']}`" if cfg.get("draft") else "")
        + _backend_line(doc, cfg),
        *_drafts_lines(doc["methods"]),
        f"- prompts: {cfg.get('prompts')}, {doc['prompts_done']} of {doc['prompts_total']} done ({status})"
        + (f" in {doc['repeats']} rounds" if doc.get("repeats", 1) > 1 else "")
        + f"; categories: {', '.join(categories)}",
        f"- {sampling}, max {ran.get('max_new_tokens')} new tokens, "
        + (f"at least {ran['min_new_tokens']}, " if ran.get("min_new_tokens") else "")
        + ("EOS ignored (fixed budget)" if ran.get("ignore_eos") else "stop at EOS")
        + f", seed {ran.get('seed')}",
        f"- machine: {machine_line(doc['machine'])}",
        *_load_lines(doc),
        f"- started {doc.get('started_at')}, updated {doc.get('updated_at')}",
        "",
        "Speedups are ratios of tokens/s (total new tokens / total seconds, prefill included) measured in the "
        "same run (`after the prefill`: over the seconds after each request's prefill, which every method spends "
        "alike; `prefill share`: the prefill's part of a method's time): "
        f"against specula's plain decoding (`{BASELINE}`) and against `{HF_BASELINE}` "
        "(Hugging Face `generate`). Methods are interleaved per prompt"
        + (" after one warm-up each (an untimed prompt of its own)." if ran.get("warmup_tokens", 1) else
           ", without warm-up (`--warmup-tokens 0`): the first method timed runs cold."),
        "",
        "## Overall",
        "",
    ]
    rows = []
    for name, e in entries:
        rows.append([
            _label(name, e), _num(e["tokens_per_s"]), _x(e["speedup"]), _x(e.get("decode_speedup")),
            _pct(e.get("prefill_fraction")), _x(e["speedup_vs_hf"]),
            _num(e["mean_accepted_tokens"]), _num(e.get("mean_accepted_per_drafting_step")),
            _pct(e["identical_fraction"]), _num(e["draft_ms_per_step"]),
            _num(e.get("draft_fraction_of_plain_step_per_token"), "{:.3f}"), _split(e), _bytes(e["memory_bytes"]),
            str(e["outputs"]),
        ])
    lines += _table(["method", "tokens/s", f"speedup vs {BASELINE}", "after the prefill", "prefill share",
                     f"vs {HF_BASELINE}", "mean accepted",
                     "per drafting step", "identical", "draft ms/step", "draft per token / plain step",
                     "time draft/verify/other", "drafter memory", "outputs"], rows)
    lines += _round_lines(entries, ran.get("fresh_rounds", True))
    lines += ["", f"## Speedup vs `{BASELINE}` by category", ""]
    lines += _matrix(entries, categories, "speedup", _x)
    if any(e["speedup_vs_hf"] is not None for _, e in entries):
        lines += ["", f"## Speedup vs `{HF_BASELINE}` by category", ""]
        lines += _matrix(entries, categories, "speedup_vs_hf", _x)
    lines += ["", "## Tokens/s by category", ""]
    lines += _matrix(entries, categories, "tokens_per_s", _num)
    lines += ["", "## Mean accepted tokens by category", ""]
    lines += _matrix(entries, categories, "mean_accepted_tokens", _num)
    if any(e.get("mean_accepted_per_drafting_step") for _, e in entries):
        lines += ["", "## Mean accepted tokens per drafting step by category", "",
                  "Tokens per step on the steps that verified a draft; the planner's plain steps (no tree paid, "
                  "or drafting paused) are left out (`drafting_step_fraction` in results.json). EAGLE's tau "
                  "drafts on every step, so on text where the planner declines to draft this reads above it.",
                  ""]
        lines += _matrix(entries, categories, "mean_accepted_per_drafting_step", _num)
    if any(e.get("paused_step_fraction") for _, e in entries):
        lines += ["", "## Steps paused by the back-off by category", "",
                  "The share of steps a request sat out in the planner's back-off pause (its drafting steps had "
                  "realised less than plain steps on this text; probes after 1, 2, 4, ... steps). The other plain "
                  "steps are the planner's: no tree paid. On text where drafting pays about what it costs, which "
                  "way the first steps fall moves this share, and the speed, from run to run.",
                  ""]
        lines += _matrix(entries, categories, "paused_step_fraction", _pct)
    planned = [(n, e) for n, e in entries if e.get("predicted_mean_accepted_tokens")]
    if planned:
        lines += ["", "## Planner: predicted vs realized mean accepted tokens", "",
                  "The planner's expected tokens per step (bonus included) for the trees it chose, against what the "
                  "target accepted; cells are predicted / realized (error).", ""]
        lines += _table(["method", "overall", *categories],
                        [[n, _prediction(e), *(_prediction(e["by_category"].get(c)) for c in categories)]
                         for n, e in planned])
    if doc["greedy"]:
        lines += ["", "## Outputs identical to plain greedy decoding, by category", ""]
        lines += _matrix(entries, categories, "identical_fraction", _pct)
    depth_rows = [(n, e["acceptance_by_depth"]) for n, e in entries if e.get("acceptance_by_depth")]
    if depth_rows:
        depth = min(8, max(len(d) for _, d in depth_rows))
        lines += ["", "## Acceptance by depth", "",
                  "P(the node at depth d is accepted | the proposal reached depth d).", ""]
        lines += _table(["method", *(f"d{d + 1}" for d in range(depth))],
                        [[n, *(_pct(d[i]) if i < len(d) else "-" for i in range(depth))] for n, d in depth_rows])
    curve = doc.get("cost_curve")
    if curve:
        lines += ["", f"## Target cost curve (context {curve['context']}, median of {curve['repeats']})", "",
                  "Latency of one verification pass of n tokens (root + n-1 draft nodes) relative to a plain step.", ""]
        lines += _table(["tokens", *map(str, curve["sizes"])],
                        [["ms", *(f"{1000 * s:.1f}" for s in curve["seconds"])],
                         ["ratio", *(f"{r:.2f}" for r in curve["ratio"])]])
    if doc["mismatches"]:
        guarantee = doc.get("greedy_guarantee")
        note = (" (expected here: the target runs with guarantee 'near-ties', reduced-precision verification "
                "can flip near-tied tokens)" if guarantee == "near-ties" else "")
        lines += ["", f"## Outputs that differ from plain decoding (lossless methods){note}", ""]
        lines += _table(["method", "prompt", "category", "turn", "first different token", "logit gap"],
                        [[m["method"], str(m["id"]), m["category"], str(m["turn"]), str(m["first_difference"]),
                          _num(m.get("logit_gap"), "{:.3g}")] for m in doc["mismatches"]])
    return "\n".join(lines) + "\n"


def _drafts_lines(methods: Sequence[dict[str, Any]]) -> list[str]:
    """["- drafts: none for none, prompt-lookup; tiny-draft (int8) for draft-model, hf:assisted"]: the draft
    model each method and peer drafted with (`methods[].draft`), in run order; [] for results without it."""
    if not all("draft" in m for m in methods):
        return []
    groups: dict[str, list[str]] = {}
    for method in methods:
        groups.setdefault(DraftInfo(**method["draft"]).label(), []).append(method["name"])
    return ["- drafts: " + "; ".join(f"{label} for {', '.join(names)}" for label, names in groups.items())]


def _load_lines(doc: dict[str, Any]) -> list[str]:
    """"- load: 3.1 s (target 1.9 s [prepared: hit], draft 0.6 s [hit], other 0.6 s, cost curve 4.0 s);
    peak RSS 9.1 GiB after loading, 9.4 GiB so far" (nothing for results without a load record)."""
    load, peak = doc.get("load"), doc.get("peak_rss_bytes")
    if not load and peak is None:
        return []
    parts = []
    if load:
        def part(label: str, key: str, prepared: str | None = None) -> str | None:
            seconds = load.get(key)
            if seconds is None:
                return None
            state = load.get(prepared) if prepared else None
            return f"{label} {seconds:.1f} s" + (f" [prepared: {state}]" if state else "")

        drafted = load.get("draft_s") or load.get("draft_prepared")  # no draft model: no draft part
        split = [p for p in (part("target", "target_s", "target_prepared"),
                             part("draft", "draft_s", "draft_prepared") if drafted else None,
                             part("other", "other_s"), part("cost curve", "cost_curve_s")) if p]
        total = load.get("total_s")
        head = f"{total:.1f} s" if total is not None else "-"
        parts.append(f"load: {head}" + (f" ({', '.join(split)})" if split else ""))
    memory = []
    if load and load.get("peak_rss_bytes") is not None:
        memory.append(f"{_bytes(load['peak_rss_bytes'])} after loading")
    if peak is not None:
        memory.append(f"{_bytes(peak)} for the whole run")
    if memory:
        parts.append("peak RSS " + ", ".join(memory))
    return [f"- {'; '.join(parts)}"]


def _backend_line(doc: dict[str, Any], cfg: dict[str, Any]) -> str:
    """", native backend, float32, specula-f32 linears, ... on cpu; greedy guarantee bitwise" (older
    results without a backend record: the configured dtype and attention)."""
    key = doc.get("backend")
    if not key:
        return (f", {cfg.get('dtype')}" + (f" ({cfg['quantize']})" if cfg.get("quantize", "none") != "none" else "")
                + f", {cfg.get('attn')} attention")
    dtype = str(key.get("dtype", "")).removeprefix("torch.")
    quant = f", {key['quantize']}" if key.get("quantize", "none") != "none" else ""
    device = key.get("gpu") or key.get("device")
    return (f", {key.get('backend')} backend, {dtype}{quant}, {key.get('linear_kernel')} linears, "
            f"{key.get('attention')} attention, on {device}; greedy guarantee: {doc.get('greedy_guarantee')}")


def write_report(out_dir: str | Path, document: dict[str, Any]) -> Path:
    return atomic_write_text(Path(out_dir) / REPORT_FILE, render_markdown(document))
