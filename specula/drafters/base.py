"""The drafter protocol: `start / propose / observe / finish`.

Drafters never see acceptance rules or the planner; rules never see models. A drafter holds
what requests share (weights, datastores, the recycling matrix); what belongs to one request
(a draft model's KV cache) is the state it returns from `start()`, which the engine keeps in
the request's session and hands back on every call. Per step it gets a
`specula.step.DraftContext` (the committed tokens, the root being the last of them, a budget,
the request's generator and a read-only cost view), returns a `specula.step.Proposal`, and
afterwards observes the `specula.step.StepResult` (what the target accepted, and the target
logits at every node).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Protocol, TypeVar, runtime_checkable

from specula.errors import ConfigError
from specula.step import DraftBudget, DraftContext, Proposal, StepResult, within_budget

__all__ = ["DraftBudget", "DraftContext", "Drafter", "FeatureDrafter", "Proposal", "StepResult", "method_config",
           "within_budget"]


@runtime_checkable
class Drafter(Protocol):
    """Proposes token trees; learns from verified steps."""

    name: str
    """The drafter's name (`--method`), also the `source` of the nodes it proposes."""

    def start(self) -> Any:
        """A new request begins: its per-request state (None when the drafter keeps none)."""
        ...

    def propose(self, ctx: DraftContext, state: Any) -> Proposal:
        """A candidate tree hung from the root `ctx.tokens[-1]` (may be empty)."""
        ...

    def observe(self, step: StepResult, state: Any) -> None:
        """Learn from the verified step (every drafter sees every step, whatever it proposed)."""
        ...

    def finish(self, state: Any) -> None:
        """The request ended: free its state (e.g. the draft model's KV cache)."""
        ...


@runtime_checkable
class FeatureDrafter(Protocol):
    """A drafter that reads the target's hidden states (trained heads): when `needs_hidden`, the
    engine asks the target's passes for them (same pass, `models.base.FeatureModel`), hands it the
    prompt's after prefill (`observe_prompt`) and every step's in `StepResult.hidden`. The drafters
    of one engine must ask for the same features (one pass returns one set)."""

    needs_hidden: bool
    """True when this drafter wants hidden states now."""
    feature_request: Any
    """Which (`models.base.FeatureRequest`): True = the last hidden state [n, E]; a tuple of layer
    indices = the inputs of those layers [n, k E] (EAGLE-3)."""

    def observe_prompt(self, prompt: list[int], hidden: Any, state: Any) -> None:
        """The prompt was prefilled: `hidden` [len(prompt) - 1, k E] are the target's features (as
        `feature_request` asked) of every prompt token but the last (the first step's root)."""
        ...


class StatelessDrafter:
    """Base for drafters that keep no per-request state and learn nothing from steps."""

    name = "stateless"

    def start(self) -> None:
        return None

    def observe(self, step: StepResult, state: Any) -> None:
        return None

    def finish(self, state: Any) -> None:
        return None


_Config = TypeVar("_Config")


def method_config(method: str, cls: type[_Config], options: dict[str, Any], **fixed: Any) -> _Config:
    """`cls(**fixed, **options)` for a drafter's frozen config dataclass, refusing unknown options
    with an error that names the method and its options (instead of a TypeError)."""
    known = {f.name for f in fields(cls)} - set(fixed)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"method {method!r} does not take {', '.join(unknown)}; its options are "
                          f"{', '.join(sorted(known))}")
    return cls(**fixed, **options)
