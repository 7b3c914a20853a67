"""The speedup benchmark in quick mode on the tiny pair: the report's schema, and exactness across contenders."""

from __future__ import annotations

import json

from benchmarks import speedup
from benchmarks.prompt_ids import PROMPT_SETS
from benchmarks.speedup_headline import FLOORS
from benchmarks.speedup_report import CONTENDERS, SPECULATIVE, TEMPERATURES

SWEEP_GAMMAS = (1, 3)


def test_quick_run_writes_every_figure_and_greedy_outputs_agree(tiny_pair_dirs, tmp_path, capsys):
    target_dir, draft_dir = tiny_pair_dirs
    # One thread per core group, as the real run: services and pinned contenders 1, hf_assisted_all_cores 2.
    report = speedup.main(
        [
            "--quick",
            "--target",
            str(target_dir),
            "--draft",
            str(draft_dir),
            "--threads",
            "1",
            "--sweep-gammas",
            ",".join(map(str, SWEEP_GAMMAS)),
            "--out-dir",
            str(tmp_path),
        ]
    )
    printed = capsys.readouterr().out
    assert "rep 3/3" in printed and "headline (greedy, code)" in printed and "grpc_overlap" in printed

    assert json.loads((tmp_path / "speedup.json").read_text()) == report
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The headline figures, under the names benchmarks/README.md gives them.
    for key in ("grpc_overlap_vs_target_only", "grpc_overlap_vs_hf_assisted"):
        assert report["ratios"][key] > 0
    assert report["efficiency"]["grpc_sequential"] > 0
    # The four headline ratios, per temperature and prompt set and at the top (greedy, code); never their values.
    headline = report["headline"]
    assert (headline["temperature"], headline["prompt_set"]) == ("greedy", "code")
    assert headline["floors"] == FLOORS
    tops = [headline] + [headline[label][prompt_set] for label in TEMPERATURES for prompt_set in PROMPT_SETS]
    for figures in tops:
        for key, floor in FLOORS.items():
            figure = figures[key]
            assert figure["ratio"] > 0 and figure["floor"] == floor and isinstance(figure["meets"], bool), key
            assert figure["numerator"]["tokens_per_s"] > 0 and figure["denominator"]["tokens_per_s"] > 0, key
            assert figure["ratio"] == figure["numerator"]["tokens_per_s"] / figure["denominator"]["tokens_per_s"]
    assert set(report["prompt_sets"]) == set(PROMPT_SETS) == set(report["prompts"])
    for label in TEMPERATURES:
        assert set(report["tokens_per_s"][label]) == set(CONTENDERS)
        assert all(v > 0 for v in report["tokens_per_s"][label].values())
        assert set(report["alpha"][label]) == set(report["bound"][label]) == set(SPECULATIVE)
        assert all(0 <= a <= 1 for a in report["alpha"][label].values())
        assert all(len(report["contenders"][label][n]["tokens_per_s_reps"]) == 3 for n in CONTENDERS)
        assert report["target_only"][label]["best"] in ("hf_target_only", "own_target_only")
    assert report["c"] > 0 and report["c_grpc"] > 0
    for result in report["step_times_ms"].values():
        for side in ("target", "draft"):
            assert {
                "bare_forward_ms",
                "runtime_forward_ms",
                "session_step_ms",
                "verify_block_ms",
                "runtime_overhead_pct",
            } <= set(result[side])
    points = report["gamma_sweep"]["points"]
    assert [p["gamma"] for p in points] == list(SWEEP_GAMMAS)
    assert all({"speedup", "alpha", "bound", "tokens_per_s"} <= set(p["grpc_overlap"]) for p in points)
    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch_version"] and machine["threads"]["in_process"] == 1

    # Greedy decoding is exact: every contender (and every γ of the sweep) emits the target's own tokens.
    outputs = report["greedy_token_ids"]
    assert set(CONTENDERS) <= set(outputs) and len(outputs) == len(CONTENDERS) + 2 * len(SWEEP_GAMMAS)
    reference = outputs["own_target_only"]
    assert len(reference) == report["prompts"]["code"]["count"] and all(reference)
    sweep_prompts = report["gamma_sweep"]["prompts"]
    for name, token_ids in outputs.items():
        assert token_ids == reference[: len(token_ids)], name
        assert len(token_ids) == (sweep_prompts if "@gamma=" in name else len(reference)), name
    assert report["checks"]["greedy_outputs_identical"] and not report["checks"]["greedy_mismatches"]
    assert set(report["greedy_token_ids_grounded"]) == set(CONTENDERS)
    assert not report["checks"]["greedy_mismatches_grounded"]
    # The project's three speculative paths share position-keyed draws, so they agree when sampling too.
    assert report["checks"]["sampled_project_outputs_identical"]
