"""Devices: which one a model runs on, its default dtype, and waiting for it (timings must cover
queued GPU work). Every check here runs before any slow load, so a wrong `--device` or a dtype /
kernel the device cannot run fails at once with the fix named."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import threading
from pathlib import Path
from typing import Any

import torch

from specula.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
"""Values of `--device` / `LoadConfig.device` (N: a CUDA device index)."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Values of `--dtype` / `LoadConfig.dtype`. auto: float32 on CPU, bfloat16 on CUDA."""


_serial = {"lock": threading.Lock(), "depth": 0, "threads": 1}
"""`serial_cpu_ops`' state: torch's thread count is the process's, so blocks that overlap on several threads share
one count, set to 1 by the first to enter and restored by the last to leave."""


@contextlib.contextmanager
def serial_cpu_ops():
    """torch's own CPU ops run on one thread inside (its intra-op threads back as they were after the last such block
    ends, on whichever thread). For the small ops between two kernel calls over a large vocabulary (a draft's
    [151,936] logits row: its -inf fill, softmax, argmax): torch splits such a row over its OpenMP workers, which
    sleep between ops (specula's `GOMP_SPINCOUNT`), and on the 2-core machine each op paid their wake-up on the core
    the kernels' pool still polls (the 1.5B's `fusion` steps: 8.8% slower per token with them split,
    `docs/native.md`, session 144). Nothing inside may call specula's kernels: they take their thread count from
    torch's (another thread's kernel call meanwhile runs on one thread: slower, never wrong)."""
    state = _serial
    with state["lock"]:
        if state["depth"] == 0:
            state["threads"] = torch.get_num_threads()
            if state["threads"] > 1:
                torch.set_num_threads(1)
        state["depth"] += 1
    try:
        yield
    finally:
        with state["lock"]:
            state["depth"] -= 1
            if state["depth"] == 0 and state["threads"] > 1:
                torch.set_num_threads(state["threads"])


