"""The attention backends a packed model may use (specdec/engine/packed_step.py), and which one a model gets.

- kernel: the compiled CPU kernel for short rows, SDPA for the rest (kernel_backend.py); CPU float32.
- sdpa: torch's SDPA on grids of short rows and one call per other row (sdpa_backend.py); any device.
- flex: torch's FlexAttention, one call per layer for every row (flex_backend.py); compiled on CUDA.
- auto: kernel on CPU float32 where it builds, flex on CUDA, sdpa otherwise.
"""

from __future__ import annotations

import enum

import torch

from specdec.engine.attention.flex_backend import FlexBackend
from specdec.engine.attention.kernel_backend import KernelBackend
from specdec.engine.attention.ragged_attention import kernel_fits, load_kernel
from specdec.engine.attention.sdpa_backend import SdpaBackend
from specdec.engine.packed_step import AttentionBackend


class AttentionBackendChoice(enum.Enum):
    """The attention_backend setting."""

    AUTO = "auto"
    KERNEL = "kernel"
    SDPA = "sdpa"
    FLEX = "flex"


def choose_attention_backend(
    choice: AttentionBackendChoice, device: torch.device, dtype: torch.dtype, head_dim: int
) -> tuple[AttentionBackend, str]:
    """The backend a model on this device and dtype gets, and why. A kernel asked for where it cannot serve
    (another device or dtype) raises ValueError; one that fails to build falls back to SDPA, saying so."""
    if choice is AttentionBackendChoice.SDPA:
        return SdpaBackend(), "asked for"
    if choice is AttentionBackendChoice.FLEX:
        return FlexBackend(device), "asked for"
    fits = kernel_fits(device, dtype, head_dim)
    if choice is AttentionBackendChoice.KERNEL and not fits:
        raise ValueError(
            f"attention_backend kernel serves CPU float32 with head_dim a multiple of 16, "
            f"not {device.type} {dtype} head_dim {head_dim}"
        )
    if fits:
        kernel = load_kernel()
        if kernel is not None:
            return KernelBackend(kernel), "CPU float32" if choice is AttentionBackendChoice.AUTO else "asked for"
        return SdpaBackend(), "the CPU kernel could not be built"
    if device.type == "cuda":
        return FlexBackend(device), "CUDA"
    return SdpaBackend(), f"no faster backend for {device.type} {dtype}"
