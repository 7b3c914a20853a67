"""The accelerator twin with several replicas: placement and batching when more than one replica serves, simulated.

    python -m benchmarks.twin_scale            # 4 draft x 2 verify against 1 x 1, c16/64/128, ~10 min
    python -m benchmarks.twin_scale --quick    # a short smoke run, to a temp folder

One set of twin replicas (docs/architecture.md, "The accelerator twin", "The scale run") behind two coordinators:
one over all of them (4 draft x 2 verify by default) and one over the first of each kind (1 x 1), so both stacks
talk to the same processes on the same cores. The load tests' closed-loop sweep runs every level on both
coordinators, speculative and plain back to back with the order alternating, `repeats` times; throughput, latency
and time to first token are medians over the runs. Around each level every replica's /metrics is scraped, which
says how many sessions each replica took and how many calls each of its model steps batched. Writes
benchmarks/results/twin_scale.json and twin_scale.png with a `headline` (benchmarks/README.md describes the keys).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks import twin_headline
from benchmarks.replica_metrics import ReplicaMetrics, figures, spread
from benchmarks.speedup import Progress
from benchmarks.stack_runs import environment, pinned_cores, results_dir, write_report_and_png
from benchmarks.twin import HEADLINE_PROFILE, pinned_here
from benchmarks.twin_scale_plot import plot
from benchmarks.twin_stack import cpu_seconds
from load_tests.report import BASELINE, STACK
from load_tests.sweep import Sweep, SweepConfig
from specdec.engine.simulated.profiles import PROFILES, parse_twin_device
from specdec.local_stack import LocalStack, twin_stack
from specdec.redis_server import free_port

SCHEMA_VERSION = 1
LABEL = "simulated: the accelerator twin on a CPU host, no GPU (docs/architecture.md, 'The scale run')"
SINGLE = "coordinator-1x1"  # the baseline stack's coordinator, over the first replica of each kind
FIGURES = ("tokens_per_s", "e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms", "ttft_p99_ms")


@dataclass
class ScaleConfig:
    """What to run; `--help` describes each field."""

    profile: str = HEADLINE_PROFILE
    vocab: int = 8192
    acceptance: float = 0.75
    draft_replicas: int = 4
    verify_replicas: int = 2
    concurrency: tuple[int, ...] = (16, 64, 128)
    max_new_tokens: int = 64
    waves: int = 3  # requests a level = waves x concurrency
    repeats: int = 3
    level_duration_s: float = 30.0
    quick: bool = False
    out_dir: str = ""

    @property
    def scaled(self) -> str:
        return f"{self.draft_replicas}x{self.verify_replicas}"


QUICK = {"concurrency": (8,), "max_new_tokens": 16, "waves": 1, "repeats": 1}


def start_stacks(config: ScaleConfig, device: str, pins: dict[str, str], progress) -> tuple[LocalStack, dict]:
    """The replicas, each with a metrics port, the scaled coordinator over all of them and the 1 x 1 one over the
    first of each kind; returns the stack and the replicas' metrics ports by name."""
    cpus = {name: ["--cpus", pins[name]] if pins else [] for name in ("draft", "verify", "coordinator")}
    stack = twin_stack(
        device,
        draft_args=["--sim-acceptance", str(config.acceptance), *cpus["draft"]],
        verify_args=cpus["verify"],
        coordinator_args=cpus["coordinator"],
        draft_replicas=config.draft_replicas,
        verify_replicas=config.verify_replicas,
    )
    names = [*stack.replica_names("draft"), *stack.replica_names("verify")]
    ports = {name: free_port() for name in names}
    stack.replica_args = {name: ["--metrics-port", str(port)] for name, port in ports.items()}
    progress(f"starting {config.scaled} replicas on {device} (α {config.acceptance}; pinned {pins or 'nowhere'}) ...")
    try:
        stack.start()
        stack.start_together({SINGLE: ("coordinator", [*stack.wiring(1, 1), *cpus["coordinator"]])})
    except BaseException:
        stack.stop()
        raise
    progress(f"stack up: {', '.join(f'{n} {s.address}' for n, s in stack.services.items())}; logs in {stack.log_dir}")
    return stack, ports


