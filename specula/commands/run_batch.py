"""`specula run-batch`: an OpenAI batch file (JSONL) answered offline, as vLLM's `run-batch`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specula.commands.common import (add_method_args, add_model_args, add_prefix_cache_arg, add_tool_args,
                                     auto_tool_parser, load_spec, method_help, served_model_name)
from specula.errors import ConfigError
from specula.paths import check_not_input, check_output


def register(sub) -> None:
    p = sub.add_parser(
        "run-batch", help="answer an OpenAI batch file (JSONL of /v1/completions and /v1/chat/completions requests)",
        description="Answer every request of an OpenAI batch file offline, through the server's own checks and "
                    "responses, decoding up to --max-batch-size sequences at once (continuous batching). "
                    "Output lines are in input order; a failed request gets its error, the others their answers. "
                    "Exit status 1 when every request failed (the errors are still written), else 0.")
    add_model_args(p)
    p.add_argument("--method", default=None, help=method_help(default=True))
    add_method_args(p)
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line")
    g.add_argument("-o", "--output-file", required=True, help="where the answers go (written whole at the end)")
    g.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded at once (default 8)")
    g.add_argument("--chat-max-tokens", type=int, default=512,
                   help="max_tokens of chat requests that give none (default 512, capped by the context)")
    add_prefix_cache_arg(g)
    g.add_argument("--served-model-name", default=None,
                   help="the model id requests may name (default: the --target value; not empty)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_tool_args(p.add_argument_group("tool calling (vLLM's options)"))
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from specula.serve.batch import read_batch, run_batch

    if Path(args.input_file).is_dir():
        raise ConfigError(f"the batch file {args.input_file} is a directory; give the JSONL file of requests")
    if not Path(args.input_file).is_file():
        raise ConfigError(f"the batch file {args.input_file} does not exist")
    if args.max_batch_size < 1:
        raise ConfigError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    if args.chat_max_tokens < 1:
        raise ConfigError(f"--chat-max-tokens must be positive, got {args.chat_max_tokens}")
    check_output(args.output_file, "--output-file", "file")
    check_not_input(args.output_file, "--output-file", [("the batch file", args.input_file)])
    model_name = served_model_name(args)
    tool_parser = auto_tool_parser(args)
    rows = read_batch(args.input_file)  # before the model loads: an unreadable file fails at once
    spec, method = load_spec(args)
    summary = run_batch(spec, rows, args.output_file, model_name,
                        max_batch_size=args.max_batch_size, chat_max_tokens=args.chat_max_tokens,
                        progress=not args.no_progress, tool_parser=tool_parser)
    print(f"specula run-batch: {summary.requests} requests, {summary.succeeded} answered, {summary.failed} failed "
          f"(method {method}) -> {args.output_file}", file=sys.stderr)
    if summary.requests and not summary.succeeded:  # a batch where nothing went through: a script should see it
        print(f"specula run-batch: every request failed; the first: {summary.first_error}", file=sys.stderr)
        return 1
    return 0
