"""The FlexAttention backend: every row of a packed step in one attention call per layer, read in place from the
paged KV pool (torch.nn.attention.flex_attention), through block masks built from the rows' block tables
(specdec/engine/attention/flex_layout.py).

On CUDA the call is compiled (torch.compile of flex_attention) with the mask's tiles as the kernel's
(flex_layout.tile_options); elsewhere flex_attention runs eagerly, which computes every query against the whole
pool: exact, and slow for a large pool (a check of exactness on CPU, not a CPU serving path: 16 rows of 5 queries
over a pool of 4,096 positions, 4 heads of 64, 1 thread, ~40 ms a layer against ~0.5 ms in the CPU kernel and
~2.5 ms through SDPA).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch.nn.attention.flex_attention import flex_attention

from specdec.common.host_copies import to_device
from specdec.engine.attention.flex_layout import FlexLayout, tile_options
from specdec.engine.packed_step import AttentionBackend

if TYPE_CHECKING:
    from specdec.engine.packed_step import PackedStep


def flex_layout_of(step: PackedStep, device: torch.device) -> FlexLayout:
    """The layout of a step's rows: each query's row, its position, the rows' block tables padded with -1."""
    row_of = torch.tensor([r for r, row in enumerate(step.rows) for _ in range(row.count)])  # [T]
    tables = [row.blocks for row in step.rows]
    width = max(len(table) for table in tables)
    padded = torch.tensor([table + [-1] * (width - len(table)) for table in tables])  # [R, M]
    return FlexLayout(to_device(row_of, device), step.positions, to_device(padded, device), step.pool.block_size)


class FlexBackend(AttentionBackend):
    """One flex_attention call per layer for all of a step's rows."""

    name = "flex"

    def __init__(self, device: torch.device):
        # compiled where it pays (CUDA); the eager call is flex_attention itself, looked up at each call
        self.compiled = torch.compile(flex_attention) if device.type == "cuda" else None
        if self.compiled is not None:  # a shape per graph bucket and per eager step size, windows apart
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if self.compiled is None:  # the eager call warns that it is for debugging: here it is the plain path
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

    def plan(self, step: PackedStep, device: torch.device, dtype: torch.dtype) -> FlexLayout:
        return flex_layout_of(step, device)

    def attend(
        self,
        step: PackedStep,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scaling: float | None,
        window: int | None,
    ) -> torch.Tensor:
        heads, num_blocks, block_size, head_dim = keys.shape
        attend = self.compiled if self.compiled is not None else flex_attention
        mask = step.plan.block_mask(window, num_blocks)
        attended = attend(
            query,
            keys.view(1, heads, num_blocks * block_size, head_dim),
            values.view(1, heads, num_blocks * block_size, head_dim),
            block_mask=mask,
            scale=scaling,
            enable_gqa=query.shape[1] != heads,
            kernel_options=tile_options(mask),
        )  # [1, H, T, D]
        return attended[0].transpose(0, 1)  # [T, H, D]
