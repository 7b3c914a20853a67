"""The twin's scale run in quick mode: 4 draft x 2 verify replicas start, answer and share the sessions; the report's
keys, never its speed figures."""

from __future__ import annotations

import json

from benchmarks import twin_scale

FIGURE_KEYS = {"tokens_per_s", "e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "placement", "host"}
REPLICA_KEYS = {"sessions", "steps", "calls_per_step", "passes", "scored_tokens_per_pass"}


def test_quick_run_places_sessions_on_every_replica(tmp_path):
    report = twin_scale.main(["--quick", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "twin_scale.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "twin_scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["simulated"] is True and "simulated" in report["headline"]["label"]
    assert set(report["headline"]["ttft_p99_speculative_vs_plain_worst"]) >= {"ratio", "floor", "meets", "simulated"}
    assert set(report["processes"]) == {
        *("draft", "draft-2", "draft-3", "draft-4", "verify", "verify-2"),
        *("coordinator", "coordinator-1x1"),
    }
    (level,) = report["levels"].values()
    assert set(level) == {"1x1", "4x2"}
    for stack, modes in level.items():
        for mode in ("spec", "plain"):
            assert FIGURE_KEYS <= set(modes[mode]) and modes[mode]["errors"] == 0
        spec = modes["spec"]["placement"]["replicas"]
        assert set(spec) == (
            {"draft", "verify"} if stack == "1x1" else set(report["processes"]) - {"coordinator", "coordinator-1x1"}
        )
        for replica in spec.values():
            assert set(replica) == REPLICA_KEYS
            assert replica["sessions"] > 0 and replica["steps"] > 0  # least-loaded placement reaches every replica
        assert {"throughput", "ttft_p50", "ttft_p99"} <= set(modes["spec_vs_plain"])
    assert set(report["scaled_vs_1x1"]["c8"]) == {"spec", "plain"}
