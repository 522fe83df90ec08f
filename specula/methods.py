"""The table of methods: one frozen `MethodSpec` row per decoding method.

A row says what the method needs (a draft model, a trained head and its kind, a datastore, the
target's hidden states, a target that skips layers), which options the command line exposes for
it (`--method` options of the same name; `api.load` accepts every option its drafter's `create`
takes), how its drafters are built (its module's `create`, or its members' for `fusion`), what
`--draft auto` and `--draft skip` mean for it, and its default trained head. The CLI, `api.load`,
`specula.drafters.make_drafters`, the bench and `specula train` read this table; method names
appear nowhere else (the drafter modules aside).

Adding a method: a drafter module defining `create(*, target, draft, **options)` (and `CONFIG`,
the frozen dataclass of its options), and one row in `METHODS`.

Importing this module imports no drafter (and no torch): `specula --help` reads the table.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Literal, Sequence

from specula.errors import ConfigError

if TYPE_CHECKING:
    from specula.drafters.heads.config import HeadKind

DraftUse = Literal["no", "required", "optional"]
"""How a method uses a draft model: not at all, it cannot draft without one, or as one more drafter."""

DraftSkip = Literal["ignored", "refused", "drafts"]
"""What `--draft skip` (the target drafting for itself with decoder sub-layers skipped) means for a
method: ignored (it drafts without a draft model), refused (a `ConfigError` naming the methods
that take it), drafts (its drafter is the layer-skipping method's; fusion: that member joins)."""

BUILT_IN = ("target", "draft", "tokenizer")
"""Keywords of every drafter module's `create` that are inputs, not options."""


@dataclass(frozen=True)
class Member:
    """A method inside `fusion`: joins when what it needs is given (`MethodSpec` needs)."""

    method: str
    """The member's method name (a row of `METHODS`)."""
    forwards: tuple[str, ...] = ()
    """Options of the fused method handed to this member (each an option its `create` takes)."""
    fixed: tuple[tuple[str, Any], ...] = ()
    """Options the member always gets inside fusion (option, value)."""
    without_head: bool = False
    """Joins only when no trained head does (token recycling: with SmolLM2's eagle3 head, fusion
    without it ran 1.28 / 1.44 / 1.45x plain decoding on the everyday prompts and 1.26 / 1.27 /
    1.31x on Spec-Bench, against 1.30 / 1.32 / 1.33x and 1.18 / 1.25 / 1.25x with it: the head
    already drafts the continuations recycling would, and its ~56-node trees cost verification,
    planning and a table update every step; docs/training.md). Measured again on 2026-11-26 with
    the session-49 kernels (one run each, `runs/s49/tr_bench.sh`): recycling added beside the head
    took `fusion` from 1.46x to 1.29x plain decoding on Spec-Bench and from 1.45x to 1.32x on the
    everyday prompts. Translation is where the head does worse than recycling: on three German
    passages of ours `fusion` accepted 2.26-2.77 tokens a step with the head, 2.95-3.16 with
    recycling instead (`runs/s49/translate_src.py`)."""


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method: a drafter family, or several at once (`members`)."""

    name: str
    """As `--method`, `api.load(method=...)` and the bench's `--methods` spell it."""
    summary: str
    """One line for help texts and reports."""
    module: str | None = None
    """The drafter module: its `create(*, target, draft, [tokenizer,] **options)` builds the one
    drafter of this method, and its `CONFIG` is the frozen dataclass of its options. None for a
    method made of other methods' drafters (`members`)."""
    members: tuple[Member, ...] = ()
    """For `fusion`: the methods whose drafters run together (in this order), each when what it
    needs is given; the planner merges their trees."""
    options: tuple[str, ...] = ()
    """The options the command line exposes for it (flags of the same name,
    `commands.common.add_method_args`; `target_name` is `--target`): each a keyword of its module's
    `create` or a field of its `CONFIG` (tests/test_methods.py checks). With `members`: derived,
    see `cli_options`."""
    draft_model: DraftUse = "no"
    """Whether it drafts with a draft model (`--draft MODEL`); "no": a draft named for it is not
    even loaded."""
    auto_draft: bool = False
    """`--draft auto` may pick a draft model for it (`draft_choice.auto_draft`); else auto is none."""
    draft_skip: DraftSkip = "ignored"
    """What `--draft skip` means for it (`DraftSkip`)."""
    head: "HeadKind | None" = None
    """The kind of trained head it drafts with (eagle, eagle3, medusa, hydra); default `--head`: the head of
    that kind installed for the target (`default_head`)."""
    datastore: bool = False
    """It drafts from a datastore file (`--datastore`, built by `specula datastore build`)."""
    features: bool = False
    """It reads the target's hidden states (a `models.base.FeatureModel` backend)."""
    layer_skipping: bool = False
    """It runs the target with sub-layers skipped (a `models.base.LayerSkippingModel` backend)."""
    bench_default: bool = False
    """The bench runs it when `--methods` is not given (with a draft model only if it needs one)."""

    def drafter_module(self) -> ModuleType:
        """The drafter module (imported on first use)."""
        if self.module is None:
            raise ConfigError(f"{self.name} is several drafters: build it with make_drafters({self.name!r}, ...)")
        return importlib.import_module(self.module)

    def cli_options(self) -> tuple[str, ...]:
        """The options the command line gives it: its `options`; for a fused method, the options it
        forwards that the command line exposes for the member."""
        if not self.members:
            return self.options
        return tuple(dict.fromkeys(name for m in self.members for name in m.forwards
                                   if name in get_method(m.method).options))

    def accepted_options(self) -> tuple[str, ...]:
        """Every option its drafters take (what `api.load` and `make_drafters` accept), sorted."""
        if self.members:
            return tuple(sorted({name for m in self.members for name in m.forwards}))
        module = self.drafter_module()
        names = {n for n, p in inspect.signature(module.create).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in BUILT_IN}
        config = getattr(module, "CONFIG", None)
        if config is not None:
            names.update(f.name for f in fields(config))
        return tuple(sorted(names))

    def switches(self) -> tuple[str, ...]:
        """The options its drafters take that are switches (True / False), sorted: a field of its `CONFIG` or a
        keyword of its module's `create` typed `bool` (or `bool | None`) or defaulting to a bool; for a fused
        method, the switches it forwards to its members. `check_switches` refuses any other value for them."""
        if self.members:
            return tuple(sorted({name for m in self.members for name in m.forwards
                                 if name in get_method(m.method).switches()}))
        module = self.drafter_module()
        typed = [(n, p.annotation, p.default) for n, p in inspect.signature(module.create).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in BUILT_IN]
        config = getattr(module, "CONFIG", None)
        typed += [(f.name, f.type, f.default) for f in fields(config)] if config is not None else []
        return tuple(sorted({name for name, kind, default in typed if kind is bool or isinstance(default, bool)
                             or str(kind).replace(" ", "") in _BOOL_TYPES}))


_BOOL_TYPES = ("bool", "bool|None", "None|bool", "Optional[bool]")
"""How a switch's type reads in an annotation (as a string: the drafter modules postpone their annotations)."""

PLAIN = "none"
"""Plain decoding (nothing drafted): the bench's baseline and `--compare`'s reference."""
DEFAULT_METHOD = "fusion"
"""The method `generate`, `serve` and `api.load` use when none is named."""

HEAD_ONLY = ("online_distill", "head_window", "head_context_vocab")
"""Options only a trained head reads (`fusion` forwards them to its head members): given to `fusion` when no head
drafts, each was ignored without a word; `make_drafters` refuses them then."""
_HEAD_FORWARDS = ("head", "target_name", *HEAD_ONLY)
_TREE_OPTIONS = ("tree_sampling", "tree_verifier", "tree_top_k", "tree_depth", "tree_nodes")
_HEAD_OPTIONS = (*_HEAD_FORWARDS, *_TREE_OPTIONS)

# Order matters: each drafter's chain is valued beside the trees of those before it (the planner's
# cost view), so the model drafters (layer skipping, the draft model), the costliest and, where
# there is one, the strongest, draft before the trained heads: a cheap head then adds nodes where
# their chain leaves room. The other way round, a head's tree that merely looked as good as the
# draft model's chain kept the draft model from drafting at all, and its acceptance was never
# learned again (README main job, Qwen2.5-Coder-1.5B with its head in fusion: 14.5 tok/s with the
# head first, 20.6 with the draft model first, 17.7 without the head; one run each, warm; measured again
# in session 79, one process, interleaved: 2.70x head first against 2.94x, mean accepted 4.4 against
# 7.4, where prose ran 2-4% faster head first: docs/training.md, "The draft model beside the head,
# measured again"). Whether the draft model drafts at all beside the head is measured, not modelled:
# the planner holds it back on steps of a request where it was measured to add less than it costs
# (`HardwarePlanner.adds_beside`).
_FUSION_MEMBERS = (
    Member("prompt-lookup"),
    Member("rest", forwards=("datastore",)),
    Member("token-recycling", forwards=("recycling_state",), without_head=True),
    Member("layer-skip", forwards=("num_draft_tokens", "skip_layers")),
    Member("draft-model", forwards=("num_draft_tokens", "draft_window"), fixed=(("adaptive", True), ("greedy_proposals", True))),
    Member("eagle3", forwards=_HEAD_FORWARDS),
    Member("eagle", forwards=_HEAD_FORWARDS),
    Member("medusa", forwards=_HEAD_FORWARDS),
    Member("hydra", forwards=_HEAD_FORWARDS),
)

METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec(PLAIN, "plain decoding: the target alone, one token per step", "specula.drafters.none",
               bench_default=True),
    MethodSpec("draft-model", "a chain drafted by a small draft model (--draft)", "specula.drafters.draft_model",
               options=("num_draft_tokens", "adaptive", "draft_window"), draft_model="required", auto_draft=True,
               draft_skip="drafts", bench_default=True),
    MethodSpec("draft-tree", "a tree drafted by a small draft model (top-k or sampled siblings)",
               "specula.drafters.draft_tree", options=(*_TREE_OPTIONS, "draft_window"), draft_model="required",
               auto_draft=True, draft_skip="refused"),
    MethodSpec("prompt-lookup", "n-gram matches in the prompt and the text so far",
               "specula.drafters.prompt_lookup", bench_default=True),
    MethodSpec("token-recycling", "an adjacency matrix of the target's past candidate tokens",
               "specula.drafters.token_recycling", options=("recycling_state",)),
    MethodSpec("rest", "retrieval from a datastore of text (--datastore)", "specula.drafters.rest",
               options=("datastore",), datastore=True),
    MethodSpec("layer-skip", "the target itself with decoder sub-layers skipped (SWIFT)",
               "specula.drafters.layer_skip", options=("num_draft_tokens",), draft_skip="drafts",
               layer_skipping=True),
    MethodSpec("eagle", "an EAGLE head over the target's features", "specula.drafters.eagle",
               options=_HEAD_OPTIONS, head="eagle", features=True),
    MethodSpec("eagle3", "an EAGLE-3 head over three depths of the target's features", "specula.drafters.eagle3",
               options=_HEAD_OPTIONS, head="eagle3", features=True),
    MethodSpec("medusa", "Medusa heads over the target's features", "specula.drafters.medusa",
               options=_HEAD_OPTIONS, head="medusa", features=True),
    MethodSpec("hydra", "Hydra heads over the target's features", "specula.drafters.hydra",
               options=_HEAD_OPTIONS, head="hydra", features=True),
    MethodSpec(DEFAULT_METHOD, "every drafter available, trees merged and sized by the planner",
               members=_FUSION_MEMBERS, draft_model="optional", auto_draft=True, draft_skip="drafts"),
)}
"""Every method, in help order."""


