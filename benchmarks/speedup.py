"""Speedup benchmark: the system against target-only decoding, HF assisted generation and the analytic bound.

    python -m benchmarks.speedup                                   # the embedded demo pair, ~10 minutes
    python -m benchmarks.speedup --quick                           # a ~1 minute smoke run
    python -m benchmarks.speedup --pair smollm2                    # SmolLM2 and its draft, held-out chat prompts
    python -m benchmarks.speedup --target DIR --draft DIR          # any pair sharing a tokenizer

Single stream (batch 1), fixed prompt sets (for a code pair: token windows cut from held-out stdlib files, and
input-grounded prompts quoting a held-out function; for a chat pair: held-out chat prompts rendered by the
target's chat template; the first set is the headline's), a fixed token budget, greedy and temperature 1 with
fixed seeds. Contenders run interleaved, repetition by repetition (the order rotates each time), so drift
on a shared machine hits them alike; figures are medians. The gRPC stack's verify service runs on one core
group and its draft service (with the coordinators and this client) on another; in-process contenders run
pinned to the verifier's cores on as many torch threads, except `hf_assisted_all_cores`, which gets both
groups. The `headline` holds four ratios of the stack against those (`benchmarks/speedup_headline.py`).
Writes `speedup.json` and `speedup.png` (see README.md).
"""

from __future__ import annotations

import argparse
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
from benchmarks.pairs import PAIR_NAMES, model_pair
from benchmarks.prompt_ids import PromptSet, benchmark_prompt_sets
from benchmarks.speedup_headline import headline, headline_table
from benchmarks.speedup_report import (
    CONTENDERS,
    HEADLINE,
    SPECULATIVE,
    TEMPERATURES,
    Measurement,
    Repetition,
    agreement_checks,
    figures,
    plot,
    speedup_bound,
    summary_table,
)
from benchmarks.speedup_stack import start_stack, stop_stack
from benchmarks.stack_runs import pinned_cores, results_dir
from benchmarks.step_timing import measure_pair
from load_tests.sweep import environment
from specdec.client import Client
from specdec.engine.cpu_affinity import parse_cpus
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.engine.model_runtime import LoadedModel, ModelSettings, check_same_vocabulary
from specdec.local_stack import LocalStack

SCHEMA_VERSION = 2
SWEEP_CONTENDERS = ("reference_loop", "grpc_overlap")


@dataclass
class BenchConfig:
    """What to run; `--help` describes each field."""

    target: str = str(DEMO_TARGET_DIR)
    draft: str = str(DEMO_DRAFT_DIR)
    prompt_set: str = "code"  # "code" (code and grounded sets) or "chat" (a chat pair's)
    gamma: int = 4
    prompts: int = 8
    prompt_tokens: int = 64
    max_new_tokens: int = 64
    repetitions: int = 3
    threads: int = 1
    seed: int = 0
    sweep_gammas: tuple[int, ...] = tuple(range(1, 9))
    sweep_prompts: int = 4
    sweep_repetitions: int = 1
    target_step_repeats: int = 40
    draft_step_repeats: int = 120
    quick: bool = False
    out_dir: str = ""  # "" = benchmarks/results/, or a temp folder for --quick runs

    @property
    def all_cores_threads(self) -> int:
        """Torch threads of `hf_assisted_all_cores`: the draft's and the verifier's core groups together."""
        return 2 * self.threads


CoreGroups = dict[str, set[int] | None]  # "verify", "draft", "all" -> cores (None: unpinned)


def core_groups(threads: int) -> tuple[dict[str, str], CoreGroups]:
    """--cpus of the stack's processes and the core sets in-process contenders pin to; empty and None when the
    machine has fewer than 2 × threads cores (then nothing is pinned)."""
    pins = pinned_cores(threads)
    if not pins:
        return {}, {"verify": None, "draft": None, "all": None}
    verify, draft = parse_cpus(pins["verify"]), parse_cpus(pins["draft"])
    return pins, {"verify": verify, "draft": draft, "all": verify | draft}


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


def machine_info(config: BenchConfig, pins: dict[str, str]) -> dict:
    info = environment()
    info.update(
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        affinity_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        machine=platform.machine(),
        load_average_start=list(os.getloadavg()),
        threads={
            "in_process": config.threads,
            "all_cores": config.all_cores_threads,
            "grpc_draft": config.threads,
            "grpc_verify": config.threads,
        },
        cpus=pins or None,
    )
    return info


