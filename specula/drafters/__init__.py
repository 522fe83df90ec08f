"""Drafters: one module per family, one protocol (`specula.drafters.base.Drafter`).

Each drafter module defines `create(*, target, draft, **options) -> Drafter`; add a new
method by adding its module to `MODULES`."""

from __future__ import annotations

import importlib
import inspect

from specula.errors import ConfigError

MODULES: dict[str, str] = {
    "none": "specula.drafters.none",
    "draft-model": "specula.drafters.draft_model",
    "draft-tree": "specula.drafters.draft_tree",
    "prompt-lookup": "specula.drafters.prompt_lookup",
    "token-recycling": "specula.drafters.token_recycling",
    "rest": "specula.drafters.rest",
    "fusion": "specula.drafters.fusion",
}
"""Method name (as in `--method`) -> module defining `create`."""

METHODS = tuple(MODULES)


def check_method(method: str) -> None:
    """Raise a clear error for an unknown method name (before any model is loaded)."""
    if method not in MODULES:
        raise ConfigError(f"unknown method {method!r}; choose one of: {', '.join(MODULES)}")


def make_drafter(method: str, *, target=None, draft=None, tokenizer=None, **options):
    """Build the drafter (a `specula.drafters.base.Drafter`) for a method name.

    target / draft: `HFCausalLM` backends (draft only for methods that use a draft model);
    tokenizer: the target's tokenizer, for drafters that check files against it;
    options: method-specific settings (None values mean "the method's default")."""
    check_method(method)
    module = importlib.import_module(MODULES[method])
    options = {k: v for k, v in options.items() if v is not None}
    accepted = inspect.signature(module.create).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        valid = sorted(n for n in accepted if n not in ("target", "draft", "tokenizer"))
        raise ConfigError(f"method {method!r} does not take {', '.join(unknown)}; "
                          f"its options are {', '.join(valid) or 'none'}")
    if tokenizer is not None and "tokenizer" in accepted:
        options["tokenizer"] = tokenizer
    return module.create(target=target, draft=draft, **options)


__all__ = ["METHODS", "MODULES", "check_method", "make_drafter"]
