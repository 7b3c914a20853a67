from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_METHOD_UNSPECIFIED: _ClassVar[DraftMethod]
    DRAFT_METHOD_MODEL: _ClassVar[DraftMethod]
    DRAFT_METHOD_NGRAM: _ClassVar[DraftMethod]

class SamplingRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLING_RULE_UNSPECIFIED: _ClassVar[SamplingRule]
    SAMPLING_RULE_REJECTION: _ClassVar[SamplingRule]
    SAMPLING_RULE_COUPLED: _ClassVar[SamplingRule]
DRAFT_METHOD_UNSPECIFIED: DraftMethod
DRAFT_METHOD_MODEL: DraftMethod
DRAFT_METHOD_NGRAM: DraftMethod
SAMPLING_RULE_UNSPECIFIED: SamplingRule
SAMPLING_RULE_REJECTION: SamplingRule
SAMPLING_RULE_COUPLED: SamplingRule

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "lark_grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    lark_grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., lark_grammar: _Optional[str] = ...) -> None: ...

class ProbabilityMatrix(_message.Message):
    __slots__ = ("rows", "vocab_size", "float32_data")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    FLOAT32_DATA_FIELD_NUMBER: _ClassVar[int]
    rows: int
    vocab_size: int
    float32_data: bytes
    def __init__(self, rows: _Optional[int] = ..., vocab_size: _Optional[int] = ..., float32_data: _Optional[bytes] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "tokenizer_sha256", "device", "dtype", "active_sessions", "kv_cache_tokens", "max_sessions", "max_context_tokens", "tensor_parallel_size", "draft_methods", "step_cost_fixed_ns", "step_cost_per_token_ns", "kv_block_size", "kv_blocks_used", "kv_blocks_free", "kv_blocks_shared")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_METHODS_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_FIXED_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_PER_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SHARED_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    tokenizer_sha256: str
    device: str
    dtype: str
    active_sessions: int
    kv_cache_tokens: int
    max_sessions: int
    max_context_tokens: int
    tensor_parallel_size: int
    draft_methods: _containers.RepeatedScalarFieldContainer[DraftMethod]
    step_cost_fixed_ns: float
    step_cost_per_token_ns: float
    kv_block_size: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_shared: int
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_sha256: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., active_sessions: _Optional[int] = ..., kv_cache_tokens: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., draft_methods: _Optional[_Iterable[_Union[DraftMethod, str]]] = ..., step_cost_fixed_ns: _Optional[float] = ..., step_cost_per_token_ns: _Optional[float] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_shared: _Optional[int] = ...) -> None: ...

class StreamedCall(_message.Message):
    __slots__ = ("call_id", "method", "request", "traceparent", "timeout_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    method: str
    request: bytes
    traceparent: str
    timeout_s: float
    def __init__(self, call_id: _Optional[int] = ..., method: _Optional[str] = ..., request: _Optional[bytes] = ..., traceparent: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StreamedReply(_message.Message):
    __slots__ = ("call_id", "status_code", "status_details", "response")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    status_code: int
    status_details: str
    response: bytes
    def __init__(self, call_id: _Optional[int] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ..., response: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
