"""Tool calls, in the two formats chat templates define most:
- `hermes` (Qwen2.5, Qwen3, Hermes): each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- `llama3_json` (Llama 3.1–3.3): the answer is one JSON object, `{"name": ..., "parameters": {...}}`.

- The chat template renders the request's tools (check_template refuses a template that takes
  none, or writes calls another way).
- parse_calls turns an answer into its text and OpenAI `tool_calls`; CallStream does it as the
  answer streams, holding back only what may be the start of a call.
- call_grammar is the grammar of an answer that must be one call (tool_choice `required` or a
  named function): the tag, a JSON object whose name is a tool's and whose arguments follow that
  tool's parameters schema, the closing tag. It is structured output (specd.grammar), so the
  call is verified as losslessly as any other answer.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence

from specd.errors import InvalidRequest
from specd.grammar import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_LLAMA3_SIGN = '"parameters": dictionary of argument name'  # what Llama 3.x templates ask calls to look like


def _template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: the default, or one for tool use
        template = template.get("tool_use") or template.get("default") or ""
    return template


def template_format(tokenizer) -> str | None:
    """How the model's chat template has it write tool calls; None where it takes no tools, or
    writes them in a format specd does not parse."""
    template = _template(tokenizer)
    if "tools" not in template:
        return None
    if OPEN in template:
        return HERMES
    if _LLAMA3_SIGN in template:
        return LLAMA3_JSON
    return None


def check_template(tokenizer) -> str:
    """The template's call format, or InvalidRequest naming tools for one that takes none or
    writes calls in another format."""
    fmt = template_format(tokenizer)
    if fmt is not None:
        return fmt
    if "tools" not in _template(tokenizer):
        raise InvalidRequest("tools", "this model's chat template takes no tools")
    raise InvalidRequest("tools", "this model's chat template writes tool calls in a format specd does not parse "
                                  "yet (it parses Hermes-style <tool_call> tags and Llama 3.x's JSON calls)")


def _call(payload: str) -> dict | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse_calls(text: str, fmt: str = HERMES) -> tuple[str | None, list[dict]]:
    """An answer's text outside its calls (None if there is none) and its calls, OpenAI's
    `tool_calls`. A tag whose payload is not a call stays in the text; in llama3_json, an
    answer that is not wholly calls (one JSON object, or several joined by ";") is text."""
    if fmt == LLAMA3_JSON:
        parts = [p for p in text.strip().split(";") if p.strip()] if text.strip().startswith("{") else []
        calls = [_call(p) for p in parts]
        return (None, calls) if calls and all(calls) else (text, [])
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class CallStream:
    """An answer's text as it streams, calls taken out: push gives the text that can go to the
    client now, finish the rest and the calls. In llama3_json an answer that opens with "{" may
    be a call, and is held back whole."""

    def __init__(self, fmt: str = HERMES):
        self.text, self.sent, self.fmt = "", 0, fmt

    def push(self, piece: str) -> str:
        self.text += piece
        if self.fmt == LLAMA3_JSON:
            head = self.text.lstrip()
            if not head or head.startswith("{"):
                return ""
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            end = start  # a call began: nothing past its tag goes out before the answer ends
        else:
            end = len(self.text)
            for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):  # a tag's start
                if OPEN.startswith(self.text[-k:]):
                    end -= k
                    break
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The text not sent yet (calls taken out) and the calls."""
        content, calls = parse_calls(self.text[self.sent:], self.fmt)
        if not calls:
            return self.text[self.sent:], []
        return content or "", calls


def call_grammar(tools: Sequence[dict], name: str | None, fmt: str = HERMES) -> GrammarSpec:
    """The grammar of one call of the tool `name` (None: of any tool), in the format's shape:
    within Hermes tags, or the bare JSON object of Llama 3.x."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise InvalidRequest("tool_choice", f"names no tool of the request: {name!r}")
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 key: f.get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False} for f in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # Compact JSON: a call's whitespace carries nothing, and a model that wanders in it would
    # spend its tokens there (every space forbidden is also a token the grammar can force).
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "key_separator": ": ",
                                       "item_separator": ", "}}
    if fmt == LLAMA3_JSON:
        return GrammarSpec("json_schema", json.dumps(schema))
    lark = f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}\n'
    return GrammarSpec("lark", lark)
