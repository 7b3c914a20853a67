"""Entry point: `python -m coordinator --draft-replicas A,B --verify-replicas C ...` (see --help)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections.abc import Callable

import grpc
from transformers import AutoTokenizer, GenerationConfig

from coordinator.background_tasks import BackgroundTasks
from coordinator.certificate_watch import follow_replica_certificates
from coordinator.network_delay import network_delay_interceptors
from coordinator.openai_api.app import start_front
from coordinator.openai_api.backends import InProcessBackend
from coordinator.openai_api.server import HttpServer
from coordinator.replica_discovery import ReplicaDiscovery
from coordinator.replica_targets import DnsResolver, ReplicaTargets
from coordinator.replicas import Replica, ReplicaPool
from coordinator.request_guard import RequestGuard
from coordinator.request_plan import MAX_RANKED_ALTERNATIVES
from coordinator.servicer import CoordinatorServicer
from coordinator.settings import CoordinatorSettings
from specdec.common.settings import parse_settings
from specdec.common.startup_objects import freeze_startup_objects
from specdec.engine.cpu_affinity import pin_cpus
from specdec.engine.gguf_checkpoint import resolve_model
from specdec.engine.model_runtime import VocabularyIdentity, check_same_vocabulary, tokenizer_sha256
from specdec.engine.simulated.tokenizer import tokenizer_source
from specdec.serving.event_loop import run_service
from specdec.serving.grpc_options import connection_age_options
from specdec.serving.server import RunningServer, configure_logging, start_server, wait_for_termination
from specdec.serving.tls import client_certificates, server_credentials, server_name_options
from specdec.telemetry import start_telemetry
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc, drafter_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger("coordinator")


def eos_token_ids(source: str, tokenizer) -> set[int]:
    """EOS ids from the generation config when there is one, plus the tokenizer's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        configured = GenerationConfig.from_pretrained(source).eos_token_id
    except OSError:
        configured = None
    ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return ids


def check_replica(identity: VocabularyIdentity, vocab_size: int, replica: Replica) -> None:
    """Refuses (ValueError) a replica whose vocabulary differs from the coordinator's tokenizer."""
    info = replica.info
    if not info.tokenizer_sha256:  # a model-free drafter: only the width must agree
        info_identity = VocabularyIdentity(replica.address, info.vocab_size, identity.tokenizer_sha256)
    else:
        info_identity = VocabularyIdentity(
            f"{info.model_id} at {replica.address}", info.vocab_size, info.tokenizer_sha256
        )
    check_same_vocabulary(VocabularyIdentity(identity.model_id, vocab_size, identity.tokenizer_sha256), info_identity)


def check_replicas(identity: VocabularyIdentity, draft_pool: ReplicaPool, verify_pool: ReplicaPool) -> int:
    """Refuses replicas whose vocabulary differs from the coordinator's tokenizer; returns the logits width."""
    vocab_size = verify_pool.replicas[0].info.vocab_size
    for replica in [*verify_pool.replicas, *draft_pool.replicas]:
        check_replica(identity, vocab_size, replica)
    return vocab_size


def joining_check(identity: VocabularyIdentity, vocab_size: int, max_context_tokens: int) -> Callable[[Replica], None]:
    """What a replica found later by discovery must pass: the same vocabulary, and room for the context the
    coordinator already promises its clients."""

    def check(replica: Replica) -> None:
        check_replica(identity, vocab_size, replica)
        if 0 < replica.info.max_context_tokens < max_context_tokens:
            raise ValueError(
                f"its context is {replica.info.max_context_tokens} tokens, the coordinator's {max_context_tokens}"
            )

    return check


