"""One request's spans and metrics on the coordinator.

Trace shape (parents first; lanes in brackets, set by `specdec.lane` where the time was spent elsewhere):
  Coordinator/Generate (server span)  > generate
    open_sessions > verify.open_session > verify.prefill [verify]
    open_draft_session > draft.open_session > draft.prefill [draft]   (after the first token)
    round (one per committed round; `specdec.round` = 1, 2, ...)
      draft.propose > draft.forward [draft], wire          (and the Drafter's own server span)
      verify        > verify.forward, verify.sampling [verify], wire   (and the Verifier's server span)
      verify_next   (chained mode: the next round's candidates, sent once pre-drafted; the Verifier's server span)
      commit
    close_sessions > draft.close_session, verify.close_session
In overlapped mode a round's `draft.propose` with `specdec.predraft` drafts the next round's block while
this round's `verify` runs; a `verify` with `specdec.chained` is a round handed to the verifier before the
previous verdict was known (the previous round's `verify_next`), so its span covers only the wait after that
verdict. The service-side
stages are laid out from the durations the services return (draft_ns, forward_ns, sampling_ns, prefill_ns): inside
the call, after half of its wire time, or ending with the call where they took longer than it (a chained round's
pass may start before the coordinator waits for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from specdec.telemetry.metrics import SpeculationMetrics, speculation_metrics
from specdec.telemetry.tracing import LANE_ATTRIBUTE, TRACER_NAME


@dataclass
class RemoteCall:
    """One internal call: its span, when it ran, and the stages the service says it spent inside."""

    span: Span
    started_ns: int  # perf_counter_ns
    started_wall_ns: int  # time_ns, for span timestamps
    ended_ns: int = 0
    served: list[tuple[str, str, int]] = field(default_factory=list)  # (span name, lane, ns)

    def inside(self, name: str, lane: str, ns: int) -> None:
        """Records a stage the service spent `ns` on (in order), shown in `lane`."""
        self.served.append((name, lane, ns))

    @property
    def wire_ns(self) -> int:
        """Round-trip time not spent inside the service (never negative)."""
        return max(0, self.ended_ns - self.started_ns - sum(ns for _, _, ns in self.served))


@contextlib.contextmanager
def _ending(span: Span, end_time: Callable[[], int | None] = lambda: None) -> Iterator[Span]:
    """Ends `span` on exit; an exception marks it as an error, a cancellation only as `specdec.cancelled`."""
    try:
        yield span
    except (asyncio.CancelledError, GeneratorExit):
        span.set_attribute("specdec.cancelled", True)
        raise
    except BaseException as error:
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        if isinstance(error, Exception):
            span.record_exception(error)
        raise
    finally:
        span.end(end_time=end_time())


class RequestTelemetry:
    """Spans and metrics of one generation; created when the request arrives (the clock for TTFT starts)."""

    def __init__(self, metrics: SpeculationMetrics | None = None, tracer: trace.Tracer | None = None):
        self.metrics = metrics or speculation_metrics()
        self.tracer = tracer or trace.get_tracer(TRACER_NAME)
        self.started_ns = time.perf_counter_ns()
        self.started_wall_ns = time.time_ns()
        self.context = otel_context.get_current()  # the RPC's server span; the request span once begun
        self.request_span: Span | None = None
        self.rounds = 0
        self._last_chunk_ns: int | None = None

    @contextlib.contextmanager
    def request(self, request_id: str, prompt_tokens: int, gamma: int, overlap: bool) -> Iterator[None]:
        """The request span, from the request's arrival until its sessions are closed."""
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.active_requests.inc()
        span = self.tracer.start_span(
            "generate",
            context=self.context,
            start_time=self.started_wall_ns,
            attributes={
                "specdec.request_id": request_id,
                "specdec.prompt_tokens": prompt_tokens,
                "specdec.num_speculative_tokens": gamma,
                "specdec.overlap": overlap,
            },
        )
        self.request_span, self.context = span, trace.set_span_in_context(span, self.context)
        try:
            with _ending(span):
                yield
        finally:
            self.metrics.active_requests.dec()

    def finished(self, finish_reason: str, **summary: int | float) -> None:
        """The generation ended: counts it by finish reason and notes the summary on the request span."""
        self.metrics.finished.labels(finish_reason).inc()
        if self.request_span is not None:
            self.request_span.set_attributes(
                {"specdec.finish_reason": finish_reason, **{f"specdec.{k}": v for k, v in summary.items()}}
            )

    @contextlib.contextmanager
    def stage(
        self, name: str, parent: otel_context.Context | None = None, **attributes
    ) -> Iterator[otel_context.Context]:
        """A coordinator span under `parent` (default: the request span); yields its context for children."""
        span = self.tracer.start_span(
            name, context=parent or self.context, attributes={f"specdec.{k}": v for k, v in attributes.items()} or None
        )
        with _ending(span):
            yield trace.set_span_in_context(span)

    def round(self) -> contextlib.AbstractContextManager[otel_context.Context]:
        """The span of the next round (`specdec.round` counts from 1)."""
        self.rounds += 1
        return self.stage("round", round=self.rounds)

    @contextlib.contextmanager
    def remote_call(self, name: str, parent: otel_context.Context, **attributes) -> Iterator[RemoteCall]:
        """A CLIENT span around one internal call, current while the call runs so its context is sent along.

        On exit the stages recorded with `call.inside(...)` and the wire time become child spans.
        """
        started_ns, started_wall = time.perf_counter_ns(), time.time_ns()
        span = self.tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.CLIENT,
            start_time=started_wall,
            attributes={f"specdec.{k}": v for k, v in attributes.items()} or None,
        )
        call = RemoteCall(span, started_ns, started_wall)
        with _ending(span, lambda: started_wall + (call.ended_ns - started_ns)):
            try:
                with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                    yield call
            finally:
                call.ended_ns = time.perf_counter_ns()
            self._served_spans(call, started_wall + (call.ended_ns - started_ns))

    def _served_spans(self, call: RemoteCall, end_wall: int) -> None:
        """The service's stages centred in the call, the wire time on either side."""
        wire = call.wire_ns
        call.span.set_attribute("specdec.wire_ns", wire)
        if not call.served:
            return
        context = trace.set_span_in_context(call.span)
        served_ns = sum(ns for _, _, ns in call.served)
        at = min(call.started_wall_ns + wire // 2, end_wall - served_ns)  # the service may have started earlier
        self._timed_span("wire", context, call.started_wall_ns, at, {"specdec.direction": "request"})
        for name, lane, ns in call.served:
            self._timed_span(name, context, at, at + ns, {LANE_ATTRIBUTE: lane})
            at += ns
        self._timed_span("wire", context, at, max(at, end_wall), {"specdec.direction": "response"})

    def _timed_span(self, name: str, context: otel_context.Context, start: int, end: int, attributes: dict) -> None:
        self.tracer.start_span(name, context=context, start_time=start, attributes=attributes).end(end_time=end)

    def emitted(self, tokens: int) -> None:
        """A chunk of `tokens` tokens goes to the client: time to first token, inter-token latency."""
        if not tokens:
            return
        now = time.perf_counter_ns()
        self.metrics.generated_tokens.inc(tokens)
        if self._last_chunk_ns is None:
            self.metrics.time_to_first_token.observe((now - self.started_ns) / 1e9)
        else:
            per_token = (now - self._last_chunk_ns) / 1e9 / tokens
            for _ in range(tokens):
                self.metrics.inter_token_latency.observe(per_token)
        self._last_chunk_ns = now
