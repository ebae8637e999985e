from services.proto.specd.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetInfo(_message.Message):
    __slots__ = ("model", "max_batch_size", "costs", "multi_step", "drafter", "drafter_kind")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    MULTI_STEP_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    max_batch_size: int
    costs: _common_pb2.Costs
    multi_step: bool
    drafter: str
    drafter_kind: str
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., max_batch_size: _Optional[int] = ..., costs: _Optional[_Union[_common_pb2.Costs, _Mapping]] = ..., multi_step: _Optional[bool] = ..., drafter: _Optional[str] = ..., drafter_kind: _Optional[str] = ...) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files",)
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class TargetRequest(_message.Message):
    __slots__ = ("open", "verify", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: OpenTarget
    verify: Verify
    close: CloseTarget
    def __init__(self, open: _Optional[_Union[OpenTarget, _Mapping]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ..., close: _Optional[_Union[CloseTarget, _Mapping]] = ...) -> None: ...

class OpenTarget(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "features", "speculate", "tenant", "logprobs")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.Sampling
    features: bool
    speculate: LocalDrafting
    tenant: str
    logprobs: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., features: _Optional[bool] = ..., speculate: _Optional[_Union[LocalDrafting, _Mapping]] = ..., tenant: _Optional[str] = ..., logprobs: _Optional[int] = ...) -> None: ...

class LocalDrafting(_message.Message):
    __slots__ = ("policy", "policy_params", "max_draft_tokens", "policy_state", "max_length")
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
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_STATE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    policy: str
    policy_params: _containers.ScalarMap[str, float]
    max_draft_tokens: int
    policy_state: _containers.ScalarMap[str, float]
    max_length: int
    def __init__(self, policy: _Optional[str] = ..., policy_params: _Optional[_Mapping[str, float]] = ..., max_draft_tokens: _Optional[int] = ..., policy_state: _Optional[_Mapping[str, float]] = ..., max_length: _Optional[int] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("verify_id", "tokens", "probs", "distributions", "relaxed_threshold", "relaxed", "top_logprobs", "side_tokens", "side_parents", "steps")
    VERIFY_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    RELAXED_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    RELAXED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SIDE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIDE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    verify_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    relaxed_threshold: float
    relaxed: bool
    top_logprobs: int
    side_tokens: _containers.RepeatedScalarFieldContainer[int]
    side_parents: _containers.RepeatedScalarFieldContainer[int]
    steps: int
    def __init__(self, verify_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ..., relaxed_threshold: _Optional[float] = ..., relaxed: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., side_tokens: _Optional[_Iterable[int]] = ..., side_parents: _Optional[_Iterable[int]] = ..., steps: _Optional[int] = ...) -> None: ...

class CloseTarget(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetResponse(_message.Message):
    __slots__ = ("verified", "closed")
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    verified: Verified
    closed: TargetClosed
    def __init__(self, verified: _Optional[_Union[Verified, _Mapping]] = ..., closed: _Optional[_Union[TargetClosed, _Mapping]] = ...) -> None: ...

class Verified(_message.Message):
    __slots__ = ("verify_id", "num_accepted", "next_token", "num_strict", "js_distances", "forward_seconds", "batch_size", "decode_seconds_per_token", "prefill_seconds", "top_logprobs", "features", "batch_tokens", "accepted_tokens", "drafted", "emitted_logprobs")
    VERIFY_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_STRICT_FIELD_NUMBER: _ClassVar[int]
    JS_DISTANCES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    EMITTED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    verify_id: int
    num_accepted: int
    next_token: int
    num_strict: int
    js_distances: _containers.RepeatedScalarFieldContainer[float]
    forward_seconds: float
    batch_size: int
    decode_seconds_per_token: float
    prefill_seconds: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    features: _common_pb2.Features
    batch_tokens: int
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    drafted: int
    emitted_logprobs: _containers.RepeatedCompositeFieldContainer[EmittedLogprob]
    def __init__(self, verify_id: _Optional[int] = ..., num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., num_strict: _Optional[int] = ..., js_distances: _Optional[_Iterable[float]] = ..., forward_seconds: _Optional[float] = ..., batch_size: _Optional[int] = ..., decode_seconds_per_token: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., batch_tokens: _Optional[int] = ..., accepted_tokens: _Optional[_Iterable[int]] = ..., drafted: _Optional[int] = ..., emitted_logprobs: _Optional[_Iterable[_Union[EmittedLogprob, _Mapping]]] = ...) -> None: ...

class EmittedLogprob(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TargetClosed(_message.Message):
    __slots__ = ("policy_state", "num_drafted", "draft_seconds", "grammar_drafted", "policy_scale")
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
    GRAMMAR_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_SCALE_FIELD_NUMBER: _ClassVar[int]
    policy_state: _containers.ScalarMap[str, float]
    num_drafted: int
    draft_seconds: float
    grammar_drafted: int
    policy_scale: _containers.ScalarMap[str, float]
    def __init__(self, policy_state: _Optional[_Mapping[str, float]] = ..., num_drafted: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., grammar_drafted: _Optional[int] = ..., policy_scale: _Optional[_Mapping[str, float]] = ...) -> None: ...
