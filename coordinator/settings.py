"""Settings of the coordinator (flags `--name`, env `SPECDEC_NAME`)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.openai_api.settings import HttpApiSettings
from specdec.common.settings import setting
from specdec.engine.cpu_affinity import CpuAffinitySettings
from specdec.engine.embedded_pair import DEMO_TARGET_DIR
from specdec.sampling.constraints import ConstraintSettings
from specdec.sampling.rules import SamplingRule
from specdec.serving.event_loop import EventLoopSettings
from specdec.serving.tls import ServerTlsSettings


@dataclass(frozen=True)
class CoordinatorSettings(
    HttpApiSettings, EventLoopSettings, ServerTlsSettings, CpuAffinitySettings, ConstraintSettings
):
    """Everything the coordinator reads at start-up (tls_cert/tls_key/tls_client_ca: the client-facing ports)."""

    address: str = setting("[::]:50051", "host:port of the client-facing gRPC API (port 0 picks a free port)")
    http_address: str = setting(
        "",
        "host:port of the OpenAI-compatible HTTP API served by this process (port 0 picks a free port; empty: off); "
        "TLS and API keys as on the gRPC port",
    )
    draft_replicas: tuple[str, ...] = setting(
        ("localhost:50061",),
        "draft service addresses, comma-separated; dns:///NAME:PORT expands to every address NAME resolves to, "
        "looked up again every discovery_refresh_s",
    )
    verify_replicas: tuple[str, ...] = setting(("localhost:50062",), "verify service addresses (same forms)")
    discovery_refresh_s: float = setting(
        5.0,
        "how often dns:/// entries are resolved again: a new address joins placement once its replica is ready, "
        "a vanished one leaves it and is closed after its sessions end (0: resolve once at start-up)",
    )
    dns_nameserver: str = setting(
        "", "HOST:PORT of a DNS server to ask for dns:/// entries (empty: the system's resolver, /etc/hosts first)"
    )
    tokenizer: str = setting(
        str(DEMO_TARGET_DIR),
        "tokenizer directory, hub id or GGUF file (the target's), or a twin device sim:PROFILE[:VOCAB]",
    )
    gguf_file: str = setting("", "a GGUF file inside the --tokenizer directory to take the tokenizer from")
    default_num_speculative_tokens: int = setting(4, "γ for requests that do not set num_speculative_tokens")
    max_num_speculative_tokens: int = setting(16, "largest γ a request may ask for")
    max_new_tokens_limit: int = setting(1024, "largest max_new_tokens a request may ask for")
    max_context_tokens: int = setting(1024, "longest prompt + completion (at most the models' context)")
    lookup_tokens: int = setting(
        4,
        "greedy requests: after a block's γ drafted tokens, try up to this many tokens that followed an earlier "
        "copy of the sequence's last tokens, kept as far as the draft agrees, then its own next one, in one more "
        "draft pass (0: off)",
    )
    overlap: bool = setting(True, "pipeline rounds: draft block k+1 while block k is verified")
    chain_rounds: bool = setting(
        True,
        "overlapped mode: hand each pre-drafted next block to the verifier as soon as "
        "it is drafted (VerifyNext); the verifier runs the one its verdict selects in "
        "its next pass, without a round trip to the coordinator",
    )
    call_streams: bool = setting(
        True,
        "send a request's calls to each replica as messages on one stream per session (CallStream) instead of "
        "a unary call each: less work per round on both sides (--no-call-streams: unary calls)",
    )
    predraft_guesses: int = setting(
        2,
        "overlapped mode, greedy and coupled requests: besides 'all accepted', guess γ times this "
        "many rejections (a position and the draft's r-th next most likely token "
        "there; those the request's verdicts matched most often first), "
        "each pre-drafted on its own draft lane (0: only 'all accepted'; fewer when "
        "the measured costs say they would not fit inside the verification)",
    )
    predraft_max_batch: float = setting(
        4.0,
        "overlapped mode: pre-draft the next block only while the verifier's passes hold fewer than this many "
        "sessions on average (0: at any batch); from there on each block is drafted after its verdict, since the "
        "guesses' draft rows would delay every session's drafts more than their hits save",
    )
    adaptive_gamma: bool = setting(
        True,
        "pick each round's γ within [0, the request's γ] from the request's live "
        "acceptance rate and the replicas' measured pass costs at their current "
        "batch size (0 = plain decoding when speculation stops paying), and "
        "as many pre-draft guesses as fit inside a verification; off: always "
        "the request's γ and every guess",
    )
    speculation_gate: bool = setting(
        True,
        "with adaptive γ: where the policy predicts a small gain from "
        "speculating, measure committed tokens/s in epochs with speculation and "
        "epochs of plain rounds at each load, and keep the faster way",
    )
    unseeded_sampling_rule: SamplingRule = setting(
        SamplingRule.REJECTION,
        "how sampled requests without a seed are judged: 'rejection' (accept x with probability "
        "min(1, p(x)/q(x)); the draft sends its q) or 'coupled' (Gumbel-max coupling: the draft and "
        "the target share each position's noise, no q is sent, and rejections become guessable for "
        "pre-drafting). A request that sets a seed always gets 'coupled', so its tokens are a "
        "function of prompt, settings and seed alone. Default 'rejection': an unseeded request gains "
        "nothing from reproducibility, and on the demo pair (benchmarks/results/sampling_rules.json) "
        "the rejection rule accepts more (α 0.54-0.60 against 0.46-0.56 coupled) and served the most "
        "tokens/s at concurrency 16 (267 and 275 against 220 and 247 at T 0.7 and 1.0), while the "
        "q it sends (~450 KB a round at a vocabulary of 8192, against under 1 KB coupled) costs "
        "little on loopback. Prefer 'coupled' where wire bytes are dear (a large vocabulary, "
        "replicas on other hosts)",
    )
    call_timeout_s: float = setting(
        30.0,
        "deadline of each internal call, but opening a session: that waits (for a replica's free KV blocks) until the "
        "client's own deadline, or this long when the client set none",
    )
    max_session_moves: int = setting(
        4,
        "most times one request's verify (or draft) session moves to another replica, with its committed tokens, "
        "because its replica is gone, lost the session or drains (0 = never: the request fails, or drafts no more)",
    )
    replica_network_delay_ms: float = setting(
        0.0,
        "measuring only: a one-way delay added to every call to a replica, each way, as if the replicas ran on "
        "other hosts (coordinator/network_delay.py; 0 = off)",
    )
    startup_timeout_s: float = setting(300.0, "how long to wait for the replicas to come up")
    grace_s: float = setting(10.0, "seconds in-flight requests get to finish after SIGTERM")
    max_connection_age_s: float = setting(
        0.0,
        "a client's connection is asked to close (HTTP/2 GOAWAY) after this long, so clients reconnect and "
        "resolve the coordinators again: replicas an autoscaler added get traffic (0 = never)",
    )
    max_connection_age_grace_s: float = setting(
        600.0, "calls still running on a connection asked to close get this long before they are cancelled"
    )
    # Redis: API keys, rate limits, the request journal, the session registry (coordinator/request_guard.py).
    redis_url: str = setting(
        "",
        "Redis for API keys, rate limits, the request journal and the session registry "
        "(redis://[:PASSWORD@]HOST:PORT/DB); empty: none of them",
    )
    redis_key_prefix: str = setting("specdec:", "prefix of every Redis key this deployment uses")
    redis_timeout_s: float = setting(1.0, "timeout of each Redis call (past it Redis counts as down)")
    require_api_key: bool = setting(
        False,
        "refuse Coordinator calls without a valid 'authorization: Bearer KEY' "
        "(python -m coordinator.api_keys); needs redis_url",
    )
    lease_s: float = setting(
        10.0,
        "lease on a running request_id, refreshed each round: after a crash a retry "
        "can take the request over this long after the last round",
    )
    lease_wait_s: float = setting(15.0, "how long a retry waits for another coordinator's lease (then ABORTED)")
    journal_ttl_s: float = setting(3600.0, "how long an unfinished request's journal outlives its last round")
    result_ttl_s: float = setting(600.0, "how long a finished request's result can be fetched again by request_id")
    registry_ttl_s: float = setting(30.0, "a coordinator silent this long is presumed dead: its sessions are closed")
    registry_refresh_s: float = setting(1.0, "how often session counts are published to and read from Redis")
    # Limits beyond the context (RESOURCE_EXHAUSTED).
    max_prompt_tokens: int = setting(0, "longest prompt accepted, in tokens (0: the context is the limit)")
    max_total_tokens: int = setting(0, "most prompt + max_new_tokens per request (0: the context is the limit)")
    # TLS of the channels to the draft and verify replicas (specdec/serving/tls.py).
    replica_tls_ca: str = setting("", "PEM CA of the replicas' server certificates: turns TLS on towards them")
    replica_tls_cert: str = setting("", "PEM client certificate for the replicas (mutual TLS)")
    replica_tls_key: str = setting("", "PEM private key of replica_tls_cert")
    replica_tls_server_name: str = setting(
        "",
        "name the replicas' certificates are checked against instead of "
        "their address (e.g. when dns:/// expands to pod IPs)",
    )
    metrics_port: int = setting(0, "port for Prometheus /metrics (0 = off)")
    trace_exporter: str = setting(
        "none",
        "where spans go: none, console, otlp (OTEL_EXPORTER_OTLP_* variables), jsonl:PATH, memory; comma-separated",
    )
    trace_sample_ratio: float = setting(1.0, "share of new traces recorded (parent-based: callers' choice wins)")
    log_level: str = setting("INFO", "logging level")
