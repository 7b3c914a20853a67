"""The queue for KV blocks: arrival order, resuming sessions first, the wait ending near the call's deadline, and a
bounded queue past which a session is refused at once."""

from __future__ import annotations

import asyncio

import pytest

from specdec.common.errors import KVCacheFullError
from specdec.engine.kv.admission import DEADLINE_MARGIN_S, KVAdmission
from specdec.engine.kv.pool import KVPool

BLOCKS = 8


def full_pool() -> tuple[KVPool, list[int]]:
    """A pool of BLOCKS blocks, every one of them taken (returned)."""
    pool = KVPool(num_layers=1, num_blocks=BLOCKS, block_size=4)
    return pool, pool.allocate(BLOCKS)


async def enter(admission: KVAdmission, blocks: int, order: list[str], name: str, **kwargs) -> None:
    """Waits for admission, records the order of admissions, holds the blocks promised briefly."""
    async with admission.admitted(blocks, None, **kwargs):
        order.append(name)
        await asyncio.sleep(0.01)


def test_sessions_are_admitted_in_arrival_order_with_resuming_ones_first():
    pool, taken = full_pool()
    waits: list[tuple[float, bool]] = []
    admission = KVAdmission(pool, queue_limit=8, on_wait=lambda seconds, resuming: waits.append((seconds, resuming)))

    async def scenario() -> list[str]:
        order: list[str] = []
        tasks = []
        for name, resuming in (("new-1", False), ("new-2", False), ("resume-1", True), ("resume-2", True)):
            tasks.append(asyncio.ensure_future(enter(admission, 2, order, name, resuming=resuming)))
            await asyncio.sleep(0.01)
        assert (admission.queued(resuming=False), admission.queued(resuming=True)) == (2, 2)
        assert order == []
        pool.blocks.release(taken[:2])  # room for one session at a time
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["resume-1", "resume-2", "new-1", "new-2"]
    assert [resuming for _, resuming in waits] == [True, True, False, False]
    assert all(seconds > 0 for seconds, _ in waits)


def test_promised_blocks_count_as_taken_until_the_admitted_call_ends():
    pool = KVPool(num_layers=1, num_blocks=4, block_size=4)
    admission = KVAdmission(pool, queue_limit=4)

    async def scenario() -> None:
        async with admission.admitted(3, None):
            with pytest.raises(KVCacheFullError, match="2 blocks, 1 of 4 free"):
                async with admission.admitted(2, None, max_wait_s=0.05):
                    pass
        async with admission.admitted(2, None):
            pass

    asyncio.run(scenario())


def test_a_wait_ends_before_the_calls_deadline_saying_what_it_asked_and_what_is_free():
    pool, _ = full_pool()
    admission = KVAdmission(pool, queue_limit=8)

    async def scenario() -> None:
        deadline = asyncio.get_running_loop().time() + DEADLINE_MARGIN_S + 0.1  # the blocks never come
        with pytest.raises(KVCacheFullError, match=f"asks for 3 blocks, 0 of {BLOCKS} free after waiting"):
            async with admission.admitted(3, deadline):
                pass

    asyncio.run(scenario())
    assert admission.queued(resuming=False) == 0


def test_past_the_queue_limit_a_new_session_is_refused_at_once_and_a_resuming_one_still_queues():
    pool, taken = full_pool()
    admission = KVAdmission(pool, queue_limit=1)

    async def scenario() -> list[str]:
        order: list[str] = []
        first = asyncio.ensure_future(enter(admission, 1, order, "first"))
        await asyncio.sleep(0.01)
        with pytest.raises(KVCacheFullError, match="1 new sessions already wait"):
            async with admission.admitted(1, None):
                pass
        resuming = asyncio.ensure_future(enter(admission, 1, order, "resuming", resuming=True))
        await asyncio.sleep(0.01)
        pool.blocks.release(taken)
        await asyncio.gather(first, resuming)
        return order

    assert asyncio.run(scenario()) == ["resuming", "first"]


def test_more_blocks_than_the_pool_holds_are_refused_at_once():
    admission = KVAdmission(KVPool(num_layers=1, num_blocks=4, block_size=4), queue_limit=4)

    async def scenario() -> None:
        with pytest.raises(KVCacheFullError, match="5 blocks, more than all 4"):
            async with admission.admitted(5, None):
                pass

    asyncio.run(scenario())
