"""Is the injected network delay the delay a call gets? Info calls to a replica through a channel built as the
coordinator builds its replica channels, with each delay, timed one after another: the one-way delay measured is
half the median round trip's growth over no delay. The same calls with the delay slept on asyncio's own timers
show why the coordinator keeps it on a thread of its own (coordinator/network_delay.py)."""

from __future__ import annotations

import asyncio
import statistics
import time
import types
from collections.abc import Sequence

from coordinator.network_delay import DelayedUnaryCalls, network_delay_interceptors
from specdec.serving.grpc_options import channel_options
from specdec.serving.tls import open_aio_channel
from specdec.v1 import common_pb2, verifier_pb2_grpc

CALLS = 200


async def round_trips(address: str, interceptors: list, calls: int) -> list[float]:
    """Seconds of `calls` Info calls, one after another, after one to warm the channel."""
    channel = open_aio_channel(address, None, channel_options(), interceptors=interceptors)
    try:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        await stub.Info(common_pb2.InfoRequest(), timeout=30)
        samples = []
        for _ in range(calls):
            started = time.perf_counter()
            await stub.Info(common_pb2.InfoRequest(), timeout=30)
            samples.append(time.perf_counter() - started)
        return samples
    finally:
        await channel.close()


async def measure_injected_delay(address: str, delays_ms: Sequence[float], calls: int = CALLS) -> dict:
    """Per nominal delay (ms): the measured one-way delay, with the coordinator's timer and with asyncio.sleep."""
    baseline = statistics.median(await round_trips(address, [], calls))
    loop_timer = types.SimpleNamespace(sleep=asyncio.sleep)  # the event loop's own timers, for comparison
    figures = {"calls": calls, "round_trip_without_delay_ms": round(baseline * 1e3, 4)}
    for delay in (d for d in delays_ms if d):
        precise = await round_trips(address, network_delay_interceptors(delay), calls)
        coarse = await round_trips(address, [DelayedUnaryCalls(delay / 1e3, loop_timer)], calls)
        figures[f"{delay:g}"] = {
            "nominal_one_way_ms": delay,
            "measured_one_way_ms": round((statistics.median(precise) - baseline) / 2 * 1e3, 4),
            "measured_one_way_ms_p90": round((statistics.quantiles(precise, n=10)[-1] - baseline) / 2 * 1e3, 4),
            "with_asyncio_sleep_one_way_ms": round((statistics.median(coarse) - baseline) / 2 * 1e3, 4),
        }
    return figures
