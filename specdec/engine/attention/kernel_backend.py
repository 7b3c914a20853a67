"""The kernel attention backend: a step's short rows in the compiled CPU kernel
(specdec/engine/attention/ragged_attention.py), one call per layer for all of them; longer rows and sliding-window
layers through SDPA (specdec/engine/attention/sdpa_backend.py). CPU, float32 only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.engine.attention.ragged_attention import AttendRows
from specdec.engine.attention.sdpa_backend import GRID_MAX_TOKENS, SdpaBackend, SdpaPlan

if TYPE_CHECKING:
    from specdec.engine.packed_step import PackedStep


class KernelPlan(SdpaPlan):
    """The SDPA plan of a step's long rows, and the kernel's short rows as (table offset, start, count, offset)
    [R, 4] with their block tables [M] (both None when the step has no short rows)."""

    def __init__(self, step: PackedStep, device: torch.device, dtype: torch.dtype):
        short = [i for i, row in enumerate(step.rows) if row.count <= GRID_MAX_TOKENS]
        super().__init__(step, device, dtype, attended_elsewhere=short)
        self.kernel_rows: torch.Tensor | None = None  # [R, 4]
        self.kernel_tables: torch.Tensor | None = None  # [M]
        if short:
            layout, tables = [], []
            for i in short:
                row = step.rows[i]
                layout.append([len(tables), row.start, row.count, step.offsets[i]])
                tables.extend(row.blocks)
            self.kernel_rows, self.kernel_tables = torch.tensor(layout), torch.tensor(tables, dtype=torch.long)


class KernelBackend(SdpaBackend):
    """Short rows in the compiled kernel; the rest as SdpaBackend attends them."""

    name = "kernel"

    def __init__(self, kernel: AttendRows):
        self.kernel = kernel

    def plan(self, step: PackedStep, device: torch.device, dtype: torch.dtype) -> KernelPlan:
        return KernelPlan(step, device, dtype)

    def attend_rows(
        self,
        step: PackedStep,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scaling: float | None,
        grouped: bool,
        attended: torch.Tensor,
    ) -> None:
        plan = step.plan
        if plan.kernel_rows is not None:
            self.kernel(
                query[0],
                keys,
                values,
                plan.kernel_rows,
                plan.kernel_tables,
                scaling if scaling is not None else query.shape[-1] ** -0.5,
                attended,
            )
        super().attend_rows(step, query, keys, values, scaling, grouped, attended)