@functools.cache
def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo, else `platform.processor()`)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def sync_device(device: Any) -> None:
    """Wait for queued accelerator work (so wall-clock timings cover it); no-op on CPU."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def resolve_device(option: str = "auto") -> torch.device:
    """`auto` = the first CUDA device when PyTorch sees one, else the CPU; `cuda` / `cuda:N` must
    exist (a `ConfigError` naming `device="cpu"` otherwise)."""
    option = (option or "auto").strip().lower()
    if option == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if option == "cpu":
        return torch.device("cpu")
    if option == "cuda" or option.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(f'device="{option}": PyTorch sees no CUDA device here (torch.cuda.is_available() is '
                              'False: no GPU, or a CPU-only torch build); use device="cpu"')
        index = 0
        if option != "cuda":
            try:
                index = int(option.split(":", 1)[1])
            except ValueError:
                raise ConfigError(f'device="{option}": write cuda:N with N a device index, e.g. cuda:0') from None
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ConfigError(f'device="{option}": there are {count} CUDA device(s) (cuda:0..cuda:{count - 1})')
        return torch.device(f"cuda:{index}")
    raise ConfigError(f"unknown device {option!r}; choose auto, cpu, cuda or cuda:N")


def resolve_dtype(option: str, device: torch.device) -> torch.dtype:
    """The weights dtype: `auto` = float32 on CPU (the model unchanged, and the fastest there),
    bfloat16 on CUDA; float16 runs on CUDA only."""
    if option not in DTYPES:
        raise ConfigError(f"unknown dtype {option!r}; choose one of: {', '.join(DTYPES)}")
    if option == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if option == "float16" and device.type != "cuda":
        raise ConfigError('dtype="float16" runs on CUDA; on CPU use float32 (the default) or bfloat16')
    return getattr(torch, option)


def check_cpu_only(what: str, device: torch.device, fix: str) -> None:
    """A `ConfigError` when a CPU-only option (`what`) meets a CUDA device."""
    if device.type != "cpu":
        raise ConfigError(f"{what} runs on CPU only, not on {device}; {fix}")


_CUDA_GRAPHS: bool | None = None

GRAPHS_ENV = "SPECULA_CUDA_GRAPHS"
"""The environment variable that turns the CUDA-graph path on or off (`cuda_graphs_wanted`)."""
GRAPHS_ASKED = "set_cuda_graphs(True)"
"""The library's ask for the CUDA-graph path, as its messages name it (`--cuda-graphs` on the command line:
`commands.common.command_flags`)."""
_OFF = ("0", "false", "off", "no")
"""Values of an on-by-default environment switch that turn it off (`env_switch`)."""


def env_switch(name: str) -> bool:
    """Whether the on-by-default switch `name` is on: unset, or any value but 0 / false / off / no."""
    return os.environ.get(name, "1").strip().lower() not in _OFF


def set_cuda_graphs(enabled: bool | None) -> None:
    """The process-wide default of the native backend's CUDA-graph path (`--cuda-graphs` /
    `--no-cuda-graphs`); None = back to the environment's (`cuda_graphs_wanted`). Read when a
    backend is built."""
    global _CUDA_GRAPHS
    _CUDA_GRAPHS = enabled


def cuda_graphs_wanted() -> bool:
    """Whether native backends on CUDA capture their passes in CUDA graphs: as set by
    `set_cuda_graphs`, else `SPECULA_CUDA_GRAPHS` (0 / false / off turn it off), else yes."""
    if _CUDA_GRAPHS is not None:
        return _CUDA_GRAPHS
    return env_switch(GRAPHS_ENV)


def cuda_graphs_asker(setting: bool | None = None) -> str | None:
    """Who asked for the CUDA-graph path, not merely left it on by default: `GRAPHS_ASKED` for a setting of True
    (`setting`, else `set_cuda_graphs`'s: `--cuda-graphs`), else `SPECULA_CUDA_GRAPHS=<value>` when the variable is
    set to turn it on (1, on, compile, ...), else None (the default, or turned off). Where the path cannot run (a
    decoder it cannot capture, the Hugging Face backend, a CPU run) an ask is refused, naming it, rather than every
    pass running eagerly without a word."""
    setting = _CUDA_GRAPHS if setting is None else setting
    if setting is not None:
        return GRAPHS_ASKED if setting else None
    value = os.environ.get(GRAPHS_ENV, "").strip()
    return f"{GRAPHS_ENV}={value}" if value and value.lower() not in _OFF else None


def cuda_graphs_unasked(asker: str) -> str:
    """How to take back the ask `asker` names (`cuda_graphs_asker`): drop the call (the flag), or unset the
    variable."""
    if asker.startswith(f"{GRAPHS_ENV}="):
        return f"unset {GRAPHS_ENV} (or set it to 0)"
    return f"drop {asker}"


def cuda_graphs_compile() -> bool:
    """`SPECULA_CUDA_GRAPHS=compile`: the captured passes' element-wise ops fused by torch.compile
    (faster steps, a compilation at start-up; docs/gpu.md)."""
    return os.environ.get(GRAPHS_ENV, "").strip().lower() == "compile"


def sdpa_without_cudnn(device: Any):
    """A context in which SDPA on CUDA leaves out its cuDNN kernel (a no-op on the CPU). PyTorch
    (2.11) picks cuDNN attention for bfloat16 / float16 on Hopper, and cuDNN builds an execution plan
    for every new key length, which every decoding step changes: measured on an H100 with
    SmolLM2-135M in bfloat16, 32.9 ms a step against 17.1 ms without cuDNN (float32, which cuDNN
    does not run: 19.0 ms). The native decoder runs its eager passes in it; the Hugging Face backend
    would gain the same (its bfloat16 plain decoding: 14.9 tok/s against 46.2 for HF `generate`)."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
