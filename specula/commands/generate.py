"""`specula generate`: one prompt, printed text and a one-line stats summary (or JSON)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from specula.commands.common import (
    add_method_args, add_model_args, add_penalty_args, add_sampling_args, flags_in_errors, load_spec, method_help,
    sampling_params,
)
from specula.errors import ConfigError
from specula.methods import PLAIN
from specula.token_bytes import TokenBytes


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt with speculative decoding",
                       description="Generate from one prompt. Greedy output is identical to plain decoding.")
    add_model_args(p)
    p.add_argument("--method", default=None, help=method_help(default=True))
    p.add_argument("--prompt", required=True,
                   help="prompt text (the chat template is applied unless --raw); - reads it from standard input")
    add_method_args(p)
    add_sampling_args(p)
    p.add_argument("--compare", action="store_true",
                   help=f"also run plain decoding (method {PLAIN}) on the same prompt and print the speedup")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="also report each new token's log-probability under the target and the N most likely "
                        "tokens at its position (0-20; the target's raw distribution, as vLLM's logprobs; "
                        "outputs do not change): a table on standard error, or `logprobs` in --json")
    add_penalty_args(p)
    add_constraint_args(p)
    p.set_defaults(handler=run)


def add_constraint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("structured output (docs/structured.md)").add_mutually_exclusive_group()
    g.add_argument("--json-object", action="store_true",
                   help="the output is one JSON object (any keys and values)")
    g.add_argument("--json-schema", metavar="FILE|JSON",
                   help="the output is JSON valid under the JSON schema in FILE, or given inline ('{...}')")
    g.add_argument("--regex", metavar="RE", help="the whole output matches the regular expression RE (Rust syntax)")
    g.add_argument("--grammar", metavar="FILE",
                   help="the output follows the context-free grammar in FILE (Lark as llguidance reads it, or GBNF)")


def constraint_from_args(args: argparse.Namespace):
    """The `Constraint` the flags ask for (None: unconstrained); a file that cannot be read is a
    ConfigError naming it. `--json-schema` takes the schema inline too: a value starting with `{`
    that names no file."""
    from specula.constraints import Constraint
    def read(path: str, what: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:  # a binary file, or another encoding: was a traceback
            raise ConfigError(f"the {what} file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                              f"give a text file") from None

    if args.json_object:
        return Constraint.json()
    if args.json_schema:
        inline = args.json_schema.lstrip().startswith("{") and not os.path.exists(args.json_schema)
        return Constraint.json_schema(args.json_schema if inline else read(args.json_schema, "JSON schema"))
    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.grammar:
        return Constraint.grammar(read(args.grammar, "grammar"))
    return None


def prompt_from_args(args: argparse.Namespace) -> str:
    """`--prompt`'s text; `-` reads it from standard input (all of it; empty is a ConfigError)."""
    if args.prompt == "":
        raise ConfigError("--prompt is empty: give some text, or - to read it from standard input")
    from specula.prompts import unicode_problem

    text = args.prompt if args.prompt != "-" else sys.stdin.read()
    if args.prompt == "-" and not text.strip():
        raise ConfigError("--prompt - read an empty prompt from standard input; pipe the prompt in, "
                          "e.g. echo 'Hello' | specula generate ... --prompt -")
    problem = unicode_problem(text)  # bytes that are not UTF-8 (read with surrogateescape): before any load
    if problem:
        raise ConfigError(f"--prompt is not valid Unicode: {problem}")
    return text


