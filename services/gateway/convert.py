"""Translation between the REST schema and the backend's domain types: a chat or
completions request becomes a GenerateRequest; backend events become OpenAI responses and
stream chunks. No I/O here."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from services.coordinator.api import (
    Event,
    FinishEvent,
    GenerateRequest,
    Logprob,
    ModelCard,
    TokenEvent,
)
from services.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ModelInfo,
    ModelList,
    SpeculativeOptions,
    TokenLogprobInfo,
    TopLogprob,
    Usage,
)
from specd.errors import InvalidRequest
from specd.policies import NO_SPECULATION
from specd.types import SamplingParams, SpecParams

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy decoding
_ROLES = {"developer": "system"}  # OpenAI's newer name; chat templates know "system"

Request = ChatCompletionRequest | CompletionRequest


# -- requests ---------------------------------------------------------------------------------

def generate_request(req: Request, *, default_policy: str, max_tokens_limit: int) -> GenerateRequest:
    sampling = sampling_params(req, max_tokens_limit)
    spec = spec_params(req.speculative, default_policy)
    overlap = req.speculative.overlap
    if isinstance(req, ChatCompletionRequest):
        messages = tuple({"role": _ROLES.get(m.role, m.role), "content": m.text} for m in req.messages)
        gen = GenerateRequest(messages=messages, sampling=sampling, spec=spec, overlap=overlap,
                              logprobs=req.logprobs_asked)
    else:
        gen = GenerateRequest(prompt=req.text, sampling=sampling, spec=spec, overlap=overlap,
                              logprobs=req.logprobs_asked)
    gen.validate(max_tokens_limit)  # here, whatever the backend: before any conversion to protobuf
    return gen


def sampling_params(req: Request, max_tokens_limit: int) -> SamplingParams:
    name, max_tokens = "max_tokens", req.max_tokens
    if getattr(req, "max_completion_tokens", None) is not None:
        name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise InvalidRequest(name, f"must be in [1, {max_tokens_limit}], got {max_tokens}")
    return SamplingParams(
        temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        top_k=req.top_k or 0,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        max_new_tokens=max_tokens,
        stop=req.stop_strings,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=req.logit_bias_pairs,
    )


def spec_params(opts: SpeculativeOptions, default_policy: str) -> SpecParams:
    policy = (opts.policy or default_policy) if opts.enabled else NO_SPECULATION
    return SpecParams(policy, opts.max_draft_tokens, dict(opts.params), opts.task_tag, opts.relaxed, opts.branches)


# -- responses --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Envelope:
    """What the response and every chunk of one request share."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, chat: bool, model: str) -> Envelope:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)


def usage(finish: FinishEvent) -> Usage:
    return Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens,
                 total_tokens=finish.prompt_tokens + finish.completion_tokens)


def chat_logprobs(found: Sequence[Logprob] | None) -> ChatLogprobs | None:
    """OpenAI's chat `logprobs` of the tokens found (None: none asked)."""
    if found is None:
        return None

    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "surrogatepass"))}

    return ChatLogprobs(content=[TokenLogprobInfo(**one(lp.token, lp.logprob),
                                                  top_logprobs=[TopLogprob(**one(t, v)) for t, v in lp.top])
                                 for lp in found])


def completion_logprobs(found: Sequence[Logprob] | None, offset: int = 0) -> CompletionLogprobs | None:
    """The completions API's `logprobs` of the tokens found, their text offsets from `offset`."""
    if found is None:
        return None
    offsets = []
    for lp in found:
        offsets.append(offset)
        offset += len(lp.token)
    tops = [dict(lp.top) for lp in found] if any(lp.top for lp in found) else None
    return CompletionLogprobs(tokens=[lp.token for lp in found], token_logprobs=[lp.logprob for lp in found],
                              top_logprobs=tops, text_offset=offsets)


def chat_completion(env: Envelope, text: str, finish: FinishEvent,
                    found: Sequence[Logprob] | None = None) -> ChatCompletion:
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish.finish_reason,
                        logprobs=chat_logprobs(found))
    return ChatCompletion(id=env.id, created=env.created, model=env.model, choices=[choice],
                          usage=usage(finish), spec_stats=finish.spec_stats)


def completion(env: Envelope, text: str, finish: FinishEvent,
               found: Sequence[Logprob] | None = None) -> Completion:
    choice = CompletionChoice(text=text, finish_reason=finish.finish_reason, logprobs=completion_logprobs(found))
    return Completion(id=env.id, created=env.created, model=env.model, choices=[choice],
                      usage=usage(finish), spec_stats=finish.spec_stats)


def chat_head(env: Envelope) -> list[ChatCompletionChunk]:
    """The first chunk announces the assistant's role, as OpenAI's does."""
    return [_chat_chunk(env, [ChunkChoice(delta=ChatDelta(role="assistant", content=""))])]


def chat_chunks(env: Envelope, event: Event, include_usage: bool) -> list[ChatCompletionChunk]:
    if isinstance(event, TokenEvent):
        found = chat_logprobs(event.logprobs) if event.logprobs else None
        return [_chat_chunk(env, [ChunkChoice(delta=ChatDelta(content=event.text), logprobs=found)])] \
            if event.text or found else []
    last = _chat_chunk(env, [ChunkChoice(delta=ChatDelta(), finish_reason=event.finish_reason)],
                       spec_stats=event.spec_stats)
    return [last, _chat_chunk(env, [], usage=usage(event))] if include_usage else [last]


def completion_chunks(env: Envelope, event: Event, include_usage: bool, offset: int = 0) -> list[Completion]:
    """offset: characters of the completion streamed before this event (its logprobs' text_offset)."""
    if isinstance(event, TokenEvent):
        found = completion_logprobs(event.logprobs, offset) if event.logprobs else None
        return [_completion_chunk(env, [CompletionChoice(text=event.text, logprobs=found)])] \
            if event.text or found else []
    last = _completion_chunk(env, [CompletionChoice(text="", finish_reason=event.finish_reason)],
                             spec_stats=event.spec_stats)
    return [last, _completion_chunk(env, [], usage=usage(event))] if include_usage else [last]


def stream_chunks(env: Envelope, chat: bool, include_usage: bool) -> Callable[[Event], list[BaseModel]]:
    """The chunks of each event of one streamed answer, in order."""
    if chat:
        return lambda event: chat_chunks(env, event, include_usage)
    streamed = 0

    def chunks(event: Event) -> list[BaseModel]:
        nonlocal streamed
        out = completion_chunks(env, event, include_usage, streamed)
        streamed += len(event.text) if isinstance(event, TokenEvent) else 0
        return out

    return chunks


def model_list(card: ModelCard, created: int) -> ModelList:
    return ModelList(data=[ModelInfo(id=card.id, created=created, max_model_len=card.max_context,
                                     draft=card.draft)])


def _chat_chunk(env: Envelope, choices: list[ChunkChoice], **extra) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=env.id, created=env.created, model=env.model, choices=choices, **extra)


def _completion_chunk(env: Envelope, choices: list[CompletionChoice], **extra) -> Completion:
    return Completion(id=env.id, created=env.created, model=env.model, choices=choices, **extra)
