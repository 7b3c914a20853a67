"""Prometheus metrics (prefix `specdec_`), grouped by who records them, and the /metrics endpoint.

Every service: `RpcMetrics` (recorded by the server interceptor) and, on the draft and verify services,
`session_gauges`, `kv_block_gauges` (specdec_kv_blocks{state="used"|"free"|"shared"}) and `SessionQueueMetrics`
(specdec_queued_sessions{kind="new"|"resume"}, specdec_queue_wait_seconds{kind}, specdec_preemptions_total: the
queue for KV blocks and the sessions preempted); on the verify service `VerifyPassMetrics`: each scoring pass's
time, with or without a prefill in it (specdec_verify_pass_duration_seconds{prefill="with"|"without"}), and the
prompt tokens it prefilled and the tokens it scored (specdec_verify_pass_tokens_total{kind="prefill"|"scored"}).
The coordinator: `SpeculationMetrics`, fed from the same numbers as the per-request GenerationStats, so
summing the responses' stats gives the counters:

  stats field                 metric
  rounds                      specdec_rounds_total  (= specdec_tokens_per_round_count)
  drafted_tokens              specdec_drafted_tokens_total
  accepted_tokens             specdec_accepted_tokens_total
  drafted_per_position[i]     specdec_drafted_tokens_by_position_total{position="i"}
  accepted_per_position[i]    specdec_accepted_tokens_by_position_total{position="i"}
  accepted + rounds           specdec_tokens_per_round_sum  (mean accepted length = _sum / _count)
  predraft_attempts / _hits   specdec_predraft_attempts_total / specdec_predraft_hits_total
  chained_rounds              specdec_chained_rounds_total
  (coordinator-wide)          specdec_round_slowdown{kind,load}: realized / predicted round time
  (coordinator-wide)          specdec_speculation_gate_tokens_per_second{load,way}: measured per way
  draft_ns, verify_ns, sampling_ns, wire_ns, prefill_ns
                              specdec_stage_duration_seconds_sum{stage="draft"|"verify"|"sampling"|"wire"|"prefill"}
  prompt_tokens               specdec_prompt_tokens_total
  verify/draft_session_moves  specdec_session_moves_total{kind="verify"|"draft", reason}
  len(token_ids) returned     specdec_generated_tokens_total
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specdec.engine.kv.admission import KVAdmission
from specdec.engine.kv.blocks import BlockAllocator

log = logging.getLogger(__name__)

PREFIX = "specdec_"
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RPC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKENS_PER_ROUND_BUCKETS = tuple(float(n) for n in range(1, 18))


class RpcMetrics:
    """RPCs served by any service, by full method name (/package.Service/Method) and status code name."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            PREFIX + "grpc_server_requests",
            "RPCs handled, by method and status code",
            ["grpc_method", "grpc_code"],
            registry=registry,
        )
        self.errors = Counter(
            PREFIX + "grpc_server_errors",
            "RPCs that ended with a status other than OK",
            ["grpc_method", "grpc_code"],
            registry=registry,
        )
        self.handling_seconds = Histogram(
            PREFIX + "grpc_server_handling_seconds",
            "Time to handle one RPC",
            ["grpc_method"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(method, code).inc()
        if code != "OK":
            self.errors.labels(method, code).inc()
        self.handling_seconds.labels(method).observe(seconds)


class SpeculationMetrics:
    """What the coordinator sees of speculation and latency (see the module docstring for the stats mapping)."""

    def __init__(self, registry: CollectorRegistry):
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests started")
        self.generated_tokens = counter("generated_tokens", "Tokens returned to clients")
        self.rounds = counter("rounds", "Draft+verify rounds (plain decoding steps count as rounds drafting 0)")
        self.drafted_tokens = counter("drafted_tokens", "Tokens drafted")
        self.accepted_tokens = counter("accepted_tokens", "Drafted tokens the verifier accepted")
        self.drafted_by_position = counter(
            "drafted_tokens_by_position", "Rounds that drafted position i (0 = the first drafted token)", ("position",)
        )
        self.accepted_by_position = counter(
            "accepted_tokens_by_position", "Rounds whose drafted token at position i was accepted", ("position",)
        )
        self.predraft_attempts = counter("predraft_attempts", "Blocks drafted while the previous one was verified")
        self.predraft_hits = counter("predraft_hits", "Pre-drafted blocks that matched the verdict")
        self.chained_rounds = counter(
            "chained_rounds",
            "Rounds the verifier ran straight after the previous verdict (VerifyNext), without a round trip",
        )
        self.finished = counter("requests_finished", "Generations that ended, by finish reason", ("finish_reason",))
        self.session_moves = counter(
            "session_moves",
            "Sessions moved to another replica with the committed tokens, by kind (verify, draft) and reason "
            "(unavailable, lost_session, draining, failed)",
            ("kind", "reason"),
        )
        self.tokens_per_round = Histogram(
            PREFIX + "tokens_per_round",
            "Tokens committed per round (accepted + recovered/bonus); _sum/_count is the mean accepted length",
            buckets=TOKENS_PER_ROUND_BUCKETS,
            registry=registry,
        )
        self.stage_seconds = Histogram(
            PREFIX + "stage_duration_seconds",
            "Time per stage and call: draft (drafter's Propose), verify (target forward), "
            "sampling (rejection sampler), wire (internal round trips minus the "
            "service time), prefill (opening both sessions)",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From receiving a request to handing its first token to gRPC",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time per token after the first chunk: each later chunk's gap to the previous one, divided over its tokens",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.active_requests = Gauge(PREFIX + "active_requests", "Generations running now", registry=registry)
        self.gate_throughput = Gauge(
            PREFIX + "speculation_gate_tokens_per_second",
            "Committed tokens/s (all requests) the speculation gate measured, by load "
            "(log2 of active generations) and way (speculative, plain): the faster way is "
            "the one kept there",
            ["load", "way"],
            registry=registry,
        )
        self.round_slowdown = Gauge(
            PREFIX + "round_slowdown",
            "Realized over predicted round time, by kind "
            "(speculative, plain) and load (log2 of sessions per verify pass); scales the "
            "γ policy's predictions",
            ["kind", "load"],
            registry=registry,
        )

    def round_committed(self, drafted: int, accepted: int) -> None:
        """One round that drafted `drafted` tokens and accepted the first `accepted` (as SpeculationStats.record)."""
        self.rounds.inc()
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        for position in range(drafted):
            self.drafted_by_position.labels(str(position)).inc()
            if position < accepted:
                self.accepted_by_position.labels(str(position)).inc()
        self.tokens_per_round.observe(accepted + 1)

    def stage_ns(self, **stage_ns: int) -> None:
        """Observes stage durations given in ns, keyed by stage name."""
        for stage, ns in stage_ns.items():
            self.stage_seconds.labels(stage).observe(ns / 1e9)


@functools.cache
def rpc_metrics(registry: CollectorRegistry = REGISTRY) -> RpcMetrics:
    """The RPC metrics of `registry`, registered on first use."""
    return RpcMetrics(registry)


@functools.cache
def speculation_metrics(registry: CollectorRegistry = REGISTRY) -> SpeculationMetrics:
    """The coordinator's metrics in `registry`, registered on first use."""
    return SpeculationMetrics(registry)


def session_gauges(
    active_sessions: Callable[[], int], kv_cache_tokens: Callable[[], int], registry: CollectorRegistry = REGISTRY
) -> None:
    """Gauges read at scrape time: sessions open on this replica and the tokens their KV caches hold."""
    Gauge(PREFIX + "active_sessions", "Sessions open on this replica", registry=registry).set_function(active_sessions)
    Gauge(
        PREFIX + "kv_cache_tokens", "Tokens held in KV caches over all open sessions", registry=registry
    ).set_function(kv_cache_tokens)


def kv_block_gauges(blocks: BlockAllocator, registry: CollectorRegistry = REGISTRY) -> None:
    """Gauges read at scrape time: the paged KV cache's blocks held by sessions, free, and shared between
    sequences (specdec/engine/kv/blocks.py)."""
    gauge = Gauge(PREFIX + "kv_blocks", "KV cache blocks by state: used, free, shared", ["state"], registry=registry)
    gauge.labels("used").set_function(lambda: blocks.used)
    gauge.labels("free").set_function(lambda: blocks.free)
    gauge.labels("shared").set_function(lambda: blocks.shared)


@functools.cache
def batch_size_histogram(registry: CollectorRegistry = REGISTRY) -> Histogram:
    """Calls run together per model step on a replica, by kind (open, verify, propose)."""
    return Histogram(
        PREFIX + "batch_size",
        "Calls batched into one model step",
        ["kind"],
        buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        registry=registry,
    )


def observe_batch(kind: str, calls: int) -> None:
    """Records one model step of `calls` batched calls (a StepBatcher on_step hook)."""
    batch_size_histogram().labels(kind).observe(calls)


class VerifyPassMetrics:
    """What each scoring pass of a verify replica cost and fed: a pass that carries a new request's prefill
    holds up every session batched with it, which these show apart from the passes without one."""

    def __init__(self, registry: CollectorRegistry):
        self.duration = Histogram(
            PREFIX + "verify_pass_duration_seconds",
            "Time of one scoring pass, by whether it carried a prefill",
            ["prefill"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.tokens = Counter(
            PREFIX + "verify_pass_tokens",
            "Tokens fed to scoring passes: prompt tokens prefilled, and tokens scored for rounds (γ + 1 each)",
            ["kind"],
            registry=registry,
        )

    def observe(self, ns: int, prefill_tokens: int, scored_tokens: int) -> None:
        """One pass of `ns` that prefilled prefill_tokens prompt tokens and scored scored_tokens."""
        self.duration.labels("with" if prefill_tokens else "without").observe(ns / 1e9)
        self.tokens.labels("prefill").inc(prefill_tokens)
        self.tokens.labels("scored").inc(scored_tokens)


@functools.cache
def verify_pass_metrics(registry: CollectorRegistry = REGISTRY) -> VerifyPassMetrics:
    """The verify pass metrics of `registry`, registered on first use."""
    return VerifyPassMetrics(registry)


def observe_verify_pass(ns: int, prefill_tokens: int, scored_tokens: int) -> None:
    """Records one scoring pass of this verify replica (a VerifyService on_pass hook)."""
    verify_pass_metrics().observe(ns, prefill_tokens, scored_tokens)


class SessionQueueMetrics:
    """A model service's queue for KV blocks (specdec/engine/kv/admission.py) and its preemptions
    (specdec/engine/kv/preemption.py): sessions waiting now, how long each waited, sessions preempted."""

    def __init__(self, registry: CollectorRegistry):
        self.queued = Gauge(
            PREFIX + "queued_sessions",
            "Sessions waiting for free KV blocks, by kind: new ones, and preempted ones waiting to resume",
            ["kind"],
            registry=registry,
        )
        self.wait = Histogram(
            PREFIX + "queue_wait_seconds",
            "Time a session waited for free KV blocks before its call ran, by kind (new, resume)",
            ["kind"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.preemptions = Counter(
            PREFIX + "preemptions", "Sessions preempted (KV blocks freed, recomputed later)", registry=registry
        )

    def watch(self, admission: KVAdmission) -> None:
        """Reads the queue's lengths at scrape time."""
        self.queued.labels("new").set_function(lambda: admission.queued(resuming=False))
        self.queued.labels("resume").set_function(lambda: admission.queued(resuming=True))


@functools.cache
def session_queue_metrics(registry: CollectorRegistry = REGISTRY) -> SessionQueueMetrics:
    """The KV queue metrics of `registry`, registered on first use."""
    return SessionQueueMetrics(registry)


def observe_queue_wait(seconds: float, resuming: bool) -> None:
    """Records one admission's wait (a KVAdmission on_wait hook)."""
    session_queue_metrics().wait.labels("resume" if resuming else "new").observe(seconds)


def observe_preemption() -> None:
    """Counts one preempted session (a Preemptions on_preempt hook)."""
    session_queue_metrics().preemptions.inc()


def serve_metrics(port: int, registry: CollectorRegistry = REGISTRY) -> None:
    """Serves /metrics on port (all interfaces) from a background thread; 0 does nothing."""
    if port:
        start_http_server(port, registry=registry)
        log.info("Prometheus metrics on port %d", port)
