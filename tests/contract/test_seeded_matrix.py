"""A seeded sampled request has one answer, whatever the schedule.

Held to: with temperature 0.8, top_p 0.95 and a fixed seed, 24 new tokens are identical to the same request at
γ 0 (plain decoding) for γ 0, 1, 4 and the coordinator's largest γ, with adaptive γ on and off, with the model
and the n-gram drafter, alone and under 16 concurrent background requests; when the drafter is SIGKILLed
mid-stream (the request carries on without it); and when the coordinator is SIGKILLed mid-stream and the same
request_id is retried on a fresh coordinator sharing the Redis journal (the retry resumes, nothing lost or
repeated).
"""

from __future__ import annotations

import concurrent.futures
import random
import threading

import grpc
import pytest
from harness import DRAFT_DIR, in_parallel, joined, request

from specdec.v1 import common_pb2, coordinator_pb2

MODEL, NGRAM = common_pb2.DRAFT_METHOD_MODEL, common_pb2.DRAFT_METHOD_NGRAM
PROMPT = [479, 287, 1532, 269, 594, 521, 8, 78, 306, 4306]  # "def fibonacci(n):\n    " in the demo vocabulary
SEED = 20260531
MAX_NEW = 24
BACKGROUND = 16
COORDINATORS = ("adaptive", "fixed")
GAMMAS = ("0", "1", "4", "max")
METHODS = {"model": MODEL, "ngram": NGRAM}
CASES = [(c, g, m) for c in COORDINATORS for g in GAMMAS for m in METHODS]
IDS = [f"{c}-gamma{g}-{m}" for c, g, m in CASES]


def seeded(num_speculative: int, method: int = MODEL, request_id: str = "") -> coordinator_pb2.GenerateRequest:
    return request(
        PROMPT,
        MAX_NEW,
        temperature=0.8,
        top_p=0.95,
        seed=SEED,
        num_speculative_tokens=num_speculative,
        draft_method=method,
        request_id=request_id,
    )


@pytest.fixture(scope="module")
def max_gamma(shared_stack) -> int:
    return shared_stack.fixed.info().max_num_speculative_tokens


@pytest.fixture(scope="module")
def reference(shared_stack) -> list[int]:
    """The request at γ 0 on the coordinator with adaptive γ off: plain decoding with the target."""
    reply = shared_stack.fixed.generate(seeded(0))
    assert len(reply.token_ids) == MAX_NEW and reply.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
    return list(reply.token_ids)


def run_case(shared_stack, max_gamma, coordinator, gamma, method) -> list[int]:
    num_speculative = max_gamma if gamma == "max" else int(gamma)
    return list(getattr(shared_stack, coordinator).generate(seeded(num_speculative, METHODS[method])).token_ids)


