"""The model process's side of a service whose passes run in a process of their own (specdec/engine/model_process.py).

The serving process keeps every block table and decides every allocation, copy and rollback; this process holds
the weights and the keys/values, and runs each pass it is sent on the blocks it is told, answering with the
logits. It has one thread (and torch's), so no serving thread ever waits for its interpreter lock, nor it for
theirs (docs/architecture.md, "The model process").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing  # noqa: F401 - registers how tensors in shared memory travel over a pipe

from specdec.common.startup_objects import freeze_startup_objects
from specdec.engine.kv.pool import KVPool, SequenceKV
from specdec.engine.model_runtime import LoadedModel, ModelSettings

log = logging.getLogger(__name__)

SHARED_LOGIT_ROWS = 64  # logit rows the shared buffer holds at first; a pass with more grows it


@dataclass(frozen=True)
class RowOrder:
    """One row of a pass: its block table, the positions it holds, its new tokens, how many last rows need logits."""

    table: tuple[int, ...]
    start: int
    token_ids: tuple[int, ...]
    logit_rows: int
    decodes_greedily: bool = False  # the next pass likely feeds this one's argmax (GreedyLookahead: one-row passes)


@dataclass(frozen=True)
class PassOrder:
    """One packed pass: the block copies made since the last one (copy-on-write of forked sequences), in order,
    the pool's block count, then the rows."""

    copies: tuple[tuple[int, int], ...]  # (source block, target block)
    allocated_blocks: int
    rows: tuple[RowOrder, ...]

    @property
    def runs_ahead(self) -> bool:
        """Whether the model process runs the next pass before it is asked (GreedyLookahead): one marked row."""
        return len(self.rows) == 1 and self.rows[0].decodes_greedily and self.rows[0].logit_rows >= 1


class BlockTableView(SequenceKV):
    """A row's blocks as the serving process holds them: read by a pass, never reserving or freeing any here."""

    def __init__(self, pool: KVPool, table: Sequence[int], length: int):  # no finalizer: the blocks are not ours
        self.pool = pool
        self.table = list(table)
        self.length = length

    def reserve(self, length: int) -> None:
        """The serving process reserved them already."""

    def trim(self) -> None:
        """The serving process frees blocks."""


