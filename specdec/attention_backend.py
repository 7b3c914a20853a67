"""The attention backend interface: how one layer's attention reads a packed step's rows from the paged KV pool.

A packed step (specdec/packed_forward.py) writes its new keys and values into the pool, then hands its backend the
step, the queries of all its rows and the layer's pool buffers; the backend returns each token's attention over its
own row's positions (and, on a sliding-window layer, only those in the window). A backend plans once per step what
every layer shares (masks, grids, block tables) and attends per layer. The backends, and which one a model gets:
specdec/attention_backends.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.packed_forward import PackedStep


class AttentionBackend(ABC):
    """Attends a packed step's rows, one layer at a time, against the rows' blocks in the pool."""

    name: str  # the attention_backend setting's value that selects it

    @abstractmethod
    def plan(self, step: PackedStep, device: torch.device, dtype: torch.dtype) -> object:
        """What every layer of the step shares (kept as step.plan); dtype is the queries'."""

    @abstractmethod
    def attend(
        self,
        step: PackedStep,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scaling: float | None,
        window: int | None,
    ) -> torch.Tensor:
        """query [1, H, T, D] of the step's T new tokens; keys, values [H_kv, N, B, D]: the layer's pool buffers,
        the step's tokens written; window: the layer's sliding window or None. Returns [T, H, D]."""
