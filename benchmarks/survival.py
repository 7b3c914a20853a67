"""Requests that survive: memory pressure, a dead verify replica, a rolling restart, minutes of random kills.

    python -m benchmarks.survival                        # kv_pressure, verify_kill, rolling_restart (~10 min)
    python -m benchmarks.survival --scenarios chaos      # five minutes of random SIGKILLs (~8 min)
    python -m benchmarks.survival --quick                # every scenario, small, into a temp folder

Each scenario adds its section to benchmarks/results/survival.json (the others stay) and its entry to `headline`:
- kv_pressure: 16 concurrent greedy requests against a verify replica whose KV budget holds a quarter of their
  working set, and against one with the default budget, runs alternating: requests refused, outputs equal to the
  unlimited replica's, tokens/s of each (median of the runs) and their ratio, preemptions and queue waits;
- verify_kill: one of two verify replicas SIGKILLed at concurrency 8 (greedy and seeded requests): failed requests,
  outputs equal to an undisturbed pass;
- rolling_restart: SIGTERM one verify replica, wait until it is back and serving, then the other, under
  concurrency 8: failed requests, how long each drain took, its exit code;
- chaos: random SIGKILLs of drafters, verify replicas and coordinators (each restarted at its address) with clients
  retrying by request_id over the Redis journal: requests completed, identical, and the failed attempts, split
  into those while every verify replica was down (UNAVAILABLE is then the answer), while their coordinator was
  killed, and any other.
Cores as in the other gRPC benchmarks (benchmarks/stack_runs.pinned_cores): drafters and coordinators share one,
verify replicas the other.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import pathlib
import statistics
import tempfile
import time
import urllib.request

import torch
from transformers import AutoConfig, AutoTokenizer

from benchmarks.fleet import FleetProcess, stop_all
from benchmarks.prompt_ids import benchmark_prompts
from benchmarks.stack_runs import environment, pinned_cores, results_dir, write_json
from benchmarks.survival_chaos import run_chaos
from benchmarks.survival_load import RequestSpec, closed_loop, tally
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.engine.kv.budget import block_bytes
from specdec.redis_server import RedisServer, free_port

SCENARIOS = ("kv_pressure", "verify_kill", "rolling_restart", "chaos")
BLOCK_SIZE = 16
CONCURRENCY = 8
GRACE_S = 30
PLACEMENT_S = 4  # a replica serving again is in the coordinator's placement within its probe (1 s) and reconnect (2 s)
QUEUE_METRICS = ("specdec_preemptions_total", "specdec_queue_wait_seconds_count", "specdec_queue_wait_seconds_sum")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Setup:
    """The demo pair, the prompts, and where each role's processes run and log."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.quick = args.quick
        self.target, self.draft = str(args.target), str(args.draft)
        tokenizer = AutoTokenizer.from_pretrained(self.target)
        count = 8 if self.quick else 16
        self.prompts = benchmark_prompts(tokenizer, count, args.prompt_tokens).token_ids
        self.cores = pinned_cores(1)
        self.log_dir = pathlib.Path(tempfile.mkdtemp(prefix="specdec-survival-"))
        self.processes: list[FleetProcess] = []
        config = AutoConfig.from_pretrained(self.target)
        self.block_bytes = block_bytes(config, torch.float32, BLOCK_SIZE)

    def specs(self, max_new_tokens: int, seeded: bool) -> list[RequestSpec]:
        """One greedy request per prompt; with seeded, also one seeded request (temperature 1) per prompt."""
        specs = [RequestSpec(tuple(p), max_new_tokens) for p in self.prompts]
        return specs + [RequestSpec(tuple(p), max_new_tokens, seed=i + 1) for i, p in enumerate(self.prompts)] * seeded

    def process(self, kind: str, name: str, *args: str) -> FleetProcess:
        model = {"draft": ("--model", self.draft), "verify": ("--model", self.target)}.get(kind, ())
        cpus = ("--cpus", self.cores[kind]) if self.cores else ()
        process = FleetProcess(kind, name, (*model, *cpus, *args), self.log_dir)
        self.processes.append(process)
        return process

    def coordinator(self, name: str, drafts, verifies, *args: str) -> FleetProcess:
        wiring = ("--tokenizer", self.target, "--draft-replicas", ",".join(d.address for d in drafts))
        wiring += ("--verify-replicas", ",".join(v.address for v in verifies))
        return self.process("coordinator", name, *wiring, *args)

    def start(self, *processes: FleetProcess) -> None:
        """Starts replicas first, at once (each mostly loads its model), then coordinators."""
        for group in (
            [p for p in processes if p.kind != "coordinator"],
            [p for p in processes if p.kind == "coordinator"],
        ):
            with concurrent.futures.ThreadPoolExecutor(max(len(group), 1)) as pool:
                list(pool.map(FleetProcess.start, group))
            if group:
                log(f"started {', '.join(f'{p.name} at {p.address}' for p in group)}")

    def close(self) -> None:
        stop_all(self.processes)


