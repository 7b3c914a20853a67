"""--cpus and --model-cpus: which cores a service and its model thread are pinned to."""

from __future__ import annotations

import asyncio
import os

import pytest

from draft_service.settings import DraftSettings
from specdec.engine.cpu_affinity import parse_cpus, pin_cpus
from specdec.engine.step_batcher import StepBatcher
from verify_service.settings import VerifySettings


def test_core_lists_and_ranges_are_parsed():
    assert parse_cpus("0") == {0}
    assert parse_cpus("0,2-3") == {0, 2, 3}
    assert parse_cpus(" 1 , 1-2 ") == {1, 2}


@pytest.mark.parametrize("spec", ["a", "1-", "-1", "3-1", ","])
def test_malformed_lists_name_the_setting(spec):
    with pytest.raises(ValueError, match="cpus"):
        parse_cpus(spec)


def test_pinning_restricts_this_process_and_empty_leaves_it_alone():
    before = os.sched_getaffinity(0)
    try:
        pin_cpus("")
        assert os.sched_getaffinity(0) == before
        core = min(before)
        pin_cpus(str(core))
        assert os.sched_getaffinity(0) == {core}
    finally:
        os.sched_setaffinity(0, before)


def test_the_model_thread_runs_on_its_own_cores_and_the_process_keeps_the_rest():
    process_cores = os.sched_getaffinity(0)
    model_core = max(process_cores)
    batcher = StepBatcher(
        {"step": lambda calls: [os.sched_getaffinity(0) for _ in calls]}, 4, "test", thread_cpus=frozenset({model_core})
    )
    try:

        async def one_step():
            return await asyncio.wait_for(batcher.submit("step", "a"), 10)

        seen = asyncio.run(one_step())
    finally:
        batcher.close()
    assert seen == {model_core}
    assert os.sched_getaffinity(0) == process_cores


def test_model_cpus_are_checked_at_start_naming_the_setting():
    assert VerifySettings(model_cpus="0,1").model_thread_cpus() == {0, 1}
    assert VerifySettings().model_thread_cpus() == frozenset()
    with pytest.raises(ValueError, match="model_cpus"):
        DraftSettings(model_cpus="1-").model_thread_cpus()
