"""Requests survive memory pressure, a dead verify replica, a rolling restart and random kills, in short forms.

Held to (greedy requests, every output equal to the target alone run with transformers):
- 8 concurrent requests against a verify replica whose KV budget is a quarter of their working set all finish (none
  is refused: they queue, and sessions that cannot grow preempt newer ones, which its /metrics count);
- 8 concurrent streams on two verify replicas, one SIGKILLed while they stream, all finish;
- a rolling restart under load (SIGTERM one verify replica, wait until it is back at its address, then the other)
  fails no request, and the drained replica exits before its grace period ends;
- requests with a request_id, retried on the other coordinator while a coordinator, the drafter and a verify replica
  are SIGKILLed and restarted in turn, all complete (resumed from the Redis journal).
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

import grpc
import pytest
from harness import (
    JOURNAL_ARGS,
    TARGET_DIR,
    Coordinator,
    Process,
    ProcessGroup,
    free_port,
    joined,
    request,
)
from reference import greedy

from specdec.v1 import coordinator_pb2_grpc

BLOCK_BYTES = 2 * 24 * 4 * 16 * 64 * 4  # one KV block of the demo target: 2 · layers · KV heads · 16 positions · 64 · 4
PRESSURED_BLOCKS = 8  # 8 requests of 12 + 48 tokens hold 4 blocks each at full length: a quarter of 32
CONCURRENCY = 8
NEW_TOKENS = 48
PROMPTS = [[11 + i, 40 + 3 * i, 7, 300 + 5 * i, 12, 99, 5 + i, 61, 250, 17 + 2 * i, 8, 33] for i in range(16)]
GRACE_S = 30
PLACEMENT_S = 4  # a replica serving again joins the coordinators' placement within their probe (1 s) + reconnect (2 s)


@dataclass
class Restartable:
    """A service process at a fixed loopback port, so that a restart comes back where its callers look."""

    group: ProcessGroup
    kind: str
    name: str
    args: tuple[str, ...]
    port: int = field(default_factory=free_port)
    process: Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Restartable:
        self.process = self.group.serve(
            self.kind, "--address", self.address, *self.args, name=f"{self.name}#{time.monotonic_ns()}"
        )
        return self

    def restart(self) -> None:
        self.process.kill()
        self.start()


class ReconnectingCoordinator(Coordinator):
    """A client whose channel reconnects within a second once its coordinator is back (gRPC's default backoff grows
    to two minutes)."""

    def __init__(self, address: str):
        self.address, self.process = address, None
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_reconnect_backoff_ms", 1000)])
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)


@dataclass
class Fleet:
    drafter: Restartable
    pressured: Restartable  # verify replica A, a quarter of the working set in its KV budget
    other: Restartable  # verify replica B
    coordinators: list[Restartable]  # over A and B, journaling into Redis
    clients: list[Coordinator]  # one channel to each of them (it reconnects after a restart)
    only_pressured: Coordinator  # over A alone
    metrics_port: int

    def coordinator(self, index: int) -> Coordinator:
        return self.clients[index % len(self.clients)]


@pytest.fixture(scope="module")
def fleet(shared_stack):
    group, redis = shared_stack.group, shared_stack.redis
    metrics_port = free_port()
    drafter = Restartable(group, "draft", "draft-survival", ())
    pressured = Restartable(
        group,
        "verify",
        "verify-pressured",
        ("--kv-cache-budget", str(PRESSURED_BLOCKS * BLOCK_BYTES), "--metrics-port", str(metrics_port)),
    )
    pressured.args += ("--grace-s", str(GRACE_S))
    other = Restartable(group, "verify", "verify-other", ("--grace-s", str(GRACE_S)))
    for started in concurrent.futures.ThreadPoolExecutor(3).map(Restartable.start, (drafter, pressured, other)):
        assert started.process.alive
    both = ["--tokenizer", str(TARGET_DIR), "--draft-replicas", drafter.address]
    both += ["--verify-replicas", f"{pressured.address},{other.address}", "--redis-url", redis.url, *JOURNAL_ARGS]
    coordinators = [Restartable(group, "coordinator", f"coordinator-survival-{i}", tuple(both)) for i in range(2)]
    for coordinator in coordinators:
        coordinator.start()
    alone = ["--tokenizer", str(TARGET_DIR), "--draft-replicas", drafter.address]
    process = group.serve("coordinator", *alone, "--verify-replicas", pressured.address, name="coordinator-pressured")
    clients = [ReconnectingCoordinator(coordinator.address) for coordinator in coordinators]
    only_pressured = Coordinator(process.address, process)
    yield Fleet(drafter, pressured, other, coordinators, clients, only_pressured, metrics_port)
    for client in (*clients, only_pressured):
        client.close()
    for each in (*coordinators, drafter, pressured, other):
        each.process.kill()
    process.kill()


@pytest.fixture(scope="module")
def expected(target) -> list[list[int]]:
    model, _ = target
    return [greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def generate_all(coordinator: Coordinator, indexes: range) -> list[list[int] | grpc.RpcError]:
    def run(index: int):
        try:
            return list(coordinator.generate(request(PROMPTS[index], NEW_TOKENS), timeout_s=180).token_ids)
        except grpc.RpcError as error:
            return error

    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(run, indexes))


def test_a_verify_replica_a_quarter_the_size_of_the_working_set_queues_and_preempts_and_refuses_none(fleet, expected):
    outcomes = generate_all(fleet.only_pressured, range(CONCURRENCY))
    assert outcomes == expected[:CONCURRENCY]
    assert metric(fleet.metrics_port, "specdec_preemptions_total") > 0
    assert metric(fleet.metrics_port, "specdec_queue_wait_seconds_count") >= CONCURRENCY


def test_a_sigkilled_verify_replica_costs_no_stream(fleet, expected):
    coordinator = fleet.coordinator(0)
    streams = [coordinator.stream(request(PROMPTS[i], NEW_TOKENS), timeout_s=180) for i in range(CONCURRENCY)]
    firsts = [next(stream) for stream in streams]  # every stream has sessions on A or B now
    fleet.other.process.kill()
    outcomes = [joined([first, *stream])[0] for first, stream in zip(firsts, streams)]
    assert outcomes == expected[:CONCURRENCY]
    fleet.other.start()
    time.sleep(PLACEMENT_S)


def under_load(fleet: Fleet, disturb, request_ids: bool = False) -> dict[int, list[int] | Exception]:
    """Runs CONCURRENCY workers sending requests in a loop (alternating coordinators) while `disturb()` runs; per
    request its tokens, or the error that failed it. With request_ids every request has one and a failed attempt is
    retried (on the other coordinator) until it succeeds, up to 40 attempts."""
    outcomes: dict[int, list[int] | Exception] = {}
    stop = threading.Event()

    def send(index: int) -> list[int] | Exception:
        message = request(PROMPTS[index % 16], NEW_TOKENS)
        if request_ids:
            message.request_id = f"survival-{uuid.uuid4().hex}"
        for attempt in range(40 if request_ids else 1):
            try:
                return list(fleet.coordinator(index + attempt).generate(message, timeout_s=180).token_ids)
            except grpc.RpcError as error:
                failure = error
                time.sleep(0.5)
        return failure

    def load(worker: int) -> None:
        index = worker
        while not stop.is_set():
            outcomes[index] = send(index)
            index += CONCURRENCY

    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        workers = [pool.submit(load, worker) for worker in range(CONCURRENCY)]
        time.sleep(2)
        try:
            disturb()
            time.sleep(2)
        finally:
            stop.set()
            concurrent.futures.wait(workers)
    return outcomes


def test_a_rolling_restart_of_both_verify_replicas_fails_no_request(fleet, expected):
    def rolling_restart() -> None:
        for replica in (fleet.pressured, fleet.other):
            replica.process.stop(timeout_s=GRACE_S + 30)  # SIGTERM: it drains, then exits by itself
            assert replica.process.popen.returncode == 0, replica.process.log_tail()
            replica.start()
            time.sleep(PLACEMENT_S)  # the coordinators' health probe puts it back into placement

    outcomes = under_load(fleet, rolling_restart)
    assert outcomes == {index: expected[index % 16] for index in outcomes}


def test_random_kills_with_journal_retries_complete_every_request_identically(fleet, expected):
    def kill_in_turn() -> None:
        for victim in (fleet.coordinators[0], fleet.drafter, fleet.other, fleet.coordinators[1]):
            victim.restart()
            time.sleep(3)

    outcomes = under_load(fleet, kill_in_turn, request_ids=True)
    assert outcomes == {index: expected[index % 16] for index in outcomes}