def get_method(name: str | MethodSpec) -> MethodSpec:
    """The row of a method name (a row is returned as is); a `ConfigError` lists the names for an
    unknown one (before any model is loaded)."""
    if isinstance(name, MethodSpec):
        return name
    spec = METHODS.get(name)
    if spec is None:
        raise ConfigError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return spec


def methods_taking(option: str) -> list[str]:
    """Names of the methods whose command-line options include `option` (for help texts)."""
    return [spec.name for spec in METHODS.values() if option in spec.options and not spec.members]


def layer_skipper() -> MethodSpec:
    """The method that drafts with the target's own layers skipped (what `--draft skip` drafts with)."""
    return next(spec for spec in METHODS.values() if spec.layer_skipping)


def first_drafting_with_model() -> MethodSpec:
    """The first method that cannot draft without a draft model (one that makes `api.load` load it)."""
    return next(spec for spec in METHODS.values() if spec.draft_model == "required")


def bench_defaults(has_draft: bool) -> list[str]:
    """The methods the bench runs when `--methods` is not given: the `bench_default` rows, those that
    need a draft model last and only `has_draft`."""
    rows = [spec for spec in METHODS.values() if spec.bench_default]
    return ([spec.name for spec in rows if spec.draft_model != "required"]
            + [spec.name for spec in rows if spec.draft_model == "required" and has_draft])


