"""read_ahead: the producer runs ahead of a slow consumer; errors and early stops reach the other side."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from coordinator.read_ahead import read_ahead


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_the_producer_moves_on_while_the_consumer_is_busy_and_order_is_kept():
    produced: list[int] = []

    async def source():
        for item in range(3):
            produced.append(item)
            yield item

    async def main():
        seen = []
        async for item in read_ahead(source()):
            await asyncio.sleep(0.05)  # a slow client write
            seen.append((item, list(produced)))
        return seen

    seen = run(main())
    assert [item for item, _ in seen] == [0, 1, 2]
    assert seen[0][1] == [0, 1, 2]  # everything was produced while the first item was still being consumed


def test_the_producer_runs_at_most_depth_items_ahead_of_a_stalled_consumer():
    produced: list[int] = []

    async def source():
        for item in range(100):
            produced.append(item)
            yield item

    async def main():
        async with contextlib.aclosing(read_ahead(source(), depth=2)) as items:
            first = await anext(items)
            await asyncio.sleep(0.05)  # a client that stopped reading
            return first, len(produced)

    first, num_produced = run(main())
    assert first == 0
    assert num_produced <= 1 + 2 + 1  # the item taken, `depth` queued, one waiting to be queued


def test_a_producer_error_is_raised_in_the_consumer_after_the_items_before_it():
    async def source():
        yield 1
        raise ValueError("verifier gone")

    async def main():
        seen = []
        with pytest.raises(ValueError, match="verifier gone"):
            async for item in read_ahead(source()):
                seen.append(item)
        return seen

    assert run(main()) == [1]


def test_a_consumer_that_stops_early_cancels_the_producer_and_waits_for_its_clean_up():
    cleaned = asyncio.Event()

    async def source():
        try:
            for item in range(1000):
                yield item
                await asyncio.sleep(0.01)
        finally:
            await asyncio.sleep(0.05)  # e.g. closing the request's sessions
            cleaned.set()

    async def main():
        async with contextlib.aclosing(read_ahead(source())) as items:
            async for item in items:
                if item == 2:
                    break
        return cleaned.is_set()

    assert run(main())
