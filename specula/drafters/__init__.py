"""Drafters: one module per family, one protocol (`specula.drafters.base.Drafter`).

Each drafter module defines `create(*, target, draft, **options) -> Drafter`; the method table
(`specula.methods.METHODS`) names the module of each method. `fusion` is not a drafter of its own:
it is its members' drafters, each when what it needs is given, whose trees the planner merges
(RASD) and sizes every step."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from specula.errors import ConfigError
from specula.models.skipping import SKIP_ASKED
from specula.methods import (
    BUILT_IN, HEAD_ONLY, METHODS, NO_HEAD, MethodSpec, check_draft_options_read, check_switches, get_method,
    is_given, layer_skipper, not_read_when_skipping, or_list,
)

if TYPE_CHECKING:  # importing a drafter package module (e.g. heads.config) must not import torch
    from specula.models.base import TargetModel


def make_drafter(method: str | MethodSpec, *, target: TargetModel | None = None, draft: TargetModel | None = None,
                 tokenizer: Any = None, **options: Any):
    """Build the drafter (a `specula.drafters.base.Drafter`) of one drafter family.

    target / draft: backends (draft only for methods that use a draft model); tokenizer: the
    target's tokenizer, for drafters that check files against it; options: method-specific
    settings (None values mean "the method's default")."""
    spec = get_method(method)
    module = spec.drafter_module()
    options = {k: v for k, v in options.items() if v is not None}
    accepted = inspect.signature(module.create).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        valid = sorted(n for n in accepted if n not in BUILT_IN)
        raise ConfigError(f"method {spec.name!r} does not take {', '.join(unknown)}; "
                          f"its options are {', '.join(valid) or 'none'}")
    check_switches(spec, options)  # adaptive="maybe" drafted as adaptive
    if tokenizer is not None and "tokenizer" in accepted:
        options["tokenizer"] = tokenizer
    return module.create(target=target, draft=draft, **options)


def make_drafters(method: str | MethodSpec, *, target: TargetModel | None = None, draft: TargetModel | None = None,
                  tokenizer: Any = None, draft_skip: bool = False, **options: Any) -> list:
    """The drafters of a method (`specula.methods.METHODS`): one for a drafter family, its members'
    for `fusion`.

    `draft_skip` (`--draft skip`): the target drafts for itself with decoder sub-layers skipped
    (option `skip_layers` fixes the set, else it is searched); what that means for the method is
    its row's `draft_skip`: its drafter is the layer-skipping one, fusion's layer-skip member joins,
    it is refused, or ignored.

    fusion = its members in order, each when what it needs is given: the model-free drafters
    (prompt lookup, REST when a `datastore` is given, token recycling unless a head is given), the
    trained head when a `head` is given (the member of its kind), then the target itself with layers skipped for
    `draft_skip`, or the draft model when `draft` is given (greedy candidates, adaptive: it drafts
    only while its next token beats the rate the others' trees already reach)."""
    spec = get_method(method)
    told_no_head = options.get("head") == NO_HEAD
    if told_no_head:  # `--head none`: no head, not even the installed one
        options["head"] = None
    if draft_skip and draft is not None:
        raise ConfigError("draft_skip=True drafts with the target itself: give draft=MODEL or draft_skip=True, not "
                          "both")
    if spec.members:
        return _fusion(spec, target, draft, tokenizer, draft_skip, options, told_no_head)
    if draft_skip:
        if spec.draft_skip == "refused":
            takers = [s.name for s in METHODS.values() if s.draft_skip == "drafts"]
            methods = or_list([f'method="{name}"' for name in takers])
            raise ConfigError(f"{SKIP_ASKED} drafts chains: use {methods} with it ({spec.name} needs a draft "
                              "model)")
        if spec.draft_skip == "drafts":
            skipper = layer_skipper()
            unread = [name for name, value in options.items()  # None: left out (`make_drafter` drops it)
                      if value is not None and name not in skipper.accepted_options()]
            if unread and spec is not skipper:  # not "method 'layer-skip' does not take ...": the method named here
                raise not_read_when_skipping(unread[0], spec.name)
            spec = skipper
        else:
            options.pop("skip_layers", None)  # ignored: the method drafts without a draft model
    return [make_drafter(spec, target=target, draft=draft, tokenizer=tokenizer, **options)]


def _fusion(spec: MethodSpec, target: TargetModel | None, draft: TargetModel | None, tokenizer: Any,
            draft_skip: bool, options: dict[str, Any], told_no_head: bool = False) -> list:
    """Every member of a fused method whose needs are given (see `make_drafters`; `told_no_head`: the head given was
    `NO_HEAD`, not left out)."""
    accepted = spec.accepted_options()
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"method {spec.name} does not take {', '.join(unknown)}; its options are "
                          f"{', '.join(accepted)}")
    head = options.get("head")
    for_head = [name for name in HEAD_ONLY if is_given(options.get(name))]  # head_window=0 too
    if for_head and head is None:  # head_window=-1 without a head was ignored without a word
        why, fix = (("the head given is none", "head=FILE instead of none") if told_no_head else
                    ("none given, none installed for the target",
                     "head=FILE (`specula train`, or the shipped one: `specula models install`)"))
        raise ConfigError(f"{for_head[0]} is for a trained head, and {spec.name} drafts without one here ({why}); "
                          f"give it one with {fix}, or drop {for_head[0]}")
    check_draft_options_read(spec, options, draft is not None, draft_skip)  # num_draft_tokens without a draft model
    if is_given(options.get("skip_layers")) and not draft_skip:  # its layer-skip member joins for draft_skip only
        raise ConfigError(f"skip_layers is for layer skipping, and {spec.name} drafts without it here (no "
                          "draft_skip=True); add draft_skip=True (the target drafting with layers skipped) or drop "
                          "skip_layers")
    if head is not None:
        import torch

        from specula.drafters.heads.runtime import TrainedHead, load_head

        if not isinstance(head, TrainedHead):  # read once: its kind names the member
            head = load_head(head, target, options.get("target_name") or target.name,
                             torch.float32 if options.get("online_distill") else None)  # OSD trains it
    given = {**options, "head": head}
    drafters = []
    for member in spec.members:
        member_spec = get_method(member.method)
        if member_spec.draft_model == "required" and draft is None:
            continue
        if member_spec.layer_skipping and not draft_skip:
            continue
        if member_spec.datastore and not given.get("datastore"):
            continue
        if member_spec.head is not None and (head is None or head.kind != member_spec.head):
            continue
        if member.without_head and head is not None:
            given_here = [name for name in member.forwards if given.get(name) is not None]
            if given_here:  # its option would be ignored without a word
                name = given_here[0]
                raise ConfigError(f"{name} is for {member.method}, which {spec.name} leaves out when a trained head "
                                  f'drafts; pass head="{NO_HEAD}" to keep {member.method} (or drop {name})')
            continue
        forwarded = {name: given.get(name) for name in member.forwards}
        drafters.append(make_drafter(member_spec, target=target, draft=draft, tokenizer=tokenizer,
                                     **forwarded, **dict(member.fixed)))
    return drafters


_MOVED = {"MODULES": "specula.methods.METHODS (each row's module)", "METHODS": "specula.methods.METHODS",
          "FUSION": "specula.methods.DEFAULT_METHOD", "check_method": "specula.methods.get_method"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        raise AttributeError(f"specula.drafters.{name} moved: use {_MOVED[name]}")
    raise AttributeError(f"module 'specula.drafters' has no attribute {name!r}")


__all__ = ["make_drafter", "make_drafters"]
