"""The GPU step benchmark's CPU dry run: each phase on tiny shapes, the report's contents, exact greedy stack, a
budget that stops everything and still leaves the report."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks import gpu_step

# What the GPU machine lacks: the script must load without them (the stack phase checks for them itself).
SERVING_PACKAGES = {"specdec", "coordinator", "draft_service", "verify_service", "opentelemetry", "redis", "dns"}


def test_the_steps_phase_times_every_step_of_every_contender(tmp_path, capsys):
    report = gpu_step.main(["--dry-run", "--out-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "target_verify batch 16 (project)" in printed

    assert json.loads((tmp_path / "gpu_steps.json").read_text()) == report
    assert report["png"] == str(tmp_path / "gpu_steps.png")
    assert (tmp_path / "gpu_steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["dry_run"] and report["phase"] == "steps" and "cut_short" not in report
    assert set(report["phases_s"]) == {"build", "steps"}
    for role in ("target", "draft"):
        model = report["models"][role]
        assert model["weight_bytes"] == 4 * model["parameters"] > 0  # float32 on CPU

    steps = report["phases"]["steps"]
    assert steps["copy_bandwidth_gb_per_s"] > 0 and steps["target_load_s"] > 0
    cases = ("target_plain", "target_verify", "draft_plain")
    assert [steps[case]["tokens_per_row"] for case in cases] == [1, 5, 1]
    for case in cases:
        figures = steps[case]
        assert figures["bandwidth_bound_ms"] > 0
        for batch in ("1", "4", "16"):
            measured = figures[batch]
            for contender in ("hf_eager_static_cache", "project_step"):
                assert measured[contender]["median_ms"] >= measured[contender]["min_ms"] > 0
                assert measured[contender]["samples"] == 3
            # Nothing is made up for what cannot run here: each says why.
            assert "CUDA device" in measured["hf_cuda_graph_static_cache"]["error"]
            assert "captured no CUDA graphs" in measured["project_step_cuda_graphs"]["error"]
    assert steps["target_plain"]["bandwidth_bound_ms"] > steps["draft_plain"]["bandwidth_bound_ms"]


def test_the_stack_phase_runs_as_its_own_call_and_decodes_greedily_as_plain(tmp_path):
    report = gpu_step.main(["--dry-run", "--phase", "stack", "--out-dir", str(tmp_path), "--work-dir", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_stack.json").read_text()) == report
    assert set(report["phases_s"]) == {"save", "stack"} and "steps" not in report["phases"]
    stack = report["phases"]["stack"]
    assert stack["gamma"] == 4 and stack["startup_s"] > 0
    for concurrency, requests in ((1, 2), (16, 16)):
        passes = stack[f"concurrency_{concurrency}"]
        plain, speculative = passes["plain"], passes["speculative"]
        assert plain["requests"] == speculative["requests"] == requests
        assert plain["drafted_tokens"] == 0 < speculative["drafted_tokens"]
        assert plain["tokens_per_s_wall"] > 0 and speculative["tokens_per_s_wall"] > 0 and passes["speedup"] > 0
        # Greedy decoding is exact: speculation emits the target's own tokens.
        assert passes["greedy_outputs_identical"] and plain["token_ids"] == speculative["token_ids"]
        assert all(plain["token_ids"])


def test_a_spent_budget_stops_the_run_where_it_is_and_still_writes_the_report(tmp_path):
    report = gpu_step.main(["--dry-run", "--budget-s", "0", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_steps.json").read_text()) == report
    assert report["cut_short"].startswith("budget of 0s spent")
    assert any(phase.get("error", "").startswith("cut short") for phase in report["phases"].values())


def test_loads_as_a_script_from_anywhere_without_the_serving_packages():
    script = gpu_step.REPO_ROOT / "benchmarks" / "gpu_step.py"
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import runpy, sys; runpy.run_path(sys.argv[1]); print(sorted({m.split('.')[0] for m in sys.modules}))",
            str(script),
        ],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    )
    modules = set(eval(loaded.stdout.strip().splitlines()[-1]))
    assert "torch" in modules and "benchmarks" in modules
    assert not modules & SERVING_PACKAGES