async def build_servicer(
    settings: CoordinatorSettings, replica_credentials: grpc.ChannelCredentials | None
) -> tuple[CoordinatorServicer, list[ReplicaDiscovery]]:
    """The servicer on ready replicas, and the discovery of each pool named by dns:/// entries (not started).
    replica_credentials: TLS to the replicas (None: plaintext)."""
    if not 0 <= settings.predraft_guesses <= MAX_RANKED_ALTERNATIVES:
        raise ValueError(f"predraft_guesses must be in [0, {MAX_RANKED_ALTERNATIVES}], got {settings.predraft_guesses}")
    if settings.predraft_max_batch < 0:
        raise ValueError(f"predraft_max_batch must be >= 0, got {settings.predraft_max_batch}")
    tokenizer_dir = resolve_model(tokenizer_source(settings.tokenizer), settings.gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    security = dict(
        credentials=replica_credentials,
        options=server_name_options(settings.replica_tls_server_name),
        interceptors=network_delay_interceptors(settings.replica_network_delay_ms),
    )  # an injected delay, if asked for (measuring only)
    resolver = DnsResolver(settings.dns_nameserver)
    draft_targets = ReplicaTargets("draft", settings.draft_replicas, resolver)
    verify_targets = ReplicaTargets("verify", settings.verify_replicas, resolver)
    draft_pool = ReplicaPool("draft", await draft_targets.addresses(), drafter_pb2_grpc.DrafterStub, **security)
    verify_pool = ReplicaPool("verify", await verify_targets.addresses(), verifier_pb2_grpc.VerifierStub, **security)
    await asyncio.gather(
        draft_pool.wait_ready(settings.startup_timeout_s), verify_pool.wait_ready(settings.startup_timeout_s)
    )
    identity = VocabularyIdentity(settings.tokenizer, 0, tokenizer_sha256(tokenizer))
    vocab_size = check_replicas(identity, draft_pool, verify_pool)
    model_contexts = [
        r.info.max_context_tokens for r in [*draft_pool.replicas, *verify_pool.replicas] if r.info.max_context_tokens
    ]
    settings = dataclasses.replace(settings, max_context_tokens=min([settings.max_context_tokens, *model_contexts]))
    servicer = CoordinatorServicer(
        settings,
        tokenizer,
        eos_token_ids(tokenizer_dir, tokenizer),
        vocab_size,
        draft_pool,
        verify_pool,
        RequestGuard.from_settings(settings, [draft_pool, verify_pool]),
    )
    check = joining_check(identity, vocab_size, settings.max_context_tokens)
    discoveries = [
        ReplicaDiscovery(pool, targets, settings.discovery_refresh_s, settings.startup_timeout_s, check)
        for pool, targets in ((draft_pool, draft_targets), (verify_pool, verify_targets))
        if targets.dynamic and settings.discovery_refresh_s > 0
    ]
    return servicer, discoveries


def follow_verify_health(running: RunningServer, verify_pool: ReplicaPool) -> None:
    """The coordinator's readiness follows its verify replicas: NOT_SERVING while none is in placement (every
    request would fail), SERVING again once one is back; its liveness never does (unready, not dead: restarting
    it would not bring a verifier back). A draining coordinator stays NOT_SERVING."""
    updates = BackgroundTasks()

    async def update() -> None:
        if not running.stop_requested.is_set():
            serving = verify_pool.any_healthy
            await running.health.set_ready(serving)
            log.log(
                logging.INFO if serving else logging.WARNING,
                "readiness: %s (%d of %d verify replicas healthy)",
                "SERVING" if serving else "NOT_SERVING",
                sum(r.healthy for r in verify_pool.replicas),
                len(verify_pool.replicas),
            )

    verify_pool.on_health_change = lambda: updates.start(update())


async def start_http_front(servicer: CoordinatorServicer, settings: CoordinatorSettings) -> HttpServer:
    """The OpenAI-compatible HTTP API in this process, on the servicer itself: no hop between the two fronts."""
    http, config = await start_front(InProcessBackend(servicer), servicer.tokenizer, settings, settings.http_address)
    log.info("OpenAI-compatible HTTP API on port %d, model %r", http.port, config.model_names[0])
    return http


async def serve(settings: CoordinatorSettings) -> None:
    start_telemetry("coordinator", settings)
    credentials = server_credentials(settings)  # TLS on the client-facing port, if set (fails early on bad files)
    replica_tls = client_certificates(settings.replica_tls_ca, settings.replica_tls_cert, settings.replica_tls_key)
    servicer, discoveries = await build_servicer(settings, replica_tls.current)
    running = await start_server(
        settings.address,
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name],
        interceptors=servicer.guard.interceptors(),
        credentials=credentials,
        health_port=settings.health_port,
        options=connection_age_options(settings.max_connection_age_s, settings.max_connection_age_grace_s),
    )
    follow_verify_health(running, servicer.verify_pool)
    for discovery in discoveries:  # after the health hook, so replicas joining or leaving move the health too
        discovery.start()
    pools = [servicer.draft_pool, servicer.verify_pool]
    certificates = asyncio.ensure_future(follow_replica_certificates(replica_tls, pools, settings.call_timeout_s))
    http = await start_http_front(servicer, settings) if settings.http_address else None
    freeze_startup_objects()
    print(f"coordinator listening on port {running.port}{f', HTTP on port {http.port}' if http else ''}", flush=True)
    await wait_for_termination(running, settings.grace_s)
    certificates.cancel()
    if http is not None:
        await http.stop()
    await asyncio.gather(*(discovery.stop() for discovery in discoveries))
    await servicer.guard.close()


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(CoordinatorSettings, argv, description="Client-facing coordinator of the stack.")
    configure_logging(settings.log_level)
    pin_cpus(settings.cpus)
    run_service(serve(settings), settings.event_loop)


if __name__ == "__main__":
    main(sys.argv[1:])
