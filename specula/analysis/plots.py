"""The acceptance plot and the markdown report of `specula analyze acceptance`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specula.analysis.measure import BOUNDS, VERIFIER_SCHEME, VERIFIERS
from specula.paths import atomic_path

PLOT_FILE = "acceptance.png"
REPORT_FILE = "report.md"

LABELS = {
    "iid": "alpha* i.i.d. drafts",
    "without_replacement": "alpha* drafts w/o replacement",
    "greedy": "alpha* greedy drafts",
    "rrs_iid": "RRS with replacement",
    "kseq": "SpecTr K-SEQ (i.i.d.)",
    "rrs_without_replacement": "RRS without replacement",
}
COLORS = {"iid": "tab:blue", "without_replacement": "tab:orange", "greedy": "tab:green"}


def plot_acceptance(document: dict[str, Any], path: Path) -> Path:
    """One panel per temperature: acceptance vs number of drafts; bounds dashed, verifiers
    solid in their draft scheme's colour (K-SEQ dotted)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = document["runs"]
    fig = Figure(figsize=(5.2 * max(1, len(runs)), 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(runs)), squeeze=False)[0]
    for ax, run in zip(axes, runs):
        overall = run["overall"]
        ns = list(range(1, len(overall["iid"]) + 1))
        for name in BOUNDS:
            ax.plot(ns, overall[name], linestyle="--", marker="o", markersize=3, color=COLORS[name], label=LABELS[name])
        for name in VERIFIERS:
            style = ":" if name == "kseq" else "-"
            ax.plot(ns, overall[name], linestyle=style, marker="s", markersize=3,
                    color=COLORS[VERIFIER_SCHEME[name]], label=LABELS[name])
        ax.set_xlabel("number of drafts n")
        ax.set_ylabel("acceptance probability (mean over positions)")
        ax.set_title(f"T = {run['temperature']:g}, {run['positions']} positions, {run['prompts']} prompts", fontsize=10)
        ax.set_xticks(ns)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    config = document.get("models", {})
    fig.suptitle(f"Multi-draft acceptance vs optimal bounds: target {config.get('target', '?')}, "
                 f"draft {config.get('draft', '?')}", fontsize=10)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render_markdown(document: dict[str, Any]) -> str:
    """Tables: per temperature, acceptance by number of drafts (bounds and verifiers), the
    checks, and per-category values at the largest n."""
    models = document.get("models", {})
    config = document["config"]
    lines = [
        "# Multi-draft acceptance vs optimal bounds",
        "",
        f"Target `{models.get('target', '?')}`, draft `{models.get('draft', '?')}`; prompts `{models.get('prompts', '?')}`. "
        f"Positions: the target's own sampled continuation ({config['positions']} tokens per prompt), teacher-forced. "
        f"Tokens outside the top set are merged into one (tail mass <= {config['lump_mass']:g} in p and q). "
        f"RRS without replacement: Monte Carlo, {config['trajectories']} trajectories per position (± = standard error); "
        "the other verifiers and all bounds are exact."
        + (f" {models['constrained_prompts']} prompt(s) carry a JSON schema: their continuation is sampled under it "
           "and p is the target's distribution masked by it, as the engine decodes structured output; q is the "
           "draft's own, unmasked." if models.get("constrained_prompts") else ""),
    ]
    for run in document["runs"]:
        overall = run["overall"]
        columns = [*BOUNDS, *VERIFIERS]
        lines += ["", f"## T = {run['temperature']:g} ({run['positions']} positions, {run['prompts']} prompts, "
                      f"{run['mean_kept_tokens']} tokens kept per position on average)", "",
                  _row(["n", *(LABELS[c] for c in columns)]), _row(["---"] * (len(columns) + 1))]
        for i in range(len(overall["iid"])):
            cells = [i + 1]
            for c in columns:
                value = f"{overall[c][i]:.4f}"
                if c == "rrs_without_replacement":
                    value += f" ± {overall['rrs_without_replacement_stderr'][i]:.4f}"
                cells.append(value)
            lines.append(_row(cells))
        checks = run["checks"]
        lines += ["", f"- bound without replacement >= bound i.i.d. at every n: "
                      f"{'yes' if checks['without_replacement_bound_above_iid_bound'] else 'NO'}",
                  f"- RRS without replacement >= RRS with replacement for n >= 2: "
                  f"{'yes' if checks['rrs_without_replacement_above_rrs_iid'] else 'NO'}"]
        for name, check in checks["verifiers"].items():
            lines.append(f"- {LABELS[name]} vs its bound ({VERIFIER_SCHEME[name]}): positions above the bound "
                         f"{check['positions_above_bound']}, largest excess {check['max_excess']:+.2g}")
        n_max = len(overall["iid"])
        lines += ["", f"Per category at n = {n_max}:", "",
                  _row(["category", "positions", *(LABELS[c] for c in columns)]), _row(["---"] * (len(columns) + 2))]
        for cat, values in run["categories"].items():
            lines.append(_row([cat, values["positions"], *(f"{values[c][-1]:.4f}" for c in columns)]))
    return "\n".join(lines) + "\n"
