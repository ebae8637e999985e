from services.proto.specd.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_POLICY: _ClassVar[StopReason]
    STOP_REASON_CAP: _ClassVar[StopReason]
    STOP_REASON_NO_PROPOSAL: _ClassVar[StopReason]
    STOP_REASON_LENGTH: _ClassVar[StopReason]
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_POLICY: StopReason
STOP_REASON_CAP: StopReason
STOP_REASON_NO_PROPOSAL: StopReason
STOP_REASON_LENGTH: StopReason

class DraftInfo(_message.Message):
    __slots__ = ("model", "kind", "name", "has_distribution", "policies", "top_logprobs", "adapter_version", "needs_features", "branches", "branch_length")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HAS_DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FEATURES_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    BRANCH_LENGTH_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    kind: str
    name: str
    has_distribution: bool
    policies: _containers.RepeatedScalarFieldContainer[str]
    top_logprobs: int
    adapter_version: int
    needs_features: bool
    branches: int
    branch_length: int
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., has_distribution: _Optional[bool] = ..., policies: _Optional[_Iterable[str]] = ..., top_logprobs: _Optional[int] = ..., adapter_version: _Optional[int] = ..., needs_features: _Optional[bool] = ..., branches: _Optional[int] = ..., branch_length: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("open", "commit", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: OpenDraft
    commit: Commit
    close: CloseDraft
    def __init__(self, open: _Optional[_Union[OpenDraft, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., close: _Optional[_Union[CloseDraft, _Mapping]] = ...) -> None: ...

class OpenDraft(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "policy", "policy_params", "max_draft_tokens", "policy_state", "max_length", "lookahead", "send_distributions", "vocab_size", "costs", "branches")
    class PolicyParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PolicyStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_STATE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    SEND_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.Sampling
    policy: str
    policy_params: _containers.ScalarMap[str, float]
    max_draft_tokens: int
    policy_state: _containers.ScalarMap[str, float]
    max_length: int
    lookahead: int
    send_distributions: bool
    vocab_size: int
    costs: _common_pb2.Costs
    branches: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., policy: _Optional[str] = ..., policy_params: _Optional[_Mapping[str, float]] = ..., max_draft_tokens: _Optional[int] = ..., policy_state: _Optional[_Mapping[str, float]] = ..., max_length: _Optional[int] = ..., lookahead: _Optional[int] = ..., send_distributions: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., costs: _Optional[_Union[_common_pb2.Costs, _Mapping]] = ..., branches: _Optional[int] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("commit_id", "tokens", "num_verified", "num_strict", "js_distances", "top_logprobs", "features", "other_sessions", "other_tokens", "side_nodes")
    COMMIT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    NUM_STRICT_FIELD_NUMBER: _ClassVar[int]
    JS_DISTANCES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    OTHER_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OTHER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIDE_NODES_FIELD_NUMBER: _ClassVar[int]
    commit_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_verified: int
    num_strict: int
    js_distances: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    features: _common_pb2.Features
    other_sessions: int
    other_tokens: int
    side_nodes: int
    def __init__(self, commit_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., num_verified: _Optional[int] = ..., num_strict: _Optional[int] = ..., js_distances: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., other_sessions: _Optional[int] = ..., other_tokens: _Optional[int] = ..., side_nodes: _Optional[int] = ...) -> None: ...

class CloseDraft(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("token", "window_end", "ack", "closed")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    token: DraftToken
    window_end: WindowEnd
    ack: CommitAck
    closed: DraftClosed
    def __init__(self, token: _Optional[_Union[DraftToken, _Mapping]] = ..., window_end: _Optional[_Union[WindowEnd, _Mapping]] = ..., ack: _Optional[_Union[CommitAck, _Mapping]] = ..., closed: _Optional[_Union[DraftClosed, _Mapping]] = ...) -> None: ...

class DraftToken(_message.Message):
    __slots__ = ("epoch", "position", "token", "prob", "entropy", "q")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROB_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    position: int
    token: int
    prob: float
    entropy: float
    q: _common_pb2.Distribution
    def __init__(self, epoch: _Optional[int] = ..., position: _Optional[int] = ..., token: _Optional[int] = ..., prob: _Optional[float] = ..., entropy: _Optional[float] = ..., q: _Optional[_Union[_common_pb2.Distribution, _Mapping]] = ...) -> None: ...

class WindowEnd(_message.Message):
    __slots__ = ("epoch", "start", "end", "reason", "relaxed_threshold", "repeat", "side_tokens", "side_parents")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RELAXED_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    SIDE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIDE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    start: int
    end: int
    reason: StopReason
    relaxed_threshold: float
    repeat: int
    side_tokens: _containers.RepeatedScalarFieldContainer[int]
    side_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., reason: _Optional[_Union[StopReason, str]] = ..., relaxed_threshold: _Optional[float] = ..., repeat: _Optional[int] = ..., side_tokens: _Optional[_Iterable[int]] = ..., side_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitAck(_message.Message):
    __slots__ = ("commit_id", "epoch")
    COMMIT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    commit_id: int
    epoch: int
    def __init__(self, commit_id: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class DraftClosed(_message.Message):
    __slots__ = ("policy_state", "num_drafted", "draft_seconds", "policy_scale")
    class PolicyStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PolicyScaleEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_SCALE_FIELD_NUMBER: _ClassVar[int]
    policy_state: _containers.ScalarMap[str, float]
    num_drafted: int
    draft_seconds: float
    policy_scale: _containers.ScalarMap[str, float]
    def __init__(self, policy_state: _Optional[_Mapping[str, float]] = ..., num_drafted: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., policy_scale: _Optional[_Mapping[str, float]] = ...) -> None: ...
