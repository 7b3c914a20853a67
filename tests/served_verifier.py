"""A VerifierServicer served in-process on a free loopback port, for tests that call it over gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from specdec.serving.server import start_server
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from verify_service.servicer import VerifierServicer


@asynccontextmanager
async def served(servicer: VerifierServicer) -> AsyncIterator[verifier_pb2_grpc.VerifierStub]:
    """Serves `servicer` for the block and yields a stub on a channel to it; then stops both."""
    running = await start_server(
        "127.0.0.1:0",
        lambda server: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server),
        [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name],
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield verifier_pb2_grpc.VerifierStub(channel)
    finally:
        await running.stop(0)
        servicer.close()
