"""Structured output: constraints on what a request may generate (JSON, JSON schema, regex,
grammar), matched by llguidance. The engine masks the target's distribution with the request's
`GrammarState` (every acceptance rule then preserves the constrained law), prunes drafts the
grammar forbids, and drafts the tokens the grammar forces for free (`FORCED_SOURCE`)."""

from specula.constraints.matcher import GrammarState, MaskedLogits, check_constraint, grammar_tokenizer
from specula.constraints.spec import Constraint, ConstraintError, as_constraint

__all__ = ["Constraint", "ConstraintError", "GrammarState", "MaskedLogits", "as_constraint", "check_constraint",
           "grammar_tokenizer"]
