"""--cpus: which cores a service is pinned to."""

from __future__ import annotations

import os

import pytest

from specdec.cpu_affinity import parse_cpus, pin_cpus


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
