"""An injected one-way network delay on the coordinator's calls to its replicas (`--replica-network-delay-ms`), to
measure the stack as if the replicas ran on other hosts (docs/architecture.md, "The accelerator twin").

Each unary call's request waits the delay before it is sent and its answer (reply or error) the delay after it
arrives. On a call stream (a session's calls as messages, specdec/serving/call_stream_client.py) every message
arrives the delay after it was written, each way, and messages written close together overlap their delays, as on a
link whose latency is the delay.
asyncio's own timers wake up on whole milliseconds (epoll's timeout, as libuv's), so a 0.1 ms sleep would take
about 1 ms; the waits here are kept by a thread of their own instead, which sleeps to each deadline with a 1 µs
timer slack and hands the waiting coroutine back to its loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import AsyncIterator

import grpc

from specdec.engine.simulated.device_wait import wait_until


class PreciseTimer:
    """Sleeps for asyncio coroutines, woken by a timer thread at the deadline rather than by the loop's clock.

    Handing a woken coroutine back to its loop takes time of its own (a thread switch, the loop's wake-up: ~0.1 ms
    on a busy host), so the timer keeps a moving average of how late sleeps end and wakes that much early.
    """

    def __init__(self):
        self._due: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future]] = []  # a heap by deadline
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self.lateness_s = 0.0  # moving average of how late a sleep ends past its deadline, woken at the deadline

    async def sleep(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        deadline = time.perf_counter() + seconds
        with self._changed:
            heapq.heappush(self._due, (deadline - self.lateness_s, next(self._order), loop, woken))
            if self._thread is None:
                self._thread = threading.Thread(target=self._wake, name="network-delay", daemon=True)
                self._thread.start()
            self._changed.notify()
        early = self.lateness_s
        await woken
        late = time.perf_counter() - deadline + early  # how late it would have ended, woken at the deadline
        self.lateness_s = max(0.0, min(seconds, self.lateness_s + _LATENESS_WEIGHT * (late - self.lateness_s)))

    def _wake(self) -> None:
        while True:
            with self._changed:
                while not self._due:
                    self._changed.wait()
                deadline = self._due[0][0]
                if deadline - time.perf_counter() > 1e-3:  # far off: a new, earlier deadline may come meanwhile
                    self._changed.wait(deadline - time.perf_counter() - 5e-4)
                    continue
                _, _, loop, woken = heapq.heappop(self._due)
            wait_until(deadline)
            loop.call_soon_threadsafe(_resolve, woken)


_LATENESS_WEIGHT = 0.05


def _resolve(woken: asyncio.Future) -> None:
    if not woken.done():  # a cancelled call's wait is simply dropped
        woken.set_result(None)


class _Delay:
    """A one-way delay of `delay_s`, slept on `timer`."""

    def __init__(self, delay_s: float, timer: PreciseTimer | None = None):
        if delay_s < 0:
            raise ValueError(f"replica_network_delay_ms must be >= 0, got {delay_s * 1e3:g}")
        self.delay_s = delay_s
        self.timer = timer or PreciseTimer()


class DelayedUnaryCalls(_Delay, grpc.aio.UnaryUnaryClientInterceptor):
    """Unary calls whose request and answer each take `delay_s` longer, as over a slower network."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        await self.timer.sleep(self.delay_s)
        try:
            return await (await continuation(client_call_details, request))
        finally:
            await self.timer.sleep(self.delay_s)


class DelayedStreams(_Delay, grpc.aio.StreamStreamClientInterceptor):
    """Streams whose every message, request or reply, arrives `delay_s` after it was sent (the stream's end and its
    status too)."""

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        call = await continuation(client_call_details, self._late(request_iterator))
        return self._late(call)

    async def _late(self, messages: AsyncIterator) -> AsyncIterator:
        """`messages`, each handed on `delay_s` after it came (its end or its error too). A task takes them as they
        come, so that the delays of messages close together overlap instead of adding up."""
        arrived: asyncio.Queue = asyncio.Queue()
        taker = asyncio.ensure_future(_take_all(messages, arrived))
        try:
            while True:
                at, message, error = await arrived.get()
                if (wait := at + self.delay_s - time.perf_counter()) > 0:
                    await self.timer.sleep(wait)
                if error is not None:
                    raise error
                if message is _END:
                    return
                yield message
        finally:
            taker.cancel()


_END = object()


async def _take_all(messages: AsyncIterator, arrived: asyncio.Queue) -> None:
    """Puts (arrival time, message, None) for each message, then (time, _END, None) or (time, None, its error)."""
    try:
        async for message in messages:
            arrived.put_nowait((time.perf_counter(), message, None))
        arrived.put_nowait((time.perf_counter(), _END, None))
    except asyncio.CancelledError as cancelled:  # the call was cancelled (or the reader left): as a plain call reads
        arrived.put_nowait((time.perf_counter(), None, cancelled))
        raise
    except Exception as error:  # noqa: BLE001 - handed on, late, to whoever reads the stream
        arrived.put_nowait((time.perf_counter(), None, error))


def network_delay_interceptors(delay_ms: float) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors a replica channel gets for a one-way delay of `delay_ms` (none for 0)."""
    if not delay_ms:
        return []
    timer = PreciseTimer()
    return [DelayedUnaryCalls(delay_ms / 1e3, timer), DelayedStreams(delay_ms / 1e3, timer)]
