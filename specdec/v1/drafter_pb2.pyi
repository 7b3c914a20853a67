from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenDraftSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "draft_method", "num_lanes", "sampling_rule", "constraint", "output_start")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_LANES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_RULE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    draft_method: _common_pb2.DraftMethod
    num_lanes: int
    sampling_rule: _common_pb2.SamplingRule
    constraint: _common_pb2.Constraint
    output_start: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., draft_method: _Optional[_Union[_common_pb2.DraftMethod, str]] = ..., num_lanes: _Optional[int] = ..., sampling_rule: _Optional[_Union[_common_pb2.SamplingRule, str]] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., output_start: _Optional[int] = ...) -> None: ...

class OpenDraftSessionResponse(_message.Message):
    __slots__ = ("session_len", "prefill_ns")
    SESSION_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    session_len: int
    prefill_ns: int
    def __init__(self, session_len: _Optional[int] = ..., prefill_ns: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "base_len", "appended_token_ids", "num_speculative_tokens", "num_alternatives", "num_lookup_tokens", "num_forced_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_len: int
    appended_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    num_alternatives: int
    num_lookup_tokens: int
    num_forced_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., base_len: _Optional[int] = ..., appended_token_ids: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., num_alternatives: _Optional[int] = ..., num_lookup_tokens: _Optional[int] = ..., num_forced_tokens: _Optional[int] = ...) -> None: ...

class LaneProposal(_message.Message):
    __slots__ = ("lane", "base_len", "appended_token_ids", "num_speculative_tokens", "num_alternatives", "num_lookup_tokens", "num_forced_tokens")
    LANE_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lane: int
    base_len: int
    appended_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    num_alternatives: int
    num_lookup_tokens: int
    num_forced_tokens: int
    def __init__(self, lane: _Optional[int] = ..., base_len: _Optional[int] = ..., appended_token_ids: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., num_alternatives: _Optional[int] = ..., num_lookup_tokens: _Optional[int] = ..., num_forced_tokens: _Optional[int] = ...) -> None: ...

class ProposeLanesRequest(_message.Message):
    __slots__ = ("session_id", "lanes", "committed_len")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lanes: _containers.RepeatedCompositeFieldContainer[LaneProposal]
    committed_len: int
    def __init__(self, session_id: _Optional[str] = ..., lanes: _Optional[_Iterable[_Union[LaneProposal, _Mapping]]] = ..., committed_len: _Optional[int] = ...) -> None: ...

class ProposeLanesResponse(_message.Message):
    __slots__ = ("lanes", "draining")
    LANES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    lanes: _containers.RepeatedCompositeFieldContainer[ProposeResponse]
    draining: bool
    def __init__(self, lanes: _Optional[_Iterable[_Union[ProposeResponse, _Mapping]]] = ..., draining: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_token_ids", "draft_probs", "session_len", "draft_ns", "batch_rows", "alternative_token_ids", "draining")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SESSION_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.ProbabilityMatrix
    session_len: int
    draft_ns: int
    batch_rows: int
    alternative_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draining: bool
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[_common_pb2.ProbabilityMatrix, _Mapping]] = ..., session_len: _Optional[int] = ..., draft_ns: _Optional[int] = ..., batch_rows: _Optional[int] = ..., alternative_token_ids: _Optional[_Iterable[int]] = ..., draining: _Optional[bool] = ...) -> None: ...
