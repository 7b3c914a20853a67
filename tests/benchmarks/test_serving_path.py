"""The serving-path benchmark's floors and bounds, on hand-made figures."""

from __future__ import annotations

import pytest

from benchmarks.serving_path import level_medians
from benchmarks.serving_path_headline import FLOORS, best_bounds, expected_tokens, headline


def mode(tps: float, ttft_p50: float, ttft_p99: float) -> dict:
    return {"tps": tps, "ttft_p50_ms": ttft_p50, "ttft_p99_ms": ttft_p99}


def test_the_bounds_take_their_best_gamma():
    assert expected_tokens(0.75, 0) == 1.0 and expected_tokens(1.0, 3) == 4.0
    bounds = best_bounds(0.75, 0.2)
    assert bounds["sequential_bound"] == pytest.approx(
        max(expected_tokens(0.75, g) / (1 + 0.2 * g) for g in range(1, 17)), abs=1e-4
    )
    assert bounds["overlapped_ceiling"] == pytest.approx(expected_tokens(0.75, 5), abs=1e-4)  # γc reaches 1 at 5
    assert bounds["overlapped_gamma"] == 5


def test_the_headline_has_every_floor_with_its_two_figures():
    levels = {
        1: {"spec": mode(500.0, 10.0, 12.0), "plain": mode(380.0, 9.8, 11.0)},
        16: {"spec": mode(1400.0, 40.0, 80.0), "plain": mode(1000.0, 30.0, 60.0)},
        64: {"spec": mode(1900.0, 90.0, 200.0), "plain": mode(2000.0, 80.0, 170.0)},
    }
    entries = headline(400.0, levels, alpha=0.75, c=0.2, concurrencies=[1, 16, 64])
    assert set(entries) == set(FLOORS)
    plain = entries["plain_vs_ideal_c1"]
    assert (plain["ratio"], plain["meets"]) == (0.95, True)
    spec = entries["spec_speedup_vs_sequential_bound_c1"]
    assert spec["ratio"] == pytest.approx(1.25 / best_bounds(0.75, 0.2)["sequential_bound"], abs=1e-3)
    assert entries["spec_vs_plain_throughput_c16"]["meets"] is True  # 1.4
    assert entries["spec_vs_plain_throughput_c64"]["meets"] is False  # 0.95
    ttft = entries["ttft_p50_spec_vs_plain_c1"]
    assert ttft["kind"] == "at most" and ttft["meets"] is True  # 10 / 9.8
    worst = entries["ttft_p99_spec_vs_plain_worst"]
    assert (worst["concurrency"], worst["meets"]) == (16, False)  # 80 / 60, the worst of the three


def test_level_medians_take_the_median_of_the_runs():
    def level(concurrency: int, mode_name: str, tps: float) -> dict:
        latency = {"ttft": {"p50": tps / 100, "p99": tps / 50}, "tpot": {"p50": 1.0}}
        speculation = {"acceptance_rate": 0.7, "mean_accepted_length": 3.0}
        return {
            "concurrency": concurrency,
            "mode": mode_name,
            "output_token_throughput_tps": tps,
            "latency_ms": latency,
            "speculation": speculation,
        }

    report = {"levels": [level(1, "spec", tps) for tps in (300.0, 100.0, 200.0)] + [level(1, "plain", 50.0)]}
    medians = level_medians(report)
    assert medians[1]["spec"]["tps"] == 200.0 and medians[1]["spec"]["ttft_p99_ms"] == 4.0
    assert medians[1]["spec"]["tps_runs"] == [300.0, 100.0, 200.0] and medians[1]["plain"]["tps"] == 50.0
