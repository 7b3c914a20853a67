"""A CA rotation without a restart, as k8s/README.md ("Certificates") runs it: a mutual-TLS server (a draft or
verify replica) and the coordinator's replica pool follow their files, which change the way the kubelet updates
a Secret volume, through the four steps: trust the new CA beside the old, renew the server's certificate from the
new CA, renew the client's, drop the old CA. Every call succeeds at every step, and at the end new connections
work only with the new CA's certificates, which the pool must have reloaded to make them."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from certs import SecretVolume, make_ca, make_cert
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.certificate_watch import follow_replica_certificates
from coordinator.replicas import ReplicaPool
from specdec.serving.server import start_server
from specdec.serving.tls import ServerTlsSettings, channel_credentials, client_certificates, server_credentials

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    old_ca, new_ca = make_ca(directory, "old-ca"), make_ca(directory, "new-ca")
    return {
        "old_ca": old_ca.cert.read_bytes(),
        "new_ca": new_ca.cert.read_bytes(),
        "old_server": make_cert(directory, "old-server", old_ca, ("127.0.0.1",)),
        "new_server": make_cert(directory, "new-server", new_ca, ("127.0.0.1",)),
        "old_client": make_cert(directory, "old-client", old_ca),
        "new_client": make_cert(directory, "new-client", new_ca),
    }


def role_files(pair, issuing_ca: bytes, extra_ca: bytes | None) -> dict[str, bytes]:
    """A role's volume as the manifests project it: its Secret's key pair and issuing CA, the optional extra CA."""
    files = {"tls.crt": pair.cert.read_bytes(), "tls.key": pair.key.read_bytes(), "trust/ca.crt": issuing_ca}
    return files if extra_ca is None else {**files, "trust/extra.crt": extra_ca}


def test_a_ca_rotation_keeps_every_call_working_and_needs_no_restart(pki, tmp_path):
    server_volume, client_volume = SecretVolume(tmp_path / "server"), SecretVolume(tmp_path / "client")
    old_ca, new_ca = pki["old_ca"], pki["new_ca"]
    both = old_ca + new_ca  # the extra trust bundle (ConfigMap specdec-trust) while the rotation runs
    old_server, new_server = pki["old_server"], pki["new_server"]
    old_client, new_client = pki["old_client"], pki["new_client"]
    steps = [  # (step, the server's files, the client's files)
        ("trust both CAs", role_files(old_server, old_ca, both), role_files(old_client, old_ca, both)),
        ("renew the server's", role_files(new_server, new_ca, both), role_files(old_client, old_ca, both)),
        ("renew the client's", role_files(new_server, new_ca, both), role_files(new_client, new_ca, both)),
        ("drop the old CA", role_files(new_server, new_ca, None), role_files(new_client, new_ca, None)),
    ]
    server_volume.publish(role_files(old_server, old_ca, None))
    client_volume.publish(role_files(old_client, old_ca, None))
    server_settings = ServerTlsSettings(
        server_volume.path("tls.crt"), server_volume.path("tls.key"), server_volume.path("trust")
    )
    client = client_certificates(
        client_volume.path("trust"), client_volume.path("tls.crt"), client_volume.path("tls.key")
    )

    async def scenario():
        running = await start_server("127.0.0.1:0", lambda s: None, [], credentials=server_credentials(server_settings))
        address = f"127.0.0.1:{running.port}"
        pool = ReplicaPool("verify", [address], health_pb2_grpc.HealthStub, client.current)
        watch = asyncio.ensure_future(follow_replica_certificates(client, [pool], grace_s=5, interval_s=0.05))
        first_channel = pool.replicas[0].channel
        try:
            for step, server_files, client_files in [("before", None, None), *steps]:
                if server_files is not None:
                    server_volume.publish(server_files)
                    client_volume.publish(client_files)
                    reloads = client.reloads
                    for _ in range(100):  # the watch looks every 0.05 s
                        if client.reloads > reloads:
                            break
                        await asyncio.sleep(0.05)
                    assert client.reloads == reloads + 1, step
                for _ in range(3):  # calls through the pool's channel of the moment
                    reply = await pool.replicas[0].stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert reply.status == SERVING, step
            assert pool.replicas[0].channel is not first_channel
            # Only the new CA's certificates open connections now: the pool's new channels carry them.
            old_client = channel_credentials(
                str(tmp_path / "old-trust.pem"), str(pki["old_client"].cert), str(pki["old_client"].key)
            )
            async with grpc.aio.secure_channel(address, old_client) as stale:
                with pytest.raises(grpc.aio.AioRpcError):
                    await health_pb2_grpc.HealthStub(stale).Check(health_pb2.HealthCheckRequest(), timeout=5)
        finally:
            watch.cancel()
            await pool.close()
            await running.stop(0)

    (tmp_path / "old-trust.pem").write_bytes(old_ca + new_ca)  # even trusting both: its client certificate is old
    asyncio.run(scenario())
