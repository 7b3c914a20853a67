"""Command line of the load tests.

    python -m load_tests --address 127.0.0.1:50051                    # against a running coordinator
    python -m load_tests --start-stack --threads 1                     # start draft/verify/coordinator here
    python -m load_tests --start-stack --concurrency 1,2,4,8,16 --rates 0.5,1,2 --max-new-tokens 128
    python -m load_tests --start-stack --pair smollm2 --prompt-sets chat  # SmolLM2 and its draft, chat questions
    python -m load_tests --start-stack --concurrency 16 --modes spec --repeats 3 --baseline-batching-off
                                                                       # vs the same stack, batching off
    python -m load_tests --start-stack --concurrency 1,16 --api openai --baseline-api grpc
                                                                       # the HTTP API vs gRPC, one stack

Writes `report.json` (every level, comparison and request), `levels.csv` (a row per level), PNG plots and
`summary.txt` under --out (default load_tests/results/latest/, which git ignores; reports kept for the record
move to load_tests/results/<question>/<date>_<change>/, see load_tests/results/README.md), prints a progress
line per level and the summary at the end. Only loopback addresses are accepted unless --allow-remote is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import pathlib
import time

from benchmarks.pairs import PAIR_NAMES, model_pair
from load_tests.plots import plot_report
from load_tests.prompts import PROMPT_SETS
from load_tests.report import baseline_headline, summary_text, write_csv, write_json
from load_tests.sweep import APIS, MODES, Endpoint, Sweep, SweepConfig
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.local_stack import REPO_ROOT, LocalStack

DEFAULT_OUT = REPO_ROOT / "load_tests" / "results" / "latest"


def _csv(kind):
    def parse(raw: str) -> tuple:
        return tuple(kind(part.strip()) for part in raw.split(",") if part.strip())

    return parse


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT names this machine (localhost, 127.0.0.0/8, ::1)."""
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m load_tests", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="HOST:PORT of a running coordinator")
    where.add_argument("--start-stack", action="store_true", help="start draft, verify and coordinator on loopback")
    p.add_argument("--allow-remote", action="store_true", help="accept an --address that is not loopback")
    p.add_argument(
        "--api",
        choices=APIS,
        default="grpc",
        help="drive the stack over gRPC or over the OpenAI-compatible HTTP API (streamed /v1/completions) [grpc]",
    )
    p.add_argument("--http-address", default="", help="HOST:PORT of the running stack's HTTP API (with --address)")
    p.add_argument(
        "--http-front",
        choices=("inside", "process"),
        default="inside",
        help="with --start-stack: serve the HTTP API inside the coordinator or in a process of its own [inside]",
    )
    stack = p.add_argument_group("--start-stack")
    stack.add_argument(
        "--pair", choices=PAIR_NAMES, help="demo, or smollm2 with --prompt-sets chat (sets --target and --draft)"
    )
    stack.add_argument("--target", default=str(DEMO_TARGET_DIR), help="target model directory or GGUF file")
    stack.add_argument("--draft", default=str(DEMO_DRAFT_DIR), help="draft model directory")
    stack.add_argument("--threads", type=int, default=1, help="CPU threads of each model service")
    stack.add_argument(
        "--draft-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra draft-service flag, e.g. --draft-arg=--max-sessions=64 (repeatable)",
    )
    stack.add_argument("--verify-arg", action="append", default=[], metavar="FLAG", help="extra verify-service flag")
    stack.add_argument(
        "--coordinator-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra coordinator flag, e.g. --coordinator-arg=--no-overlap",
    )
    baseline = p.add_argument_group(
        "baseline stack (with --start-stack): a second stack, the first one's flags plus "
        "these, that every level also runs on, back to back; the report compares them"
    )
    baseline.add_argument(
        "--baseline-api",
        choices=APIS,
        default="",
        help="the baseline is the same stack driven over this API (no second stack), e.g. grpc against --api openai",
    )
    baseline.add_argument(
        "--baseline-batching-off",
        action="store_true",
        help="the baseline is the same stack with batching off (--max-batch-size=1 on the draft and verify services)",
    )
    for service in ("draft", "verify", "coordinator"):
        baseline.add_argument(
            f"--baseline-{service}-arg",
            action="append",
            default=[],
            metavar="FLAG",
            help=f"extra {service} flag of the baseline stack (repeatable)",
        )
    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=_csv(int),
        default=(1, 2, 4, 8, 16),
        help="closed-loop concurrency levels, comma-separated (empty for none) [1,2,4,8,16]",
    )
    load.add_argument(
        "--rates",
        type=_csv(float),
        default=(),
        help="open-loop Poisson arrival rates in requests/s, comma-separated [none]",
    )
    load.add_argument(
        "--prompt-sets",
        type=_csv(str),
        default=("code", "grounded"),
        help=f"prompt sets among {','.join(PROMPT_SETS)} [code,grounded]",
    )
    load.add_argument("--modes", type=_csv(str), default=MODES, help="spec and/or plain [spec,plain]")
    load.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests per level; 0 = max(16, 6 x concurrency), or ~20 s of arrivals for a rate [0]",
    )
    load.add_argument(
        "--duration-s", type=float, default=120.0, help="no request of a level starts after this many seconds [120]"
    )
    load.add_argument("--max-new-tokens", type=int, default=128)
    load.add_argument(
        "--gamma",
        "--num-speculative-tokens",
        dest="gamma",
        type=int,
        default=None,
        help="γ of the speculative mode [the server's default]",
    )
    load.add_argument("--temperature", type=float, default=0.0)
    baseline.add_argument(
        "--throughput-floor",
        type=float,
        default=None,
        help="with a baseline: the report's headline says if each stack/baseline throughput ratio is at least this",
    )
    baseline.add_argument(
        "--latency-ceiling",
        type=float,
        default=1.05,
        help="with --throughput-floor: ... and every median e2e latency ratio at most this [1.05]",
    )
    load.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    load.add_argument("--seed", type=int, default=0, help="prompt choice, request seeds and arrivals")
    load.add_argument("--request-timeout-s", type=float, default=300.0)
    load.add_argument("--warmup", type=int, default=2, help="unmeasured requests per mode before the sweep")
    load.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each (load, prompt set) pair, modes alternating; ratios are their medians [1]",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=DEFAULT_OUT,
        help="output directory; an earlier run's files there are overwritten "
        "[load_tests/results/latest, which git ignores]",
    )
    return p


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    unknown = set(args.prompt_sets) - set(PROMPT_SETS)
    if unknown or not args.prompt_sets:
        raise SystemExit(f"--prompt-sets: choose from {', '.join(PROMPT_SETS)}")
    if not args.concurrency and not args.rates:
        raise SystemExit("give at least one --concurrency level or --rates value")
    config = SweepConfig(
        concurrency=args.concurrency,
        rates=args.rates,
        prompt_sets=args.prompt_sets,
        modes=args.modes,
        requests=args.requests,
        duration_s=args.duration_s,
        max_new_tokens=args.max_new_tokens,
        num_speculative_tokens=args.gamma,
        temperature=args.temperature,
        stop=tuple(args.stop),
        seed=args.seed,
        request_timeout_s=args.request_timeout_s,
        warmup=args.warmup,
        repeats=args.repeats,
        stack=flags_description(
            {"draft": args.draft_arg, "verify": args.verify_arg, "coordinator": args.coordinator_arg}
        )
        if args.start_stack
        else "",
        baseline=f"api {args.baseline_api}" if args.baseline_api else flags_description(baseline_args(args)),
        api=args.api,
    )
    try:
        config.plan()  # modes, repeats: refused here, before a stack starts
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return config


