"""Drafters: one module per family, one protocol (`specula.drafters.base.Drafter`)."""

from __future__ import annotations

from specula.drafters.base import DraftBudget, DraftContext, Drafter, Proposal, StepResult
from specula.errors import ConfigError

METHODS = ("none", "draft-model", "prompt-lookup")
"""Method names accepted by `make_drafter` (and `--method`)."""


def make_drafter(method: str, *, draft=None, num_draft_tokens: int | None = None) -> Drafter:
    """Build the drafter for a method name. `draft` is an `HFCausalLM` for draft-model."""
    if method == "none":
        from specula.drafters.none import NoDrafter

        return NoDrafter()
    if method == "prompt-lookup":
        from specula.drafters.prompt_lookup import PromptLookupDrafter

        return PromptLookupDrafter()
    if method == "draft-model":
        from specula.drafters.draft_model import DraftModelConfig, DraftModelDrafter

        if draft is None:
            raise ConfigError("method 'draft-model' needs a draft model: pass --draft MODEL (same tokenizer as the target)")
        cfg = DraftModelConfig() if num_draft_tokens is None else DraftModelConfig(num_draft_tokens=num_draft_tokens)
        return DraftModelDrafter(draft, cfg)
    raise ConfigError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")


__all__ = ["METHODS", "DraftBudget", "DraftContext", "Drafter", "Proposal", "StepResult", "make_drafter"]
