from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenVerifySessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "sampling_rule", "logprobs", "top_logprobs", "constraint", "output_start", "draw_first_token", "next_call")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_RULE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    DRAW_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_CALL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    sampling_rule: _common_pb2.SamplingRule
    logprobs: bool
    top_logprobs: int
    constraint: _common_pb2.Constraint
    output_start: int
    draw_first_token: bool
    next_call: NextCallHint
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., sampling_rule: _Optional[_Union[_common_pb2.SamplingRule, str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., output_start: _Optional[int] = ..., draw_first_token: _Optional[bool] = ..., next_call: _Optional[_Union[NextCallHint, _Mapping]] = ...) -> None: ...

class OpenVerifySessionResponse(_message.Message):
    __slots__ = ("session_len", "prefill_ns", "first_token_id", "constraint_dead_end", "first_token_logprob")
    SESSION_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_DEAD_END_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    session_len: int
    prefill_ns: int
    first_token_id: int
    constraint_dead_end: bool
    first_token_logprob: _common_pb2.TokenLogprob
    def __init__(self, session_len: _Optional[int] = ..., prefill_ns: _Optional[int] = ..., first_token_id: _Optional[int] = ..., constraint_dead_end: _Optional[bool] = ..., first_token_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "base_len", "draft_token_ids", "draft_probs", "next_call")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CALL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_len: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.ProbabilityMatrix
    next_call: NextCallHint
    def __init__(self, session_id: _Optional[str] = ..., base_len: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[_common_pb2.ProbabilityMatrix, _Mapping]] = ..., next_call: _Optional[_Union[NextCallHint, _Mapping]] = ...) -> None: ...

class NextCallHint(_message.Message):
    __slots__ = ("after_any_verdict", "after_verdicts")
    AFTER_ANY_VERDICT_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERDICTS_FIELD_NUMBER: _ClassVar[int]
    after_any_verdict: bool
    after_verdicts: _containers.RepeatedCompositeFieldContainer[GuessedVerdict]
    def __init__(self, after_any_verdict: _Optional[bool] = ..., after_verdicts: _Optional[_Iterable[_Union[GuessedVerdict, _Mapping]]] = ...) -> None: ...

class GuessedVerdict(_message.Message):
    __slots__ = ("num_accepted", "next_token_id")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ...) -> None: ...

class VerifyNextRequest(_message.Message):
    __slots__ = ("session_id", "after_base_len", "rounds", "plain_otherwise", "next_call")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_OTHERWISE_FIELD_NUMBER: _ClassVar[int]
    NEXT_CALL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    after_base_len: int
    rounds: _containers.RepeatedCompositeFieldContainer[GuessedRound]
    plain_otherwise: bool
    next_call: NextCallHint
    def __init__(self, session_id: _Optional[str] = ..., after_base_len: _Optional[int] = ..., rounds: _Optional[_Iterable[_Union[GuessedRound, _Mapping]]] = ..., plain_otherwise: _Optional[bool] = ..., next_call: _Optional[_Union[NextCallHint, _Mapping]] = ...) -> None: ...

class GuessedRound(_message.Message):
    __slots__ = ("verdict", "draft_token_ids", "draft_probs")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    verdict: GuessedVerdict
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.ProbabilityMatrix
    def __init__(self, verdict: _Optional[_Union[GuessedVerdict, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[_common_pb2.ProbabilityMatrix, _Mapping]] = ...) -> None: ...

class VerifyNextResponse(_message.Message):
    __slots__ = ("ran", "round_index", "verdict")
    RAN_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ran: bool
    round_index: int
    verdict: VerifyResponse
    def __init__(self, ran: _Optional[bool] = ..., round_index: _Optional[int] = ..., verdict: _Optional[_Union[VerifyResponse, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_token_ids", "next_token_id", "is_bonus", "session_len", "forward_ns", "sampling_ns", "batch_rows", "batch_tokens", "logprobs", "draining", "constraint_dead_end")
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    IS_BONUS_FIELD_NUMBER: _ClassVar[int]
    SESSION_LEN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_DEAD_END_FIELD_NUMBER: _ClassVar[int]
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    next_token_id: int
    is_bonus: bool
    session_len: int
    forward_ns: int
    sampling_ns: int
    batch_rows: int
    batch_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    draining: bool
    constraint_dead_end: bool
    def __init__(self, accepted_token_ids: _Optional[_Iterable[int]] = ..., next_token_id: _Optional[int] = ..., is_bonus: _Optional[bool] = ..., session_len: _Optional[int] = ..., forward_ns: _Optional[int] = ..., sampling_ns: _Optional[int] = ..., batch_rows: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., draining: _Optional[bool] = ..., constraint_dead_end: _Optional[bool] = ...) -> None: ...
