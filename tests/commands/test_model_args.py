"""The model-loading options every command shares (`commands.common.add_model_args`): each one
reaches `LoadConfig`, has its default, and refuses a value outside its choices."""

import argparse

import pytest

from specula.api import LoadConfig
from specula.commands.common import add_model_args, load_config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_model_args(p)
    return p


@pytest.mark.parametrize("flag,field,value,default,bad", [
    ("--quantize", "quantize", "int4", "none", "int3"),
    ("--linear-kernel", "linear_kernel", "aten", "auto", "mkl"),
    ("--attn", "attn_implementation", "batch_invariant", "auto", "flash"),
])
def test_model_option_reaches_load_config(flag, field, value, default, bad):
    assert load_config(parser().parse_args(["--target", "x", flag, value])) == LoadConfig(**{field: value})
    assert getattr(load_config(parser().parse_args(["--target", "x"])), field) == default
    with pytest.raises(SystemExit):
        parser().parse_args(["--target", "x", flag, bad])
