"""Translation between the REST schema and the backend's domain types: a chat or
completions request becomes a GenerateRequest; backend events become OpenAI responses and
stream chunks. No I/O here."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

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
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from specd.errors import InvalidRequest
from specd.policies import NO_SPECULATION
from specd.tools import HERMES, CallStream, call_grammar, parse_calls
from specd.types import MAX_SEED, SamplingParams, SpecParams

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy decoding
_ROLES = {"developer": "system"}  # OpenAI's newer name; chat templates know "system"

Request = ChatCompletionRequest | CompletionRequest


# -- requests ---------------------------------------------------------------------------------

def generate_request(req: Request, *, default_policy: str, max_tokens_limit: int,
                     tool_format: str | None = None) -> GenerateRequest:
    """tool_format: how the backend's model writes tool calls (ModelCard.tool_format)."""
    sampling = sampling_params(req, max_tokens_limit)
    spec = spec_params(req.speculative, default_policy)
    overlap = req.speculative.overlap
    if isinstance(req, ChatCompletionRequest):
        messages = tuple({"role": _ROLES.get(m.role, m.role), "content": m.text, **m.template_fields}
                         for m in req.messages)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" \
            else []
        if req.must_call:  # one call, its arguments under the tool's schema (specd.tools)
            grammar = call_grammar(tools, None if req.must_call is True else req.must_call, tool_format or HERMES)
            try:
                grammar.validate()
            except InvalidRequest as e:
                raise InvalidRequest("tools", f"a function's parameters cannot be used as a schema: {e.message}") \
                    from None
            sampling = replace(sampling, grammar=grammar)
        gen = GenerateRequest(messages=messages, sampling=sampling, spec=spec, overlap=overlap,
                              logprobs=req.logprobs_asked, tools_json=json.dumps(tools) if tools else "")
    else:
        gen = GenerateRequest(prompt=req.text, sampling=sampling, spec=spec, overlap=overlap,
                              logprobs=req.logprobs_asked)
    gen.validate(max_tokens_limit)  # here, whatever the backend: before any conversion to protobuf
    return gen


def choices(gen: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The n generations of a request asking for n choices. With a seed, choice i samples with
    seed + i (mod 2**63), so that each text is reproducible and the choices differ; choice 0 is
    the request's own."""
    seed = gen.sampling.seed
    if n == 1 or seed is None:
        return [gen] * n
    return [replace(gen, sampling=replace(gen.sampling, seed=(seed + i) % (MAX_SEED + 1))) for i in range(n)]


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
        grammar=req.response_format.grammar() if getattr(req, "response_format", None) is not None else None,
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


@dataclass(frozen=True)
class Answer:
    """One whole choice: its text, how it ended, its tokens' log-probabilities (None: not asked)."""

    text: str
    finish: FinishEvent
    logprobs: Sequence[Logprob] | None = None
    tool_calls: Sequence[dict] = ()  # the calls taken out of the text (specd.tools)

    def with_calls(self, fmt: str) -> Answer:
        """The answer with its tool calls (in format fmt) taken out of its text."""
        content, calls = parse_calls(self.text, fmt)
        return replace(self, text=content, tool_calls=calls) if calls else self


def usage_of(finishes: Sequence[FinishEvent]) -> Usage:
    """The usage of a request's choices: one prompt, every choice's tokens."""
    prompt, completion_tokens = finishes[0].prompt_tokens, sum(f.completion_tokens for f in finishes)
    return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens)


def spec_stats_of(finishes: Sequence[FinishEvent]) -> dict:
    """The first choice's statistics; with several choices, each one's in `per_choice` too."""
    if len(finishes) == 1:
        return finishes[0].spec_stats
    return {**finishes[0].spec_stats, "per_choice": [f.spec_stats for f in finishes]}


def chat_completion(env: Envelope, answers: Sequence[Answer]) -> ChatCompletion:
    choices = [ChatChoice(index=i, message=AssistantMessage(content=a.text, tool_calls=list(a.tool_calls) or None),
                          finish_reason="tool_calls" if a.tool_calls else a.finish.finish_reason,
                          logprobs=chat_logprobs(a.logprobs)) for i, a in enumerate(answers)]
    finishes = [a.finish for a in answers]
    return ChatCompletion(id=env.id, created=env.created, model=env.model, choices=choices,
                          usage=usage_of(finishes), spec_stats=spec_stats_of(finishes))


