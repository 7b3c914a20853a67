"""The sampling-rules benchmark in quick mode on the tiny pair: the report's schema and its figures' ranges."""

from __future__ import annotations

import json

from benchmarks import sampling_rules


def test_quick_run_reports_every_rule_at_every_temperature_and_concurrency(tiny_pair_dirs, tmp_path, capsys):
    target_dir, draft_dir = tiny_pair_dirs
    report = sampling_rules.main(
        ["--quick", "--target", str(target_dir), "--draft", str(draft_dir), "--prompt-set", "words"]
        + ["--out-dir", str(tmp_path)]
    )
    printed = capsys.readouterr().out
    assert "T1.0 c4" in printed and "coupled" in printed
    assert json.loads((tmp_path / "sampling_rules.json").read_text()) == report

    assert set(report["headline"]) == {f"T{t}" for t in sampling_rules.TEMPERATURES}
    for by_level in report["headline"].values():
        assert set(by_level) == {"c1", "c4"}
        for by_mode in by_level.values():
            assert set(by_mode) == set(sampling_rules.MODES)
            for figures in by_mode.values():
                assert set(figures) == set(sampling_rules.HEADLINE)
                assert figures["tokens_per_s"] > 0 and figures["wire_bytes_per_round"] > 0
                for rate in ("acceptance_rate", "predraft_hit_rate"):  # None: nothing drafted, or no pre-draft
                    assert figures[rate] is None or 0 <= figures[rate] <= 1
    for by_level in report["results"].values():
        for level, by_mode in by_level.items():
            assert all(figures["requests"] == report["levels"][level]["requests"] for figures in by_mode.values())