def run(args: argparse.Namespace) -> int:
    from specula.models.loading import process_age_seconds

    # validate everything before loading models
    with flags_in_errors(args):  # a bad --logprobs names its flag
        params = replace(sampling_params(args), logprobs=args.logprobs)
    prompt = prompt_from_args(args)
    constraint = constraint_from_args(args)
    if constraint is not None:
        constraint.grammar_text()  # a schema, regex or grammar the library cannot compile fails here, in one line
    spec, method = load_spec(args)
    if args.compare and method == PLAIN:
        print("note: --compare has nothing to compare with: the method is plain decoding (none)", file=sys.stderr)
    ids = spec.encode(prompt, raw=args.raw)
    compare = args.compare and method != PLAIN
    if compare:  # both timed runs warm: the process's first request pays one-time costs (a prefill of a
        # length not run yet, first calls), which charged to the method alone read 0.63-1.16x for plain
        # decoding against itself
        for warm in (spec, spec.baseline()):
            warm.generate(ids, params=replace(params, max_new_tokens=2, min_new_tokens=min(2, params.min_new_tokens),
                                                      logprobs=None), constraint=constraint)
    token_ids: list[int] = []
    text_parts: list[str] = []
    logprobs: list = []
    stats = None
    first_token_s = None
    for chunk in spec.stream(ids, params=params, constraint=constraint):
        if first_token_s is None and chunk.token_ids:
            first_token_s = process_age_seconds()
        token_ids.extend(chunk.token_ids)
        text_parts.append(chunk.text)
        logprobs.extend(chunk.logprobs or ())
        stats = chunk.stats
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    baseline = None
    if compare:
        baseline = spec.baseline().generate(ids, params=params, constraint=constraint)
    if args.json:
        payload = {"text": "".join(text_parts), "token_ids": token_ids, "stats": stats.to_dict(),
                   "load": {**(spec.load_report.to_dict() if spec.load_report else {}),
                            "first_token_process_s": _round(first_token_s)}}
        if params.logprobs is not None:
            payload["logprobs"] = logprobs_json(logprobs, TokenBytes(spec.tokenizer))
        if baseline is not None:
            payload["baseline"] = baseline.stats.to_dict()
            payload["speedup"] = round(stats.tokens_per_s / baseline.stats.tokens_per_s, 3)
            # Sampled runs are two draws from the same distribution: equal or not says nothing.
            payload["identical_to_plain"] = baseline.token_ids == token_ids if params.greedy else None
        print(json.dumps(payload))
        return 0
    print()
    if params.logprobs is not None:
        print(logprobs_table(logprobs, TokenBytes(spec.tokenizer)), file=sys.stderr)
    first = f"; first token {first_token_s:.1f} s after start" if first_token_s is not None else ""
    first += " (after --compare's warm-up of both)" if first and compare else ""
    if spec.load_report is not None:
        print(spec.load_report.summary() + first, file=sys.stderr)
    print(stats.summary(), file=sys.stderr)
    if stats.planner is not None:
        print(f"planner: {stats.planner}", file=sys.stderr)
    if baseline is not None:
        print(baseline.stats.summary(), file=sys.stderr)
        print(f"speedup vs plain decoding (same run): {stats.tokens_per_s / baseline.stats.tokens_per_s:.2f}x; "
              f"{compare_verdict(baseline.token_ids == token_ids, params)}", file=sys.stderr)
    return 0


def logprobs_json(entries, token_bytes) -> list[dict]:
    """`--json`'s `logprobs`: one object per new token."""
    return [{"token_id": e.token_id, "token": token_bytes.text(e.token_id), "logprob": e.logprob, "rank": e.rank,
             "top": [{"token_id": t, "token": token_bytes.text(t), "logprob": lp} for t, lp in e.top]}
            for e in entries]


def logprobs_table(entries, token_bytes) -> str:
    """One line per new token: its position, text, logprob, rank and the alternatives asked for."""
    lines = ["logprobs (the target's; position, token, logprob, rank, most likely):"]
    for i, e in enumerate(entries):
        top = ", ".join(f"{token_bytes.text(t)!r} {lp:.3f}" for t, lp in e.top)
        lines.append(f"{i:5d}  {token_bytes.text(e.token_id)!r:>16}  {e.logprob:8.3f}  {e.rank:6d}"
                     + (f"  {top}" if top else ""))
    return "\n".join(lines)


def compare_verdict(identical: bool, params) -> str:
    """What `--compare` can say about the outputs: greedy runs must be identical to plain decoding;
    a sampled run is another draw from the same distribution, so a difference is expected."""
    if params.greedy:
        return "output identical to plain decoding" if identical else "output DIFFERENT to plain decoding"
    if params.seed is None:  # each run drew its own seed: the texts are two unrelated draws
        return ("sampled run: a draw from the same distribution as plain decoding (no --seed: each run drew "
                f"its own, so the texts {'match by chance' if identical else 'differ'}; --seed S compares one draw)")
    return ("sampled run: a draw from the same distribution as plain decoding "
            f"(with the same seed the texts {'happen to match' if identical else 'differ, as they may'})")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
