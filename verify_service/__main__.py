"""Entry point: `python -m verify_service [--model DIR] [--address HOST:PORT] ...` (see --help)."""

from __future__ import annotations

import asyncio
import sys

from specdec.model_runtime import LoadedModel, ModelSettings
from specdec.serving import configure_logging, start_server, wait_for_termination
from specdec.settings import parse_settings
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from verify_service.servicer import VerifierServicer
from verify_service.service import VerifyService
from verify_service.settings import VerifySettings


async def serve(settings: VerifySettings) -> None:
    model = LoadedModel.load(ModelSettings(settings.model, settings.device, settings.dtype, settings.threads))
    servicer = VerifierServicer(VerifyService(settings, model))
    running = await start_server(settings.address, lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s),
                                 [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name])
    print(f"verify service listening on port {running.port}", flush=True)
    await wait_for_termination(running, settings.grace_s)


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(VerifySettings, argv, description="Verify service of the speculative-decoding stack.")
    configure_logging(settings.log_level)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main(sys.argv[1:])