def completion(env: Envelope, answers: Sequence[Answer]) -> Completion:
    choices = [CompletionChoice(index=i, text=a.text, finish_reason=a.finish.finish_reason,
                                logprobs=completion_logprobs(a.logprobs)) for i, a in enumerate(answers)]
    finishes = [a.finish for a in answers]
    return Completion(id=env.id, created=env.created, model=env.model, choices=choices,
                      usage=usage_of(finishes), spec_stats=spec_stats_of(finishes))


def chat_head(env: Envelope, n: int = 1) -> list[ChatCompletionChunk]:
    """The first chunks announce the assistant's role, one per choice, as OpenAI's do."""
    return [_chat_chunk(env, [ChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]) for i in range(n)]


def chat_chunks(env: Envelope, event: Event, include_usage: bool, index: int = 0) -> list[ChatCompletionChunk]:
    if isinstance(event, TokenEvent):
        found = chat_logprobs(event.logprobs) if event.logprobs else None
        return [_chat_chunk(env, [ChunkChoice(index=index, delta=ChatDelta(content=event.text), logprobs=found)])] \
            if event.text or found else []
    last = _chat_chunk(env, [ChunkChoice(index=index, delta=ChatDelta(), finish_reason=event.finish_reason)],
                       spec_stats=event.spec_stats)
    return [last, usage_chunk(env, True, [event])] if include_usage else [last]


def completion_chunks(env: Envelope, event: Event, include_usage: bool, offset: int = 0,
                      index: int = 0) -> list[Completion]:
    """offset: characters of the completion streamed before this event (its logprobs' text_offset)."""
    if isinstance(event, TokenEvent):
        found = completion_logprobs(event.logprobs, offset) if event.logprobs else None
        return [_completion_chunk(env, [CompletionChoice(index=index, text=event.text, logprobs=found)])] \
            if event.text or found else []
    last = _completion_chunk(env, [CompletionChoice(index=index, text="", finish_reason=event.finish_reason)],
                             spec_stats=event.spec_stats)
    return [last, usage_chunk(env, False, [event])] if include_usage else [last]


def usage_chunk(env: Envelope, chat: bool, finishes: Sequence[FinishEvent]) -> BaseModel:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    chunk = _chat_chunk if chat else _completion_chunk
    return chunk(env, [], usage=usage_of(finishes))


def stream_chunks(env: Envelope, chat: bool, include_usage: bool, index: int = 0,
                  tool_format: str | None = None) -> Callable[[Event], list[BaseModel]]:
    """The chunks of each event of one streamed choice, in order; with tools (their call
    format), calls are taken out of the text and sent as tool_calls deltas when the choice ends."""
    if chat and tool_format:
        return _calls_streamed(env, include_usage, index, tool_format)
    if chat:
        return lambda event: chat_chunks(env, event, include_usage, index)
    streamed = 0

    def chunks(event: Event) -> list[BaseModel]:
        nonlocal streamed
        out = completion_chunks(env, event, include_usage, streamed, index)
        streamed += len(event.text) if isinstance(event, TokenEvent) else 0
        return out

    return chunks


def _calls_streamed(env: Envelope, include_usage: bool, index: int, fmt: str) -> Callable[[Event], list[BaseModel]]:
    stream = CallStream(fmt)

    def chunks(event: Event) -> list[BaseModel]:
        if isinstance(event, TokenEvent):
            return chat_chunks(env, replace(event, text=stream.push(event.text)), include_usage, index)
        rest, calls = stream.finish()
        out = chat_chunks(env, TokenEvent((), rest), include_usage, index) if rest else []
        if calls:
            delta = ChatDelta(tool_calls=[ToolCallDelta(index=j, **c) for j, c in enumerate(calls)])
            out.append(_chat_chunk(env, [ChunkChoice(index=index, delta=delta)]))
            event = replace(event, finish_reason="tool_calls")
        return out + chat_chunks(env, event, include_usage, index)

    return chunks


def model_list(card: ModelCard, created: int) -> ModelList:
    return ModelList(data=[ModelInfo(id=card.id, created=created, max_model_len=card.max_context,
                                     draft=card.draft)])


def _chat_chunk(env: Envelope, choices: list[ChunkChoice], **extra) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=env.id, created=env.created, model=env.model, choices=choices, **extra)


def _completion_chunk(env: Envelope, choices: list[CompletionChoice], **extra) -> Completion:
    return Completion(id=env.id, created=env.created, model=env.model, choices=choices, **extra)
