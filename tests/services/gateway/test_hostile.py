"""Hostile input through the real gateway, in both topologies: the in-process engine
(LocalBackend) and every service separate (gateway -> coordinator service -> draft and target
services, over real gRPC). Each input is answered with a 400 naming the field, never a 500,
and the server goes on answering; a gRPC client that skips the gateway gets INVALID_ARGUMENT
naming the field from the coordinator service. Then schemathesis fuzzes the gateway from its
own OpenAPI schema in both topologies: no generated request gets a 5xx."""

from __future__ import annotations

import grpc
import httpx
import pytest

from clients.specd_client import build_request
from services.common.metrics import new_registry
from services.common.settings import CoordinatorSettings
from services.common.state import AsyncMemoryStateStore
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.coordinator.main import start as start_coordinator
from services.coordinator.remote import RemoteBackend
from services.gateway import create_app
from services.proto.specd.coordinator.v1 import coordinator_pb2_grpc
from tests.services.conftest import LoopThread
from tests.services.gateway.conftest import serve_on_loop

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
MAX_TOKENS_LIMIT = 8  # fuzzed requests that pass validation stay cheap


@pytest.fixture(scope="module")
def remote_gateway(service_loop, target_service, ngram_draft_service):
    """Base URL of a gateway whose backend is a coordinator *service* (RemoteBackend)."""
    settings = CoordinatorSettings(port=0, target_address=target_service.address,
                                   draft_address=ngram_draft_service.address)

    async def coordinator_up():
        coordinator = Coordinator(CoordinatorConfig(settings.target_address, settings.draft_address),
                                  AsyncMemoryStateStore())
        server, port = await start_coordinator(settings, coordinator)
        return coordinator, server, port

    coordinator, server, port = service_loop.run(coordinator_up())
    loop = LoopThread()

    async def backend_up() -> RemoteBackend:
        backend = RemoteBackend(f"127.0.0.1:{port}")
        await backend.connect()
        return backend

    backend = loop.run(backend_up())
    app = create_app(backend, max_tokens_limit=MAX_TOKENS_LIMIT, registry=new_registry())
    url, stop = serve_on_loop(app, loop)
    yield {"url": url, "coordinator": f"127.0.0.1:{port}"}
    stop()
    loop.run(backend.close())
    loop.stop()
    service_loop.run(server.stop(0))
    service_loop.run(coordinator.close())


@pytest.fixture(scope="module")
def local_gateway(serve, local_backend):
    return serve(create_app(local_backend, max_tokens_limit=MAX_TOKENS_LIMIT, registry=new_registry()))


@pytest.fixture(params=["in-process", "services"])
def gateway(request) -> str:
    name = "local_gateway" if request.param == "in-process" else "remote_gateway"
    value = request.getfixturevalue(name)
    return value if isinstance(value, str) else value["url"]


