"""The coordinator's speculation metrics count what SpeculationStats counts; the verifier's pass metrics."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from specdec.sampling.speculation_stats import SpeculationStats
from specdec.telemetry.metrics import SpeculationMetrics, VerifyPassMetrics, session_gauges


def sample_reader(registry: CollectorRegistry) -> Callable[..., float]:
    """value(name, **labels): a sample of the registry, 0 where it has none."""

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0

    return value


def test_round_counters_match_speculation_stats():
    registry = CollectorRegistry()
    metrics, stats = SpeculationMetrics(registry), SpeculationStats()
    for drafted, accepted in [(4, 4), (4, 1), (2, 0), (0, 0), (3, 2)]:
        stats.record(drafted, accepted)
        metrics.round_committed(drafted, accepted)
    value = sample_reader(registry)

    assert value("specdec_rounds_total") == stats.rounds == value("specdec_tokens_per_round_count")
    assert value("specdec_drafted_tokens_total") == stats.drafted
    assert value("specdec_accepted_tokens_total") == stats.accepted
    assert value("specdec_tokens_per_round_sum") / value("specdec_tokens_per_round_count") == stats.mean_accepted_length
    for position, (drafted, accepted) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
        assert value("specdec_drafted_tokens_by_position_total", position=str(position)) == drafted
        assert value("specdec_accepted_tokens_by_position_total", position=str(position)) == accepted


def test_session_gauges_are_read_at_scrape_time():
    registry, sessions = CollectorRegistry(), {"a": 5}
    session_gauges(lambda: len(sessions), lambda: sum(sessions.values()), registry)
    sessions["b"] = 7
    assert registry.get_sample_value("specdec_active_sessions") == 2
    assert registry.get_sample_value("specdec_kv_cache_tokens") == 12


def test_verify_passes_are_told_apart_by_prefill():
    registry = CollectorRegistry()
    metrics = VerifyPassMetrics(registry)
    metrics.observe(120_000_000, prefill_tokens=90, scored_tokens=30)
    metrics.observe(40_000_000, prefill_tokens=0, scored_tokens=25)
    metrics.observe(60_000_000, prefill_tokens=0, scored_tokens=5)
    value = sample_reader(registry)

    assert value("specdec_verify_pass_duration_seconds_count", prefill="with") == 1
    assert value("specdec_verify_pass_duration_seconds_sum", prefill="with") == 0.12
    assert value("specdec_verify_pass_duration_seconds_count", prefill="without") == 2
    assert value("specdec_verify_pass_duration_seconds_sum", prefill="without") == 0.1
    assert value("specdec_verify_pass_tokens_total", kind="prefill") == 90
    assert value("specdec_verify_pass_tokens_total", kind="scored") == 60
