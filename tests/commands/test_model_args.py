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


@pytest.mark.parametrize("command", ["generate", "bench", "profile", "serve", "run-batch", "train",
                                     "analyze acceptance"])
def test_every_command_that_loads_a_model_takes_threads(command, capsys):
    from specula.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([*command.split(), "--help"])
    assert "--threads N" in capsys.readouterr().out


def test_threads_are_set_before_the_command_runs_and_refused_below_one(capsys):
    import torch

    from specula.cli import main

    before = torch.get_num_threads()
    try:
        # the model is not found (exit 2), after --threads took effect
        assert main(["generate", "--target", "no-such-model", "--prompt", "x", "--threads", "1"]) == 2
        assert torch.get_num_threads() == 1
        assert main(["generate", "--target", "no-such-model", "--prompt", "x", "--threads", "0"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == "error: --threads must be >= 1, got 0"
    finally:
        torch.set_num_threads(before)
