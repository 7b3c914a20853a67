"""The portable attention backend: torch's SDPA over rows gathered from the paged KV pool.

Rows of a few tokens each (decode steps, verify blocks) may share an SDPA call on a grid: their blocks gathered into
[rows, H_kv, length, D] up to the grid's longest row, their queries laid out [rows, n, H, D], with a mask that gives
each row its own causal window. A grid saves calls but reads positions its shorter rows never use, so rows in order
of length join a grid only where that reads fewer extra positions than a call costs (GRID_CALL_POSITIONS): a
drafter's lanes of similar lengths share one, verify rows of very different lengths attend one row per call. Long
rows (prefills) attend alone; one that starts at position 0 is plainly causal and takes SDPA's is_causal instead of
a mask (SDPA's is_causal is aligned top-left, so a row after cached positions keeps its explicit mask).

A sliding-window layer (Mistral, Gemma-2/3's local layers, Qwen2 with use_sliding_window) whose window is shorter
than some row's end attends every row alone with a windowed mask (`_windowed_mask`); a window as long as every row
is full attention and takes the paths above.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.engine.packed_step import AttentionBackend

if TYPE_CHECKING:
    from specdec.engine.packed_step import PackedRow, PackedStep

GRID_MAX_TOKENS = 16  # rows of at most this many new tokens are short: they may attend on grids or in the kernel
# One more attention call costs about what attending this many more row-positions costs. On CPU, 1 thread, 4
# heads of 64, cold caches: ~15 µs a call against ~0.35 µs a row-position for 5 queries (11 and 0.15 for one).
GRID_CALL_POSITIONS = 48


@dataclass(frozen=True)
class AttentionGrid:
    """Where one grid's rows' tokens go on a [rows, n, H, D] query grid, their blocks, and the mask every layer
    shares."""

    rows: tuple[int, ...]  # indexes of the step's rows on the grid
    length: int  # positions attended: the longest grid row's end
    tokens: torch.Tensor | None  # [Tg] packed indexes of the grid rows' tokens (None: all tokens, in order)
    grid_rows: torch.Tensor  # [Tg] the grid row of each grid token
    query_positions: torch.Tensor  # [Tg] index of each grid token within its row (0..n-1)
    tables: torch.Tensor  # [S, blocks] each grid row's block table, padded with its first block
    mask: torch.Tensor  # [S, 1, n, length] additive: 0 where a query sees a position, -inf elsewhere

    @classmethod
    def plan_all(
        cls,
        rows: Sequence[PackedRow],
        offsets: Sequence[int],
        total_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> list[AttentionGrid]:
        """The grids of a step's short rows. In order of length, a row joins the grid before it where the positions
        its rows would read past their ends for it (the new row's length over the grid's, per row already there) are
        no more than GRID_CALL_POSITIONS; otherwise it starts a new one. A row left alone gets no grid: it attends
        alone."""
        short = sorted(
            (i for i, row in enumerate(rows) if row.count <= GRID_MAX_TOKENS),
            key=lambda i: rows[i].start + rows[i].count,
        )
        clusters: list[list[int]] = []
        length = 0  # positions the last cluster attends: its longest row's end
        for i in short:
            end = rows[i].start + rows[i].count
            if clusters and len(clusters[-1]) * (end - length) <= GRID_CALL_POSITIONS:
                clusters[-1].append(i)
            else:
                clusters.append([i])
            length = end
        return [
            cls.plan(rows, cluster, offsets, total_tokens, device, dtype) for cluster in clusters if len(cluster) > 1
        ]

    @classmethod
    def plan(
        cls,
        rows: Sequence[PackedRow],
        on_grid: Sequence[int],
        offsets: Sequence[int],
        total_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> AttentionGrid:
        """The grid of the rows `on_grid` (indexes into rows)."""
        pool = rows[on_grid[0]].kv.pool
        query_len = max(rows[i].count for i in on_grid)
        length = max(rows[i].start + rows[i].count for i in on_grid)
        width = pool.blocks_for(length)
        starts, tables, tokens, grid_rows, query_positions = [], [], [], [], []
        for grid_row, i in enumerate(on_grid):
            row = rows[i]
            table = row.blocks
            starts.append(row.start)
            tables.append(table + table[:1] * (width - len(table)))
            tokens.extend(range(offsets[i], offsets[i] + row.count))
            grid_rows.extend([grid_row] * row.count)
            query_positions.extend(range(row.count))
        # Query j of grid row s sees positions 0..starts[s]+j; padded queries and the positions past a row's end
        # (padding blocks) see finite values (the pool is zero-filled) and are masked out or never read.
        last_seen = torch.tensor(starts)[:, None] + torch.arange(query_len)  # [S, n]
        visible = torch.arange(length) <= last_seen[:, :, None]  # [S, n, L]
        mask = _additive(visible).unsqueeze(1)  # [S, 1, n, L]
        in_packing_order = tokens == list(range(total_tokens))  # every token of the step, in order
        indexes = torch.tensor([tokens, grid_rows, query_positions], device=device)  # [3, Tg]
        return cls(
            tuple(on_grid),
            length,
            None if in_packing_order else indexes[0],
            indexes[1],
            indexes[2],
            torch.tensor(tables, device=device),
            mask.to(device, dtype),
        )


def gather_blocks(buffer: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of the sequences whose block tables are tables [S, blocks], from one layer's
    buffer [H_kv, N, B, D]: [S, H_kv, length, D]."""
    gathered = buffer[:, tables]  # [H_kv, S, blocks, B, D]
    heads, rows, blocks, block_size, head_dim = gathered.shape
    return gathered.transpose(0, 1).reshape(rows, heads, blocks * block_size, head_dim)[:, :, :length]


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """A boolean visibility mask as an additive one: 0 where visible, -inf elsewhere (float32)."""
    return torch.where(visible, 0.0, float("-inf"))


