"""Protobuf <-> domain conversion for the draft service."""

from __future__ import annotations

from services.common.convert import (
    distribution_to_proto,
    features_from_proto,
    sampling_from_proto,
    top_logprobs_from_proto,
)
from services.draft.runner import Ack, Commit, Token, WindowEnd
from services.proto.specd.draft.v1 import draft_pb2
from specd.errors import InvalidRequest
from specd.types import SamplingParams, SpecParams

REASONS = {
    "policy": draft_pb2.STOP_REASON_POLICY,
    "cap": draft_pb2.STOP_REASON_CAP,
    "no_proposal": draft_pb2.STOP_REASON_NO_PROPOSAL,
    "length": draft_pb2.STOP_REASON_LENGTH,
}


def open_from_proto(msg: draft_pb2.OpenDraft) -> tuple[list[int], SamplingParams, SpecParams, dict]:
    spec = SpecParams(msg.policy, msg.max_draft_tokens if msg.HasField("max_draft_tokens") else None,
                      dict(msg.policy_params))
    return list(msg.prompt_ids), sampling_from_proto(msg.sampling), spec, dict(msg.policy_state)


def commit_from_proto(msg: draft_pb2.Commit) -> Commit:
    try:
        top = tuple(top_logprobs_from_proto(msg.top_logprobs))
    except ValueError as e:
        raise InvalidRequest("top_logprobs", str(e)) from None
    if len(top) > msg.num_verified:
        raise InvalidRequest("top_logprobs", f"{len(top)} positions for {msg.num_verified} verified drafts")
    try:
        features = features_from_proto(msg.features)
    except ValueError as e:
        raise InvalidRequest("features", str(e)) from None
    if msg.other_sessions < 0 or msg.other_tokens < 0:
        raise InvalidRequest("other_sessions", "the load of a forward cannot be negative")
    return Commit(msg.commit_id, tuple(msg.tokens), msg.num_verified, msg.num_strict,
                  tuple(msg.js_distances), top, features, msg.other_sessions, msg.other_tokens)


def event_to_proto(event) -> draft_pb2.DraftResponse:
    if isinstance(event, Token):
        tok = draft_pb2.DraftToken(epoch=event.epoch, position=event.position, token=event.token,
                                   prob=event.prob, entropy=event.entropy)
        if event.q is not None:
            tok.q.CopyFrom(distribution_to_proto(event.q))
        return draft_pb2.DraftResponse(token=tok)
    if isinstance(event, WindowEnd):
        end = draft_pb2.WindowEnd(epoch=event.epoch, start=event.start, end=event.end,
                                  reason=REASONS[event.reason], plain_rounds=event.plain_rounds)
        if event.relaxed_threshold is not None:
            end.relaxed_threshold = event.relaxed_threshold
        return draft_pb2.DraftResponse(window_end=end)
    if isinstance(event, Ack):
        return draft_pb2.DraftResponse(ack=draft_pb2.CommitAck(commit_id=event.commit_id, epoch=event.epoch))
    raise TypeError(f"not a draft event: {event!r}")
