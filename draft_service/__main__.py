"""Entry point: `python -m draft_service [--model DIR] [--address HOST:PORT] ...` (see --help)."""

from __future__ import annotations

import asyncio
import logging
import sys

from draft_service.service import DraftService
from draft_service.servicer import DrafterServicer
from draft_service.settings import DraftSettings
from specdec.common.settings import parse_settings
from specdec.common.startup_objects import freeze_startup_objects
from specdec.engine.cpu_affinity import pin_cpus
from specdec.engine.model_loading import load_model
from specdec.engine.model_process import ModelProcess, serving_model
from specdec.serving.event_loop import run_service
from specdec.serving.server import configure_logging, start_server, wait_for_termination
from specdec.serving.tls import server_credentials
from specdec.telemetry import start_telemetry
from specdec.telemetry.metrics import observe_batch, observe_queue_wait, session_queue_metrics
from specdec.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("draft_service")


def build_service(settings: DraftSettings) -> DraftService:
    """Loads the draft model (if any) and wraps it in a DraftService."""
    if settings.model:
        model = serving_model(load_model(settings, "draft"), settings)
        return DraftService(settings, model, model.vocab_size)
    if settings.vocab_size <= 0:
        raise SystemExit("a model-free draft service needs --vocab-size (the target's vocabulary size)")
    return DraftService(settings, None, settings.vocab_size)


async def serve(settings: DraftSettings) -> None:
    service = build_service(settings)
    model = service.model
    start_telemetry("draft", settings, service.sessions, model.kv_pool.blocks if model and model.packed else None)
    servicer = DrafterServicer(service, observe_batch, observe_queue_wait)
    if servicer.admission is not None:
        session_queue_metrics().watch(servicer.admission)
    expiry = asyncio.ensure_future(servicer.expire_idle_sessions())
    try:
        running = await start_server(
            settings.address,
            lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s),
            [drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name],
            credentials=server_credentials(settings),
            health_port=settings.health_port,
        )
        if isinstance(model, ModelProcess):  # gone: its passes fail UNAVAILABLE, health NOT_SERVING for good
            model.on_exit(lambda code: running.end_health_from_thread(f"the model process exited ({code})"))
        freeze_startup_objects()
        print(f"draft service listening on port {running.port}", flush=True)
        await wait_for_termination(running, settings.grace_s, servicer.drain)
    finally:
        expiry.cancel()
        servicer.close()
        if isinstance(model, ModelProcess):
            model.close()


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(DraftSettings, argv, description="Draft service of the speculative-decoding stack.")
    configure_logging(settings.log_level)
    pin_cpus(settings.cpus)
    run_service(serve(settings), settings.event_loop)


if __name__ == "__main__":
    main(sys.argv[1:])
