"""A server takes renewed certificates without a restart (specdec/serving/certificate_reload.py): its files are
swapped the way the kubelet updates a Secret volume, and the next handshake serves the new certificate, signed by
a new CA, while a client that trusts both the old and the new CA keeps working across the swap, on the connection
it had and on new ones. Files that make no valid set are refused and the loaded set stays."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from certs import SecretVolume, make_ca, make_cert
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.serving.server import start_server
from specdec.serving.tls import (
    ServerTlsSettings,
    channel_credentials,
    read_pem,
    server_certificates,
    server_credentials,
)

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    old_ca, new_ca = make_ca(directory, "old-ca"), make_ca(directory, "new-ca")
    both = directory / "both-cas.pem"
    both.write_bytes(old_ca.cert.read_bytes() + new_ca.cert.read_bytes())
    return {
        "old_ca": old_ca,
        "new_ca": new_ca,
        "both": both,
        "old_server": make_cert(directory, "old-server", old_ca),
        "new_server": make_cert(directory, "new-server", new_ca),
        "client": make_cert(directory, "client", old_ca),
    }


def server_files(server, client_ca: bytes) -> dict[str, bytes]:
    return {"tls.crt": server.cert.read_bytes(), "tls.key": server.key.read_bytes(), "trust/ca.crt": client_ca}


async def check(address: str, ca: str, client) -> int | grpc.StatusCode:
    """One health check on a new channel trusting `ca`, with the client certificate: its status, or the error."""
    credentials = channel_credentials(ca, str(client.cert), str(client.key))
    async with grpc.aio.secure_channel(address, credentials) as channel:
        try:
            return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status
        except grpc.aio.AioRpcError as error:
            return error.code()


def test_a_server_serves_a_renewed_certificate_without_a_restart_and_both_ca_clients_keep_working(pki, tmp_path):
    volume = SecretVolume(tmp_path / "tls")
    volume.publish(server_files(pki["old_server"], pki["old_ca"].cert.read_bytes()))
    settings = ServerTlsSettings(volume.path("tls.crt"), volume.path("tls.key"), volume.path("trust"))
    old, new, both, client = str(pki["old_ca"].cert), str(pki["new_ca"].cert), str(pki["both"]), pki["client"]

    async def scenario():
        running = await start_server("127.0.0.1:0", lambda s: None, [], credentials=server_credentials(settings))
        address = f"127.0.0.1:{running.port}"
        credentials = channel_credentials(both, str(client.cert), str(client.key))
        try:
            async with grpc.aio.secure_channel(address, credentials) as kept:  # open across the swap
                stub = health_pb2_grpc.HealthStub(kept)
                assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
                assert [await check(address, ca, client) for ca in (old, new, both)] == [
                    SERVING,
                    grpc.StatusCode.UNAVAILABLE,  # the old certificate: the new CA alone does not trust it
                    SERVING,
                ]
                volume.publish(server_files(pki["new_server"], pki["old_ca"].cert.read_bytes()))
                assert [await check(address, ca, client) for ca in (old, new, both)] == [
                    grpc.StatusCode.UNAVAILABLE,  # the renewed certificate is served: signed by the new CA
                    SERVING,
                    SERVING,
                ]
                assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
        finally:
            await running.stop(0)

    asyncio.run(scenario())


def test_files_that_make_no_valid_set_are_refused_and_the_loaded_set_stays(pki, tmp_path):
    volume = SecretVolume(tmp_path / "tls")
    volume.publish(server_files(pki["old_server"], pki["old_ca"].cert.read_bytes()))
    files = server_certificates(ServerTlsSettings(volume.path("tls.crt"), volume.path("tls.key")))
    loaded = files.current
    assert files.renewed() is None  # nothing changed
    mismatched = server_files(pki["new_server"], b"")
    mismatched["tls.key"] = pki["old_server"].key.read_bytes()  # a renewed certificate beside the old key
    volume.publish(mismatched)
    assert files.renewed() is None and files.current is loaded and files.reloads == 0
    volume.publish(server_files(pki["new_server"], b""))  # the key follows
    assert files.renewed() is not None and files.reloads == 1


def test_a_ca_directory_trusts_every_ca_file_in_it(pki, tmp_path):
    """A projected volume puts the issuing CA and, during a rotation, the other CA side by side."""
    trust = tmp_path / "trust"
    trust.mkdir()
    (trust / "ca.crt").write_bytes(pki["old_ca"].cert.read_bytes())
    (trust / "extra.crt").write_bytes(pki["new_ca"].cert.read_bytes())
    (trust / "notes.txt").write_text("not read")
    assert read_pem(str(trust), "tls_client_ca") == b"\n".join(
        [pki["old_ca"].cert.read_bytes(), pki["new_ca"].cert.read_bytes()]
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="tls_client_ca: the directory .* holds no .crt or .pem file"):
        read_pem(str(empty), "tls_client_ca")
