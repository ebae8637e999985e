"""The REST wire format: pydantic models mirroring OpenAI's chat and completions API, plus
the `speculative` request extension and the `spec_stats` response field (docs/services.md, "The protocol").

Unknown request fields are accepted and ignored, as OpenAI clients send many; the ones that
would change the answer and that this server does not implement (echo, best_of, suffix, the
legacy functions) are listed explicitly and refused with a 400 naming them when set to anything
but their default (docs/usage.md, "The OpenAI parameters").

Every list and dict has a length cap checked as it is validated (MAX_MESSAGES is the
coordinator's own cap), so that an oversized request fails at its first item over the cap
rather than after every item was validated.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from services.coordinator.api import MAX_MESSAGES
from specd.grammar import GrammarSpec
from specd.logprobs import MAX_TOP_LOGPROBS
from specd.types import (
    MAX_BRANCHES,
    MAX_DRAFT_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_POLICY_PARAMS,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TOP_K,
    TASK_TAG,
)

# -- requests ---------------------------------------------------------------------------------

MAX_CONTENT_PARTS = MAX_MESSAGES  # text parts of one message
MAX_UNSUPPORTED_ITEMS = 128  # tools, functions (OpenAI's own cap), logit_bias entries, response_format keys
MAX_PROMPTS = 16  # a prompt list (only one prompt is served; more are refused by name)


def _only(*allowed: Any) -> AfterValidator:
    """A field this server accepts only at its default (unset, or one of `allowed`)."""

    default = next((a for a in allowed if a is not None), None)
    hint = "leave it unset" if default is None else f"leave it unset or {default!r}"

    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(f"is not supported by this server; {hint}")
        return value

    return AfterValidator(check)


MAX_CHOICES = 16  # n: each choice is a generation of its own, with its own KV slot


class SpeculativeOptions(BaseModel):
    """Per-request speculation settings (the `speculative` extra body field). Unknown keys
    are refused: a misspelt setting must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(True, description="false decodes with the target alone (policy 'none')")
    policy: str | None = Field(None, description="stopping policy; default: the gateway's")
    max_draft_tokens: int | None = Field(None, ge=1, le=MAX_DRAFT_TOKENS,
                                         description="hard cap on tokens drafted per round")
    params: dict[str, float] = Field(default_factory=dict, max_length=MAX_POLICY_PARAMS,
                                     description="policy hyperparameters by name")
    task_tag: str = Field("default", pattern=f"^{TASK_TAG.pattern}$",
                          description="key of the shared adaptive policy state")
    relaxed: bool = Field(False, description="AdaSD's lossy relaxed verification (adasd only)")
    overlap: bool | None = Field(None, description="PEARL overlap; default: the coordinator's setting")
    branches: int | None = Field(None, ge=0, le=MAX_BRANCHES,
                                 description="side branches verified beside the drafted chain as a draft tree "
                                             "(lookup drafters: ngram, retrieval, hybrid); default: the draft "
                                             "service's, 0: chains only")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Knobs(BaseModel):
    """What chat and completions requests share."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(None, description="ignored: the gateway serves one target model")
    max_tokens: int | None = Field(None, description="tokens to generate (default 256)")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K, description="extension: 0 = off")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="sampling: the same seed gives the same text (the target "
                                                "alone's with that seed, whatever was drafted)")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings; generation stops before the first")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices to generate; with a seed, choice i "
                                                                   "samples with seed + i")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0,
                                           description="subtracted from the logit of every token already "
                                                       "generated (speculation applies it at every drafted "
                                                       "position as the target alone would)")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0,
                                            description="subtracted from a token's logit once per time it was "
                                                        "generated")
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0,
                                             description="extension: a prompt or generated token's logit is "
                                                         "divided by it (multiplied, if negative); 1 = off")
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit")

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit() or len(key) > 10 or int(key) >= 1 << 31:
                raise ValueError(f"keys are token ids (decimal strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases are in [-100, 100], got {bias} for token {key}")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
    speculative: SpeculativeOptions = Field(default_factory=SpeculativeOptions)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    json_schema: dict = Field(alias="schema", description="the JSON schema the answer follows")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _for_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema, and only with it")
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_object")
        return GrammarSpec("json_schema", json.dumps(self.json_schema.json_schema))


class FunctionSpec(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_UNSUPPORTED_ITEMS)] | None = None
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return self

    @property
    def template_fields(self) -> dict:
        """What the chat template reads beyond role and content: the calls (their arguments as
        objects, as templates expect), the call a tool message answers."""
        out: dict = {}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        # Checked before the union so that errors read as one clear message, not two.
        if value is None:
            return value
        if isinstance(value, list):
            if len(value) > MAX_CONTENT_PARTS:
                raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts, got {len(value)}")
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in value):
                raise ValueError('content parts must be {"type": "text", "text": "..."}; '
                                 "only text is supported")
        elif not isinstance(value, str):
            # pydantic turns ValueError, not TypeError, into a validation error
            raise ValueError("must be a string or a list of text parts")  # noqa: TRY004
        return value

    @field_validator("content")
    @classmethod
    def _not_empty(cls, value: str | list[TextPart] | None, info) -> str | list[TextPart] | None:
        if value is None:
            return value
        text = value if isinstance(value, str) else "".join(p.text for p in value)
        if not text.strip() and info.data.get("role") != "tool":  # a tool may return nothing
            raise ValueError("must not be empty")
        return value

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(_Knobs):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens")

    @field_validator("messages", mode="before")
    @classmethod
    def _few_enough(cls, value: Any) -> Any:
        # Before the items: an oversized list fails at once, not after each item was validated.
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages, got {len(value)}")
        return value
    logprobs: bool | None = Field(None, description="return each generated token's log-probability under the "
                                                    "target (temperature 1, before penalties)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="with logprobs: this many most likely tokens at each position")

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @property
    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
    tools: Annotated[list[Tool], Field(max_length=MAX_UNSUPPORTED_ITEMS)] | None = Field(
        None, description="functions the model may call (chat templates that write Hermes-style <tool_call> tags, "
                          "Llama 3.x's JSON calls or Mistral's [TOOL_CALLS])")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required (one call), or a named function")

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_the_tools(cls, value, info):
        tools = info.data.get("tools") or []
        if value not in (None, "none", "auto") and not tools:
            raise ValueError("required or a named function needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names no tool of the request: {value.function.name!r}")
        return value

    @property
    def must_call(self) -> bool | str:
        """False, True (tool_choice required: one call of any tool) or the function to call."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice == "required"
    functions: Annotated[Annotated[list, Field(max_length=MAX_UNSUPPORTED_ITEMS)] | None, _only(None, [])] = None
    function_call: Annotated[Any, _only(None, "none")] = None
    response_format: ResponseFormat | None = Field(None, description="structured output: json_object or "
                                                                     "json_schema constrains the answer")

    @field_validator("response_format")
    @classmethod
    def _not_with_a_forced_call(cls, value, info):
        if value is not None and value.type != "text" and info.data.get("tool_choice") not in (None, "none", "auto"):
            raise ValueError("cannot constrain an answer that tool_choice makes a tool call")
        return value


