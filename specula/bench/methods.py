"""What the bench times: specula methods (a `Specula` each, on the shared target) and peers, behind one
small interface. Every call is timed the same way: wall clock around the whole generation
(prefill included), after waiting for the accelerator."""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Protocol, Sequence

from specula.api import EngineConfig, Specula
from specula.errors import ConfigError
from specula.models.device import sync_device
from specula.models.loading import NO_DRAFT, DraftInfo
from specula.methods import (
    HEAD_ONLY, METHODS, NO_DRAFT_GIVEN, NO_HEAD, PLAIN, bench_defaults, check_draft_options_read, check_switches,
    draft_options_unread, get_method, in_flags, methods_taking,
)
from specula.models.base import TargetModel
from specula.sampling import SamplingParams
from specula.stats import GenerationStats

BASELINE = PLAIN
"""The method every speedup and identity check is measured against (plain decoding, same loop)."""


@dataclass
class MethodOutput:
    """One timed generation."""

    token_ids: list[int]
    """New tokens (prompt excluded, EOS kept when generation stopped on it)."""
    seconds: float
    """Wall time of the whole call, prefill included."""
    stats: GenerationStats | None
    """specula's counters (None for peers)."""


class BenchMethod(Protocol):
    """Something the bench can time on a prompt."""

    name: str
    kind: Literal["specula", "hf"]
    lossless: bool
    """Greedy output must equal plain decoding (a difference fails the bench)."""
    context_window: int | None
    """Tokens its prompt and output may hold together (None: not known); the bench caps every budget at
    the smallest (`runner.shared_window`)."""
    draft: DraftInfo
    """The draft model it drafts with (`NO_DRAFT`: none), results.json `methods[].draft`."""

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, constraint=None) -> MethodOutput:
        """Generate (matching `constraint`, a `specula.constraints.Constraint`, when given)."""
        ...

    def memory_bytes(self) -> int | None: ...


class SpeculaMethod:
    """A drafter on the shared target, through the one decode loop."""

    kind: Literal["specula"] = "specula"

    def __init__(self, name: str, spec: Specula, draft: DraftInfo = NO_DRAFT) -> None:
        self.name = name
        self.spec = spec
        self.lossless = spec.lossless
        self.planner = spec.planned
        self.context_window = spec.target.max_context
        self.draft = draft if spec.draft is not None and get_method(spec.method).draft_model != "no" else NO_DRAFT
        """`draft` (the run's draft model) where this method drafts with `spec.draft`, else `NO_DRAFT`."""

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, constraint=None) -> MethodOutput:
        device = self.spec.target.device
        sync_device(device)
        t0 = time.perf_counter()
        out = self.spec.generate(list(prompt_ids), params=params, constraint=constraint)
        sync_device(device)
        return MethodOutput(list(out.token_ids), time.perf_counter() - t0, out.stats)

    def memory_bytes(self) -> int | None:
        """The drafters' `memory_bytes` (attribute or method) summed, when any exposes one."""
        return self.spec.drafter_memory_bytes()


