"""The serving path at accelerator step times: the stack against ideal plain decoding and against itself, plain.

    python -m benchmarks.serving_path                  # the fast pair (benchmarks/fast_pair.py), ~8 minutes
    python -m benchmarks.serving_path --quick          # a ~2 minute smoke run to a temp folder
    python -m benchmarks.serving_path --target DIR --draft DIR --verify-arg=--model-process

A target whose step takes ~2 ms (as a 1-3B model's does on one H100) makes the serving path's own cost per round
(gRPC, event loops, batching, judging, the coordinator's hop) weigh as it does on a GPU. Cores are pinned as the
speedup benchmark pins them (`benchmarks.stack_runs.pinned_cores`): the verify service's passes on one core, the
draft service, the coordinator, the verify service's serving threads and the load generator on the other; the
in-process contenders on the verifier's core. Measured:
- ideal plain decoding: the project's plain loop in process (`target_only_generate`), one target step per token;
- c = draft step / target step in process, and α from the stack's speculative requests: the sequential bound
  E/(1+γc) and the overlapped ceiling E/max(1, γc) at their best γ;
- the stack, closed loop at each concurrency (the load tests' sweep, `load_tests/sweep.py`), speculative and
  plain back to back, `--runs` times with the order alternating: throughput, TTFT p50/p99, α.
The ideal runs before and after the sweep; figures are medians. Writes `serving_path.json` (`headline`: the floors
in `benchmarks/serving_path_headline.py`) and `serving_path.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace

from benchmarks.contenders import own_target_only, pinned
from benchmarks.fast_pair import FastPairShape, build_fast_pair, describe
from benchmarks.serving_path_headline import FLOORS, headline
from benchmarks.speedup_stack import stop_stack
from benchmarks.stack_runs import environment, pinned_cores, results_dir, write_json
from benchmarks.step_timing import measure_pair
from load_tests.prompts import load_prompt_set
from load_tests.sweep import Sweep, SweepConfig
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import LocalStack

PROMPT_SET = "code"


@dataclass(frozen=True)
class PathConfig:
    """What to run; see `--help`."""

    target: str = ""  # empty: the fast pair, built into a temp folder
    draft: str = ""
    concurrency: tuple[int, ...] = (1, 16, 64)
    max_new_tokens: int = 64
    runs: int = 3
    ideal_runs: int = 3  # passes of ideal plain decoding before the sweep, and as many after
    requests_c1: int = 16
    duration_s: float = 60.0
    draft_args: tuple[str, ...] = ()
    verify_args: tuple[str, ...] = ()
    coordinator_args: tuple[str, ...] = ()
    quick: bool = False


def _progress(line: str) -> None:
    print(f"[serving_path {time.strftime('%H:%M:%S')}] {line}", flush=True)


def start_pinned_stack(config: PathConfig, target: str, draft: str, pins: dict[str, str]) -> LocalStack:
    """Draft, verify and coordinator processes; the verifier's passes in a model process on its core, its serving
    threads beside the draft service and the coordinator, as a GPU host's threads run off the GPU (as the speedup
    benchmark runs it: benchmarks/speedup_stack.py)."""
    stack = LocalStack(target, draft)
    draft_cpus = ["--cpus", pins["draft"]] if pins else []
    verify_cpus = ["--cpus", pins["coordinator"], "--model-cpus", pins["verify"]] if pins else []
    replicas = {
        "draft": ("draft_service", ["--model", draft, "--threads", "1", *draft_cpus, *config.draft_args]),
        "verify": (
            "verify_service",
            ["--model", target, "--threads", "1", *verify_cpus, "--model-process", *config.verify_args],
        ),
    }
    try:
        stack.start_together(replicas)
        coordinator_cpus = ["--cpus", pins["coordinator"]] if pins else []
        stack.start_together(
            {"coordinator": ("coordinator", [*stack.wiring(), *coordinator_cpus, *config.coordinator_args])}
        )
    except BaseException:
        stop_stack(stack)
        raise
    return stack


def ideal_plain_tps(
    target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, cores: set[int] | None
) -> float:
    """Tokens/s of the in-process plain loop over the prompts, greedy, pinned to the verifier's cores."""
    run = own_target_only(target)
    tokens, seconds = 0, 0.0
    with pinned(cores, 1):
        for prompt in prompts:
            output = run(prompt, 0.0, 0, max_new_tokens)
            tokens, seconds = tokens + len(output.token_ids), seconds + output.seconds
    return tokens / seconds


def level_medians(sweep_report: dict) -> dict[int, dict[str, dict]]:
    """Per concurrency and mode: medians over the runs of throughput, TTFT p50/p99, α and tokens a round."""
    grouped: dict[int, dict[str, list[dict]]] = {}
    for level in sweep_report["levels"]:
        grouped.setdefault(level["concurrency"], {}).setdefault(level["mode"], []).append(level)
    medians: dict[int, dict[str, dict]] = {}
    for concurrency, modes in grouped.items():
        for mode, runs in modes.items():
            medians.setdefault(concurrency, {})[mode] = {
                "tps": statistics.median(r["output_token_throughput_tps"] for r in runs),
                "ttft_p50_ms": statistics.median(r["latency_ms"]["ttft"]["p50"] for r in runs),
                "ttft_p99_ms": statistics.median(r["latency_ms"]["ttft"]["p99"] for r in runs),
                "tpot_p50_ms": statistics.median(r["latency_ms"]["tpot"]["p50"] for r in runs),
                "acceptance_rate": runs[0]["speculation"]["acceptance_rate"],
                "mean_accepted_length": runs[0]["speculation"]["mean_accepted_length"],
                "tps_runs": [r["output_token_throughput_tps"] for r in runs],
            }
    return medians


