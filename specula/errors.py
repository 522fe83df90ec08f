"""User-facing errors. The CLI prints their message on one line and exits with code 2."""


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