class LevelWatch:
    """Around each load level: every replica's metrics and the CPU time of every stack process and of this one."""

    def __init__(self, ports: dict[str, int], pids: dict[str, int]):
        self.metrics = ReplicaMetrics(ports)
        self.pids = {**pids, "client": os.getpid()}

    def probe(self, level) -> Callable[[], dict]:
        """A load_tests LevelProbe: {"replicas": their metrics' differences, "cpu_s": per process, "wall_s"}."""
        replicas = self.metrics.probe(level)
        before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        started = time.perf_counter()

        def finish() -> dict:
            wall_s = time.perf_counter() - started
            cpu_s = {name: round(cpu_seconds(pid) - before[name], 3) for name, pid in self.pids.items()}
            return {"replicas": replicas(), "cpu_s": cpu_s, "wall_s": round(wall_s, 3)}

        return finish


def host_load(levels: list[dict], pins: dict[str, str], tokens: int) -> dict:
    """Over some levels: how busy each pinned core group was (its processes' CPU seconds over the wall time, 1.0 =
    one core's worth) and each process's CPU milliseconds a generated token."""
    cpu_s = {name: sum(level["probe"]["cpu_s"][name] for level in levels) for name in levels[0]["probe"]["cpu_s"]}
    wall_s = sum(level["probe"]["wall_s"] for level in levels)
    groups: dict[str, float] = {}
    for name, seconds in cpu_s.items():
        cpus = pins.get(name.split("-")[0], pins.get("coordinator", "")) if pins else "unpinned"
        groups[cpus] = groups.get(cpus, 0.0) + seconds
    return {
        "busy_cores_by_cpus": {cpus: round(seconds / wall_s, 3) for cpus, seconds in groups.items()},
        "cpu_ms_per_token": {name: round(seconds * 1e3 / tokens, 4) for name, seconds in cpu_s.items() if seconds},
    }


def level_figures(level: dict) -> dict:
    latency = level["latency_ms"]
    return {
        "tokens_per_s": level["output_token_throughput_tps"],
        "e2e_p50_ms": latency["e2e"]["p50"],
        "e2e_p99_ms": latency["e2e"]["p99"],
        "ttft_p50_ms": latency["ttft"]["p50"],
        "ttft_p99_ms": latency["ttft"]["p99"],
        "errors": level["errors"],
        "acceptance_rate": level["speculation"]["acceptance_rate"],
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 4) if numerator is not None and denominator else None


def placement(levels: list[dict], replicas: list[str]) -> dict:
    """A stack's replicas over some levels (its runs of one concurrency and mode): each one's sessions and
    batching, and how evenly the sessions spread per kind."""
    counted = levels[0]["probe"]["replicas"][replicas[0]]
    per_replica = {
        name: figures({key: sum(level["probe"]["replicas"][name][key] for level in levels) for key in counted})
        for name in replicas
    }
    kinds = {kind: [n for n in replicas if n.split("-")[0] == kind] for kind in ("draft", "verify")}
    return {
        "replicas": per_replica,
        "session_spread": {kind: spread([per_replica[n]["sessions"] for n in names]) for kind, names in kinds.items()},
    }


