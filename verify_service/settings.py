"""Settings of the verify service (flags `--name`, env `SPECDEC_NAME`)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.common.settings import setting
from specdec.engine.cpu_affinity import CpuAffinitySettings
from specdec.engine.embedded_pair import DEMO_TARGET_DIR
from specdec.engine.execution_settings import ExecutionSettings
from specdec.engine.kv.admission import KVCacheSettings
from specdec.engine.simulated.profiles import is_simulated
from specdec.engine.simulated.settings import TwinSettings
from specdec.engine.step_batcher import StepBatchingSettings
from specdec.sampling.constraints import ConstraintSettings
from specdec.serving.event_loop import EventLoopSettings
from specdec.serving.session_store import SessionExpirySettings
from specdec.serving.tls import ServerTlsSettings

TP_LAUNCHERS = ("local", "ray")
RAY_PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class VerifySettings(
    EventLoopSettings,
    ServerTlsSettings,
    StepBatchingSettings,
    SessionExpirySettings,
    CpuAffinitySettings,
    KVCacheSettings,
    ExecutionSettings,
    TwinSettings,
    ConstraintSettings,
):
    """Everything the verify service reads at start-up (tls_*: TLS, or mutual TLS with tls_client_ca, on its port)."""

    address: str = setting("[::]:50062", "host:port to serve gRPC on (port 0 picks a free port)")
    model: str = setting(str(DEMO_TARGET_DIR), "target model directory, hub id or GGUF file")
    gguf_file: str = setting("", "a GGUF file in the --model directory to load (dequantized once, cached beside it)")
    device: str = setting(
        "cpu",
        "device for the target model: cpu, cuda:N (rank r uses cuda:r under TP), or a twin sim:PROFILE[:VOCAB] "
        "(then --model target)",
    )
    dtype: str = setting("float32", "weight dtype: float32, bfloat16 or float16")
    threads: int = setting(1, "CPU threads per rank (0 = torch default)")
    max_sessions: int = setting(256, "most sessions held at once; more are refused with RESOURCE_EXHAUSTED")
    max_speculative_tokens: int = setting(16, "largest number of draft tokens one Verify may carry")
    grace_s: float = setting(
        10.0,
        "after SIGTERM: the longest the replica waits, opening no new sessions, for its callers to move or close the "
        "sessions it holds (then in-flight calls get what is left of it)",
    )
    metrics_port: int = setting(0, "port for Prometheus /metrics (0 = off)")
    trace_exporter: str = setting(
        "none",
        "where spans go: none, console, otlp (OTEL_EXPORTER_OTLP_* variables), jsonl:PATH, memory; comma-separated",
    )
    trace_sample_ratio: float = setting(1.0, "share of new traces recorded (parent-based: callers' choice wins)")
    log_level: str = setting("INFO", "logging level")
    # Tensor parallelism (verify_service/tensor_parallel.py). 1 = one plain process, no torch.distributed.
    tensor_parallel_size: int = setting(
        1,
        "ranks the target is sharded over with transformers' tp_plan='auto'; "
        "rank 0 serves gRPC (1 = a plain process, no torch.distributed)",
    )
    tp_launcher: str = setting(
        "local",
        "how ranks 1..N-1 start: local (processes on this node) or ray "
        "(a placement group with one bundle per rank, an actor per rank)",
    )
    tp_master_addr: str = setting(
        "", "address rank 0 listens on for the ranks to join (empty: 127.0.0.1 for local, this node's IP for ray)"
    )
    tp_master_port: int = setting(0, "port of that rendezvous (0 picks a free one)")
    tp_timeout_s: float = setting(
        30.0,
        "timeout of every collective and of one step across the ranks: a rank "
        "silent for longer is declared hung and the service turns NOT_SERVING",
    )
    tp_start_timeout_s: float = setting(300.0, "how long the ranks get to start, join and load their shards")
    tp_ray_address: str = setting(
        "",
        "Ray cluster for --tp-launcher ray ('' starts a local Ray instance with one "
        "CPU per rank, 'auto' joins the running cluster, or ray://HOST:PORT)",
    )
    tp_ray_placement_strategy: str = setting(
        "PACK", "placement-group strategy: PACK, STRICT_PACK, SPREAD or STRICT_SPREAD"
    )
    tp_ray_rank0_resource: str = setting(
        "specdec_rank0",
        "Ray custom resource that only the Ray node this process runs in offers (KubeRay: the head group's "
        "`resources`); bundle 0, the GPU rank 0 uses, asks for it, so it is reserved on this node ('' = no pin; "
        "a local Ray instance offers it itself)",
    )

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_launcher not in TP_LAUNCHERS:
            raise ValueError(f"tp_launcher must be one of {', '.join(TP_LAUNCHERS)}, got {self.tp_launcher!r}")
        if self.tp_ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(
                f"tp_ray_placement_strategy must be one of {', '.join(RAY_PLACEMENT_STRATEGIES)}, "
                f"got {self.tp_ray_placement_strategy!r}"
            )
        if self.tp_timeout_s <= 0 or self.tp_start_timeout_s <= 0:
            raise ValueError("tp_timeout_s and tp_start_timeout_s must be > 0")
        if is_simulated(self.device) and self.tensor_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size: a twin device models its profile's tensor parallelism in one process"
            )
        if self.model_process and self.tensor_parallel_size > 1:
            raise ValueError("model_process runs one rank's passes; tensor_parallel_size > 1 runs its ranks already")
