"""Settings of the verify service (flags `--name`, env `SPECDEC_NAME`)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.embedded_pair import DEMO_TARGET_DIR
from specdec.settings import setting


@dataclass(frozen=True)
class VerifySettings:
    """Everything the verify service reads at start-up."""

    address: str = setting("[::]:50062", "host:port to serve gRPC on (port 0 picks a free port)")
    model: str = setting(str(DEMO_TARGET_DIR), "target model directory or hub id")
    device: str = setting("cpu", "device for the target model: cpu or cuda:N (rank r uses cuda:r under TP)")
    dtype: str = setting("float32", "weight dtype: float32, bfloat16 or float16")
    threads: int = setting(1, "CPU threads per rank (0 = torch default)")
    max_sessions: int = setting(256, "most sessions held at once; more are refused with RESOURCE_EXHAUSTED")
    max_speculative_tokens: int = setting(16, "largest number of draft tokens one Verify may carry")
    grace_s: float = setting(10.0, "seconds in-flight calls get to finish after SIGTERM")
    metrics_port: int = setting(0, "port for Prometheus /metrics (0 = off)")
    log_level: str = setting("INFO", "logging level")
