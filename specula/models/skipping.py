"""Skip sets of decoder sub-layers (for drafting by the target itself, SWIFT): their syntax, and
the checks of `--draft skip` (the target, a `LayerSkippingModel`, drafts for itself)."""

from __future__ import annotations

import contextlib
import re
from typing import Sequence

from specula.errors import ConfigError
from specula.models.base import LayerSkippingModel, SubLayer, TargetModel

KINDS = ("attn", "mlp")
SKIP_DRAFT = "skip"
"""`--draft skip` (`load(draft="skip")`): the target drafts for itself with sub-layers skipped (no draft model is
loaded)."""
SKIP_ASKED = "draft_skip=True"
"""`make_drafters`' (and `Specula`'s) keyword for `load(draft="skip")`, as their messages name it."""


def draft_skip_named(skipping: bool) -> contextlib.AbstractContextManager:
    """A context in which the errors of drafters built with `SKIP_ASKED` (`make_drafters`' keyword) name it as
    `api.load`'s callers asked for it, `draft="skip"` (`--draft skip` on the command line), when `skipping`."""
    from specula.errors import reworded

    if not skipping:
        return contextlib.nullcontext()
    return reworded(lambda message: message.replace(SKIP_ASKED, f'draft="{SKIP_DRAFT}"'))


def check_skip_layers(draft: str | None, skip_layers: str | None) -> None:
    """`skip_layers` is given with `draft="skip"` only (the one place this is checked). Its errors name `load`'s
    keywords (a command shows its flags: `commands.common.flags_in_errors`)."""
    if skip_layers is not None and draft != SKIP_DRAFT:
        raise ConfigError('skip_layers applies to draft="skip" only (the target drafting with layers skipped); '
                          'add draft="skip" or drop skip_layers')


def check_draft_skip(target: TargetModel, skip_layers: str | None = None, quantize: str | None = None) -> None:
    """`draft="skip"` on a loaded target, checked: the backend can skip layers, `draft_quantize`
    is not given (the draft reads the target's weights), `skip_layers` names layers the model has."""
    if not isinstance(target, LayerSkippingModel):
        raise ConfigError('draft="skip" needs the native backend (Llama, Qwen2, Mistral models): use '
                          'backend="native", or another draft (draft=MODEL)')
    if quantize is not None:
        raise ConfigError('draft_quantize does not apply to draft="skip" (the draft reads the target\'s own '
                          'weights); drop draft_quantize, or use draft="self" with draft_quantize="int8"')
    if skip_layers is not None:
        parse_skip_layers(skip_layers, target.num_layers)


def parse_skip_layers(spec: str, num_layers: int) -> frozenset[SubLayer]:
    """"attn:14-26,mlp:5-12,3" -> {(14, "attn"), ..., (3, "attn"), (3, "mlp")}: comma-separated
    layer numbers or ranges (0-based, inclusive), each optionally prefixed by attn: or mlp: (no
    prefix: both sub-layers). A `ConfigError` names what is wrong and the model's layers."""
    skip: set[SubLayer] = set()
    for item in (part.strip() for part in spec.split(",")):
        match = re.fullmatch(r"(?:(attn|mlp):)?(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ConfigError(f"skip_layers: cannot read {item!r}; write layers as 3, 5-9, attn:12-20 or "
                              "mlp:4 separated by commas")
        kinds = (match.group(1),) if match.group(1) else KINDS
        first = int(match.group(2))
        last = int(match.group(3)) if match.group(3) else first
        if last < first:
            raise ConfigError(f"skip_layers: range {item!r} runs backwards; write {last}-{first}")
        if last >= num_layers:
            raise ConfigError(f"skip_layers names layer {last}, but the model has {num_layers} layers "
                              f"(0-{num_layers - 1}); name layers in that range")
        skip.update((layer, kind) for layer in range(first, last + 1) for kind in kinds)
    if len(skip) == 2 * num_layers:
        raise ConfigError("skip_layers skips every layer; leave some to draft with")
    return frozenset(skip)


def format_skip_layers(skip: Sequence[SubLayer] | frozenset[SubLayer]) -> str:
    """The inverse of `parse_skip_layers` (ranges per sub-layer kind), "" for no skip."""
    parts = []
    for kind in KINDS:
        layers = sorted(layer for layer, k in skip if k == kind)
        ranges: list[str] = []
        for layer in layers:
            if ranges and int(ranges[-1].split("-")[-1]) == layer - 1:
                ranges[-1] = f"{ranges[-1].split('-')[0]}-{layer}"
            else:
                ranges.append(str(layer))
        parts.extend(f"{kind}:{r}" for r in ranges)
    return ",".join(parts)


def candidate_sublayers(num_layers: int) -> list[SubLayer]:
    """What the search may skip: both sub-layers of layers 1 .. L-2 (SWIFT keeps the first and last)."""
    return [(layer, kind) for layer in range(1, num_layers - 1) for kind in KINDS]




_MOVED = {"LayerSkipDraft": "draft_skip=True (specula.drafters.make_drafters; api.load(draft='skip'))",
          "layer_skip_draft": "specula.models.skipping.check_draft_skip"}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"specula.models.skipping.{name} is gone: use {_MOVED[name]}")
    raise AttributeError(f"module 'specula.models.skipping' has no attribute {name!r}")
