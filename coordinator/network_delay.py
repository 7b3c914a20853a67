"""An injected one-way network delay on the coordinator's calls to its replicas (`--replica-network-delay-ms`), to
measure the stack as if the replicas ran on other hosts (docs/architecture.md, "The accelerator twin").

Each call's request waits the delay before it is sent and its answer (reply or error) the delay after it arrives.
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


class DelayedUnaryCalls(grpc.aio.UnaryUnaryClientInterceptor):
    """Unary calls whose request and answer each take `delay_s` longer, as over a slower network."""

    def __init__(self, delay_s: float, timer: PreciseTimer | None = None):
        if delay_s < 0:
            raise ValueError(f"replica_network_delay_ms must be >= 0, got {delay_s * 1e3:g}")
        self.delay_s = delay_s
        self.timer = timer or PreciseTimer()

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        await self.timer.sleep(self.delay_s)
        try:
            return await (await continuation(client_call_details, request))
        finally:
            await self.timer.sleep(self.delay_s)


def network_delay_interceptors(delay_ms: float) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors a replica channel gets for a one-way delay of `delay_ms` (none for 0)."""
    return [DelayedUnaryCalls(delay_ms / 1e3)] if delay_ms else []
