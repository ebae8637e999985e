"""Protobuf <-> domain conversion for the coordinator's gRPC service (and its clients)."""

from __future__ import annotations

import json

from services.common.convert import sampling_from_proto, sampling_to_proto
from services.coordinator.api import Event, FinishEvent, GenerateRequest, Logprob, TokenEvent
from services.proto.specd.coordinator.v1 import coordinator_pb2 as pb
from specd.errors import InvalidRequest
from specd.types import SpecParams

_STAT_FIELDS = ("policy", "drafter", "drafted", "accepted", "verifications", "mean_accepted_tokens",
                "acceptance_rate", "draft_lengths", "accepted_lengths", "fallback", "fallback_reason", "fallback_kind",
                "overlap", "lossy", "wall_time_s", "tokens_per_s", "draft_wait_s", "verify_wait_s",
                "relaxed_accepted", "discarded", "tree_rounds", "branch_accepted", "drafted_on_target",
                "grammar_drafted")


def request_from_proto(msg: pb.GenerateRequest, default_policy: str) -> GenerateRequest:
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("input", "give a prompt, messages or prompt_ids")
    sp = msg.speculative
    spec = SpecParams(sp.policy or default_policy,
                      sp.max_draft_tokens if sp.HasField("max_draft_tokens") else None,
                      dict(sp.params), sp.task_tag or "default", sp.relaxed,
                      sp.branches if sp.HasField("branches") else None)
    return GenerateRequest(
        prompt=msg.prompt if kind == "prompt" else None,
        messages=tuple(message_from_proto(m) for m in msg.messages.messages)
        if kind == "messages" else None,
        prompt_ids=tuple(msg.prompt_ids.ids) if kind == "prompt_ids" else None,
        sampling=sampling_from_proto(msg.sampling, msg.max_new_tokens, tuple(msg.stop)),
        spec=spec, overlap=sp.overlap if sp.HasField("overlap") else None, tenant=msg.tenant,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None, tools_json=msg.tools_json)


def request_to_proto(r: GenerateRequest) -> pb.GenerateRequest:
    s = r.spec
    sp = pb.Speculative(policy=s.policy, params=s.policy_params, task_tag=s.task_tag, relaxed=s.relaxed)
    if s.max_draft_tokens is not None:
        sp.max_draft_tokens = s.max_draft_tokens
    if r.overlap is not None:
        sp.overlap = r.overlap
    if s.branches is not None:
        sp.branches = s.branches
    msg = pb.GenerateRequest(sampling=sampling_to_proto(r.sampling), max_new_tokens=r.sampling.max_new_tokens,
                             stop=list(r.sampling.stop), speculative=sp, tenant=r.tenant)
    if r.logprobs is not None:
        msg.logprobs = r.logprobs
    msg.tools_json = r.tools_json
    if r.prompt_ids is not None:
        msg.prompt_ids.ids.extend(r.prompt_ids)
    elif r.messages is not None:
        msg.messages.messages.extend(message_to_proto(m) for m in r.messages)
    else:
        msg.prompt = r.prompt or ""
    return msg


def message_from_proto(m: pb.ChatMessage) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        try:
            out["tool_calls"] = json.loads(m.tool_calls_json)
        except ValueError:
            raise InvalidRequest("messages.tool_calls", "is not JSON") from None
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def message_to_proto(m: dict) -> pb.ChatMessage:
    return pb.ChatMessage(role=m["role"], content=m["content"], tool_call_id=m.get("tool_call_id", ""),
                          tool_calls_json=json.dumps(m["tool_calls"]) if m.get("tool_calls") else "")


def event_to_proto(event: Event) -> pb.GenerateResponse:
    if isinstance(event, TokenEvent):
        return pb.GenerateResponse(tokens=pb.Tokens(ids=event.token_ids, text=event.text, logprobs=[
            pb.Logprob(token=lp.token, logprob=lp.logprob, top_tokens=[t for t, _ in lp.top],
                       top_logprobs=[v for _, v in lp.top]) for lp in event.logprobs]))
    stats = {k: v for k, v in event.spec_stats.items() if k in _STAT_FIELDS and v is not None}
    return pb.GenerateResponse(finish=pb.Finish(
        finish_reason=event.finish_reason, prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens, spec_stats=pb.SpecStats(**stats)))


def event_from_proto(msg: pb.GenerateResponse) -> Event:
    if msg.WhichOneof("kind") == "tokens":
        return TokenEvent(tuple(msg.tokens.ids), msg.tokens.text, tuple(
            Logprob(lp.token, lp.logprob, tuple(zip(lp.top_tokens, lp.top_logprobs))) for lp in msg.tokens.logprobs))
    f = msg.finish
    s = f.spec_stats
    stats = {name: getattr(s, name) for name in _STAT_FIELDS}
    stats["draft_lengths"], stats["accepted_lengths"] = list(s.draft_lengths), list(s.accepted_lengths)
    stats["new_tokens"] = f.completion_tokens
    return FinishEvent(f.finish_reason, f.prompt_tokens, f.completion_tokens, stats)
