"""Preemption: the newest sessions give their blocks first, busy ones never, and a preempted session keeps its tokens
and recomputes them, through the same logits, once it runs again."""

from __future__ import annotations

import pytest
import torch

from specdec.common.errors import KVCacheFullError, SessionPreemptedError
from specdec.engine.kv.preemption import Preemptions
from specdec.engine.kv.session import KVSession
from specdec.engine.model_runtime import LoadedModel, ModelSettings

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


@pytest.fixture(scope="module")
def target(tiny_pair_dirs) -> LoadedModel:
    return LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), kv_block_size=4))


def opened(target: LoadedModel, preemptions: Preemptions, count: int) -> dict[str, KVSession]:
    sessions = {}
    for index in range(count):
        session_id = f"s{index}"
        sessions[session_id] = KVSession(target, PROMPT)
        sessions[session_id].prefill()
        preemptions.arrived(session_id)
    return sessions


def test_make_room_preempts_the_newest_session_that_is_not_busy_and_holds_blocks(target):
    counted: list[None] = []
    preemptions = Preemptions(on_preempt=lambda: counted.append(None))
    sessions = opened(target, preemptions, 4)
    free = target.kv_pool.blocks.free
    assert preemptions.make_room("s0", sessions.get, busy={"s3"})
    assert preemptions.is_preempted("s2") and not preemptions.is_preempted("s3")
    assert sessions["s2"].cached_len == 0 and len(sessions["s2"]) == len(PROMPT)
    assert target.kv_pool.blocks.free == free + 3  # the 10 prompt positions' blocks of 4
    assert preemptions.make_room("s0", sessions.get, busy={"s3"})  # then s1
    assert not preemptions.make_room("s0", sessions.get, busy={"s3"})  # s2 holds nothing now, s3 is busy
    assert not preemptions.make_room("s3", sessions.get)  # nobody is newer than s3
    assert len(counted) == 2


def test_a_preempted_session_runs_again_only_once_readmitted_and_recomputes_the_same_logits(target):
    preemptions = Preemptions()
    sessions = opened(target, preemptions, 2)
    reference = sessions["s0"].extend([7, 8])  # [3, V]
    victim = sessions["s1"]
    error = preemptions.preempt("s1", victim)
    assert isinstance(error, KVCacheFullError) and error.tokens == len(PROMPT)
    with pytest.raises(SessionPreemptedError, match="preempted"):
        preemptions.check_runnable("s1", victim)
    preemptions.readmit("s1")
    preemptions.check_runnable("s1", victim)
    recomputed = victim.extend([7, 8])  # feeds the prompt again, then the two new tokens
    preemptions.ran("s1")
    assert not preemptions.is_preempted("s1")
    torch.testing.assert_close(recomputed, reference, rtol=1e-4, atol=1e-4)
    assert recomputed.argmax(-1).tolist() == reference.argmax(-1).tolist()
    preemptions.left("s1")
    assert preemptions.order("s1") == -1