def differs(tokens: list[int], reference: list[int]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return f"differs from γ 0 at token {first}:\n  got {tokens}\n  γ 0 {reference}"


@pytest.mark.parametrize("coordinator,gamma,method", CASES, ids=IDS)
def test_alone(shared_stack, max_gamma, reference, coordinator, gamma, method):
    tokens = run_case(shared_stack, max_gamma, coordinator, gamma, method)
    assert tokens == reference, differs(tokens, reference)


@pytest.fixture(scope="module")
def under_load(shared_stack, max_gamma, reference) -> dict:
    """Every case of the matrix, run (8 at a time) while 16 other requests of mixed settings keep both
    coordinators busy; yields each case's tokens, or the error it raised."""
    stop = threading.Event()
    background_errors: list[BaseException] = []

    def background(worker: int) -> None:
        rng = random.Random(worker)
        coordinator = (shared_stack.adaptive, shared_stack.fixed)[worker % 2]
        while not stop.is_set():
            prompt = [rng.randrange(1, 8192) for _ in range(rng.randint(3, 40))]
            message = request(
                prompt,
                rng.randint(16, 48),
                temperature=rng.choice([0.0, 0.7, 1.0]),
                seed=rng.randrange(2**32),
                num_speculative_tokens=rng.choice([0, 2, 4, 8]),
                draft_method=rng.choice([MODEL, NGRAM]),
            )
            try:
                coordinator.generate(message, timeout_s=60)
            except grpc.RpcError as error:
                background_errors.append(error)

    with concurrent.futures.ThreadPoolExecutor(BACKGROUND) as load:
        workers = [load.submit(background, i) for i in range(BACKGROUND)]
        try:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                futures = {case: pool.submit(run_case, shared_stack, max_gamma, *case) for case in CASES}
                concurrent.futures.wait(futures.values(), timeout=300)
            results = {case: f.exception() or f.result() for case, f in futures.items()}
        finally:
            stop.set()
            concurrent.futures.wait(workers, timeout=120)
    assert not background_errors, f"background requests failed: {background_errors[:3]}"
    return results


@pytest.mark.parametrize("coordinator,gamma,method", CASES, ids=IDS)
def test_under_concurrent_load(under_load, reference, coordinator, gamma, method):
    outcome = under_load[(coordinator, gamma, method)]
    if isinstance(outcome, BaseException):
        raise outcome
    assert outcome == reference, differs(outcome, reference)


def read_until_tokens(stream) -> list:
    """Stream chunks up to and including the first that carries tokens."""
    seen = [next(stream)]
    while not seen[-1].token_ids:
        seen.append(next(stream))
    return seen


@pytest.fixture(scope="module")
def doomed(shared_stack) -> dict:
    """Started side by side: a draft replica with a coordinator (adaptive γ off) of its own, for the drafter kill;
    coordinator "first", to be killed, and coordinator "fresh", to resume, both on the shared Redis."""

    def with_own_draft():
        draft = shared_stack.group.serve("draft", "--model", str(DRAFT_DIR), name="draft-doomed")
        coordinator = shared_stack.start_coordinator(
            "--no-adaptive-gamma", name="coordinator-doomed-draft", draft=draft.address
        )
        return draft, coordinator

    (draft, own_draft), first, fresh = in_parallel(
        with_own_draft,
        lambda: shared_stack.start_coordinator(name="coordinator-doomed"),
        lambda: shared_stack.start_coordinator(name="coordinator-fresh"),
    )
    yield dict(draft=draft, own_draft=own_draft, first=first, fresh=fresh)
    draft.kill()
    for coordinator in (own_draft, first, fresh):
        coordinator.close()
        coordinator.process.kill()


def test_drafter_sigkilled_mid_stream(doomed, reference):
    """The coordinator's only draft replica is SIGKILLed after the first tokens arrive: the rest comes from
    the target alone."""
    coordinator = doomed["own_draft"]
    uninterrupted = list(coordinator.generate(seeded(4)).token_ids)  # for the failure message
    stream = coordinator.stream(seeded(4))
    seen = read_until_tokens(stream)
    before_kill = len(joined(seen)[0])
    doomed["draft"].kill()
    seen += list(stream)
    assert before_kill < MAX_NEW, "the stream had ended before the kill"
    tokens = joined(seen)[0]
    assert tokens == reference, f"{differs(tokens, reference)}\n  the same request without a kill: {uninterrupted}"


def test_coordinator_sigkilled_mid_stream_resumes_from_the_journal(doomed, reference):
    """Coordinator "first" is SIGKILLed after the first tokens; the same request_id retried on coordinator
    "fresh", which shares its Redis, gives the uninterrupted completion, starting with what "first" journaled."""
    first, fresh = doomed["first"], doomed["fresh"]
    request_id = f"contract-resume-{random.randrange(2**32)}"
    uninterrupted = list(first.generate(seeded(4)).token_ids)  # for the failure message
    stream = first.stream(seeded(4, request_id=request_id))
    seen = read_until_tokens(stream)
    first.process.kill()
    with pytest.raises(grpc.RpcError):
        for chunk in stream:
            seen.append(chunk)
    seen_tokens = joined(seen)[0]
    assert 0 < len(seen_tokens) < MAX_NEW, "the stream ended before the kill: nothing to resume"
    retried = fresh.stream_all(seeded(4, request_id=request_id), timeout_s=60)
    tokens = joined(retried)[0]
    assert tokens[: len(seen_tokens)] == seen_tokens, "the retry does not continue what the client saw"
    assert tokens == reference, f"{differs(tokens, reference)}\n  the same request without a kill: {uninterrupted}"
    assert retried[-1].finish_reason == coordinator_pb2.FINISH_REASON_LENGTH


def test_coordinator_info_names_the_largest_gamma(max_gamma):
    assert max_gamma > 4  # the matrix's γ 4 and max are distinct cases only then