class CompletionRequest(_Knobs):
    prompt: str | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
    echo: Annotated[bool | None, _only(None, False)] = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="return each generated token's log-probability under the target "
                                             "(temperature 1, before penalties) and this many most likely tokens")
    best_of: Annotated[int | None, _only(None, 1)] = None
    suffix: Annotated[str | None, _only(None)] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_PROMPTS:
            raise ValueError(f"only one prompt per request is supported, got {len(value)}")
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"only one prompt per request is supported, got {len(value)}")
        return value

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs


# -- responses --------------------------------------------------------------------------------

def _absent_if_none(value: Any) -> bool:
    return value is None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobInfo]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent_if_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    spec_stats: dict = Field(description="speculation statistics of this request")


class ToolCallDelta(ToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_absent_if_none)
    content: str | None = Field(None, exclude_if=_absent_if_none)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_absent_if_none)


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event; spec_stats comes with the chunk that carries the finish_reason, usage
    with a last chunk of empty choices when stream_options.include_usage is set."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_absent_if_none)
    spec_stats: dict | None = Field(None, exclude_if=_absent_if_none)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A completion, and also each SSE chunk of a streamed one (as OpenAI does): chunks
    have no usage, except the last one when stream_options.include_usage is set."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_absent_if_none)
    spec_stats: dict | None = Field(None, exclude_if=_absent_if_none)


class ModelInfo(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specd"
    max_model_len: int
    draft: str | None = Field(description="the drafter serving this model, if any")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfo]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
