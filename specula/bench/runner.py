"""The benchmark loop: every method on prompt 1 (all turns), then prompt 2, ...

Rules (also in docs/bench.md):
- One warm-up generation per method (untimed) before the first timed prompt.
- Methods are interleaved per prompt, their order rotated by one each prompt, so slow drifts
  of the machine hit every method alike.
- `repeats` rounds: the whole prompt set again, each round on methods built afresh (no drafter
  state learned in an earlier round: a planner's acceptance, Token Recycling's matrix), each after
  its own warm-up, so every round measures what a new process gets; records carry their round and
  the summary gives each method's speedup min / median / max over the rounds.
- Multi-turn prompts (MT-bench): turn k is asked after the method's OWN answers to turns
  1..k-1 (decoded text, chat-templated again), as Spec-Bench does. Its turns share the context
  window (`turn_budget`), and a prompt with a turn that cannot fit is refused before any timing
  (`check_prompts_fit`).
- Everyone stops at EOS (the same EOS ids) or after max_new_tokens; with `ignore_eos` every
  method generates exactly max_new_tokens. tokens/s compares what each method produced.
- Greedy runs: each output is compared token for token with `none`'s output for the same
  prompt and turn; a lossless method that differs is a mismatch (the CLI exits 1).
- results.json and report.md are rewritten atomically after every prompt; on Ctrl-C the
  partial prompt is dropped and report.md and the plots are made from the prompts done.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from specula.bench.datasets import BenchPrompt, categories_of
from specula.bench.methods import BASELINE, BenchMethod, MethodOutput
from specula.bench.plots import write_plots
from specula.bench.report import build_document, now_iso, write_report, write_results
from specula.bench.summary import first_difference
from specula.errors import ConfigError
from specula.models.base import output_room
from specula.models.loading import NO_DRAFT
from specula.sampling import SamplingParams


@dataclass(frozen=True)
class BenchSettings:
    """How the prompts are run."""

    params: SamplingParams
    """Sampling and token budget shared by every method; `seed` is the base of per-turn seeds."""
    raw: bool = False
    """Encode prompts as plain text (no chat template; turns joined by blank lines)."""
    warmup_tokens: int = 32
    """Token budget of each method's untimed warm-up generation (0: no warm-up)."""
    progress: bool = True
    """Show a progress bar (with ETA) over (prompt, method) runs on stderr."""
    repeats: int = 1
    """Rounds over the whole prompt set; a round after the first runs on freshly built methods
    (`run_bench`'s `fresh_methods`), so each round starts from the state a new process has."""
    context_window: int | None = None
    """Tokens a prompt and its output may hold together: every method's and peer's new-token budget is
    capped to fit it, the same for all (None: `run_bench` takes the smallest of the methods' windows)."""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}; pass e.g. repeats=3")

    def budget(self, prompt_len: int) -> int:
        """max_new_tokens after a prompt of `prompt_len` tokens: `params`' own, capped at the context window."""
        if self.context_window is None:
            return self.params.max_new_tokens
        return output_room(self.context_window, prompt_len, self.params.max_new_tokens)

    def params_for(self, prompt_len: int, seed: int | None, limit: int | None = None) -> SamplingParams:
        """`params` for a prompt of `prompt_len` tokens: its `budget` (at most `limit`), min_new_tokens no
        more than that, sampled with `seed`."""
        n = self.budget(prompt_len) if limit is None else min(limit, self.budget(prompt_len))
        return replace(self.params, max_new_tokens=n, min_new_tokens=min(n, self.params.min_new_tokens), seed=seed)


def shared_window(methods: Sequence[BenchMethod]) -> int | None:
    """The smallest context window among `methods` (their `context_window`; None where none says one)."""
    windows = [w for w in (getattr(m, "context_window", None) for m in methods) if w is not None]
    return min(windows, default=None)


def windowed(settings: BenchSettings, methods: Sequence[BenchMethod]) -> BenchSettings:
    """`settings` with the context window the run keeps to: its own, else the methods' (`shared_window`)."""
    if settings.context_window is not None:
        return settings
    return replace(settings, context_window=shared_window(methods))


