"""Conversions between protobuf messages and the core's types, validating fields on the way in."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from specdec.common.errors import InvalidFieldError
from specdec.engine.kv.pool import KVPool
from specdec.sampling.constraints import ConstraintKind, ConstraintSpec
from specdec.sampling.rules import SamplingParams, SamplingRule
from specdec.sampling.token_logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from specdec.v1 import common_pb2, verifier_pb2

PLAIN_STEP = -1  # VerifyNextResponse.round_index of the plain step (no guessed round matched the verdict)


def sampling_from_proto(
    message: common_pb2.SamplingParams, default_seed: int = 0, prefix: str = "sampling"
) -> SamplingParams:
    """SamplingParams from the wire; unset top_p means 1 and unset seed means default_seed."""
    top_p = message.top_p if message.HasField("top_p") else 1.0
    seed = message.seed if message.HasField("seed") else default_seed
    repetition = message.repetition_penalty if message.HasField("repetition_penalty") else 1.0
    params = SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=top_p,
        seed=seed,
        repetition_penalty=repetition,
        frequency_penalty=message.frequency_penalty,
        presence_penalty=message.presence_penalty,
        min_p=message.min_p,
    )
    try:
        params.validate()
    except ValueError as error:
        field = str(error).split(":")[0].split()[0].strip()
        raise InvalidFieldError(f"{prefix}.{field}", str(error)) from None
    return params


SAMPLING_RULES = {
    common_pb2.SAMPLING_RULE_UNSPECIFIED: SamplingRule.REJECTION,  # a replica's default: today's rule
    common_pb2.SAMPLING_RULE_REJECTION: SamplingRule.REJECTION,
    common_pb2.SAMPLING_RULE_COUPLED: SamplingRule.COUPLED,
}
SAMPLING_RULE_ENUMS = {
    SamplingRule.REJECTION: common_pb2.SAMPLING_RULE_REJECTION,
    SamplingRule.COUPLED: common_pb2.SAMPLING_RULE_COUPLED,
}


def session_sampling_from_proto(message: common_pb2.SamplingParams, rule: int) -> SamplingParams:
    """A session's SamplingParams from an Open*SessionRequest's `sampling` and `sampling_rule` (unspecified: the
    rejection rule); INVALID_ARGUMENT names the field that is out of range."""
    if rule not in SAMPLING_RULES:
        raise InvalidFieldError("sampling_rule", f"unknown value {rule}")
    return dataclasses.replace(sampling_from_proto(message), rule=SAMPLING_RULES[rule])


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        min_p=params.min_p,
    )


def constraint_from_proto(message: common_pb2.Constraint, prefix: str = "constraint") -> ConstraintSpec | None:
    """The constraint a message names (None: none); INVALID_ARGUMENT names an empty source."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return ConstraintSpec(ConstraintKind.JSON_OBJECT)
    source = getattr(message, kind)
    if not source:
        raise InvalidFieldError(f"{prefix}.{kind}", "must not be empty")
    return ConstraintSpec(ConstraintKind(kind), source)


def constraint_to_proto(spec: ConstraintSpec | None) -> common_pb2.Constraint | None:
    if spec is None:
        return None
    if spec.kind is ConstraintKind.JSON_OBJECT:
        return common_pb2.Constraint(json_object=True)
    return common_pb2.Constraint(**{spec.kind.value: spec.source})


def probs_to_proto(probs: torch.Tensor | None) -> common_pb2.ProbabilityMatrix | None:
    """[rows, V] float probabilities -> ProbabilityMatrix (None for one-hot q)."""
    if probs is None:
        return None
    data = probs.detach().to(torch.float32).cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()
    return common_pb2.ProbabilityMatrix(rows=probs.shape[0], vocab_size=probs.shape[1], float32_data=data)


def probs_from_proto(
    message: common_pb2.ProbabilityMatrix, rows: int, vocab_size: int, field: str = "draft_probs"
) -> torch.Tensor | None:
    """ProbabilityMatrix -> [rows, V] float32 tensor, or None when empty (one-hot q)."""
    if message.rows == 0 and not message.float32_data:
        return None
    if message.rows != rows:
        raise InvalidFieldError(f"{field}.rows", f"is {message.rows}, expected one row per draft token ({rows})")
    if message.vocab_size != vocab_size:
        raise InvalidFieldError(
            f"{field}.vocab_size", f"is {message.vocab_size}, the model's vocabulary is {vocab_size}"
        )
    if len(message.float32_data) != rows * vocab_size * 4:
        raise InvalidFieldError(
            f"{field}.float32_data", f"holds {len(message.float32_data)} bytes, expected {rows * vocab_size * 4}"
        )
    array = np.frombuffer(message.float32_data, dtype="<f4").reshape(rows, vocab_size)
    if not np.isfinite(array).all() or (array < 0).any():
        raise InvalidFieldError(f"{field}.float32_data", "probabilities must be finite and non-negative")
    return torch.from_numpy(array.astype(np.float32))  # [rows, V]


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str, allow_empty: bool = False) -> list[int]:
    """Validates token ids against the vocabulary."""
    ids = list(token_ids)
    if not ids and not allow_empty:
        raise InvalidFieldError(field, "must not be empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidFieldError(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def ends_after(hint: verifier_pb2.NextCallHint) -> bool:
    """Whether a hint says no round follows whatever the verdict: the caller's request ends with this round."""
    return not hint.after_any_verdict and not hint.after_verdicts


def follows_at_once(hint: verifier_pb2.NextCallHint, num_accepted: int, next_token: int) -> bool:
    """Whether a Verify caller's next round follows the verdict (accepted count, next token) at once, by the
    hint its request carried."""
    return hint.after_any_verdict or any(
        guess.num_accepted == num_accepted
        and (not guess.HasField("next_token_id") or guess.next_token_id == next_token)
        for guess in hint.after_verdicts
    )


def kv_block_info(pool: KVPool | None) -> dict[str, int]:
    """ServiceInfo's KV block fields of a model's paged pool (all 0 for none: a model-free drafter, an unpaged
    model)."""
    if pool is None:
        return {}
    blocks = pool.blocks
    return {
        "kv_block_size": pool.block_size,
        "kv_blocks_used": blocks.used,
        "kv_blocks_free": blocks.free,
        "kv_blocks_shared": blocks.shared,
    }


def call_deadline(context) -> float | None:
    """The event loop's time at which a call's deadline passes (grpc.aio ServicerContext); None when it has none
    (or when the servicer is called in-process, without a context)."""
    remaining = context.time_remaining() if context is not None else None
    if remaining is None or remaining == float("inf"):
        return None
    return asyncio.get_running_loop().time() + remaining


def checked_top_logprobs(logprobs: bool, top_logprobs: int) -> int | None:
    """A request's `logprobs` and `top_logprobs` as the alternatives per token to return (None: no
    log-probabilities); INVALID_ARGUMENT names `top_logprobs` past the limit or without `logprobs`."""
    if top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidFieldError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    if top_logprobs and not logprobs:
        raise InvalidFieldError("top_logprobs", "needs logprobs set to true")
    return top_logprobs if logprobs else None


def logprob_to_proto(logprob: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=logprob.token,
        logprob=logprob.logprob,
        top_token_ids=logprob.top_tokens,
        top_logprobs=logprob.top_logprobs,
    )
