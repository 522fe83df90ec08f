"""Device plumbing on a CPU machine: `--device` / `--dtype` resolution, and every CUDA-only or
CPU-only combination refused with the fix named, before any slow load."""

from __future__ import annotations

import pytest
import torch

from specula.errors import ConfigError
from specula.models.device import check_cpu_only, resolve_device, resolve_dtype
from specula.models.loading import LoadConfig, load_model
from specula.models.prepack import resolve_linear_kernel


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_the_cpu_without_cuda_and_cpu_is_explicit(no_cuda):
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda:0")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cuda:0")) == torch.float16


@pytest.mark.parametrize("option", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_without_a_gpu_names_the_fix(no_cuda, option):
    with pytest.raises(ConfigError, match=f'^device="{option.lower()}": .*; use device="cpu"$'):
        resolve_device(option)


def test_bad_device_and_dtype_names(monkeypatch):
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda:0")
    with pytest.raises(ConfigError, match="1 CUDA device"):
        resolve_device("cuda:3")
    with pytest.raises(ConfigError, match="cuda:N"):
        resolve_device("cuda:x")
    with pytest.raises(ConfigError, match='^dtype="float16" runs on CUDA'):
        resolve_dtype("float16", torch.device("cpu"))
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_dtype("int4", torch.device("cpu"))


def test_cpu_only_options_are_refused_on_cuda_before_loading(monkeypatch):
    cuda = torch.device("cuda:0")
    with pytest.raises(ConfigError, match="--quantize int8 runs on CPU only"):
        check_cpu_only("--quantize int8", cuda, "use --quantize none")
    for kernel in ("onednn", "specula"):
        with pytest.raises(ConfigError, match=f'^linear_kernel="{kernel}"'):
            resolve_linear_kernel(kernel, dtype=torch.bfloat16, device="cuda", quantize="none", native=True)
    assert resolve_linear_kernel("auto", dtype=torch.bfloat16, device="cuda", quantize="none", native=True) == "aten"

    def no_loading(*args, **kwargs):
        raise AssertionError("a slow load started")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    with pytest.raises(ConfigError, match='^quantize="int8" runs on CPU only.*; use quantize="none"'):
        load_model("anything", quantize="int8", device=cuda)


def test_load_config_resolves_on_this_machine(no_cuda):
    assert LoadConfig().resolved() == (torch.device("cpu"), torch.float32)
    assert LoadConfig(dtype="bfloat16", device="cpu").resolved() == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match='use device="cpu"'):  # LoadConfig's field, as a Python caller writes it
        LoadConfig(device="cuda").resolved()


def test_cli_refuses_cuda_without_a_gpu_with_exit_2(no_cuda, capsys):
    from specula.cli import main

    for argv in (["generate", "--target", "smollm2-135m", "--prompt", "hi", "--device", "cuda"],
                 ["profile", "--target", "smollm2-135m", "--device", "cuda", "--out", "/tmp/x"],
                 ["bench", "--target", "smollm2-135m", "--device", "cuda:0", "--out", "/tmp/x"],
                 ["serve", "--target", "smollm2-135m", "--device", "cuda"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error:") and "--device cpu" in err and len(err.strip().splitlines()) == 1
        assert 'device="' not in err  # the library's wording (device="cuda") in the command's flags
    code = main(["generate", "--target", "smollm2-135m", "--prompt", "hi", "--device", "cpu", "--dtype", "float16"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --dtype float16 runs on CUDA;"), err


def test_serial_cpu_ops_runs_torch_on_one_thread_inside_and_restores_after():
    """Inside, torch's CPU ops run on the calling thread alone; after, its thread count is what it was, also
    when the block raises; with one thread already nothing changes."""
    from specula.models.device import serial_cpu_ops

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with serial_cpu_ops():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(KeyError):
            with serial_cpu_ops():
                raise KeyError("inside")
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        with serial_cpu_ops():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_serial_cpu_ops_overlapping_on_two_threads_restore_the_count_once_both_end():
    """torch's thread count is the process's: blocks that overlap on two threads leave it at one thread until the
    last ends, then restore the count from before the first (not the one the second saw inside the first)."""
    import threading

    from specula.models.device import serial_cpu_ops

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with serial_cpu_ops():
            first_in.set()
            second_in.wait()
        first_out.set()

    def second():
        first_in.wait()
        with serial_cpu_ops():
            second_in.set()
            first_out.wait()
            seen.append(torch.get_num_threads())  # the first has ended, this one has not
        # ending, it restores what the first saw before it, not the one thread it saw on entering

    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        later = []
        fresh = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        fresh.start()
        fresh.join(timeout=10)
        assert seen == [1] and torch.get_num_threads() == 2 and later == [2]
    finally:
        torch.set_num_threads(before)
