"""Packed forward passes: several sequences' new tokens in one model call, each row with its own KV cache.

This is what continuous batching runs on. The rows of a step have different cached lengths and different
numbers of new tokens (a prefill, a verify block of γ+1, a single draft step). Their new tokens are packed
into one sequence [1, T] with no padding, so every token-wise layer (projections, MLP, norms, LM head) runs
once over the T tokens; attention, registered with transformers under `PACKED_ATTENTION`, lets each row see
its own keys/values only.

On CPU in float32, the short rows (decode steps, verify blocks) attend in one call per layer to a compiled kernel
(specdec/ragged_attention.py); elsewhere SDPA attends them as follows.

The rows' keys/values live in one paged KVPool per model (specdec/kv_pool.py): each row reads its positions
through its block table. Rows of a few tokens each (decode steps, verify blocks) may share an SDPA call on a grid:
their blocks gathered into [rows, H_kv, length, D] up to the grid's longest row, their queries laid out
[rows, n, H, D], with a mask that gives each row its own causal window. A grid saves calls but reads positions its
shorter rows never use, so rows in order of length join a grid only where that reads fewer extra positions than a
call costs (GRID_CALL_POSITIONS): a drafter's lanes of similar lengths share one, verify rows of very different
lengths attend one row per call. Long rows (prefills) attend alone.

A sliding-window layer (Mistral, Gemma-2/3's local layers, Qwen2 with use_sliding_window) whose window is shorter
than some row's end attends every row alone with a windowed mask (`_windowed_mask`); a window as long as every row
is full attention and takes the paths above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.kv_pool import KVPool, SequenceKV
from specdec.ragged_attention import AttendRows

PACKED_ATTENTION = "specdec_packed"
GRID_MAX_TOKENS = 16  # rows of at most this many new tokens are short: they may attend on grids or in the kernel
# One more attention call costs about what attending this many more row-positions costs. On CPU, 1 thread, 4
# heads of 64, cold caches: ~15 µs a call against ~0.35 µs a row-position for 5 queries (11 and 0.15 for one).
GRID_CALL_POSITIONS = 48


@dataclass(frozen=True)
class PackedRow:
    """One row of a packed step: its cache, where its new tokens start and how many there are."""

    kv: SequenceKV
    start: int  # positions already cached = absolute position of the row's first new token
    count: int  # new tokens of this row in the packed sequence


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
            table = row.kv.table[: pool.blocks_for(row.start + row.count)]
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
    in the queries' dtype so that no layer's attention converts it; None for a single query."""
    if row.count == 1:
        return None
    visible = torch.arange(row.start + row.count, device=device) <= (
        row.start + torch.arange(row.count, device=device)
    ).unsqueeze(1)
    return _additive(visible).to(dtype)


