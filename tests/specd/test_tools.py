"""Hermes-style tool calls (specd.tools): parsed out of an answer whole or as it streams, and
the grammar of an answer that must be one call."""

from __future__ import annotations

import json

import pytest

from specd.errors import InvalidRequest
from specd.tools import LLAMA3_JSON, CallStream, call_grammar, parse_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_calls_are_taken_out_of_the_text():
    content, calls = parse_calls("Let me look. " + CALL + " " + CALL.replace("Paris", "Oslo"))
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_calls(CALL)[0] is None  # a call alone: no text


@pytest.mark.parametrize("text", ["no call here", "<tool_call>not json</tool_call>", '<tool_call>{"x": 1}</tool_call>',
                                  "<tool_call>{\"name\": \"f\"}"])  # unclosed
def test_what_is_not_a_call_stays_text(text):
    assert parse_calls(text) == (text, [])


@pytest.mark.parametrize("pieces", [["Hi ", CALL], ["Hi <to", "ol_call>", CALL[len("<tool_call>"):]],
                                    list("Hi " + CALL)])
def test_a_stream_sends_the_text_and_holds_a_call_back(pieces):
    stream = CallStream()
    sent = "".join(stream.push(p) for p in pieces)
    rest, calls = stream.finish()
    assert sent == "Hi " and rest == "" and calls[0]["function"]["name"] == "get_weather"


def test_a_stream_sends_what_only_looked_like_a_tag():
    stream = CallStream()
    sent = "".join(stream.push(p) for p in ["a <t", "able> b", " <tool"])
    assert sent == "a <table> b "
    assert stream.finish() == ("<tool", [])


def test_the_grammar_of_one_call_compiles_and_names_the_tools():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}} for n in ("a", "b")]
    for name in (None, "b"):
        spec = call_grammar(tools, name)
        spec.validate()
        assert spec.kind == "lark" and '"const": "b"' in spec.schema and ('"const": "a"' in spec.schema) == (name is None)
    with pytest.raises(InvalidRequest) as e:
        call_grammar(tools, "c")
    assert e.value.field == "tool_choice"


def test_llama3_json_answers_are_calls_only_when_wholly_calls():
    content, calls = parse_calls(' {"name": "w", "parameters": {"city": "Oslo"}}', LLAMA3_JSON)
    assert content is None and calls[0]["function"] == {"name": "w", "arguments": '{"city": "Oslo"}'}
    two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert [c["function"]["name"] for c in parse_calls(two, LLAMA3_JSON)[1]] == ["a", "b"]
    for text in ('It is {"name": "w"}', '{"city": "Oslo"}', "{not json}", "plain"):
        assert parse_calls(text, LLAMA3_JSON) == (text, [])
    stream = CallStream(LLAMA3_JSON)
    assert stream.push("  ") == "" and stream.push('{"name"') == "" and stream.push(': "w", "parameters": {}}') == ""
    assert stream.finish()[1][0]["function"]["name"] == "w"
    stream = CallStream(LLAMA3_JSON)
    assert stream.push("Hello") == "Hello" and stream.push(" {x}") == " {x}" and stream.finish() == ("", [])
    spec = call_grammar([{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}], None,
                        LLAMA3_JSON)
    spec.validate()
    assert spec.kind == "json_schema" and '"parameters"' in spec.schema
