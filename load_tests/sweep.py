"""A sweep: every load level x prompt set, speculative and plain back to back against one running stack.

The two modes of a (load, prompt set) pair run one right after the other with the same prompts in the
same order, and the order inside a pair alternates (spec first, then plain first, ...), so drift on a
noisy machine hits both modes alike and the ratios stay fair. With repeats, a pair runs that many times in a
row, still alternating (spec plain, plain spec, spec plain, ...), and the report's ratios are the medians of
the runs' ratios.

With a baseline stack (e.g. the same stack with batching off, or the same stack driven over its other API), every
level also runs on the baseline, right after or right before the same level on the stack under test (the order
alternating like the modes'), so the stack/baseline ratios, medians over the runs too, see the same drift on both
sides. A stack is driven over gRPC (`Coordinator.GenerateStream`) or over the OpenAI-compatible HTTP API (a streamed
`POST /v1/completions` of the same request); either way its coordinator's gRPC Info describes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import aiohttp
import grpc

from load_tests.chat_prompts import chat_messages
from load_tests.generator import (
    LoopOutcome,
    RequestResult,
    completions_body,
    run_closed_loop,
    run_open_loop,
    timed_http_request,
    timed_request,
)
from load_tests.prompts import Prompt, load_prompt_set
from load_tests.report import BASELINE, STACK, build_report, progress_line, request_record, summarize_level
from specdec.client import build_request
from specdec.local_stack import REPO_ROOT
from specdec.serving.server import channel_options
from specdec.v1 import common_pb2, coordinator_pb2_grpc

MODES = ("spec", "plain")
Sender = Callable[..., Awaitable[RequestResult]]  # (request, index, level start) -> its result
# Called as a level starts; what it returns is called as the level ends, and its dict goes into the level's
# summary as "probe" (e.g. the replicas' metrics over the level).
LevelProbe = Callable[["LevelPlan"], Callable[[], dict]]
APIS = ("grpc", "openai")


@dataclass(frozen=True)
class Endpoint:
    """How the sweep reaches one stack: its coordinator's gRPC address (Info; the requests under the grpc API) and,
    under the openai API, the HOST:PORT of its HTTP API."""

    address: str
    api: str = "grpc"
    http_address: str = ""


@dataclass(frozen=True)
class Load:
    """A closed-loop concurrency level or an open-loop arrival rate."""

    kind: str  # "concurrency" or "rate"
    value: float

    @property
    def label(self) -> str:
        return f"c{int(self.value)}" if self.kind == "concurrency" else f"r{self.value:g}"


@dataclass(frozen=True)
class LevelPlan:
    """One level to run: a load, a prompt set and a mode, with its request budget."""

    order: int
    load: Load
    prompt_set: str
    mode: str
    requests: int
    pair: int  # index of the (load, prompt set) pair: both modes share it, and so their arrival times
    repeat: int = 0  # which run of the pair (0 = the first)
    stack: str = STACK  # STACK or BASELINE

    @property
    def level_id(self) -> str:
        stack = f"-{BASELINE}" if self.stack == BASELINE else ""
        suffix = f"-{self.repeat + 1}" if self.repeat else ""
        return f"{self.load.label}-{self.prompt_set}-{self.mode}{stack}{suffix}"


@dataclass
class SweepConfig:
    """What to run; see `python -m load_tests --help` for each field."""

    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    rates: tuple[float, ...] = ()
    prompt_sets: tuple[str, ...] = ("code", "grounded")
    modes: tuple[str, ...] = MODES
    requests: int = 0  # per level; 0 = auto (closed loop: max(16, 6 x concurrency); open loop: ~20 s of arrivals)
    duration_s: float = 120.0
    max_new_tokens: int = 128
    num_speculative_tokens: int | None = None  # γ of the spec mode; None = the server's default
    temperature: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    request_timeout_s: float = 300.0
    warmup: int = 2  # unmeasured requests per mode before the first level
    repeats: int = 1  # runs of each (load, prompt set) pair; the ratios reported are the medians over them
    stack: str = ""  # the started stack's extra flags, for the record ("" = none, or a running stack)
    baseline: str = ""  # what the baseline stack differs by (its extra flags, or its API); "" = no baseline stack
    api: str = "grpc"  # how the stack under test is driven: grpc or openai (the HTTP API)

    def requests_for(self, load: Load) -> int:
        if self.requests > 0:
            return self.requests
        if load.kind == "concurrency":
            # six waves: the level's ramp-down (fewer requests in flight than its concurrency) weighs little
            return max(16, 6 * int(load.value))
        return max(8, math.ceil(20 * load.value))

    def plan(self) -> list[LevelPlan]:
        """Levels in run order: loads ascending (closed loop first), each prompt set `repeats` times, the two
        modes back to back with alternating order, and with a baseline each mode on both stacks back to back,
        alternating too."""
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise ValueError(f"modes must be among {MODES}, got {self.modes}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        loads = [Load("concurrency", c) for c in sorted(set(self.concurrency))] + [
            Load("rate", r) for r in sorted(set(self.rates))
        ]
        levels: list[LevelPlan] = []
        for pair, (load, prompt_set) in enumerate((ld, ps) for ld in loads for ps in self.prompt_sets):
            for repeat in range(self.repeats):
                forward = (pair + repeat) % 2 == 0
                modes = self.modes if forward else tuple(reversed(self.modes))
                stacks = (STACK, BASELINE) if self.baseline else (STACK,)
                for mode in modes:
                    for stack in stacks if forward else tuple(reversed(stacks)):
                        levels.append(
                            LevelPlan(len(levels), load, prompt_set, mode, self.requests_for(load), pair, repeat, stack)
                        )
        return levels


def environment() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "git_commit": commit,
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


class Sweep:
    """Runs a SweepConfig against the coordinator at `address` (and the baseline's at `baseline_address`) and
    builds the report."""

    def __init__(
        self,
        address: str | Endpoint,
        config: SweepConfig,
        log: Callable[[str], None] = print,
        baseline_address: str | Endpoint | None = None,
        level_probe: LevelProbe | None = None,
    ):
        if bool(config.baseline) != (baseline_address is not None):
            raise ValueError("a baseline stack needs both config.baseline and baseline_address")
        endpoints = {STACK: address, **({BASELINE: baseline_address} if baseline_address else {})}
        self.endpoints = {stack: e if isinstance(e, Endpoint) else Endpoint(e) for stack, e in endpoints.items()}
        self.config = config
        self.log = log
        self.level_probe = level_probe
        self.run_id = uuid.uuid4().hex[:8]

    def _gamma(self, mode: str) -> int | None:
        return 0 if mode == "plain" else self.config.num_speculative_tokens

    def _request(self, prompt: Prompt, mode: str, index: int, request_id: str):
        config = self.config
        chat = prompt.set_name == "chat"  # a user message the coordinator renders with the model's template
        return build_request(
            None if chat else prompt.prompt,
            messages=chat_messages(prompt) if chat else (),
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            seed=config.seed + index,
            stop=config.stop,
            num_speculative_tokens=self._gamma(mode),
            include_stats=True,
            request_id=request_id,
        )

    async def _run_level(self, sender: Sender, level: LevelPlan, prompts: list[Prompt]) -> LoopOutcome:
        config = self.config

        async def send(index: int, level_start: float) -> RequestResult:
            request = self._request(
                prompts[index % len(prompts)], level.mode, index, f"lt-{self.run_id}-{level.level_id}-{index}"
            )
            return await sender(request, index, level_start)

        if level.load.kind == "concurrency":
            return await run_closed_loop(send, int(level.load.value), level.requests, config.duration_s)
        return await run_open_loop(
            send, level.load.value, level.requests, config.duration_s, seed=config.seed + level.pair
        )

    async def _warm_up(self, sender: Sender, prompts: list[Prompt]) -> None:
        for mode in self.config.modes:
            for index in range(self.config.warmup):
                result = await sender(
                    self._request(
                        prompts[index % len(prompts)], mode, index, f"lt-{self.run_id}-warmup-{mode}-{index}"
                    ),
                    index,
                    time.perf_counter(),
                )
                if not result.ok:
                    self.log(f"warm-up request ({mode}) failed: {result.status} {result.error}")

    async def _connect(
        self, channel: grpc.aio.Channel, stack: str, resources: contextlib.AsyncExitStack
    ) -> tuple[Sender, dict, int]:
        """How to send a stack a request, its coordinator's Info as the report's server record, and the spec mode's
        γ."""
        endpoint = self.endpoints[stack]
        address = endpoint.address
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=60)
        except TimeoutError:
            raise SystemExit(f"no coordinator answered at {address} within 60 s") from None
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        info = await stub.Info(common_pb2.InfoRequest(), timeout=30)
        server = {
            "address": address,
            "target_model_id": info.target_model_id,
            "draft_replicas": list(info.draft_replicas),
            "verify_replicas": list(info.verify_replicas),
            "default_num_speculative_tokens": info.default_num_speculative_tokens,
            "max_new_tokens_limit": info.max_new_tokens_limit,
            "max_context_tokens": info.max_context_tokens,
            "overlap": info.overlap,
            "api": endpoint.api,
            **({"http_address": endpoint.http_address} if endpoint.api == "openai" else {}),
        }
        gamma = self.config.num_speculative_tokens
        timeout_s = self.config.request_timeout_s
        if endpoint.api == "openai":
            session = await resources.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            )

            async def sender(request, index: int, level_start: float) -> RequestResult:
                path, body = completions_body(request, info.target_model_id)
                url = f"http://{endpoint.http_address}{path}"
                return await timed_http_request(session, url, body, index, level_start, timeout_s)

        else:

            async def sender(request, index: int, level_start: float) -> RequestResult:
                return await timed_request(stub, request, index, level_start, timeout_s)

        return sender, server, gamma if gamma is not None else info.default_num_speculative_tokens

    async def run(self) -> dict:
        """Runs every level, logging a progress line per level; returns the report dict."""
        config, plan = self.config, self.config.plan()
        pool = max(level.requests for level in plan)
        prompts = {name: load_prompt_set(name, pool, seed=config.seed) for name in config.prompt_sets}
        async with contextlib.AsyncExitStack() as resources:
            senders, servers, gammas = {}, {}, {}
            for stack, endpoint in self.endpoints.items():
                channel = await resources.enter_async_context(
                    grpc.aio.insecure_channel(endpoint.address, options=channel_options())
                )
                senders[stack], servers[stack], gammas[stack] = await self._connect(channel, stack, resources)
                self.log(
                    f"{stack} coordinator {endpoint.address} over {endpoint.api}: target "
                    f"{servers[stack]['target_model_id']}, γ {gammas[stack]}, overlap {servers[stack]['overlap']}"
                    + (f"; baseline: {config.baseline}" if stack == BASELINE else "")
                )
                await self._warm_up(senders[stack], prompts[config.prompt_sets[0]])
            self.log(f"{len(plan)} levels, prompt pool {pool} per set")
            levels, requests = [], []
            for level in plan:
                probed = self.level_probe(level) if self.level_probe else None
                outcome = await self._run_level(senders[level.stack], level, prompts[level.prompt_set])
                identity = {
                    "level_id": level.level_id,
                    "order": level.order,
                    "load": level.load.kind,
                    "concurrency": int(level.load.value) if level.load.kind == "concurrency" else None,
                    "rate_rps": level.load.value if level.load.kind == "rate" else None,
                    "prompt_set": level.prompt_set,
                    "mode": level.mode,
                    "repeat": level.repeat,
                    "stack": level.stack,
                    "num_speculative_tokens": 0 if level.mode == "plain" else gammas[level.stack],
                }
                summary = summarize_level(identity, outcome.results, outcome.wall_s, outcome.stopped_by)
                if probed is not None:
                    summary["probe"] = probed()
                levels.append(summary)
                requests.extend(
                    request_record(level.level_id, r) for r in sorted(outcome.results, key=lambda r: r.index)
                )
                self.log(progress_line(summary, len(plan)))
        config_record = {
            **{key: list(value) if isinstance(value, tuple) else value for key, value in asdict(config).items()},
            "num_speculative_tokens": gammas[STACK],
            "run_id": self.run_id,
        }
        return build_report(config_record, servers[STACK], environment(), levels, requests, servers.get(BASELINE))