@dataclass
class BenchResult:
    """What `run_bench` wrote."""

    document: dict[str, Any]
    """The final results.json content."""
    out_dir: Path
    files: list[Path]
    """results.json, report.md and the plots."""

    @property
    def interrupted(self) -> bool:
        return self.document["status"] == "interrupted"

    @property
    def mismatches(self) -> list[dict[str, Any]]:
        return self.document["mismatches"]


# --------------------------------------------------------------------------- prompts


def conversation_ids(tokenizer, turns: Sequence[str], answers: Sequence[str], raw: bool = False) -> list[int]:
    """Prompt ids for turn len(turns): the user turns interleaved with the model's answers to the
    earlier ones. Chat template when the tokenizer has one (unless raw); else the texts joined by
    blank lines. An empty answer that the chat template refuses is sent as `PLACEHOLDER_ANSWER`
    (`conversation`)."""
    return conversation(tokenizer, turns, answers, raw)[0]


def conversation(tokenizer, turns: Sequence[str], answers: Sequence[str],
                 raw: bool = False) -> tuple[list[int], bool]:
    """`conversation_ids`' ids, and whether `PLACEHOLDER_ANSWER` stood in for its empty answers: a chat template
    may refuse an empty assistant message (`TemplateRefused`: its own raise_exception), whether the answer is
    still to come (`answers_left_empty`) or the model gave none (it stopped at once): the conversation then
    goes on with the placeholder, the same for every method; a template that refuses for another reason is
    refused still."""
    from specula.prompts import TemplateRefused

    try:
        return _conversation_ids(tokenizer, turns, answers, raw), False
    except TemplateRefused:
        if "" not in answers:
            raise
        return _conversation_ids(tokenizer, turns, [answer or PLACEHOLDER_ANSWER for answer in answers], raw), True


def _conversation_ids(tokenizer, turns: Sequence[str], answers: Sequence[str], raw: bool) -> list[int]:
    """`conversation_ids` as the chat template (or the raw join) writes it, answers as given."""
    from specula.prompts import encode_prompt

    if len(answers) != len(turns) - 1:
        raise ValueError(f"{len(turns)} turns need {len(turns) - 1} earlier answers, got {len(answers)}")
    if raw or not getattr(tokenizer, "chat_template", None):
        parts = [text for k, turn in enumerate(turns) for text in (turn, *answers[k : k + 1])]
        return encode_prompt(tokenizer, "\n\n".join(parts), raw=True)
    messages = []
    for k, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if k < len(answers):
            messages.append({"role": "assistant", "content": answers[k]})
    return encode_prompt(tokenizer, messages)


PLACEHOLDER_ANSWER = "OK"
"""What stands for an answer not given yet where the chat template refuses an empty assistant message."""


def with_answers_left_empty(tokenizer, turns: Sequence[str], answers: Sequence[str], raw: bool = False) -> list[int]:
    """Prompt ids for turn len(turns) after `answers` and the answers after them left empty: what the room
    of the turns still to come is measured against (`turn_budget`, `check_prompts_fit`). A chat template
    that refuses an empty assistant message (`TemplateRefused`: its own error) measures them with
    `PLACEHOLDER_ANSWER` in their place: a longer conversation, so the room counted is less, never more."""
    return answers_left_empty(tokenizer, turns, answers, raw)[0]


def answers_left_empty(tokenizer, turns: Sequence[str], answers: Sequence[str],
                       raw: bool = False) -> tuple[list[int], bool]:
    """`with_answers_left_empty`'s ids, and whether `PLACEHOLDER_ANSWER` stood in for the answers left empty (the
    chat template refused an empty one): their tokens are then in the count (`left_empty_as`)."""
    return conversation(tokenizer, turns, [*answers, *[""] * (len(turns) - 1 - len(answers))], raw)


def left_empty_as(placeholder: bool) -> str:
    """How the answers not given yet were counted (`answers_left_empty`): left empty, or as `PLACEHOLDER_ANSWER`,
    whose tokens a count then includes."""
    if placeholder:
        return f"with {PLACEHOLDER_ANSWER!r} as each earlier answer (the chat template refuses an empty one)"
    return "with the earlier answers left empty"


