"""The HTTP front in a process of its own: `python -m specdec serve http --coordinator HOST:PORT` (see --help).

It calls the coordinator over gRPC, passing each request's `Authorization` header on as metadata and its deadline
with it; the coordinator checks the key. Serving the front inside the coordinator (`--http-address` there) saves
that hop (docs/architecture.md, "The HTTP front").
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass

import grpc
import uvloop
from transformers import AutoTokenizer

from coordinator.openai_api.app import start_front
from coordinator.openai_api.backends import GrpcBackend
from coordinator.openai_api.settings import HttpApiSettings
from specdec.common.settings import parse_settings, setting
from specdec.common.startup_objects import freeze_startup_objects
from specdec.engine.cpu_affinity import CpuAffinitySettings, pin_cpus
from specdec.engine.embedded_pair import DEMO_TARGET_DIR
from specdec.serving.grpc_options import channel_options
from specdec.serving.server import configure_logging
from specdec.serving.tls import channel_credentials

log = logging.getLogger("http_front")


@dataclass(frozen=True)
class FrontSettings(HttpApiSettings, CpuAffinitySettings):
    """Everything the HTTP front reads at start-up."""

    address: str = setting("[::]:8000", "host:port of the HTTP API (port 0 picks a free port)")
    coordinator: str = setting("localhost:50051", "address of the coordinator's gRPC API")
    coordinator_tls_ca: str = setting("", "PEM CA of the coordinator's certificate: turns TLS on towards it")
    tokenizer: str = setting(str(DEMO_TARGET_DIR), "tokenizer directory or hub id (the target's, as the coordinator's)")
    tls_cert: str = setting("", "PEM certificate chain of the HTTP port; with tls_key turns TLS on")
    tls_key: str = setting("", "PEM private key of tls_cert")
    tls_client_ca: str = setting("", "PEM CA bundle: every client must present a certificate it signed (mutual TLS)")
    startup_timeout_s: float = setting(300.0, "how long to wait for the coordinator to come up")
    grace_s: float = setting(10.0, "seconds in-flight requests get to finish after SIGTERM")
    log_level: str = setting("INFO", "logging level")


async def serve(settings: FrontSettings) -> None:
    credentials = channel_credentials(settings.coordinator_tls_ca, prefix="coordinator_tls")
    channel = (
        grpc.aio.secure_channel(settings.coordinator, credentials, options=channel_options())
        if credentials
        else grpc.aio.insecure_channel(settings.coordinator, options=channel_options())
    )
    await asyncio.wait_for(channel.channel_ready(), settings.startup_timeout_s)
    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer)
    http, config = await start_front(GrpcBackend(channel), tokenizer, settings, settings.address)
    log.info("OpenAI-compatible HTTP API for %s, model %r", settings.coordinator, config.model_names[0])
    freeze_startup_objects()
    print(f"http front listening on port {http.port}", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    await http.stop()
    await channel.close()


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(FrontSettings, argv, description="OpenAI-compatible HTTP front of a coordinator.")
    configure_logging(settings.log_level)
    pin_cpus(settings.cpus)
    uvloop.run(serve(settings))


if __name__ == "__main__":
    main(sys.argv[1:])
