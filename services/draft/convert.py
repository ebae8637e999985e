"""Protobuf <-> domain conversion for the draft service."""

from __future__ import annotations

from services.common.convert import (
    distribution_to_proto,
    features_from_proto,
    sampling_from_proto,
    top_logprobs_from_proto,
)
from services.draft.core import DraftOpen, TargetCosts
from services.proto.specd.draft.v1 import draft_pb2
from specd.errors import InvalidRequest
from specd.policies import NO_SPECULATION, check_spec
from specd.speculation.proposer import Ack, Commit, Token, WindowEnd
from specd.types import SpecParams

REASONS = {
    "policy": draft_pb2.STOP_REASON_POLICY,
    "cap": draft_pb2.STOP_REASON_CAP,
    "no_proposal": draft_pb2.STOP_REASON_NO_PROPOSAL,
    "length": draft_pb2.STOP_REASON_LENGTH,
}


def open_from_proto(msg: draft_pb2.OpenDraft) -> DraftOpen:
    """The Open message as a DraftOpen; InvalidRequest naming the field it cannot take."""
    spec = SpecParams(msg.policy, msg.max_draft_tokens if msg.HasField("max_draft_tokens") else None,
                      dict(msg.policy_params))
    sampling = sampling_from_proto(msg.sampling)
    sampling.validate()
    if not msg.prompt_ids:
        raise InvalidRequest("prompt", "must not be empty")
    if spec.policy == NO_SPECULATION:
        raise InvalidRequest("policy", "a draft session needs a stopping policy; 'none' is the target alone")
    check_spec(spec, sampling)
    if msg.lookahead not in (1, 2):
        raise InvalidRequest("lookahead", f"must be 1 (sequential) or 2 (PEARL), got {msg.lookahead}")
    c = msg.costs
    costs = TargetCosts(verify_seconds=list(c.verify_seconds), batch_seconds=list(c.batch_seconds),
                        batch_token_seconds=list(c.batch_token_seconds), round_overhead_seconds=c.round_overhead_seconds)
    return DraftOpen(list(msg.prompt_ids), sampling, spec, dict(msg.policy_state), msg.max_length, msg.lookahead,
                     msg.send_distributions, msg.vocab_size or None, msg.branches if msg.HasField("branches") else None,
                     costs)


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
    if not msg.tokens:
        raise InvalidRequest("tokens", "a commit appends at least the recovered or bonus token")
    return Commit(msg.commit_id, tuple(msg.tokens), msg.num_verified, msg.num_strict,
                  tuple(msg.js_distances), top, features, other_sessions=msg.other_sessions,
                  other_tokens=msg.other_tokens, side_nodes=msg.side_nodes)


def event_to_proto(event) -> draft_pb2.DraftResponse:
    if isinstance(event, Token):
        tok = draft_pb2.DraftToken(epoch=event.epoch, position=event.position, token=event.token,
                                   prob=event.prob, entropy=event.entropy)
        if event.q is not None:
            tok.q.CopyFrom(distribution_to_proto(event.q))
        return draft_pb2.DraftResponse(token=tok)
    if isinstance(event, WindowEnd):
        end = draft_pb2.WindowEnd(epoch=event.epoch, start=event.start, end=event.end,
                                  reason=REASONS[event.reason], repeat=event.repeat,
                                  side_tokens=event.side_tokens, side_parents=event.side_parents)
        if event.relaxed_threshold is not None:
            end.relaxed_threshold = event.relaxed_threshold
        return draft_pb2.DraftResponse(window_end=end)
    if isinstance(event, Ack):
        return draft_pb2.DraftResponse(ack=draft_pb2.CommitAck(commit_id=event.commit_id, epoch=event.epoch))
    raise TypeError(f"not a draft event: {event!r}")