def baseline_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """The baseline stack's extra flags per service ({} when there is no baseline stack)."""
    extra = {service: list(getattr(args, f"baseline_{service}_arg")) for service in ("draft", "verify", "coordinator")}
    if args.baseline_batching_off:
        for service in ("draft", "verify"):
            extra[service].append("--max-batch-size=1")
    return extra if any(extra.values()) else {}


def flags_description(extra: dict[str, list[str]]) -> str:
    """A started stack's extra flags, e.g. 'draft --max-batch-size=1; verify --max-batch-size=1' ('' for none)."""
    return "; ".join(f"{service} {' '.join(flags)}" for service, flags in extra.items() if flags)


def write_outputs(report: dict, out: pathlib.Path) -> list[pathlib.Path]:
    """report.json, levels.csv, the PNGs and summary.txt under `out`."""
    summary = summary_text(report)
    paths = [
        write_json(report, out / "report.json"),
        write_csv(report["levels"], out / "levels.csv"),
        *plot_report(report, out),
    ]
    (out / "summary.txt").write_text(summary + "\n")
    return [*paths, out / "summary.txt"]


def endpoints(args: argparse.Namespace, address: str, http_address: str) -> list[Endpoint]:
    """The stack under test and, with --baseline-api, the same stack over that API."""
    under_test = Endpoint(address, args.api, http_address)
    return [under_test] + ([Endpoint(address, args.baseline_api, http_address)] if args.baseline_api else [])


