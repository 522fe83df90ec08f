"""Drafters: one module per family, one protocol (`specula.drafters.base.Drafter`).

Each drafter module defines `create(*, target, draft, **options) -> Drafter`; add a new
method by adding its module to `MODULES`. `fusion` is not a drafter of its own: it is every
drafter that can run with the given models and files, whose trees the planner merges (RASD)
and sizes every step."""

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
    "layer-skip": "specula.drafters.layer_skip",
    "eagle": "specula.drafters.eagle",
    "medusa": "specula.drafters.medusa",
    "hydra": "specula.drafters.hydra",
}
"""Method name (as in `--method`) -> module defining `create`."""

FUSION = "fusion"
"""Every available drafter at once (see `make_drafters`)."""

METHODS = (*MODULES, FUSION)


def check_method(method: str) -> None:
    """Raise a clear error for an unknown method name (before any model is loaded)."""
    if method not in MODULES and method != FUSION:
        raise ConfigError(f"unknown method {method!r}; choose one of: {', '.join([*MODULES, FUSION])}")


def make_drafter(method: str, *, target=None, draft=None, tokenizer=None, **options):
    """Build the drafter (a `specula.drafters.base.Drafter`) for one drafter family.

    target / draft: backends (`specula.models.base.TargetModel`; draft only for methods that use
    a draft model); tokenizer: the target's tokenizer, for drafters that check files against it;
    options: method-specific settings (None values mean "the method's default")."""
    check_method(method)
    if method == FUSION:
        raise ConfigError("fusion is several drafters: build it with make_drafters('fusion', ...)")
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


def make_drafters(method: str, *, target=None, draft=None, tokenizer=None, datastore: str | None = None,
                  recycling_state: str | None = None, num_draft_tokens: int | None = None, head=None,
                  target_name: str | None = None, online_distill: bool | None = None, **options) -> list:
    """The drafters of a method: one for a drafter family, several for `fusion`.

    `head`: a trained head file (or loaded head) for eagle / medusa / hydra; fusion adds it as one
    more drafter (whatever its kind) when given.

    fusion = the model-free drafters first (prompt lookup, REST when a `datastore` is given, token
    recycling), then the draft model when `draft` is given (greedy candidates, adaptive: it drafts
    only while its next token beats the rate the others' trees already reach), or the target itself
    with layers skipped for `--draft skip` (`models.skipping.LayerSkipDraft`)."""
    from specula.models.skipping import LayerSkipDraft

    check_method(method)
    skipping = isinstance(draft, LayerSkipDraft)
    if skipping and method == "draft-tree":
        raise ConfigError("--draft skip drafts chains: use --method draft-model, layer-skip or fusion with it "
                          "(draft-tree needs a draft model)")
    if skipping or method == "layer-skip":
        # `--draft skip`: the draft-model methods draft with the target itself, layers skipped.
        skip_options = {"skip_layers": draft.skip_layers} if skipping else {}
        if method in ("draft-model", "layer-skip"):
            return [make_drafter("layer-skip", target=target, num_draft_tokens=num_draft_tokens,
                                 **skip_options, **options)]
        draft = None
    if method != FUSION:
        given = {"datastore": datastore, "recycling_state": recycling_state, "num_draft_tokens": num_draft_tokens,
                 "head": head, "target_name": target_name if head is not None else None,
                 "online_distill": online_distill}
        return [make_drafter(method, target=target, draft=draft, tokenizer=tokenizer, **given, **options)]
    if options:
        raise ConfigError(f"method fusion does not take {', '.join(sorted(options))}; its options are "
                          "datastore, head, num_draft_tokens, online_distill, recycling_state")
    if online_distill and head is None:
        raise ConfigError("--online-distill trains a head: give fusion one with --head FILE (or install the shipped one)")
    drafters = [make_drafter("prompt-lookup")]
    if datastore:
        drafters.append(make_drafter("rest", target=target, datastore=datastore, tokenizer=tokenizer))
    drafters.append(make_drafter("token-recycling", target=target, recycling_state=recycling_state,
                                 tokenizer=tokenizer))
    if head is not None:
        from specula.drafters.heads.runtime import TrainedHead, load_head

        if not isinstance(head, TrainedHead):  # read once: its kind names the drafter
            head = load_head(head, target, target_name or target.name)
        kind = head.kind
        drafters.append(make_drafter(kind, target=target, head=head, target_name=target_name,
                                     online_distill=online_distill))
    if skipping:
        drafters.append(make_drafter("layer-skip", target=target, num_draft_tokens=num_draft_tokens,
                                     **skip_options))
    elif draft is not None:
        drafters.append(make_drafter("draft-model", draft=draft, num_draft_tokens=num_draft_tokens, adaptive=True,
                                     greedy_proposals=True))
    return drafters


__all__ = ["FUSION", "METHODS", "MODULES", "check_method", "make_drafter", "make_drafters"]
