"""What each query of a packed step may read from the paged pool, as FlexAttention block masks built on the device.

A layer's pool buffer [H_kv, N, B, D] is viewed as one key sequence [1, H_kv, N*B, D]. Query token t belongs to row
row_of[t] at absolute position positions[t]; row r's block table tables[r] lists its blocks in order (-1 past its
end). `owner[r, n]` is the logical index of pooled block n in row r (-1 where the block is not the row's; a block
shared copy-on-write between forks is its own in each row that holds it). Query t sees pooled key k where
owner[row_of[t], k // B] >= 0 and that logical position, owner * B + k % B, is <= positions[t] (and, on a
sliding-window layer, > positions[t] - window).

The block mask comes from the tables directly (`BlockMask.from_kv_blocks`): each tile of Q_TILE queries lists the
blocks of the rows it holds, so the kernel skips every other row's blocks, and nothing is built query by key.
Every step is a fixed number of tensor ops over the inputs' shapes, with no value read back, so a step of fixed
shapes can be captured in a CUDA graph and traced whole by torch.compile (docs/architecture.md, "CUDA graphs").
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

Q_TILE = 16  # queries per tile of a block mask
# KV block sizes the compiled kernels take as their key tile: a tile must divide the mask's blocks, and Triton's
# tiles are powers of two from 16 (its smallest matrix product) to 128 (what a tile of 128-wide heads keeps in
# shared memory)
FLEX_BLOCK_SIZES = (16, 32, 64, 128)


def flex_block_size_refusal(block_size: int) -> str | None:
    """Why compiled FlexAttention cannot read a pool of `block_size`-position blocks, or None: it can."""
    if block_size in FLEX_BLOCK_SIZES:
        return None
    return f"compiled FlexAttention takes KV blocks of {', '.join(map(str, FLEX_BLOCK_SIZES))} positions"


def tile_options(mask: BlockMask) -> dict[str, int | bool]:
    """kernel_options whose tiles are the mask's blocks: BLOCK_M queries by BLOCK_N keys, each dividing its block
    as the compiler requires (its defaults, 128 x 64 on sm90 at head size 128, or the decode kernel's
    max(next_pow2(T * H / H_kv), 16), do not). The main kernel for every step size, as vLLM runs its paged masks:
    the decode kernel packs a KV head's query heads into one tile, which a tile of 16 queries holds only for
    groups of at most 16 heads, and builds its tiles from the step's size."""
    q_block, kv_block = mask.BLOCK_SIZE
    return {"BLOCK_M": q_block, "BLOCK_N": kv_block, "FORCE_USE_FLEX_ATTENTION": True}


class FlexLayout:
    """A packed step's rows on the device, and its block masks per (window, pooled blocks), made once per step."""

    def __init__(self, row_of: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, block_size: int):
        self.row_of = row_of  # [T]: the row of each query
        self.positions = positions  # [T]: each query's absolute position
        self.tables = tables  # [R, M]: each row's block ids, -1 past its end
        self.block_size = block_size
        self._owners: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[tuple[int | None, int], BlockMask] = {}

    def block_mask(self, window: int | None, num_blocks: int) -> BlockMask:
        """The block mask of a layer with this window (None: full attention) over a pool of num_blocks blocks."""
        mask = self._masks.get((window, num_blocks))
        if mask is None:
            mask = self._masks[(window, num_blocks)] = self._make(window, num_blocks)
        return mask

    def _owner_and_tiles(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(owner [R, N], blocks each tile reads [tiles], tiles' block ids [tiles, N], those it reads first)."""
        if num_blocks not in self._owners:
            rows, width = self.tables.shape
            spill = torch.where(self.tables >= 0, self.tables, num_blocks)  # [R, M]: -1 entries land past the pool
            logical = torch.arange(width, device=self.tables.device).expand(rows, width)  # [R, M]
            owner = torch.full((rows, num_blocks + 1), -1, dtype=torch.long, device=self.tables.device)
            owner = owner.scatter(1, spill, logical)[:, :num_blocks]  # [R, N]
            queries = self.row_of.shape[0]
            tiles = -(-queries // Q_TILE)
            tile_of = torch.arange(queries, device=self.row_of.device) // Q_TILE  # [T]
            rows_in_tile = torch.zeros((tiles, rows), device=owner.device)  # [tiles, R]
            rows_in_tile = rows_in_tile.index_put((tile_of, self.row_of), torch.ones((), device=owner.device))
            readable = (rows_in_tile @ (owner >= 0).float()) > 0  # [tiles, N]
            count = readable.sum(dim=-1, dtype=torch.int32)  # [tiles]
            order = readable.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices.to(torch.int32)
            self._owners[num_blocks] = owner, count, order
        return self._owners[num_blocks]

    def _make(self, window: int | None, num_blocks: int) -> BlockMask:
        owner, count, order = self._owner_and_tiles(num_blocks)
        row_of, positions, block_size = self.row_of, self.positions, self.block_size

        def visible(batch, head, q, k):
            logical = owner[row_of[q], k // block_size]
            position = logical * block_size + k % block_size
            seen = (logical >= 0) & (position <= positions[q])
            if window is not None:
                seen = seen & (position > positions[q] - window)
            return seen

        return BlockMask.from_kv_blocks(
            count[None, None],
            order[None, None],
            BLOCK_SIZE=(Q_TILE, block_size),
            mask_mod=visible,
            seq_lengths=(row_of.shape[0], num_blocks * block_size),
            compute_q_blocks=False,
        )
