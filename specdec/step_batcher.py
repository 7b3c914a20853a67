"""Continuous batching of a service's model work on one worker thread.

Calls are queued from the event loop. Each time the worker is free it takes everything queued, runs the
one-off calls (close, ...) in arrival order, then every batchable kind (open, verify, propose) as batches
of at most `max_batch_size` calls on distinct sessions (a call's first argument is its session id)
through that kind's batch function, which does one model pass for all of them. Sessions thus join and leave the running batch between steps. `max_batch_size` 1 turns
batching off (one call per step, in arrival order).

In a disaggregated stack every step of a session is a round trip: its next call leaves the coordinator only
after the previous reply arrived. Taking only what is queued would then let two sessions alternate, one row
per step. So before a step the worker waits, at most `max_wait_s`, for the sessions it served recently
(within two step durations) that have not called again yet.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from specdec.settings import setting

log = logging.getLogger(__name__)

BatchFn = Callable[[Sequence[tuple]], Sequence[Any]]  # argument tuples -> per call a result or an Exception
T = TypeVar("T")


def only_result(results: Sequence[T | Exception]) -> T:
    """The result of a one-call batch (a batch function called for a single call); raises its error."""
    if isinstance(results[0], Exception):
        raise results[0]
    return results[0]


@dataclass(frozen=True)
class _Call:
    kind: str | None  # a batchable kind, or None for a one-off call of `fn`
    fn: Callable[..., Any] | None
    args: tuple
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class StepBatchingSettings:
    """The batching part of a model service's settings (a base of each one's settings class)."""

    max_batch_size: int = setting(32, "most calls run together in one model step (continuous batching; "
                                        "1 = off: one session per step)")
    max_batch_wait_ms: float = setting(10.0, "longest a step waits for sessions served in the last steps whose "
                                             "next call is still on its way (0 = run what is queued)")


class StepBatcher:
    """One worker thread that runs queued model work, batching calls of the same kind."""

    def __init__(self, batch_fns: Mapping[str, BatchFn], max_batch_size: int, name: str,
                 on_step: Callable[[str, int], None] | None = None, max_wait_s: float = 0.0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.batch_fns = dict(batch_fns)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s if max_batch_size > 1 else 0.0
        self.on_step = on_step  # (kind, calls in the batch), e.g. a batch-size histogram
        self._recent: dict[object, float] = {}  # session -> when a step last served it (monotonic s)
        self._step_s = 0.0  # running average of a round's duration
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, kind: str, *args) -> asyncio.Future:
        """Queues one call of a batchable kind; the future resolves to its result or raises its error."""
        if kind not in self.batch_fns:
            raise KeyError(f"no batch function for {kind!r}")
        return self._enqueue(kind, None, args)

    def run(self, fn: Callable[..., Any], *args) -> asyncio.Future:
        """Queues a one-off call on the worker thread (it runs between batches, never beside one)."""
        return self._enqueue(None, fn, args)

    def close(self, wait: bool = True) -> None:
        """Stops the worker after the calls already queued (without waiting when wait is False)."""
        self._queue.put(None)
        if wait:
            self._thread.join()

    def _enqueue(self, kind: str | None, fn: Callable[..., Any] | None, args: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Call(kind, fn, args, future, loop))
        return future

    def _work(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            calls = [first]
            while not self._queue.empty():
                call = self._queue.get_nowait()
                if call is None:
                    self._queue.put(None)  # stop after this round
                    break
                calls.append(call)
            self._wait_for_recent_sessions(calls)
            started = time.monotonic()
            self._run_round(calls)
            self._step_s += 0.2 * (time.monotonic() - started - self._step_s)

    def _wait_for_recent_sessions(self, calls: list[_Call]) -> None:
        """Adds calls arriving within max_wait_s while sessions served in the last two steps are missing."""
        if self.max_wait_s <= 0 or all(call.kind is None for call in calls):
            return
        now = time.monotonic()
        self._recent = {s: seen for s, seen in self._recent.items() if now - seen < 2 * self._step_s + self.max_wait_s}
        expected = set(self._recent)
        deadline = now + self.max_wait_s
        while expected - {call.args[0] for call in calls if call.kind is not None}:
            try:
                call = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return
            if call is None:
                self._queue.put(None)
                return
            calls.append(call)

    def _run_round(self, calls: list[_Call]) -> None:
        """Runs one drain's calls. Batchable calls wait to be batched, except that a one-off call on a session
        (e.g. its close) first runs the batches holding that session's earlier calls, so no call overtakes
        an earlier one on the same session."""
        by_kind: dict[str, list[_Call]] = {}
        for call in calls:
            if call.future.cancelled():
                continue
            if call.kind is not None:
                by_kind.setdefault(call.kind, []).append(call)
                continue
            session = call.args[0] if call.args else None
            if any(c.args[0] == session for pending in by_kind.values() for c in pending):
                self._run_batches(by_kind)
                by_kind = {}
            self._run_one(call)
        self._run_batches(by_kind)

    def _run_batches(self, by_kind: dict[str, list[_Call]]) -> None:
        for kind, pending in by_kind.items():
            while pending:
                batch, pending = self._next_batch(pending)
                self._run_batch(kind, batch)

    def _next_batch(self, pending: list[_Call]) -> tuple[list[_Call], list[_Call]]:
        """Up to max_batch_size calls with distinct sessions (first argument), in arrival order; a second call
        on a session already in the batch (a retry) waits for the next batch. Returns (batch, the rest)."""
        batch: list[_Call] = []
        rest: list[_Call] = []
        sessions: set = set()
        for call in pending:
            if len(batch) < self.max_batch_size and call.args[0] not in sessions:
                batch.append(call)
                sessions.add(call.args[0])
            else:
                rest.append(call)
        return batch, rest

    def _run_one(self, call: _Call) -> None:
        if call.args:
            self._recent.pop(call.args[0], None)  # e.g. a close: do not wait for that session any more
        try:
            result = call.fn(*call.args)
        except Exception as error:  # noqa: BLE001 - handed to the caller
            result = error
        _settle(call, result)

    def _run_batch(self, kind: str, batch: list[_Call]) -> None:
        try:
            results = self.batch_fns[kind]([call.args for call in batch])
        except Exception as error:  # noqa: BLE001 - the whole step failed: every call in it gets the error
            log.exception("%s step of %d calls failed", kind, len(batch))
            results = [error] * len(batch)
        served = time.monotonic()
        for call in batch:
            self._recent[call.args[0]] = served
        if self.on_step is not None:
            self.on_step(kind, len(batch))
        for call, result in zip(batch, results):
            _settle(call, result)


def _settle(call: _Call, result: Any) -> None:
    def settle() -> None:
        if call.future.done():
            return
        if isinstance(result, BaseException):
            call.future.set_exception(result)
        else:
            call.future.set_result(result)

    try:
        call.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop has closed: nobody waits for this call any more
        pass
