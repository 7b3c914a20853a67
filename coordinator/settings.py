"""Settings of the coordinator (flags `--name`, env `SPECDEC_NAME`)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.embedded_pair import DEMO_TARGET_DIR
from specdec.settings import setting


@dataclass(frozen=True)
class CoordinatorSettings:
    """Everything the coordinator reads at start-up."""

    address: str = setting("[::]:50051", "host:port of the client-facing gRPC API (port 0 picks a free port)")
    draft_replicas: tuple[str, ...] = setting(("localhost:50061",), "draft service addresses, comma-separated; "
                                              "dns:///NAME:PORT expands to every address NAME resolves to")
    verify_replicas: tuple[str, ...] = setting(("localhost:50062",), "verify service addresses (same forms)")
    tokenizer: str = setting(str(DEMO_TARGET_DIR), "tokenizer directory or hub id (the target's)")
    default_num_speculative_tokens: int = setting(4, "γ for requests that do not set num_speculative_tokens")
    max_num_speculative_tokens: int = setting(16, "largest γ a request may ask for")
    max_new_tokens_limit: int = setting(1024, "largest max_new_tokens a request may ask for")
    max_context_tokens: int = setting(1024, "longest prompt + completion (at most the models' context)")
    overlap: bool = setting(True, "pipeline rounds: draft block k+1 while block k is verified")
    call_timeout_s: float = setting(30.0, "deadline of each internal call")
    startup_timeout_s: float = setting(300.0, "how long to wait for the replicas to come up")
    grace_s: float = setting(10.0, "seconds in-flight requests get to finish after SIGTERM")
    metrics_port: int = setting(0, "port for Prometheus /metrics (0 = off)")
    trace_exporter: str = setting("none", "where spans go: none, console, otlp (OTEL_EXPORTER_OTLP_* variables), "
                                          "jsonl:PATH, memory; comma-separated")
    trace_sample_ratio: float = setting(1.0, "share of new traces recorded (parent-based: callers' choice wins)")
    log_level: str = setting("INFO", "logging level")
