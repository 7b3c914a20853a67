"""Verify replicas that die leave placement, and the coordinator's readiness follows them while its liveness
stays SERVING (unready, not dead: kubelet must not restart it): real processes, SIGKILL."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import Client
from specdec.local_stack import start_service
from specdec.serving.health_status import LIVENESS

PROMPT = [3, 5, 7]


def coordinator_health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def outcome(client: Client, max_new_tokens: int = 6) -> grpc.StatusCode:
    try:
        client.generate(PROMPT, max_new_tokens=max_new_tokens, num_speculative_tokens=2)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def two_verifiers(tiny_pair_dirs, tmp_path_factory):
    target_dir, draft_dir = tiny_pair_dirs
    log_dir = tmp_path_factory.mktemp("two_verifiers")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        draft, first, second = pool.map(
            lambda args: start_service(*args, log_dir),
            [
                ("draft", "draft_service", ["--model", str(draft_dir)]),
                ("verify-a", "verify_service", ["--model", str(target_dir)]),
                ("verify-b", "verify_service", ["--model", str(target_dir)]),
            ],
        )
    coordinator = start_service(
        "coordinator",
        "coordinator",
        [
            "--tokenizer",
            str(target_dir),
            "--draft-replicas",
            draft.address,
            "--verify-replicas",
            f"{first.address},{second.address}",
            "--call-timeout-s",
            "10",
        ],
        log_dir,
    )
    services = {"draft": draft, "verify-a": first, "verify-b": second, "coordinator": coordinator}
    yield services, log_dir
    for service in services.values():
        service.stop()


def test_a_dead_verify_replica_leaves_placement_and_health_follows_the_replicas(two_verifiers, tiny_pair_dirs):
    services, log_dir = two_verifiers
    coordinator = services["coordinator"]
    with Client(coordinator.address, timeout_s=60) as client:
        assert outcome(client) == grpc.StatusCode.OK
        services["verify-a"].process.send_signal(signal.SIGKILL)  # the first: placement's pick while loads tie
        services["verify-a"].process.wait(10)
        outcomes = [outcome(client) for _ in range(10)]
        assert outcomes.count(grpc.StatusCode.OK) >= 9, outcomes
        assert all(code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE) for code in outcomes), outcomes
        assert coordinator_health(coordinator.address) == health_pb2.HealthCheckResponse.SERVING

        services["verify-b"].process.send_signal(signal.SIGKILL)
        services["verify-b"].process.wait(10)
        for _ in range(5):  # the next request placed on it fails and takes it out: none is left
            assert outcome(client) == grpc.StatusCode.UNAVAILABLE
            if coordinator_health(coordinator.address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
        assert coordinator_health(coordinator.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert coordinator_health(coordinator.address, LIVENESS) == health_pb2.HealthCheckResponse.SERVING

        target_dir, _ = tiny_pair_dirs
        services["verify-b"] = start_service(
            "verify-b-restarted",
            "verify_service",
            ["--model", str(target_dir), "--address", f"127.0.0.1:{services['verify-b'].port}"],
            log_dir,
        )
        for _ in range(100):  # probed back (every second)
            if coordinator_health(coordinator.address) == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.2)
        assert coordinator_health(coordinator.address) == health_pb2.HealthCheckResponse.SERVING
        assert outcome(client) == grpc.StatusCode.OK
    log = coordinator.log_path.read_text()
    assert "verify replica" in log and "marked unhealthy" in log and "NOT_SERVING" in log
