"""Tools through the real gateway (LocalBackend, the tiny target with a Hermes-style chat
template): a required or named call is constrained to the tool's schema and is the target
alone's; calls come back as OpenAI tool_calls, whole and streamed; a template without tools is
refused naming `tools`."""

from __future__ import annotations

import json

import httpx
import pytest

from services.coordinator.local import LocalBackend
from services.gateway import create_app
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.runtime.tiny import char_tokenizer, loaded, perturbed, tiny_llama

CHAT = "/v1/chat/completions"
HERMES = (
    "{%- if tools %}<|im_start|>system\nTools: <tools>{% for t in tools %}{{ t.function.name }} {% endfor %}"
    "</tools> Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = (  # the shape of Llama 3.1-3.3's template: tools in the first user message, calls as bare JSON
    "{%- if tools %}<|im_start|>user\nGiven the following functions, please respond with a JSON for a function call. "
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}. "
    "{% for t in tools %}{{ t.function.name }} {% endfor %}{{ messages[0].content }}<|im_end|>\n"
    "{%- set messages = messages[1:] %}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>ipython\n{{ {'output': m.content} | tojson }}<|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{\"name\": \"{{ m.tool_calls[0].function.name }}\", "
    "\"parameters\": {{ m.tool_calls[0].function.arguments | tojson }}}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_USERS = "{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}"
MISTRAL = (  # the shape of Mistral 7B v0.3's template: tools before the last user turn, calls after [TOOL_CALLS]
    _USERS + "{{ bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{% if tools and m == users[-1] %}[AVAILABLE_TOOLS] {{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}{% set out = c.function | tojson %}"
    "{{ out[:-1] }}{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings "
    "with length 9!') }}{% endif %}, \"id\": \"{{ c.id }}\"}}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, \"call_id\": "
    "\"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- else %} {{ m.content }}{{ eos_token }}{% endif %}{%- endfor %}")
MISTRAL_ARGS = (  # the shape of Mistral Small 3.2's: [TOOL_CALLS]name[ARGS]{...}
    _USERS + "{{ bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{% if tools and m == users[-1] %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments | tojson }}{% endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ m.content }}{{ eos_token }}{% endif %}{%- endfor %}")
MISTRAL_TOKENS = ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                  "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[ARGS]"]
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 6}},
                                                "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "integer"}}, "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Rain in Oslo?"}]


@pytest.fixture(scope="module")
def urls(serve):
    """Gateways whose model's template takes tools (Hermes, Llama 3.x, Mistral, Mistral's
    [ARGS]), and one whose template does not (last)."""
    out = []
    for template in (HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, None):
        tok = char_tokenizer()
        if template in (MISTRAL, MISTRAL_ARGS):  # control tokens, as Mistral's tokenizers have them
            tok.add_special_tokens({"additional_special_tokens": MISTRAL_TOKENS[:7 if template == MISTRAL else 8]})
        if template:
            tok.chat_template = template
        target = loaded(tiny_llama(0, layers=4, vocab_size=len(tok)), "tiny-tools", tok)
        draft = loaded(perturbed(target.model, 0.01, seed=1), "tiny-tools-draft", tok)
        out.append(serve(create_app(LocalBackend(SpeculativeEngine(target, build_drafter("hf", target, draft))))))
    return out


def _chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + CHAT, json={"messages": ASK, "max_tokens": 120, "temperature": 0, **body}, timeout=60)


@pytest.mark.parametrize("choice, name", [("required", None), ({"type": "function", "function": {"name": "time"}},
                                                                 "time")])
