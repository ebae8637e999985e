"""The real gateway (FastAPI under uvicorn, on a free loopback port) over an in-process
Coordinator over the real draft and target gRPC services (tiny models): HTTP -> gateway ->
coordinator -> draft/target. Greedy chat completions, plain and streamed, equal the target
alone's answer for several policies with PEARL overlap on and off, and the official `openai`
SDK parses both kinds of answer."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from services.common.metrics import new_registry
from services.common.state import AsyncMemoryStateStore
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.gateway import create_app
from specd.engine import SpeculativeEngine
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import LoopThread
from tests.services.gateway.conftest import serve_on_loop

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "abcabc abc"}]
N = 24


@pytest.fixture(scope="module")
def services_gateway(target_service, hf_draft_service):
    """Base URL of a gateway served by uvicorn on its own event loop (its own thread), with the
    Coordinator built and connected on that loop: grpc.aio channels belong to one loop."""
    loop = LoopThread()
    registry = new_registry()  # shared by the coordinator and the app, as `specd serve gateway` does

    async def connect() -> Coordinator:
        coordinator = Coordinator(CoordinatorConfig(target_service.address, hf_draft_service.address),
                                  AsyncMemoryStateStore(), registry)
        await coordinator.connect()
        return coordinator

    coordinator = loop.run(connect())
    url, stop = serve_on_loop(create_app(coordinator, registry=registry), loop)
    deadline = time.monotonic() + 20
    while httpx.get(url + "/health", timeout=1).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the gateway's backend was not ready in 20 s"
        time.sleep(0.05)
    yield url
    stop()
    loop.run(coordinator.close())
    loop.stop()


@pytest.fixture(scope="module")
def expected_text(chat_pair) -> str:
    target = chat_pair[0]
    ids = target.encode_prompt(MESSAGES, chat=True)
    out = SpeculativeEngine(target).generate(ids, SamplingParams(max_new_tokens=N), SpecParams("none"))
    return target.decode(out.token_ids)


@pytest.fixture
def http(services_gateway):
    with httpx.Client(base_url=services_gateway, timeout=30) as client:
        yield client


def _body(policy: str, overlap: bool, **more) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": N,
            "speculative": {"policy": policy, "overlap": overlap}, **more}


def _check_stats(stats: dict, policy: str, overlap: bool) -> None:
    assert stats["policy"] == policy and stats["overlap"] is overlap and stats["fallback"] is False
    assert stats["drafter"] and stats["drafted"] > 0 and stats["accepted"] > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
@pytest.mark.parametrize("policy", ["heuristic", "constant"])
def test_chat_completion_is_the_target_alone(http, expected_text, policy, overlap):
    r = http.post(CHAT, json=_body(policy, overlap))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["message"]["content"] == expected_text
    _check_stats(out["spec_stats"], policy, overlap)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
@pytest.mark.parametrize("policy", ["heuristic", "constant"])
def test_streamed_chat_is_the_target_alone(http, expected_text, policy, overlap):
    with http.stream("POST", CHAT, json=_body(policy, overlap, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        payloads = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all("error" not in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == expected_text
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("spec_stats" not in c for c in chunks[:-1])
    _check_stats(final["spec_stats"], policy, overlap)


def test_openai_sdk_parses_both_answers(services_gateway, expected_text):
    with openai.OpenAI(base_url=services_gateway + "/v1", api_key="unused", max_retries=0,
                       timeout=30) as client:
        spec = {"speculative": {"policy": "heuristic", "overlap": True}}
        plain = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=N,
                                               extra_body=spec)
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                                     max_tokens=N, stream=True, extra_body=spec))
    assert plain.choices[0].message.content == expected_text
    assert plain.usage.completion_tokens == plain.model_extra["spec_stats"]["new_tokens"]
    _check_stats(plain.model_extra["spec_stats"], "heuristic", True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert final.choices[0].finish_reason == plain.choices[0].finish_reason
    _check_stats(final.model_extra["spec_stats"], "heuristic", True)


def test_metrics_show_the_in_process_coordinator(http):
    """/metrics of a gateway running the coordinator in-process carries the coordinator's
    speculation series beside the gateway's own."""
    from prometheus_client.parser import text_string_to_metric_families

    body = {"model": "specd", "messages": MESSAGES, "max_tokens": N, "temperature": 0,
            "speculative": {"policy": "constant", "overlap": False}}
    assert http.post(CHAT, json=body).status_code == 200
    samples = [s for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples]

    def value(name: str, **labels) -> float:
        return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("specd_requests_total", policy="constant", status="ok") >= 1
    assert 0 < value("specd_accepted_tokens_total", policy="constant") <= value("specd_drafted_tokens_total",
                                                                                   policy="constant")
    assert value("specd_gateway_requests_total", route=CHAT, status="200") >= 1
    assert value("specd_gateway_request_duration_seconds_count", route=CHAT) >= 1
    assert value("specd_active_sessions", service="gateway") == 1  # the /metrics request itself
    assert value("specd_active_sessions", service="coordinator") == 0
