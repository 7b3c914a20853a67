"""The survival benchmark's clients: closed-loop requests through one or more coordinators, each attempt recorded.

A request is one of a fixed list of (prompt ids, budget, seed) specs, so every repetition of a spec must give the same
tokens. With retries, a request carries a request_id and a failed attempt is sent again, with the same id, to the next
coordinator, as a client of a journaled deployment would (coordinator/journal.py resumes it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

RETRY_PAUSE_S = 0.5
RECONNECT_OPTIONS = [("grpc.max_reconnect_backoff_ms", 1000)]  # a restarted coordinator is reached within a second


@dataclass(frozen=True)
class RequestSpec:
    """What a request asks for: greedy without a seed, else temperature 1 with it."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int | None = None

    def message(self, request_id: str = "") -> coordinator_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(temperature=0.0 if self.seed is None else 1.0)
        if self.seed is not None:
            sampling.seed = self.seed
        return coordinator_pb2.GenerateRequest(
            token_ids=coordinator_pb2.TokenIds(ids=self.prompt_ids),
            max_new_tokens=self.max_new_tokens,
            sampling=sampling,
            request_id=request_id,
            include_stats=True,
        )


@dataclass(frozen=True)
class Attempt:
    """One call: to which coordinator, when (monotonic seconds), and its status code name ("OK" on success)."""

    coordinator: int
    started: float
    ended: float
    code: str


@dataclass
class Outcome:
    """One request: its spec's index, its tokens once it succeeded, every attempt, and the moves its sessions made."""

    spec: int
    tokens: list[int] | None = None
    attempts: list[Attempt] = field(default_factory=list)
    verify_moves: int = 0
    draft_moves: int = 0

    @property
    def ok(self) -> bool:
        return self.tokens is not None

    @property
    def code(self) -> str:
        return self.attempts[-1].code if self.attempts else "NOT_SENT"


async def send(
    stubs: Sequence[coordinator_pb2_grpc.CoordinatorStub],
    spec: RequestSpec,
    spec_index: int,
    first: int,
    retry_for_s: float = 0.0,
    timeout_s: float = 300.0,
) -> Outcome:
    """Sends a request to coordinator `first`; with retry_for_s > 0 it has a request_id and failed attempts go to
    the next coordinator until one succeeds or retry_for_s has passed."""
    outcome = Outcome(spec_index)
    message = spec.message(f"survival-{uuid.uuid4().hex}" if retry_for_s > 0 else "")
    give_up = time.monotonic() + retry_for_s
    target = first
    while True:
        started = time.monotonic()
        try:
            reply = await stubs[target % len(stubs)].Generate(message, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            outcome.attempts.append(Attempt(target % len(stubs), started, time.monotonic(), error.code().name))
            if time.monotonic() >= give_up:
                return outcome
            target += 1
            await asyncio.sleep(RETRY_PAUSE_S)
            continue
        outcome.attempts.append(Attempt(target % len(stubs), started, time.monotonic(), "OK"))
        outcome.tokens = list(reply.token_ids)
        outcome.verify_moves = reply.stats.verify_session_moves
        outcome.draft_moves = reply.stats.draft_session_moves
        return outcome


async def closed_loop(
    addresses: Sequence[str],
    specs: Sequence[RequestSpec],
    concurrency: int,
    stop: asyncio.Event | None = None,
    count: int | None = None,
    retry_for_s: float = 0.0,
) -> list[Outcome]:
    """`concurrency` workers send requests back to back, request i being spec i % len(specs) on coordinator i; they
    stop after `count` requests in all, or once `stop` is set (finishing the requests in flight)."""
    channels = [grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS) for address in addresses]
    stubs = [coordinator_pb2_grpc.CoordinatorStub(channel) for channel in channels]
    outcomes: list[Outcome] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while (stop is None or not stop.is_set()) and (count is None or next_index < count):
            index, next_index = next_index, next_index + 1
            outcomes.append(await send(stubs, specs[index % len(specs)], index % len(specs), index, retry_for_s))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))
    return outcomes


def tally(outcomes: Sequence[Outcome], reference: Sequence[list[int]]) -> dict:
    """Counts of a run: requests, succeeded, failed (by final code), identical to the reference, moves."""
    failed: dict[str, int] = {}
    for outcome in outcomes:
        if not outcome.ok:
            failed[outcome.code] = failed.get(outcome.code, 0) + 1
    succeeded = [o for o in outcomes if o.ok]
    return {
        "requests": len(outcomes),
        "succeeded": len(succeeded),
        "failed": sum(failed.values()),
        "failed_by_code": failed,
        "identical": sum(o.tokens == reference[o.spec] for o in succeeded),
        "differing": sum(o.tokens != reference[o.spec] for o in succeeded),
        "verify_session_moves": sum(o.verify_moves for o in outcomes),
        "draft_session_moves": sum(o.draft_moves for o in outcomes),
        "tokens": sum(len(o.tokens) for o in succeeded),
    }
