"""Python client for application backends: `Client(address).generate("prompt", max_new_tokens=64)`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import grpc

from specdec.serving.grpc_options import channel_options
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

Prompt = str | Sequence[int] | None


def build_request(
    prompt: Prompt = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    num_speculative_tokens: int | None = None,
    include_stats: bool = False,
    request_id: str = "",
    draft_method: int = common_pb2.DRAFT_METHOD_UNSPECIFIED,
    messages: Sequence[Mapping[str, str]] = (),
    logprobs: bool = False,
    top_logprobs: int = 0,
    constraint: common_pb2.Constraint | None = None,
    **penalties: float,
) -> coordinator_pb2.GenerateRequest:
    """A GenerateRequest from keyword arguments; a str prompt is text, a sequence of ints is token ids, and
    `messages` ({"role": ..., "content": ...} each) is a conversation the server renders with the model's chat
    template. `constraint`: what the output must be (e.g. `Constraint(json_schema=...)`); `penalties`: the
    sampling's repetition_penalty, frequency_penalty, presence_penalty and min_p."""
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, **penalties)
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    request = coordinator_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=list(stop),
        include_stats=include_stats,
        request_id=request_id,
        draft_method=draft_method,
        messages=[coordinator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        constraint=constraint,
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    if num_speculative_tokens is not None:
        request.num_speculative_tokens = num_speculative_tokens
    return request


class Client:
    """Blocking client of the Coordinator service."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 300.0,
        credentials: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
    ):
        self.channel = (
            grpc.secure_channel(address, credentials, options=channel_options())
            if credentials
            else grpc.insecure_channel(address, options=channel_options())
        )
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def generate(self, prompt: Prompt = None, **kwargs) -> coordinator_pb2.GenerateResponse:
        """Generates a whole completion (keyword arguments as in build_request: `messages=[...]` for a chat)."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout_s, metadata=self.metadata)

    def stream(self, prompt: Prompt = None, **kwargs) -> Iterator[coordinator_pb2.GenerateStreamResponse]:
        """Streams the completion chunk by chunk, one chunk per committed round."""
        return self.stub.GenerateStream(build_request(prompt, **kwargs), timeout=self.timeout_s, metadata=self.metadata)

    def info(self) -> coordinator_pb2.CoordinatorInfo:
        return self.stub.Info(common_pb2.InfoRequest(), timeout=self.timeout_s, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
