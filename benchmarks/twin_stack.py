"""The twin benchmark's stack and its concurrency-1 runs.

One draft and one verify replica on the twin device, pinned as the speedup benchmark pins them (the draft service,
the coordinators and this process on the draft's core group, the verify service on its own), and one coordinator per
injected network delay on those same replicas. At concurrency 1 each prompt runs speculative and plain through every
coordinator back to back (the order rotating), and the CPU time each stack process spends on a request is read
from /proc around it, so the host time of a round can be split by process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from benchmarks.stack_runs import RequestRun, timed_generate, totals
from specdec.client import Client
from specdec.local_stack import LocalStack, twin_stack

PROCESSES = ("coordinator", "verify", "draft")  # whose CPU time a round is split by


def delay_name(delay_ms: float) -> str:
    return f"coordinator-delay-{delay_ms:g}ms"


def start_twin_stack(
    device: str, acceptance: float, delays_ms: Sequence[float], pins: dict[str, str], progress: Callable[[str], None]
) -> tuple[LocalStack, dict[float, str]]:
    """The replicas and a coordinator per delay; returns the stack and each delay's coordinator address."""
    cpus = {name: ["--cpus", pins[name]] if pins else [] for name in ("draft", "verify", "coordinator")}
    stack = twin_stack(
        device,
        draft_args=["--sim-acceptance", str(acceptance), *cpus["draft"]],
        verify_args=cpus["verify"],
        coordinator_args=cpus["coordinator"],
    )
    progress(f"starting the twin stack on {device} (α {acceptance}; pinned {pins or 'nowhere'}) ...")
    try:
        stack.start()  # its own coordinator has no delay
        delayed = [*stack.wiring(), *cpus["coordinator"], "--replica-network-delay-ms"]
        stack.start_together({delay_name(d): ("coordinator", [*delayed, f"{d:g}"]) for d in delays_ms if d})
    except BaseException:
        stack.stop()
        raise
    addresses = {delay: stack.services[delay_name(delay)].address if delay else stack.address for delay in delays_ms}
    progress(f"stack up: coordinators {addresses}; logs in {stack.log_dir}")
    return stack, addresses


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class ModeRuns:
    """One mode's requests through one coordinator, with the CPU time each stack process spent on them."""

    runs: list[RequestRun] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PROCESSES, 0.0))

    def figures(self) -> dict:
        figures = totals(self.runs)
        rounds = figures["rounds"] or 1
        figures["cpu_ms_per_round"] = {name: round(s * 1e3 / rounds, 3) for name, s in self.cpu_s.items()}
        return figures


def run_concurrency_1(
    stack: LocalStack,
    addresses: dict[float, str],
    prompts: Sequence[Sequence[int]],
    gamma: int,
    max_new_tokens: int,
    repetitions: int,
    progress: Callable[[str], None],
) -> dict[float, dict[str, list[ModeRuns]]]:
    """Every prompt, speculative (γ `gamma`, the policy free below it) and plain (γ 0), through every coordinator,
    in `repetitions` passes: delay -> mode -> one ModeRuns per pass."""
    pids = {name: stack.services[name].process.pid for name in ("verify", "draft")}
    modes = {"speculative": gamma, "plain": 0}
    results = {delay: {mode: [ModeRuns() for _ in range(repetitions)] for mode in modes} for delay in addresses}
    clients = {delay: Client(address) for delay, address in addresses.items()}
    try:
        for client in clients.values():  # warm every path once
            for gamma_of_mode in modes.values():
                timed_generate(client, prompts[0], max_new_tokens=8, num_speculative_tokens=gamma_of_mode)
        for repetition in range(repetitions):
            for index, prompt in enumerate(prompts):
                order = [(d, m) for d in addresses for m in modes]
                shift = (repetition + index) % len(order)
                for delay, mode in order[shift:] + order[:shift]:
                    coordinator = stack.services[delay_name(delay) if delay else "coordinator"].process.pid
                    watched = {"coordinator": coordinator, **pids}
                    before = {name: cpu_seconds(pid) for name, pid in watched.items()}
                    run = timed_generate(
                        clients[delay], prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=modes[mode]
                    )
                    into = results[delay][mode][repetition]
                    into.runs.append(run)
                    for name, pid in watched.items():
                        into.cpu_s[name] += cpu_seconds(pid) - before[name]
            progress(f"concurrency 1: pass {repetition + 1}/{repetitions} done")
    finally:
        for client in clients.values():
            client.close()
    return results
