"""What `--draft auto` means: the draft-choice policy (which draft model, if any, a method gets
when none is named). Loading the chosen draft is `models.loading.load_draft`'s job."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specula.methods import MethodSpec, get_method
from specula.models.base import TargetModel
from specula.models.loading import SELF_DRAFT

if TYPE_CHECKING:
    from specula.models.loading import LoadConfig

AUTO_DRAFT = "auto"
"""`--draft auto` (the default): the target's embedded companion draft, else `self`, where a draft
can pay (see `auto_draft`), else none."""
SELF_DRAFT_MIN_PARAMETERS = 1_000_000_000
"""Targets from this size get a model draft by default: below it, a draft token costs too large a
share of a target step on CPU (measured: SmolLM2-135M int8 12 ms against 24 ms float32)."""
AUTO_DRAFT_QUANTIZE = "int8"
"""How `--draft auto` quantizes a self-draft, and a companion where specula's CPU kernels do not run
(a draft needs speed and agreement, not exactness)."""
AUTO_COMPANION_QUANTIZE = "int4"
"""How `--draft auto` quantizes an embedded companion draft where specula's CPU kernels run
(`auto_draft_quantize`)."""


def auto_draft(method: str | MethodSpec, target: TargetModel, target_name: str | None = None) -> str | None:
    """What `--draft auto` means for `method` (a row with `auto_draft`) on a loaded target, on CPU,
    for targets of >= 1B parameters: the embedded draft registered for the target
    (`EmbeddedModel.draft`) when it is installed, else `self`; None otherwise. Measured on
    Qwen2.5-Coder-1.5B (4 prompts off Spec-Bench, 64 tokens, 2 threads): the 0.5B int8 draft 1.79x
    plain decoding with 5-token chains (1.76x in `fusion`), the int8 self-draft 1.52x (1.26x in
    `fusion`): its token costs 0.33 of a target step against ~0.1 for the 0.5B, and its higher
    agreement does not make up for it."""
    from specula.models.install import is_valid_conversion
    from specula.models.registry import get_embedded

    if not get_method(method).auto_draft or target.device.type != "cpu":
        return None
    if target.num_parameters < SELF_DRAFT_MIN_PARAMETERS:
        return None
    embedded = get_embedded(target_name) if target_name else None
    companion = get_embedded(embedded.draft) if embedded is not None and embedded.draft else None
    if companion is not None and is_valid_conversion(companion):
        return companion.alias
    return SELF_DRAFT


def why_no_auto_draft(method: str | MethodSpec, target: TargetModel) -> str:
    """Why `auto_draft` picked no draft model for `method` on `target`, for a message (`--draft auto` is the default:
    an option for the draft model then had nothing to read it, `methods.check_draft_options_read`)."""
    spec = get_method(method)
    if not spec.auto_draft:
        return f"the default draft choice, auto, picks none for method {spec.name}"
    if target.device.type != "cpu":
        return f"the default draft choice, auto, picks one on CPU only, and the target runs on {target.device.type}"
    return (f"the default draft choice, auto, picks one for targets of >= {SELF_DRAFT_MIN_PARAMETERS / 1e9:g}B "
            f"parameters, and this one has {target.num_parameters / 1e6:.3g}M")


def auto_draft_quantize(draft: str, config: LoadConfig) -> str:
    """How `--draft auto` quantizes the `draft` it picked: an embedded companion in int4 (4-bit weights
    in groups of 64, int8 activations) where its linears run on specula's CPU kernels (the native
    backend, float32 on CPU, `--linear-kernel auto|specula`), else int8; a self-draft in int8.
    Measured on Qwen2.5-Coder-1.5B with the 0.5B companion (2-core Xeon, greedy, the same process
    interleaved, `docs/native.md`, "int4 drafts"): the README's job 1.16-1.34x faster a request
    (three repeats), `fusion` 1.03x on Spec-Bench (two runs) and 1.04x / 0.99x on the everyday set,
    about the same acceptance; a one-row pass of the 0.5B 22 -> 14 ms."""
    from specula.models.prepack import resolve_linear_kernel

    if draft == SELF_DRAFT or config.backend == "hf":
        return AUTO_DRAFT_QUANTIZE
    device, dtype = config.resolved()
    kernel = resolve_linear_kernel(config.linear_kernel, dtype=dtype, device=device.type, quantize="none",
                                   native=True)  # the one place that says where a native model's linears run
    return AUTO_COMPANION_QUANTIZE if kernel == "specula" else AUTO_DRAFT_QUANTIZE


__all__ = ["AUTO_COMPANION_QUANTIZE", "AUTO_DRAFT", "AUTO_DRAFT_QUANTIZE", "SELF_DRAFT_MIN_PARAMETERS", "auto_draft",
           "auto_draft_quantize", "why_no_auto_draft"]
