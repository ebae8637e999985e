"""Tool calls, in the formats chat templates define most:
- `hermes` (Qwen2.5, Qwen3, Hermes): each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- `llama3_json` (Llama 3.1–3.3): the answer is one JSON object, `{"name": ..., "parameters": {...}}`;
- `mistral` (Mistral 7B v0.3, Nemo, Small 3.0): the control token `[TOOL_CALLS]`, then a JSON list
  of `{"name": ..., "arguments": {...}}`;
- `mistral_args` (Mistral Small 3.1/3.2, Magistral, Devstral): `[TOOL_CALLS]name[ARGS]{...}` per
  call (a `[CALL_ID]id` may come between the name and `[ARGS]`).

- The chat template renders the request's tools (check_template refuses a template that takes
  none, or writes calls another way); history_for adapts earlier calls' ids to what it accepts.
- parse_calls turns an answer into its text and OpenAI `tool_calls`; CallStream does it as the
  answer streams, holding back only what may be the start of a call.
- Mistral's markers are control tokens, which decoding drops: call_tokens names the ids a
  request with tools keeps in its text (specd.detok.TextStream's `keep`).
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
from specd.grammar import GrammarSpec, special, token_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral's control tokens

HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS = "hermes", "llama3_json", "mistral", "mistral_args"
_LLAMA3_SIGN = '"parameters": dictionary of argument name'  # what Llama 3.x templates ask calls to look like
_MARKER = {HERMES: OPEN, MISTRAL: TOOL_CALLS, MISTRAL_ARGS: TOOL_CALLS}  # where a call starts
_MISTRAL_ID = 9  # Mistral's templates take call ids of 9 letters or digits, and refuse others


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
    if TOOL_CALLS in template and _single_token(tokenizer, TOOL_CALLS):
        if ARGS in template:
            return MISTRAL_ARGS if _single_token(tokenizer, ARGS) else None
        return MISTRAL
    return None


def _single_token(tokenizer, text: str) -> bool:
    return token_id(tokenizer, text) is not None


def call_tokens(tokenizer, fmt: str | None = None) -> dict[int, str]:
    """The control tokens a format (default: the tokenizer's template's) writes its calls with,
    id -> text: an answer's text keeps them (decoding drops control tokens) so that its calls
    can be found."""
    if tokenizer is None:
        return {}
    fmt = fmt or template_format(tokenizer)
    if fmt not in (MISTRAL, MISTRAL_ARGS):
        return {}
    ids = {t: token_id(tokenizer, t) for t in (TOOL_CALLS, ARGS, CALL_ID)}
    return {i: t for t, i in ids.items() if i is not None}


def history_for(messages: list[dict], fmt: str | None) -> list[dict]:
    """Messages as the format's template takes them: Mistral's refuse call ids that are not 9
    letters or digits, so each id becomes its last 9 letters and digits (left-padded with 0), the
    same for a call and the tool message that answers it."""
    if fmt not in (MISTRAL, MISTRAL_ARGS):
        return messages

    def short(value: str) -> str:
        return "".join(c for c in value if c.isascii() and c.isalnum())[-_MISTRAL_ID:].rjust(_MISTRAL_ID, "0")

    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "id": short(str(c.get("id", "")))} for c in m["tool_calls"]]
        if m.get("tool_call_id") is not None:
            m["tool_call_id"] = short(str(m["tool_call_id"]))
        out.append(m)
    return out


def check_template(tokenizer) -> str:
    """The template's call format, or InvalidRequest naming tools for one that takes none or
    writes calls in another format."""
    fmt = template_format(tokenizer)
    if fmt is not None:
        return fmt
    if "tools" not in _template(tokenizer):
        raise InvalidRequest("tools", "this model's chat template takes no tools")
    raise InvalidRequest("tools", "this model's chat template writes tool calls in a format specd does not parse "
                                  "yet (it parses Hermes-style <tool_call> tags, Llama 3.x's JSON calls and "
                                  "Mistral's [TOOL_CALLS])")


def _call_id(fmt: str) -> str:
    if fmt in (MISTRAL, MISTRAL_ARGS):
        return uuid.uuid4().hex[:_MISTRAL_ID]  # what the template takes back in the history
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(value, fmt: str) -> dict | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return {"id": _call_id(fmt), "type": "function",
            "function": {"name": value["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _call(payload: str, fmt: str = HERMES) -> dict | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return _as_call(value, fmt)


def _mistral_calls(payload: str, fmt: str) -> list[dict] | None:
    """The calls after the first [TOOL_CALLS], or None where they are not all calls."""
    if fmt == MISTRAL:
        try:
            value = json.loads(payload)
        except ValueError:
            return None
        calls = [_as_call(v, fmt) for v in (value if isinstance(value, list) else [value])]
        return calls if calls and all(calls) else None
    calls = []
    for part in payload.split(TOOL_CALLS):
        name, sep, args = part.partition(ARGS)
        name = name.split(CALL_ID)[0].strip()
        if not sep or not name:
            return None
        try:
            arguments = json.loads(args)
        except ValueError:
            return None
        calls.append(_as_call({"name": name, "arguments": arguments}, fmt))
    return calls if all(calls) else None


def parse_calls(text: str, fmt: str = HERMES) -> tuple[str | None, list[dict]]:
    """An answer's text outside its calls (None if there is none) and its calls, OpenAI's
    `tool_calls`. A tag whose payload is not a call stays in the text; in llama3_json, an
    answer that is not wholly calls (one JSON object, or several joined by ";") is text; in
    Mistral's formats, the calls are all that follows [TOOL_CALLS], or the answer is text."""
    if fmt in (MISTRAL, MISTRAL_ARGS):
        at = text.find(TOOL_CALLS)
        calls = _mistral_calls(text[at + len(TOOL_CALLS):].strip(), fmt) if at >= 0 else None
        return ((text[:at].strip() or None), calls) if calls else (text, [])
    if fmt == LLAMA3_JSON:
        parts = [p for p in text.strip().split(";") if p.strip()] if text.strip().startswith("{") else []
        calls = [_call(p, fmt) for p in parts]
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
    be a call, and is held back whole; in the others, everything from a call's marker on."""

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
        marker = _MARKER[self.fmt]
        start = self.text.find(marker, self.sent)
        if start >= 0:
            end = start  # a call began: nothing past its tag goes out before the answer ends
        else:
            end = len(self.text)
            for k in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):  # a tag's start
                if marker.startswith(self.text[-k:]):
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


