"""Checks a GenerateRequest field by field and turns it into a GenerationPlan (INVALID_ARGUMENT names the field)."""

from __future__ import annotations

import dataclasses
import secrets
import uuid

from transformers import PreTrainedTokenizerBase

from coordinator.chat_prompt import chat_prompt_ids
from coordinator.request_plan import GenerationPlan
from coordinator.settings import CoordinatorSettings
from specdec.common.errors import InvalidFieldError
from specdec.sampling.rules import SamplingRule
from specdec.serving.wire import check_token_ids, checked_top_logprobs, constraint_from_proto, sampling_from_proto
from specdec.v1 import common_pb2, coordinator_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def plan_request(
    request: coordinator_pb2.GenerateRequest,
    settings: CoordinatorSettings,
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
) -> GenerationPlan:
    """Validates every field; returns the plan the generation loop runs."""
    prompt_kind = request.WhichOneof("prompt")
    if request.messages:
        if prompt_kind is not None:
            raise InvalidFieldError("messages", f"give the prompt as messages or as {prompt_kind}, not both")
        prompt_ids = chat_prompt_ids(request.messages, tokenizer)
    elif prompt_kind == "text":
        if not request.text:
            raise InvalidFieldError("text", "the prompt must not be empty")
        prompt_ids = tokenizer(request.text, add_special_tokens=False)["input_ids"]
        if not prompt_ids:
            raise InvalidFieldError("text", "the prompt tokenizes to no tokens")
    elif prompt_kind == "token_ids":
        prompt_ids = check_token_ids(request.token_ids.ids, vocab_size, "token_ids.ids")
    else:
        raise InvalidFieldError("prompt", "give the prompt as text, token_ids or messages")
    if len(prompt_ids) >= settings.max_context_tokens:
        raise InvalidFieldError(
            "prompt", f"{len(prompt_ids)} tokens leave no room in the context of {settings.max_context_tokens} tokens"
        )
    if not 1 <= request.max_new_tokens <= settings.max_new_tokens_limit:
        raise InvalidFieldError(
            "max_new_tokens", f"must be in [1, {settings.max_new_tokens_limit}], got {request.max_new_tokens}"
        )
    if len(prompt_ids) + request.max_new_tokens > settings.max_context_tokens:
        raise InvalidFieldError(
            "max_new_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
            f"({request.max_new_tokens}) exceeds the context of {settings.max_context_tokens}",
        )
    gamma = (
        request.num_speculative_tokens
        if request.HasField("num_speculative_tokens")
        else settings.default_num_speculative_tokens
    )
    if not 0 <= gamma <= settings.max_num_speculative_tokens:
        raise InvalidFieldError(
            "num_speculative_tokens", f"must be in [0, {settings.max_num_speculative_tokens}], got {gamma}"
        )
    if len(request.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in request.stop):
        raise InvalidFieldError(
            "stop", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters"
        )
    if request.draft_method not in common_pb2.DraftMethod.values():
        raise InvalidFieldError("draft_method", f"unknown value {request.draft_method}")
    if len(request.request_id) > 128:
        raise InvalidFieldError("request_id", "at most 128 characters")
    params = sampling_from_proto(request.sampling, default_seed=secrets.randbits(63))
    # A seeded request's tokens must be a function of prompt, settings and seed alone: only the coupled rule
    # makes them independent of the blocks the rounds happen to use.
    rule = SamplingRule.COUPLED if request.sampling.HasField("seed") else settings.unseeded_sampling_rule
    params = dataclasses.replace(params, rule=rule)
    constraint = constraint_from_proto(request.constraint)
    return GenerationPlan(
        constraint=constraint,
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=list(prompt_ids),
        max_new_tokens=request.max_new_tokens,
        params=params,
        gamma=gamma,
        draft_method=request.draft_method,
        overlap=settings.overlap,
        chain_rounds=settings.chain_rounds,
        call_streams=settings.call_streams,
        predraft_guesses=settings.predraft_guesses,
        predraft_max_batch=settings.predraft_max_batch,
        lookup_tokens=min(settings.lookup_tokens, max(0, settings.max_num_speculative_tokens - gamma - 1)),
        forced_tokens=max(0, settings.max_num_speculative_tokens - gamma) if constraint is not None else 0,
        top_logprobs=checked_top_logprobs(request.logprobs, request.top_logprobs),
    )