NO_HEAD = "none"
"""`--head none` (a bench variant `fusion:head=none`): no trained head, not even the installed one."""


def default_head(method: str | MethodSpec, target_name: str | None) -> Path | None:
    """`--head`'s default for a method: the head of its kind installed for the target
    (`specula models install`), or None; for `fusion`, the first installed head of its members'
    kinds (eagle3 first). Measured on SmolLM2 with the shipped eagle3 head (10,265 training prompts,
    docs/training.md): fusion with it (token recycling then left out) ran 1.28 / 1.28 / 1.33x of
    fusion without it on the everyday set (three runs) and 1.04 / 1.04 / 1.05x on Spec-Bench
    (three runs), where prompt lookup finds most of what is accepted and the planner's cost view
    keeps the head from drafting where it does not pay. Beside a draft model (Qwen2.5-Coder-1.5B's
    head with its 0.5B companion) the head drafts after it and its chains are valued by what they
    add to the draft model's (`planner.select.chain_lookahead`): fusion with it ran 1.04 / 1.02x of
    fusion without it on the everyday set and 1.01 / 1.01x on Spec-Bench (two runs each,
    docs/training.md)."""
    spec = get_method(method)
    kinds = [spec.head] if spec.head is not None else [
        kind for kind in (get_method(m.method).head for m in spec.members) if kind is not None]
    from specula.drafters.heads.shipped import default_head as installed_head

    for kind in kinds:
        found = installed_head(target_name, kind)
        if found is not None:
            return found
    return None


