"""Devices: which one a model runs on, and waiting for it (timings must cover queued GPU work)."""

from __future__ import annotations

from typing import Any

import torch


def sync_device(device: Any) -> None:
    """Wait for queued accelerator work (so wall-clock timings cover it); no-op on CPU."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
