"""TLS for every gRPC port and mutual TLS between services, from settings (PEM files).

A server turns TLS on when it has a certificate and key (`--tls-cert`, `--tls-key`); with `--tls-client-ca`
it also requires each client to present a certificate that CA signed (mutual TLS); `--health-port` adds a
plaintext port that answers health checks only (specdec/serving/server.py). The coordinator's
channels to the draft and verify replicas use `--replica-tls-ca` (and `--replica-tls-cert/-key` for mTLS).
A CA setting names a PEM file or a directory of them (all trusted). Servers reload their files when they change,
clients through `client_certificates` (specdec/serving/certificate_reload.py).
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from specdec.common.settings import setting
from specdec.serving.certificate_reload import CA_FILE_SUFFIXES, ReloadingTlsFiles, ca_files, check_key_pair


@dataclass(frozen=True)
class ServerTlsSettings:
    """The TLS part of a service's settings (a base of each service's settings class)."""

    tls_cert: str = setting("", "PEM certificate chain this server presents; with tls_key turns TLS on for its port")
    tls_key: str = setting("", "PEM private key of tls_cert")
    tls_client_ca: str = setting(
        "",
        "PEM CA bundle, or a directory of them: when set, every client must present a certificate signed by "
        "one of them (mutual TLS); needs tls_cert and tls_key",
    )
    health_port: int = setting(
        0,
        "port of a plaintext server that answers grpc.health.v1 and nothing else, for probes that cannot "
        "speak TLS (kubelet's gRPC probes); 0 = off",
    )


def read_pem(path: str, setting_name: str) -> bytes:
    """The bytes of a PEM file named by a setting (a CA directory: its files, one after the other), or ValueError
    naming the setting."""
    files = ca_files(path)
    if not files:
        raise ValueError(f"{setting_name}: the directory {path!r} holds no {' or '.join(CA_FILE_SUFFIXES)} file")
    try:
        data = b"\n".join(pathlib.Path(file).read_bytes() for file in files)
    except OSError as error:
        raise ValueError(f"{setting_name}: cannot read {path!r}: {error.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{setting_name}: {path!r} holds no PEM block")
    return data


def server_certificates(settings: ServerTlsSettings) -> ReloadingTlsFiles[grpc.ServerCertificateConfiguration]:
    """The server's certificate, key and client CA, read again whenever they change."""

    def load() -> grpc.ServerCertificateConfiguration:
        pair = (read_pem(settings.tls_key, "tls_key"), read_pem(settings.tls_cert, "tls_cert"))
        check_key_pair(settings.tls_cert, settings.tls_key, "tls")
        client_ca = read_pem(settings.tls_client_ca, "tls_client_ca") if settings.tls_client_ca else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=client_ca)

    return ReloadingTlsFiles("server TLS", [settings.tls_cert, settings.tls_key, settings.tls_client_ca], load)


def server_credentials(settings: ServerTlsSettings) -> grpc.ServerCredentials | None:
    """Credentials for `start_server`: None (plaintext) when no certificate is configured; otherwise they take
    changed files on the next handshake, so a renewed certificate needs no restart."""
    if not settings.tls_cert and not settings.tls_key:
        if settings.tls_client_ca:
            raise ValueError("tls_client_ca: mutual TLS needs tls_cert and tls_key too")
        return None
    if not (settings.tls_cert and settings.tls_key):
        raise ValueError("tls_cert and tls_key: give both or neither")
    files = server_certificates(settings)
    return grpc.dynamic_ssl_server_credentials(
        files.current, files.renewed, require_client_authentication=bool(settings.tls_client_ca)
    )


def channel_credentials(
    ca: str = "", cert: str = "", key: str = "", prefix: str = "replica_tls"
) -> grpc.ChannelCredentials | None:
    """Client credentials from PEM paths: None (plaintext) without a CA; cert + key add a client certificate."""
    if not ca:
        if cert or key:
            raise ValueError(f"{prefix}_cert/{prefix}_key: a client certificate needs {prefix}_ca as well")
        return None
    if bool(cert) != bool(key):
        raise ValueError(f"{prefix}_cert and {prefix}_key: give both or neither")
    if cert:
        check_key_pair(cert, key, prefix)
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, f"{prefix}_ca"),
        private_key=read_pem(key, f"{prefix}_key") if key else None,
        certificate_chain=read_pem(cert, f"{prefix}_cert") if cert else None,
    )


def client_certificates(
    ca: str = "", cert: str = "", key: str = "", prefix: str = "replica_tls"
) -> ReloadingTlsFiles[grpc.ChannelCredentials | None]:
    """`channel_credentials`, made anew when the files change (see coordinator/replicas.py, renew_channels)."""
    load = functools.partial(channel_credentials, ca, cert, key, prefix)
    return ReloadingTlsFiles(f"{prefix} client TLS", [ca, cert, key], load)


def server_name_options(server_name: str) -> list[tuple[str, str]]:
    """Channel options that check the server's certificate against `server_name` instead of the address
    (needed when an address is an IP, e.g. after dns:/// expansion to pod IPs)."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def open_aio_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, object]],
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel: TLS with `credentials`, plaintext without."""
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