def spelled(option: str) -> str:
    """The command-line flag of an option: `tree_depth` -> `--tree-depth` (`target_name`, the target's name:
    `--target`)."""
    return "--target" if option == "target_name" else "--" + option.replace("_", "-")


def flag_spellings(options: Iterable[str] = ()) -> dict[str, str]:
    """{option: its flag} (`spelled`) for every option the command line exposes for a method
    (`MethodSpec.cli_options`) and each of `options` (others with a flag of the same name: the engine's limits,
    sampling parameters): how the command line writes an error about an option (`in_flags`)."""
    names = {name for spec in METHODS.values() for name in spec.cli_options()} | set(options)
    return {name: spelled(name) for name in sorted(names)}


_NUMBER = r"-?(?:\d+(?:\.\d+)?(?:e[+-]?\d+)?|inf|nan)"
"""A number as Python writes an int or a float (`in_flags`)."""


def in_flags(message: str, spellings: dict[str, str], keep: Iterable[str] = ()) -> str:
    """`message` (the library's, naming options as Python does) with each option of `spellings` that is written
    with an underscore (`tree_depth`; a one-word option reads the same either way, and is often an English word:
    head) replaced, as a whole word, by its flag (`--tree-depth`), and any option written as a keyword
    replaced by its flag: with a placeholder value in capitals (`head=FILE`, `tree_depth=N`), a value that is a
    lowercase word (`head=none`, `tree_sampling=iid`), a string in double quotes or a number (`draft="skip"`,
    `epochs=0`, `lr=1e-05`, `epochs=inf`), the flag and the value (`--head FILE`, `--head none`, `--draft skip`,
    `--epochs 0`); with a string in single quotes (a path's repr: `out='a b'`), the flag and the string as it is
    (`--out 'a b'`); alone (`answers=`, the keyword itself), the flag (`--answers`). A spelling of a keyword with
    its value (`cache_features=False`: `--no-feature-cache`, a command's own) is replaced as a whole word. Those in
    `keep` stay (a bench variant's own options, which it spells as the library does: `tree_depth=0`), and those
    right after a colon (a variant written out: `fusion:head=none`)."""
    kept = set(keep)
    named = [n for n in spellings if n not in kept]
    for names, pattern, write in (
            (named, r'(?<![\w:-])({})=(?:"([^"\s]+)"|(\'[^\']*\'|[A-Z]+|' + _NUMBER + r'|[a-z][a-z_]*)(?![\w-]|\.\d))',
             lambda m: f"{spellings[m.group(1)]} {m.group(2) or m.group(3)}"),
            (named, r"(?<![\w:-])({})=(?=[\s,;:)]|$)", lambda m: spellings[m.group(1)]),
            ([n for n in named if "_" in n or "=" in n], r"(?<![\w:-])({})(?![\w-])",
             lambda m: spellings[m.group(1)])):
        if names:  # the longest first
            words = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
            message = re.sub(pattern.format(words), write, message)
    return message


