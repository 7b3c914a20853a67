"""A model whose passes run in a process of its own (`--model-process`), as a serving engine's core runs apart from
its front end.

In one process, every torch op of a pass gives up the interpreter lock and takes it back, so each bit of Python
that the serving threads run (gRPC, the event loop) stalls the pass (docs/architecture.md, "The model process").
Here the serving process keeps the LoadedModel's tokenizer, settings and KV block tables (allocation, copy-on-write,
rollback, admission: everything the services decide) but not its weights; each pass goes to the model process as a
PassOrder (specdec/engine/model_worker.py) and its logits come back. The model thread waits on a pipe meanwhile, holding
no lock.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing

from specdec.common.errors import DownstreamUnavailableError
from specdec.engine.cpu_linears import drop_onednn_copies
from specdec.engine.draft_kernels import drop_draft_kernels
from specdec.engine.execution_settings import ExecutionSettings
from specdec.engine.kv.pool import KVPool, SequenceKV
from specdec.engine.model_runtime import LoadedModel
from specdec.engine.model_worker import PassOrder, RowOrder, serve_passes
from specdec.engine.packed_forward import reserved_rows

log = logging.getLogger(__name__)


class ModelProcessError(RuntimeError):
    """The model process failed a pass (INTERNAL)."""


class ModelProcessGoneError(DownstreamUnavailableError):
    """The model process has exited (UNAVAILABLE): killed, out of memory."""


class CopyRecordingPool(KVPool):
    """The serving process's KV pool: block tables only. A block copy (copy-on-write) is recorded for the model
    process, which holds the keys and values, to make before the next pass."""

    def __init__(self, like: KVPool):
        super().__init__(len(like.keys), like.blocks.num_blocks, like.block_size)
        self.allocated_blocks = like.allocated_blocks
        self.copies: list[tuple[int, int]] = []

    def copy_block(self, source: int, target: int) -> None:
        self.copies.append((source, target))

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        """The copies recorded since the last call, in order."""
        with self.lock:
            copies, self.copies = tuple(self.copies), []
        return copies


def serving_model(model: LoadedModel, settings: ExecutionSettings) -> LoadedModel | ModelProcess:
    """The model a service runs its sessions on: `model`, or with --model-process one whose passes run in a model
    process pinned to --model-cpus."""
    return ModelProcess.start(model, settings.model_thread_cpus()) if settings.model_process else model


class WaitingThreadPlacement:
    """Where the thread that waits on the model process runs: on the model's cores, idle between orders, unless the
    model process runs a pass ahead (GreedyLookahead), when the thread judges each answer on the service's other
    cores instead of taking the model's from that pass (docs/architecture.md, "The model process")."""

    def __init__(self, model_cpus: frozenset[int]):
        self._elsewhere = frozenset(os.sched_getaffinity(0)) - model_cpus if model_cpus else frozenset()
        self._moved: tuple[int, set[int]] | None = None  # (the moved thread's id, its cores before)

    def place(self, runs_ahead: bool) -> None:
        """Moves the calling thread off the model's cores while `runs_ahead`, and back to its own cores after."""
        thread = threading.get_ident()
        if runs_ahead and self._moved is None and self._elsewhere:
            self._moved = thread, os.sched_getaffinity(0)
            os.sched_setaffinity(0, self._elsewhere)  # 0: this thread only
        elif not runs_ahead and self._moved is not None and self._moved[0] == thread:
            os.sched_setaffinity(0, self._moved[1])
            self._moved = None


