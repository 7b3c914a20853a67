"""Settings of the draft service (flags `--name`, env `SPECDEC_NAME`)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.common.settings import setting
from specdec.engine.cpu_affinity import CpuAffinitySettings
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR
from specdec.engine.execution_settings import ExecutionSettings
from specdec.engine.kv.admission import KVCacheSettings
from specdec.engine.simulated.settings import TwinSettings
from specdec.engine.step_batcher import StepBatchingSettings
from specdec.sampling.constraints import ConstraintSettings
from specdec.serving.event_loop import EventLoopSettings
from specdec.serving.session_store import SessionExpirySettings
from specdec.serving.tls import ServerTlsSettings


@dataclass(frozen=True)
class DraftSettings(
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
    """Everything the draft service reads at start-up (tls_*: TLS, or mutual TLS with tls_client_ca, on its port)."""

    address: str = setting("[::]:50061", "host:port to serve gRPC on (port 0 picks a free port)")
    model: str = setting(
        str(DEMO_DRAFT_DIR), "draft model directory, hub id or GGUF file; empty serves n-gram drafting only"
    )
    gguf_file: str = setting("", "a GGUF file in the --model directory to load (dequantized once, cached beside it)")
    vocab_size: int = setting(0, "vocabulary size when serving n-gram drafting without a model (the target's)")
    device: str = setting(
        "cpu", "device for the draft model: cpu, cuda:N, or a twin sim:PROFILE[:VOCAB] (then --model draft)"
    )
    dtype: str = setting("float32", "weight dtype: float32, bfloat16 or float16")
    threads: int = setting(1, "CPU threads for the model (0 = torch default)")
    draft_kernels: bool = setting(
        True,
        "CPU float32 Llama drafts: each layer's q/k/v and gate/up projections as one product each, and the LM head "
        "in bfloat16 where the CPU has AMX or AVX-512 BF16 (the draft's logits change slightly; no rule's exactness "
        "depends on them)",
    )
    max_sessions: int = setting(256, "most sessions held at once; more are refused with RESOURCE_EXHAUSTED")
    max_speculative_tokens: int = setting(
        16,
        "largest γ a Propose may draft for: num_speculative_tokens up to this + 1 "
        "(the bonus-token guess an 'all accepted' pre-draft lane drafts ahead of its block)",
    )
    kv_admission_wait_ms: float = setting(
        2000.0,
        "longest a new session waits for free KV blocks before RESOURCE_EXHAUSTED (its call's deadline may end it "
        "sooner; 0 = refuse at once): a refused drafter costs a request only speed, as it then decodes plainly",
    )
    max_lanes: int = setting(16, "most lanes one session may hold (a coordinator's pre-draft guesses)")
    join_running_step: bool = setting(
        True,
        "Propose calls that arrive while a step drafts join it before its next "
        "pass (iteration-level batching) instead of waiting for the whole step",
    )
    max_alternatives: int = setting(8, "largest num_alternatives a Propose may ask for")
    max_lookup_tokens: int = setting(8, "largest num_lookup_tokens a Propose may ask for (greedy lookup tokens)")
    default_draft_method: str = setting("model", "draft method for sessions that name none: model or ngram")
    ngram_min: int = setting(1, "n-gram drafter: shortest suffix matched")
    ngram_max: int = setting(4, "n-gram drafter: longest suffix matched")
    ngram_max_proposal: int = setting(10, "n-gram drafter: most tokens proposed per round")
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