def run(args: argparse.Namespace, address: Endpoint, baseline_address: Endpoint | None = None) -> dict:
    config = config_from_args(args)
    started = time.perf_counter()
    report = asyncio.run(
        Sweep(address, config, log=lambda line: print(line, flush=True), baseline_address=baseline_address).run()
    )
    if args.throughput_floor is not None:
        report["headline"] = baseline_headline(report, args.throughput_floor, args.latency_ceiling)
        print(f"headline: {report['headline']}")
    paths = write_outputs(report, args.out)
    print(summary_text(report))
    print(f"sweep took {time.perf_counter() - started:.0f}s; wrote {', '.join(str(p) for p in paths)}")
    return report


def main(argv: list[str] | None = None) -> dict:
    """Runs the CLI; returns the report (for tests)."""
    args = parser().parse_args(argv)
    if args.pair:
        pair = model_pair(args.pair)
        args.target, args.draft = pair.target, pair.draft
        args.coordinator_arg = [*pair.coordinator_flags, *args.coordinator_arg]
    config_from_args(args)  # fail on bad flags before starting anything
    extra = baseline_args(args)
    if args.baseline_api and extra:
        raise SystemExit("--baseline-api compares the same stack over two APIs: give no baseline stack flags with it")
    http = "openai" in (args.api, args.baseline_api)
    if args.address:
        if extra:
            raise SystemExit("a baseline stack needs --start-stack")
        if http and not args.http_address:
            raise SystemExit("--api openai against a running stack needs its --http-address")
        for given in filter(None, (args.address, args.http_address)):
            if not args.allow_remote and not is_loopback(given):
                raise SystemExit(f"{given} is not a loopback address; pass --allow-remote to load it anyway")
        return run(args, *endpoints(args, args.address, args.http_address))
    threads = ["--threads", str(args.threads)]
    with contextlib.ExitStack() as stacks:
        addresses = []
        for name, more in [("stack", {})] + ([("baseline stack", extra)] if extra else []):
            print(f"starting the {name} (target {args.target}, draft {args.draft}) ...", flush=True)
            started = time.perf_counter()
            stack = stacks.enter_context(
                LocalStack(
                    args.target,
                    args.draft,
                    draft_args=[*threads, *args.draft_arg, *more.get("draft", [])],
                    verify_args=[*threads, *args.verify_arg, *more.get("verify", [])],
                    coordinator_args=[
                        *args.coordinator_arg,
                        *more.get("coordinator", []),
                        *(["--http-address", "127.0.0.1:0"] if http and args.http_front == "inside" else []),
                    ],
                )
            )
            if http and args.http_front == "process":  # on the coordinator's cores, if it has its own
                stack.start_http_front(*(flag for flag in args.coordinator_arg if flag.startswith("--cpus")))
            print(
                f"{name} ready in {time.perf_counter() - started:.1f}s: coordinator at {stack.address}, "
                f"logs in {stack.log_dir}",
                flush=True,
            )
            addresses.append(Endpoint(stack.address, args.api, stack.http_address))
        if args.baseline_api:
            addresses = endpoints(args, stack.address, stack.http_address)
        return run(args, *addresses)