def turn_seed(seed: int | None, prompt_id: int | str, turn: int) -> int:
    """Seed of one sampled generation, the same for every method (and across runs)."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class TurnOutput(NamedTuple):
    """One turn of a conversation as a method ran it."""

    prompt_ids: list[int]
    output: MethodOutput
    budget: int
    """The turn's new-token budget (`turn_budget`)."""


def turn_budget(tokenizer, prompt: BenchPrompt, answers: Sequence[str],
                settings: BenchSettings) -> tuple[list[int], int]:
    """Prompt ids of the turn after `answers` and its new-token budget: `settings.budget`, and, with
    turns still to come, at most an equal share of the room the remaining turns have in the context
    window (the window less the conversation with their answers left empty). An answer therefore never
    takes the room of a later turn: with `check_prompts_fit`'s one token per turn, every turn has room."""
    turn = len(answers) + 1
    ids = conversation_ids(tokenizer, prompt.turns[:turn], answers, settings.raw)
    budget = settings.budget(len(ids))
    later = len(prompt.turns) - turn
    if later and settings.context_window is not None:
        frame = with_answers_left_empty(tokenizer, prompt.turns, answers, settings.raw)
        budget = min(budget, max(0, settings.context_window - len(frame)) // (later + 1))
    return ids, budget


def no_room(prompt: BenchPrompt, turn: int, tokens: int, window: int | None, what: str = "fills") -> ConfigError:
    """The refusal of a prompt's `turn` that takes `tokens` and `what` (fills, or leaves no room in) the context
    window: before any timing (`check_prompts_fit`) or, for an answer re-encoded longer, mid-run
    (`run_conversation`)."""
    return ConfigError(f"prompt {prompt.id} ({prompt.category}) turn {turn} takes {tokens} tokens and {what} the "
                       f"context window of {window} (the smallest of the methods' and peers'); leave it out "
                       "(--categories, --prompts) or compare a longer-context peer")


def check_prompts_fit(prompts: Sequence[BenchPrompt], tokenizer, settings: BenchSettings) -> list[str]:
    """Refuse (ConfigError), before anything is timed, a prompt with a turn that cannot fit the context
    window: its prompt with the earlier answers left empty, and one new token for it and each earlier
    turn, take more than the window. Returns notes on the multi-turn prompts whose first turn gets less
    than --max-new-tokens because its turns share the window (`turn_budget`)."""
    window = settings.context_window
    if window is None:
        return []
    shared = []
    for prompt in prompts:
        for turn in range(1, len(prompt.turns) + 1):
            ids, placeholder = answers_left_empty(tokenizer, prompt.turns[:turn], [], settings.raw)
            if len(ids) + turn > window:
                raise no_room(prompt, turn, len(ids), window, "fills" if turn == 1 else
                              f"{left_empty_as(placeholder)} leaves no room for its own and the earlier answers in")
        if len(prompt.turns) > 1:
            ids, budget = turn_budget(tokenizer, prompt, [], settings)
            if budget < settings.budget(len(ids)):
                shared.append(f"{prompt.id}: {budget}")
    if not shared:
        return []
    listed = ", ".join(shared[:5]) + (f" and {len(shared) - 5} more" if len(shared) > 5 else "")
    return [f"{len(shared)} multi-turn prompt(s) share the context window of {window} between their turns: each "
            "turn gets at most an equal share of the room left to its turns, so turn 1 gets less than "
            f"--max-new-tokens {settings.params.max_new_tokens} (prompt: turn 1's budget; {listed})"]


def run_conversation(method: BenchMethod, prompt: BenchPrompt, tokenizer,
                     settings: BenchSettings) -> list[TurnOutput]:
    """All turns of one prompt with one method: (prompt ids, output, budget) per turn."""
    answers: list[str] = []
    results = []
    for turn in range(1, len(prompt.turns) + 1):
        ids, budget = turn_budget(tokenizer, prompt, answers, settings)
        if budget < 1:  # `check_prompts_fit` leaves room for every turn; an answer re-encoded longer could not
            raise no_room(prompt, turn, len(ids), settings.context_window)
        params = settings.params_for(len(ids), turn_seed(settings.params.seed, prompt.id, turn), budget)
        out = method.generate(ids, params, prompt.constraint)
        answers.append(tokenizer.decode(out.token_ids, skip_special_tokens=True).strip())
        results.append(TurnOutput(ids, out, budget))
    return results


# --------------------------------------------------------------------------- records


def schema_valid(prompt: BenchPrompt, out: MethodOutput, tokenizer) -> bool | None:
    """Whether the output of a prompt with a schema parses as JSON valid under it (None: no schema)."""
    if prompt.schema is None or tokenizer is None:
        return None
    import jsonschema

    try:
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids, skip_special_tokens=True)), prompt.schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def run_record(prompt: BenchPrompt, turn: int, method: BenchMethod, prompt_ids: Sequence[int],
               out: MethodOutput, max_new_tokens: int, identical: bool | None, tokenizer=None,
               round_number: int = 1, ignore_eos: bool = False) -> dict[str, Any]:
    """One entry of results.json `runs` (schema in docs/bench.md)."""
    stats = out.stats
    record: dict[str, Any] = {
        "id": prompt.id,
        "round": round_number,
        "category": prompt.category,
        "source_category": prompt.source_category,
        "turn": turn,
        "method": method.name,
        "kind": method.kind,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(out.token_ids),
        "seconds": round(out.seconds, 6),
        "tokens_per_s": round(len(out.token_ids) / out.seconds, 3) if out.seconds > 0 else None,
        "finish_reason": stats.finish_reason if stats else _peer_finish(out.token_ids, method, max_new_tokens, ignore_eos),
        "identical": identical,
        "schema_valid": schema_valid(prompt, out, tokenizer),
        "token_sha1": hashlib.sha1(",".join(map(str, out.token_ids)).encode()).hexdigest(),
        "token_ids": list(out.token_ids),
        "memory_bytes": method.memory_bytes(),
        "steps": None, "mean_accepted_tokens": None, "accepted_lengths": None, "drafted_tokens": None,
        "proposed_tokens": None,
        "accepted_tokens": None, "depth_drafted": None, "depth_accepted": None, "time": None,
        "predicted_accepted": None, "paused_steps": None, "held_steps": None,
    }
    if stats is not None:
        other = max(0.0, out.seconds - stats.draft_seconds - stats.verify_seconds)
        record.update({
            "steps": stats.steps,
            "mean_accepted_tokens": round(stats.mean_accepted_tokens, 4),
            "accepted_lengths": list(stats.accepted_lengths),
            "drafted_tokens": stats.drafted_tokens,
            "proposed_tokens": stats.proposed_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "depth_drafted": list(stats.depth_drafted),
            "depth_accepted": list(stats.depth_accepted),
            "predicted_accepted": round(stats.predicted_accepted, 4) if stats.predicted_accepted else None,
            "paused_steps": (stats.planner or {}).get("paused_steps"),
            # steps each costly drafter sat out in the hold-back ({} where none did; None: no planner judged)
            "held_steps": None if "paused_steps" not in (stats.planner or {})
            else dict(stats.planner.get("held_steps", {})),
            "time": {"draft": round(stats.draft_seconds, 6), "verify": round(stats.verify_seconds, 6),
                     "other": round(other, 6), "prefill": round(stats.prefill_seconds, 6)},
        })
    return record


