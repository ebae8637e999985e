"""What the gateway (and the coordinator's gRPC servicer) call: one request in, a stream of
events out. Two implementations exist: `Coordinator` (the draft -> verify loop over the
draft and target gRPC services, with PEARL overlap) and `LocalBackend` (the in-process
engine, for a single-process deployment and for tests of the layers above).

A request carries either a completion `prompt`, chat `messages` or raw `prompt_ids`; the
backend owns the tokenizer, so the gateway never loads a model.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specd.errors import InvalidRequest
from specd.logprobs import TokenLogprob, check_logprobs
from specd.types import SamplingParams, SpecParams, check_text

# What one request may send, checked before it is tokenized: far more text than any model's
# context holds is refused at once rather than tokenized first.
MAX_PROMPT_CHARS = 1 << 20
MAX_MESSAGES = 1024
MAX_ROLE_CHARS = 32
MAX_TENANT_CHARS = 64
# Drafts a request may ask a window to hold (CoordinatorSettings.max_draft_tokens): target work
# per emitted token grows with it, and 256 dense q's of a 152k vocabulary pass gRPC's 64 MiB.
# Refused above it rather than clamped: the request asked for something this service does not do.
MAX_REQUEST_DRAFT_TOKENS = 64


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | None = None  # a completion prompt, tokenized without the chat template
    messages: tuple[dict, ...] | None = None  # chat messages ({"role", "content"}), chat template applied
    prompt_ids: tuple[int, ...] | None = None  # already tokenized
    sampling: SamplingParams = SamplingParams()
    spec: SpecParams = SpecParams()  # policy "none" decodes with the target alone
    overlap: bool | None = None  # PEARL overlap; None = the coordinator's setting
    # Who the request is for, as an opaque name (the gateway's label of the API key; "": one
    # shared tenant): the target keeps part of its KV slots for tenants below their fair share.
    tenant: str = ""
    # Each emitted token's log-probability under the target and this many alternatives
    # (specd.logprobs; None: none), in TokenEvent.logprobs.
    logprobs: int | None = None
    # The tools the chat template offers the model: OpenAI's `tools`, as JSON text ("": none).
    # Messages may then carry OpenAI's `tool_calls` (assistant) and `tool_call_id` (tool).
    tools_json: str = ""

    def tool_specs(self) -> list[dict] | None:
        """The tools, for the chat template (None: none); InvalidRequest naming tools for JSON
        that is not a list of them."""
        if not self.tools_json:
            return None
        try:
            tools = json.loads(self.tools_json)
        except ValueError:
            raise InvalidRequest("tools", "is not JSON") from None
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                                  for t in tools):
            raise InvalidRequest("tools", 'is a list of {"type": "function", "function": {...}}')
        return tools

    def validate(self, max_new_tokens_limit: int = 1 << 20,
                 max_draft_tokens_limit: int = MAX_REQUEST_DRAFT_TOKENS) -> None:
        """InvalidRequest naming the first field beyond the limits above or those of the
        sampling and speculation parameters; cheap, and run before any conversion or tokenizing."""
        if self.prompt is not None:
            check_text("prompt", self.prompt)
            if len(self.prompt) > MAX_PROMPT_CHARS:
                raise InvalidRequest("prompt", f"at most {MAX_PROMPT_CHARS} characters, got {len(self.prompt)}")
        if self.messages is not None:
            if len(self.messages) > MAX_MESSAGES:
                raise InvalidRequest("messages", f"at most {MAX_MESSAGES} messages, got {len(self.messages)}")
            for i, m in enumerate(self.messages):
                role, content = m.get("role"), m.get("content")
                if not isinstance(role, str) or not 1 <= len(role) <= MAX_ROLE_CHARS:
                    raise InvalidRequest(f"messages.{i}.role", "must be a role name such as 'user'")
                check_text(f"messages.{i}.role", role)
                if not isinstance(content, str):
                    raise InvalidRequest(f"messages.{i}.content", "must be a string")
                check_text(f"messages.{i}.content", content)
                if not isinstance(m.get("tool_calls", []), list) or not isinstance(m.get("tool_call_id", ""), str):
                    raise InvalidRequest(f"messages.{i}", "tool_calls is a list and tool_call_id a string")
            chars = sum(len(m["content"]) for m in self.messages)
            if chars > MAX_PROMPT_CHARS:
                raise InvalidRequest("messages", f"at most {MAX_PROMPT_CHARS} characters in all, got {chars}")
        if len(self.tools_json) > MAX_PROMPT_CHARS:
            raise InvalidRequest("tools", f"at most {MAX_PROMPT_CHARS} characters of JSON, got {len(self.tools_json)}")
        check_text("tools", self.tools_json)
        self.tool_specs()
        if len(self.tenant) > MAX_TENANT_CHARS:
            raise InvalidRequest("tenant", f"at most {MAX_TENANT_CHARS} characters, got {len(self.tenant)}")
        check_text("tenant", self.tenant)
        if self.prompt_ids is not None and len(self.prompt_ids) > MAX_PROMPT_CHARS:
            raise InvalidRequest("prompt_ids", f"at most {MAX_PROMPT_CHARS} tokens, got {len(self.prompt_ids)}")
        self.sampling.validate(max_new_tokens_limit)
        self.spec.validate(max_draft_tokens_limit)
        check_logprobs(self.logprobs, self.spec)


@dataclass(frozen=True)
class Logprob:
    """One emitted token's text and log-probability, with the most likely tokens at its
    position (text, log-probability), as the OpenAI API reports them."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """Newly emitted tokens and the text they complete (held back while a UTF-8 character
    or a possible stop string is still incomplete); with GenerateRequest.logprobs, one
    Logprob per token id."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    """Last event of every request."""

    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    spec_stats: dict = field(default_factory=dict)  # GenerationStats.to_dict() + coordinator fields


Event = TokenEvent | FinishEvent


@dataclass(frozen=True)
class ModelCard:
    id: str  # the target model's name, served as the OpenAI `model`
    max_context: int
    draft: str | None  # drafter name, None when there is none
    tool_format: str | None = None  # how the chat template writes tool calls (specd.tools), None: no tools


class Backend(Protocol):
    def model_card(self) -> ModelCard: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Async iterator of events. Raises specd.errors.InvalidRequest before the first event
        for bad parameters, Unavailable when the target cannot be reached. Closing the iterator
        early (client disconnect) cancels the request and frees its KV caches."""

    async def ready(self) -> bool:
        """True when a request could be served now (the target is reachable)."""


def named_logprobs(tokenizer, ids: Sequence[int], found: Sequence[TokenLogprob]) -> tuple[Logprob, ...]:
    """The Logprobs of emitted ids, their tokens' text decoded one by one (a token that is part
    of a UTF-8 character reads as U+FFFD, as in vLLM)."""
    def text(token: int) -> str:
        return tokenizer.decode([token])

    return tuple(Logprob(text(t), lp.logprob, tuple((text(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)))
                 for t, lp in zip(ids, found))
