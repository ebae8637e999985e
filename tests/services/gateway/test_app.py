"""The gateway over HTTP, served by uvicorn over the tiny LocalBackend: response and SSE
shapes, greedy output equal to the target alone, every bad request a 400 naming its field,
OpenAI's error shape for 401/404, a client disconnect freeing the session, and the
operational routes."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from services.gateway import create_app
from specd.errors import Overloaded, Unavailable

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
STAT_KEYS = {"drafted", "accepted", "mean_accepted_tokens", "acceptance_rate", "draft_lengths",
             "verifications"}


def _events(response: httpx.Response) -> list:
    """The SSE payloads of a stream, JSON-decoded, with [DONE] kept as a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def _chat(http, **body) -> dict:
    r = http.post(CHAT, json={"model": "tiny", "messages": HI, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_completion(http, local_backend):
    out = _chat(http, max_tokens=24)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["model"] == local_backend.model_card().id
    (choice,) = out["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = out["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert STAT_KEYS <= out["spec_stats"].keys() and out["spec_stats"]["policy"] == "cost-aware"


def test_streamed_chat_adds_up_to_the_plain_answer(http):
    plain = _chat(http, max_tokens=24)
    with http.stream("POST", CHAT, json={"messages": HI, "temperature": 0, "max_tokens": 24, "stream": True,
                                         "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    assert events[-1] == "[DONE]"
    first, *middle, final, usage_chunk, _ = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == first["id"] for e in events[:-1])
    text = "".join(e["choices"][0]["delta"]["content"] for e in middle)
    assert text == plain["choices"][0]["message"]["content"]
    assert final["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert STAT_KEYS <= final["spec_stats"].keys()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]


def test_streamed_completion_without_usage(http):
    body = {"prompt": "Hi", "temperature": 0, "max_tokens": 16}
    plain = http.post(COMPLETIONS, json=body).json()
    assert plain["object"] == "text_completion" and STAT_KEYS <= plain["spec_stats"].keys()
    with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        *chunks, done = _events(r)
    assert done == "[DONE]" and all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert "spec_stats" in chunks[-1] and all("spec_stats" not in c for c in chunks[:-1])


@pytest.mark.parametrize("policy", ["constant", "heuristic", "svip", "adaedl"])
def test_greedy_output_equals_the_target_alone(http, policy):
    messages = [{"role": "user", "content": "Hello"}]
    alone = _chat(http, messages=messages, max_tokens=60, speculative={"enabled": False})
    spec = _chat(http, messages=messages, max_tokens=60, speculative={"policy": policy})
    assert alone["spec_stats"]["policy"] == "none" and alone["spec_stats"]["drafted"] == 0
    assert spec["spec_stats"]["policy"] == policy and spec["spec_stats"]["accepted"] > 0
    assert spec["choices"] == alone["choices"] and spec["usage"] == alone["usage"]


PENALTIES = {"presence_penalty": 1.2, "frequency_penalty": 0.6, "repetition_penalty": 1.3,
             "logit_bias": {"5": 3.0, "9": -100}}


@pytest.mark.parametrize("body", [{"temperature": 0}, {"temperature": 0.9, "seed": 3}], ids=["greedy", "seeded"])
def test_penalties_and_logit_bias_are_lossless_and_change_the_answer(http, body):
    messages = [{"role": "user", "content": "Hello"}]
    plain = _chat(http, messages=messages, max_tokens=40, **body, speculative={"enabled": False})
    alone = _chat(http, messages=messages, max_tokens=40, **body, **PENALTIES, speculative={"enabled": False})
    spec = _chat(http, messages=messages, max_tokens=40, **body, **PENALTIES, speculative={"policy": "constant"})
    assert spec["choices"] == alone["choices"] and spec["spec_stats"]["drafted"] > 0
    assert alone["choices"] != plain["choices"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_target_alones_token_by_token(http, stream):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 30, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}

    def answer(**extra) -> tuple[str, list[dict]]:
        if not stream:
            out = _chat(http, **body, **extra)
            return out["choices"][0]["message"]["content"], out["choices"][0]["logprobs"]["content"]
        with http.stream("POST", CHAT, json={**body, **extra, "stream": True}) as r:
            chunks = [e for e in _events(r) if e != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        return text, [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                      for t in c["choices"][0]["logprobs"]["content"]]

    alone_text, alone = answer(speculative={"enabled": False})
    spec_text, spec = answer(speculative={"policy": "constant"})
    assert spec_text == alone_text and len(spec) == len(alone) > 0
    for a, b in zip(alone, spec):
        assert a["token"] == b["token"] and a["bytes"] == list(a["token"].encode())
        assert b["logprob"] == pytest.approx(a["logprob"], abs=1e-4) and b["logprob"] <= 0
        assert [t["token"] for t in b["top_logprobs"]] == [t["token"] for t in a["top_logprobs"]]
        assert len(b["top_logprobs"]) == 2 and b["top_logprobs"][0]["logprob"] >= b["logprob"] - 1e-6
    assert "".join(t["token"] for t in spec) == spec_text  # the tiny tokenizer's tokens are whole characters


def test_completion_logprobs_follow_the_completions_api(http):
    out = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 12, "temperature": 0, "logprobs": 3}).json()
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == choice["text"]
    assert all(len(top) <= 3 and max(top.values()) >= v - 1e-6 for top, v in zip(lp["top_logprobs"],
                                                                                   lp["token_logprobs"]))
    with http.stream("POST", COMPLETIONS, json={"prompt": "Hi", "max_tokens": 12, "temperature": 0, "logprobs": 3,
                                                "stream": True}) as r:
        chunks = [e for e in _events(r) if e != "[DONE]"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]
    plain = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 4, "temperature": 0}).json()
    assert plain["choices"][0]["logprobs"] is None


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
], ids=["json_object", "json_schema"])
def test_structured_output_is_lossless_and_follows_the_grammar(http, response_format):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 80, "temperature": 0,
            "response_format": response_format}
    alone = _chat(http, **body, speculative={"enabled": False})
    spec = _chat(http, **body, speculative={"policy": "constant"})
    assert spec["choices"] == alone["choices"]
    text = spec["choices"][0]["message"]["content"]
    assert text.startswith("{") and spec["spec_stats"]["grammar_drafted"] > 0
    if spec["choices"][0]["finish_reason"] == "stop":
        value = json.loads(text)
        assert "json_schema" not in response_format or set(value) == {"name", "age"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_n_choices_are_each_the_target_alones_with_seed_plus_i(http, route, stream):
    prompt = {"messages": [{"role": "user", "content": "Hello"}]} if route == CHAT else {"prompt": "Hi"}
    body = {**prompt, "max_tokens": 20, "temperature": 0.9, "seed": 40, "stream_options": {"include_usage": True}}

    def texts(**extra) -> tuple[list[str], dict]:
        if not stream:
            out = http.post(route, json={**body, **extra}).json()
            assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
            key = "message" if route == CHAT else None
            return [c["message"]["content"] if key else c["text"] for c in out["choices"]], out["usage"]
        with http.stream("POST", route, json={**body, **extra, "stream": True}) as r:
            chunks = [e for e in _events(r) if e != "[DONE]"]
        n = extra.get("n", 1)
        parts = [""] * n
        for c in chunks:
            for choice in c["choices"]:
                parts[choice["index"]] += choice["delta"].get("content", "") if route == CHAT else choice["text"]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert len(usage) == 1 and not chunks[-1]["choices"]  # one usage chunk, last
        return parts, usage[0]

    many, usage = texts(n=3, speculative={"policy": "constant"})
    singles = [texts(seed=40 + i, speculative={"enabled": False}) for i in range(3)]
    assert many == [t[0][0] for t in singles] and len(set(many)) > 1
    assert usage["completion_tokens"] == sum(t[1]["completion_tokens"] for t in singles)
    assert usage["prompt_tokens"] == singles[0][1]["prompt_tokens"]


def test_sampling_with_a_seed_is_reproducible(http):
    """The same seed gives the same text: whatever the policy (and the state it learnt from the
    request before), and the target alone's."""
    body = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 7, "max_tokens": 24}
    alone = _chat(http, **body, speculative={"enabled": False})
    runs = [_chat(http, **body, speculative={"policy": p}) for p in ("constant", "heuristic", "heuristic")]
    assert alone["usage"]["completion_tokens"] > 0
    assert all(r["choices"] == alone["choices"] for r in runs)
    assert sum(r["spec_stats"]["accepted"] for r in runs) > 0