def test_a_forced_call_follows_the_tools_schema_and_is_the_target_alones(urls, choice, name):
    body = {"tools": [WEATHER, TIME], "tool_choice": choice}
    alone = _chat(urls[0], **body, speculative={"enabled": False}).json()
    spec = _chat(urls[0], **body, speculative={"policy": "constant"}).json()
    calls = [c["choices"][0]["message"]["tool_calls"] for c in (alone, spec)]
    assert [[(t["function"]["name"], t["function"]["arguments"]) for t in c] for c in calls][0] == \
        [(t["function"]["name"], t["function"]["arguments"]) for t in calls[1]]
    choice0 = spec["choices"][0]
    assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None
    (call,) = choice0["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert name is None or call["function"]["name"] == name
    args = json.loads(call["function"]["arguments"])
    assert set(args) == ({"zone"} if call["function"]["name"] == "time" else {"city"})
    assert spec["spec_stats"]["drafted"] > 0


def test_a_streamed_call_comes_as_a_tool_calls_delta(urls):
    body = {"messages": ASK, "max_tokens": 120, "temperature": 0, "stream": True, "tools": [WEATHER],
            "tool_choice": "required"}
    with httpx.stream("POST", urls[0] + CHAT, json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "weather"
    assert "city" in json.loads(calls[0]["function"]["arguments"])
    assert not any("<tool_call>" in d.get("content", "") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_earlier_calls_and_tool_results_are_rendered(urls):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    r = _chat(urls[0], messages=history, tools=[WEATHER], max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > _chat(urls[0], tools=[WEATHER], max_tokens=8).json()["usage"][
        "prompt_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER]}, "tools"),  # the other model's template takes no tools
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0"),
])
def test_bad_tool_requests_name_their_field(urls, body, param):
    url = urls[-1] if param == "tools" else urls[0]
    r = _chat(url, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_the_openai_sdk_reads_the_calls(urls):
    import openai

    with openai.OpenAI(base_url=urls[0] + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                             temperature=0, max_tokens=120)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "weather" and "city" in json.loads(call.function.arguments)
        chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0,
                                                     tool_choice={"type": "function", "function": {"name": "weather"}},
                                                     max_tokens=120, stream=True))
        streamed = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
        assert [t.function.name for t in streamed] == ["weather"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_json_calls_are_parsed_and_forced(urls, stream):
    body = {"messages": ASK, "max_tokens": 120, "temperature": 0, "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    if not stream:
        alone = _chat(urls[1], **body, speculative={"enabled": False}).json()["choices"][0]
        spec = _chat(urls[1], **body, speculative={"policy": "constant"}).json()["choices"][0]
        assert spec["finish_reason"] == "tool_calls" and spec["message"]["content"] is None
        calls = [c["message"]["tool_calls"] for c in (alone, spec)]
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls[0]] == \
            [(t["function"]["name"], t["function"]["arguments"]) for t in calls[1]]
    else:
        with httpx.stream("POST", urls[1] + CHAT, json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        calls = [[t for d in deltas for t in d.get("tool_calls", [])]]
        assert not any(d.get("content") for d in deltas)  # the call's JSON never went out as text
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = calls[-1]
    assert call["function"]["name"] == "weather" and set(json.loads(call["function"]["arguments"])) == {"city"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("which", [2, 3], ids=["mistral", "mistral_args"])
def test_mistral_calls_are_parsed_and_forced(urls, which, stream):
    """Mistral's calls start with a control token, which the text keeps for requests with tools."""
    body = {"messages": ASK, "max_tokens": 120, "temperature": 0, "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    if not stream:
        alone = _chat(urls[which], **body, speculative={"enabled": False}).json()["choices"][0]
        spec = _chat(urls[which], **body, speculative={"policy": "constant"}).json()["choices"][0]
        assert spec["finish_reason"] == "tool_calls" and spec["message"]["content"] is None, spec
        calls = [c["message"]["tool_calls"] for c in (alone, spec)]
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls[0]] == \
            [(t["function"]["name"], t["function"]["arguments"]) for t in calls[1]]
    else:
        with httpx.stream("POST", urls[which] + CHAT, json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        calls = [[t for d in deltas for t in d.get("tool_calls", [])]]
        assert not any(d.get("content") for d in deltas)  # neither the control token nor the call went out as text
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = calls[-1]
    assert call["function"]["name"] == "weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    assert len(call["id"]) == 9 and call["id"].isalnum()


def test_mistral_templates_take_the_histories_ids_of_any_shape(urls):
    """Mistral's templates refuse call ids that are not 9 letters or digits; OpenAI's are longer."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_Zx81q", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_Zx81q", "content": "rain"}]
    r = _chat(urls[2], messages=history, tools=[WEATHER], max_tokens=8)
    assert r.status_code == 200, r.text
