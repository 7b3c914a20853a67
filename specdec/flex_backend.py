"""The FlexAttention backend: every row of a packed step in one attention call per layer, read in place from the
paged KV pool (torch.nn.attention.flex_attention).

A layer's pool buffer [H_kv, N, B, D] is viewed as one long key sequence [1, H_kv, N*B, D]. Query token t belongs
to row row_of[t] at absolute position position[t]; pooled position k lies in block k // B, which is logical block
owner[row, k // B] of that row (-1 where the block is not the row's: a block shared copy-on-write between forks is
its own in each row that holds it). The mask lets t see k where the block is its row's and
owner * B + k % B <= position[t] (and, on a sliding-window layer, > position[t] - window). The block mask built
from it is made once per step and window and shared by every layer; its sparsity skips the blocks of other rows.

On CUDA the call is compiled (torch.compile of flex_attention); elsewhere flex_attention runs eagerly, which
computes every query against the whole pool: exact, and slow for a large pool (a check of exactness on CPU, not a
CPU serving path: 16 rows of 5 queries over a pool of 4,096 positions, 4 heads of 64, 1 thread, ~40 ms a layer
against ~0.5 ms in the CPU kernel and ~2.5 ms through SDPA).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from specdec.attention_backend import AttentionBackend

if TYPE_CHECKING:
    from specdec.packed_forward import PackedStep


class FlexPlan:
    """Which row and position each query token has, each row's logical index of every pooled block, and the block
    masks made from them (per window: None for full attention)."""

    def __init__(self, step: PackedStep, device: torch.device):
        self.device = device
        self.row_of = torch.tensor(
            [r for r, row in enumerate(step.rows) for _ in range(row.count)], device=device
        )  # [T]
        self.positions = step.positions  # [T]
        self.block_size = step.pool.block_size
        self.tables = [row.blocks for row in step.rows]
        self.block_masks: dict[tuple[int | None, int], BlockMask] = {}

    def block_mask(self, window: int | None, num_blocks: int) -> BlockMask:
        """The block mask of a layer with this window over a pool of num_blocks blocks."""
        mask = self.block_masks.get((window, num_blocks))
        if mask is None:
            mask = self.block_masks[(window, num_blocks)] = self._make(window, num_blocks)
        return mask

    def _make(self, window: int | None, num_blocks: int) -> BlockMask:
        owner = torch.full((len(self.tables), num_blocks), -1, dtype=torch.long)  # [R, N]
        for r, table in enumerate(self.tables):
            owner[r, table] = torch.arange(len(table))
        owner = owner.to(self.device)
        row_of, positions, block_size = self.row_of, self.positions, self.block_size

        def visible(batch, head, q, k):
            logical = owner[row_of[q], k // block_size]
            position = logical * block_size + k % block_size
            seen = (logical >= 0) & (position <= positions[q])
            if window is not None:
                seen = seen & (position > positions[q] - window)
            return seen

        return create_block_mask(visible, None, None, len(positions), num_blocks * block_size, device=self.device)


class FlexBackend(AttentionBackend):
    """One flex_attention call per layer for all of a step's rows."""

    name = "flex"

    def __init__(self, device: torch.device):
        # compiled where it pays (CUDA); the eager call is flex_attention itself, looked up at each call
        self.compiled = torch.compile(flex_attention) if device.type == "cuda" else None
        if self.compiled is None:  # the eager call warns that it is for debugging: here it is the plain path
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

    def plan(self, step: PackedStep, device: torch.device, dtype: torch.dtype) -> FlexPlan:
        return FlexPlan(step, device)

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
        attended = attend(
            query,
            keys.view(1, heads, num_blocks * block_size, head_dim),
            values.view(1, heads, num_blocks * block_size, head_dim),
            block_mask=step.plan.block_mask(window, num_blocks),
            scale=scaling,
            enable_gqa=query.shape[1] != heads,
        )  # [1, H, T, D]
        return attended[0].transpose(0, 1)  # [T, H, D]
