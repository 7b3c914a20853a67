"""TLS on the client-facing port and mutual TLS between the services, with throwaway certificates.

The shared replicas (conftest.py) accept only clients with a certificate from the test CA; here two more
coordinators serve clients over TLS and over mutual TLS, and a third lacks its client certificate.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import Client
from specdec.local_stack import REPO_ROOT, start_service
from specdec.redis_server import free_port
from specdec.serving.tls import ServerTlsSettings, channel_credentials, server_credentials
from specdec.v1 import common_pb2, coordinator_pb2_grpc, drafter_pb2_grpc, verifier_pb2_grpc

COORDINATOR_HEALTH_PORT = free_port()


@pytest.fixture(scope="module")
def coordinators(secure_replicas, pki):
    server = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        tls = pool.submit(
            secure_replicas.start_coordinator, "coordinator-tls", *server, "--health-port", str(COORDINATOR_HEALTH_PORT)
        )
        mtls = pool.submit(
            secure_replicas.start_coordinator, "coordinator-mtls", *server, "--tls-client-ca", str(pki.ca.cert)
        )
        refused = pool.submit(
            start_service,
            "coordinator-without-client-cert",
            "coordinator",
            [*secure_replicas.coordinator_args(client_certificate=False), "--startup-timeout-s", "3"],
            secure_replicas.log_dir,
        )
        started = {"tls": tls.result(), "mtls": mtls.result(), "refused": refused.exception()}
    yield started
    started["tls"].stop()
    started["mtls"].stop()


def credentials(pki, ca=None, client=None) -> grpc.ChannelCredentials:
    key, cert = (client.key.read_bytes(), client.cert.read_bytes()) if client else (None, None)
    return grpc.ssl_channel_credentials((ca or pki.ca).cert.read_bytes(), private_key=key, certificate_chain=cert)


def refused(address: str, channel_credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with Client(address, timeout_s=15, credentials=channel_credentials) as client:
        with pytest.raises(grpc.RpcError) as raised:
            client.generate([1, 2, 3], max_new_tokens=2)
    return raised.value.code()


def test_tls_port_serves_clients_that_trust_its_ca(coordinators, pki):
    with Client(coordinators["tls"].address, timeout_s=60, credentials=credentials(pki)) as client:
        assert len(client.generate([1, 2, 3], max_new_tokens=4).token_ids) == 4


def test_the_command_line_client_speaks_tls(coordinators, pki):
    generated = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "--address", coordinators["tls"].address]
        + ["--tls-ca", str(pki.ca.cert), "--max-new-tokens", "3", "1 2 3"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert generated.returncode == 0, generated.stderr


def test_tls_port_refuses_plaintext_and_clients_of_another_ca(coordinators, pki):
    address = coordinators["tls"].address
    assert refused(address, None) == grpc.StatusCode.UNAVAILABLE
    assert refused(address, credentials(pki, ca=pki.rogue_ca)) == grpc.StatusCode.UNAVAILABLE


def test_mtls_port_serves_clients_with_a_certificate_from_its_ca(coordinators, pki):
    with Client(coordinators["mtls"].address, timeout_s=60, credentials=credentials(pki, client=pki.client)) as client:
        assert len(client.generate([1, 2, 3], max_new_tokens=4).token_ids) == 4


def test_mtls_port_refuses_clients_without_the_right_certificate(coordinators, pki):
    address = coordinators["mtls"].address
    assert refused(address, credentials(pki)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    assert refused(address, credentials(pki, client=pki.rogue_client)) == grpc.StatusCode.UNAVAILABLE
    assert refused(address, None) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "service, stub_type", [("draft", drafter_pb2_grpc.DrafterStub), ("verify", verifier_pb2_grpc.VerifierStub)]
)
def test_replicas_speak_mutual_tls_only(secure_replicas, pki, service, stub_type):
    address = getattr(secure_replicas, service).address
    with grpc.secure_channel(address, credentials(pki, client=pki.client)) as channel:
        assert stub_type(channel).Info(common_pb2.InfoRequest(), timeout=15).vocab_size == 64
    for channel in (
        grpc.insecure_channel(address),
        grpc.secure_channel(address, credentials(pki)),
        grpc.secure_channel(address, credentials(pki, client=pki.rogue_client)),
    ):
        with channel, pytest.raises(grpc.RpcError) as raised:
            stub_type(channel).Info(common_pb2.InfoRequest(), timeout=15)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "service, stub_type",
    [
        ("coordinator", coordinator_pb2_grpc.CoordinatorStub),
        ("draft", drafter_pb2_grpc.DrafterStub),
        ("verify", verifier_pb2_grpc.VerifierStub),
    ],
)
def test_health_port_answers_probes_in_plaintext_and_nothing_else(coordinators, secure_replicas, service, stub_type):
    """What kubelet's gRPC probes (plaintext only) see of a TLS service: health on --health-port, and no API
    in plaintext anywhere."""
    if service == "coordinator":
        tls_address, health_port = coordinators["tls"].address, COORDINATOR_HEALTH_PORT
    else:
        tls_address, health_port = getattr(secure_replicas, service).address, secure_replicas.health_ports[service]
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=15)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as raised:
            stub_type(channel).Info(common_pb2.InfoRequest(), timeout=15)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(tls_address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            stub_type(channel).Info(common_pb2.InfoRequest(), timeout=15)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_coordinator_without_a_client_certificate_cannot_reach_the_replicas(coordinators):
    failure = coordinators["refused"]
    assert isinstance(failure, RuntimeError) and "not ready" in str(failure)


def test_tls_settings_are_checked(pki, tmp_path):
    assert server_credentials(ServerTlsSettings()) is None and channel_credentials() is None
    with pytest.raises(ValueError, match="tls_client_ca"):
        server_credentials(ServerTlsSettings(tls_client_ca=str(pki.ca.cert)))
    with pytest.raises(ValueError, match="give both"):
        server_credentials(ServerTlsSettings(tls_cert=str(pki.server.cert)))
    with pytest.raises(ValueError, match="tls_key: cannot read"):
        server_credentials(ServerTlsSettings(tls_cert=str(pki.server.cert), tls_key=str(tmp_path / "missing")))
    (tmp_path / "empty.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="no PEM block"):
        channel_credentials(ca=str(tmp_path / "empty.pem"))
    with pytest.raises(ValueError, match="replica_tls_ca"):
        channel_credentials(cert=str(pki.client.cert), key=str(pki.client.key))
