"""User-facing errors. The CLI prints their message on one line and exits with code 2."""


class SpeculaError(Exception):
    """A problem with the user's input or environment; the message names the fix."""


class ConfigError(SpeculaError, ValueError):
    """Invalid arguments or configuration."""


class ModelNotFoundError(SpeculaError):
    """A model name that is neither an embedded alias, a local path, nor a cached hub id."""


class IncompatibleModelsError(SpeculaError):
    """Draft and target disagree on tokenizer / vocabulary."""


class HeadFileError(SpeculaError):
    """A trained head file that cannot be used: missing, truncated, corrupted, or made for another
    target or vocabulary."""