@torch.inference_mode()
def logit_gap(model, prompt_ids: Sequence[int], reference: Sequence[int], output: Sequence[int],
              position: int) -> float | None:
    """Plain full-forward logit of the reference token minus that of the method's token where they
    first differ: a tiny gap means a near tie (float noise), a large one a bug."""
    if position >= min(len(reference), len(output)):
        return None
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt_ids, *reference[:position]]], dtype=torch.long, device=device)  # [1, L]
    logits = model(ids).logits[0, -1].float()  # [vocab]
    return float(logits[reference[position]] - logits[output[position]])


def _is_loader(reference) -> bool:
    """A zero-argument function that loads the reference model (not a model: modules are callable too)."""
    return callable(reference) and not isinstance(reference, torch.nn.Module)


def compare_prompt(
    prompt: BenchPrompt, methods: Sequence[BenchMethod], outputs: dict[str, list[TurnOutput]],
    settings: BenchSettings, reference_model=None, tokenizer=None, round_number: int = 1,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run records of one prompt in one round (identity vs that round's `none` for greedy runs) and
    the outputs of lossless methods that differ from it (each with its logit gap, where the
    reference model is given: a model, or a zero-argument function returning one, called only when
    a mismatch needs it)."""
    reference = outputs.get(BASELINE)
    greedy = settings.params.greedy
    records, mismatches = [], []
    for method in methods:
        for turn, (ids, out, budget) in enumerate(outputs[method.name], start=1):
            identical = None
            if greedy and reference is not None:
                ref_ids, ref_out, _ = reference[turn - 1]
                diff = first_difference(ref_out.token_ids, out.token_ids)
                identical = diff is None
                if diff is not None and method.lossless:
                    gap = None
                    if reference_model is not None and ids == ref_ids:
                        model = reference_model() if _is_loader(reference_model) else reference_model
                        gap = logit_gap(model, ids, ref_out.token_ids, out.token_ids, diff) if model is not None else None
                    mismatches.append({
                        "id": prompt.id, "round": round_number, "category": prompt.category, "turn": turn,
                        "method": method.name,
                        "first_difference": diff, "same_prompt": ids == ref_ids,
                        "logit_gap": None if gap is None else round(gap, 6),
                    })
            records.append(run_record(prompt, turn, method, ids, out, budget, identical,
                                      tokenizer, round_number, settings.params.ignore_eos))
    return records, mismatches


# --------------------------------------------------------------------------- the loop


def _peer_finish(token_ids: Sequence[int], method, max_new_tokens: int, ignore_eos: bool) -> str:
    """A peer's finish reason (it reports no stats): "stop" where it ended on one of its EOS ids, as
    specula's methods say it (also when that EOS was the budget's last token), else "length" at the
    budget."""
    if token_ids and not ignore_eos and token_ids[-1] in set(getattr(method, "eos", ())):
        return "stop"
    return "length" if len(token_ids) >= max_new_tokens else "stop"


WARMUP_PROMPT = "Say hello, then name three colours."
"""What each method decodes, untimed, before a round: none of the timed prompts (a drafter that
learns across requests, token recycling's matrix, had seen the first timed prompt's answer, and that
prompt's mean accepted read 1.78 against 1.00)."""


def _warm_up(methods: Sequence[BenchMethod], tokenizer, settings: BenchSettings) -> None:
    if settings.warmup_tokens <= 0:
        return
    ids = conversation_ids(tokenizer, [WARMUP_PROMPT], [], settings.raw)
    params = settings.params_for(len(ids), turn_seed(settings.params.seed, "warm-up", 1), settings.warmup_tokens)
    for method in methods:
        method.generate(ids, params)


def run_bench(
    methods: Sequence[BenchMethod],
    tokenizer,
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    out_dir: str | Path,
    header: dict[str, Any] | None = None,
    reference_model=None,
    fresh_methods: Callable[[], Sequence[BenchMethod]] | None = None,
    fit_checked: bool = False,
) -> BenchResult:
    """Run every method on every prompt, `settings.repeats` rounds; write results.json + report.md
    after each prompt and the plots at the end (also after Ctrl-C, which ends the run with status
    "interrupted").

    header: machine / config / cost_curve / load entries for results.json. reference_model: the target's
    HF model, or a zero-argument function loading it (called at the first mismatch only), used to
    diagnose mismatches (logit gap). results.json's `peak_rss_bytes` is the process's peak resident
    size when it was written (models and every run so far). fresh_methods: builds the methods again
    (the same names, in the same order) for each round after the first; None runs every round on the
    same method objects (what their drafters learned then carries over). fit_checked: the caller has run
    `check_prompts_fit` on these prompts with `settings` and the methods' window (the command line, before
    its cost curve), so it is not run again."""
    from specula.models.loading import peak_rss_bytes

    from tqdm import tqdm

    if not prompts:
        raise ConfigError("no prompts to run: give run_bench one or more (load_prompts, select_prompts)")
    names = [m.name for m in methods]
    if BASELINE not in names:
        raise ConfigError(f"the bench needs the baseline method {BASELINE!r} among the methods")
    if len(set(names)) != len(names):
        raise ConfigError(f"method names must be distinct, got {names}")
    settings = windowed(settings, methods)
    if not fit_checked:
        check_prompts_fit(prompts, tokenizer, settings)  # a prompt that cannot run is refused before any work
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = {
        "machine": {}, "config": {}, "cost_curve": None, **(header or {}),
        "methods": [{"name": m.name, "kind": m.kind, "lossless": m.lossless,
                     "planner": bool(getattr(m, "planner", False)),
                     "draft": getattr(m, "draft", NO_DRAFT).to_dict()} for m in methods],
        "categories": categories_of(prompts),
        "greedy": settings.params.greedy,
        "repeats": settings.repeats,
        "run": {  # what this run used, whoever called it (the command line's `config` or not)
            "temperature": settings.params.temperature, "top_k": settings.params.top_k,
            "top_p": settings.params.top_p, "max_new_tokens": settings.params.max_new_tokens,
            "min_new_tokens": settings.params.min_new_tokens, "ignore_eos": settings.params.ignore_eos,
            "seed": settings.params.seed, "warmup_tokens": settings.warmup_tokens, "raw": settings.raw,
            "repetition_penalty": settings.params.repetition_penalty,
            "frequency_penalty": settings.params.frequency_penalty,
            "presence_penalty": settings.params.presence_penalty,
            "logit_bias": {str(t): b for t, b in settings.params.logit_bias},
            "fresh_rounds": fresh_methods is not None, "context_window": settings.context_window,
        },
        "started_at": now_iso(),
    }
    runs: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    done = 0

    def document(status: str) -> dict[str, Any]:
        head["peak_rss_bytes"] = peak_rss_bytes()
        return build_document(head, runs, mismatches, prompts_done=done,
                              prompts_total=len(prompts) * settings.repeats, status=status)

    def save(status: str) -> tuple[dict[str, Any], list[Path]]:
        doc = document(status)
        return doc, [write_results(out, doc), write_report(out, doc)]

    save("running")
    bar = tqdm(total=len(prompts) * len(methods) * settings.repeats, unit="run", desc="bench", file=sys.stderr,
               disable=not settings.progress, dynamic_ncols=True)
    status = "failed"
    try:
        for round_number in range(1, settings.repeats + 1):
            if round_number > 1 and fresh_methods is not None:
                methods = list(fresh_methods())
                if [m.name for m in methods] != names:
                    raise ValueError(f"fresh_methods built {[m.name for m in methods]}, not {names}")
            where = f"round {round_number}/{settings.repeats} " if settings.repeats > 1 else ""
            bar.set_postfix_str(f"{where}warm-up")
            _warm_up(methods, tokenizer, settings)
            for index, prompt in enumerate(prompts):
                shift = (index + round_number - 1) % len(methods)
                outputs: dict[str, list[TurnOutput]] = {}
                for method in [*methods[shift:], *methods[:shift]]:
                    bar.set_postfix_str(f"{where}{prompt.category} #{prompt.id} {method.name}")
                    outputs[method.name] = run_conversation(method, prompt, tokenizer, settings)
                    bar.update(1)
                records, bad = compare_prompt(prompt, methods, outputs, settings, reference_model, tokenizer,
                                              round_number)
                runs.extend(records)
                mismatches.extend(bad)
                done += 1
                save("running")
        status = "complete"
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        bar.close()
        doc, files = save(status)
        files += write_plots(out, doc)
    return BenchResult(doc, out, files)
