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
    report = pass_cost.main(
        [
            "--target",
            str(target_dir),
            "--contexts",
            "8,20",
            "--rows",
            "1,3",
            "--gamma",
            "2",
            "--context-spread",
            "8",
            "--repeats",
            "2",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert "round 2/2" in capsys.readouterr().out
    assert json.loads((tmp_path / "pass_cost.json").read_text()) == report
    assert (tmp_path / "pass_cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = report["points"]
    assert [(p["context_tokens"], p["rows"]) for p in points] == [(8, 1), (8, 3), (20, 1), (20, 3)]
    assert all(len(p["samples_ms"]) == 2 and p["pass_ms"] > 0 for p in points)
    assert all(p["batching_gain"] > 0 for p in points) and points[0]["batching_gain"] == 1.0


def test_run_with_a_prompt_times_its_prefill_and_gives_each_point_a_ceiling(tiny_pair_dirs, tmp_path, capsys):
    target_dir, _ = tiny_pair_dirs
    report = pass_cost.main(
        [
            "--target",
            str(target_dir),
            "--contexts",
            "12",
            "--rows",
            "1,3",
            "--gamma",
            "2",
            "--repeats",
            "2",
            "--prompt-tokens",
            "10",
            "--new-tokens",
            "16",
            "--tokens-per-round",
            "2",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert "on/off ceiling for 16 new tokens at 2 a round" in capsys.readouterr().out
    workload = report["workload"]
    assert workload["prompt_tokens"] == 10 and len(workload["prefill_samples_ms"]) == 2 and workload["prefill_ms"] > 0
    one, three = report["points"]
    assert one["on_off_ceiling"] == 1.0 and three["on_off_ceiling"] > 0
    assert (tmp_path / "pass_cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_on_off_ceiling_weighs_the_prefill_both_ways_pay_against_the_rounds_batching_makes_cheaper():
    workload = pass_cost.Workload(prompt_tokens=100, prefill_ms=100.0, new_tokens=120, tokens_per_round=3.0)
    assert workload.rounds == 40.0
    # off: 100 + 40 x 30 = 1300 ms a request; on, 4 rows in a 60 ms pass: 100 + 40 x 15 = 700 ms
    assert pass_cost.on_off_ceiling(workload, alone_ms=30.0, pass_ms=60.0, rows=4) == 1300 / 700
    free_prefill = pass_cost.Workload(100, 0.0, 120, 3.0)
    assert pass_cost.on_off_ceiling(free_prefill, 30.0, 60.0, 4) == 2.0  # the batching gain itself
    samples = {(60, 1): [30.0], (60, 4): [60.0], (240, 4): [80.0]}
    points = {(p["context_tokens"], p["rows"]): p for p in pass_cost.summarize(samples, 4, workload)}
    assert points[60, 1]["on_off_ceiling"] == 1.0 and points[60, 4]["on_off_ceiling"] == 1.86
    assert points[240, 4]["on_off_ceiling"] is None
    assert "on_off_ceiling" not in pass_cost.summarize(samples, 4)[0]
