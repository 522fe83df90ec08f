"""PNG plots of a results document (matplotlib's Agg canvas; no pyplot, no global backend)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from specula.bench.methods import BASELINE
from specula.bench.report import ordered
from specula.paths import atomic_path

SPEEDUP_PNG = "speedup_by_category.png"
ACCEPTED_PNG = "accepted_lengths.png"
COST_CURVE_PNG = "cost_curve.png"
PLOTS = (SPEEDUP_PNG, ACCEPTED_PNG, COST_CURVE_PNG)
"""Every plot a bench writes into its --out (`write_plots`); `specula bench` clears them first."""


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def plot_speedup(doc: dict[str, Any], path: Path) -> Path | None:
    """Grouped bars: speedup vs `none` per category (and overall), one bar per method."""
    summary, categories = doc["summary"], doc["categories"]
    methods = [m for m, e in ordered(doc) if m != BASELINE and e["speedup"] is not None]
    if not methods:
        return None
    groups = ["overall", *[c for c in categories if any(c in summary[m]["by_category"] for m in methods)]]
    fig = _figure(max(6.0, 0.9 * len(groups) * max(1, len(methods)) ** 0.5 + 2), 4.6)
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    top = 1.0
    for k, name in enumerate(methods):
        entry = summary[name]
        values = [entry["speedup"]] + [entry["by_category"].get(c, {}).get("speedup") for c in groups[1:]]
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(groups))]
        heights = [v if v is not None else 0.0 for v in values]
        top = max(top, *heights)
        bars = ax.bar(xs, heights, width, label=name, hatch="//" if entry["kind"] == "hf" else None,
                      edgecolor="white", linewidth=0.5)
        if len(methods) * len(groups) <= 60:
            ax.bar_label(bars, labels=[f"{v:.2f}" if v is not None else "" for v in values], fontsize=7,
                         padding=2, rotation=90 if len(methods) > 3 else 0,
                         bbox={"boxstyle": "square,pad=0.05", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"{BASELINE} (plain decoding)")
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 5 else 0)
    ax.set_ylim(0, top * (1.25 if len(methods) > 3 else 1.12))
    ax.set_ylabel(f"speedup vs {BASELINE} (tokens/s ratio)")
    target = doc["config"].get("target")
    rounds = f" in {doc['repeats']} rounds" if doc.get("repeats", 1) > 1 else ""
    prompts = len({r["id"] for r in doc.get("runs", [])}) or doc["prompts_done"]  # prompts_done counts each round
    fig.suptitle(f"Speedup by category: {target}, {prompts} prompts{rounds} "
                 "(hatched: Hugging Face generate)",
                 fontsize=10)
    ax.legend(fontsize=8, ncols=min(5, len(methods) + 1), loc="lower center", bbox_to_anchor=(0.5, 1.01),
              frameon=False)
    return _save(fig, path)


def plot_accepted_lengths(doc: dict[str, Any], path: Path) -> Path | None:
    """Per specula method: fraction of steps that emitted k tokens (accepted drafts + 1)."""
    counts: dict[str, Counter] = {}
    for run in doc["runs"]:
        if run.get("accepted_lengths"):
            counts.setdefault(run["method"], Counter()).update(run["accepted_lengths"])
    methods = [m for m, _ in ordered(doc) if m in counts and m != BASELINE] or [m for m in counts]
    if not methods:
        return None
    cols = min(3, len(methods))
    rows = (len(methods) + cols - 1) // cols
    fig = _figure(max(5.5, 3.6 * cols + 0.4), 2.8 * rows + 0.5)
    axes = fig.subplots(rows, cols, squeeze=False)
    longest = max(max(counts[m]) for m in methods)
    for idx, name in enumerate(methods):
        ax = axes[idx // cols][idx % cols]
        total = sum(counts[name].values())
        ks = list(range(1, longest + 1))
        ax.bar(ks, [counts[name].get(k, 0) / total for k in ks], color=f"C{idx}")
        mean = sum(k * c for k, c in counts[name].items()) / total
        ax.axvline(mean, color="black", linestyle="--", linewidth=1)
        ax.set_title(f"{name}: mean {mean:.2f} over {total} steps", fontsize=9)
        ax.set_xlabel("tokens per step (accepted + 1)", fontsize=8)
        ax.set_ylabel("fraction of steps", fontsize=8)
        ax.tick_params(labelsize=7)
    for idx in range(len(methods), rows * cols):
        axes[idx // cols][idx % cols].set_visible(False)
    fig.suptitle("Accepted length per verification step", fontsize=10)
    return _save(fig, path)


def plot_cost_curve(curve: dict[str, Any], path: Path, title: str = "") -> Path:
    """Latency ratio of an n-token verification pass to a plain step, with the linear reference."""
    sizes, ratios, seconds = curve["sizes"], curve["ratio"], curve["seconds"]
    fig = _figure(6.0, 4.0)
    ax = fig.add_subplot()
    ax.plot(sizes, ratios, marker="o", label="measured")
    ax.plot(sizes, sizes, color="gray", linestyle=":", label="n plain steps (no batching gain)")
    for n, r, s in zip(sizes, ratios, seconds):
        ax.annotate(f"{1000 * s:.1f} ms", (n, r), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    low, top = min(1.0, min(ratios)) * 0.8, max(2.0, max(ratios)) * 1.4
    ticks = [t for t in (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 16, 32, 64, 128) if low <= t <= top]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(low, top)
    ax.set_xlabel("tokens in the verification pass (root + draft nodes)")
    ax.set_ylabel("latency / one plain decode step")
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title(title or f"Target cost curve (context {curve['context']})", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_cost_curves(curves: dict[str, dict[str, Any]], path: Path, title: str = "") -> Path:
    """Several options' cost curves side by side: absolute latency (left) and latency relative to
    each option's own plain step (right). curves: label -> `CostCurve.to_dict()`-like dict."""
    fig = _figure(10.0, 4.0)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    sizes_all = sorted({n for c in curves.values() for n in c["sizes"]})
    for label, curve in curves.items():
        ms = [1000 * s for s in curve["seconds"]]
        left.plot(curve["sizes"], ms, marker="o", label=f"{label} ({ms[0]:.0f} ms/step)")
        right.plot(curve["sizes"], curve["ratio"], marker="o", label=label)
    right.plot(sizes_all, sizes_all, color="gray", linestyle=":", label="n plain steps")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(sizes_all, [str(n) for n in sizes_all])
        ax.set_xlabel("tokens in the verification pass")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("latency of one pass (ms)")
    all_ms = [1000 * s for c in curves.values() for s in c["seconds"]]
    ms_ticks = [t for t in (10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400) if min(all_ms) * 0.7 <= t <= max(all_ms) * 1.4]
    left.set_yticks(ms_ticks, [f"{t:g}" for t in ms_ticks])
    right.set_ylabel("latency / the option's plain decode step")
    top = max(max(c["ratio"]) for c in curves.values()) * 1.4
    ticks = [t for t in (0.5, 1, 1.5, 2, 3, 4, 8, 16, 32, 64) if t <= top]
    right.set_yticks(ticks, [f"{t:g}" for t in ticks])
    right.set_ylim(min(0.8, min(min(c["ratio"]) for c in curves.values()) * 0.9), top)
    for ax in (left, right):
        ax.minorticks_off()
    fig.suptitle(title or "Cost curves", fontsize=10)
    return _save(fig, path)


def write_plots(out_dir: str | Path, doc: dict[str, Any]) -> list[Path]:
    """Every plot the document has data for; returns the files written."""
    out = Path(out_dir)
    written = [plot_speedup(doc, out / SPEEDUP_PNG), plot_accepted_lengths(doc, out / ACCEPTED_PNG)]
    if doc.get("cost_curve"):
        title = f"Target cost curve: {doc['config'].get('target')} (context {doc['cost_curve']['context']})"
        written.append(plot_cost_curve(doc["cost_curve"], out / COST_CURVE_PNG, title))
    return [p for p in written if p is not None]
