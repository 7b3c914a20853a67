"""A coordinator whose replicas are DNS names follows their records without a restart: real processes on
127.0.0.2 and 127.0.0.3 (one port per replica set), a loopback DNS server whose A records the test changes,
SIGKILL."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2
from loopback_dns import LoopbackDns
from test_replicas import coordinator_health, outcome

from specdec.client import Client
from specdec.local_stack import ServiceProcess, start_service
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

REFRESH_S = 0.5
DRAFT_NAME, VERIFY_NAME = "draft.specdec.test", "verify.specdec.test"


def active_sessions(address: str, stub_type) -> int:
    with grpc.insecure_channel(address) as channel:
        return stub_type(channel).Info(common_pb2.InfoRequest(), timeout=10).active_sessions


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def most_sessions_seen(address: str, stub_type, client: Client, requests: int) -> int:
    """The most sessions `address` held at once while `requests` long requests ran concurrently."""
    done, peak = threading.Event(), [0]

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], active_sessions(address, stub_type))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        codes = list(pool.map(lambda _: outcome(client, max_new_tokens=96), range(requests)))
    done.set()
    watcher.join()
    assert codes == [grpc.StatusCode.OK] * requests, codes
    return peak[0]


def ten_requests(client: Client) -> list[grpc.StatusCode]:
    """Ten sequential requests' codes; none but UNAVAILABLE (a replica found dead) may fail."""
    codes = [outcome(client) for _ in range(10)]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    return codes


def start_at(name: str, module: str, args: list[str], host: str, port: int, log_dir) -> ServiceProcess:
    return start_service(name, module, [*args, "--address", f"{host}:{port}"], log_dir)


def test_a_coordinator_follows_its_replicas_through_dns_without_a_restart(long_pair_dirs, tmp_path):
    target_dir, draft_dir = long_pair_dirs
    draft_args, verify_args = ["--model", str(draft_dir)], ["--model", str(target_dir)]
    services: dict[str, ServiceProcess] = {}
    with LoopbackDns() as dns, concurrent.futures.ThreadPoolExecutor(2) as starter:
        try:
            services["draft-a"], services["verify-a"] = starter.map(
                lambda args: start_at(*args, tmp_path),
                [
                    ("draft-a", "draft_service", draft_args, "127.0.0.2", 0),
                    ("verify-a", "verify_service", verify_args, "127.0.0.2", 0),
                ],
            )
            draft_port, verify_port = services["draft-a"].port, services["verify-a"].port
            services["draft-b"], services["verify-b"] = starter.map(
                lambda args: start_at(*args, tmp_path),
                [
                    ("draft-b", "draft_service", draft_args, "127.0.0.3", draft_port),
                    ("verify-b", "verify_service", verify_args, "127.0.0.3", verify_port),
                ],
            )
            dns.set(DRAFT_NAME, "127.0.0.2")
            dns.set(VERIFY_NAME, "127.0.0.2")
            coordinator = services["coordinator"] = start_service(
                "coordinator",
                "coordinator",
                [
                    *("--tokenizer", str(target_dir), "--call-timeout-s", "10"),
                    *("--draft-replicas", f"dns:///{DRAFT_NAME}:{draft_port}"),
                    *("--verify-replicas", f"dns:///{VERIFY_NAME}:{verify_port}"),
                    *("--dns-nameserver", dns.address, "--discovery-refresh-s", str(REFRESH_S)),
                ],
                tmp_path,
            )
            draft_b, verify_a, verify_b = (
                f"127.0.0.3:{draft_port}",
                f"127.0.0.2:{verify_port}",
                f"127.0.0.3:{verify_port}",
            )
            with Client(coordinator.address, timeout_s=60) as client:
                assert outcome(client) == grpc.StatusCode.OK
                assert list(client.info().draft_replicas) == [f"127.0.0.2:{draft_port}"]

                # A draft replica the autoscaler added: it joins within the refresh interval and takes sessions.
                dns.set(DRAFT_NAME, "127.0.0.2", "127.0.0.3")
                assert wait_for(lambda: draft_b in client.info().draft_replicas, 4 * REFRESH_S)
                assert most_sessions_seen(draft_b, drafter_pb2_grpc.DrafterStub, client, requests=4) >= 1

                # The verify replica moves to a new IP (a restarted pod) and the old one dies: within the refresh
                # interval (and the new one's ready check) the coordinator uses the new one only.
                dns.set(VERIFY_NAME, "127.0.0.3")
                services["verify-a"].process.send_signal(signal.SIGKILL)
                moved = time.monotonic()
                assert wait_for(lambda: list(client.info().verify_replicas) == [verify_b], 2 * REFRESH_S)
                assert time.monotonic() - moved < REFRESH_S + 0.4
                assert ten_requests(client).count(grpc.StatusCode.OK) == 10
                assert most_sessions_seen(verify_b, verifier_pb2_grpc.VerifierStub, client, requests=2) >= 1

                # The old address comes back (a new pod got it): it joins again. Then B dies while DNS still
                # names it: the failure takes it out of placement at the cost of one request, and once DNS drops
                # it too it leaves for good (no more probing).
                services["verify-a"] = start_at(
                    "verify-a2", "verify_service", verify_args, "127.0.0.2", verify_port, tmp_path
                )
                dns.set(VERIFY_NAME, "127.0.0.2", "127.0.0.3")
                assert wait_for(lambda: verify_a in client.info().verify_replicas, 4 * REFRESH_S)
                services["verify-b"].process.send_signal(signal.SIGKILL)
                services["verify-b"].process.wait(10)
                assert ten_requests(client).count(grpc.StatusCode.OK) >= 9
                dns.set(VERIFY_NAME, "127.0.0.2")
                assert wait_for(lambda: list(client.info().verify_replicas) == [verify_a], 4 * REFRESH_S)
                assert coordinator_health(coordinator.address) == health_pb2.HealthCheckResponse.SERVING
            log = coordinator.log_path.read_text()
            assert f"draft replica {draft_b} joined placement" in log
            assert f"verify replica {verify_b} joined placement" in log
            assert log.count(f"verify replica {verify_a} joined placement") == 1
            assert f"verify replica {verify_b} marked unhealthy" in log
            assert log.count(f"verify replica {verify_b} left placement") == 1
        finally:
            for service in services.values():
                service.stop()
