"""The load generator: one timed streaming request, and the closed-loop and open-loop (Poisson) drivers.

Timing is on the client's monotonic clock around `Coordinator.GenerateStream`, or around a streamed
`POST /v1/completions` of the OpenAI-compatible HTTP API (the same request, as server-sent events): time to first
token (TTFT) is the first chunk carrying tokens; inter-token latency (ITL) is the gap between consecutive chunks.
Either API sends one chunk per committed round, so in speculative mode one chunk carries several tokens
and its ITL is a round's latency; time per output token (TPOT = (e2e - TTFT) / (tokens - 1)) is the
per-token figure that compares across modes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import grpc

from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

OK = "OK"


@dataclass
class RequestResult:
    """What one request measured. Times in seconds; start_s is relative to the start of its level."""

    index: int
    status: str  # gRPC status code name; "OK" for success
    start_s: float
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive chunks
    output_tokens: int = 0
    chunks: int = 0
    finish_reason: str = ""
    error: str = ""
    prompt_tokens: int | None = None
    rounds: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    server_total_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for fewer than two tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _finish_name(value: int) -> str:
    return coordinator_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_")


async def timed_request(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    request: coordinator_pb2.GenerateRequest,
    index: int,
    level_start: float,
    timeout_s: float,
) -> RequestResult:
    """Sends one GenerateStream call and times every chunk; a failed call becomes its status code name."""
    started = time.perf_counter()
    result = RequestResult(index=index, status=OK, start_s=started - level_start, e2e_s=0.0)
    last_chunk_at = None
    try:
        async for reply in stub.GenerateStream(request, timeout=timeout_s):
            now = time.perf_counter()
            if reply.token_ids:
                if last_chunk_at is None:
                    result.ttft_s = now - started
                else:
                    result.itl_s.append(now - last_chunk_at)
                last_chunk_at = now
                result.output_tokens += len(reply.token_ids)
                result.chunks += 1
            if reply.finish_reason:
                result.finish_reason = _finish_name(reply.finish_reason)
            if reply.HasField("stats"):
                stats = reply.stats
                result.prompt_tokens = stats.prompt_tokens
                result.rounds = stats.rounds
                result.drafted_tokens = stats.drafted_tokens
                result.accepted_tokens = stats.accepted_tokens
                result.acceptance_rate = stats.acceptance_rate
                result.mean_accepted_length = stats.mean_accepted_length
                result.server_total_s = stats.total_ns / 1e9
    except grpc.aio.AioRpcError as error:
        result.status = error.code().name
        result.error = (error.details() or "")[:300]
    result.e2e_s = time.perf_counter() - started
    return result


def completions_body(request: coordinator_pb2.GenerateRequest, model: str) -> tuple[str, dict]:
    """The streamed completion that asks the HTTP API what `request` asks the gRPC API: (its path, its body), a chat
    completion for a request of messages, a text completion otherwise."""
    sampling = request.sampling
    body = {
        "model": model,
        "max_tokens": request.max_new_tokens,
        "temperature": sampling.temperature,
        "stop": list(request.stop),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for name in ("top_p", "seed"):
        if sampling.HasField(name):
            body[name] = getattr(sampling, name)
    if sampling.top_k:
        body["top_k"] = sampling.top_k
    if request.HasField("num_speculative_tokens"):
        body["num_speculative_tokens"] = request.num_speculative_tokens
    if request.messages:
        body["messages"] = [{"role": message.role, "content": message.content} for message in request.messages]
        return "/v1/chat/completions", body
    body["prompt"] = request.text
    return "/v1/completions", body


async def timed_http_request(
    session: aiohttp.ClientSession, url: str, body: dict, index: int, level_start: float, timeout_s: float
) -> RequestResult:
    """Sends one streamed completion to the HTTP API and times every chunk (one per committed round); the status
    of a failed request is its HTTP status (`HTTP_429`), its usage chunk gives the token counts and speculation."""
    started = time.perf_counter()
    result = RequestResult(index=index, status=OK, start_s=started - level_start, e2e_s=0.0)
    last_chunk_at = None
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                result.status, result.error = f"HTTP_{response.status}", (await response.text())[:300]
            async for line in response.content if response.status == 200 else ():
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("error"):
                    result.status, result.error = f"HTTP_{chunk['error']['code']}", chunk["error"]["message"][:300]
                for choice in chunk.get("choices", ()):
                    if last_chunk_at is None:
                        result.ttft_s = now - started
                    else:
                        result.itl_s.append(now - last_chunk_at)
                    last_chunk_at = now
                    result.chunks += 1
                    result.finish_reason = (choice["finish_reason"] or "").upper() or result.finish_reason
                if chunk.get("usage"):
                    _take_usage(result, chunk["usage"])
    except (aiohttp.ClientError, TimeoutError) as error:
        result.status, result.error = type(error).__name__, str(error)[:300]
    result.e2e_s = time.perf_counter() - started
    return result


def _take_usage(result: RequestResult, usage: dict) -> None:
    speculation = usage["speculation"]
    result.output_tokens = usage["completion_tokens"]
    result.prompt_tokens = usage["prompt_tokens"]
    result.rounds = speculation["verify_passes"]
    result.drafted_tokens = speculation["drafted_tokens"]
    result.accepted_tokens = speculation["accepted_tokens"]
    result.acceptance_rate = speculation["acceptance_rate"]
    result.mean_accepted_length = speculation["tokens_per_verify_pass"]


Send = Callable[[int, float], Awaitable[RequestResult]]  # (request index, level start) -> result


@dataclass
class LoopOutcome:
    """The results of one level in completion order, its wall time and what ended it."""

    results: list[RequestResult]
    wall_s: float
    stopped_by: str  # "requests": the request budget was spent; "duration": the time budget ran out


async def run_closed_loop(send: Send, concurrency: int, max_requests: int, duration_s: float) -> LoopOutcome:
    """`concurrency` workers, each sending its next request as soon as its last one finishes. No request
    starts after `duration_s`; those in flight then run to completion (or to their own timeout)."""
    if concurrency < 1 or max_requests < 1:
        raise ValueError("concurrency and max_requests must be at least 1")
    started = time.perf_counter()
    indices = itertools.count()
    results: list[RequestResult] = []
    stopped_by = "requests"

    async def worker() -> None:
        nonlocal stopped_by
        while True:
            if time.perf_counter() - started >= duration_s:
                stopped_by = "duration"
                return
            index = next(indices)
            if index >= max_requests:
                return
            results.append(await send(index, started))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoopOutcome(
        results, time.perf_counter() - started, stopped_by if len(results) < max_requests else "requests"
    )


def poisson_offsets(rate_rps: float, max_requests: int, duration_s: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of a Poisson process: the first at 0, then exponential gaps,
    cut at max_requests arrivals or at duration_s."""
    if rate_rps <= 0 or max_requests < 1:
        raise ValueError("rate_rps must be positive and max_requests at least 1")
    rng = random.Random(seed)
    offsets, at = [], 0.0
    while len(offsets) < max_requests and at < duration_s:
        offsets.append(at)
        at += rng.expovariate(rate_rps)
    return offsets


async def run_open_loop(
    send: Send, rate_rps: float, max_requests: int, duration_s: float, seed: int = 0
) -> LoopOutcome:
    """Requests arrive as a Poisson process at `rate_rps` whatever the server's pace (an open system):
    a slow server builds a queue instead of slowing the arrivals."""
    offsets = poisson_offsets(rate_rps, max_requests, duration_s, seed)
    started = time.perf_counter()
    results: list[RequestResult] = []

    async def send_and_keep(index: int) -> None:
        results.append(await send(index, started))

    tasks = []
    for index, offset in enumerate(offsets):
        delay = started + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send_and_keep(index)))
    await asyncio.gather(*tasks)
    return LoopOutcome(
        results, time.perf_counter() - started, "requests" if len(offsets) == max_requests else "duration"
    )
