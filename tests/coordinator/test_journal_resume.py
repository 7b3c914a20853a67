"""The request journal: a coordinator SIGKILLed mid-stream, a new one, the same request_id retried -> the very
completion the first would have produced, journaled part first. Real processes, a real redis-server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import pytest
import redis

from coordinator.journal import RequestJournal
from coordinator.redis_state import RedisKeys, connect
from coordinator.request_guard import fingerprint
from specdec.client import Client, build_request

MAX_NEW = 100
# Fixed γ: a resumed sampled request must reproduce the uninterrupted one draw for draw. The coupled rule for
# unseeded requests too: the reference, which gives the seed the first coordinator chose, is decoded under it.
JOURNAL_ARGS = [
    "--no-adaptive-gamma",
    "--unseeded-sampling-rule",
    "coupled",
    "--lease-s",
    "2",
    "--lease-wait-s",
    "6",
    "--registry-ttl-s",
    "3",
    "--registry-refresh-s",
    "0.5",
    "--max-new-tokens-limit",
    "240",
]
SAMPLED = dict(max_new_tokens=MAX_NEW, temperature=1.0, top_k=20, num_speculative_tokens=3, include_stats=True)
GREEDY = dict(max_new_tokens=MAX_NEW, num_speculative_tokens=0)  # plain decoding: one token per round


def start_journaled(secure_replicas, redis_server, name):
    return secure_replicas.start_coordinator(name, "--redis-url", redis_server.url, *JOURNAL_ARGS)


def tokens_and_text(replies) -> tuple[list[int], str]:
    return [t for r in replies for t in r.token_ids], "".join(r.text for r in replies)


@pytest.fixture(scope="module")
def after_crash(secure_replicas, redis_server):
    """Runs two requests on coordinator A, SIGKILLs it mid-stream, starts coordinator B and yields
    (B, what the client saw from A before the kill, the unary request's outcome on A)."""
    first = start_journaled(secure_replicas, redis_server, "coordinator-a")
    try:
        with Client(first.address, timeout_s=120) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
            unary = pool.submit(client.generate, [9, 8], request_id="crash-unary", **GREEDY)
            stream = client.stream([5, 6, 7], request_id="crash-stream", **SAMPLED)
            seen = [next(stream)]
            while not seen[-1].token_ids:
                seen.append(next(stream))
            first.process.kill()  # SIGKILL: no drain, no cleanup, the lease simply stops being refreshed
            first.process.wait()
            with pytest.raises(grpc.RpcError):
                for reply in stream:
                    seen.append(reply)
            unary_outcome = unary.exception() or unary.result()
    finally:
        first.stop()
    second = start_journaled(secure_replicas, redis_server, "coordinator-b")
    yield second, seen, unary_outcome
    second.stop()


def test_a_killed_stream_resumes_to_the_uninterrupted_completion(after_crash):
    second, seen_before_kill, _ = after_crash
    with Client(second.address, timeout_s=120) as client:
        retried = list(client.stream([5, 6, 7], request_id="crash-stream", **SAMPLED))
        seed = retried[-1].stats.seed  # the seed coordinator A chose, taken from the journal
        reference = list(client.stream([5, 6, 7], seed=seed, **SAMPLED))
    tokens, text = tokens_and_text(retried)
    assert (tokens, text) == tokens_and_text(reference) and len(tokens) == MAX_NEW  # nothing lost or repeated
    seen_tokens, _ = tokens_and_text(seen_before_kill)
    journaled = list(retried[0].token_ids)
    assert tokens[: len(seen_tokens)] == seen_tokens and 0 < len(seen_tokens) <= len(journaled) < MAX_NEW
    assert all(r.request_id == "crash-stream" for r in retried)
    assert retried[-1].stats.prompt_tokens == 3
    assert "crash-stream: resuming after" in second.log_path.read_text()


def test_a_killed_unary_request_resumes_or_returns_the_stored_result(after_crash):
    second, _, unary_outcome = after_crash
    with Client(second.address, timeout_s=120) as client:
        retried = client.generate([9, 8], request_id="crash-unary", **GREEDY)
        reference = client.generate([9, 8], **GREEDY)
        again = client.generate([9, 8], request_id="crash-unary", **GREEDY)  # finished: fetched, not rerun
    assert list(retried.token_ids) == list(reference.token_ids) and retried.text == reference.text
    assert len(retried.token_ids) == MAX_NEW and retried.request_id == "crash-unary"
    assert (list(again.token_ids), again.text) == (list(retried.token_ids), retried.text)
    if not isinstance(unary_outcome, grpc.RpcError):  # it had finished on A before the kill
        assert list(unary_outcome.token_ids) == list(reference.token_ids)
    runs = second.log_path.read_text().count("request crash-unary~")
    assert runs <= 1


def test_the_dead_coordinators_sessions_are_closed(after_crash, secure_replicas):
    deadline = time.monotonic() + 30
    while secure_replicas.active_sessions() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert secure_replicas.active_sessions() == (0, 0)
    second, _, _ = after_crash
    assert "is gone: closing its" in second.log_path.read_text()


def test_a_finished_result_is_fetched_again_not_rerun(after_crash):
    second, _, _ = after_crash
    with Client(second.address, timeout_s=60) as client:
        first = client.generate([4, 4], max_new_tokens=20, temperature=0.9, request_id="fetch-me", include_stats=True)
        again = client.generate([4, 4], max_new_tokens=20, temperature=0.9, request_id="fetch-me", include_stats=True)
        streamed = list(client.stream([4, 4], max_new_tokens=20, temperature=0.9, request_id="fetch-me"))
        with pytest.raises(grpc.RpcError) as raised:
            client.generate([4, 5], max_new_tokens=20, request_id="fetch-me")
    assert again == first and tokens_and_text(streamed) == (list(first.token_ids), first.text)
    assert streamed[-1].finish_reason == first.finish_reason and not streamed[-1].HasField("stats")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in raised.value.details()
    assert second.log_path.read_text().count("request fetch-me~") == 1


def test_one_request_id_never_runs_twice_at_once(after_crash):
    second, _, _ = after_crash
    with Client(second.address, timeout_s=120) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(client.generate, [3, 1, 4], request_id="twice", **GREEDY) for _ in range(2)]
        outcomes = [r.exception() or r.result() for r in runs]
    finished = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
    refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    assert finished and all(list(o.token_ids) == list(finished[0].token_ids) for o in finished)
    assert all(e.code() == grpc.StatusCode.ABORTED for e in refused)  # waited past lease_wait_s
    assert second.log_path.read_text().count("request twice~") == 1


