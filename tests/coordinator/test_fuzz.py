"""Fuzzing the client-facing port: >= 10,000 random and malformed requests against a real coordinator (API keys
on, real redis-server, real replicas) -> every reply is a defined status, the process stays up, and a valid
request still succeeds afterwards.

Half come from hypothesis (GenerateRequests with hostile field values, sent through the typed stub with a
valid, missing or garbage key), half are raw bytes on the wire through a generic call: random bytes and
mutated serialized requests (flipped, cut, spliced). max-new-tokens-limit is tiny so valid requests are cheap.
"""

from __future__ import annotations

import collections
import concurrent.futures
import random

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.api_keys import add_key
from coordinator.redis_state import RedisKeys, connect_sync
from specdec.client import build_request
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

HYPOTHESIS_REQUESTS = 4000
RAW_REQUESTS = 6000
# Statuses a hostile request may get. UNKNOWN, INTERNAL, UNAVAILABLE or DEADLINE_EXCEEDED would be a bug.
DEFINED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ABORTED,
}
METHODS = ("/specdec.v1.Coordinator/Generate", "/specdec.v1.Coordinator/GenerateStream", "/specdec.v1.Coordinator/Info")
OUTCOMES: collections.Counter = collections.Counter()  # (how, status) over the module


@pytest.fixture(scope="module")
def fuzzed(secure_replicas, redis_server):
    service = secure_replicas.start_coordinator(
        "coordinator-fuzzed",
        "--redis-url",
        redis_server.url,
        "--require-api-key",
        "--max-new-tokens-limit",
        "3",
        "--max-prompt-tokens",
        "64",
        "--result-ttl-s",
        "30",
        "--lease-wait-s",
        "1",
        "--log-level",
        "ERROR",
    )
    with connect_sync(redis_server.url) as client:
        key = add_key(client, RedisKeys(), "fuzzer")
    channel = grpc.insecure_channel(service.address)
    yield service, channel, key
    channel.close()
    service.stop()


def call(channel: grpc.Channel, method: str, payload: bytes, metadata) -> grpc.StatusCode:
    """One call with raw bytes (no (de)serializers); the stream is read to its end."""
    try:
        if method.endswith("Stream"):
            for _ in channel.unary_stream(method)(payload, metadata=metadata, timeout=60):
                pass
        else:
            channel.unary_unary(method)(payload, metadata=metadata, timeout=60)
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()


int32s = st.integers(-(2**31), 2**31 - 1)
small = st.integers(-3, 70)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
words = st.lists(st.sampled_from(["w1", "w7", "w63", "w64", "<eos>", "w", " ", "\n", "ünï", "\u200b"]), max_size=12)
prompts = st.one_of(
    st.none(),
    st.text(max_size=40),
    words.map(" ".join),
    words.map("".join),
    st.lists(st.one_of(small, int32s), max_size=70),
)
stops = st.one_of(
    st.lists(st.text(max_size=12), max_size=4),
    st.sampled_from([["w" * 257], ["w1"] * 17, ["", "\ufffd", "\x00"], ["w1" * 128]]),
)


@st.composite
def generate_requests(draw) -> coordinator_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), floats)), top_k=draw(st.one_of(small, int32s))
    )
    if draw(st.booleans()):
        sampling.top_p = draw(floats)
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**64 - 1))
    request = coordinator_pb2.GenerateRequest(
        max_new_tokens=draw(st.one_of(st.integers(-2, 5), int32s)),
        stop=draw(stops),
        include_stats=draw(st.booleans()),
        request_id=draw(st.one_of(st.just(""), st.text(max_size=8), st.sampled_from(["r" * 128, "r" * 129]))),
        draft_method=draw(st.one_of(st.sampled_from([0, 1, 2]), int32s)),
    )
    if draw(st.booleans()):
        request.sampling.CopyFrom(sampling)
    prompt = draw(prompts)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    if draw(st.booleans()):
        request.num_speculative_tokens = draw(st.one_of(st.integers(-2, 18), int32s))
    return request


@settings(
    max_examples=HYPOTHESIS_REQUESTS,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(
    request=generate_requests(),
    method=st.sampled_from(METHODS),
    auth=st.sampled_from(["valid"] * 12 + ["none", "garbage", "empty bearer", "binary"]),
)
def test_hypothesis_requests_get_defined_statuses(fuzzed, request, method, auth):
    service, channel, key = fuzzed
    metadata = {
        "valid": [("authorization", f"Bearer {key}")],
        "none": [],
        "garbage": [("authorization", "Bearer ' OR 1=1; --")],
        "empty bearer": [("authorization", "Bearer ")],
        "binary": [("authorization-bin", b"\x00\xff")],
    }[auth]
    payload = common_pb2.InfoRequest().SerializeToString() if method.endswith("Info") else request.SerializeToString()
    code = call(channel, method, payload, metadata)
    OUTCOMES["hypothesis", code] += 1
    assert code in DEFINED, f"{method} {request!r} -> {code}"


def raw_payloads(count: int, seed: int) -> list[bytes]:
    """Random bytes, and valid requests flipped, cut, duplicated and spliced."""
    rng = random.Random(seed)
    valid = [
        build_request([1, 2, 3], max_new_tokens=1).SerializeToString(),
        build_request(
            "w5 w9", max_new_tokens=1, temperature=0.7, seed=5, stop=["w9"], request_id="raw"
        ).SerializeToString(),
        build_request([7] * 30, max_new_tokens=1, num_speculative_tokens=2, include_stats=True).SerializeToString(),
    ]
    payloads = []
    for i in range(count):
        base = bytearray(rng.choice(valid))
        kind = i % 5
        if kind == 0:
            payloads.append(rng.randbytes(rng.randint(0, 300)))
            continue
        if kind == 1:
            for _ in range(rng.randint(1, 4)):
                base[rng.randrange(len(base))] ^= 1 << rng.randrange(8)
        elif kind == 2:
            base = base[: rng.randrange(len(base) + 1)]
        elif kind == 3:
            base = base + rng.choice(valid) + rng.randbytes(rng.randint(0, 20))
        else:
            at = rng.randrange(len(base) + 1)
            base[at:at] = rng.randbytes(rng.randint(1, 12))
        payloads.append(bytes(base))
    return payloads


def test_raw_bytes_on_the_wire_get_defined_statuses(fuzzed):
    service, channel, key = fuzzed
    metadata = [("authorization", f"Bearer {key}")]
    payloads = raw_payloads(RAW_REQUESTS, seed=9)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: call(channel, METHODS[i % 2], payloads[i], metadata), range(len(payloads))))
    OUTCOMES.update(("raw", code) for code in codes)
    bad = [(payloads[i], code) for i, code in enumerate(codes) if code not in DEFINED]
    assert not bad, f"{len(bad)} undefined statuses, e.g. {bad[:3]}"


def test_still_serving_a_valid_request_afterwards(fuzzed):
    service, channel, key = fuzzed
    assert service.process.poll() is None, "the coordinator died"
    print("fuzz outcomes:", dict(OUTCOMES))
    assert sum(OUTCOMES.values()) >= 10_000
    assert OUTCOMES["hypothesis", grpc.StatusCode.OK] > 0 and OUTCOMES["raw", grpc.StatusCode.OK] > 0
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    reply = stub.Generate(
        build_request([1, 2, 3], max_new_tokens=3), metadata=[("authorization", f"Bearer {key}")], timeout=60
    )
    assert len(reply.token_ids) == 3 and reply.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
