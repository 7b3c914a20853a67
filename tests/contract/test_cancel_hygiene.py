"""Cancelled and timed-out requests leave nothing behind on the replicas.

Held to: after 200 streams cancelled at random points (at once while the sessions open, within 100 ms, or after
a few chunks) and 100 unary requests with deadlines of 5 to 600 ms, 8 in flight at a time (the replicas'
max_sessions: with more in flight most calls are refused before they hold a session, and nothing is cancelled
mid-generation), both replicas' Info shows 0 active sessions and 0 KV cache tokens within 5 s, and then a
burst of as many concurrent requests as a replica's max_sessions (8 here) all succeed. During the storm a
call ends OK, CANCELLED, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED, nothing else.
"""

from __future__ import annotations

import concurrent.futures
import random
import time

import grpc
import pytest
from harness import Coordinator, in_parallel, replica_info, replica_load, request

from specdec.v1 import common_pb2

MAX_SESSIONS = 8
STREAMS = 200
DEADLINES = 100
CONCURRENCY = MAX_SESSIONS  # every call can hold sessions: cancels land mid-generation, not on refusals
DRAIN_S = 5.0
EXPECTED_CODES = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def small_stack(processes):
    """A draft and a verify replica that hold at most 8 sessions each, and a coordinator in front."""
    limit = ("--max-sessions", str(MAX_SESSIONS))
    draft, verify = in_parallel(
        lambda: processes.serve("draft", *limit, name="draft-small"),
        lambda: processes.serve("verify", *limit, name="verify-small"),
    )
    process = processes.serve(
        "coordinator", "--draft-replicas", draft.address, "--verify-replicas", verify.address, name="coordinator-small"
    )
    coordinator = Coordinator(process.address, process)
    yield draft, verify, coordinator
    coordinator.close()
    for each in (process, draft, verify):
        each.kill()


def random_request(rng: random.Random):
    return request(
        [rng.randrange(1, 8192) for _ in range(rng.randint(2, 48))],
        rng.randint(24, 96),
        temperature=rng.choice([0.0, 0.8, 1.0]),
        seed=rng.randrange(2**32),
        num_speculative_tokens=rng.choice([0, 1, 4, 8, 16]),
        draft_method=rng.choice([common_pb2.DRAFT_METHOD_MODEL, common_pb2.DRAFT_METHOD_NGRAM]),
    )


def cancelled_stream(coordinator: Coordinator, index: int) -> tuple:
    """Opens a stream and cancels it before its first chunk or after a few; returns what happened."""
    rng = random.Random(index)
    call = coordinator.stream(random_request(rng), timeout_s=60)
    chunks = rng.randint(-1, 6)  # -1: at once, while the sessions open; 0: within 100 ms
    try:
        if chunks == 0:
            time.sleep(rng.uniform(0.0, 0.1))
        for _ in range(chunks):
            next(call)
        call.cancel()
        return ("cancelled", chunks)
    except StopIteration:
        return ("finished",)
    except grpc.RpcError as error:
        return ("error", error.code())


def short_deadline(coordinator: Coordinator, index: int) -> tuple:
    rng = random.Random(10_000 + index)
    try:
        coordinator.generate(random_request(rng), timeout_s=rng.uniform(0.005, 0.6))
        return ("finished",)
    except grpc.RpcError as error:
        return ("error", error.code())


@pytest.fixture(scope="module")
def storm(small_stack) -> list[tuple]:
    """Runs the storm; returns each call's outcome: ("cancelled", after how many chunks), ("finished",) or
    ("error", its status code)."""
    _, _, coordinator = small_stack
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(cancelled_stream, coordinator, i) for i in range(STREAMS)]
        futures += [pool.submit(short_deadline, coordinator, i) for i in range(DEADLINES)]
        done, pending = concurrent.futures.wait(futures, timeout=300)
    assert not pending
    return [f.result() for f in futures]


def test_replicas_hold_nothing_within_5_s(small_stack, storm):
    draft, verify, _ = small_stack
    deadline = time.monotonic() + DRAIN_S
    while True:
        loads = {"draft": replica_load(draft.address), "verify": replica_load(verify.address)}
        if all(load == (0, 0) for load in loads.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert loads == {"draft": (0, 0), "verify": (0, 0)}, f"(active_sessions, kv_cache_tokens) {DRAIN_S:.0f} s on"


def test_a_burst_of_max_sessions_requests_then_succeeds(small_stack, storm):
    draft, verify, coordinator = small_stack
    capacity = min(replica_info(draft.address).max_sessions, replica_info(verify.address).max_sessions)
    assert capacity == MAX_SESSIONS
    with concurrent.futures.ThreadPoolExecutor(capacity) as pool:
        futures = [
            pool.submit(coordinator.generate, request([5, 6, 7, i], 16, num_speculative_tokens=4), 60)
            for i in range(capacity)
        ]
        concurrent.futures.wait(futures, timeout=120)
    failures = [f.exception() for f in futures if f.exception() is not None]
    assert not failures, f"{len(failures)} of {capacity} failed, e.g. {failures[0]}"
    assert all(len(f.result().token_ids) == 16 for f in futures)


def test_the_storm_ended_only_in_expected_ways(storm):
    unexpected = [o[1] for o in storm if o[0] == "error" and o[1] not in EXPECTED_CODES]
    assert not unexpected, f"unexpected status codes: {sorted(set(map(str, unexpected)))}"
    cancelled_midway = sum(1 for o in storm if o[0] == "cancelled" and o[1] > 0)
    assert cancelled_midway >= STREAMS // 4, f"only {cancelled_midway} streams were cancelled after a chunk"
