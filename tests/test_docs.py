"""The commands the README and docs/*.md show in their code blocks run on today's command line: a
concrete command parses as written; a synopsis (`[--option VALUE]` ...) names only options its
subcommand has. (Session 70's documented fine-tune had lost its `--out` when `--out` became required.)"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from specula.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
COMMAND = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:python3? -m specula|specula)\s+(.*)$")


def documented_commands(path: Path) -> list[tuple[int, str]]:
    """(line, text after `specula`) of every specula command in the file's shell code blocks:
    backslash continuations joined, a synopsis' indented `[--...` lines joined to its command,
    comments, redirections and `$(...)` substitutions dropped."""
    text, found = path.read_text(), []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if block.group(1) not in SHELL_BLOCKS:
            continue
        first_line = text[:block.start()].count("\n") + 2
        lines = block.group(2).split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while i + 1 < len(lines) and (line.endswith("\\") or lines[i + 1].lstrip().startswith("[--")):
                i += 1
                line = line.rstrip("\\") + " " + lines[i].strip()
            i += 1
            line = re.sub(r"\$\([^()]*\)", "SUBSTITUTED", line)
            line = re.sub(r"(^|\s)#.*$", "", line)
            parts = [line] if "[--" in line else re.split(r"&&|\|\||;|\s\|\s", line)
            for part in parts:
                match = COMMAND.match(part.strip().removeprefix("$ "))
                if match:
                    command = re.split(r"\s(?:\d?>>?|&>|<)", " " + match.group(1))[0].strip()
                    found.append((first_line + start, command))
    return found


def subcommand(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub)parser the leading words name, and the words after them."""
    while words:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or words[0] not in actions[0].choices:
            break
        parser, words = actions[0].choices[words[0]], words[1:]
    return parser, words


CASES = [pytest.param(path, line, command, id=f"{path.name}:{line}")
         for path in DOCS for line, command in documented_commands(path)]


def test_the_docs_show_commands():
    assert len(CASES) > 50 and {p.values[0].name for p in CASES} >= {"README.md", "training.md", "gpu.md"}


@pytest.mark.parametrize(("path", "line", "command"), CASES)
def test_a_documented_command_runs_on_todays_command_line(path, line, command):
    parser = build_parser()
    if "[--" in command or "..." in command:  # a synopsis: its options must exist
        sub, _ = subcommand(parser, command.split())
        known = {option for action in sub._actions for option in action.option_strings}
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command))
        assert named <= known, f"{path.name}:{line}: {sorted(named - known)} not options of `{sub.prog}`"
        return
    words = shlex.split(command)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(words)
        except SystemExit as exc:  # --help: 0
            if exc.code and "$" not in err.getvalue():  # a shell variable where a choice is checked
                pytest.fail(f"{path.name}:{line}: `specula {command}` -> {err.getvalue().strip()}")
