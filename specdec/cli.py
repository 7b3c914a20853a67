"""Command line: start the whole stack on loopback, send a prompt, or run one service.

python -m specdec up                       # three processes (+ a redis-server), embedded pair, one request
python -m specdec up --keep-running        # ... and keep serving until Ctrl-C
python -m specdec generate --address HOST:PORT "def fibonacci(n):"
python -m specdec serve draft|verify|coordinator|http [service flags]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pathlib
import sys
import time

import grpc

from specdec.client import Client
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.local_stack import LocalStack
from specdec.redis_server import RedisServer

DEFAULT_PROMPT = "def fibonacci(n):\n    "
SERVICE_MODULES = {
    "draft": "draft_service.__main__",
    "verify": "verify_service.__main__",
    "coordinator": "coordinator.__main__",
    "http": "coordinator.openai_api.__main__",
}


def print_response(response) -> None:
    print(response.text)
    print("-" * 60)
    stats = response.stats
    finish = response.DESCRIPTOR.fields_by_name["finish_reason"].enum_type.values_by_number[response.finish_reason].name
    print(
        f"finish: {finish}  tokens: {len(response.token_ids)}  rounds: {stats.rounds}  "
        f"acceptance: {stats.acceptance_rate:.2f}  tokens/round: {stats.mean_accepted_length:.2f}  "
        f"pre-draft hits: {stats.predraft_hits}/{stats.predraft_attempts}  total: {stats.total_ns / 1e6:.0f} ms"
    )


def redis_for_up(args: argparse.Namespace, resources: contextlib.ExitStack) -> str:
    """--redis-url, else a redis-server of our own on loopback (journal and registry on); '' without one."""
    if args.redis_url or args.no_redis:
        return args.redis_url
    try:
        server = resources.enter_context(RedisServer())
    except FileNotFoundError as error:
        print(f"no Redis ({error}); running without the request journal", flush=True)
        return ""
    print(f"redis-server at {server.url}", flush=True)
    return server.url


def command_up(args: argparse.Namespace) -> None:
    threads = ["--threads", str(args.threads)]
    resources = contextlib.ExitStack()
    redis_url = redis_for_up(args, resources)
    print(
        f"starting draft, verify and coordinator processes (target {args.target}, draft {args.draft}) ...", flush=True
    )
    started = time.perf_counter()
    with (
        resources,
        LocalStack(
            args.target,
            args.draft,
            draft_args=threads,
            verify_args=threads,
            coordinator_args=["--redis-url", redis_url] if redis_url else [],
        ) as stack,
    ):
        print(
            f"stack ready in {time.perf_counter() - started:.1f}s: coordinator at {stack.address}, "
            f"logs in {stack.log_dir}",
            flush=True,
        )
        with Client(stack.address) as client:
            response = client.generate(
                args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, include_stats=True
            )
        print(f"prompt: {args.prompt!r}\n" + "-" * 60 + f"\n{args.prompt}", end="")
        print_response(response)
        if args.keep_running:
            print(f"serving on {stack.address}; Ctrl-C stops", flush=True)
            try:
                while all(s.process.poll() is None for s in stack.services.values()):
                    time.sleep(1)
            except KeyboardInterrupt:
                pass


def command_generate(args: argparse.Namespace) -> None:
    credentials = grpc.ssl_channel_credentials(pathlib.Path(args.tls_ca).read_bytes()) if args.tls_ca else None
    with Client(args.address, credentials=credentials, api_key=args.api_key or None) as client:
        print_response(
            client.generate(
                args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, include_stats=True
            )
        )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        if len(argv) < 2 or argv[1] not in SERVICE_MODULES:
            raise SystemExit(f"usage: python -m specdec serve {{{','.join(SERVICE_MODULES)}}} [flags]")
        importlib.import_module(SERVICE_MODULES[argv[1]]).main(argv[2:])
        return
    parser = argparse.ArgumentParser(
        prog="python -m specdec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start the stack on loopback and answer one prompt")
    up.add_argument("--target", default=str(DEMO_TARGET_DIR))
    up.add_argument("--draft", default=str(DEMO_DRAFT_DIR))
    up.add_argument("--threads", type=int, default=1, help="CPU threads per model service")
    up.add_argument("--keep-running", action="store_true")
    up.add_argument("--redis-url", default="", help="Redis for the coordinator (default: start a redis-server)")
    up.add_argument("--no-redis", action="store_true", help="run the coordinator without Redis")
    generate = commands.add_parser("generate", help="send one prompt to a running coordinator")
    generate.add_argument("--address", default="localhost:50051")
    generate.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY", ""),
        help="sent as 'authorization: Bearer KEY' [env SPECDEC_API_KEY]",
    )
    generate.add_argument("--tls-ca", default="", help="PEM CA of the coordinator's certificate: connect with TLS")
    for sub in (up, generate):
        sub.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
        sub.add_argument("--max-new-tokens", type=int, default=64)
        sub.add_argument("--temperature", type=float, default=0.0)
    commands.add_parser("serve", help="run one service: serve draft|verify|coordinator|http [flags]")
    args = parser.parse_args(argv)
    {"up": command_up, "generate": command_generate}[args.command](args)


if __name__ == "__main__":
    main()
