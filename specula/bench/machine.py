"""What a measurement ran on: recorded with every benchmark and cost curve."""

from __future__ import annotations

import os
import platform
from typing import Any

from specula.models.device import cpu_model


def machine_info(device: Any = None) -> dict[str, Any]:
    """CPU, threads, accelerator and library versions (JSON-ready)."""
    import torch
    import transformers

    import specula

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specula": getattr(specula, "__version__", None),
        "device": str(device) if device is not None else "cpu",
        "gpu": None,
    }
    if device is not None and torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def machine_line(info: dict[str, Any]) -> str:
    """One human line: CPU, threads, accelerator, versions."""
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    return (f"{info.get('cpu')} ({info.get('cpu_count')} CPUs, {info.get('torch_threads')} torch threads{gpu}); "
            f"torch {info.get('torch')}, transformers {info.get('transformers')}, Python {info.get('python')}, "
            f"{info.get('platform')}")