class SharedLogits:
    """Shared memory the model process writes each pass's float32 logits [K, V] into, for the serving process to
    read; a pass with more rows than it holds grows it, and the new one is handed over with that pass's answer."""

    def __init__(self, rows: int, vocab: int):
        self.buffer = torch.empty((rows, vocab)).share_memory_()  # [rows, V]

    def put(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Writes logits [K, V] at the buffer's start; returns the buffer if it had to grow for them, else None."""
        grown = None
        if logits.shape[0] > self.buffer.shape[0]:
            rows = max(2 * self.buffer.shape[0], logits.shape[0])
            self.buffer = grown = torch.empty((rows, logits.shape[1])).share_memory_()
        self.buffer[: logits.shape[0]].copy_(logits)
        return grown


def run_pass(model: LoadedModel, order: PassOrder) -> torch.Tensor:
    """Applies the order's copies and runs its rows; their float32 logits [K, V] (K: the rows' logit_rows)."""
    pool = model.kv_pool
    pool.allocated_blocks = order.allocated_blocks
    for source, target in order.copies:
        pool.copy_block(source, target)
    rows = [(row.token_ids, BlockTableView(pool, row.table, row.start), row.logit_rows) for row in order.rows]
    return torch.cat(model.forward_rows(rows))  # [K, V]


@dataclass(frozen=True)
class RunAhead:
    """A pass GreedyLookahead ran before it was asked: its one row, its logits [1, V], and the pool's block count
    then. A position that opens a block the row does not hold yet was written in the scratch block instead."""

    row: RowOrder
    logits: torch.Tensor  # [1, V]
    allocated_blocks: int  # the scratch block's id (specdec/engine/kv/pool.py)
    in_scratch: bool


class GreedyLookahead:
    """A one-row greedy decode's next pass, run before the serving process asks for it (asynchronous scheduling,
    docs/architecture.md "The model process"): while the serving process judges a pass, this process already feeds
    the pass's argmax at the next position, and answers the next order at once if it is exactly that pass.

    Only a pass the serving process marked (a plain round under greedy decoding). The early write touches no other
    sequence's keys: the row's last block was made its own for the marked pass (copy-on-write), and a position that
    opens a new block is written in the pool's scratch block, which no table names, then copied into the block the
    order brings. Whatever order comes next rewrites the position before anyone reads it.
    """

    def __init__(self, model: LoadedModel):
        self.model = model
        self._ahead: RunAhead | None = None

    def answer(self, order: PassOrder) -> torch.Tensor | None:
        """The logits [1, V] of the pass run ahead if `order` is exactly it, else None (then run the order)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or order.copies or len(order.rows) != 1:
            return None
        row, expected = order.rows[0], ahead.row
        held = len(expected.table) - 1  # the row's blocks before the one the position falls in
        same_pass = (row.start, row.token_ids, row.logit_rows) == (expected.start, expected.token_ids, 1)
        if not same_pass or len(row.table) <= held or row.table[:held] != expected.table[:held]:
            return None
        pool = self.model.kv_pool
        if ahead.in_scratch:
            if order.allocated_blocks != ahead.allocated_blocks:  # the buffers grow without the scratch block
                return None
            pool.copy_block(ahead.allocated_blocks, row.table[held])
        elif row.table[held] != expected.table[held]:
            return None
        pool.allocated_blocks = order.allocated_blocks  # as run_pass sets it
        return ahead.logits

    def run_after(self, order: PassOrder, logits: torch.Tensor) -> None:
        """Runs the next pass of a marked one-row order whose logits [K, V] were just answered."""
        if not order.runs_ahead:
            return
        row, pool = order.rows[0], self.model.kv_pool
        position = row.start + len(row.token_ids)
        if position >= self.model.max_context_tokens:
            return
        held = position // pool.block_size
        in_scratch = position % pool.block_size == 0
        table = row.table[:held] + ((pool.scratch_block,) if in_scratch else (row.table[held],))
        token = int(logits[-1].argmax())
        view = BlockTableView(pool, table, position)
        ahead = torch.cat(self.model.forward_rows([((token,), view, 1)]))  # [1, V]
        self._ahead = RunAhead(RowOrder(table, position, (token,), 1), ahead, pool.allocated_blocks, in_scratch)


def serve_passes(settings: ModelSettings, cpus: frozenset[int], connection: Connection) -> None:
    """The model process: loads the model, says ("ready", its SharedLogits buffer), then answers each PassOrder
    with ("ok", (logit rows, the buffer if it grew)) or ("error", why) until the serving process closes its end."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s model-process %(levelname)s %(message)s")
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        model = LoadedModel.load(settings)
        if not model.packed:
            raise ValueError(f"not served packed here: {model.unpacked_reason}")
    except Exception as error:  # noqa: BLE001 - told to the serving process, which fails its start
        connection.send(("error", f"loading {settings.model!r} failed: {error!r}"))
        return
    logits_out = SharedLogits(SHARED_LOGIT_ROWS, model.vocab_size)
    lookahead = GreedyLookahead(model)
    freeze_startup_objects()
    connection.send(("ready", logits_out.buffer))
    while True:
        try:
            order = connection.recv()
        except EOFError:  # the serving process is gone or closed us
            return
        try:
            logits = lookahead.answer(order)
            if logits is None:
                logits = run_pass(model, order)  # [K, V]
            connection.send(("ok", (logits.shape[0], logits_out.put(logits))))
        except Exception as error:  # noqa: BLE001 - that pass fails, the process serves on
            log.exception("pass failed")
            connection.send(("error", repr(error)))
            continue
        try:
            lookahead.run_after(order, logits)
        except Exception:  # noqa: BLE001 - only a guess: the next order runs as sent
            log.exception("greedy lookahead failed")
