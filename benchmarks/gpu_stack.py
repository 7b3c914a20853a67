"""The whole stack on one device for the GPU step benchmark: draft, verify and coordinator processes on
loopback, speculative (γ fixed) against plain decoding (γ 0) through the same processes, at each concurrency.

The services need the project's serving dependencies (grpc health and reflection, OpenTelemetry, Redis's client,
dnspython, the protobuf runtime its stubs were generated for); `missing_stack_module` finds out in a child
process, before any model directory is written, so a machine without them skips the phase and says why.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
ENTRY_POINTS = ("draft_service.__main__", "verify_service.__main__", "coordinator.__main__", "specdec.client")
_IMPORT_CHECK = f"""
import importlib, sys
for name in {ENTRY_POINTS!r}:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        sys.exit(f"module {{error.name!r}} is missing (imported by {{name}})")
    except Exception as error:
        sys.exit(f"{{name}} does not import: {{type(error).__name__}}: {{error}}")
"""


def missing_stack_module() -> str | None:
    """Why the services cannot start here (the first module they miss), or None when they can."""
    check = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    if check.returncode == 0:
        return None
    return (check.stderr.strip().splitlines() or [f"exit code {check.returncode}"])[-1]


def run_concurrent(address: str, prompts: Sequence[list[int]], concurrency: int, timeout_s: float, **request) -> dict:
    """Sends every prompt, `concurrency` requests in flight at once, each on its own channel; returns the
    figures over the batch's wall time and the completions."""
    from benchmarks.stack_runs import timed_generate, totals
    from specdec.client import Client

    def one(prompt: list[int]):
        with Client(address, timeout_s=timeout_s) as client:
            return timed_generate(client, prompt, **request)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(one, prompts))
    wall_s = time.perf_counter() - started
    figures = totals(runs)
    return {
        **figures,
        "concurrency": concurrency,
        "wall_s": round(wall_s, 4),
        "tokens_per_s_wall": round(figures["tokens"] / wall_s, 3),
        "token_ids": [run.token_ids for run in runs],
    }


def run_stack(
    target_dir: pathlib.Path,
    draft_dir: pathlib.Path,
    service_args: Sequence[str],
    prompts_by_concurrency: dict[int, list[list[int]]],
    max_new_tokens: int,
    gamma: int,
    deadline: float,
) -> dict:
    """Starts the stack once and runs, per concurrency, plain then speculative over the same prompts (greedy);
    a pass that would start past `deadline` (time.monotonic) is skipped and named."""
    from specdec.local_stack import LocalStack

    started = time.perf_counter()
    coordinator_args = ["--no-adaptive-gamma", "--no-speculation-gate"]  # every round drafts the γ asked for
    report: dict = {"gamma": gamma, "max_new_tokens": max_new_tokens, "coordinator_args": coordinator_args}
    with LocalStack(
        str(target_dir),
        str(draft_dir),
        draft_args=service_args,
        verify_args=service_args,
        coordinator_args=coordinator_args,
    ) as stack:
        report["startup_s"] = round(time.perf_counter() - started, 2)
        print(f"  stack up in {report['startup_s']:.1f}s (logs in {stack.log_dir})", flush=True)
        modes = {"plain": 0, "speculative": gamma}
        warm_prompt = next(iter(prompts_by_concurrency.values()))[0]
        for mode_gamma in modes.values():  # first requests allocate caches and warm the kernels
            run_concurrent(stack.address, [warm_prompt], 1, 600.0, max_new_tokens=4, num_speculative_tokens=mode_gamma)
        for concurrency, prompts in prompts_by_concurrency.items():
            passes: dict = {}
            for mode, mode_gamma in modes.items():
                if time.monotonic() > deadline:
                    passes[mode] = {"skipped": "time budget spent"}
                    continue
                timeout_s = max(deadline - time.monotonic(), 30.0)
                try:
                    passes[mode] = run_concurrent(
                        stack.address,
                        prompts,
                        concurrency,
                        timeout_s,
                        max_new_tokens=max_new_tokens,
                        num_speculative_tokens=mode_gamma,
                    )
                except Exception as error:  # a pass past its deadline (or failing) is reported; the others stand
                    passes[mode] = {"error": f"{type(error).__name__}: {error}"[:1000]}
                    print(f"  c{concurrency} {mode}: failed: {passes[mode]['error']}", flush=True)
                    continue
                print(
                    f"  c{concurrency} {mode}: {passes[mode]['tokens_per_s_wall']:.1f} tokens/s "
                    f"(α {passes[mode]['acceptance_rate']}) in {passes[mode]['wall_s']:.1f}s",
                    flush=True,
                )
            if all("tokens" in figures for figures in passes.values()):
                plain, speculative = passes["plain"], passes["speculative"]
                passes["speedup"] = round(speculative["tokens_per_s_wall"] / plain["tokens_per_s_wall"], 4)
                passes["greedy_outputs_identical"] = plain["token_ids"] == speculative["token_ids"]
            report[f"concurrency_{concurrency}"] = passes
    return report
