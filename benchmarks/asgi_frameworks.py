"""What an ASGI framework costs the HTTP front per request: Starlette against FastAPI, side by side in one run.

    python -m benchmarks.asgi_frameworks [--requests 3000] [--runs 5] [--out benchmarks/results/asgi_frameworks.json]

Both apps take the same chat-completion body, validate it with the front's pydantic model
(coordinator/openai_api/protocol.py) and answer a JSON body of a chat completion's size: Starlette validates in
its handler, as the front does; FastAPI validates and serializes through its declared body and return types. Each
request is an ASGI call made in-process (no socket, no server), so what is timed is the framework's own work; runs
alternate between the two and the figures are medians of the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import time

from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from coordinator.openai_api.protocol import ChatCompletionRequest

BODY = json.dumps(
    {
        "model": "demo-target",
        "messages": [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def f(x):"}],
        "max_tokens": 64,
        "temperature": 0,
        "stream": False,
    }
).encode()
REPLY = {
    "id": "chatcmpl-0123456789abcdef",
    "object": "chat.completion",
    "created": 0,
    "model": "demo-target",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 256}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 64, "total_tokens": 84},
}


def starlette_app() -> Starlette:
    async def chat(request: Request) -> JSONResponse:
        ChatCompletionRequest.model_validate_json(await request.body())
        return JSONResponse(REPLY)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def fastapi_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> dict:
        return REPLY

    return app


async def call(app, sent: list) -> None:
    """One POST through the app's ASGI interface."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())],
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
    }
    messages = iter([{"type": "http.request", "body": BODY, "more_body": False}])

    async def receive() -> dict:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)


async def per_request_us(app, requests: int) -> float:
    sent: list = []
    started = time.perf_counter()
    for _ in range(requests):
        await call(app, sent)
    elapsed = time.perf_counter() - started
    assert sent[0]["status"] == 200, sent[0]
    return elapsed / requests * 1e6


async def measure(requests: int, runs: int) -> dict:
    apps = {"starlette": starlette_app(), "fastapi": fastapi_app()}
    for app in apps.values():
        await per_request_us(app, 200)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in apps}
    for run in range(runs):
        for name in list(apps) if run % 2 == 0 else list(reversed(apps)):
            times[name].append(round(await per_request_us(apps[name], requests), 1))
            print(f"run {run + 1}/{runs} {name}: {times[name][-1]} µs a request", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "question": "what the ASGI framework costs the HTTP front per request (validate a chat body, answer JSON)",
        "requests_per_run": requests,
        "runs_us_per_request": times,
        "median_us_per_request": medians,
        "headline": {
            "starlette_us": medians["starlette"],
            "fastapi_us": medians["fastapi"],
            "fastapi_over_starlette": round(medians["fastapi"] / medians["starlette"], 2),
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the report here as JSON")
    args = parser.parse_args(argv)
    report = asyncio.run(measure(args.requests, args.runs))
    print(json.dumps(report["headline"]))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
