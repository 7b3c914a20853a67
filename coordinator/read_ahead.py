"""Reading an async iterator ahead of its consumer, so that a slow consumer does not hold the producer back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def read_ahead(source: AsyncIterator[T], depth: int = 4) -> AsyncIterator[T]:
    """Yields source's items in order while a task already pulls the next ones, at most `depth` ahead.

    A request's rounds are the producer and the journal and client writes the consumer: the next round's
    Verify goes out while the last round's chunk is journaled and written, instead of after. A producer's error
    is raised in the consumer; when the consumer stops early (or is cancelled) the task is cancelled and
    awaited, so the source's own clean-up (closing its sessions) has run when this returns.
    """
    items: asyncio.Queue[tuple[object, BaseException | None]] = asyncio.Queue(maxsize=depth)

    async def pump() -> None:
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    await items.put((item, None))
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            await items.put((_END, error))
        else:
            await items.put((_END, None))

    task = asyncio.ensure_future(pump())
    try:
        while True:
            item, error = await items.get()
            if item is _END:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
