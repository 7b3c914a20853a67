"""A packed step padded to a bucket of tokens, so its shapes depend on the bucket alone (docs/architecture.md,
"CUDA graphs").

A decode or verify step feeds a few tokens per row. Padded to the next bucket (a power of two), every tensor of the
forward has the bucket's shapes, whatever the rows, so one CUDA graph per bucket replays every such step
(specdec/engine/cuda_graph_steps.py). The rows' data lives in fixed device buffers, refilled before each replay from
host buffers (pinned on CUDA) in non-blocking copies:

- `staged` [6, T]: token ids, positions, block and place each token writes to, its row, the tokens kept for logits;
- `tables` [R, M]: each row's block ids, -1 past its end (copied as wide as the step's longest table).

Padding tokens belong to a padding row (the last table row) whose table is the pool's scratch block: they write there at
their own positions (token j at j % B) and attend to one another, so they hold finite values that nobody else reads.
Attention goes through FlexAttention layouts (specdec/engine/attention/flex_layout.py) built inside the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.engine.attention.flex_layout import FlexLayout
from specdec.engine.kv.pool import KVPool
from specdec.engine.packed_forward import packed_logits
from specdec.engine.packed_step import AttentionBackend, StaticStep

IDS, POSITIONS, WRITE_BLOCKS, WRITE_PLACES, ROWS, KEPT = range(6)  # the rows of `staged`


def token_buckets(largest: int) -> list[int]:
    """Powers of two from 1 up to the first at least `largest`."""
    buckets = [1]
    while buckets[-1] < largest:
        buckets.append(2 * buckets[-1])
    return buckets


class BucketInputs:
    """The fixed device buffers of one bucket of `tokens` tokens, and filling them from a step's rows.

    The tables hold up to `max_blocks_per_row` blocks a row (a row at the model's longest context), but a step
    copies only its rows' tables as they are ([rows, longest table]) and widens them on the device: at 128k
    positions in blocks of 16 a whole table buffer is 16 MB, a step's rows a few KB."""

    def __init__(self, tokens: int, max_blocks_per_row: int, device: torch.device):
        self.tokens = tokens
        self.staged = torch.zeros((6, tokens), dtype=torch.long, device=device)  # [6, T]
        self.tables = torch.full((tokens + 1, max_blocks_per_row), -1, dtype=torch.long, device=device)  # [R, M]
        pinned = device.type == "cuda"
        self._host = torch.zeros((6, tokens), dtype=torch.long, pin_memory=pinned)  # [6, T]
        self._host_tables = torch.zeros(tokens * max_blocks_per_row, dtype=torch.long, pin_memory=pinned)  # [R M]
        self._step_tables = torch.zeros(tokens * max_blocks_per_row, dtype=torch.long, device=device)  # [R M]
        self._copied = torch.cuda.Event() if pinned else None  # the last copy out of the host buffers
        self.table_elements_copied = 0  # block ids the last step copied to the device

    @property
    def padding_row(self) -> int:
        return self.tokens

    def fill(self, rows: Sequence[tuple[Sequence[int], list[int], int, int]], pool: KVPool) -> None:
        """Stages rows of (token ids, block table, start position, logits kept) and pads the rest of the bucket.

        Rows take table rows 0..len(rows)-1 and their tokens come first; the logits kept are the last `kept` tokens
        of each row, in row order (the first of `staged[KEPT]`). Reads nothing back from the device.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffers
        block_size, scratch = pool.block_size, pool.scratch_block
        columns: list[list[int]] = [[] for _ in range(6)]
        ids, positions, blocks, places, row_of, kept = columns
        for index, (row_ids, table, start, keep) in enumerate(rows):
            offset = len(ids)
            kept.extend(range(offset + len(row_ids) - keep, offset + len(row_ids)))
            ids.extend(row_ids)
            positions.extend(range(start, start + len(row_ids)))
            blocks.extend(table[p // block_size] for p in range(start, start + len(row_ids)))
            places.extend(p % block_size for p in range(start, start + len(row_ids)))
            row_of.extend([index] * len(row_ids))
        padding = self.tokens - len(ids)
        ids.extend([0] * padding)
        positions.extend(j % block_size for j in range(padding))
        blocks.extend([scratch] * padding)
        places.extend(j % block_size for j in range(padding))
        row_of.extend([self.padding_row] * padding)
        kept.extend([0] * (self.tokens - len(kept)))
        self._host.copy_(torch.tensor(columns, dtype=torch.long))
        width = max((len(table) for _, table, _, _ in rows), default=0)
        count = len(rows) * width
        if count:
            self._host_tables[:count] = torch.tensor(
                [[*table, *[-1] * (width - len(table))] for _, table, _, _ in rows], dtype=torch.long
            ).view(-1)
        self.staged.copy_(self._host, non_blocking=True)
        self._step_tables[:count].copy_(self._host_tables[:count], non_blocking=True)
        self.tables.fill_(-1)
        self.tables[: len(rows), :width] = self._step_tables[:count].view(len(rows), width)
        self.tables[self.padding_row, 0] = scratch
        self.table_elements_copied = count
        if self._copied is not None:
            self._copied.record()


def bucketed_logits(
    model: torch.nn.Module, pool: KVPool, backend: AttentionBackend, staged: torch.Tensor, tables: torch.Tensor
) -> torch.Tensor:
    """One forward of a bucket's staged tokens [6, T] and tables [R, M]; returns logits [T, V] of every token.

    A fixed sequence of tensor ops for fixed shapes: what a CUDA graph captures and torch.compile traces whole.
    """
    layout = FlexLayout(staged[ROWS], staged[POSITIONS], tables, pool.block_size)
    step = StaticStep(pool, staged[WRITE_BLOCKS : WRITE_PLACES + 1], backend, layout)
    return packed_logits(model, staged[IDS], staged[POSITIONS], step)  # [T, V]
