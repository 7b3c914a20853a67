"""The twin benchmark in quick mode (both profiles and the demo pair): the report's keys, never its values."""

from __future__ import annotations

import json

from benchmarks import twin
from benchmarks.twin_headline import FLOORS, TTFT_FLOORS
from specdec.engine.simulated.profiles import PROFILES

PROFILE_KEYS = {
    "device",
    "placements",
    "analytic",
    "request_gamma",
    "concurrency_1",
    "per_round",
    "injected_delay",
    "sweep",
    "full_vocabulary",
    "headline",
}
ENTRY_KEYS = {"ratio", "numerator", "denominator", "floor", "meets", "side", "simulated"}
LEVEL_KEYS = {"tokens_per_s", "e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "acceptance_rate"}


def test_quick_run_writes_every_key(tmp_path):
    report = twin.main(["--quick", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "twin.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "twin.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["simulated"] is True and "simulated" in report["label"]
    assert set(report["profiles"]) == set(PROFILES)
    headline = report["headline"]
    assert headline["profile"] == twin.HEADLINE_PROFILE
    for scope in [headline, *(headline[name] for name in PROFILES)]:
        assert set(FLOORS) <= set(scope)
        assert all(set(scope[key]) == ENTRY_KEYS for key in FLOORS)
    assert set(headline["demo_pair"]) == set(TTFT_FLOORS)
    for profile in report["profiles"].values():
        assert set(profile) == PROFILE_KEYS
        c1 = profile["concurrency_1"]
        for delay in ("0", "0.5"):
            assert {"plain", "speculative", "speculative_vs_sequential_bound"} <= set(c1[delay])
            assert {"tokens_per_s", "vs_ideal_plain", "cpu_ms_per_round"} <= set(c1[delay]["speculative"])
        assert set(profile["per_round"]["speculative"]["cpu_ms"]) == {"coordinator", "verify", "draft"}
        assert {"measured_one_way_ms", "with_asyncio_sleep_one_way_ms"} <= set(profile["injected_delay"]["0.5"])
        for level in profile["sweep"].values():
            assert LEVEL_KEYS <= set(level["spec"]) and LEVEL_KEYS <= set(level["plain"])
            assert {"throughput", "ttft_p50", "ttft_p99"} <= set(level["spec_vs_plain"])
