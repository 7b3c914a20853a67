"""The first device run's CPU rehearsal (benchmarks/gpu_check.py --dry-run): every phase runs through the same code
on tiny shapes and reports its figures, none an error."""

from __future__ import annotations

import json

from benchmarks import gpu_check


def test_the_dry_run_reaches_every_phase_and_writes_the_report(tmp_path):
    report = gpu_check.main(["--dry-run", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == json.loads(json.dumps(report, default=str))
    phases = report["phases"]
    assert list(phases) == ["environment", "noise", "runtime", "graphs", "steps", "flex"]
    assert not [name for name, figures in phases.items() if "error" in figures or "skipped" in figures]

    runtime = phases["runtime"]
    assert runtime["packed"] and runtime["unpacked_reason"] is None and runtime["attention_backend"] == "flex"
    assert runtime["graph_buckets"] and not runtime["cuda_graphs"], "eager buckets on the CPU"
    assert runtime["float32_logits"] is False and runtime["float32_logits_refusal"]
    graphs = phases["graphs"]
    assert graphs["replayed"] and graphs["max_abs_logit_difference"] < 1e-3
    steps = phases["steps"]
    assert steps["bandwidth_bound_ms"] > 0 and steps["verify_graphs"]["median_ms"] > 0
    assert set(steps["headline"]) == {"verify_ms", "bound_ms", "ratio", "ceiling", "meets"}
    for queries, figures in phases["flex"]["by_queries"].items():
        assert figures["max_abs_error"] < 1e-4, queries
    assert phases["noise"]["bits_equal_cpu"] and phases["noise"]["device"]["median_ms"] > 0
