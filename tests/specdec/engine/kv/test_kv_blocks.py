"""The block allocator: lowest ids first, holder counts for shared blocks, refusal that takes nothing."""

from __future__ import annotations

import pytest

from specdec.common.errors import KVCacheFullError
from specdec.engine.kv.blocks import BlockAllocator


def test_blocks_are_taken_lowest_first_and_come_back_when_nobody_holds_them():
    blocks = BlockAllocator(6)
    assert blocks.allocate(3, 16) == [0, 1, 2]
    assert blocks.allocate(1, 16) == [3]
    blocks.release([1])
    assert (blocks.free, blocks.used) == (3, 3)
    assert blocks.allocate(2, 16) == [1, 4], "a released block is reused before higher ones"
    assert blocks.peak_used == 5


def test_a_shared_block_is_free_only_after_its_last_holder_lets_go():
    blocks = BlockAllocator(4)
    held = blocks.allocate(2, 16)
    blocks.share(held)
    blocks.share(held[:1])
    assert blocks.shared == 2 and blocks.is_shared(0) and blocks.is_shared(1)
    blocks.release(held)
    assert blocks.shared == 1 and blocks.is_shared(0) and not blocks.is_shared(1) and blocks.free == 2
    blocks.release(held)
    assert blocks.shared == 0 and blocks.free == 3
    blocks.release(held[:1])
    assert blocks.free == 4


def test_asking_for_more_than_is_free_takes_nothing_and_says_what_was_asked_and_what_is_free():
    blocks = BlockAllocator(4)
    blocks.allocate(3, 16)
    with pytest.raises(KVCacheFullError, match=r"asked for 2 blocks \(32 positions\), 1 of 4 free"):
        blocks.allocate(2, 16)
    assert blocks.free == 1


def test_a_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockAllocator(0)