class ModelProcess:
    """A packed LoadedModel whose passes run in a model process (see the module doc); otherwise the model itself."""

    def __init__(self, model: LoadedModel, process, connection, logits_in: torch.Tensor, cpus: frozenset[int]):
        self.model = model
        self.kv_pool = CopyRecordingPool(model.kv_pool)
        self._process = process
        self._connection = connection
        self._logits_in = logits_in  # [rows, V], the model process's SharedLogits buffer
        self._lock = threading.Lock()  # one pass in flight
        self._placement = WaitingThreadPlacement(cpus)
        self._closing = False

    @classmethod
    def start(cls, model: LoadedModel, cpus: frozenset[int] = frozenset(), timeout_s: float = 600) -> ModelProcess:
        """Starts the model process on `cpus` (empty: this process's), waits until it has loaded the model, then
        drops this process's copy of the weights."""
        if not model.packed:
            raise ValueError(f"--model-process needs a packed model; {model.settings.model}: {model.unpacked_reason}")
        context = torch.multiprocessing.get_context("spawn")  # tensors in shared memory travel over its pipes
        ours, theirs = context.Pipe()
        process = context.Process(
            target=serve_passes, args=(model.settings, cpus, theirs), name="model-process", daemon=True
        )
        started = time.perf_counter()
        process.start()
        theirs.close()
        log.info("waiting for the model process (pid %d) to load %s", process.pid, model.settings.model)
        if not ours.poll(timeout_s):
            process.kill()
            raise ModelProcessError(f"the model process did not load {model.settings.model} within {timeout_s:g}s")
        status, detail = ours.recv()
        if status != "ready":
            process.kill()
            raise ModelProcessError(f"the model process did not start: {detail}")
        log.info("model process ready in %.1fs", time.perf_counter() - started)
        drop_draft_kernels(model.model)
        drop_onednn_copies(model.model)
        model.model.to("meta")  # the weights live in the model process only
        return cls(model, process, ours, detail, cpus)

    def new_cache(self) -> SequenceKV:
        """An empty sequence in the block-table pool."""
        return self.kv_pool.new_sequence()

    def forward_rows(self, rows: Sequence[tuple[Sequence[int], SequenceKV, int]]) -> list[torch.Tensor]:
        """LoadedModel.forward_rows, run by the model process: per row float32 logits [keep, V]."""
        with self._lock, reserved_rows(rows):
            order = PassOrder(
                self.kv_pool.take_copies(),
                self.kv_pool.allocated_blocks,
                tuple(
                    RowOrder(tuple(kv.table), kv.length, tuple(ids), keep, kv.decodes_greedily)
                    for ids, kv, keep in rows
                ),
            )
            self._placement.place(order.runs_ahead)
            logits = self._pass(order)  # [K, V]
            for ids, kv, _ in rows:
                kv.length += len(ids)
        return list(torch.split(logits, [keep for _, _, keep in rows]))

    def _pass(self, order: PassOrder) -> torch.Tensor:
        try:
            self._connection.send(order)
            status, detail = self._connection.recv()
        except (EOFError, OSError) as error:
            raise ModelProcessGoneError(f"the model process is gone (exit code {self._process.exitcode})") from error
        if status != "ok":
            raise ModelProcessError(f"the model process failed the pass: {detail}")
        rows, grown = detail
        if grown is not None:
            self._logits_in = grown
        return self._logits_in[:rows].clone()  # the next pass overwrites the buffer

    def forward(self, input_ids: torch.Tensor, cache: SequenceKV) -> torch.Tensor:
        """input_ids [1, T] after the cached prefix -> float32 logits [T, V]."""
        return self.forward_rows([(input_ids[0].tolist(), cache, input_ids.shape[1])])[0]

    def on_exit(self, callback: Callable[[int | None], None]) -> None:
        """Calls callback(exit code) from a monitor thread if the model process ends before `close` (killed, out of
        memory): the service then stops serving instead of failing every call."""

        def watch() -> None:
            multiprocessing.connection.wait([self._process.sentinel])
            if not self._closing:
                log.error("the model process exited with %s; the service stops serving", self._process.exitcode)
                callback(self._process.exitcode)

        threading.Thread(target=watch, name="model-process-monitor", daemon=True).start()

    def close(self) -> None:
        """Ends the model process (it exits when its pipe closes)."""
        self._closing = True
        self._connection.close()
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()

    def __getattr__(self, name: str):  # tokenizer, vocab_size, settings, packed, ...: the model's
        return getattr(self.model, name)