def _causal_mask(row: PackedRow, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """Query i of a row (position start+i) sees positions 0..start+i: additive [n, start+n], made once per step
    in the queries' dtype so that no layer's attention converts it; None where SDPA needs none (one query, or a row
    from position 0: is_causal)."""
    if row.count == 1 or row.start == 0:
        return None
    visible = torch.arange(row.start + row.count, device=device) <= (
        row.start + torch.arange(row.count, device=device)
    ).unsqueeze(1)
    return _additive(visible).to(dtype)


def _windowed_mask(row: PackedRow, window: int, device: torch.device, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """Query i of a row (position p = start+i) sees positions p-window+1..p (transformers' sliding_window_overlay):
    (the first position attended, additive mask [n, start+n-first])."""
    first = max(0, row.start + 1 - window)
    keys = torch.arange(first, row.start + row.count, device=device)  # [L]
    queries = row.start + torch.arange(row.count, device=device).unsqueeze(1)  # [n, 1]
    return first, _additive((keys <= queries) & (keys > queries - window)).to(dtype)


class SdpaPlan:
    """A step's SDPA calls: its grids, its rows attending one per call, and its windowed masks per window."""

    def __init__(
        self, step: PackedStep, device: torch.device, dtype: torch.dtype, attended_elsewhere: Collection[int] = ()
    ):
        # attended_elsewhere: rows another path attends (the kernel's short rows); with any, no grids are planned
        self.device, self.dtype = device, dtype
        self.grids = (
            []
            if attended_elsewhere
            else AttentionGrid.plan_all(step.rows, step.offsets, step.total_tokens, device, dtype)
        )
        on_grids = set(attended_elsewhere) | {i for grid in self.grids for i in grid.rows}
        # (row index, its causal mask [n, start+n] or None, its block table [blocks]): the rows attending one per call
        self.single_rows = [
            (i, _causal_mask(row, device, dtype), step.table_of(row, device))
            for i, row in enumerate(step.rows)
            if i not in on_grids
        ]
        # window -> per row (first position attended, its mask, its block table [blocks])
        self.windowed_masks: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def windowed(self, step: PackedStep, window: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per row (first position attended, additive mask, block table) on a layer of this window."""
        masks = self.windowed_masks.get(window)
        if masks is None:
            masks = self.windowed_masks[window] = [
                (*_windowed_mask(row, window, self.device, self.dtype), step.table_of(row, self.device))
                for row in step.rows
            ]
        return masks


class SdpaBackend(AttentionBackend):
    """Grids of short rows, other rows one per call, every row alone on a sliding-window layer."""

    name = "sdpa"

    def plan(self, step: PackedStep, device: torch.device, dtype: torch.dtype) -> SdpaPlan:
        return SdpaPlan(step, device, dtype)

    def attend(
        self,
        step: PackedStep,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scaling: float | None,
        window: int | None,
    ) -> torch.Tensor:
        grouped = query.shape[1] != keys.shape[0]
        if window is not None and any(row.start + row.count > window for row in step.rows):
            return _windowed_attention(step, query, keys, values, window, scaling, grouped)
        attended = query.new_empty(query.shape[2:3] + query.shape[1:2] + query.shape[3:])  # [T, H, D]
        self.attend_rows(step, query, keys, values, scaling, grouped, attended)
        return attended

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
        """Full attention of the plan's grids and single rows into attended [T, H, D]."""
        queries = query[0].transpose(0, 1)  # [T, H, D]
        for grid in step.plan.grids:
            on_grid = queries if grid.tokens is None else queries[grid.tokens]  # [Tg, H, D]
            grid_queries = queries.new_zeros((len(grid.rows), grid.mask.shape[2]) + queries.shape[1:])  # [S, n, H, D]
            grid_queries[grid.grid_rows, grid.query_positions] = on_grid
            grid_out = F.scaled_dot_product_attention(
                grid_queries.transpose(1, 2),
                gather_blocks(keys, grid.tables, grid.length),
                gather_blocks(values, grid.tables, grid.length),
                attn_mask=grid.mask,
                scale=scaling,
                enable_gqa=grouped,
            ).transpose(1, 2)  # [S, n, H, D]
            grid_tokens = slice(None) if grid.tokens is None else grid.tokens
            attended[grid_tokens] = grid_out[grid.grid_rows, grid.query_positions]
        for i, mask, table in step.plan.single_rows:
            row, begin, end = step.rows[i], step.offsets[i], step.offsets[i + 1]
            length = row.start + row.count
            attended[begin:end] = F.scaled_dot_product_attention(
                query[:, :, begin:end],
                gather_blocks(keys, table[None], length),
                gather_blocks(values, table[None], length),
                attn_mask=mask,
                is_causal=mask is None and row.count > 1,  # a row from position 0: causal, aligned top-left
                scale=scaling,
                enable_gqa=grouped,
            )[0].transpose(0, 1)  # [n, H, D]


def _windowed_attention(
    step: PackedStep,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    window: int,
    scaling: float | None,
    grouped: bool,
) -> torch.Tensor:
    """A sliding-window layer: each row alone against its window of the pool; query [1, H, T, D] -> [T, H, D]."""
    attended = query.new_empty(query.shape[2:3] + query.shape[1:2] + query.shape[3:])  # [T, H, D]
    for i, (row, (first, mask, table)) in enumerate(zip(step.rows, step.plan.windowed(step, window))):
        length = row.start + row.count
        attended[step.offsets[i] : step.offsets[i + 1]] = F.scaled_dot_product_attention(
            query[:, :, step.offsets[i] : step.offsets[i + 1]],
            gather_blocks(keys, table[None], length)[:, :, first:],
            gather_blocks(values, table[None], length)[:, :, first:],
            attn_mask=mask,
            scale=scaling,
            enable_gqa=grouped,
        )[0].transpose(0, 1)  # [n, H, D]
    return attended