def check_drafting_used(methods: Iterable[str | MethodSpec], given: Sequence[str], what: str = f"method {PLAIN}",
                        fix: str = f'pass a method that drafts (e.g. method="{DEFAULT_METHOD}")') -> None:
    """Refuse options that only matter when drafting (`given`, each spelled as its reader writes it: `max_tree_nodes`
    for `api.load`, `--max-tree-nodes` on the command line) when every one of `methods` is plain decoding: method
    none drafts nothing, so each was ignored without a word. The one check and wording of this refusal (`api.load`,
    `Specula`, `specula generate` / `serve` / `run-batch` / `bench`): a ConfigError naming `what` runs and the `fix`."""
    if given and all(get_method(m).name == PLAIN for m in methods):
        raise ConfigError(f"{given[0]} only matters when drafting, and {what} drafts nothing; drop {given[0]} or {fix}")


def is_given(value: Any) -> bool:
    """Whether an option's value was given: not None (left out) and not False (a switch left off). 0 is given
    (`head_window=0`: the whole context, `draft_window=0`: the whole prompt), though `0 in (None, False)`."""
    return value is not None and value is not False


NO_DRAFT_GIVEN = "no draft model given"
"""Why a fused method drafts without a draft model, by default (`check_draft_options_read`)."""


def draft_options_unread(method: str | MethodSpec, options: dict[str, Any], draft: bool,
                         draft_skip: bool = False) -> list[str]:
    """The options of `options` given (not None / False) that fused `method` hands only to its members drafting with a
    model (the draft model's; layer skipping's), when none of those joins: the draft model's without `draft`, layer
    skipping's without `draft_skip` (`num_draft_tokens` and `draft_window` with neither; `draft_window` with
    `draft_skip`). Nothing reads them: each was ignored without a word. [] for a method of one drafter."""
    spec = get_method(method)

    def joins(member: Member) -> bool | None:
        """Whether a member drafting with a model joins (None: it drafts without one, whenever it joins)."""
        row = get_method(member.method)
        return bool(draft) if row.draft_model == "required" else bool(draft_skip) if row.layer_skipping else None

    drafted = [name for m in spec.members if get_method(m.method).draft_model == "required" for name in m.forwards]
    return [name for name in dict.fromkeys(drafted) if is_given(options.get(name))
            and all(joins(m) is False for m in spec.members if name in m.forwards)]


