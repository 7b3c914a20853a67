"""The coupled-noise benchmark runs, times each way and writes its headline (figures are never asserted on)."""

from __future__ import annotations

import json
import os

from benchmarks import coupled_noise


def test_quick_run_reports_each_way_and_a_headline(tmp_path):
    cores = os.sched_getaffinity(0)
    report = coupled_noise.main(["--quick", "--rows", "4", "--out-dir", str(tmp_path)])
    assert os.sched_getaffinity(0) == cores  # the run pinned itself to one core, and gave the others back
    assert json.loads((tmp_path / "coupled_noise.json").read_text()) == report
    assert set(report["figures"]) == {"host_rows", "device", "device_tensor_ops"}
    assert all(way["median_ms"] > 0 and way["samples"] >= 1 for way in report["figures"].values())
    headline = report["headline"]
    assert set(headline) == {"host_rows_ms", "device_ms", "ratio", "floor", "meets"} and headline["floor"] == 10.0
    assert headline["meets"] == (headline["ratio"] >= headline["floor"])