def summarize(swept: list[dict], stack_replicas: dict[str, list[str]], pins: dict[str, str]) -> dict:
    """'c<N>' -> stack (1x1, the scaled one) -> mode -> medians over the runs and the placement, with spec/plain
    and scaled/1x1 ratios."""
    out: dict = {}
    by_key: dict[tuple, list[dict]] = {}
    for level in swept:
        by_key.setdefault((level["concurrency"], level["stack"], level["mode"]), []).append(level)
    for (concurrency, stack, mode), runs in sorted(by_key.items()):
        every = [level_figures(level) for level in runs]
        medians = {key: round(statistics.median(f[key] for f in every), 3) for key in FIGURES}
        at = out.setdefault(f"c{concurrency}", {}).setdefault(stack, {})
        at[mode] = {
            **medians,
            "tokens_per_s_runs": [f["tokens_per_s"] for f in every],
            "errors": sum(f["errors"] for f in every),
            "acceptance_rate": every[0]["acceptance_rate"],
            "placement": placement(runs, stack_replicas[stack]),
            "host": host_load(runs, pins, sum(level["output_tokens"] for level in runs)),
        }
    for stacks in out.values():
        for modes in stacks.values():
            spec, plain = modes["spec"], modes["plain"]
            modes["spec_vs_plain"] = {
                "throughput": ratio(spec["tokens_per_s"], plain["tokens_per_s"]),
                "ttft_p50": ratio(spec["ttft_p50_ms"], plain["ttft_p50_ms"]),
                "ttft_p99": ratio(spec["ttft_p99_ms"], plain["ttft_p99_ms"]),
                "e2e_p50": ratio(spec["e2e_p50_ms"], plain["e2e_p50_ms"]),
            }
    return out


def scaling(levels: dict, scaled: str) -> dict:
    """Per level and mode, the scaled stack's throughput and latencies over the 1 x 1 stack's."""
    return {
        label: {
            mode: {key: ratio(stacks[scaled][mode][key], stacks["1x1"][mode][key]) for key in FIGURES}
            for mode in ("spec", "plain")
        }
        for label, stacks in levels.items()
    }


def headline(levels: dict, scaled: str, profile: str) -> dict:
    """The twin's throughput and TTFT floors at the scaled stack's levels, and the scaled/1x1 throughput beside."""
    by_mode = {label: stacks[scaled] for label, stacks in levels.items()}
    return {
        "label": LABEL,
        "profile": profile,
        "stack": scaled,
        **twin_headline.sweep_entries(by_mode),
        "floors": {
            key: {"floor": floor, "side": side}
            for key, (floor, side) in twin_headline.FLOORS.items()
            if key.startswith(("speculative_vs_plain", "ttft_p99"))
        },
    }


def run_sweeps(config: ScaleConfig, stack: LocalStack, ports: dict[str, int], gamma: int, progress) -> list[dict]:
    """Every level on both coordinators (one load-test sweep a concurrency, `waves` x concurrency requests a level),
    each replica's metrics and every process's CPU time probed around each level; the levels of every sweep."""
    pids = {name: service.process.pid for name, service in stack.services.items()}
    levels = []
    for concurrency in config.concurrency:
        sweep_config = SweepConfig(
            concurrency=(concurrency,),
            prompt_sets=("code",),
            max_new_tokens=config.max_new_tokens,
            num_speculative_tokens=gamma,
            duration_s=config.level_duration_s,
            requests=config.waves * concurrency,
            repeats=config.repeats,
            stack=f"{config.scaled} replicas",
            baseline=f"1 x 1 replicas ({SINGLE}: the first replica of each kind)",
        )
        progress(f"c{concurrency}: {config.scaled} against 1 x 1, spec and plain, {config.repeats} runs ...")
        sweep = Sweep(
            stack.address,
            sweep_config,
            log=progress,
            baseline_address=stack.services[SINGLE].address,
            level_probe=LevelWatch(ports, pids).probe,
        )
        levels.extend(asyncio.run(sweep.run())["levels"])
    return levels