class PackedStep:
    """The rows of one packed forward, in packing order (passed to the attention function as a kwarg). Every row
    holds blocks for its new positions already (SequenceKV.reserve)."""

    def __init__(
        self, rows: Sequence[PackedRow], device: torch.device, dtype: torch.dtype, kernel: AttendRows | None = None
    ):
        self.rows = list(rows)
        self.pool: KVPool = self.rows[0].kv.pool
        self.offsets = [0]  # row i's tokens are packed at offsets[i]..offsets[i+1]-1
        for row in self.rows:
            self.offsets.append(self.offsets[-1] + row.count)
        block_size = self.pool.block_size
        positions = [p for r in self.rows for p in range(r.start, r.start + r.count)]
        self.positions = torch.tensor(positions, device=device)  # [T]
        written = [
            (r.kv.table[p // block_size], p % block_size) for r in self.rows for p in range(r.start, r.start + r.count)
        ]
        self.write_at = torch.tensor(written, device=device).T  # [2, T]: each token's block and place in it
        short = [i for i, row in enumerate(self.rows) if row.count <= GRID_MAX_TOKENS]
        self.kernel = kernel if short else None
        # With the kernel: its short rows as (table offset, start, count, offset) [R, 4] and their tables [M]; no grids.
        self.kernel_rows, self.kernel_tables = (None, None) if self.kernel is None else self._kernel_layout(short)
        self.grids = (
            []
            if self.kernel is not None
            else AttentionGrid.plan_all(self.rows, self.offsets, self.total_tokens, device, dtype)
        )
        shared = set(short) if self.kernel is not None else {i for grid in self.grids for i in grid.rows}
        # (row index, its causal mask [n, start+n] or None for one token, its block table [blocks]): the rows
        # attending one per call
        self.single_rows = [
            (i, _causal_mask(row, device, dtype), self.table_of(row, device))
            for i, row in enumerate(self.rows)
            if i not in shared
        ]
        # window -> per row (first position attended, its mask, its block table [blocks])
        self.windowed_masks: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def _kernel_layout(self, short: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's rows [R, 4] and block tables [M] for the short rows."""
        layout, tables = [], []
        for i in short:
            row = self.rows[i]
            layout.append([len(tables), row.start, row.count, self.offsets[i]])
            tables.extend(row.kv.table[: self.pool.blocks_for(row.start + row.count)])
        return torch.tensor(layout), torch.tensor(tables, dtype=torch.long)

    def table_of(self, row: PackedRow, device: torch.device) -> torch.Tensor:
        """The blocks holding a row's positions [blocks]."""
        return torch.tensor(row.kv.table[: self.pool.blocks_for(row.start + row.count)], device=device)

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    def finish(self) -> None:
        """Every layer has written its keys/values: the rows now hold their new tokens."""
        for row in self.rows:
            row.kv.length = row.start + row.count


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed_step: PackedStep | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of each packed row against its own cached + new keys; query [1, H, T, D] and key/value
    [1, H_kv, T, D] hold the new tokens of all rows. Returns [1, T, H, D] like transformers' sdpa path.
    Outside packed_forward (no packed_step) it is transformers' sdpa attention."""
    if packed_step is None:  # a plain transformers call on this model (e.g. generate()): ordinary attention
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("packed attention has no logit soft-capping")
    step = packed_step
    pooled_keys, pooled_values = step.pool.write(
        module.layer_idx, step.write_at[0], step.write_at[1], key[0].transpose(0, 1), value[0].transpose(0, 1)
    )  # [H_kv, N, B, D]
    grouped = query.shape[1] != key.shape[1]
    if sliding_window is not None and any(row.start + row.count > sliding_window for row in step.rows):
        return _windowed_attention(step, query, pooled_keys, pooled_values, sliding_window, scaling, grouped), None
    queries = query[0].transpose(0, 1)  # [T, H, D]
    attended = queries.new_empty(queries.shape)  # [T, H, D]
    if step.kernel is not None:
        step.kernel(
            query[0],
            pooled_keys,
            pooled_values,
            step.kernel_rows,
            step.kernel_tables,
            scaling if scaling is not None else query.shape[-1] ** -0.5,
            attended,
        )
    for grid in step.grids:
        on_grid = queries if grid.tokens is None else queries[grid.tokens]  # [Tg, H, D]
        grid_queries = queries.new_zeros((len(grid.rows), grid.mask.shape[2]) + queries.shape[1:])  # [S, n, H, D]
        grid_queries[grid.grid_rows, grid.query_positions] = on_grid
        grid_out = F.scaled_dot_product_attention(
            grid_queries.transpose(1, 2),
            gather_blocks(pooled_keys, grid.tables, grid.length),
            gather_blocks(pooled_values, grid.tables, grid.length),
            attn_mask=grid.mask,
            scale=scaling,
            enable_gqa=grouped,
        ).transpose(1, 2)  # [S, n, H, D]
        grid_tokens = slice(None) if grid.tokens is None else grid.tokens
        attended[grid_tokens] = grid_out[grid.grid_rows, grid.query_positions]
    for i, mask, table in step.single_rows:
        row, begin, end = step.rows[i], step.offsets[i], step.offsets[i + 1]
        length = row.start + row.count
        attended[begin:end] = F.scaled_dot_product_attention(
            query[:, :, begin:end],
            gather_blocks(pooled_keys, table[None], length),
            gather_blocks(pooled_values, table[None], length),
            attn_mask=mask,
            scale=scaling,
            enable_gqa=grouped,
        )[0].transpose(0, 1)  # [n, H, D]
    return attended.unsqueeze(0), None  # [1, T, H, D]


def _windowed_mask(row: PackedRow, window: int, device: torch.device, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """Query i of a row (position p = start+i) sees positions p-window+1..p (transformers' sliding_window_overlay):
    (the first position attended, additive mask [n, start+n-first])."""
    first = max(0, row.start + 1 - window)
    keys = torch.arange(first, row.start + row.count, device=device)  # [L]
    queries = row.start + torch.arange(row.count, device=device).unsqueeze(1)  # [n, 1]
    return first, _additive((keys <= queries) & (keys > queries - window)).to(dtype)


def _windowed_attention(
    step: PackedStep,
    query: torch.Tensor,
    pooled_keys: torch.Tensor,
    pooled_values: torch.Tensor,
    window: int,
    scaling: float | None,
    grouped: bool,
) -> torch.Tensor:
    """A sliding-window layer: each row alone against its window of the pool; query [1, H, T, D] -> [1, T, H, D]."""
    masks = step.windowed_masks.get(window)
    if masks is None:
        masks = step.windowed_masks[window] = [
            (*_windowed_mask(row, window, query.device, query.dtype), step.table_of(row, query.device))
            for row in step.rows
        ]
    attended = query.new_empty(query.shape[2:3] + query.shape[1:2] + query.shape[3:])  # [T, H, D]
    for i, (row, (first, mask, table)) in enumerate(zip(step.rows, masks)):
        length = row.start + row.count
        attended[step.offsets[i] : step.offsets[i + 1]] = F.scaled_dot_product_attention(
            query[:, :, step.offsets[i] : step.offsets[i + 1]],
            gather_blocks(pooled_keys, table[None], length)[:, :, first:],
            gather_blocks(pooled_values, table[None], length)[:, :, first:],
            attn_mask=mask,
            scale=scaling,
            enable_gqa=grouped,
        )[0].transpose(0, 1)  # [n, H, D]
    return attended.unsqueeze(0)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # the masks plain transformers calls need (sdpa's)


def packed_forward_refusal(config: PretrainedConfig) -> str | None:
    """Why a model's attention is not one packed_attention reproduces (logit soft-capping, layer kinds other than
    full and sliding-window attention), or None: the config allows packing. The start-up self-test
    (specdec/packed_self_test.py) has the last word."""
    if getattr(config, "attn_logit_softcapping", None):
        return f"attention logit soft-capping ({config.attn_logit_softcapping}), which SDPA does not apply"
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        return f"layer types {sorted(kinds)}"
    return None


@torch.inference_mode()
def packed_forward(
    model: torch.nn.Module,
    rows: Sequence[tuple[Sequence[int], SequenceKV, int]],
    device: torch.device,
    kernel: AttendRows | None = None,
) -> list[torch.Tensor]:
    """Runs every row's new tokens in one forward pass and extends each row's cache.

    rows: (new token ids, the row's SequenceKV, how many of its last positions need logits), all in one pool.
    kernel: the compiled attention of short rows (specdec/ragged_attention.py), or None for SDPA.
    Returns per row float32 logits [keep, V] for the last `keep` new tokens (no LM head work for the others).
    """
    pool = rows[0][1].pool
    with pool.lock:
        try:
            for ids, kv, _ in rows:
                kv.reserve(kv.length + len(ids))  # already done where the forward was planned (KVSession)
            step = PackedStep([PackedRow(kv, kv.length, len(ids)) for ids, kv, _ in rows], device, model.dtype, kernel)
            input_ids = torch.tensor(
                [[t for ids, _, _ in rows for t in ids]], dtype=torch.long, device=device
            )  # [1, T]
            keep_at = [end - keep for (_, _, keep), end in zip(rows, step.offsets[1:])]
            keep_index = torch.cat([torch.arange(at, end) for at, end in zip(keep_at, step.offsets[1:])])  # [K]
            no_mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)  # 4D: transformers builds no mask
            output = model(
                input_ids=input_ids,
                position_ids=step.positions.unsqueeze(0),
                attention_mask=no_mask,
                use_cache=False,
                logits_to_keep=keep_index.to(device),
                packed_step=step,
            )
        except BaseException:  # e.g. out of memory: no row grows; the blocks reserved for the step go back
            for _, kv, _ in rows:
                kv.trim()
            raise
        step.finish()
    logits = output.logits[0].float()  # [K, V]
    return list(torch.split(logits, [keep for _, _, keep in rows]))