def not_read_when_skipping(name: str, method: str) -> ConfigError:
    """The refusal of a draft model's option `name` given to `method` drafting with draft="skip" (the target's own
    layers skipped, which read no such option): fusion's draft_window (`check_draft_options_read`), draft-model's
    draft_window or adaptive (`drafters.make_drafters`). One wording for both."""
    return ConfigError(f"{name} is for a draft model, and {method} drafts with the target's own layers skipped here, "
                       f"not a draft model; drop {name}, or give a draft model with draft=MODEL instead")


def check_draft_options_read(method: str | MethodSpec, options: dict[str, Any], draft: bool, draft_skip: bool = False,
                             why: str = NO_DRAFT_GIVEN) -> None:
    """Refuse what `draft_options_unread` finds: `num_draft_tokens` given to fusion with no draft model and no layer
    skipping, `draft_window` with no draft model, was ignored without a word. A ConfigError naming the option, `why`
    no draft model drafts (`NO_DRAFT_GIVEN`, or `--draft auto`'s reason) and the fix (`draft=MODEL`, which the
    command line writes `--draft MODEL`). One check for `make_drafters`, `api.load` and the bench."""
    unread = draft_options_unread(method, options, draft, draft_skip)
    if not unread:
        return
    name, spec = unread[0], get_method(method)
    if draft_skip:
        raise not_read_when_skipping(name, spec.name)
    skips = any(name in m.forwards and get_method(m.method).layer_skipping for m in spec.members)
    readers, drafts = ("a draft model or layer skipping", "with neither") if skips else ("a draft model", "without one")
    raise ConfigError(f"{name} is for {readers}, and {spec.name} drafts {drafts} here ({why}); give it a draft model "
                      f"with draft=MODEL, or drop {name}")


def check_switches(method: str | MethodSpec, options: dict[str, Any]) -> None:
    """Refuse a value but True or False (None: the default) for a switch of `method` (`MethodSpec.switches`): a
    ConfigError naming the option and what it takes. "maybe", 1 or "no" read as on without a word (`api.load`, a
    bench variant's `draft-model:adaptive=maybe`)."""
    for name in get_method(method).switches():
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{name} is a switch: it takes true or false, got {value!r}")


def article(word: str) -> str:
    """"a" or "an" as `word`'s first letter sounds: "an" before a, e, i, o; "a" before a u that reads "you"
    (a user), as every word these messages name does, and before the rest."""
    return "an" if word[:1].lower() in "aeio" else "a"


def an(word: str) -> str:
    """`word` after its article, for a head kind in a message: "an eagle3", "a medusa"."""
    return f"{article(word)} {word}"


def or_list(names: list[str]) -> str:
    """"a, b or c"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


__all__ = ["DEFAULT_METHOD", "HEAD_ONLY", "METHODS", "NO_DRAFT_GIVEN", "NO_HEAD", "PLAIN", "Member", "MethodSpec",
           "an", "article", "bench_defaults", "check_draft_options_read", "check_drafting_used", "check_switches",
           "default_head", "draft_options_unread", "first_drafting_with_model", "flag_spellings", "get_method", "in_flags",
           "is_given", "layer_skipper", "methods_taking", "not_read_when_skipping", "or_list", "spelled"]
