"""Fixtures for tests/models (defined in `modelkit`)."""

from modelkit import cache, fake_index, make_model, tiny_gguf  # noqa: F401
