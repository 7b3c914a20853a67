"""Copying tensors made on the host to the device that computes with them, without waiting for the copy."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, queued behind the device's work rather than waited for. To CUDA the copy goes through
    pinned memory: from pageable memory a "non-blocking" copy is staged by the driver while the host waits."""
    if host.device == device or host.device.type != "cpu" or device.type != "cuda":
        return host.to(device)
    return host.contiguous().pin_memory().to(device, non_blocking=True)
