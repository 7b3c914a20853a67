"""Admission of sessions by free KV blocks: they queue in arrival order until the blocks are free or their call's
deadline nears; past a bounded queue they are refused at once.

A new session needs its prompt's blocks plus one per lane to grow into (specdec/engine/kv/pool.py). While the pool
has fewer free (less what sessions admitted but not yet opened will take), it waits behind the sessions that came
before it. A session that was preempted (specdec/engine/kv/preemption.py) queues the same way to be recomputed, ahead
of every new session, as vLLM puts preempted requests back at the front of its waiting queue.

A wait ends with KVCacheFullError (RESOURCE_EXHAUSTED), saying what it asked and what is free:
- when the call's deadline is less than `DEADLINE_MARGIN_S` away, so that the caller hears the refusal from the
  replica instead of its own deadline (which it would take for a replica that is gone);
- at once when `kv_queue_limit` new sessions already wait, or when the session asks for more than the whole pool.
This runs on the event loop, before the call is queued for the model thread, so waiting holds no step back.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from specdec.common.errors import KVCacheFullError
from specdec.common.settings import setting
from specdec.engine.kv.pool import KVPool

POLL_S = 0.005  # how often a waiting session looks at the free blocks again (blocks are freed on the model thread)
DEADLINE_MARGIN_S = 1.0  # a wait ends this long before its call's deadline: time for the step and the answer
WaitHook = Callable[[float, bool], None]  # (seconds waited, whether the session was resuming) of each admission


@dataclass(frozen=True)
class KVCacheSettings:
    """The KV cache part of a model service's settings (a base of each one's settings class)."""

    kv_cache_budget: float = setting(
        0.5,
        "memory for the model's KV cache: bytes, or (at most 1) a share (CUDA: of the GPU's total memory for all "
        "this process holds, the pool getting what the weights leave, allocated before serving; two services on one "
        "GPU give shares that sum under 1; CPU: of the available memory, taken as used)",
    )
    kv_block_size: int = setting(
        16,
        "positions per KV cache block (the unit of allocation and of prefix sharing); on CUDA with the flex backend "
        "16, 32, 64 or 128",
    )
    kv_queue_limit: int = setting(
        64,
        "most new sessions waiting for free KV blocks at once; one more is refused at once with RESOURCE_EXHAUSTED "
        "(0 = refuse whenever the blocks are not free)",
    )


@dataclass(frozen=True)
class _Ticket:
    resuming: bool


class KVAdmission:
    """The queue of sessions waiting for free blocks of one pool: preempted ones to resume, then new ones."""

    def __init__(self, pool: KVPool, queue_limit: int, on_wait: WaitHook | None = None):
        self.pool = pool
        self.queue_limit = queue_limit
        self.on_wait = on_wait
        self._waiting: collections.deque[_Ticket] = collections.deque()  # resuming tickets first, each in arrival
        self._promised = 0  # blocks of sessions admitted whose call has not finished

    def blocks_needed(self, tokens: int, lanes: int = 1) -> int:
        """A session's blocks: its tokens', plus one per lane to grow into."""
        return self.pool.blocks_for(tokens) + lanes

    def queued(self, resuming: bool) -> int:
        """Sessions waiting now: the resuming ones, or the new ones."""
        return sum(ticket.resuming == resuming for ticket in self._waiting)

    @asynccontextmanager
    async def admitted(
        self, blocks: int, deadline: float | None, resuming: bool = False, max_wait_s: float | None = None
    ) -> AsyncIterator[None]:
        """Waits in order until `blocks` blocks are free, then holds them promised while the body (the call that
        takes them) runs. `deadline`: the event loop's time by which the call must be answered (None: none);
        max_wait_s: a bound of the wait's own. KVCacheFullError when they are not free in time, never could be, or
        the queue of new sessions is full."""
        total = self.pool.blocks.num_blocks
        if blocks > total:
            raise KVCacheFullError(f"KV cache full: a session asks for {blocks} blocks, more than all {total}")
        loop = asyncio.get_running_loop()
        started = loop.time()
        give_up = min(
            deadline - DEADLINE_MARGIN_S if deadline is not None else float("inf"),
            started + max_wait_s if max_wait_s is not None else float("inf"),
        )
        if not self._waiting and self._free() >= blocks:
            ticket = None  # nobody ahead and the blocks are there
        else:
            ticket = self._join(blocks, resuming)
        try:
            while ticket is not None and (self._waiting[0] is not ticket or self._free() < blocks):
                if loop.time() >= give_up:
                    raise KVCacheFullError(
                        f"KV cache full: a session asks for {blocks} blocks, {max(self._free(), 0)} of {total} free "
                        f"after waiting {loop.time() - started:.1f}s behind "
                        f"{self._waiting.index(ticket)} other(s)"
                    )
                await asyncio.sleep(POLL_S)
        finally:
            if ticket is not None:
                self._waiting.remove(ticket)
        if self.on_wait is not None:
            self.on_wait(loop.time() - started, resuming)
        self._promised += blocks
        try:
            yield
        finally:
            self._promised -= blocks

    def _join(self, blocks: int, resuming: bool) -> _Ticket:
        """Queues a ticket: a resuming one behind the other resuming ones, a new one at the end unless the queue of
        new sessions is full."""
        if not resuming and self.queued(resuming=False) >= self.queue_limit:
            raise KVCacheFullError(
                f"KV cache full: a session asks for {blocks} blocks, {max(self._free(), 0)} of "
                f"{self.pool.blocks.num_blocks} free, and {self.queue_limit} new sessions already wait "
                "(kv_queue_limit)"
            )
        ticket = _Ticket(resuming)
        if resuming:
            self._waiting.insert(self.queued(resuming=True), ticket)
        else:
            self._waiting.append(ticket)
        return ticket

    def _free(self) -> int:
        return self.pool.blocks.free - self._promised
