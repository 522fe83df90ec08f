"""User-facing errors. The CLI prints their message on one line and exits with code 2."""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Iterator


class SpeculaError(Exception):
    """A problem with the user's input or environment; the message names the fix."""


class ConfigError(SpeculaError, ValueError):
    """Invalid arguments or configuration."""


class CacheNotWritable(ConfigError):
    """specula's cache folder (or its lock files) cannot be written; the message names the fix."""


class ModelNotFoundError(SpeculaError):
    """A model name that is neither an embedded alias, a local path, nor a cached hub id."""


class IncompatibleModelsError(SpeculaError):
    """Draft and target disagree on tokenizer / vocabulary."""


class HeadFileError(SpeculaError):
    """A trained head file that cannot be used: missing, truncated, corrupted, or made for another
    target or vocabulary."""


@contextlib.contextmanager
def reworded(rewrite: Callable[[str], str]) -> Iterator[None]:
    """A `SpeculaError` raised inside (its one argument a message) carries `rewrite(message)` instead: for a caller
    that names an option otherwise than the code raising it does (the command line's flags, `api.load`'s
    draft_quantize for `load_draft`'s quantize)."""
    try:
        yield
    except SpeculaError as exc:
        if len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (rewrite(exc.args[0]),)
        raise


def keywords_renamed(message: str, names: dict[str, str]) -> str:
    """`message` with each keyword of `names` written with its value (`quantize="int8"`, `quantize=`) named by its
    new name (`draft_quantize="int8"`); the same word elsewhere stays (prose, `draft_quantize=`, a variant's
    `fusion:quantize=`)."""
    if not names:
        return message
    words = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w:.-])({words})(?==)", lambda m: names[m.group(1)], message)