def run(config: PathConfig, out_dir: pathlib.Path) -> dict:
    started = time.perf_counter()
    work = pathlib.Path(tempfile.mkdtemp(prefix="specdec-serving-path-"))
    shape = FastPairShape()
    if config.target:
        target_dir, draft_dir, pair = config.target, config.draft, {"target": config.target, "draft": config.draft}
    else:
        target_dir, draft_dir = map(str, build_fast_pair(work / "pair", shape))
        pair = {"fast_pair": describe(shape)}
        # its wide random logits (init range 0.4) differ packed and plain past the start-up self-test's tolerance
        # once the draft's LM head runs in bfloat16, which would serve it one sequence per pass
        config = replace(config, draft_args=("--no-draft-kernels", *config.draft_args))
    pins = pinned_cores(1)
    verify_cores = {int(core) for core in pins["verify"].split(",")} if pins else None
    client_cores = {int(core) for core in pins["coordinator"].split(",")} if pins else None
    target = LoadedModel.load(ModelSettings(target_dir, threads=1))
    draft = LoadedModel.load(ModelSettings(draft_dir, threads=1))
    texts = [p.prompt for p in load_prompt_set(PROMPT_SET, config.requests_c1)]
    prompts = [target.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    with pinned(verify_cores, 1):
        steps = measure_pair(target, draft, prompts[0], 1, 4, 40, 120)
    _progress(f"in process: target step {steps['target']['runtime_forward_ms']:.2f} ms, c {steps['c']:.3f}")
    ideal = [ideal_plain_tps(target, prompts, config.max_new_tokens, verify_cores) for _ in range(config.ideal_runs)]
    _progress(
        f"ideal plain: {', '.join(f'{tps:.1f}' for tps in ideal)} tok/s; starting the stack ({pins or 'unpinned'})"
    )
    stack = start_pinned_stack(config, target_dir, draft_dir, pins)
    try:
        sweep_config = SweepConfig(
            concurrency=config.concurrency,
            prompt_sets=(PROMPT_SET,),
            requests=0 if not config.quick else 8,
            duration_s=config.duration_s,
            max_new_tokens=config.max_new_tokens,
            repeats=config.runs,
            stack=f"serving_path: {asdict(config)}",
        )
        with pinned(client_cores, 1):  # the load generator runs beside the coordinator, off the verifier's core
            sweep = asyncio.run(Sweep(stack.address, sweep_config, log=_progress).run())
    finally:
        stop_stack(stack)
    ideal += [ideal_plain_tps(target, prompts, config.max_new_tokens, verify_cores) for _ in range(config.ideal_runs)]
    _progress(f"ideal plain after the sweep: {', '.join(f'{tps:.1f}' for tps in ideal[config.ideal_runs :])} tok/s")
    levels = level_medians(sweep)
    alpha = levels.get(1, levels[min(levels)])["spec"]["acceptance_rate"] or 0.0
    ideal_tps = statistics.median(ideal)
    report = {
        "headline": headline(ideal_tps, levels, alpha, steps["c"], sorted(levels)),
        "floors": FLOORS,
        "ideal_plain": {"tps": round(ideal_tps, 3), "tps_runs": [round(tps, 3) for tps in ideal]},
        "levels": {str(c): modes for c, modes in sorted(levels.items())},
        "steps": steps,
        "pair": pair,
        "pins": pins,
        "config": asdict(config),
        "sweep_comparisons": sweep["comparisons"],
        "environment": environment(load_average=os.getloadavg(), wall_s=round(time.perf_counter() - started, 1)),
    }
    write_json(out_dir / "serving_path.json", report)
    _print_headline(report["headline"])
    return report


def _print_headline(entries: dict) -> None:
    for name, entry in entries.items():
        print(
            f"  {name:40s} {entry['ratio']!s:>8} ({entry['numerator']['value']} / {entry['denominator']['value']}) "
            f"{entry['kind']} {entry['floor']}: {'meets' if entry['meets'] else 'MISSES'}",
            flush=True,
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="", help="target model directory (default: the fast pair's)")
    p.add_argument("--draft", default="", help="draft model directory (default: the fast pair's)")
    p.add_argument("--concurrency", default="1,16,64", help="closed-loop levels, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="runs of every level, modes alternating (medians)")
    p.add_argument("--duration-s", type=float, default=60.0, help="no request of a level starts after this")
    for service in ("draft", "verify", "coordinator"):
        p.add_argument(f"--{service}-arg", action="append", default=[], metavar="FLAG", help=f"extra {service} flag")
    p.add_argument("--quick", action="store_true", help="c1 and c4, one run, 16 tokens, to a temp folder")
    p.add_argument("--out-dir", type=pathlib.Path, help="where the report goes (default benchmarks/results/)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    quick = args.quick
    config = PathConfig(
        target=args.target,
        draft=args.draft,
        concurrency=(1, 4) if quick else tuple(int(c) for c in args.concurrency.split(",")),
        max_new_tokens=16 if quick else args.max_new_tokens,
        runs=1 if quick else args.runs,
        ideal_runs=1 if quick else 3,
        requests_c1=8 if quick else 16,
        duration_s=args.duration_s,
        draft_args=tuple(args.draft_arg),
        verify_args=tuple(args.verify_arg),
        coordinator_args=tuple(args.coordinator_arg),
        quick=quick,
    )
    return run(config, results_dir(args.out_dir, quick))


if __name__ == "__main__":
    main()