BAD = [  # (route, body, param)
    (CHAT, {"messages": HI, "speculative": {"policy": "no-such-policy"}}, "speculative.policy"),
    (CHAT, {"messages": HI, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": HI, "max_tokens": 1001}, "max_tokens"),  # the gateway's limit
    (CHAT, {"messages": HI, "max_tokens": 700}, "max_tokens"),  # the model's context (engine)
    (CHAT, {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": HI, "temperature": -1}, "temperature"),
    (CHAT, {"messages": HI, "temperature": 3}, "temperature"),
    (CHAT, {"messages": HI, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": HI, "top_p": 0}, "top_p"),
    (CHAT, {"messages": "Hi"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": ""}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
    (CHAT, {"messages": [{"role": "robot", "content": "Hi"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),  # longer than the context
    (CHAT, {"messages": HI, "n": 17}, "n"),
    (CHAT, {"messages": HI, "n": 0}, "n"),
    (CHAT, {"messages": HI, "n": 3, "logit_bias": {"100000": 1}}, "logit_bias"),  # every choice refused at once
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (CHAT, {"messages": HI, "logprobs": True, "speculative": {"branches": 2}}, "speculative.branches"),
    (CHAT, {"messages": HI, "stop": 5}, "stop"),
    (CHAT, {"messages": HI, "response_format": {"type": "yaml"}}, "response_format.type"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}},
     "response_format"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_object"}, "speculative": {"branches": 2}},
     "speculative.branches"),
    (CHAT, {"messages": HI, "presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"messages": HI, "frequency_penalty": -3}, "frequency_penalty"),
    (CHAT, {"messages": HI, "repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"messages": HI, "logit_bias": {"a": 1}}, "logit_bias"),
    (CHAT, {"messages": HI, "logit_bias": {"5": 101}}, "logit_bias"),
    (CHAT, {"messages": HI, "logit_bias": {"100000": 1}}, "logit_bias"),  # past the vocabulary
    (CHAT, {"messages": HI, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    (CHAT, {"messages": HI, "presence_penalty": 1, "speculative": {"branches": 2}}, "speculative.branches"),
    (CHAT, {"messages": HI, "speculative": {"policy": "svip", "params": {"h": -1}}}, "speculative.params.h"),
    (CHAT, {"messages": HI, "speculative": {"params": {"no_such_param": 1}}},
     "speculative.params.no_such_param"),
    (CHAT, {"messages": HI, "speculative": {"params": {"k0": "many"}}}, "speculative.params.k0"),
    (CHAT, {"messages": HI, "speculative": {"max_draft_tokens": 0}}, "speculative.max_draft_tokens"),
    (CHAT, {"messages": HI, "speculative": {"relaxed": True}}, "speculative.relaxed"),
    (CHAT, {"messages": HI, "speculative": {"polcy": "svip"}}, "speculative.polcy"),
    (COMPLETIONS, {"prompt": "x" * 600}, "prompt"),
    (COMPLETIONS, {"prompt": "   "}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
    (COMPLETIONS, {"prompt": "Hi", "echo": True}, "echo"),
    (COMPLETIONS, {"prompt": "Hi", "best_of": 2}, "best_of"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route, body, param", BAD)
def test_bad_request_is_a_400_naming_the_field(http, route, body, param, stream):
    r = http.post(route, json={"model": "tiny", **body, "stream": stream})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("content, headers", [
    (b"{not json", {"content-type": "application/json"}),
    (b"[1, 2]", {"content-type": "application/json"}),
    (b'{"messages": []}', {}),  # no JSON content type: not parsed (FastAPI's CSRF guard)
])
def test_a_body_that_is_not_a_json_object_is_a_400(http, content, headers):
    r = http.post(CHAT, content=content, headers=headers)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] is None


def test_unknown_fields_are_ignored(http):
    out = _chat(http, max_tokens=4, user="someone", metadata={"a": "b"}, store=False)
    assert out["usage"]["completion_tokens"] <= 4


def test_unknown_route_and_method_use_the_error_shape(http):
    r = http.get("/v1/no-such-route")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "Invalid URL (GET /v1/no-such-route)",
                                  "type": "invalid_request_error", "param": None, "code": None}}
    r = http.get(CHAT)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_api_keys(serve, local_backend):
    url = serve(create_app(local_backend, api_keys=frozenset({"k1"})))
    body = {"messages": HI, "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
            r = c.post(CHAT, json=body, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["param"] is None
        assert c.get("/v1/models").status_code == 401
        assert c.post(CHAT, json=body, headers={"Authorization": "Bearer k1"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


LONG = {"messages": [{"role": "user", "content": "the"}], "temperature": 0, "max_tokens": 480,
        "speculative": {"enabled": False}}  # the tiny target answers "the" with 480 tokens, no EOS


def _wait_idle(backend, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while backend.active_sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.active_sessions == 0


def test_client_disconnect_mid_stream_frees_the_session(http, local_backend):
    # On a starved machine the tiny target can finish all its tokens before this client reads
    # the first line (CI saw it once); such a try proves nothing, so try again, a few times.
    for _ in range(5):
        cancelled = local_backend.cancelled_sessions
        with http.stream("POST", CHAT, json={**LONG, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
            running = local_backend.active_sessions == 1
        # Leaving the block closes the unread response, and so the connection.
        _wait_idle(local_backend)
        if running:
            break
    assert running
    assert local_backend.cancelled_sessions == cancelled + 1


def test_client_disconnect_before_a_plain_answer_frees_the_session(http, local_backend):
    cancelled = local_backend.cancelled_sessions
    with pytest.raises(httpx.ReadTimeout):
        http.post(CHAT, json=LONG, timeout=0.3)  # the answer takes seconds: the client gives up
    _wait_idle(local_backend)
    assert local_backend.cancelled_sessions == cancelled + 1
    assert 'route="/v1/chat/completions",status="499"' in http.get("/metrics").text


def test_models(http, local_backend):
    out = http.get("/v1/models").json()
    card = local_backend.model_card()
    assert out["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"], m["draft"]) for m in out["data"]] == \
        [(card.id, "model", 512, card.draft)]


def test_health_metrics_and_openapi(http):
    assert http.get("/health").json() == {"status": "ok"}
    http.get("/v1/no-such-route")
    text = http.get("/metrics").text
    assert 'specd_gateway_requests_total{route="/health",status="200"}' in text
    assert 'specd_gateway_requests_total{route="unmatched",status="404"}' in text
    paths = http.get("/openapi.json").json()["paths"]
    assert {CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics"} <= paths.keys()


def test_health_is_503_when_the_backend_is_not_ready(serve, local_backend):
    class NotReady:
        def model_card(self):
            return local_backend.model_card()

        async def ready(self) -> bool:
            return False

    r = httpx.get(serve(create_app(NotReady())) + "/health")
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}


class _Failing:
    """A backend whose every request fails before its first event."""

    def __init__(self, card, exc: Exception):
        self.card, self.exc = card, exc

    def model_card(self):
        return self.card

    async def ready(self) -> bool:
        return True

    async def generate(self, request):
        raise self.exc
        yield  # an async generator, like a real backend


@pytest.mark.parametrize("exc, status, type_", [
    (Overloaded("all 16 KV slots are in use"), 503, "server_error"),
    (Unavailable("target service unreachable"), 503, "server_error"),
    (RuntimeError("a bug"), 500, "server_error"),
])
def test_backend_errors_map_to_statuses(serve, local_backend, exc, status, type_):
    url = serve(create_app(_Failing(local_backend.model_card(), exc)))
    for stream in (False, True):
        r = httpx.post(url + CHAT, json={"messages": HI, "stream": stream})
        assert r.status_code == status and r.json()["error"]["type"] == type_
        assert ("retry-after" in r.headers) == (status == 503)  # refused at once, told when to retry
    if status == 500:
        assert r.json()["error"]["message"] == "internal server error"  # no internals leak


class _Held:
    """A backend whose answers wait until `go` is set: their generations stay in flight."""

    def __init__(self, card):
        import threading

        self.card, self.go, self.closed = card, threading.Event(), 0

    def model_card(self):
        return self.card

    async def ready(self) -> bool:
        return True

    async def generate(self, request):
        import asyncio

        from services.coordinator.api import FinishEvent, TokenEvent

        try:
            yield TokenEvent([1], "Hi")
            while not self.go.is_set():
                await asyncio.sleep(0.01)
            yield FinishEvent("stop", 1, 1)
        finally:
            self.closed += 1


def test_over_the_concurrency_limit_a_request_is_refused_at_once(serve, local_backend):
    """Two generations in flight at a limit of two: the third gets 503 with Retry-After at
    once, the two finish undisturbed, and their slots come back (streamed or not)."""
    from concurrent.futures import ThreadPoolExecutor

    backend = _Held(local_backend.model_card())
    app = create_app(backend, max_concurrent_requests=2)
    url = serve(app)

    def stream():
        with httpx.stream("POST", url + CHAT, json={"messages": HI, "stream": True}, timeout=30) as r:
            return r.status_code, "".join(r.iter_text())

    def plain():
        r = httpx.post(url + CHAT, json={"messages": HI}, timeout=30)
        return r.status_code, r.text

    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(stream), pool.submit(plain)]
        deadline = time.monotonic() + 10
        while app.state.gateway.admission.in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        refused = httpx.post(url + CHAT, json={"messages": HI}, timeout=30)
        assert time.monotonic() - t0 < 5  # refused at once, not queued behind the two
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "overloaded"
        backend.go.set()
        (s_status, s_body), (p_status, _) = held[0].result(10), held[1].result(10)
    assert s_status == 200 and "[DONE]" in s_body and p_status == 200
    # The stream gives its place back as its response ends on the server, which may be just
    # after the client has read the last byte.
    deadline = time.monotonic() + 5
    while app.state.gateway.admission.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.state.gateway.admission.in_flight == 0
    assert httpx.post(url + CHAT, json={"messages": HI}, timeout=30).status_code == 200
