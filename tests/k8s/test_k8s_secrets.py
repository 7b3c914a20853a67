"""scripts/k8s_secrets.py: the Secrets it writes hold what the manifests read, and its certificates do what
the manifests ask of them: mutual TLS between the services (the server role's certificate serving, the client
role's, with a key pair of its own, presented by the coordinator), checked against the replica server name the
coordinator is configured with, when the coordinator dials a bare IP as it does a pod's. Running it again keeps
the CA and renews the certificates."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import pathlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.serving.server import start_server
from specdec.serving.tls import ServerTlsSettings, channel_credentials, server_credentials, server_name_options

SERVING = health_pb2.HealthCheckResponse.SERVING
ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("k8s_secrets", ROOT / "scripts" / "k8s_secrets.py")
k8s_secrets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k8s_secrets)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("secrets")
    assert k8s_secrets.main(["--out", str(out), "--client", "app-a", "--client", "app.b"]) == 0
    return out


def secrets_of(out: pathlib.Path) -> dict[str, dict[str, bytes]]:
    listed = json.loads((out / "secrets.json").read_text())
    assert listed["kind"] == "List"
    return {s["metadata"]["name"]: {k: base64.b64decode(v) for k, v in s["data"].items()} for s in listed["items"]}


def test_the_secrets_hold_the_keys_the_manifests_read(written):
    made = secrets_of(written)
    assert set(made) == set(k8s_secrets.SECRET_KEYS)
    for name, keys in k8s_secrets.SECRET_KEYS.items():
        assert set(keys) <= set(made[name]), name
    assert set(made["specdec-api-keys"]) == {"app-a", "app.b"}
    assert all(key.startswith(b"sd-") and len(key) >= 24 for key in made["specdec-api-keys"].values())
    password = made["specdec-redis"]["password"].decode()
    assert made["specdec-redis"]["url"].decode() == f"redis://:{password}@specdec-redis:6379/0"
    for role in k8s_secrets.TLS_SECRETS:
        assert made[role]["ca.crt"] == (written / "ca.crt").read_bytes()
    assert made["specdec-tls"]["tls.key"] != made["specdec-tls-client"]["tls.key"]  # a key pair per role
    assert (written / "ca.key").stat().st_mode & 0o077 == 0  # the CA key is the operator's alone


def test_running_again_keeps_the_ca_and_renews_only_the_certificates(written, tmp_path):
    before = secrets_of(written)
    renewal = tmp_path / "renewal"
    assert k8s_secrets.main(["--out", str(renewal), "--ca", str(written), "--tls-only"]) == 0
    after = secrets_of(renewal)
    assert set(after) == set(k8s_secrets.TLS_SECRETS)  # the Redis password and API keys stay as they are
    for role in k8s_secrets.TLS_SECRETS:
        assert after[role]["ca.crt"] == before[role]["ca.crt"]
        assert after[role]["tls.crt"] != before[role]["tls.crt"] and after[role]["tls.key"] != before[role]["tls.key"]


def test_bad_client_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="client names"):
        k8s_secrets.make_secrets(tmp_path, clients=("has space",))


def test_the_certificates_serve_mutual_tls_to_the_replica_server_name(written, tmp_path):
    made = secrets_of(written)
    for role in k8s_secrets.TLS_SECRETS:
        (tmp_path / role).mkdir()
        for name, data in made[role].items():
            (tmp_path / role / name).write_bytes(data)
    cert, key, ca = (str(tmp_path / "specdec-tls" / name) for name in ("tls.crt", "tls.key", "ca.crt"))
    client_cert, client_key = (str(tmp_path / "specdec-tls-client" / name) for name in ("tls.crt", "tls.key"))
    settings = ServerTlsSettings(cert, key, ca)  # what draft and verify get (k8s/base/config/*.env)

    async def check(address: str, credentials, server_name: str) -> int:
        options = server_name_options(server_name)
        async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status

    async def scenario():
        running = await start_server("127.0.0.1:0", lambda server: None, [], credentials=server_credentials(settings))
        address = f"127.0.0.1:{running.port}"
        try:
            # The coordinator's replica channel: CA, the client role's certificate, and the replica server name.
            mutual = channel_credentials(ca, client_cert, client_key)
            assert await check(address, mutual, k8s_secrets.REPLICA_SERVER_NAME) == SERVING
            with pytest.raises(grpc.aio.AioRpcError):  # no client certificate: refused
                await check(address, channel_credentials(ca), k8s_secrets.REPLICA_SERVER_NAME)
            with pytest.raises(grpc.aio.AioRpcError):  # a name the certificate does not carry
                await check(address, mutual, "specdec-elsewhere")
            with pytest.raises(grpc.aio.AioRpcError):  # the server role's certificate is no client certificate
                await check(address, channel_credentials(ca, cert, key), k8s_secrets.REPLICA_SERVER_NAME)
        finally:
            await running.stop(0)

    asyncio.run(scenario())
