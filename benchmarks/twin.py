"""The accelerator twin as a measuring instrument: the whole stack at GPU step times, every figure simulated.

    python -m benchmarks.twin                          # both profiles and the demo pair's TTFT, ~15 min
    python -m benchmarks.twin --parts twin --profiles llama8b-h100   # one part; the report keeps the others
    python -m benchmarks.twin --quick                  # a 1-2 minute smoke run, to a temp folder

Per profile (docs/architecture.md, "The accelerator twin"): draft and verify replicas on `sim:PROFILE:VOCAB`, pinned
as the speedup benchmark pins them, with a coordinator per injected network delay (0, 0.1, 0.5 ms). At concurrency
1 each prompt runs speculative and plain through every coordinator (medians of passes), against the twin's ideal
plain decoding and the analytic bounds; per round, where the time goes (the stats' stages and each process's CPU
time); then a concurrency sweep (load_tests) spec against plain. The demo pair gets the same time-to-first-token
sweep on its real models. Writes benchmarks/results/twin.json and twin.png with a `headline` of the floors
(benchmarks/twin_headline.py); benchmarks/README.md describes every key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import statistics
import time
from dataclasses import dataclass

from benchmarks import twin_headline
from benchmarks.prompt_ids import benchmark_prompts
from benchmarks.speedup import Progress
from benchmarks.stack_runs import environment, pinned_cores, results_dir, write_report_and_png
from benchmarks.twin_delay import measure_injected_delay
from benchmarks.twin_plot import plot
from benchmarks.twin_stack import ModeRuns, run_concurrency_1, start_twin_stack
from load_tests.sweep import Sweep, SweepConfig
from specdec.engine.cpu_affinity import parse_cpus
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.engine.simulated.profiles import PROFILES, parse_twin_device
from specdec.engine.simulated.tokenizer import load_twin_tokenizer
from specdec.local_stack import LocalStack

SCHEMA_VERSION = 1
LABEL = "simulated: the accelerator twin on a CPU host, no GPU (docs/architecture.md, 'The accelerator twin')"
HEADLINE_PROFILE = "llama70b-tp4-h100"
PARTS = ("twin", "demo")


@dataclass
class TwinConfig:
    """What to run; `--help` describes each field."""

    profiles: tuple[str, ...] = tuple(PROFILES)
    parts: tuple[str, ...] = PARTS
    vocab: int = 8192
    acceptance: float = 0.75
    prompts: int = 8
    prompt_tokens: int = 64
    max_new_tokens: int = 64
    repetitions: int = 3
    delays_ms: tuple[float, ...] = (0.0, 0.1, 0.5)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    demo_concurrency: tuple[int, ...] = (1, 4, 16, 64)
    sweep_duration_s: float = 60.0
    sweep_requests: int = 0  # per level; 0 = the load tests' default, max(16, 6 x concurrency)
    full_vocab_prompts: int = 2  # concurrency-1 prompts also run at the profile's whole vocabulary (0 = skip)
    quick: bool = False
    out_dir: str = ""


QUICK = {
    "prompts": 2,
    "max_new_tokens": 16,
    "repetitions": 1,
    "delays_ms": (0.0, 0.5),
    "concurrency": (1, 16, 64),  # every level a floor names, with a few requests each
    "demo_concurrency": (1, 4),
    "sweep_requests": 4,
    "full_vocab_prompts": 1,
}


@contextlib.contextmanager
def pinned_here(cpus: str):
    """This process on `cpus` ('' = unchanged) while the block runs: it calls the stack as a client on the
    coordinators' cores."""
    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, parse_cpus(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def sweep_levels(report: dict) -> dict:
    """A load-test report's levels as 'c<N>' -> mode -> the figures the twin reports."""
    levels: dict[str, dict] = {}
    for level in report["levels"]:
        latency = level["latency_ms"]
        levels.setdefault(f"c{level['concurrency']}", {})[level["mode"]] = {
            "tokens_per_s": level["output_token_throughput_tps"],
            "requests": level["ok"],
            "errors": level["errors"],
            "e2e_p50_ms": latency["e2e"]["p50"],
            "e2e_p99_ms": latency["e2e"]["p99"],
            "ttft_p50_ms": latency["ttft"]["p50"],
            "ttft_p99_ms": latency["ttft"]["p99"],
            "acceptance_rate": level["speculation"]["acceptance_rate"],
            "mean_accepted_length": level["speculation"]["mean_accepted_length"],
        }
    for modes in levels.values():
        spec, plain = modes["spec"], modes["plain"]
        modes["spec_vs_plain"] = {
            "throughput": round(spec["tokens_per_s"] / plain["tokens_per_s"], 4),
            "ttft_p50": round(spec["ttft_p50_ms"] / plain["ttft_p50_ms"], 4),
            "ttft_p99": round(spec["ttft_p99_ms"] / plain["ttft_p99_ms"], 4),
            "e2e_p50": round(spec["e2e_p50_ms"] / plain["e2e_p50_ms"], 4),
        }
    return levels


def run_sweep(address: str, config: TwinConfig, concurrency: tuple[int, ...], gamma: int | None, progress) -> dict:
    """The load tests' closed-loop sweep on the code prompts, speculative against plain."""
    sweep = SweepConfig(
        concurrency=concurrency,
        prompt_sets=("code",),
        max_new_tokens=config.max_new_tokens,
        num_speculative_tokens=gamma,
        duration_s=config.sweep_duration_s,
        requests=config.sweep_requests,
    )
    return sweep_levels(asyncio.run(Sweep(address, sweep, log=progress).run()))


def concurrency_1_figures(runs: dict[float, dict[str, list[ModeRuns]]], ideal: float, analysis: dict) -> dict:
    """Per delay, per mode the medians over passes, and the ratios to the ideal plain decoding and the bounds."""
    figures: dict = {"ideal_plain_tokens_per_s": round(ideal, 3)}
    for delay, by_mode in runs.items():
        at_delay = {}
        for mode, passes in by_mode.items():
            every = [p.figures() for p in passes]
            merged = ModeRuns(
                [run for p in passes for run in p.runs], {k: sum(p.cpu_s[k] for p in passes) for k in passes[0].cpu_s}
            )
            at_delay[mode] = {
                **merged.figures(),
                "tokens_per_s": round(statistics.median(f["tokens_per_s"] for f in every), 3),
            }
            at_delay[mode]["tokens_per_s_passes"] = [f["tokens_per_s"] for f in every]
            at_delay[mode]["vs_ideal_plain"] = round(at_delay[mode]["tokens_per_s"] / ideal, 4)
        spec = at_delay["speculative"]["vs_ideal_plain"]
        at_delay["speculative_vs_sequential_bound"] = round(spec / analysis["sequential_bound"]["speedup"], 4)
        at_delay["speculative_vs_overlapped_ceiling"] = round(spec / analysis["overlapped_ceiling"]["speedup"], 4)
        figures[f"{delay:g}"] = at_delay
    return figures


def per_round(c1: dict) -> dict:
    """Where a round's time goes at concurrency 1 without delay, per mode (ms per round)."""
    out = {}
    for mode in ("plain", "speculative"):
        figures = c1["0"][mode]
        out[mode] = {
            "server_ms": figures["server_ms_per_round"],
            "verify_pass_ms": figures["verify_ms_per_round"],
            "verify_judge_ms": figures["sampling_ms_per_round"],
            "wire_ms": figures["wire_ms_per_round"],
            "draft_ms": figures["draft_ms_per_round"],
            "cpu_ms": figures["cpu_ms_per_round"],
            "tokens_per_round": figures["mean_accepted_length"],
        }
    return out


def run_profile(name: str, config: TwinConfig, pins: dict[str, str], progress: Progress) -> dict:
    """Every figure of one profile."""
    twin = parse_twin_device(f"sim:{name}:{config.vocab}")
    prompts = benchmark_prompts(load_twin_tokenizer(config.vocab), config.prompts, config.prompt_tokens).token_ids
    analysis = twin_headline.analytic(
        twin.profile, config.acceptance, config.prompt_tokens + config.max_new_tokens // 2
    )
    gamma = analysis["overlapped_ceiling"]["gamma"]
    ideal = twin_headline.ideal_plain_tokens_per_s(twin.profile, [len(p) for p in prompts], config.max_new_tokens)
    progress(f"{name}: c {analysis['c']}, request γ {gamma}, ideal plain {ideal:.1f} tok/s (simulated)")
    stack, addresses = start_twin_stack(twin.spec, config.acceptance, config.delays_ms, pins, progress)
    try:
        with pinned_here(pins.get("coordinator", "")):
            runs = run_concurrency_1(
                stack, addresses, prompts, gamma, config.max_new_tokens, config.repetitions, progress
            )
            delays = asyncio.run(measure_injected_delay(stack.services["verify"].address, config.delays_ms))
            progress(f"{name}: concurrency sweep {config.concurrency} ...")
            sweep = run_sweep(stack.address, config, config.concurrency, gamma, progress)
    finally:
        stack.stop()
    c1 = concurrency_1_figures(runs, ideal, analysis)
    report = {
        "device": twin.spec,
        "placements": {role: placement_record(twin.profile, role) for role in ("target", "draft")},
        "analytic": analysis,
        "request_gamma": gamma,
        "concurrency_1": c1,
        "per_round": per_round(c1),
        "injected_delay": delays,
        "sweep": sweep,
    }
    if config.full_vocab_prompts:
        report["full_vocabulary"] = run_full_vocabulary(name, config, prompts, gamma, pins, progress)
    report["headline"] = {**twin_headline.concurrency_1_entries(c1, analysis), **twin_headline.sweep_entries(sweep)}
    return report


def run_full_vocabulary(name: str, config: TwinConfig, prompts, gamma: int, pins: dict[str, str], progress) -> dict:
    """Concurrency 1 at the profile's whole vocabulary, for the host time that V-wide rows cost on this CPU."""
    device = f"sim:{name}"
    stack, addresses = start_twin_stack(device, config.acceptance, (0.0,), pins, progress)
    try:
        with pinned_here(pins.get("coordinator", "")):
            runs = run_concurrency_1(
                stack, addresses, prompts[: config.full_vocab_prompts], gamma, config.max_new_tokens, 1, progress
            )
    finally:
        stack.stop()
    return {"device": parse_twin_device(device).spec, **{mode: r[0].figures() for mode, r in runs[0.0].items()}}


def placement_record(profile, role: str) -> dict:
    placement = profile.placement(role)
    model = placement.model
    return {
        "model": model.name,
        "gpu": placement.gpu.name,
        "tensor_parallel": placement.tensor_parallel,
        "parameters": model.params,
        "weight_bytes": model.weight_bytes,
        "kv_bytes_per_position": model.kv_bytes_per_position,
    }


def run_demo(config: TwinConfig, pins: dict[str, str], progress: Progress) -> dict:
    """The time-to-first-token sweep on the demo pair (real models on the CPU), pinned like the twin."""
    cpus = {name: ["--cpus", pins[name]] if pins else [] for name in ("draft", "verify", "coordinator")}
    stack = LocalStack(str(DEMO_TARGET_DIR), str(DEMO_DRAFT_DIR), cpus["draft"], cpus["verify"], cpus["coordinator"])
    progress(f"demo pair: sweep {config.demo_concurrency} ...")
    with stack, pinned_here(pins.get("coordinator", "")):
        sweep = run_sweep(stack.address, config, config.demo_concurrency, None, progress)
    entries = twin_headline.sweep_entries(sweep)
    return {"sweep": sweep, "headline": {key: entries[key] for key in twin_headline.TTFT_FLOORS if key in entries}}


def headline(profiles: dict, demo: dict | None) -> dict:
    """The headline profile's floors at the top, every profile's under its name, the demo pair's TTFT ones."""
    top = profiles.get(HEADLINE_PROFILE, {}).get("headline", {})
    return {
        "label": LABEL,
        "profile": HEADLINE_PROFILE,
        **top,
        **{name: profile["headline"] for name, profile in profiles.items()},
        "demo_pair": demo["headline"] if demo else {},
        "floors": {key: {"floor": floor, "side": side} for key, (floor, side) in twin_headline.FLOORS.items()},
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.twin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    csv = lambda kind: lambda raw: tuple(kind(part) for part in raw.split(",") if part)  # noqa: E731
    defaults = TwinConfig()
    p.add_argument("--profiles", type=csv(str), default=defaults.profiles, help=f"among {', '.join(PROFILES)}")
    p.add_argument("--parts", type=csv(str), default=defaults.parts, help="twin (the profiles) and/or demo")
    p.add_argument("--vocab", type=int, default=defaults.vocab, help="token ids the twin serves")
    p.add_argument("--acceptance", type=float, default=defaults.acceptance, help="the draft's calibrated greedy α")
    p.add_argument("--prompts", type=int, default=defaults.prompts)
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--repetitions", type=int, default=defaults.repetitions, help="concurrency-1 passes (medians)")
    p.add_argument("--concurrency", type=csv(int), default=defaults.concurrency)
    p.add_argument("--demo-concurrency", type=csv(int), default=defaults.demo_concurrency)
    p.add_argument(
        "--sweep-duration-s", type=float, default=defaults.sweep_duration_s, help="most seconds a sweep level runs"
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run, to a temp folder unless --out-dir")
    p.add_argument("--out-dir", default="", help="where twin.json and twin.png go [benchmarks/results]")
    return p


def config_from(argv: list[str] | None) -> TwinConfig:
    args = vars(parser().parse_args(argv))
    config = TwinConfig(**args)
    if config.quick:
        config = dataclasses.replace(
            config, **{k: v for k, v in QUICK.items() if getattr(config, k) == getattr(TwinConfig(), k)}
        )
    unknown = set(config.profiles) - set(PROFILES) or set(config.parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown profiles or parts: {sorted(unknown)}")
    return config


def main(argv: list[str] | None = None) -> dict:
    config = config_from(argv)
    progress = Progress()
    out_dir = results_dir(pathlib.Path(config.out_dir) if config.out_dir else None, config.quick)
    path = out_dir / "twin.json"
    kept = json.loads(path.read_text()) if path.exists() else {}  # parts not run this time stay as they were
    pins = pinned_cores(1)
    started = time.perf_counter()
    profiles = dict(kept.get("profiles", {}))
    if "twin" in config.parts:
        for name in config.profiles:
            profiles[name] = run_profile(name, config, pins, progress)
    demo = run_demo(config, pins, progress) if "demo" in config.parts else kept.get("demo_pair")
    report = {
        "schema_version": SCHEMA_VERSION,
        "simulated": True,
        "label": LABEL,
        "headline": headline(profiles, demo),
        "profiles": profiles,
        "demo_pair": demo,
        "config": {**dataclasses.asdict(config), "cpus": pins or None},
        "environment": environment(wall_s=round(time.perf_counter() - started, 1)),
    }
    write_report_and_png(path, report, plot)
    progress(summary(report))
    return report


def summary(report: dict) -> str:
    lines = ["headline (simulated):"]
    for scope in [*report["profiles"], "demo_pair"]:
        for key, item in report["headline"].get(scope, {}).items():
            lines.append(
                f"  {scope} {key}: {item['ratio']} (floor {item['floor']} {item['side']}, meets {item['meets']})"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
