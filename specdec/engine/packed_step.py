"""What one packed forward pass hands its attention: the step's rows and the interface of the backends that attend them.

A packed step (specdec/engine/packed_forward.py) writes its new keys and values into the paged KV pool, then hands its
attention backend the step, the queries of all its rows and the layer's pool buffers; the backend returns each token's
attention over its own row's positions (and, on a sliding-window layer, only those in the window). A backend plans
once per step what every layer shares (masks, grids, block tables) and attends per layer. The backends, and which one
a model gets: specdec/engine/attention/selection.py. A bucketed step (specdec/engine/bucketed_step.py) hands its
attention a StaticStep instead, whose shapes depend on its bucket alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.common.host_copies import to_device
from specdec.engine.attention.flex_layout import FlexLayout
from specdec.engine.kv.pool import KVPool, SequenceKV


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


@dataclass(frozen=True)
class PackedRow:
    """One row of a packed step: its cache, where its new tokens start and how many there are."""

    kv: SequenceKV
    start: int  # positions already cached = absolute position of the row's first new token
    count: int  # new tokens of this row in the packed sequence

    @property
    def blocks(self) -> list[int]:
        """The ids of the blocks holding the row's positions, its new tokens included."""
        return self.kv.table[: self.kv.pool.blocks_for(self.start + self.count)]


class PackedStep:
    """The rows of one packed forward, in packing order (passed to the attention function as a kwarg). Every row
    holds blocks for its new positions already (SequenceKV.reserve)."""

    def __init__(self, rows: Sequence[PackedRow], device: torch.device, dtype: torch.dtype, backend: AttentionBackend):
        self.rows = list(rows)
        self.pool: KVPool = self.rows[0].kv.pool
        self.offsets = [0]  # row i's tokens are packed at offsets[i]..offsets[i+1]-1
        for row in self.rows:
            self.offsets.append(self.offsets[-1] + row.count)
        block_size = self.pool.block_size
        positions = [p for r in self.rows for p in range(r.start, r.start + r.count)]
        self.positions = to_device(torch.tensor(positions), device)  # [T]
        written = [
            (r.kv.table[p // block_size], p % block_size) for r in self.rows for p in range(r.start, r.start + r.count)
        ]
        self.write_at = to_device(torch.tensor(written).T, device)  # [2, T]: each token's block and place
        self.backend = backend
        self.plan = backend.plan(self, device, dtype)  # what every layer's attention shares

    def table_of(self, row: PackedRow, device: torch.device) -> torch.Tensor:
        """The blocks holding a row's positions [blocks]."""
        return torch.tensor(row.blocks, device=device)

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    def finish(self) -> None:
        """Every layer has written its keys/values: the rows now hold their new tokens."""
        for row in self.rows:
            row.kv.length = row.start + row.count


@dataclass(frozen=True)
class StaticStep:
    """What packed attention reads of a bucketed step (the counterpart of a PackedStep): the pool, where each token
    writes [2, T], the backend and the step's FlexLayout as its plan."""

    pool: KVPool
    write_at: torch.Tensor
    backend: AttentionBackend
    plan: FlexLayout
