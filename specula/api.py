"""The Python API, mirroring `specula generate`.

    import specula.api as specula
    spec = specula.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", method="draft-model")
    out = spec.generate("Write a quicksort in Python.", max_new_tokens=128)
    print(out.text, out.stats.summary())
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Literal, Sequence

from specula.drafters import make_drafters
from specula.constraints import Constraint, as_constraint
from specula.errors import ConfigError
from specula.engine import EngineConfig, GenerationOutput, Session, SpeculativeDecoder, StreamChunk, no_prefix_cache
from specula.logprobs import TokenLogprob
from specula.methods import METHODS, PLAIN, check_drafting_used
from specula.models.base import TargetModel
from specula.models.loading import LoadConfig, LoadReport, load_backend, load_draft
from specula.planner import CostCurve, Planner
from specula.prompts import is_integer
from specula.sampling import SamplingParams

__all__ = [
    "EngineConfig", "GenerationOutput", "LoadConfig", "LoadReport", "PlannerChoice", "SamplingParams", "Session",
    "Specula", "StreamChunk", "TokenLogprob", "build_decoder", "load", "load_backend", "load_draft",
]

Prompt = str | Sequence[dict] | Sequence[int]

PlannerChoice = Planner | CostCurve | Literal["hardware", "none"]
"""How a decoder's trees are merged and sized: "hardware" (a `HardwarePlanner` on the target: the
default), a `CostCurve` (the same planner on the target with this lone-pass curve instead of one
measured or cached: `--cost-curve`), "none" (the pass-through planner: the drafters' trees as
proposed, within the engine's budget), or a planner to share. The old spellings still work: None
means "hardware", False means "none". Method none drafts nothing and gets no planner: a curve or a
planner given to it is refused (ConfigError), as `--cost-curve` is with `--method none` (`_check_drafting_used`)."""


class Specula:
    """A target (and optional draft) with one method: `generate` / `stream` text or ids, or drive
    requests step by step through sessions (`start`, `step`, `finish`: what a server batches).

    Every call taking a prompt takes text (the chat template applied unless `raw`), chat messages
    or token ids, and either `SamplingParams` fields as keywords (max_new_tokens, temperature, ...)
    or a ready `params=SamplingParams(...)`."""

    def __init__(self, target: TargetModel, tokenizer, method: str = PLAIN, draft: TargetModel | None = None,
                 *, engine: EngineConfig = EngineConfig(), planner: PlannerChoice | None = "hardware",
                 **drafter_options) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.method = method
        self.load_report: LoadReport | None = None
        """Load time and peak memory, when built by `load`."""
        _check_drafting_used(method, engine, planner, drafter_options)  # as load(); build_decoder: none no planner
        self.decoder = build_decoder(method, target, tokenizer, draft, engine=engine, planner=planner,
                                     **drafter_options)
        """The decode loop (internal: callers use the methods below)."""

    # ------------------------------------------------------------------ facts
    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation (unless `ignore_eos`)."""
        return self.decoder.eos_token_ids

    @property
    def engine_config(self) -> EngineConfig:
        """The decode loop's limits."""
        return self.decoder.config

    @property
    def planned(self) -> bool:
        """Whether a planner sizes the trees (False: the drafters' trees as proposed)."""
        return self.decoder.planned

    @property
    def lossless(self) -> bool:
        """Whether greedy output must equal plain decoding (no drafter is lossy)."""
        return not any(getattr(d, "lossy", False) for d in self.decoder.drafters)

    def drafter_memory_bytes(self) -> int | None:
        """The drafters' memory (`memory_bytes`, attribute or method) summed; None when none says."""
        values = [getattr(d, "memory_bytes", None) for d in self.decoder.drafters]
        values = [int(v() if callable(v) else v) for v in values if v is not None]
        return sum(values) if values else None

    def baseline(self) -> "Specula":
        """Plain decoding (method none) on the same target, tokenizer and engine limits (bar the drafting ones,
        `EngineConfig.without_drafting_limits`): what `--compare` measures against."""
        return Specula(self.target, self.tokenizer, PLAIN, engine=self.engine_config.without_drafting_limits())

    # ------------------------------------------------------------------ one request
    def encode(self, prompt: Prompt, raw: bool = False, *, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> list[int]:
        """Token ids of a prompt: text (chat template applied unless raw), messages, or ids. The chat
        template's options are vLLM's `LLM.chat`'s: `continue_final_message=True, add_generation_prompt=False`
        leaves the last message open for the model to continue (prefill an assistant answer, then
        `generate(spec.encode(messages, ...))`)."""
        from specula.prompts import encode_prompt

        return encode_prompt(self.tokenizer, prompt, raw=raw, add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message)

    def generate(self, prompt: Prompt, *, raw: bool = False, params: SamplingParams | None = None,
                 constraint: Constraint | dict | str | None = None, **sampling) -> GenerationOutput:
        """Generate; keyword arguments are `SamplingParams` fields (max_new_tokens, temperature, ...).
        `constraint`: the output must match it (`specula.constraints.Constraint`; a dict is a JSON
        schema, "json" any JSON object): the target's distribution is masked to it, so greedy output
        is constrained plain greedy decoding's, and tokens it forces are drafted for free."""
        return self.decoder.generate(self.encode(prompt, raw), _params(params, sampling), as_constraint(constraint))

    def generate_batch(self, prompts: Sequence[Prompt], *, raw: bool = False,
                       params: SamplingParams | Sequence[SamplingParams] | None = None,
                       constraint: Constraint | dict | str | None = None, max_batch_size: int = 8,
                       progress: bool = False, **sampling) -> list[GenerationOutput]:
        """Generate for many prompts at once (vLLM's `LLM.generate`): continuous batching, up to
        `max_batch_size` requests decoded together (their trees verified in one packed target pass
        where the backend batches, sized for the batch's goodput), each joining as another
        finishes. Outputs in prompt order, each what `generate` gives that prompt alone. `params`:
        one for all, or one per prompt; `progress` shows a bar. A lone prompt (a string, token ids, one
        chat's messages) is one prompt, as in vLLM."""
        if not is_integer(max_batch_size) or max_batch_size < 1:  # before anything runs or is timed
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        prompts = [prompts] if _lone_prompt(prompts) else list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            each = [_params(params, sampling)] * len(prompts)
        else:
            if sampling:
                raise ConfigError("give per-prompt params= or sampling keywords, not both")
            each = [_checked(p) for p in params]
            if len(each) != len(prompts):
                raise ConfigError(f"params= has {len(each)} entries for {len(prompts)} prompts: give one per prompt")
        ids = []
        for i, (prompt, prompt_params) in enumerate(zip(prompts, each)):  # every prompt checked before anything runs
            try:
                ids.append(self.decoder.check_request(self.encode(prompt, raw), prompt_params))
            except ConfigError as exc:  # which of many prompts: the message alone did not say
                if len(prompts) > 1:
                    exc.add_note(f"(prompts[{i}] of the batch)")
                raise
        self.prepare_batch(max_batch_size)
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        bar = _progress(len(prompts), progress)
        try:
            jobs = ((i, ids[i], each[i]) for i in range(len(prompts)))
            for i, out in self.decoder.generate_many(jobs, max_batch_size, as_constraint(constraint)):
                outputs[i] = out
                bar.update(1)
        finally:
            bar.close()
        return outputs  # type: ignore[return-value]

    def stream(self, prompt: Prompt, *, raw: bool = False, params: SamplingParams | None = None,
               constraint: Constraint | dict | str | None = None, **sampling) -> Iterator[StreamChunk]:
        """One chunk per decode step; the last has `finished` and the final stats."""
        return self.decoder.stream(self.encode(prompt, raw), _params(params, sampling), as_constraint(constraint))

    # ------------------------------------------------------------------ sessions
    def start(self, prompt: Prompt, *, raw: bool = False, params: SamplingParams | None = None,
              constraint: Constraint | dict | str | None = None, max_prefill_tokens: int | None = None,
              **sampling) -> Session:
        """A new request, prefilled and ready to step (the prompt is checked against the context
        window). Free it with `finish` once done, failed or abandoned. With `max_prefill_tokens`, only
        that many prompt tokens run now (chunked prefill): `prefill` runs the rest, a chunk at a time,
        between other sessions' steps, until `session.prefilled`."""
        return self.decoder.start(self.encode(prompt, raw), _params(params, sampling), as_constraint(constraint),
                                  max_prefill_tokens)

    def prefill(self, session: Session, max_tokens: int | None = None) -> bool:
        """Run the next `max_tokens` of a session's prompt (None: the rest): True once it is prefilled and may
        step. A failure frees the session and raises."""
        return self.decoder.prefill(session, max_tokens)

    def step(self, sessions: Sequence[Session]) -> list[StreamChunk]:
        """Advance every running session by one decode step (their trees verified in one packed
        target pass where the backend batches): one chunk per session, in order. A chunk with
        `error` set ends its session alone; a finished session gets an empty chunk."""
        return self.decoder.step(sessions)

    def finish(self, session: Session) -> None:
        """Free a session's caches and drafter state (idempotent); its final stats are kept."""
        self.decoder.finish(session)

    def prepare_batch(self, max_batch_size: int) -> None:
        """Get ready to step up to `max_batch_size` sessions together (the planner times packed
        passes once, cached); a server calls this at start-up."""
        self.decoder.planner.prepare_batch(max_batch_size)


def _progress(total: int, show: bool):
    """A tqdm bar over `total` prompts (disabled unless `show`)."""
    from tqdm import tqdm

    return tqdm(total=total, disable=not show, unit="prompt", desc="generate")


def _lone_prompt(prompts: Any) -> bool:
    """Whether `generate_batch`'s argument is one prompt, not a list of them: a string, a list of
    token ids, or one chat's messages (dicts)."""
    if isinstance(prompts, str):
        return True
    if hasattr(prompts, "tolist") and getattr(prompts, "ndim", 2) == 1:  # a 1-D numpy array or tensor of ids
        return True
    items = list(prompts) if isinstance(prompts, (list, tuple)) else []
    return bool(items) and (all(is_integer(x) for x in items) or all(isinstance(x, dict) for x in items))


_KEYWORD_HINTS = {
    "max_tokens": "the new tokens' limit is max_new_tokens (as in transformers)",
    "min_tokens": "the least number of new tokens is min_new_tokens (as in transformers)",
    "do_sample": "set temperature > 0 to sample (0, the default, is greedy)",
    "stop_strings": "stop strings are stop=",
    "eos_token_id": "stop on other token ids with stop_token_ids=",
    "n": "one output per call: give generate_batch the prompt n times, with params= a SamplingParams each "
         "(its own seed)",
    "num_return_sequences": "one output per call: give generate_batch the prompt n times, with params= a "
                            "SamplingParams each (its own seed)",
    "continue_final_message": "the chat template's options are encode()'s: generate(spec.encode(messages, "
                              "continue_final_message=True, add_generation_prompt=False))",
    "add_generation_prompt": "the chat template's options are encode()'s: generate(spec.encode(messages, "
                             "add_generation_prompt=False))",
}
"""What a keyword of transformers' `generate` or vLLM's `SamplingParams` that SamplingParams lacks is here."""


def _params(params: SamplingParams | None, sampling: dict) -> SamplingParams:
    """The request's sampling parameters: `params` as given, or built from keyword fields."""
    if params is None:
        unknown = sorted(set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)})
        if unknown:
            name = unknown[0]
            hint = _KEYWORD_HINTS.get(name, "see specula.sampling.SamplingParams for the fields")
            raise ConfigError(f"unknown sampling keyword {name!r}: {hint}")
        return SamplingParams(**sampling)
    if sampling:
        raise ConfigError(f"give either params= or sampling keywords ({', '.join(sorted(sampling))}), not both")
    return _checked(params)


