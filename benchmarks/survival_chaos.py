"""The survival benchmark's chaos scenario: random SIGKILLs of drafters, verify replicas and coordinators.

Two of each serve, the coordinators journaling into one Redis. Every few seconds (5-15, a seeded draw) one process
that is up is SIGKILLed and restarted at its address. Clients send greedy and seeded requests at concurrency 8, each
with a request_id, and retry a failed attempt on the other coordinator, as a journaled deployment's clients would.
Every request must complete with the tokens of an undisturbed pass. A failed attempt is put down to:
- `coordinator_down`: its coordinator was killed while it ran, or was down when it was sent (or back for less than
  RECONNECT_S, the clients' reconnect);
- `every_verify_replica_down`: it ended while no verify replica was up (or within RECOVERY_S of one coming back,
  the coordinator's health probe), answered UNAVAILABLE;
- `other`: anything else, which the stack should never cause.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Sequence

from benchmarks.fleet import FleetProcess
from benchmarks.survival_load import Attempt, closed_loop, tally

KILL_EVERY_S = (5.0, 15.0)
RECONNECT_S = 2.0  # a coordinator back is reached within the clients' reconnect backoff (1 s)
RECOVERY_S = 5.0  # a verify replica back is in placement within the coordinators' probe (1 s) + reconnect (2 s)
JOURNAL_ARGS = ("--lease-s", "2", "--lease-wait-s", "10", "--registry-ttl-s", "3", "--registry-refresh-s", "0.5")
CONCURRENCY = 8


class Timeline:
    """When each process went down (killed) and came back (serving again), on the monotonic clock."""

    def __init__(self, processes: Sequence[FleetProcess]):
        self.down: dict[str, list[list[float]]] = {p.name: [] for p in processes}  # per process [killed, back]
        self.lock = threading.Lock()

    def killed(self, name: str) -> None:
        with self.lock:
            self.down[name].append([time.monotonic(), float("inf")])

    def back(self, name: str) -> None:
        with self.lock:
            self.down[name][-1][1] = time.monotonic()

    def was_down(self, name: str, start: float, end: float, slack_s: float = 0.0) -> bool:
        """Whether the process was down at some time in [start, end] (each outage extended by slack_s)."""
        return any(killed <= end and back + slack_s >= start for killed, back in self.down[name])

    def all_down(self, names: Sequence[str], slack_s: float) -> list[tuple[float, float]]:
        """The intervals during which every process of `names` was down (each extended by slack_s)."""
        edges = sorted({t for name in names for window in self.down[name] for t in window if t != float("inf")})
        spans = []
        for start, end in zip(edges, edges[1:]):
            middle = (start + end) / 2
            if all(self.was_down(name, middle, middle) for name in names):
                spans.append((start, end + slack_s))
        return spans


def kill_randomly(processes: Sequence[FleetProcess], timeline: Timeline, seconds: float, seed: int = 0) -> list:
    """Kills a random process that is up every KILL_EVERY_S, restarting each in a thread of its own, for `seconds`;
    returns the (seconds since start, name) of each kill and waits for the restarts."""
    rng = random.Random(seed)
    started = time.monotonic()
    restarts: list[threading.Thread] = []
    kills = []
    restarting: set[str] = set()

    def restart(process: FleetProcess) -> None:
        try:
            process.start()
            timeline.back(process.name)
        finally:
            restarting.discard(process.name)

    while time.monotonic() - started < seconds:
        time.sleep(rng.uniform(*KILL_EVERY_S))
        up = [p for p in processes if p.alive and p.name not in restarting]
        if not up:
            continue
        victim = rng.choice(up)
        restarting.add(victim.name)
        timeline.killed(victim.name)  # before the signal: its callers may see it gone at once
        victim.kill()
        kills.append((round(time.monotonic() - started, 1), victim.name))
        print(f"chaos: +{kills[-1][0]:.0f}s SIGKILL {victim.name}", flush=True)
        thread = threading.Thread(target=restart, args=(victim,), daemon=True)
        thread.start()
        restarts.append(thread)
    for thread in restarts:
        thread.join()
    return kills


def cause(attempt: Attempt, coordinators: Sequence[FleetProcess], timeline: Timeline, outages) -> str:
    if timeline.was_down(coordinators[attempt.coordinator].name, attempt.started, attempt.ended, RECONNECT_S):
        return "coordinator_down"
    if attempt.code == "UNAVAILABLE" and any(start <= attempt.ended <= end for start, end in outages):
        return "every_verify_replica_down"
    return "other"


def run_chaos(setup, redis_url: str, seconds: float) -> dict:
    drafts = [setup.process("draft", f"draft-{i}") for i in range(2)]
    verifies = [setup.process("verify", f"verify-{i}") for i in range(2)]
    coordinators = [
        setup.coordinator(f"coordinator-{i}", drafts, verifies, "--redis-url", redis_url, *JOURNAL_ARGS)
        for i in range(2)
    ]
    setup.start(*drafts, *verifies, *coordinators)
    specs = setup.specs(32 if setup.quick else 64, seeded=True)
    addresses = [c.address for c in coordinators]
    undisturbed = asyncio.run(closed_loop(addresses, specs, CONCURRENCY, count=len(specs)))
    reference = [next((o.tokens for o in undisturbed if o.ok and o.spec == i), None) for i in range(len(specs))]
    print(f"chaos: undisturbed pass of {len(specs)} requests done; killing for {seconds:.0f}s", flush=True)
    processes = [*drafts, *verifies, *coordinators]
    timeline = Timeline(processes)

    async def run() -> tuple[list, list]:
        stop = asyncio.Event()
        load = asyncio.ensure_future(closed_loop(addresses, specs, CONCURRENCY, stop=stop, retry_for_s=300.0))
        kills = await asyncio.get_running_loop().run_in_executor(None, kill_randomly, processes, timeline, seconds)
        stop.set()
        return kills, await load

    kills, outcomes = asyncio.run(run())
    outages = timeline.all_down([v.name for v in verifies], RECOVERY_S)
    causes: dict[str, dict[str, int]] = {}
    for outcome in outcomes:
        for attempt in outcome.attempts:
            if attempt.code != "OK":
                by_code = causes.setdefault(cause(attempt, coordinators, timeline, outages), {})
                by_code[attempt.code] = by_code.get(attempt.code, 0) + 1
    counts = tally(outcomes, reference)
    other = sum(causes.get("other", {}).values())
    not_identical = counts["requests"] - counts["identical"]
    print(f"chaos: {counts['identical']} of {counts['requests']} identical, failed attempts {causes}", flush=True)
    return {
        "config": {
            "seconds": seconds,
            "kill_every_s": KILL_EVERY_S,
            "concurrency": CONCURRENCY,
            "requests_per_pass": len(specs),
            "max_new_tokens": specs[0].max_new_tokens,
        },
        "kills": kills,
        "kills_by_kind": {
            kind: sum(name.startswith(kind) for _, name in kills) for kind in ("draft", "verify", "coordinator")
        },
        "every_verify_replica_down_s": round(sum(end - start - RECOVERY_S for start, end in outages), 1),
        **counts,
        "attempts": sum(len(o.attempts) for o in outcomes),
        "failed_attempts_by_cause": causes,
        "headline": {
            "chaos_completed_identically": {
                "failed": not_identical,
                "requests": counts["requests"],
                "ceiling": 0,
                "meets": not_identical == 0 and counts["requests"] > 0,
            },
            "chaos_failed_attempts_not_explained_by_an_outage": {
                "failed": other,
                "attempts": sum(len(o.attempts) for o in outcomes),
                "ceiling": 0,
                "meets": other == 0,
            },
        },
    }
