from services.proto.specd.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CoordinatorInfo(_message.Message):
    __slots__ = ("model", "drafter", "max_context", "tool_format")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    drafter: str
    max_context: int
    tool_format: str
    def __init__(self, model: _Optional[str] = ..., drafter: _Optional[str] = ..., max_context: _Optional[int] = ..., tool_format: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Speculative(_message.Message):
    __slots__ = ("policy", "max_draft_tokens", "params", "task_tag", "relaxed", "overlap", "branches")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TASK_TAG_FIELD_NUMBER: _ClassVar[int]
    RELAXED_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    policy: str
    max_draft_tokens: int
    params: _containers.ScalarMap[str, float]
    task_tag: str
    relaxed: bool
    overlap: bool
    branches: int
    def __init__(self, policy: _Optional[str] = ..., max_draft_tokens: _Optional[int] = ..., params: _Optional[_Mapping[str, float]] = ..., task_tag: _Optional[str] = ..., relaxed: _Optional[bool] = ..., overlap: _Optional[bool] = ..., branches: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "prompt_ids", "sampling", "max_new_tokens", "stop", "speculative", "tenant", "logprobs", "tools_json")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    prompt_ids: TokenIds
    sampling: _common_pb2.Sampling
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculative: Speculative
    tenant: str
    logprobs: int
    tools_json: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., speculative: _Optional[_Union[Speculative, _Mapping]] = ..., tenant: _Optional[str] = ..., logprobs: _Optional[int] = ..., tools_json: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "finish")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    tokens: Tokens
    finish: Finish
    def __init__(self, tokens: _Optional[_Union[Tokens, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("ids", "text", "logprobs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[str]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[str]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "spec_stats")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_STATS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    spec_stats: SpecStats
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., spec_stats: _Optional[_Union[SpecStats, _Mapping]] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("policy", "drafter", "drafted", "accepted", "verifications", "mean_accepted_tokens", "acceptance_rate", "draft_lengths", "accepted_lengths", "fallback", "fallback_reason", "overlap", "lossy", "wall_time_s", "tokens_per_s", "draft_wait_s", "verify_wait_s", "relaxed_accepted", "discarded", "fallback_kind", "tree_rounds", "branch_accepted", "drafted_on_target", "grammar_drafted")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RELAXED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_KIND_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_ON_TARGET_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    policy: str
    drafter: str
    drafted: int
    accepted: int
    verifications: int
    mean_accepted_tokens: float
    acceptance_rate: float
    draft_lengths: _containers.RepeatedScalarFieldContainer[int]
    accepted_lengths: _containers.RepeatedScalarFieldContainer[int]
    fallback: bool
    fallback_reason: str
    overlap: bool
    lossy: bool
    wall_time_s: float
    tokens_per_s: float
    draft_wait_s: float
    verify_wait_s: float
    relaxed_accepted: int
    discarded: int
    fallback_kind: str
    tree_rounds: int
    branch_accepted: int
    drafted_on_target: bool
    grammar_drafted: int
    def __init__(self, policy: _Optional[str] = ..., drafter: _Optional[str] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., verifications: _Optional[int] = ..., mean_accepted_tokens: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., draft_lengths: _Optional[_Iterable[int]] = ..., accepted_lengths: _Optional[_Iterable[int]] = ..., fallback: _Optional[bool] = ..., fallback_reason: _Optional[str] = ..., overlap: _Optional[bool] = ..., lossy: _Optional[bool] = ..., wall_time_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., draft_wait_s: _Optional[float] = ..., verify_wait_s: _Optional[float] = ..., relaxed_accepted: _Optional[int] = ..., discarded: _Optional[int] = ..., fallback_kind: _Optional[str] = ..., tree_rounds: _Optional[int] = ..., branch_accepted: _Optional[int] = ..., drafted_on_target: _Optional[bool] = ..., grammar_drafted: _Optional[int] = ...) -> None: ...
