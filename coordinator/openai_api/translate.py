"""OpenAI request bodies as the Coordinator's GenerateRequest: the same fields under the Coordinator's names, and the
OpenAI API's defaults where a field is left out (temperature 1; text completions 16 tokens)."""

from __future__ import annotations

import json

from coordinator.openai_api.protocol import ChatCompletionRequest, CommonFields, CompletionRequest
from specdec.v1 import common_pb2, coordinator_pb2

DRAFT_METHODS = {"model": common_pb2.DRAFT_METHOD_MODEL, "ngram": common_pb2.DRAFT_METHOD_NGRAM}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for text completions


def _common(body: CommonFields, max_tokens: int) -> coordinator_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=1.0 if body.temperature is None else body.temperature)
    if body.top_p is not None:
        sampling.top_p = body.top_p
    if body.top_k is not None and body.top_k > 0:
        sampling.top_k = body.top_k
    if body.seed is not None:
        sampling.seed = body.seed
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"):  # ranges: the coordinator's
        if getattr(body, name) is not None:
            setattr(sampling, name, getattr(body, name))
    request = coordinator_pb2.GenerateRequest(
        max_new_tokens=max_tokens,
        sampling=sampling,
        stop=body.stop_strings,
        include_stats=True,  # usage comes from the stats
        draft_method=DRAFT_METHODS.get(body.draft_method, common_pb2.DRAFT_METHOD_UNSPECIFIED),
    )
    if body.num_speculative_tokens is not None:
        request.num_speculative_tokens = body.num_speculative_tokens
    if body.response_format is not None and body.response_format.type == "json_object":
        request.constraint.json_object = True
    elif body.response_format is not None and body.response_format.type == "json_schema":
        request.constraint.json_schema = json.dumps(body.response_format.json_schema.schema_)
    return request


def chat_request(body: ChatCompletionRequest, default_max_tokens: int) -> coordinator_pb2.GenerateRequest:
    """A chat completion: the messages, rendered by the target's chat template on the coordinator."""
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    request = _common(body, max_tokens)
    request.messages.extend(coordinator_pb2.ChatMessage(role=m.role, content=m.text) for m in body.messages)
    request.logprobs = body.logprobs
    request.top_logprobs = body.top_logprobs or 0
    return request


def completion_request(body: CompletionRequest) -> coordinator_pb2.GenerateRequest:
    """A text completion of one prompt, text or token ids; `logprobs` is the alternatives per token."""
    request = _common(body, body.max_completion_tokens or body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS)
    prompt = body.single_prompt
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if body.logprobs is not None:
        request.logprobs = True
        request.top_logprobs = body.logprobs
    return request


def chat_params(body: ChatCompletionRequest) -> dict[str, str]:
    """The Coordinator's field names a chat completion spells its own way."""
    return {
        "prompt": "messages",
        "max_new_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
    }


def completion_params(body: CompletionRequest) -> dict[str, str]:
    """The Coordinator's field names a text completion spells its own way."""
    return {
        "max_new_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        "top_logprobs": "logprobs",
    }
