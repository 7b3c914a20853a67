"""Admission of new sessions by free KV blocks: they wait in arrival order for a bounded time, then are refused.

A new session needs its prompt's blocks plus one per lane to grow into (specdec/engine/kv/pool.py). While the pool has
fewer free (less what sessions admitted but not yet opened will take), it waits behind the sessions that came
before it, at most `kv_admission_wait_ms`; then it gets KVCacheFullError (RESOURCE_EXHAUSTED), saying what it asked
and what is free. Sessions already running are not held back: one that cannot grow fails alone at its next step.
This runs on the event loop, before the open is queued for the model thread, so waiting holds no step back.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from specdec.common.errors import KVCacheFullError
from specdec.common.settings import setting
from specdec.engine.kv.pool import KVPool

POLL_S = 0.005  # how often a waiting session looks at the free blocks again (blocks are freed on the model thread)


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
    kv_admission_wait_ms: float = setting(
        2000.0, "longest a new session waits for free KV blocks before RESOURCE_EXHAUSTED (0 = refuse at once)"
    )


class KVAdmission:
    """The queue of new sessions waiting for free blocks of one pool."""

    def __init__(self, pool: KVPool, wait_s: float):
        self.pool = pool
        self.wait_s = wait_s
        self._waiting: collections.deque[object] = collections.deque()  # tickets, in arrival order
        self._promised = 0  # blocks of sessions admitted whose open has not finished

    def blocks_needed(self, prompt_tokens: int, lanes: int = 1) -> int:
        """A new session's blocks: its prompt's, plus one per lane to grow into."""
        return self.pool.blocks_for(prompt_tokens) + lanes

    @asynccontextmanager
    async def admitted(self, blocks: int) -> AsyncIterator[None]:
        """Waits in order until `blocks` blocks are free, then holds them promised while the body (the open) runs;
        KVCacheFullError when they are not free within wait_s, or never could be."""
        total = self.pool.blocks.num_blocks
        if blocks > total:
            raise KVCacheFullError(f"KV cache full: a new session asks for {blocks} blocks, more than all {total}")
        ticket = object()
        self._waiting.append(ticket)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        try:
            while self._waiting[0] is not ticket or self._free() < blocks:
                if loop.time() >= deadline:
                    raise KVCacheFullError(
                        f"KV cache full: a new session asks for {blocks} blocks, {max(self._free(), 0)} of {total} "
                        f"free after waiting {self.wait_s:g}s behind {self._waiting.index(ticket)} other(s)"
                    )
                await asyncio.sleep(POLL_S)
        finally:
            self._waiting.remove(ticket)
        self._promised += blocks
        try:
            yield
        finally:
            self._promised -= blocks

    def _free(self) -> int:
        return self.pool.blocks.free - self._promised
