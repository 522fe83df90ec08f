"""`specula` command line. Each subcommand lives in `specula.commands.<name>` and
exposes `register(subparsers)`; handlers raise `SpeculaError` for bad input, which is
printed as one line (`error: ...`) with exit code 2 and no traceback."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from specula.errors import SpeculaError

# Subcommand modules, in help order. A module that fails to import is a bug, not hidden.
COMMANDS = ("generate", "models", "bench", "profile", "train", "datastore", "analyze", "serve", "run_batch", "cache")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A value that starts like a negative number is a value, not an option: `--sizes -1,0` reaches the
        # option's own check (which names what it allows) instead of "expected one argument". Python 3.11 took
        # only -N and -N.N for numbers; newer argparse reads any "-" + digit (or "-." + digit) as this does.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> None:  # argparse's own usage errors: exit 2, one line
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specula", description="Lossless speculative decoding for causal language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"specula.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"specula.commands.{name}":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specula.commands.common import set_threads

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        set_threads(getattr(args, "threads", None))  # before anything loads (`commands.common.add_threads_arg`)
        return int(args.handler(args) or 0)
    except SpeculaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`specula generate ... | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
