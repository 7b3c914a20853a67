"""Placement and batching on each replica of a stack, from the replicas' own Prometheus metrics.

Each model service serves /metrics (`--metrics-port`, specdec/telemetry/metrics.py). Scraped before and after a
load level, the counters' differences say what the level did on that replica: sessions opened there (the RPC
metrics count OpenSession, streamed or unary), model steps and the calls batched into each
(specdec_batch_size{kind}), and on a verify replica its scoring passes and the tokens they scored.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Mapping

from prometheus_client.parser import text_string_to_metric_families

# (metric sample name, label that tells the series apart) -> the short name a figure goes by
SERIES = {
    ("specdec_grpc_server_requests_total", "/specdec.v1.Verifier/OpenSession"): "sessions",
    ("specdec_grpc_server_requests_total", "/specdec.v1.Drafter/OpenSession"): "sessions",
    ("specdec_batch_size_count", "step"): "steps",  # the verify service batches every call as one kind
    ("specdec_batch_size_sum", "step"): "calls",
    ("specdec_batch_size_count", "propose"): "steps",
    ("specdec_batch_size_sum", "propose"): "calls",
    ("specdec_verify_pass_duration_seconds_count", "with"): "passes_with_prefill",
    ("specdec_verify_pass_duration_seconds_count", "without"): "passes_without_prefill",
    ("specdec_verify_pass_tokens_total", "scored"): "scored_tokens",
}
LABELS = ("grpc_method", "kind", "prefill")  # the labels SERIES keys on, one per metric


def scrape(port: int) -> dict[str, float]:
    """The SERIES of one service's /metrics on loopback, summed by short name (OK and failed calls alike)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    counts: dict[str, float] = dict.fromkeys(SERIES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = next((sample.labels[name] for name in LABELS if name in sample.labels), None)
            short = SERIES.get((sample.name, label))
            if short is not None:
                counts[short] += sample.value
    return counts


def difference(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


def figures(counts: Mapping[str, float]) -> dict:
    """One replica's counts over some levels and what they say about batching: calls a model step, and on a
    verify replica tokens scored a pass."""
    passes = counts["passes_with_prefill"] + counts["passes_without_prefill"]
    return {
        "sessions": int(counts["sessions"]),
        "steps": int(counts["steps"]),
        "calls_per_step": round(counts["calls"] / counts["steps"], 3) if counts["steps"] else None,
        "passes": int(passes),
        "scored_tokens_per_pass": round(counts["scored_tokens"] / passes, 3) if passes else None,
    }


def spread(sessions: list[int]) -> float | None:
    """Most over fewest sessions per replica (1.0 is perfectly even; None when a replica got none)."""
    return round(max(sessions) / min(sessions), 4) if sessions and min(sessions) > 0 else None


class ReplicaMetrics:
    """Scrapes a fixed set of replicas (name -> metrics port) around each load level."""

    def __init__(self, ports: Mapping[str, int]):
        self.ports = dict(ports)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {name: scrape(port) for name, port in self.ports.items()}

    def probe(self, _level) -> Callable[[], dict]:
        """A load_tests LevelProbe: scrapes now, and at the level's end returns each replica's differences."""
        before = self.snapshot()

        def finish() -> dict:
            after = self.snapshot()
            return {name: difference(after[name], before[name]) for name in self.ports}

        return finish
