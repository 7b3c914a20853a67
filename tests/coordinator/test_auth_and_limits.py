"""API keys, per-key rate limits and size limits on a real coordinator with a real redis-server."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.api_keys import hash_key
from specdec.client import Client, build_request
from specdec.local_stack import REPO_ROOT
from specdec.v1 import common_pb2, coordinator_pb2_grpc

PROMPT = [1, 2, 3]


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code(), raised.value.details()


def test_a_valid_key_works_for_every_call(guarded):
    with guarded.client(guarded.add_key()) as client:
        reply = client.generate(PROMPT, max_new_tokens=8, include_stats=True)
        assert len(reply.token_ids) == 8 and reply.finish_reason == 1
        chunks = list(client.stream(PROMPT, max_new_tokens=8))
        assert [t for c in chunks for t in c.token_ids] == list(reply.token_ids)
        assert client.info().max_new_tokens_limit == 16


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer"),), (("authorization", "Basic dXNlcjpwdw=="),), (("x-api-key", "sd-whatever"),)],
)
def test_no_key_is_unauthenticated(guarded, metadata):
    with grpc.insecure_channel(guarded.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = build_request(PROMPT, max_new_tokens=4)
        for call in (
            lambda: stub.Generate(request, metadata=metadata, timeout=30),
            lambda: list(stub.GenerateStream(request, metadata=metadata, timeout=30)),
            lambda: stub.Info(common_pb2.InfoRequest(), metadata=metadata, timeout=30),
        ):
            code, details = status_of(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in details


def test_wrong_key_is_unauthenticated(guarded):
    real = guarded.add_key()
    for wrong in ("sd-not-a-key", real + "x", real[:-1], "   "):
        with guarded.client(wrong) as client:
            code, details = status_of(lambda: client.generate(PROMPT, max_new_tokens=4))
            assert code == grpc.StatusCode.UNAUTHENTICATED, details


def test_health_checks_need_no_key(guarded):
    with grpc.insecure_channel(guarded.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def run_admin(guarded, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.api_keys", "--redis-url", guarded.redis.url, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_admin_cli_adds_a_hashed_key_and_revokes_it_at_once(guarded):
    added = run_admin(guarded, "add", "cli-tenant", "--requests-per-minute", "100", "--tokens-per-minute", "5000")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    stored = redis.Redis.from_url(guarded.redis.url)
    everything = b"".join(
        k + b"".join(v for kv in stored.hgetall(k).items() for v in kv)
        for k in stored.scan_iter()
        if stored.type(k) == b"hash"
    )
    assert key.encode() not in everything and hash_key(key).encode() in everything  # only the hash is stored
    assert "cli-tenant" in run_admin(guarded, "list").stdout
    assert run_admin(guarded, "add", "cli-tenant").returncode != 0  # one key per name
    with guarded.client(key) as client:
        assert client.generate(PROMPT, max_new_tokens=4).token_ids
        assert run_admin(guarded, "revoke", "cli-tenant").returncode == 0
        code, _ = status_of(lambda: client.generate(PROMPT, max_new_tokens=4))
        assert code == grpc.StatusCode.UNAUTHENTICATED


def test_admin_cli_stores_a_key_from_a_file_again_and_again(guarded, tmp_path):
    """What the Kubernetes seeding Job does (k8s/base/api-keys-seed.yaml): the key comes from a Secret's file,
    nothing of it is printed, and running the Job again only sets the limits."""
    key_file = tmp_path / "seeded-tenant"
    key_file.write_text("sd-" + "k" * 40 + "\n")
    key = "sd-" + "k" * 40
    for limit in ("100", "7"):
        added = run_admin(guarded, "add", "seeded-tenant", "--key-file", str(key_file), "--requests-per-minute", limit)
        assert added.returncode == 0 and key not in added.stdout + added.stderr, added.stderr
    assert "seeded-tenant\trequests/min=7\t" in run_admin(guarded, "list").stdout
    with guarded.client(key) as client:
        assert client.generate(PROMPT, max_new_tokens=2).token_ids
    key_file.write_text("sd-" + "o" * 40)
    other = run_admin(guarded, "add", "seeded-tenant", "--key-file", str(key_file))
    assert other.returncode == 2 and "revoke it first" in other.stderr  # one key per name, still
    key_file.write_text("short")
    assert "at least 24 characters" in run_admin(guarded, "add", "short", "--key-file", str(key_file)).stderr
    assert run_admin(guarded, "revoke", "seeded-tenant").returncode == 0


def test_over_the_request_rate_is_resource_exhausted(guarded):
    limited, other = guarded.add_key(requests_per_minute=3), guarded.add_key(requests_per_minute=3)
    with guarded.client(limited) as client, guarded.client(other) as other_client:
        for _ in range(3):
            assert client.generate(PROMPT, max_new_tokens=2).token_ids
        code, details = status_of(lambda: client.generate(PROMPT, max_new_tokens=2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 requests per minute" in details
        assert other_client.generate(PROMPT, max_new_tokens=2).token_ids  # buckets are per key


def test_over_the_token_rate_is_resource_exhausted(guarded):
    with guarded.client(guarded.add_key(tokens_per_minute=30)) as client:
        for _ in range(2):  # 3 prompt + 8 new tokens each
            assert len(client.generate(PROMPT, max_new_tokens=8).token_ids) == 8
        code, details = status_of(lambda: client.generate(PROMPT, max_new_tokens=8))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "30 tokens per minute" in details
        code, details = status_of(lambda: client.generate([1] * 40, max_new_tokens=4))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "more than key" in details


def test_size_limits_are_resource_exhausted(guarded):
    with guarded.client(guarded.add_key()) as client:
        code, details = status_of(lambda: client.generate([1] * 49, max_new_tokens=2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("prompt: 49 tokens")
        code, details = status_of(lambda: client.generate([1] * 45, max_new_tokens=12))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_total_tokens" in details
        assert len(client.generate([1] * 48, max_new_tokens=8).token_ids) == 8  # at both limits exactly
        code, _ = status_of(lambda: client.generate(PROMPT, max_new_tokens=17))
        assert code == grpc.StatusCode.INVALID_ARGUMENT  # max_new_tokens_limit stays a field check


def test_redis_down_fails_closed_with_unavailable(guarded):
    key = guarded.add_key()
    guarded.redis.kill()
    try:
        with guarded.client(key) as client:
            code, details = status_of(lambda: client.generate(PROMPT, max_new_tokens=4))
            assert code == grpc.StatusCode.UNAVAILABLE and "Redis" in details and "refusing" in details
            code, _ = status_of(lambda: client.generate(PROMPT, max_new_tokens=4, request_id="while-down"))
            assert code == grpc.StatusCode.UNAVAILABLE
        with Client(guarded.address, timeout_s=30) as anonymous:
            code, _ = status_of(lambda: anonymous.generate(PROMPT, max_new_tokens=4))
            assert code == grpc.StatusCode.UNAUTHENTICATED  # nor is a call without a key
    finally:
        guarded.redis.start()  # same port, empty (keys are made per test)
    with guarded.client(guarded.add_key()) as client:
        assert client.generate(PROMPT, max_new_tokens=4).token_ids  # back as soon as Redis is