# (route, body as JSON text, the parameter the 400 must name). JSON text, not dicts: some
# inputs (NaN, lone surrogates, integers beyond 64 bits) are what a hostile client sends raw.
HOSTILE = {
    "seed -1": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "seed": -1}', "seed"),
    "seed 2**70": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "seed": %d}' % 2**70, "seed"),
    "seed 1.5": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "seed": 1.5}', "seed"),
    "lone surrogate in a message": (
        CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
    "lone surrogate in a prompt": (COMPLETIONS, '{"prompt": "a\\udfffb"}', "prompt"),
    "lone surrogate in stop": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "stop": ["\\ud800"]}',
                               "stop"),
    "lone surrogate in task_tag": (
        CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "speculative": {"task_tag": "\\ud800"}}',
        "speculative.task_tag"),
    "NaN temperature": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
                        "temperature"),
    "Infinity top_p": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "top_p": Infinity}', "top_p"),
    "NaN policy parameter": (
        CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "speculative": {"params": {"h": NaN}}}',
        "speculative.params.h"),
    "10^9 tokens": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1000000000}',
                    "max_tokens"),
    "10^12 top_k": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "top_k": 1000000000000}', "top_k"),
    "10^12 max_draft_tokens": (
        CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "speculative": {"max_draft_tokens": 1000000000000}}',
        "speculative.max_draft_tokens"),
    "2 MB prompt": (COMPLETIONS, '{"prompt": "%s"}' % ("x" * (2 << 20)), "prompt"),
    "2 MB message": (CHAT, '{"messages": [{"role": "user", "content": "%s"}]}' % ("x" * (2 << 20)), "messages"),
    "10,000 messages": (CHAT, '{"messages": [%s]}' % ", ".join(['{"role": "user", "content": "Hi"}'] * 10000),
                        "messages"),
    "100 stop strings": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "stop": [%s]}'
                         % ", ".join(f'"s{i}"' for i in range(100)), "stop"),
    "a 10,000-character stop string": (
        CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "stop": "%s"}' % ("s" * 10000), "stop"),
    "a 10,000-character task_tag": (
        CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "speculative": {"task_tag": "%s"}}' % ("t" * 10000),
        "speculative.task_tag"),
    "a task_tag with a newline": (
        CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "speculative": {"task_tag": "a\\nb"}}',
        "speculative.task_tag"),
    "100 policy parameters": (
        CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "speculative": {"params": {%s}}}'
        % ", ".join(f'"p{i}": 1' for i in range(100)), "speculative.params"),
    "a long policy name": (
        CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "speculative": {"policy": "%s"}}' % ("p" * 10000),
        "speculative.policy"),
    "messages is a string": (CHAT, '{"messages": "Hi"}', "messages"),
    "max_tokens is a word": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": "ten"}',
                             "max_tokens"),
    "stream is a list": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "stream": [1]}', "stream"),
    "content is a number": (CHAT, '{"messages": [{"role": "user", "content": 5}]}', "messages.0.content"),
    "temperature is an object": (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "temperature": {}}',
                                 "temperature"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_a_400_naming_the_field(gateway, case):
    route, text, param = HOSTILE[case]
    r = httpx.post(gateway + route, content=text.encode(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and len(error["message"]) < 1000
    # ...and the server goes on serving
    ok = httpx.post(gateway + CHAT, json={"messages": HI, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("options, field", [
    ({"stop": [f"s{i}" for i in range(5)]}, "stop"),
    ({"stop": ["s" * 10000]}, "stop"),
    ({"task_tag": "t" * 10000}, "task_tag"),
    ({"task_tag": "a b"}, "task_tag"),
    ({"policy": "p" * 10000}, "policy"),
    ({"policy_params": {f"p{i}": 1.0 for i in range(100)}}, "policy_params"),
    ({"policy_params": {"h": float("nan")}}, "policy_params.h"),
    ({"max_draft_tokens": 1 << 30}, "max_draft_tokens"),
])
def test_the_coordinator_service_checks_what_a_grpc_client_sends(remote_gateway, options, field):
    """A client that skips the gateway meets the same limits, as INVALID_ARGUMENT."""
    with grpc.insecure_channel(remote_gateway["coordinator"]) as ch, pytest.raises(grpc.RpcError) as raw:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        list(stub.Generate(build_request("Hi", max_new_tokens=2, **options), timeout=30))
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raw.value.details().startswith(f"{field}: ")


def test_a_body_over_the_size_limit_is_refused_before_parsing(gateway):
    text = '{"messages": [{"role": "user", "content": "%s"}]}' % ("x" * (9 << 20))
    r = httpx.post(gateway + CHAT, content=text.encode(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_an_error_names_no_internal_address():
    """What a client reads about a failed service carries no address or gRPC debug text."""
    from services.common.grpc_errors import status_error

    details = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.1.2.3:50062: "
               "Failed to connect to remote host: Connection refused")
    message = str(status_error(grpc.StatusCode.UNAVAILABLE, details, "target"))
    assert "10.1.2.3" not in message and "ipv4" not in message and "target" in message


# -- fuzzing from the OpenAPI schema -----------------------------------------------------------

def _fuzz(url: str, examples: int) -> None:
    """`examples` requests generated from the schema (valid ones and invalid ones) against the
    gateway at url; every answer must be below 500."""
    import hypothesis
    import schemathesis
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_url(url + "/openapi.json").include(method="POST")
    cases = st.one_of(schema.as_strategy(schemathesis.GenerationMode.POSITIVE),
                      schema.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    failures: list[str] = []
    statuses: dict[int, int] = {}

    @hypothesis.given(case=cases)
    @hypothesis.settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck),
                         phases=[hypothesis.Phase.generate])
    def check(case) -> None:
        response = case.call(base_url=url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code} "
                            f"{response.text[:300]}")

    check()
    assert not failures, "\n".join(failures[:10])
    assert sum(statuses.values()) >= examples // 2 and 200 in statuses and 400 in statuses, statuses


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["in-process", "services"])
def test_fuzzing_from_the_openapi_schema_finds_no_5xx(request, topology):
    name = "local_gateway" if topology == "in-process" else "remote_gateway"
    value = request.getfixturevalue(name)
    _fuzz(value if isinstance(value, str) else value["url"], examples=150)