def _checked(params: Any) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ConfigError(f"params= takes a SamplingParams (specula.sampling.SamplingParams(...)), got "
                          f"{type(params).__name__}; or pass its fields as keywords")
    return params


def build_decoder(method: str, target: TargetModel, tokenizer=None, draft: TargetModel | None = None, *,
                  engine: EngineConfig = EngineConfig(), planner: PlannerChoice | None = "hardware",
                  **drafter_options) -> SpeculativeDecoder:
    """The decoder for a method: its drafters, and the planner that merges and sizes their trees
    every step (`PlannerChoice`: the hardware-aware planner by default; method `none` drafts
    nothing and never gets one: a planner given here is dropped, so one loop can build every method
    with one planner; `Specula` and `load` refuse it). "none" verifies what the drafters propose as it
    is (within the engine's budget: research runs and tests that need the same trees whatever the timing)."""
    drafters = make_drafters(method, target=target, draft=draft, tokenizer=tokenizer, **drafter_options)
    planner = resolve_planner("none" if method == PLAIN else planner, target)
    return SpeculativeDecoder(target, drafters, tokenizer, planner=planner, config=engine, method=method)


def _check_drafting_used(method: str, engine: EngineConfig, planner: object,
                         options: dict[str, Any] | None = None) -> None:
    """For method none (plain decoding: nothing drafted), refuse what only matters when drafting, each ignored
    without a word before: a drafting limit of `engine` set away from its default
    (`EngineConfig.drafting_limits_set`: max_tree_nodes), a planner other than the defaults ("hardware" / None,
    "none" / False: a `CostCurve`, a `Planner`), and a drafter option of `options` given (not None) that some method
    takes. One check and wording with the command line's (`methods.check_drafting_used`)."""
    if method != PLAIN:
        return
    default = planner is None or planner is False or (isinstance(planner, str) and planner in ("hardware", "none"))
    if isinstance(planner, (str, bool)) and not default:
        resolve_planner(planner, None)  # raises: a spelling no method takes, named as for any method
    drafting = {name for spec in METHODS.values() for name in spec.accepted_options()}
    options = dict(options or {})
    if options.get("draft_skip"):  # --draft skip's layers go with the draft, which method none ignores (load's draft=)
        options.pop("skip_layers", None)
    given = sorted(name for name, value in options.items() if name in drafting and value is not None)
    check_drafting_used([method], [*engine.drafting_limits_set(), *([] if default else ["planner="]), *given])