def measure_steps(
    target: LoadedModel,
    draft: LoadedModel,
    context: Sequence[int],
    config: BenchConfig,
    cores: CoreGroups,
    progress: Progress,
) -> tuple[dict, dict[str, float]]:
    """Step times on the verifier's cores and on all of them, and c for each speculative contender."""
    step_times = {}
    for threads, where in ((config.all_cores_threads, cores["all"]), (config.threads, cores["verify"])):
        progress(f"step times at {threads} thread(s) on cores {sorted(where) if where else 'any'} ...")
        with contenders.pinned(where, threads):
            step_times[f"threads_{threads}"] = measure_pair(
                target, draft, context, threads, config.gamma, config.target_step_repeats, config.draft_step_repeats
            )
    one_group, all_cores = step_times[f"threads_{config.threads}"], step_times[f"threads_{config.all_cores_threads}"]
    progress(
        f"c = {one_group['c']:.3f} on one core group, {all_cores['c']:.3f} on all; target step "
        f"{one_group['target']['runtime_forward_ms']:.2f} ms, draft {one_group['draft']['runtime_forward_ms']:.2f} ms"
    )
    c_by_contender = {name: one_group["c"] for name in SPECULATIVE}  # the stack: each model on one group
    c_by_contender["hf_assisted_all_cores"] = all_cores["c"]
    return step_times, c_by_contender