def run(config: ScaleConfig, progress: Progress) -> dict:
    """Every figure of the scale run."""
    twin = parse_twin_device(f"sim:{config.profile}:{config.vocab}")
    analysis = twin_headline.analytic(twin.profile, config.acceptance, 64 + config.max_new_tokens // 2)
    gamma = analysis["overlapped_ceiling"]["gamma"]
    pins = pinned_cores(1)
    stack, ports = start_stacks(config, twin.spec, pins, progress)
    try:
        with pinned_here(pins.get("coordinator", "")):
            swept = run_sweeps(config, stack, ports, gamma, progress)
    finally:
        stack.stop()
    scaled = config.scaled
    stack_replicas = {
        STACK: [*stack.replica_names("draft"), *stack.replica_names("verify")],
        BASELINE: ["draft", "verify"],
    }
    levels = {
        label: {scaled if side == STACK else "1x1": modes for side, modes in sides.items()}
        for label, sides in summarize(swept, stack_replicas, pins).items()
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "simulated": True,
        "label": LABEL,
        "headline": headline(levels, scaled, config.profile),
        "device": twin.spec,
        "analytic": analysis,
        "request_gamma": gamma,
        "processes": {
            name: {"cpus": pins.get(name.split("-")[0]) if pins else None, "address": service.address}
            for name, service in stack.services.items()
        },
        "levels": levels,
        "scaled_vs_1x1": scaling(levels, scaled),
        "config": {**dataclasses.asdict(config), "cpus": pins or None},
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.twin_scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = ScaleConfig()
    p.add_argument("--profile", default=defaults.profile, choices=tuple(PROFILES))
    p.add_argument("--vocab", type=int, default=defaults.vocab, help="token ids the twin serves")
    p.add_argument("--acceptance", type=float, default=defaults.acceptance, help="the draft's calibrated greedy α")
    p.add_argument("--draft-replicas", type=int, default=defaults.draft_replicas)
    p.add_argument("--verify-replicas", type=int, default=defaults.verify_replicas)
    p.add_argument(
        "--concurrency", type=lambda raw: tuple(int(c) for c in raw.split(",") if c), default=defaults.concurrency
    )
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--waves", type=int, default=defaults.waves, help="requests a level, in multiples of concurrency")
    p.add_argument("--repeats", type=int, default=defaults.repeats, help="runs of every level (medians)")
    p.add_argument("--level-duration-s", type=float, default=defaults.level_duration_s, help="most seconds a level")
    p.add_argument("--quick", action="store_true", help="a short smoke run, to a temp folder unless --out-dir")
    p.add_argument("--out-dir", default="", help="where twin_scale.json and twin_scale.png go [benchmarks/results]")
    return p


def config_from(argv: list[str] | None) -> ScaleConfig:
    config = ScaleConfig(**vars(parser().parse_args(argv)))
    if config.quick:
        config = dataclasses.replace(
            config, **{k: v for k, v in QUICK.items() if getattr(config, k) == getattr(ScaleConfig(), k)}
        )
    return config


def main(argv: list[str] | None = None) -> dict:
    config = config_from(argv)
    progress = Progress()
    out_dir = results_dir(pathlib.Path(config.out_dir) if config.out_dir else None, config.quick)
    started = time.perf_counter()
    report = run(config, progress)
    report["environment"] = environment(wall_s=round(time.perf_counter() - started, 1))
    path = out_dir / "twin_scale.json"
    write_report_and_png(path, report, plot)
    progress(summary(report))
    return report


def summary(report: dict) -> str:
    lines = [f"simulated, {report['device']}; spec/plain throughput and scaled/1x1 (tokens/s):"]
    for label, stacks in report["levels"].items():
        for stack, modes in stacks.items():
            spread_of = modes["spec"]["placement"]["session_spread"]
            busy = modes["spec"]["host"]["busy_cores_by_cpus"]
            spec, plain = modes["spec"]["tokens_per_s"], modes["plain"]["tokens_per_s"]
            lines.append(
                f"  {label} {stack}: spec {spec:.0f}, plain {plain:.0f} ({modes['spec_vs_plain']['throughput']}x);"
                f" session spread draft {spread_of['draft']},"
                f" verify {spread_of['verify']}; spec's busy cores by cpus {busy}"
            )
    for key, item in report["headline"].items():
        if isinstance(item, dict) and "ratio" in item:
            lines.append(f"  {key}: {item['ratio']} (floor {item['floor']} {item['side']}, meets {item['meets']})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
