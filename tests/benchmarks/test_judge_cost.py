"""The judge-cost benchmark runs and finds the batched judge's verdicts identical to one-at-a-time judging."""

from __future__ import annotations

import json

from benchmarks import judge_cost


def test_quick_run_reports_each_rule_and_identical_verdicts(tmp_path):
    judge_cost.main(["--quick", "--rows", "1,3", "--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "judge_cost.json").read_text())
    assert set(report["rules"]) == {"greedy", "rejection", "coupled"}
    for by_rows in report["rules"].values():
        assert set(by_rows) == {"1", "3"}
        for entry in by_rows.values():
            assert entry["verdicts_identical"] is True
            assert entry["one_at_a_time_ms"] > 0 and entry["batched_ms"] > 0