def headline_count(failed: int, requests: int) -> dict:
    """A headline entry held to zero failures: (failed, requests), the ceiling, whether it meets it."""
    return {"failed": failed, "requests": requests, "ceiling": 0, "meets": failed == 0 and requests > 0}


def kv_pressure(setup: Setup) -> dict:
    max_new = 48 if setup.quick else 200
    specs = setup.specs(max_new, seeded=False)
    working_set = sum(-(-(len(s.prompt_ids) + max_new) // BLOCK_SIZE) for s in specs)
    budget_blocks = max(working_set // 4, 1)
    metrics_port = free_port()
    draft = setup.process("draft", "draft")
    budget = ("--kv-cache-budget", str(budget_blocks * setup.block_bytes), "--metrics-port", str(metrics_port))
    limited = setup.process("verify", "verify-limited", *budget)
    unlimited = setup.process("verify", "verify-unlimited")
    coordinators = {
        "limited": setup.coordinator("coordinator-limited", [draft], [limited]),
        "unlimited": setup.coordinator("coordinator-unlimited", [draft], [unlimited]),
    }
    setup.start(draft, limited, unlimited, *coordinators.values())
    runs: dict[str, list[dict]] = {"limited": [], "unlimited": []}
    outcomes: dict[str, list] = {"limited": [], "unlimited": []}
    for run in range(2 if setup.quick else 3):
        for mode in ("limited", "unlimited") if run % 2 == 0 else ("unlimited", "limited"):
            started = time.perf_counter()
            done = asyncio.run(closed_loop([coordinators[mode].address], specs, len(specs), count=len(specs)))
            seconds = time.perf_counter() - started
            outcomes[mode].extend(done)
            tokens = sum(len(o.tokens) for o in done if o.ok)
            runs[mode].append(
                {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 2)}
            )
            log(
                f"kv_pressure run {run}, {mode}: {tokens} tokens in {seconds:.1f}s, "
                f"{sum(not o.ok for o in done)} failed"
            )
    reference = [
        next((o.tokens for o in outcomes["unlimited"] if o.ok and o.spec == i), None) for i in range(len(specs))
    ]
    median = {mode: statistics.median(r["tokens_per_s"] for r in runs[mode]) for mode in runs}
    limited_counts = tally(outcomes["limited"], reference)
    return {
        "config": {
            "requests_per_run": len(specs),
            "concurrency": len(specs),
            "prompt_tokens": len(specs[0].prompt_ids),
            "max_new_tokens": max_new,
            "working_set_blocks": working_set,
            "budget_blocks": budget_blocks,
            "kv_queue_limit": 64,
        },
        "limited": {**limited_counts, "runs": runs["limited"]},
        "unlimited": {**tally(outcomes["unlimited"], reference), "runs": runs["unlimited"]},
        "refused": limited_counts["failed_by_code"].get("RESOURCE_EXHAUSTED", 0),
        "throughput_limited_vs_unlimited": {
            "ratio": round(median["limited"] / median["unlimited"], 3),
            "limited_tokens_per_s": median["limited"],
            "unlimited_tokens_per_s": median["unlimited"],
        },
        "limited_verify_metrics": scrape(metrics_port, QUEUE_METRICS),
    }


def two_verifiers(setup: Setup) -> tuple[list[FleetProcess], FleetProcess]:
    """A drafter, verify replicas A and B (draining for up to GRACE_S) and a coordinator over both, started."""
    draft = setup.process("draft", "draft")
    verifies = [setup.process("verify", f"verify-{name}", "--grace-s", str(GRACE_S)) for name in "ab"]
    coordinator = setup.coordinator("coordinator", [draft], verifies)
    setup.start(draft, *verifies, coordinator)
    return verifies, coordinator


def verify_kill(setup: Setup, verifies: list[FleetProcess], coordinator: FleetProcess, specs) -> tuple[dict, list]:
    """An undisturbed pass, then the same requests with verify replica A SIGKILLed a third of the way through."""
    started = time.perf_counter()
    undisturbed = asyncio.run(closed_loop([coordinator.address], specs, CONCURRENCY, count=len(specs)))
    seconds = time.perf_counter() - started
    reference = [next((o.tokens for o in undisturbed if o.ok and o.spec == i), None) for i in range(len(specs))]
    log(f"verify_kill: undisturbed pass of {len(specs)} requests in {seconds:.1f}s")

    async def disturbed() -> list:
        load = asyncio.ensure_future(closed_loop([coordinator.address], specs, CONCURRENCY, count=len(specs)))
        await asyncio.sleep(seconds / 3)
        verifies[0].kill()
        log("verify_kill: SIGKILLed verify-a")
        return await load

    outcomes = asyncio.run(disturbed())
    counts = tally(outcomes, reference)
    log(f"verify_kill: {counts['failed']} of {counts['requests']} failed, {counts['identical']} identical")
    verifies[0].start()
    time.sleep(PLACEMENT_S)
    return {
        "config": {"requests": len(specs), "concurrency": CONCURRENCY, "killed_after_s": round(seconds / 3, 2)},
        "undisturbed": tally(undisturbed, reference),
        "killed": counts,
    }, reference


def rolling_restart(setup: Setup, verifies: list[FleetProcess], coordinator: FleetProcess, specs, reference) -> dict:
    """Load at concurrency 8 while each verify replica in turn gets SIGTERM, drains, exits and comes back."""
    drains = []

    def restart_each() -> None:
        time.sleep(3)
        for replica in verifies:
            code, drain_s = replica.terminate(GRACE_S + 30)
            started = time.monotonic()
            replica.start()
            drains.append(
                {
                    "replica": replica.name,
                    "exit_code": code,
                    "drain_s": round(drain_s, 2),
                    "restart_s": round(time.monotonic() - started, 2),
                }
            )
            log(f"rolling_restart: {replica.name} drained in {drain_s:.1f}s (exit {code}), serving again")
            time.sleep(PLACEMENT_S)  # the coordinator's health probe puts it back into placement

    async def run() -> list:
        stop = asyncio.Event()
        load = asyncio.ensure_future(closed_loop([coordinator.address], specs, CONCURRENCY, stop=stop))
        await asyncio.get_running_loop().run_in_executor(None, restart_each)
        stop.set()
        return await load

    counts = tally(asyncio.run(run()), reference)
    log(f"rolling_restart: {counts['failed']} of {counts['requests']} failed, {counts['identical']} identical")
    return {"config": {"concurrency": CONCURRENCY, "grace_s": GRACE_S}, "drains": drains, **counts}


def scrape(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """Prometheus samples of a service's /metrics whose names start with one of `names`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith(names) and not line.startswith("#")
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="kv_pressure,verify_kill,rolling_restart", help=f"of {SCENARIOS}")
    parser.add_argument("--quick", action="store_true", help="small versions, into a temp folder")
    parser.add_argument("--chaos-s", type=float, default=300.0, help="how long the chaos scenario kills")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--target", default=str(DEMO_TARGET_DIR))
    parser.add_argument("--draft", default=str(DEMO_DRAFT_DIR))
    parser.add_argument("--out-dir", type=pathlib.Path)
    args = parser.parse_args(argv)
    scenarios = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    path = results_dir(args.out_dir, args.quick) / "survival.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    setup = Setup(args)
    log(f"logs in {setup.log_dir}")
    try:
        sections = run_scenarios(setup, scenarios)
    finally:
        setup.close()
    report.update(sections)
    report.setdefault("environment", {})[",".join(scenarios)] = environment(cores=setup.cores, quick=args.quick)
    report["headline"] = headline(report)
    write_json(path, report)
    print(json.dumps(report["headline"], indent=2))


def run_scenarios(setup: Setup, scenarios: list[str]) -> dict:
    sections = {}
    if "kv_pressure" in scenarios:
        sections["kv_pressure"] = kv_pressure(setup)
        setup.close()
    if "verify_kill" in scenarios or "rolling_restart" in scenarios:
        specs = setup.specs(32 if setup.quick else 128, seeded=True)
        verifies, coordinator = two_verifiers(setup)
        sections["verify_kill"], reference = verify_kill(setup, verifies, coordinator, specs)
        if "rolling_restart" in scenarios:
            sections["rolling_restart"] = rolling_restart(setup, verifies, coordinator, specs, reference)
        setup.close()
    if "chaos" in scenarios:
        with RedisServer() as redis:
            sections["chaos"] = run_chaos(setup, redis.url, 60.0 if setup.quick else setup.args.chaos_s)
    return sections


def headline(report: dict) -> dict:
    """Per scenario present, its figure held to a floor (or a ceiling of 0 failures)."""
    entries = {}
    if "kv_pressure" in report:
        section = report["kv_pressure"]
        entries["kv_pressure_refused"] = headline_count(section["refused"], section["limited"]["requests"])
        entries["kv_pressure_identical"] = headline_count(
            section["limited"]["differing"], section["limited"]["succeeded"]
        )
        entries["kv_pressure_throughput_limited_vs_unlimited"] = section["throughput_limited_vs_unlimited"]
    for name in ("verify_kill", "rolling_restart"):
        if name in report:
            section = report[name]["killed"] if name == "verify_kill" else report[name]
            entries[f"{name}_failed"] = headline_count(section["failed"], section["requests"])
            entries[f"{name}_identical"] = headline_count(section["differing"], section["succeeded"])
    if "chaos" in report:
        entries.update(report["chaos"]["headline"])
    return entries


if __name__ == "__main__":
    main()
