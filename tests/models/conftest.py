"""Fixtures for tests/models (most defined in `modelkit`)."""

import pytest
from modelkit import cache, fake_index, make_model, tiny_gguf  # noqa: F401


@pytest.fixture
def isa():
    """`kernels.set_isa`, the kernel variant in force before the test restored after it."""
    from specula.models.native import kernels

    before = kernels.isa()
    yield kernels.set_isa
    kernels.set_isa(before)