def build_specula_methods(
    names: Sequence[str],
    target: TargetModel,
    tokenizer,
    draft: TargetModel | None = None,
    options: Callable[[str], dict] = lambda name: {},
    engine: EngineConfig = EngineConfig(),
    planner_for: Callable[[str], object] = lambda name: None,
    flags: dict[str, str] | None = None,
    draft_info: DraftInfo = NO_DRAFT,
    no_draft: str = NO_DRAFT_GIVEN,
) -> list[SpeculaMethod]:
    """One `Specula` per method name (built as `specula generate` builds it), all on the same
    target backend (and draft). `none` comes first even when not named and never gets a planner;
    `planner_for(name)` may give the others one (e.g. from --cost-curve; None: the default), and `none` runs with
    `engine`'s limits bar the drafting ones (`EngineConfig.without_drafting_limits`: it refuses those).
    A variant `name:draft=none` runs without the draft model (`fusion:draft=none`: every other
    member, the trained head included, beside `fusion` with it in the same run), and without the draft model's
    options `options` gives (`methods.draft_options_unread`: fusion's num_draft_tokens, draft_window);
    `name:head=none` runs without the head, and without the head's options `options` gives (`methods.HEAD_ONLY`).
    A draft model's option given to an entry that drafts without one is refused (`methods.check_draft_options_read`),
    `no_draft` saying why `draft` is None (`--draft auto`'s reason, `draft_choice.why_no_auto_draft`). An entry that
    cannot be built is a ConfigError naming it ("method 'x'", "method variant 'x:option=value'"); `flags`: the
    command line's spelling of the options `options` gives (`methods.flag_spellings`), which the error then names
    them by (a variant's own options stay as it writes them). `draft_info` names `draft` (`LoadReport.draft`) in
    the `draft` of the methods that draft with it."""
    ordered = [BASELINE, *(n for n in dict.fromkeys(names) if n != BASELINE)]
    methods = []
    for name in ordered:
        base, overrides = split_method(name)
        own_draft = _variant_draft(name, overrides.get(DRAFT_OPTION), draft)
        planner, limits = (None, engine.without_drafting_limits()) if base == BASELINE else (planner_for(base), engine)
        given = entry_options(name, options(base), draft is not None, no_draft, flags)
        with _named(name, flags):
            spec = Specula(target, tokenizer, base, own_draft, engine=limits, planner=planner, **given)
        methods.append(SpeculaMethod(name, spec, draft_info))
    return methods


def entry_options(name: str, given: dict[str, Any], draft: bool, no_draft: str = NO_DRAFT_GIVEN,
                  flags: dict[str, str] | None = None) -> dict[str, Any]:
    """The options an entry of `--methods` runs with: `given` (the command line's for its method), less the head's
    for a `head=none` variant (`methods.HEAD_ONLY`) and the draft model's for a `draft=none` one
    (`methods.draft_options_unread`: fusion's num_draft_tokens, draft_window), which are for the entries with one;
    then its own. A draft model's option no drafter of the entry reads is refused (`draft`: the run has a draft
    model; `no_draft`: why not, `methods.check_draft_options_read`), a ConfigError named as `build_specula_methods`
    names one."""
    base, overrides = split_method(name)
    variant_draft = overrides.pop(DRAFT_OPTION, None)
    if str(overrides.get("head")) == NO_HEAD:  # the command line's head options are for the entries with a head
        given = {option: value for option, value in given.items() if option not in HEAD_ONLY}
    skips = bool(given.get("draft_skip"))
    with _named(name, flags):
        if variant_draft is not None:  # likewise the command line's draft model options, for the entries with one
            unread = draft_options_unread(base, given, False, skips)
            given = {option: value for option, value in given.items() if option not in unread}
            own = draft_options_unread(base, overrides, False, skips)
            if own:  # fusion:draft=none:num_draft_tokens=3
                raise ConfigError(f"{own[0]} is for the draft model, which {DRAFT_OPTION}=none takes away; drop one "
                                  "of them")
        check_draft_options_read(base, {**given, **overrides}, draft and variant_draft is None, skips, no_draft)
    return {**given, **overrides}


@contextlib.contextmanager
def _named(name: str, flags: dict[str, str] | None) -> Iterator[None]:
    """The error of an entry that cannot be built (a ConfigError, or a variant's value of the wrong kind:
    max_ngram=abc) as a ConfigError naming the entry ("method 'x'", "method variant 'x:option=value'"), with the
    options of `flags` named by their flags (a variant's own options as it writes them)."""
    base, overrides = split_method(name)
    label = f"method variant {name!r}" if overrides else f"method {name!r}"  # (an entry without options: a method)
    try:
        yield
    except (TypeError, ValueError) as exc:
        message = str(exc) if flags is None else in_flags(str(exc), flags, keep=overrides)
        raise ConfigError(f"{label}: {as_variant_writes(message)}") from exc


