"""Tool calls (specd.tools), in each format,: parsed out of an answer whole or as it streams, and
the grammar of an answer that must be one call."""

from __future__ import annotations

import json

import pytest

from specd.errors import InvalidRequest
from specd.tools import (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, CallStream, call_grammar, call_tokens,
                         history_for, parse_calls)

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


MISTRAL_CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.mark.parametrize("fmt, text", [
    (MISTRAL, MISTRAL_CALL),
    (MISTRAL, '[TOOL_CALLS] {"name": "get_weather", "arguments": {"city": "Paris"}}'),  # one call, no list
    (MISTRAL_ARGS, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
    (MISTRAL_ARGS, '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}')])
def test_mistral_calls_follow_the_control_token(fmt, text):
    content, calls = parse_calls("Looking. " + text, fmt)
    assert content == "Looking." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    call_id = calls[0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()  # what Mistral's templates take back
    assert parse_calls(text, fmt)[0] is None


def test_several_mistral_calls_and_what_is_not_one():
    two = '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    assert [c["function"]["name"] for c in parse_calls(two, MISTRAL)[1]] == ["a", "b"]
    two = '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": 1}'
    assert [c["function"]["name"] for c in parse_calls(two, MISTRAL_ARGS)[1]] == ["a", "b"]
    for fmt, text in [(MISTRAL, "plain"), (MISTRAL, "[TOOL_CALLS] not json"), (MISTRAL, '[TOOL_CALLS] [{"x": 1}]'),
                      (MISTRAL_ARGS, "[TOOL_CALLS]a{}"), (MISTRAL_ARGS, "[TOOL_CALLS]a[ARGS]{bad")]:
        assert parse_calls(text, fmt) == (text, [])


def test_a_mistral_stream_holds_back_from_the_control_token():
    stream = CallStream(MISTRAL)
    sent = "".join(stream.push(p) for p in ["Hi ", "[TOOL_CALLS]", ' [{"name": "w", ', '"arguments": {}}]'])
    rest, calls = stream.finish()
    assert sent == "Hi " and rest == "" and calls[0]["function"]["name"] == "w"


def test_mistral_histories_get_the_ids_their_templates_take():
    history = [{"role": "assistant", "tool_calls": [{"id": "call_0123456789abcdef", "function": {"name": "w"}}]},
               {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "rain"},
               {"role": "tool", "tool_call_id": "c-1", "content": "sun"}]
    out = history_for(history, MISTRAL)
    assert out[0]["tool_calls"][0]["id"] == out[1]["tool_call_id"] == "789abcdef"
    assert out[2]["tool_call_id"] == "0000000c1"
    assert history[0]["tool_calls"][0]["id"] == "call_0123456789abcdef"  # the request's own are left alone
    assert history_for(history, HERMES) is history


def test_the_mistral_grammars_start_with_the_control_tokens_id():
    from specd.grammar import Grammar
    from specd.runtime.tiny import char_tokenizer

    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]
    for fmt, tail in ((MISTRAL, ' [{"name": "w", "arguments": {"city": "'), (MISTRAL_ARGS, "w")):
        spec = call_grammar(tools, None, fmt)
        spec.validate()  # without a tokenizer, as the gateway checks it
        grammar = Grammar(spec, tok, len(tok), [tok.eos_token_id])
        forced = grammar.forced(len(tail) + 1)
        assert forced[0] == tok.convert_tokens_to_ids("[TOOL_CALLS]")
        assert tok.decode(forced[1:]) == tail
    assert call_tokens(tok, MISTRAL_ARGS) == {tok.convert_tokens_to_ids("[TOOL_CALLS]"): "[TOOL_CALLS]",
                                              tok.convert_tokens_to_ids("[ARGS]"): "[ARGS]"}
    assert call_tokens(tok, HERMES) == {}
    with pytest.raises(InvalidRequest) as e:  # a model without the token
        Grammar(call_grammar(tools, None, MISTRAL), char_tokenizer(), 98, [2])
    assert e.value.field == "response_format"