def measure_contenders(
    runs: dict[str, contenders.Contender],
    prompt_sets: dict[str, PromptSet],
    config: BenchConfig,
    progress: Progress,
) -> dict[str, dict[str, dict[str, Measurement]]]:
    """Warm-up, then `repetitions` interleaved passes of every contender at both temperatures on every
    prompt set: prompt set -> temperature label -> contender -> Measurement."""
    progress("warming up every contender")
    for name in CONTENDERS:
        for prompt_set in prompt_sets.values():
            for temperature in TEMPERATURES.values():
                runs[name](prompt_set.token_ids[0], temperature, config.seed, min(8, config.max_new_tokens))
    measurements = {
        set_name: {label: {name: Measurement() for name in CONTENDERS} for label in TEMPERATURES}
        for set_name in prompt_sets
    }
    for rep in range(config.repetitions):
        for label, temperature in TEMPERATURES.items():
            for set_name, prompt_set in prompt_sets.items():
                for name in _rotated(CONTENDERS, rep):
                    repetition = run_pass(
                        runs[name], prompt_set.token_ids, temperature, config.seed, config.max_new_tokens
                    )
                    measurements[set_name][label][name].repetitions.append(repetition)
                    progress(
                        f"rep {rep + 1}/{config.repetitions} {label:<13} {set_name:<8} {name:<21} "
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
    pins, cores = core_groups(config.threads)
    machine = machine_info(config, pins)
    previous_threads = torch.get_num_threads()
    stack: LocalStack | None = None
    clients: dict[str, Client] = {}
    try:
        progress(f"loading target {config.target} and draft {config.draft}")
        target = LoadedModel.load(ModelSettings(config.target))
        draft = LoadedModel.load(ModelSettings(config.draft, draft_kernels=True))  # as the draft service runs it
        check_same_vocabulary(target.identity, draft.identity)
        torch.set_num_threads(config.all_cores_threads)  # unpinned: torch's worker threads may use every core
        prompt_sets = benchmark_prompt_sets(
            target.tokenizer, config.prompts, config.prompt_tokens, config.seed, config.prompt_set
        )
        primary = next(iter(prompt_sets))  # the headline's set
        for set_name, prompt_set in prompt_sets.items():
            lengths = [len(ids) for ids in prompt_set.token_ids]
            progress(f"{set_name}: {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens ({prompt_set.kind})")
        step_times, c_by_contender = measure_steps(
            target, draft, prompt_sets[primary].token_ids[0], config, cores, progress
        )

        stack, addresses = start_stack(config.target, config.draft, config.threads, pins, progress)
        clients = {name: Client(address) for name, address in addresses.items()}
        on, one, verifier, drafter = contenders.on_cores, config.threads, cores["verify"], cores["draft"]

        def contender_set(gamma: int) -> dict[str, contenders.Contender]:
            """In-process contenders on the verifier's cores (or all); gRPC calls from the drafter's."""
            return {
                "hf_target_only": on(contenders.hf_target_only(target), verifier, one),
                "own_target_only": on(contenders.own_target_only(target), verifier, one),
                "grpc_plain": on(contenders.grpc_stack(clients["grpc_overlap"], 0), drafter, one),
                "hf_assisted": on(contenders.hf_assisted(target, draft, gamma), verifier, one),
                "hf_assisted_all_cores": on(
                    contenders.hf_assisted(target, draft, gamma), cores["all"], config.all_cores_threads
                ),
                "reference_loop": on(contenders.reference_loop(target, draft, gamma), verifier, one),
                "grpc_sequential": on(contenders.grpc_stack(clients["grpc_sequential"], gamma), drafter, one),
                "grpc_overlap": on(contenders.grpc_stack(clients["grpc_overlap"], gamma), drafter, one),
            }

        measurements = measure_contenders(contender_set(config.gamma), prompt_sets, config, progress)
        summaries = {
            set_name: {label: {name: m.summary() for name, m in by_name.items()} for label, by_name in by_label.items()}
            for set_name, by_label in measurements.items()
        }
        by_set = {set_name: figures(summaries[set_name], config.gamma, c_by_contender) for set_name in summaries}
        report_figures = by_set[primary]
        baseline = report_figures["target_only"]["greedy"]["tokens_per_s"]
        sweep_prompts = prompt_sets[primary].token_ids[: config.sweep_prompts]
        sweep_points, sweep_outputs = gamma_sweep(
            contender_set, sweep_prompts, baseline, c_by_contender, config, progress
        )
    finally:
        for client in clients.values():
            client.close()
        stop_stack(stack)
        torch.set_num_threads(previous_threads)

    checks, greedy_ids = agreement_checks(measurements, sweep_outputs, primary)
    machine.update(
        load_average_end=list(os.getloadavg()),
        wall_s=round(progress.elapsed_s, 1),
        finished_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    report = {
        "schema_version": SCHEMA_VERSION,
        "headline": headline({set_name: f["tokens_per_s"] for set_name, f in by_set.items()}, primary),
        "headline_temperature": HEADLINE,
        "ratios": report_figures["ratios"][HEADLINE],
        "efficiency": report_figures["efficiency"][HEADLINE],
        "tokens_per_s": report_figures["tokens_per_s"],
        "target_only": report_figures["target_only"],
        "alpha": report_figures["alpha"],
        "c": c_by_contender["reference_loop"],
        "c_grpc": c_by_contender["grpc_sequential"],
        "c_all_cores": c_by_contender["hf_assisted_all_cores"],
        "bound": report_figures["bound"],
        "overlapped_ceiling": report_figures["overlapped_ceiling"],
        "ratios_by_temperature": report_figures["ratios"],
        "efficiency_by_temperature": report_figures["efficiency"],
        "contenders": summaries[primary],
        "prompt_sets": {
            set_name: {
                "tokens_per_s": f["tokens_per_s"],
                "target_only": f["target_only"],
                "alpha": f["alpha"],
                "ratios_by_temperature": f["ratios"],
                "contenders": summaries[set_name],
            }
            for set_name, f in by_set.items()
        },
        "step_times_ms": step_times,
        "gamma_sweep": {
            "temperature": 0.0,
            "contenders": list(SWEEP_CONTENDERS),
            "prompts": len(sweep_prompts),
            "repetitions": config.sweep_repetitions,
            "baseline_tokens_per_s": baseline,
            "points": sweep_points,
        },
        "checks": checks,
        "greedy_token_ids": greedy_ids[primary],
        "greedy_token_ids_grounded": greedy_ids.get("grounded", {}),
        "prompts": {
            set_name: {
                "kind": prompt_set.kind,
                "count": len(prompt_set.token_ids),
                "tokens_each": [len(ids) for ids in prompt_set.token_ids],
                "sources": prompt_set.sources,
            }
            for set_name, prompt_set in prompt_sets.items()
        },
        "config": {
            **asdict(config),
            "sweep_gammas": list(config.sweep_gammas),
            "temperatures": TEMPERATURES,
            "all_cores_threads": config.all_cores_threads,
            "cpus": pins or None,
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
    p.add_argument(
        "--pair", choices=PAIR_NAMES, help="a pair and its prompt set: demo (code prompts) or smollm2 (chat prompts)"
    )
    p.add_argument("--target", default=defaults.target, help="target model directory (default: the demo target)")
    p.add_argument("--draft", default=defaults.draft, help="draft model directory (default: the demo draft)")
    p.add_argument("--prompt-set", choices=("code", "chat"), default=defaults.prompt_set, help="prompts for --target")
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
        help="torch threads (and cores) of each core group: the verify service, the draft service, and the "
        "in-process contenders pinned to the verifier's; hf_assisted_all_cores gets twice as many",
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
    pair = model_pair(args.pair) if args.pair else None
    config = BenchConfig(
        target=pair.target if pair else args.target,
        draft=pair.draft if pair else args.draft,
        prompt_set=pair.prompt_set if pair else args.prompt_set,
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
        if not pathlib.Path(getattr(config, side)).exists():
            parser().error(
                f"--{side} {getattr(config, side)} is not a directory "
                "(train the demo pair with `python -m demo_pair.train all`, or pass a pair)"
            )
    report = run_benchmark(config)
    print()
    print(summary_table(report))
    print()
    print(headline_table(report["headline"]))
    top = report["headline"]
    print(
        f"\nheadline ({top['temperature']}, {top['prompt_set']}): the stack "
        f"{top['stack_vs_target_only_same_verifier']['ratio']:.2f}× target-only on the verifier's core, "
        f"{top['stack_vs_hf_assisted_same_verifier']['ratio']:.2f}× HF assisted there, "
        f"{top['stack_vs_hf_assisted_all_cores']['ratio']:.2f}× HF assisted on all cores; plain stack "
        f"{top['plain_stack_vs_in_process']['ratio']:.2f}× in process; greedy outputs identical: "
        f"{report['checks']['greedy_outputs_identical']}"
    )
    print(f"wrote {pathlib.Path(config.out_dir) / 'speedup.json'} and {pathlib.Path(config.out_dir) / 'speedup.png'}")
    return report


if __name__ == "__main__":
    main()