def resolve_planner(choice: PlannerChoice | None | Literal[False], target: TargetModel) -> Planner:
    """The planner a `PlannerChoice` names (None: "hardware", False: "none", the old spellings)."""
    from specula.planner import HardwarePlanner, PassThroughPlanner

    if choice is None or (isinstance(choice, str) and choice == "hardware"):
        return HardwarePlanner(target)
    if isinstance(choice, CostCurve):  # the target still goes in: batch tables, padding, packed passes
        return HardwarePlanner(target, curve=choice)
    if choice is False or (isinstance(choice, str) and choice == "none"):
        return PassThroughPlanner()
    if isinstance(choice, (str, bool)):
        raise ConfigError(f"planner {choice!r}: give \"hardware\", \"none\" or a Planner")
    return choice


def _check_load_keywords(method: str, accepted: Sequence[str], options: dict[str, Any]) -> None:
    """A keyword of `load` that belongs elsewhere, named with where it goes before any model loads (it
    was 'method fusion does not take device; its options are ...', after the target had loaded):
    LoadConfig's fields (device, dtype, quantize, ...) and sampling parameters (temperature, ...)."""
    for name in sorted(set(options) - set(accepted)):
        if name in {f.name for f in dataclasses.fields(LoadConfig)}:
            where = f"how models load is config=LoadConfig({name}=...) (specula.api.LoadConfig)"
        elif name in {f.name for f in dataclasses.fields(SamplingParams)} or name in _KEYWORD_HINTS:
            where = "sampling parameters go to generate(), stream(), start() or generate_batch(), not load()"
        else:
            continue  # the method's own check names its options
        raise ConfigError(f"load() does not take {name} for method {method}: {where}")


