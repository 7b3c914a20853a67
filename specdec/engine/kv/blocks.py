"""Which blocks of a paged KV pool are free, and how many sequences hold each of the others.

A block is B positions of keys/values in every layer (specdec/engine/kv/pool.py). Sequences hold blocks through their
block tables; a fork shares its parent's blocks (the count of holders goes up) and the first write into a shared
block copies it (copy-on-write, like vLLM's block manager). A block is free again once nobody holds it.

Allocation takes the lowest free ids first, so the same operations in the same order give the same block
tables (tensor-parallel ranks mirror the leader's allocation by replaying them).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from specdec.common.errors import KVCacheFullError


class BlockAllocator:
    """Free list and holder counts of `num_blocks` blocks."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap: the lowest free id is taken first
        self._holders = [0] * num_blocks  # per block how many block tables hold it
        self.shared = 0  # blocks held by more than one table
        self.peak_used = 0  # most blocks held at once

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int, positions_per_block: int) -> list[int]:
        """`count` free blocks, lowest ids first; KVCacheFullError (taking none) when fewer are free."""
        if count > len(self._free):
            raise KVCacheFullError(
                f"KV cache full: asked for {count} blocks ({count * positions_per_block} positions), "
                f"{len(self._free)} of {self.num_blocks} free"
            )
        taken = [heapq.heappop(self._free) for _ in range(count)]
        for block in taken:
            self._holders[block] = 1
        self.peak_used = max(self.peak_used, self.used)
        return taken

    def share(self, blocks: Iterable[int]) -> None:
        """One more table holds each of `blocks`."""
        for block in blocks:
            self._holders[block] += 1
            if self._holders[block] == 2:
                self.shared += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One table fewer holds each of `blocks`; those nobody holds are free again."""
        for block in blocks:
            self._holders[block] -= 1
            if self._holders[block] == 1:
                self.shared -= 1
            elif self._holders[block] == 0:
                heapq.heappush(self._free, block)

    def is_shared(self, block: int) -> bool:
        return self._holders[block] > 1
