"""The load generator: a tiny sweep against real servers (schema and counts of the report), plus the pure parts."""

from __future__ import annotations

import csv
import json

import pytest

from demo_pair.corpus import CorpusFile
from load_tests.cli import is_loopback, main
from load_tests.generator import RequestResult, poisson_offsets
from load_tests.prompts import code_prompts, grounded_prompts, word_prompts
from load_tests.report import (
    LATENCY_METRICS,
    LEVEL_FIELDS,
    PERCENTILES,
    SPECULATION_FIELDS,
    baseline_comparisons,
    comparisons,
    summarize_level,
)
from load_tests.sweep import Load, SweepConfig

REPORT_KEYS = {
    "schema_version",
    "config",
    "server",
    "baseline_server",
    "environment",
    "levels",
    "comparisons",
    "baseline_comparisons",
    "requests",
}
DISTRIBUTION_KEYS = {"count", "mean", "max", *(f"p{p}" for p in PERCENTILES)}


def test_tiny_sweep_against_real_servers(tiny_pair_dirs, tmp_path, capsys):
    target_dir, draft_dir = tiny_pair_dirs
    out = tmp_path / "out"
    report = main(
        [
            "--start-stack",
            "--target",
            str(target_dir),
            "--draft",
            str(draft_dir),
            "--prompt-sets",
            "words",
            "--concurrency",
            "1,2",
            "--rates",
            "20",
            "--requests",
            "3",
            "--max-new-tokens",
            "6",
            "--gamma",
            "3",
            "--warmup",
            "1",
            "--request-timeout-s",
            "60",
            "--out",
            str(out),
            "--coordinator-arg=--no-adaptive-gamma",
        ]
    )  # the tiny pair: adaptive γ would not draft at all
    printed = capsys.readouterr().out
    assert "spec/plain" in printed and printed.count("] ") >= 6  # a progress line per level, then the summary

    assert json.loads((out / "report.json").read_text()) == report
    assert set(report) == REPORT_KEYS and report["schema_version"] == 3
    assert report["baseline_server"] is None and report["baseline_comparisons"] == []
    levels = report["levels"]
    assert len(levels) == 6  # (c=1, c=2, 20/s) x (spec, plain)
    assert [lv["order"] for lv in levels] == list(range(6))
    # Interleaved: each load's two modes run back to back, and the order inside a pair alternates.
    assert [(lv["level_id"]) for lv in levels] == [
        "c1-words-spec",
        "c1-words-plain",
        "c2-words-plain",
        "c2-words-spec",
        "r20-words-spec",
        "r20-words-plain",
    ]
    requests_by_level: dict[str, list[dict]] = {}
    for record in report["requests"]:
        requests_by_level.setdefault(record["level_id"], []).append(record)
    for level in levels:
        assert set(LEVEL_FIELDS) <= set(level) and {"latency_ms", "speculation"} <= set(level)
        assert set(level["latency_ms"]) == set(LATENCY_METRICS)
        assert all(set(level["latency_ms"][m]) == DISTRIBUTION_KEYS for m in LATENCY_METRICS)
        assert set(level["speculation"]) == set(SPECULATION_FIELDS)
        records = requests_by_level[level["level_id"]]
        assert level["requests"] == 3 == len(records) == level["ok"] + level["errors"]
        assert level["errors"] == sum(level["errors_by_status"].values())
        assert level["ok"] == sum(r["status"] == "OK" for r in records) == sum(level["finish_reasons"].values())
        assert level["output_tokens"] == sum(r["output_tokens"] for r in records)
        assert level["prompt_tokens"] == sum(r["prompt_tokens"] or 0 for r in records)
        assert level["latency_ms"]["e2e"]["count"] == level["ok"]
        assert level["latency_ms"]["itl"]["count"] == sum(len(r["itl_ms"]) for r in records if r["status"] == "OK")
        for record in records:
            assert 1 <= record["output_tokens"] <= 6 and record["chunks"] == len(record["itl_ms"]) + 1
            assert record["ttft_ms"] <= record["e2e_ms"]
        speculation = level["speculation"]
        assert speculation["requests_with_stats"] == level["ok"]
        assert speculation["rounds"] == sum(r["rounds"] for r in records)
        if level["mode"] == "plain":
            assert level["num_speculative_tokens"] == 0 and speculation["drafted_tokens"] == 0
            assert speculation["acceptance_rate"] is None and speculation["mean_accepted_length"] == 1.0
        else:
            assert level["num_speculative_tokens"] == 3 and speculation["drafted_tokens"] > 0
            assert 0 <= speculation["acceptance_rate"] <= 1 and 1 <= speculation["mean_accepted_length"] <= 4
        assert level["output_token_throughput_tps"] > 0 and level["request_throughput_rps"] > 0

    assert len(report["comparisons"]) == 3
    for row in report["comparisons"]:
        assert row["repeats"] == 1 and len(row["spec_level_ids"]) == len(row["output_token_throughput_ratios"]) == 1
        for key in ("e2e_p50_ratio", "output_token_throughput_ratio", "ttft_p50_ratio", "tpot_p50_ratio"):
            assert row[key] is not None and row[key] > 0
    assert report["server"]["target_model_id"] == str(target_dir)

    with (out / "levels.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["level_id"] for row in rows] == [lv["level_id"] for lv in levels]
    assert all(int(row["requests"]) == int(row["ok"]) + int(row["errors"]) for row in rows)
    for name in (
        "latency_concurrency_words",
        "throughput_concurrency_words",
        "latency_rate_words",
        "throughput_rate_words",
    ):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert "spec/plain" in (out / "summary.txt").read_text()


def test_summarize_level_counts_errors_and_tokens():
    results = [
        RequestResult(
            0,
            "OK",
            0.0,
            0.5,
            ttft_s=0.1,
            itl_s=[0.2, 0.2],
            output_tokens=5,
            chunks=3,
            finish_reason="LENGTH",
            prompt_tokens=4,
            rounds=3,
            drafted_tokens=6,
            accepted_tokens=3,
            acceptance_rate=0.5,
            mean_accepted_length=5 / 3,
        ),
        RequestResult(1, "DEADLINE_EXCEEDED", 0.1, 1.0, ttft_s=0.2, output_tokens=2, chunks=1),
        RequestResult(2, "RESOURCE_EXHAUSTED", 0.2, 0.01),
    ]
    level = summarize_level({"level_id": "x"}, results, wall_s=2.0, stopped_by="requests")
    assert (level["requests"], level["ok"], level["errors"]) == (3, 1, 2)
    assert level["errors_by_status"] == {"DEADLINE_EXCEEDED": 1, "RESOURCE_EXHAUSTED": 1}
    assert level["output_tokens"] == 7 and level["output_token_throughput_tps"] == 3.5
    assert level["request_throughput_rps"] == 0.5
    assert level["latency_ms"]["e2e"]["count"] == 1 and level["latency_ms"]["e2e"]["p50"] == 500.0
    assert level["latency_ms"]["tpot"]["p50"] == 100.0  # (0.5 - 0.1) / (5 - 1)
    assert level["speculation"]["acceptance_rate"] == 0.5 and level["speculation"]["mean_accepted_length"] == 1.6667


def test_poisson_arrivals_are_bounded_in_requests_and_seconds():
    assert len(poisson_offsets(10.0, 5, 100.0, seed=1)) == 5
    offsets = poisson_offsets(10.0, 10_000, 2.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets[-1] < 2.0
    assert 10 < len(offsets) < 40  # ~20 expected
    assert poisson_offsets(10.0, 50, 9.0, seed=3) == poisson_offsets(10.0, 50, 9.0, seed=3)


def test_plan_interleaves_modes_and_sizes_levels():
    plan = SweepConfig(concurrency=(4, 1), rates=(0.5,), prompt_sets=("code", "grounded")).plan()
    assert [(lv.load, lv.prompt_set, lv.mode) for lv in plan[:4]] == [
        (Load("concurrency", 1), "code", "spec"),
        (Load("concurrency", 1), "code", "plain"),
        (Load("concurrency", 1), "grounded", "plain"),
        (Load("concurrency", 1), "grounded", "spec"),
    ]
    assert [lv.requests for lv in plan] == [16] * 4 + [24] * 4 + [10] * 4
    assert plan[-1].level_id == "r0.5-grounded-spec" and plan[-1].pair == plan[-2].pair


def test_repeated_pairs_run_back_to_back_alternating_and_numbered():
    plan = SweepConfig(concurrency=(16,), prompt_sets=("code",), repeats=3).plan()
    assert [(lv.level_id, lv.repeat) for lv in plan] == [
        ("c16-code-spec", 0),
        ("c16-code-plain", 0),
        ("c16-code-plain-2", 1),
        ("c16-code-spec-2", 1),
        ("c16-code-spec-3", 2),
        ("c16-code-plain-3", 2),
    ]
    with pytest.raises(ValueError, match="repeats"):
        SweepConfig(repeats=0).plan()


def test_a_baseline_runs_each_level_next_to_the_stacks_alternating():
    plan = SweepConfig(
        concurrency=(16,), prompt_sets=("code",), modes=("spec",), repeats=2, baseline="verify --max-batch-size=1"
    ).plan()
    assert [(lv.level_id, lv.stack) for lv in plan] == [
        ("c16-code-spec", "stack"),
        ("c16-code-spec-baseline", "baseline"),
        ("c16-code-spec-baseline-2", "baseline"),
        ("c16-code-spec-2", "stack"),
    ]


def test_tiny_sweep_against_a_baseline_stack(tiny_pair_dirs, tmp_path):
    """Two real stacks, the baseline with batching off: every level runs on both, and the report compares them."""
    target_dir, draft_dir = tiny_pair_dirs
    out = tmp_path / "out"
    report = main(
        [
            "--start-stack",
            "--target",
            str(target_dir),
            "--draft",
            str(draft_dir),
            "--prompt-sets",
            "words",
            "--concurrency",
            "2",
            "--modes",
            "spec",
            "--requests",
            "3",
            "--max-new-tokens",
            "6",
            "--gamma",
            "3",
            "--warmup",
            "1",
            "--request-timeout-s",
            "60",
            "--out",
            str(out),
            "--coordinator-arg=--no-adaptive-gamma",
            "--baseline-batching-off",
        ]
    )
    assert report["config"]["stack"] == "coordinator --no-adaptive-gamma"
    assert report["config"]["baseline"] == "draft --max-batch-size=1; verify --max-batch-size=1"
    assert report["baseline_server"]["address"] != report["server"]["address"]
    assert [(lv["level_id"], lv["stack"], lv["ok"]) for lv in report["levels"]] == [
        ("c2-words-spec", "stack", 3),
        ("c2-words-spec-baseline", "baseline", 3),
    ]
    [row] = report["baseline_comparisons"]
    assert row["repeats"] == 1 and row["mode"] == "spec"
    assert row["output_token_throughput_ratio"] == round(row["stack_tps"][0] / row["baseline_tps"][0], 4) > 0
    assert (out / "throughput_vs_baseline.png").read_bytes()[:4] == b"\x89PNG"
    assert "stack/baseline" in (out / "summary.txt").read_text()


def test_tiny_sweep_over_the_http_api_against_grpc_on_one_stack(tiny_pair_dirs, tmp_path):
    """One stack, its HTTP front in a process of its own (python -m specdec serve http), driven over both APIs: the
    same greedy requests give the same tokens, and the report compares the two."""
    target_dir, draft_dir = tiny_pair_dirs
    common = ["--start-stack", "--target", str(target_dir), "--draft", str(draft_dir), "--prompt-sets", "words"]
    report = main(
        [
            *common,
            *("--concurrency", "2", "--modes", "spec", "--requests", "3", "--max-new-tokens", "6", "--gamma", "3"),
            *("--warmup", "1", "--request-timeout-s", "60", "--out", str(tmp_path / "out")),
            *("--api", "openai", "--http-front", "process", "--baseline-api", "grpc"),
        ]
    )
    assert report["config"]["api"] == "openai" and report["config"]["baseline"] == "api grpc"
    assert report["server"]["api"] == "openai" and report["baseline_server"]["api"] == "grpc"
    assert report["server"]["address"] == report["baseline_server"]["address"]  # one coordinator
    assert [(lv["stack"], lv["ok"]) for lv in report["levels"]] == [("stack", 3), ("baseline", 3)]
    by_api = {}
    for request in report["requests"]:
        by_api.setdefault(request["level_id"].endswith("baseline"), []).append(request)
    for http, grpc in zip(by_api[False], by_api[True]):
        assert (
            (http["output_tokens"], http["prompt_tokens"]) == (grpc["output_tokens"], grpc["prompt_tokens"]) != (0, 0)
        )
        assert http["finish_reason"] in ("LENGTH", "STOP") and http["chunks"] >= 1 and http["ttft_ms"] > 0
    [row] = report["baseline_comparisons"]
    assert row["output_token_throughput_ratio"] > 0


def test_baseline_comparisons_are_medians_over_the_runs_with_both_stacks():
    def level(stack: str, repeat: int, tps: float) -> dict:
        return {
            "load": "concurrency",
            "concurrency": 16,
            "rate_rps": None,
            "prompt_set": "code",
            "mode": "spec",
            "repeat": repeat,
            "stack": stack,
            "level_id": f"{stack}-{repeat}",
            "output_token_throughput_tps": tps,
            "latency_ms": {"e2e": {"p50": 1000.0 if stack == "stack" else 3000.0}},
        }

    runs = [(300.0, 100.0), (250.0, 100.0), (330.0, 100.0)]  # (stack tok/s, baseline tok/s) per run
    levels = [
        level(stack, repeat, tps) for repeat, pair in enumerate(runs) for stack, tps in zip(("stack", "baseline"), pair)
    ]
    levels.append(level("stack", 3, 900.0))  # a run without its baseline half is left out
    [row] = baseline_comparisons(levels)
    assert row["repeats"] == 3 and row["output_token_throughput_ratios"] == [3.0, 2.5, 3.3]
    assert row["output_token_throughput_ratio"] == 3.0 and row["e2e_p50_ratio"] == 0.3333
    assert row["stack_level_ids"] == ["stack-0", "stack-1", "stack-2"] and row["baseline_tps"] == [100.0] * 3
    assert comparisons(levels) == []  # spec/plain: no plain levels


def test_comparisons_are_medians_over_the_runs():
    def level(mode: str, repeat: int, tps: float, e2e_ms: float) -> dict:
        figures = {"p50": e2e_ms}
        return {
            "load": "concurrency",
            "concurrency": 16,
            "rate_rps": None,
            "prompt_set": "code",
            "mode": mode,
            "repeat": repeat,
            "level_id": f"{mode}-{repeat}",
            "output_token_throughput_tps": tps,
            "latency_ms": {"e2e": figures, "ttft": figures, "tpot": figures},
        }

    runs = [(100.0, 110.0), (90.0, 100.0), (120.0, 100.0)]  # (spec tok/s, plain tok/s) per run
    levels = [
        level(mode, repeat, tps, 1000.0 if mode == "spec" else 2000.0)
        for repeat, pair in enumerate(runs)
        for mode, tps in zip(("spec", "plain"), pair)
    ]
    levels.append(level("spec", 3, 500.0, 10.0))  # a run without its plain half is left out
    [row] = comparisons(levels)
    assert row["repeats"] == 3 and row["spec_level_ids"] == ["spec-0", "spec-1", "spec-2"]
    assert row["output_token_throughput_ratios"] == [0.9091, 0.9, 1.2]
    assert row["output_token_throughput_ratio"] == 0.9091 and row["e2e_p50_ratio"] == 0.5


def test_prompt_sets_are_deterministic():
    source = "\n".join(
        f"def f{i}(x):\n    y = x + {i}\n    if y:\n        return y\n    return -y\n" for i in range(60)
    )
    files = [CorpusFile("a.py", source), CorpusFile("b.py", source.replace("f", "g"))]
    code = code_prompts(5, seed=2, files=files)
    assert code == code_prompts(5, seed=2, files=files) and len(code) == 5
    assert all(200 <= len(p.prompt.rstrip(" ")) <= 600 and p.prompt.rstrip(" ").endswith("\n") for p in code)
    grounded = grounded_prompts(4, seed=2, files=files)
    for prompt in grounded:
        quoted = prompt.prompt.split("\n", 1)[1]
        first_line = quoted.split("\n", 1)[0]
        assert prompt.prompt.endswith(f"\n{first_line}\n") and first_line.startswith(("def f", "def g"))
    words = word_prompts(3, seed=0, vocab_size=64)
    assert all(1 <= int(w[1:]) < 64 for p in words for w in p.prompt.split())


@pytest.mark.parametrize(
    "address, expected",
    [
        ("127.0.0.1:50051", True),
        ("localhost:1", True),
        ("[::1]:50051", True),
        ("10.0.0.2:50051", False),
        ("example.com:443", False),
    ],
)
def test_only_loopback_addresses_by_default(address, expected):
    assert is_loopback(address) is expected
