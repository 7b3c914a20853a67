"""Speedup benchmark: the system against target-only decoding, HF assisted generation and the analytic bound.

    python -m benchmarks.speedup                                   # the embedded demo pair, ~10 minutes
    python -m benchmarks.speedup --quick                           # a ~1 minute smoke run
    python -m benchmarks.speedup --target DIR --draft DIR          # any pair sharing a tokenizer

Single stream (batch 1), a fixed set of prompts cut from held-out stdlib files, a fixed token budget,
greedy and temperature 1 with fixed seeds. Contenders run interleaved, repetition by repetition (the
order rotates each time), so drift on a shared machine hits them alike; figures are medians. Every
contender gets the same cores: in-process ones run on `--threads` torch threads, and the gRPC stack splits
them between its draft and verify services. Writes `speedup.json` and `speedup.png` (see README.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import transformers

from benchmarks import contenders
from benchmarks.prompt_ids import benchmark_prompts
from benchmarks.speedup_report import (
    CONTENDERS,
    HEADLINE,
    TEMPERATURES,
    Measurement,
    Repetition,
    figures,
    first_mismatches,
    plot,
    speedup_bound,
    summary_table,
)
from benchmarks.stack_runs import results_dir
from benchmarks.step_timing import measure_pair
from load_tests.sweep import environment
from specdec.client import Client
from specdec.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.local_stack import LocalStack, start_service
from specdec.model_runtime import LoadedModel, ModelSettings, check_same_vocabulary

SCHEMA_VERSION = 1
SWEEP_CONTENDERS = ("reference_loop", "grpc_overlap")


@dataclass
class BenchConfig:
    """What to run; `--help` describes each field."""

    target: str = str(DEMO_TARGET_DIR)
    draft: str = str(DEMO_DRAFT_DIR)
    gamma: int = 4
    prompts: int = 8
    prompt_tokens: int = 64
    max_new_tokens: int = 64
    repetitions: int = 3
    threads: int = 2
    seed: int = 0
    sweep_gammas: tuple[int, ...] = tuple(range(1, 9))
    sweep_prompts: int = 4
    sweep_repetitions: int = 1
    target_step_repeats: int = 40
    draft_step_repeats: int = 120
    quick: bool = False
    out_dir: str = ""  # "" = benchmarks/results/, or a temp folder for --quick runs

    @property
    def draft_threads(self) -> int:
        return max(1, self.threads // 2)

    @property
    def verify_threads(self) -> int:
        return max(1, self.threads - self.draft_threads)


QUICK = {
    "prompts": 2,
    "prompt_tokens": 32,
    "max_new_tokens": 16,
    "sweep_prompts": 1,
    "target_step_repeats": 10,
    "draft_step_repeats": 30,
}


class Progress:
    """Progress lines with the elapsed time, flushed at once."""

    def __init__(self, write: Callable[[str], None] = print):
        self.started = time.perf_counter()
        self.write = write

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def __call__(self, message: str) -> None:
        self.write(f"[{self.elapsed_s:6.1f}s] {message}")
        sys.stdout.flush()


def _rotated(names: Sequence[str], shift: int) -> list[str]:
    shift %= len(names)
    return [*names[shift:], *names[:shift]]


def run_pass(
    run: contenders.Contender, prompts: Sequence[Sequence[int]], temperature: float, seed: int, max_new_tokens: int
) -> Repetition:
    """One contender over every prompt; prompt i is sampled with seed + i."""
    return Repetition([run(prompt, temperature, seed + i, max_new_tokens) for i, prompt in enumerate(prompts)])


def start_stack(config: BenchConfig, progress: Progress) -> tuple[LocalStack, dict[str, str]]:
    """The draft and verify services with two coordinators on them: overlapped and sequential rounds.

    Both modes thus run on the very same replica processes; draft and verify split the threads. Processes
    that do not wait for each other start side by side (importing torch dominates start-up).
    """
    progress(
        f"starting the gRPC stack (draft {config.draft_threads} thread(s), verify {config.verify_threads} "
        "thread(s), coordinators with --overlap and --no-overlap) ..."
    )
    stack = LocalStack(config.target, config.draft)
    replicas = {
        "draft": ("draft_service", ["--model", config.draft, "--threads", str(config.draft_threads)]),
        "verify": ("verify_service", ["--model", config.target, "--threads", str(config.verify_threads)]),
    }
    try:
        _start_together(stack, replicas)
        wiring = [
            "--tokenizer",
            config.target,
            "--draft-replicas",
            stack.services["draft"].address,
            "--verify-replicas",
            stack.services["verify"].address,
        ]
        wiring.append("--no-adaptive-gamma")  # every round drafts the γ under test
        _start_together(
            stack,
            {
                "coordinator": ("coordinator", [*wiring, "--overlap"]),
                "coordinator-sequential": ("coordinator", [*wiring, "--no-overlap"]),
            },
        )
    except BaseException:
        stop_stack(stack)
        raise
    sequential = stack.services["coordinator-sequential"].address
    progress(f"coordinators at {stack.address} (overlap) and {sequential} (sequential); logs in {stack.log_dir}")
    return stack, {"grpc_overlap": stack.address, "grpc_sequential": sequential}


def _start_together(stack: LocalStack, services: dict[str, tuple[str, list[str]]]) -> None:
    """Starts services (name -> module, args) in parallel into stack.services; raises the first failure."""
    with concurrent.futures.ThreadPoolExecutor(len(services)) as pool:
        futures = {
            name: pool.submit(start_service, name, module, args, stack.log_dir)
            for name, (module, args) in services.items()
        }
    for name, future in futures.items():
        if future.exception() is None:
            stack.services[name] = future.result()
    for future in futures.values():
        future.result()


def stop_stack(stack: LocalStack | None) -> None:
    """SIGTERM to every service at once (they drain in parallel), then wait for each."""
    if stack is None:
        return
    for service in stack.services.values():
        if service.process.poll() is None:
            service.process.terminate()
    for service in stack.services.values():
        service.stop()


def machine_info(config: BenchConfig) -> dict:
    info = environment()
    info.update(
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        affinity_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        machine=platform.machine(),
        load_average_start=list(os.getloadavg()),
        threads={
            "in_process": config.threads,
            "grpc_draft": config.draft_threads,
            "grpc_verify": config.verify_threads,
        },
    )
    return info


def measure_steps(
    target: LoadedModel, draft: LoadedModel, context: Sequence[int], config: BenchConfig, progress: Progress
) -> tuple[dict, dict[str, float]]:
    """Step times at every thread count a contender uses, and c for each speculative contender."""
    step_times = {}
    for threads in sorted({config.threads, config.draft_threads, config.verify_threads}, reverse=True):
        progress(f"step times at {threads} thread(s) ...")
        step_times[f"threads_{threads}"] = measure_pair(
            target, draft, context, threads, config.gamma, config.target_step_repeats, config.draft_step_repeats
        )
    in_process = step_times[f"threads_{config.threads}"]
    c_grpc = (
        step_times[f"threads_{config.draft_threads}"]["draft"]["runtime_forward_ms"]
        / step_times[f"threads_{config.verify_threads}"]["target"]["runtime_forward_ms"]
    )
    progress(
        f"c = {in_process['c']:.3f} in process, {c_grpc:.3f} for the gRPC split; target step "
        f"{in_process['target']['runtime_forward_ms']:.2f} ms, draft {in_process['draft']['runtime_forward_ms']:.2f} ms"
    )
    c_by_contender = {
        "hf_assisted": in_process["c"],
        "reference_loop": in_process["c"],
        "grpc_sequential": c_grpc,
        "grpc_overlap": c_grpc,
    }
    return step_times, c_by_contender


def measure_contenders(
    runs: dict[str, contenders.Contender], prompts: Sequence[Sequence[int]], config: BenchConfig, progress: Progress
) -> dict[str, dict[str, Measurement]]:
    """Warm-up, then `repetitions` interleaved passes of every contender at both temperatures."""
    progress("warming up every contender")
    for name in CONTENDERS:
        for temperature in TEMPERATURES.values():
            runs[name](prompts[0], temperature, config.seed, min(8, config.max_new_tokens))
    measurements = {label: {name: Measurement() for name in CONTENDERS} for label in TEMPERATURES}
    for rep in range(config.repetitions):
        for label, temperature in TEMPERATURES.items():
            for name in _rotated(CONTENDERS, rep):
                repetition = run_pass(runs[name], prompts, temperature, config.seed, config.max_new_tokens)
                measurements[label][name].repetitions.append(repetition)
                progress(
                    f"rep {rep + 1}/{config.repetitions} {label:<13} {name:<16} "
                    f"{repetition.tokens_per_s:8.1f} tok/s ({repetition.tokens} tokens, {repetition.seconds:.1f}s)"
                )
    return measurements


def gamma_sweep(
    contender_set: Callable[[int], dict[str, contenders.Contender]],
    prompts: Sequence[Sequence[int]],
    baseline: float,
    c_by_contender: dict[str, float],
    config: BenchConfig,
    progress: Progress,
) -> tuple[list[dict], dict[str, list[list[int]]]]:
    """Greedy speedup, α and bound of SWEEP_CONTENDERS at each γ; also their completions, by `name@gamma=γ`."""
    points, outputs = [], {}
    for gamma in config.sweep_gammas:
        runs = contender_set(gamma)
        point = {"gamma": gamma}
        for name in SWEEP_CONTENDERS:
            measurement = Measurement(
                [
                    run_pass(runs[name], prompts, 0.0, config.seed, config.max_new_tokens)
                    for _ in range(config.sweep_repetitions)
                ]
            )
            summary = measurement.summary()
            speedup = summary["tokens_per_s"] / baseline
            bound = speedup_bound(summary["alpha"] or 0.0, gamma, c_by_contender[name])
            point[name] = {
                "tokens_per_s": summary["tokens_per_s"],
                "alpha": summary["alpha"],
                "mean_accepted_length": summary["mean_accepted_length"],
                "speedup": speedup,
                "bound": bound,
                "efficiency": speedup / bound,
            }
            outputs[f"{name}@gamma={gamma}"] = measurement.token_ids
            progress(
                f"γ sweep γ={gamma} {name:<16} {summary['tokens_per_s']:8.1f} tok/s, "
                f"α {summary['alpha'] or 0:.2f}, speedup {speedup:.2f} (bound {bound:.2f})"
            )
        points.append(point)
    return points, outputs


def run_benchmark(config: BenchConfig, progress: Progress | None = None) -> dict:
    """Runs everything, writes speedup.json and speedup.png into config.out_dir, and returns the report."""
    progress = progress or Progress()
    out_dir = results_dir(pathlib.Path(config.out_dir) if config.out_dir else None, config.quick)
    config.out_dir = str(out_dir)
    machine = machine_info(config)
    previous_threads = torch.get_num_threads()
    stack: LocalStack | None = None
    clients: dict[str, Client] = {}
    try:
        progress(f"loading target {config.target} and draft {config.draft} ({config.threads} threads)")
        target, draft = (
            LoadedModel.load(ModelSettings(path, threads=config.threads)) for path in (config.target, config.draft)
        )
        check_same_vocabulary(target.identity, draft.identity)
        prompt_set = benchmark_prompts(target.tokenizer, config.prompts, config.prompt_tokens, config.seed)
        prompts = prompt_set.token_ids
        progress(f"{len(prompts)} prompts of {config.prompt_tokens} tokens ({prompt_set.kind})")
        step_times, c_by_contender = measure_steps(target, draft, prompts[0], config, progress)
        torch.set_num_threads(config.threads)

        stack, addresses = start_stack(config, progress)
        clients = {name: Client(address) for name, address in addresses.items()}

        def contender_set(gamma: int) -> dict[str, contenders.Contender]:
            return {
                "hf_target_only": contenders.hf_target_only(target),
                "own_target_only": contenders.own_target_only(target),
                "hf_assisted": contenders.hf_assisted(target, draft, gamma),
                "reference_loop": contenders.reference_loop(target, draft, gamma),
                "grpc_sequential": contenders.grpc_stack(clients["grpc_sequential"], gamma),
                "grpc_overlap": contenders.grpc_stack(clients["grpc_overlap"], gamma),
            }

        measurements = measure_contenders(contender_set(config.gamma), prompts, config, progress)
        summaries = {
            label: {name: m.summary() for name, m in by_name.items()} for label, by_name in measurements.items()
        }
        report_figures = figures(summaries, config.gamma, c_by_contender)
        baseline = report_figures["target_only"]["greedy"]["tokens_per_s"]
        sweep_prompts = prompts[: config.sweep_prompts]
        sweep_points, sweep_outputs = gamma_sweep(
            contender_set, sweep_prompts, baseline, c_by_contender, config, progress
        )
    finally:
        for client in clients.values():
            client.close()
        stop_stack(stack)
        torch.set_num_threads(previous_threads)

    greedy_ids = {**{name: measurements["greedy"][name].token_ids for name in CONTENDERS}, **sweep_outputs}
    mismatches = {
        name: found
        for name, ids in greedy_ids.items()
        if (found := first_mismatches(greedy_ids["own_target_only"], ids))
    }
    sampled = [
        measurements["temperature_1"][name].token_ids for name in ("reference_loop", "grpc_sequential", "grpc_overlap")
    ]
    machine.update(
        load_average_end=list(os.getloadavg()),
        wall_s=round(progress.elapsed_s, 1),
        finished_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    report = {
        "schema_version": SCHEMA_VERSION,
        "headline_temperature": HEADLINE,
        "ratios": report_figures["ratios"][HEADLINE],
        "efficiency": report_figures["efficiency"][HEADLINE],
        "tokens_per_s": report_figures["tokens_per_s"],
        "target_only": report_figures["target_only"],
        "alpha": report_figures["alpha"],
        "c": c_by_contender["reference_loop"],
        "c_grpc": c_by_contender["grpc_sequential"],
        "bound": report_figures["bound"],
        "overlapped_ceiling": report_figures["overlapped_ceiling"],
        "ratios_by_temperature": report_figures["ratios"],
        "efficiency_by_temperature": report_figures["efficiency"],
        "contenders": summaries,
        "step_times_ms": step_times,
        "gamma_sweep": {
            "temperature": 0.0,
            "contenders": list(SWEEP_CONTENDERS),
            "prompts": len(sweep_prompts),
            "repetitions": config.sweep_repetitions,
            "baseline_tokens_per_s": baseline,
            "points": sweep_points,
        },
        "checks": {
            "greedy_outputs_identical": not mismatches,
            "greedy_mismatches": mismatches,
            "sampled_project_outputs_identical": all(ids == sampled[0] for ids in sampled),
        },
        "greedy_token_ids": greedy_ids,
        "prompts": {
            "kind": prompt_set.kind,
            "count": len(prompts),
            "tokens_each": config.prompt_tokens,
            "sources": prompt_set.sources,
        },
        "config": {
            **asdict(config),
            "sweep_gammas": list(config.sweep_gammas),
            "temperatures": TEMPERATURES,
            "draft_threads": config.draft_threads,
            "verify_threads": config.verify_threads,
        },
        "machine": machine,
    }
    (out_dir / "speedup.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out_dir / "speedup.png")
    return report


def _gammas(text: str) -> tuple[int, ...]:
    if "-" in text and "," not in text:
        low, high = (int(part) for part in text.split("-"))
        return tuple(range(low, high + 1))
    return tuple(int(part) for part in text.split(","))


def parser() -> argparse.ArgumentParser:
    defaults = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.speedup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=defaults.target, help="target model directory (default: the demo target)")
    p.add_argument("--draft", default=defaults.draft, help="draft model directory (default: the demo draft)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: " + ", ".join(f"{k.replace('_', '-')}={v}" for k, v in QUICK.items()),
    )
    p.add_argument("--gamma", type=int, default=defaults.gamma, help="γ of the main comparison")
    p.add_argument("--prompts", type=int, help=f"prompts in the set (default {defaults.prompts})")
    p.add_argument("--prompt-tokens", type=int, help=f"tokens per prompt (default {defaults.prompt_tokens})")
    p.add_argument("--max-new-tokens", type=int, help=f"token budget per request (default {defaults.max_new_tokens})")
    p.add_argument("--repetitions", type=int, default=defaults.repetitions, help="passes per contender (median)")
    p.add_argument(
        "--threads",
        type=int,
        default=defaults.threads,
        help="CPU threads for every contender; the gRPC stack splits them between draft and verify",
    )
    p.add_argument("--seed", type=int, default=defaults.seed, help="prompt selection and sampling seeds")
    p.add_argument("--sweep-gammas", type=_gammas, default=defaults.sweep_gammas, help="γ values, '1-8' or '1,2,4'")
    p.add_argument("--sweep-prompts", type=int, help=f"prompts per γ of the sweep (default {defaults.sweep_prompts})")
    p.add_argument("--sweep-repetitions", type=int, default=defaults.sweep_repetitions)
    p.add_argument(
        "--out-dir",
        default=defaults.out_dir,
        help="where speedup.json and speedup.png go (default benchmarks/results/; a temp folder with --quick)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    config = BenchConfig(
        target=args.target,
        draft=args.draft,
        gamma=args.gamma,
        repetitions=args.repetitions,
        threads=args.threads,
        seed=args.seed,
        sweep_gammas=args.sweep_gammas,
        sweep_repetitions=args.sweep_repetitions,
        quick=args.quick,
        out_dir=args.out_dir,
    )
    if args.quick:
        for key, value in QUICK.items():
            setattr(config, key, value)
    for key in ("prompts", "prompt_tokens", "max_new_tokens", "sweep_prompts"):
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
    config.sweep_prompts = min(config.sweep_prompts, config.prompts)
    return config


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    config = config_from_args(args)
    for side in ("target", "draft"):
        if not pathlib.Path(getattr(config, side)).is_dir():
            parser().error(
                f"--{side} {getattr(config, side)} is not a directory "
                "(train the demo pair with `python -m demo_pair.train all`, or pass a pair)"
            )
    report = run_benchmark(config)
    print()
    print(summary_table(report))
    ratios = report["ratios"]
    print(
        f"\nheadline ({report['headline_temperature']}): grpc_overlap {ratios['grpc_overlap_vs_target_only']:.2f}× "
        f"target-only, {ratios['grpc_overlap_vs_hf_assisted']:.2f}× HF assisted; grpc_sequential efficiency "
        f"{report['efficiency']['grpc_sequential']:.2f}; greedy outputs identical: "
        f"{report['checks']['greedy_outputs_identical']}"
    )
    print(f"wrote {pathlib.Path(config.out_dir) / 'speedup.json'} and {pathlib.Path(config.out_dir) / 'speedup.png'}")
    return report


if __name__ == "__main__":
    main()
