"""Generation statistics: counters filled by the decode loop, never prints."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class GenerationStats:
    """Counters of one generation (or the sum of several, see `merge`)."""

    method: str = "none"
    """Drafter name."""
    new_tokens: int = 0
    """Tokens emitted (after truncation at EOS / stop / max_new_tokens)."""
    steps: int = 0
    """Target verification steps (one forward pass each, prefill excluded)."""
    accepted_lengths: list[int] = field(default_factory=list)
    """Per step: accepted draft tokens + 1 (the bonus / correction token)."""
    drafted_tokens: int = 0
    """Tree nodes sent to the target, summed over steps."""
    accepted_tokens: int = 0
    """Draft tokens the target accepted, summed over steps."""
    depth_drafted: list[int] = field(default_factory=list)
    """depth_drafted[d-1]: steps whose tree reached depth d."""
    depth_accepted: list[int] = field(default_factory=list)
    """depth_accepted[d-1]: steps that accepted a node at depth d."""
    source_drafted: Counter = field(default_factory=Counter)
    """Nodes sent to the target, by drafter source: a node two drafters proposed counts for each
    (so the sources can add up to more than `drafted_tokens`)."""
    source_accepted: Counter = field(default_factory=Counter)
    """Accepted nodes, by drafter source (a node counts for every drafter that proposed it)."""
    proposed_tokens: int = 0
    """Nodes the drafters proposed, summed over steps, before the planner cut what does not pay."""
    predicted_accepted: float = 0.0
    """Sum over steps of the planner's predicted accepted tokens (incl. bonus), when known."""
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    commit_seconds: float = 0.0
    seconds: float = 0.0
    """Wall time of the whole generation, prefill included."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens read from the engine's prefix cache instead of prefilled (`prefix_cache`)."""
    finish_reason: str = ""
    """"stop" (EOS or a stop string), "length" (max_new_tokens or the context window), or
    "cancelled" (the caller stopped the generation)."""
    speculation_off_by_load: int = 0
    """Steps on which this request had a tree worth verifying alone but shared a batch at a load
    where the goodput plan gave it no node (serving; 0 alone)."""
    planner: dict[str, Any] | None = None
    """The planner's projection for this request (mean tree size, expected tokens per step,
    projected speedup), when a planner ran."""

    # ------------------------------------------------------------------ recording
    def record_step(self, depths: Sequence[int], proposers: Sequence[Sequence[str]], path: Sequence[int]) -> None:
        """One step: the verified tree's node depths, each node's proposing drafters (every one,
        `TokenTree.proposers`) and the accepted path's nodes (cut to what the step emitted)."""
        self.steps += 1
        self.accepted_lengths.append(len(path) + 1)
        self.drafted_tokens += len(depths)
        self.accepted_tokens += len(path)
        max_depth = max(depths, default=0)
        _grow(self.depth_drafted, max_depth)
        _grow(self.depth_accepted, max_depth)
        for d in range(max_depth):
            self.depth_drafted[d] += 1
        for d in range(len(path)):
            self.depth_accepted[d] += 1
        for names in proposers:
            self.source_drafted.update(names)
        for i in path:
            self.source_accepted.update(proposers[i])

    # ------------------------------------------------------------------ derived
    @property
    def mean_accepted_tokens(self) -> float:
        """Mean tokens per step, bonus included (plain decoding = 1.00)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    @property
    def drafting_steps(self) -> int:
        """Steps that verified a draft (a tree of at least one node)."""
        return self.depth_drafted[0] if self.depth_drafted else 0

    @property
    def mean_accepted_per_drafting_step(self) -> float | None:
        """Mean tokens per step over the drafting steps alone (None when no step drafted)."""
        return tokens_per_drafting_step(sum(self.accepted_lengths), self.steps, self.drafting_steps)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """P(a node at depth d is accepted | the tree reached depth d)."""
        return [a / d if d else 0.0 for a, d in zip(self.depth_accepted, self.depth_drafted)]

    @property
    def other_seconds(self) -> float:
        return max(
            0.0,
            self.seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds - self.commit_seconds,
        )

    def draft_cost(self, plain_step_seconds: float | None = None) -> dict[str, float | None]:
        """What drafting cost, as a fraction of one plain target step (`plain_step_seconds`; default
        the planner's estimate for this run, None when no planner ran): per step and per proposed
        node (`per_token`, the figure a drafter's own loop is judged by)."""
        plain = plain_step_seconds or (self.planner or {}).get("plain_step_seconds")
        if not plain or not self.steps:
            return {"per_step": None, "per_token": None}
        return {"per_step": round(self.draft_seconds / self.steps / plain, 4),
                "per_token": round(self.draft_seconds / self.proposed_tokens / plain, 4) if self.proposed_tokens
                else None}

    def merge(self, other: "GenerationStats") -> "GenerationStats":
        """Sum of two stats (for multi-turn prompts and aggregates)."""
        out = GenerationStats(method=self.method)
        for name in (
            "new_tokens", "steps", "drafted_tokens", "proposed_tokens", "accepted_tokens", "predicted_accepted",
            "prefill_seconds", "draft_seconds", "verify_seconds", "commit_seconds", "seconds", "prompt_tokens",
            "cached_tokens", "speculation_off_by_load",
        ):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.accepted_lengths = self.accepted_lengths + other.accepted_lengths
        out.depth_drafted = _add_lists(self.depth_drafted, other.depth_drafted)
        out.depth_accepted = _add_lists(self.depth_accepted, other.depth_accepted)
        out.source_drafted = self.source_drafted + other.source_drafted
        out.source_accepted = self.source_accepted + other.source_accepted
        out.finish_reason = other.finish_reason or self.finish_reason
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "steps": self.steps,
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "mean_accepted_per_drafting_step": (
                round(self.mean_accepted_per_drafting_step, 4) if self.drafting_steps else None
            ),
            "predicted_mean_accepted_tokens": (
                round(self.predicted_accepted / self.steps, 4) if self.predicted_accepted and self.steps else None
            ),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "seconds": round(self.seconds, 4),
            "drafted_tokens": self.drafted_tokens,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_by_depth": [round(a, 4) for a in self.acceptance_by_depth],
            "accepted_lengths": list(self.accepted_lengths),
            "acceptance_by_source": {
                s: {"drafted": n, "accepted": self.source_accepted.get(s, 0)} for s, n in self.source_drafted.items()
            },
            "time": {
                "prefill": round(self.prefill_seconds, 4),
                "draft": round(self.draft_seconds, 4),
                "verify": round(self.verify_seconds, 4),
                "commit": round(self.commit_seconds, 4),
                "other": round(self.other_seconds, 4),
            },
            "draft_cost_of_plain_step": self.draft_cost(),
            "finish_reason": self.finish_reason,
            "speculation_off_by_load": self.speculation_off_by_load,
            **({"planner": self.planner} if self.planner is not None else {}),
        }

    def summary(self) -> str:
        """One line for humans."""
        return (
            f"[{self.method}] {self.new_tokens} tokens in {self.seconds:.2f}s ({self.tokens_per_s:.2f} tok/s), "
            f"{self.steps} steps, mean accepted {self.mean_accepted_tokens:.2f}"
            + (f" ({self.mean_accepted_per_drafting_step:.2f} per drafting step)"
               if 0 < self.drafting_steps < self.steps else "") + ", "
            f"acceptance {self.acceptance_rate:.1%} of {self.drafted_tokens} drafted; "
            f"time draft {self.draft_seconds:.2f}s verify {self.verify_seconds:.2f}s "
            f"commit {self.commit_seconds:.2f}s prefill {self.prefill_seconds:.2f}s"
        )


def tokens_per_drafting_step(emitted: float, steps: int, drafting_steps: int) -> float | None:
    """Mean tokens per step over the steps that verified a draft: `emitted` tokens over `steps`, of
    which `steps - drafting_steps` were plain steps of one token each (the planner found no tree
    worth verifying, or drafting was paused). EAGLE's tau drafts on every step, so where the planner
    declines to draft this reads above it. None when no step drafted."""
    return (emitted - (steps - drafting_steps)) / drafting_steps if drafting_steps else None


def _grow(values: list[int], size: int) -> None:
    values.extend([0] * (size - len(values)))


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