_COMPACT = {"x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}}


def call_grammar(tools: Sequence[dict], name: str | None, fmt: str = HERMES) -> GrammarSpec:
    """The grammar of one call of the tool `name` (None: of any tool), in the format's shape:
    within Hermes tags, the bare JSON object of Llama 3.x, or after Mistral's [TOOL_CALLS]
    (a control token, named for specd.grammar to find its id)."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise InvalidRequest("tool_choice", f"names no tool of the request: {name!r}")
    if fmt == MISTRAL_ARGS:  # the name as text between control tokens, then the arguments' JSON
        options = [f'{special(TOOL_CALLS)} {json.dumps(f["name"])} {special(ARGS)} %json '
                   f'{json.dumps({**(f.get("parameters") or {"type": "object"}), **_COMPACT})}' for f in chosen]
        return GrammarSpec("lark", "start: " + "\n     | ".join(options) + "\n")
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 key: f.get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False} for f in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # Compact JSON: a call's whitespace carries nothing, and a model that wanders in it would
    # spend its tokens there (every space forbidden is also a token the grammar can force).
    schema = {**schema, **_COMPACT}
    if fmt == LLAMA3_JSON:
        return GrammarSpec("json_schema", json.dumps(schema))
    if fmt == MISTRAL:  # the list of calls the template writes, of one call
        return GrammarSpec("lark", f'start: {special(TOOL_CALLS)} " [" call "]"\ncall: %json {json.dumps(schema)}\n')
    lark = f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}\n'
    return GrammarSpec("lark", lark)