def load(target: str, draft: str | None = "auto", method: str | None = None,
         config: LoadConfig = LoadConfig(), draft_quantize: str | None = None, skip_layers: str | None = None,
         draft_vocab: str | int = "auto", **drafter_options) -> Specula:
    """Load target (and draft) and build a `Specula`. The method defaults to `fusion` (every
    available drafter, sized by the hardware-aware planner). `draft`: a model spec, "self" (the
    target's own weights, int8 unless `draft_quantize` says otherwise), "auto" (the default: for the
    draft methods on CPU, targets of >= 1B parameters get their embedded companion draft when it is
    installed, in int4 where specula's CPU kernels run (else int8), else "self" in int8, unless
    `draft_quantize` says otherwise; else none), "skip"
    (the target itself with decoder sub-layers skipped, SWIFT; `skip_layers` fixes the set, else it
    is searched on the fly) or None / "none". A draft model is loaded only for the methods that
    draft with one (`MethodSpec.draft_model`: fusion, draft-model, draft-tree); others ignore `draft`.
    A method with a trained head gets the head installed for the target unless `head` is given.
    `draft_vocab` (`models.draft_vocab`): "auto" (a large-vocabulary draft scores only the 32k most
    frequent tokens where a ranking ships for its tokenizer; outputs unchanged), "full", or a
    number of tokens. The returned object's `load_report` says how long the target, the draft and
    the rest took, and which draft model was loaded (`draft`: as named, `auto` resolved; its quantization)."""
    import time

    from specula.draft_choice import AUTO_DRAFT, auto_draft, auto_draft_quantize, why_no_auto_draft
    from specula.methods import DEFAULT_METHOD, check_draft_options_read, default_head, get_method
    from specula.models.loading import (NO_DRAFT, SELF_DRAFT, DraftInfo, draft_quantize_named, hf_only_architecture,
                                        peak_rss_bytes, process_age_seconds, resolve)
    from specula.models.native import ARCHITECTURES
    from specula.models.draft_vocab import check_draft_vocab
    from specula.models.skipping import SKIP_DRAFT, check_draft_skip, check_skip_layers, draft_skip_named

    start = time.perf_counter()
    row = get_method(method or DEFAULT_METHOD)
    _check_load_keywords(row.name, row.accepted_options(), drafter_options)
    _check_drafting_used(row.name, drafter_options.get("engine", EngineConfig()), drafter_options.get("planner"),
                         drafter_options)  # before the target's load, not after
    if drafter_options.get("engine", EngineConfig()).prefix_cache_mib:  # asked for: refused before the load
        if config.backend == "hf":
            raise no_prefix_cache("the hf backend")
        arch = hf_only_architecture(target) if config.backend == "auto" else None
        if arch is not None:
            raise ConfigError(f"{target} is {arch}, which runs on the hf backend only (the native one runs "
                              f"{', '.join(ARCHITECTURES)}), and the hf backend cannot copy a sequence's cache, so "
                              "it has no prefix cache: use prefix_cache_mib=0")
    check_skip_layers(draft, skip_layers)
    draft_vocab = check_draft_vocab(draft_vocab)
    if draft in (None, "none", SKIP_DRAFT):  # fusion's num_draft_tokens with no draft model: before the load
        check_draft_options_read(row, drafter_options, False, draft == SKIP_DRAFT)
    if draft not in (None, "none", AUTO_DRAFT, SKIP_DRAFT):
        if row.draft_model == "no":
            draft = None  # this method drafts without a draft model: loading one would only cost time and memory
        elif draft != SELF_DRAFT:
            resolve(draft)  # a draft that cannot load fails now, not after the target's load (up to a minute)
    target_report: dict = {}
    target_lm, tokenizer = load_backend(target, config, "target", report=target_report)
    if draft == AUTO_DRAFT:
        draft = auto_draft(row, target_lm, target)
        draft_quantize = draft_quantize or (auto_draft_quantize(draft, config) if draft is not None else None)
        if draft is None:  # an option for the draft model would be ignored: say why there is none
            check_draft_options_read(row, drafter_options, False, why=why_no_auto_draft(row, target_lm))
    if draft == SKIP_DRAFT:  # no draft model: the target drafts for itself
        check_draft_skip(target_lm, skip_layers, draft_quantize)
        drafter_options.update(draft_skip=True, skip_layers=skip_layers)
        draft = None
    draft_lm = None
    draft_report: dict = {}
    if draft is not None and draft != "none":
        draft_start = time.perf_counter()
        with draft_quantize_named(draft, draft_quantize):  # load_draft names it quantize
            draft_lm = load_draft(draft, tokenizer, target_lm, config, target_name=target, quantize=draft_quantize,
                                  report=draft_report, vocab=draft_vocab)
        draft_report["seconds"] = time.perf_counter() - draft_start  # the compatibility check included
    if drafter_options.get("head") is None and "head" in row.accepted_options():  # a head method, or fusion
        drafter_options["head"] = default_head(row, target)
    if drafter_options.get("head") is not None:
        drafter_options.setdefault("target_name", target)
    with draft_skip_named(bool(drafter_options.get("draft_skip"))):  # its errors name load's draft="skip"
        spec = Specula(target_lm, tokenizer, row.name, draft_lm, **drafter_options)
    total = time.perf_counter() - start
    target_s, draft_s = target_report.get("seconds", 0.0), draft_report.get("seconds", 0.0)
    spec.load_report = LoadReport(target_s, draft_s, max(0.0, total - target_s - draft_s), total, peak_rss_bytes(),
                                  target_report.get("prepared"), draft_report.get("prepared"),
                                  process_age_seconds(), draft_report.get("vocab"),
                                  DraftInfo(draft, draft_report.get("quantize")) if draft_lm is not None else NO_DRAFT)
    return spec
