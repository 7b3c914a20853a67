"""The pass-cost benchmark: its figures from hand-made timings, and a run on the tiny target."""

from __future__ import annotations

import json
import random

from benchmarks import pass_cost


def test_summary_gives_medians_per_row_and_the_gain_against_one_row_alone():
    samples = {(60, 1): [30.0, 10.0, 20.0], (60, 4): [40.0, 50.0, 60.0], (240, 4): [80.0]}
    points = {(p["context_tokens"], p["rows"]): p for p in pass_cost.summarize(samples, gamma=4)}
    assert points[60, 1]["pass_ms"] == 20.0 and points[60, 1]["batching_gain"] == 1.0
    assert points[60, 4]["pass_ms"] == 50.0 and points[60, 4]["per_row_ms"] == 12.5
    assert points[60, 4]["batching_gain"] == 1.6  # 4 rows x 20 ms alone / 50 ms together
    assert points[60, 4]["tokens_fed"] == 20  # 4 rows x (γ + 1)
    assert points[240, 4]["batching_gain"] is None  # no one-row pass at that context to compare with


def test_spread_lengths_are_even_around_the_context_and_the_one_row_pass_holds_the_nearest():
    assert pass_cost.context_lengths(240, 0, 4, random.Random(0)) == [240] * 4
    lengths = pass_cost.context_lengths(240, 300, 16, random.Random(0))
    assert sorted(lengths) == list(range(90, 391, 20))
    assert lengths[0] in (230, 250) and lengths[1:] != sorted(lengths[1:])  # nearest first, the rest shuffled
    assert pass_cost.context_lengths(240, 300, 1, random.Random(0)) == [240]


def test_run_on_the_tiny_target_times_every_point_and_writes_json_and_png(tiny_pair_dirs, tmp_path, capsys):
    target_dir, _ = tiny_pair_dirs
    report = pass_cost.main(["--target", str(target_dir), "--contexts", "8,20", "--rows", "1,3", "--gamma", "2",
                             "--context-spread", "8", "--repeats", "2", "--out-dir", str(tmp_path)])
    assert "round 2/2" in capsys.readouterr().out
    assert json.loads((tmp_path / "pass_cost.json").read_text()) == report
    assert (tmp_path / "pass_cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = report["points"]
    assert [(p["context_tokens"], p["rows"]) for p in points] == [(8, 1), (8, 3), (20, 1), (20, 3)]
    assert all(len(p["samples_ms"]) == 2 and p["pass_ms"] > 0 for p in points)
    assert all(p["batching_gain"] > 0 for p in points) and points[0]["batching_gain"] == 1.0
