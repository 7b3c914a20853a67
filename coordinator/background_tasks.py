"""Work started in the background and kept referenced until it is done (the event loop holds tasks weakly)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator


class BackgroundTasks:
    """The tasks started here that have not finished yet."""

    def __init__(self) -> None:
        self._running: set[asyncio.Future] = set()

    def start(self, work: Awaitable) -> asyncio.Future:
        """Runs `work` as a task, held until it is done."""
        task = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    def __len__(self) -> int:
        return len(self._running)

    def __iter__(self) -> Iterator[asyncio.Future]:
        return iter(list(self._running))
