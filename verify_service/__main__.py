"""Entry point: `python -m verify_service [--model DIR] [--address HOST:PORT] ...` (see --help).

`--tensor-parallel-size N` (N > 1) shards the target over N ranks: this process is rank 0 and serves gRPC,
`--tp-launcher local|ray` starts the others (verify_service/tensor_parallel.py, rank_launchers.py).
"""

from __future__ import annotations

import asyncio
import sys

from specdec.common.settings import parse_settings
from specdec.common.startup_objects import freeze_startup_objects
from specdec.engine.cpu_affinity import pin_cpus
from specdec.engine.model_loading import load_model
from specdec.engine.model_process import ModelProcess, serving_model
from specdec.serving.event_loop import run_service
from specdec.serving.server import RunningServer, configure_logging, start_server, wait_for_termination
from specdec.serving.tls import server_credentials
from specdec.telemetry import start_telemetry
from specdec.telemetry.metrics import (
    observe_batch,
    observe_preemption,
    observe_queue_wait,
    observe_verify_pass,
    session_queue_metrics,
)
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from verify_service.service import VerifyService
from verify_service.servicer import VerifierServicer
from verify_service.settings import VerifySettings
from verify_service.tensor_parallel import TensorParallelLeader


async def serve(settings: VerifySettings) -> None:
    ranks = None
    if settings.tensor_parallel_size > 1:
        from verify_service.rank_launchers import make_launcher

        ranks = TensorParallelLeader.start(settings, make_launcher(settings))
        model = ranks.model
    else:
        model = serving_model(load_model(settings, "target"), settings)
    servicer = VerifierServicer(
        VerifyService(settings, model, ranks, observe_verify_pass, observe_preemption),
        settings.tensor_parallel_size,
        observe_batch,
        observe_queue_wait,
    )
    start_telemetry("verify", settings, servicer.service.sessions, model.kv_pool.blocks if model.packed else None)
    if servicer.admission is not None:
        session_queue_metrics().watch(servicer.admission)
    expiry = asyncio.ensure_future(servicer.expire_idle_sessions())
    try:
        running = await start_server(
            settings.address,
            lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s),
            [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name],
            credentials=server_credentials(settings),
            health_port=settings.health_port,
        )
        if ranks is not None:
            ranks.on_failure(
                lambda reason: asyncio.run_coroutine_threadsafe(_stop_serving(running, servicer, reason), running.loop)
            )
        if isinstance(model, ModelProcess):  # gone: its passes fail UNAVAILABLE, health NOT_SERVING for good
            model.on_exit(lambda code: running.end_health_from_thread(f"the model process exited ({code})"))
        freeze_startup_objects()
        print(f"verify service listening on port {running.port}", flush=True)
        await wait_for_termination(running, settings.grace_s, servicer.drain)
    finally:
        expiry.cancel()
        servicer.close()
        if ranks is not None:
            ranks.close()
        if isinstance(model, ModelProcess):
            model.close()


async def _stop_serving(running: RunningServer, servicer: VerifierServicer, reason: str) -> None:
    """A rank failed: calls in flight fail UNAVAILABLE, health NOT_SERVING for good, liveness included (the process
    stays up to say so; a restart starts the group anew)."""
    servicer.ranks_failed()
    await running.health.end(f"tensor parallelism failed: {reason}")


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(VerifySettings, argv, description="Verify service of the speculative-decoding stack.")
    configure_logging(settings.log_level)
    pin_cpus(settings.cpus)
    run_service(serve(settings), settings.event_loop)


if __name__ == "__main__":
    main(sys.argv[1:])