def test_a_dead_holders_lease_is_waited_for_and_a_live_one_is_not_taken(redis_server):
    async def scenario():
        client = connect(redis_server.url, 1.0)
        journal = RequestJournal(client, RedisKeys("lease-test:"), lease_s=1.0, journal_ttl_s=60, result_ttl_s=60)
        args = ("scope", "req", "fingerprint", 7)
        assert (await journal.begin(*args, "holder-a", 3)).state == "new"
        assert await journal.append("scope", "req", "holder-a", [11, 12], "w11 w12")
        started = time.monotonic()  # holder-a now dies: its lease runs out within 1s
        taken = await journal.begin_waiting(*args, "holder-b", 3, wait_s=5.0)
        waited = time.monotonic() - started
        assert taken.state == "resume" and taken.token_ids == [11, 12] and taken.seed == 7 and 0.3 < waited < 3
        assert not await journal.append("scope", "req", "holder-a", [13], " w13")  # fenced off
        assert (await journal.begin(*args, "holder-c", 3)).state == "busy"
        refresher = asyncio.ensure_future(beat(journal))  # holder-b stays alive
        busy = await journal.begin_waiting(*args, "holder-c", 3, wait_s=2.0)
        refresher.cancel()
        assert busy.state == "busy"
        assert (await journal.begin("scope", "req", "other fingerprint", 7, "holder-c", 3)).state == "conflict"
        await client.aclose()

    async def beat(journal):
        while True:
            await journal.append("scope", "req", "holder-b")
            await asyncio.sleep(0.2)

    asyncio.run(scenario())


def test_a_retry_of_an_attempt_that_journaled_no_tokens_uses_the_journaled_seed(after_crash, redis_server):
    """An attempt died before its first round was journaled: Redis holds its seed and no tokens. The retry (no
    seed of the client's own) must draw with that seed, as every later retry will."""
    second, _, _ = after_crash
    kwargs = dict(max_new_tokens=24, temperature=1.0, top_k=20, num_speculative_tokens=3, include_stats=True)
    request = build_request([6, 1, 6], request_id="no-tokens-yet", **kwargs)
    journaled_seed = 424242

    async def dead_attempt() -> None:  # began (lease and seed stored), then died before any round
        client = connect(redis_server.url, 1.0)
        journal = RequestJournal(client, RedisKeys(), lease_s=2.0, journal_ttl_s=60, result_ttl_s=60)
        entry = await journal.begin("-", "no-tokens-yet", fingerprint(request), journaled_seed, "dead-holder", 3)
        assert entry.state == "new"
        await journal.release("-", "no-tokens-yet", "dead-holder")
        await client.aclose()

    asyncio.run(dead_attempt())
    with Client(second.address, timeout_s=60) as client:
        retried = client.generate([6, 1, 6], request_id="no-tokens-yet", **kwargs)
        reference = client.generate([6, 1, 6], seed=journaled_seed, **kwargs)
    assert retried.stats.seed == journaled_seed
    assert list(retried.token_ids) == list(reference.token_ids)


def test_with_redis_down_requests_still_run_unjournaled(after_crash, redis_server):
    second, _, _ = after_crash
    redis_server.kill()
    try:
        with Client(second.address, timeout_s=60) as client:
            reference = client.generate([2, 7], max_new_tokens=16)
            assert client.generate([2, 7], max_new_tokens=16, request_id="while-down").token_ids == reference.token_ids
            assert client.info().max_new_tokens_limit == 240
    finally:
        redis_server.start()
    assert "running it without one" in second.log_path.read_text()
    with Client(second.address, timeout_s=60) as client:
        assert client.generate([2, 7], max_new_tokens=16, request_id="after").token_ids == reference.token_ids
    keys = redis.Redis.from_url(redis_server.url).keys("specdec:journal:*")
    assert b"specdec:journal:-:after" in keys  # journaled again once Redis is back