def as_variant_writes(message: str) -> str:
    """`message` (the library's) with each drafter option it writes with a string in double quotes, as a Python
    caller writes it (`tree_verifier="kseq"`), written as a variant writes it (`tree_verifier=kseq`: a variant's
    values are not quoted, `split_method`); one right after a colon (a variant written out) is left as it is."""
    names = {name for spec in METHODS.values() for name in spec.accepted_options()}
    words = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.sub(r'(?<![\w:-])({})="([^"\s]+)"'.format(words), r"\1=\2", message)


DRAFT_OPTION = "draft"
"""The variant option that takes a method's draft model away (`draft=none`), not a drafter option."""


def _variant_draft(name: str, value: Any, draft: TargetModel | None) -> TargetModel | None:
    """The draft model a variant runs with: the shared one, or none for `draft=none`."""
    if value is None:
        return draft
    if str(value).lower() != "none":
        raise ConfigError(f"method variant {name!r}: {DRAFT_OPTION}= takes only none (the draft model is "
                          f"chosen for the whole run with --draft)")
    return None


def split_method(spec: str) -> tuple[str, dict[str, Any]]:
    """A method entry of `--methods`: `name` or a variant `name:option=value:...` (options as the
    drafter's keyword arguments, e.g. `draft-tree:tree_sampling=iid`, `draft-model:adaptive=true`)
    -> (name, {option: value}); values parse as int, float, true/false, else stay strings."""
    base, *parts = spec.split(":")
    overrides: dict[str, Any] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"method variant {spec!r}: write options as name:option=value, e.g. "
                              f"{methods_taking('tree_sampling')[0]}:tree_sampling=iid")
        overrides[key.strip()] = _parse_value(raw.strip())
    return base.strip(), overrides


def _parse_value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def parse_method_list(value: str | None, has_draft: bool) -> list[str]:
    """`--methods a,b,c` -> names (validated against the method table; variants
    `name:option=value` allowed, see `split_method`); default: the table's `bench_default` methods
    (none, prompt-lookup, + draft-model with a draft)."""
    if value is None:
        names = bench_defaults(has_draft)
    else:
        names = [n.strip() for n in value.split(",") if n.strip()]
        if not names:
            raise ConfigError("--methods is empty; give comma-separated method names, e.g. none,prompt-lookup")
    for name in names:
        base, overrides = split_method(name)
        get_method(base)
        _variant_draft(name, overrides.get(DRAFT_OPTION), None)
        if base == BASELINE and overrides:
            raise ConfigError(f"{name!r}: the baseline {BASELINE!r} takes no options")
        check_variant(name, base, {k: v for k, v in overrides.items() if k != DRAFT_OPTION})
    return [BASELINE, *(n for n in dict.fromkeys(names) if n != BASELINE)]


def check_variant(name: str, base: str, overrides: dict[str, Any]) -> None:
    """A variant's options checked against the options dataclass of each drafter they reach (the
    method's, or the fused members' they are forwarded to), before any model is loaded: an unknown
    option, or a value its config refuses or cannot compare (max_ngram=abc), is a ConfigError
    naming the variant."""
    from dataclasses import fields

    spec = get_method(base)
    unknown = sorted(set(overrides) - set(spec.accepted_options()))
    if unknown:
        raise ConfigError(f"method variant {name!r}: {base} does not take {', '.join(unknown)}; its options are "
                          f"{', '.join(spec.accepted_options())}")
    try:
        check_switches(spec, overrides)  # draft-model:adaptive=maybe ran as adaptive=true
    except ConfigError as exc:
        raise ConfigError(f"method variant {name!r}: {as_variant_writes(str(exc))}") from None
    reached = [(m.method, set(m.forwards)) for m in spec.members] if spec.members else [(base, set(overrides))]
    for method, forwarded in reached:
        config = getattr(get_method(method).drafter_module(), "CONFIG", None)
        if config is None:
            continue
        given = {k: v for k, v in overrides.items() if k in forwarded and k in {f.name for f in fields(config)}}
        if not given:
            continue
        try:
            config(**given)
        except ConfigError as exc:
            raise ConfigError(f"method variant {name!r}: {as_variant_writes(str(exc))}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"method variant {name!r}: a value of the wrong kind in {given} ({exc})") from None
