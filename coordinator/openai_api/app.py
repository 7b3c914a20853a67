"""The HTTP front's routes (Starlette): `POST /v1/chat/completions` and `/v1/completions` (whole, or server-sent
events when `stream` is true), `GET /v1/models`, `/health` and `/metrics`. A request is checked for the API's shape,
translated to a GenerateRequest and run on the backend; nothing else happens to it here."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import pydantic
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from transformers import PreTrainedTokenizerBase

from coordinator.openai_api.errors import FrontError
from coordinator.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from coordinator.openai_api.responses import Completion
from coordinator.openai_api.server import HttpServer
from coordinator.openai_api.translate import chat_params, chat_request, completion_params, completion_request
from coordinator.servicer import add_chunk
from specdec.common.errors import InvalidFieldError
from specdec.v1 import coordinator_pb2


@dataclass(frozen=True)
class FrontConfig:
    """What the routes need besides the backend."""

    model_names: Sequence[str]  # the names `model` may take; the first is listed by /v1/models
    tokenizer: PreTrainedTokenizerBase  # the target's: token texts of log-probabilities
    default_max_tokens: int  # chat completions that set neither max_tokens nor max_completion_tokens
    request_timeout_s: float


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def build_app(backend, config: FrontConfig) -> Starlette:
    """The ASGI app over `backend` (coordinator/openai_api/backends.py)."""
    created = int(time.time())

    async def complete(http: Request, kind: str) -> Response:
        authorization = http.headers.get("authorization")
        try:
            await backend.authenticate(authorization)
            if kind == "chat":
                body = ChatCompletionRequest.model_validate_json(await http.body())
                request, renamed = chat_request(body, config.default_max_tokens), chat_params(body)
            else:
                body = CompletionRequest.model_validate_json(await http.body())
                request, renamed = completion_request(body), completion_params(body)
            if body.model not in config.model_names:
                raise FrontError(
                    grpc.StatusCode.NOT_FOUND, f"model: {body.model!r} is not served here (GET /v1/models)", "model"
                )
        except pydantic.ValidationError as error:
            return FrontError.of_validation(error).response()
        except InvalidFieldError as error:
            return FrontError.invalid(error.field, str(error).removeprefix(f"{error.field}: ")).response()
        except FrontError as error:
            return error.response()
        replies = backend.replies(request, authorization, config.request_timeout_s)
        try:
            first = await anext(replies)  # errors before the first tokens get their own HTTP status
        except FrontError as error:
            await replies.aclose()
            return error.named(renamed).response()
        completion = Completion(kind, body.model)
        tokenizer = config.tokenizer if request.logprobs else None
        if body.stream:
            events = _events(first, replies, completion, tokenizer, body.include_usage, renamed)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        response = coordinator_pb2.GenerateResponse()
        add_chunk(response, first)
        try:
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    add_chunk(response, reply)
        except FrontError as error:
            return error.named(renamed).response()
        return JSONResponse(completion.whole(response, tokenizer))

    async def chat(http: Request) -> Response:
        return await complete(http, "chat")

    async def completions(http: Request) -> Response:
        return await complete(http, "text")

    async def models(http: Request) -> Response:
        try:
            await backend.authenticate(http.headers.get("authorization"))
        except FrontError as error:
            return error.response()
        model = {"id": config.model_names[0], "object": "model", "created": created, "owned_by": "specdec"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(http: Request) -> Response:
        serving = await backend.healthy()
        return JSONResponse({"status": "ok" if serving else "no verify replica"}, status_code=200 if serving else 503)

    async def metrics(http: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


async def _events(
    first: coordinator_pb2.GenerateStreamResponse,
    replies: AsyncIterator[coordinator_pb2.GenerateStreamResponse],
    completion: Completion,
    tokenizer: PreTrainedTokenizerBase | None,
    include_usage: bool,
    renamed: dict[str, str],
) -> AsyncIterator[str]:
    """A chunk per committed round, the usage chunk if asked for, `[DONE]`; a failure after the first chunk is an
    error event (the status line has gone out)."""
    stats = None
    try:
        async with contextlib.aclosing(replies):
            yield _event(completion.chunk(first, tokenizer, include_usage))
            stats = first.stats if first.HasField("stats") else None
            async for reply in replies:
                yield _event(completion.chunk(reply, tokenizer, include_usage))
                stats = reply.stats if reply.HasField("stats") else stats
        if include_usage and stats is not None:
            yield _event(completion.usage_chunk(stats))
    except FrontError as error:
        yield _event(error.named(renamed).event())
    yield "data: [DONE]\n\n"


async def start_front(
    backend, tokenizer: PreTrainedTokenizerBase, settings, address: str
) -> tuple[HttpServer, FrontConfig]:
    """The front on `backend`, started at `address`: `settings` holds the HTTP API's settings, its TLS files,
    `tokenizer` (the name models are served by) and `grace_s`; the coordinator's and the front process's both do."""
    config = FrontConfig(
        settings.model_names(settings.tokenizer),
        tokenizer,
        settings.default_max_tokens,
        settings.http_request_timeout_s,
    )
    http = await HttpServer(build_app(backend, config), address, settings, settings.grace_s).start()
    return http, config
