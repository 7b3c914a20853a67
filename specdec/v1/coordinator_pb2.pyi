from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_CONSTRAINT_DEAD_END: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_CONSTRAINT_DEAD_END: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "max_new_tokens", "sampling", "stop", "num_speculative_tokens", "include_stats", "request_id", "draft_method", "messages", "logprobs", "top_logprobs", "constraint")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STATS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_METHOD_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_speculative_tokens: int
    include_stats: bool
    request_id: str
    draft_method: _common_pb2.DraftMethod
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    logprobs: bool
    top_logprobs: int
    constraint: _common_pb2.Constraint
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., num_speculative_tokens: _Optional[int] = ..., include_stats: _Optional[bool] = ..., request_id: _Optional[str] = ..., draft_method: _Optional[_Union[_common_pb2.DraftMethod, str]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "accepted_per_position", "drafted_per_position", "draft_ns", "verify_ns", "sampling_ns", "wire_ns", "prefill_ns", "total_ns", "predraft_attempts", "predraft_hits", "seed", "prompt_tokens", "predraft_guesses", "chained_rounds", "wire_bytes", "sampling_rule", "verify_session_moves", "draft_session_moves")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_NS_FIELD_NUMBER: _ClassVar[int]
    WIRE_NS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_GUESSES_FIELD_NUMBER: _ClassVar[int]
    CHAINED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_RULE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SESSION_MOVES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SESSION_MOVES_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    draft_ns: int
    verify_ns: int
    sampling_ns: int
    wire_ns: int
    prefill_ns: int
    total_ns: int
    predraft_attempts: int
    predraft_hits: int
    seed: int
    prompt_tokens: int
    predraft_guesses: int
    chained_rounds: int
    wire_bytes: int
    sampling_rule: _common_pb2.SamplingRule
    verify_session_moves: int
    draft_session_moves: int
    def __init__(self, rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., draft_ns: _Optional[int] = ..., verify_ns: _Optional[int] = ..., sampling_ns: _Optional[int] = ..., wire_ns: _Optional[int] = ..., prefill_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., predraft_attempts: _Optional[int] = ..., predraft_hits: _Optional[int] = ..., seed: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., predraft_guesses: _Optional[int] = ..., chained_rounds: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., sampling_rule: _Optional[_Union[_common_pb2.SamplingRule, str]] = ..., verify_session_moves: _Optional[int] = ..., draft_session_moves: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "request_id", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    request_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "request_id", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    request_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class CoordinatorInfo(_message.Message):
    __slots__ = ("target_model_id", "draft_replicas", "verify_replicas", "default_num_speculative_tokens", "max_num_speculative_tokens", "max_new_tokens_limit", "max_context_tokens", "overlap")
    TARGET_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    target_model_id: str
    draft_replicas: _containers.RepeatedScalarFieldContainer[str]
    verify_replicas: _containers.RepeatedScalarFieldContainer[str]
    default_num_speculative_tokens: int
    max_num_speculative_tokens: int
    max_new_tokens_limit: int
    max_context_tokens: int
    overlap: bool
    def __init__(self, target_model_id: _Optional[str] = ..., draft_replicas: _Optional[_Iterable[str]] = ..., verify_replicas: _Optional[_Iterable[str]] = ..., default_num_speculative_tokens: _Optional[int] = ..., max_num_speculative_tokens: _Optional[int] = ..., max_new_tokens_limit: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., overlap: _Optional[bool] = ...) -> None: ...
