"""The coordinator as its own gRPC service (services.coordinator.main.start) over the real draft
and target services on loopback (tiny models), driven by clients.specd_client (sync and async)
and by RemoteBackend: greedy output is the target alone's with PEARL on and off; bad requests
come back as INVALID_ARGUMENT naming the field; a cancelled stream frees both services'
sessions; the standard health check and server reflection answer."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from clients.specd_client import AsyncCoordinatorClient, Chunk, CoordinatorClient, build_request
from services.common.server import channel_options, check_health
from services.common.settings import CoordinatorSettings
from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import FinishEvent, GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.coordinator.main import start
from services.coordinator.remote import RemoteBackend
from services.coordinator.servicer import SERVICE_NAME
from services.proto.specd.coordinator.v1 import coordinator_pb2_grpc
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import Service

PROMPT = "Hello there, how are"
MESSAGES = [{"role": "user", "content": "abcabc abc"}]
N = 24


@pytest.fixture(scope="module")
def coordinator_service(service_loop, target_service, hf_draft_service):
    settings = CoordinatorSettings(port=0, target_address=target_service.address,
                                   draft_address=hf_draft_service.address, reflection=True)

    async def up():  # the Coordinator's channels belong to the loop that serves it
        coordinator = Coordinator(CoordinatorConfig(settings.target_address, settings.draft_address),
                                  AsyncMemoryStateStore())
        server, port = await start(settings, coordinator)
        return coordinator, server, port

    coordinator, server, port = service_loop.run(up())
    yield Service(f"127.0.0.1:{port}", coordinator, server, service_loop)
    service_loop.run(server.stop(0))
    service_loop.run(coordinator.close())


def reference(target, source: str | list[dict], n: int = N) -> list[int]:
    ids = target.encode_prompt(source, chat=not isinstance(source, str))
    out = SpeculativeEngine(target).generate(ids, SamplingParams(max_new_tokens=n), SpecParams("none"))
    return out.token_ids


def _source(kind: str) -> dict:
    return {"prompt": PROMPT} if kind == "prompt" else {"messages": MESSAGES}


def _check(chunks: list[Chunk], expected: list[int], overlap: bool) -> None:
    *body, last = chunks
    assert [t for c in body for t in c.token_ids] == expected
    assert all(c.finish_reason is None and c.spec_stats is None for c in body)
    assert last.finish_reason in ("stop", "length") and last.completion_tokens == len(expected)
    stats = last.spec_stats
    assert stats["policy"] == "heuristic" and stats["overlap"] == overlap and not stats["fallback"]
    assert stats["drafter"] and 1 <= stats["verifications"] < len(expected) and stats["accepted"] > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
@pytest.mark.parametrize("kind", ["prompt", "messages"])
def test_sync_client_is_the_target_alone(chat_pair, coordinator_service, kind, overlap):
    with CoordinatorClient(coordinator_service.address) as client:
        chunks = list(client.generate(**_source(kind), max_new_tokens=N, policy="heuristic", overlap=overlap))
    _check(chunks, reference(chat_pair[0], _source(kind)[kind]), overlap)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
@pytest.mark.parametrize("kind", ["prompt", "messages"])
def test_async_client_is_the_target_alone(chat_pair, coordinator_service, kind, overlap):
    async def run():
        async with AsyncCoordinatorClient(coordinator_service.address) as client:
            return [c async for c in client.generate(**_source(kind), max_new_tokens=N, policy="heuristic",
                                                     overlap=overlap)]

    _check(asyncio.run(run()), reference(chat_pair[0], _source(kind)[kind]), overlap)


def test_info(chat_pair, coordinator_service):
    with CoordinatorClient(coordinator_service.address) as client:
        card = client.info()
    assert card.id == chat_pair[0].name and card.max_context == chat_pair[0].max_context
    assert card.draft  # the hf draft service's name

    async def run():
        async with AsyncCoordinatorClient(coordinator_service.address) as client:
            return await client.info()

    assert asyncio.run(run()) == card


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
def test_remote_backend_is_the_target_alone(chat_pair, coordinator_service, overlap):
    async def run():
        backend = RemoteBackend(coordinator_service.address)
        await backend.connect()
        ids, finish = [], None
        try:
            async for ev in backend.generate(GenerateRequest(
                    prompt=PROMPT, sampling=SamplingParams(max_new_tokens=N), spec=SpecParams("heuristic"),
                    overlap=overlap)):
                if isinstance(ev, FinishEvent):
                    finish = ev
                else:
                    ids += ev.token_ids
        finally:
            await backend.close()
        return backend.model_card(), ids, finish

    card, ids, finish = asyncio.run(run())
    assert card.id == chat_pair[0].name
    assert ids == reference(chat_pair[0], PROMPT)
    assert finish.spec_stats["overlap"] == overlap and not finish.spec_stats["fallback"]


def _generate_calls(coordinator_service) -> dict[str, float]:
    """The coordinator's specd_grpc_requests_total for Generate, by the final codes that matter here."""
    registry = coordinator_service.servicer.registry
    return {code: registry.get_sample_value("specd_grpc_requests_total", {
        "service": "coordinator", "method": "Generate", "code": code}) or 0.0 for code in ("OK", "CANCELLED")}


def test_a_caller_that_stops_at_the_finish_ends_the_call_as_ok_not_cancelled(coordinator_service, monkeypatch):
    """The gateway stops reading at the FinishEvent and closes the iterator, as a client that
    breaks at finish_reason does: the call must have ended OK by then, not be cancelled. Here the
    service ends its calls late, as a loaded machine can (CI once counted 2 OK calls of 3)."""
    coordinator = coordinator_service.servicer
    generate = coordinator.generate

    def ending_late(request):
        async def events():
            async for event in generate(request):
                yield event
            await asyncio.sleep(0.2)  # the call's status goes out after this

        return events()

    monkeypatch.setattr(coordinator, "generate", ending_late)

    def request():
        return GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=4), spec=SpecParams("constant"))

    async def remote(n: int) -> None:
        backend = RemoteBackend(coordinator_service.address)
        await backend.connect()
        try:
            for _ in range(n):
                events = backend.generate(request())
                async for ev in events:
                    if isinstance(ev, FinishEvent):
                        break
                await events.aclose()
        finally:
            await backend.close()

    async def async_client(n: int) -> None:
        async with AsyncCoordinatorClient(coordinator_service.address) as client:
            for _ in range(n):
                stream = client.generate(PROMPT, max_new_tokens=4, policy="constant")
                async for chunk in stream:
                    if chunk.finish_reason:
                        break
                await stream.aclose()

    def sync_client(n: int) -> None:
        with CoordinatorClient(coordinator_service.address) as client:
            for _ in range(n):
                stream = client.generate(PROMPT, max_new_tokens=4, policy="constant")
                for chunk in stream:
                    if chunk.finish_reason:
                        break
                stream.close()

    n, before = 3, _generate_calls(coordinator_service)
    asyncio.run(remote(n))
    asyncio.run(async_client(n))
    sync_client(n)
    after = _generate_calls(coordinator_service)
    assert after["OK"] - before["OK"] == 3 * n, (before, after)
    assert after["CANCELLED"] == before["CANCELLED"], (before, after)


@pytest.mark.parametrize("options, field", [
    ({"policy": "nope"}, "policy"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    # above the server's cap on a window (api.MAX_REQUEST_DRAFT_TOKENS, CoordinatorSettings.max_draft_tokens):
    # target work per emitted token, and dense q's past gRPC's message limit
    ({"policy": "constant", "max_draft_tokens": 65}, "max_draft_tokens"),
    ({"policy": "constant", "max_draft_tokens": 256, "policy_params": {"k": 256}}, "max_draft_tokens"),
    ({"policy": "constant", "policy_params": {"max_draft_tokens": 256}}, "policy_params.max_draft_tokens"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(coordinator_service, options, field):
    with grpc.insecure_channel(coordinator_service.address) as ch, pytest.raises(grpc.RpcError) as raw:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        list(stub.Generate(build_request(PROMPT, **options), timeout=30))
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raw.value.details().startswith(f"{field}: ")

    with CoordinatorClient(coordinator_service.address) as client, pytest.raises(InvalidRequest) as e:
        list(client.generate(PROMPT, **options))
    assert e.value.field == field

    async def run():
        async with AsyncCoordinatorClient(coordinator_service.address) as client:
            return [c async for c in client.generate(PROMPT, **options)]

    with pytest.raises(InvalidRequest) as e:
        asyncio.run(run())
    assert e.value.field == field


def test_the_input_is_checked_before_sending(coordinator_service):
    with CoordinatorClient(coordinator_service.address) as client, pytest.raises(InvalidRequest) as e:
        client.generate(PROMPT, MESSAGES)
    assert e.value.field == "input"


def _wait_until_free(*services, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(s.servicer.active_sessions for s in services):
        time.sleep(0.05)
    assert [s.servicer.active_sessions for s in services] == [0] * len(services)


def test_sync_stream_cancelled_frees_both_sessions(coordinator_service, target_service, hf_draft_service):
    with CoordinatorClient(coordinator_service.address) as client:
        stream = client.generate(PROMPT, max_new_tokens=300, policy="constant")
        for chunk in stream:
            assert chunk.token_ids
            break
        assert target_service.servicer.active_sessions == 1 and hf_draft_service.servicer.active_sessions == 1
        stream.close()  # cancels the call
        _wait_until_free(target_service, hf_draft_service)


def test_async_stream_cancelled_frees_both_sessions(coordinator_service, target_service, hf_draft_service):
    async def run():
        async with AsyncCoordinatorClient(coordinator_service.address) as client:
            stream = client.generate(PROMPT, max_new_tokens=300, policy="constant", overlap=True)
            assert (await anext(stream)).token_ids
            assert target_service.servicer.active_sessions == 1
            assert hf_draft_service.servicer.active_sessions == 1
            await stream.aclose()  # cancels the call

    asyncio.run(run())
    _wait_until_free(target_service, hf_draft_service)


def test_health_and_reflection(coordinator_service):
    assert asyncio.run(check_health(coordinator_service.address))
    with grpc.insecure_channel(coordinator_service.address) as ch:
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
    assert SERVICE_NAME == "specd.coordinator.v1.CoordinatorService"
    assert SERVICE_NAME in services and "grpc.health.v1.Health" in services


def test_command_line(chat_pair, coordinator_service, capsys):
    from clients.specd_client import main

    assert main(["--address", coordinator_service.address, "--max-new-tokens", "8", "--policy", "constant",
                 PROMPT]) == 0
    text, _, stats = capsys.readouterr().out.partition("\n")
    assert text == chat_pair[0].decode(reference(chat_pair[0], PROMPT, 8))
    assert json.loads(stats)["policy"] == "constant"
    assert main(["--address", coordinator_service.address, "--policy", "nope", PROMPT]) == 1
    assert "policy" in capsys.readouterr().err


def test_a_gateway_spreads_requests_over_several_coordinators_and_outlives_one(chat_pair, service_loop,
                                                                                target_service, hf_draft_service):
    """RemoteBackend dialing a list of two coordinators (as a headless Service's name resolves to
    its pods): requests go to both, each answering as the target alone; once one is stopped, the
    next requests are answered by the other."""
    from prometheus_client import CollectorRegistry

    async def up():
        registry = CollectorRegistry()
        coordinator = Coordinator(CoordinatorConfig(target_service.address, hf_draft_service.address),
                                  AsyncMemoryStateStore(), registry)
        server, port = await start(CoordinatorSettings(port=0, target_address=target_service.address,
                                                       draft_address=hf_draft_service.address), coordinator)
        return coordinator, server, port, registry

    started = [service_loop.run(up()) for _ in range(2)]
    address = "ipv4:" + ",".join(f"127.0.0.1:{port}" for _, _, port, _ in started)
    want = reference(chat_pair[0], PROMPT, 8)

    def served(registry) -> float:
        return sum(s.value for m in registry.collect() if m.name == "specd_requests"
                   for s in m.samples if s.name == "specd_requests_total")

    async def run(n: int) -> list[list[int]]:
        backend = RemoteBackend(address)
        await backend.connect()
        try:
            answers = []
            for _ in range(n):
                request = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=8),
                                          spec=SpecParams("heuristic"))
                answers.append([t for ev in [e async for e in backend.generate(request)]
                                if not isinstance(ev, FinishEvent) for t in ev.token_ids])
            return answers
        finally:
            await backend.close()

    assert channel_options(address)[-1] == ("grpc.lb_policy_name", "round_robin")
    # one process: the default policy, which reconnects at once after a restart (test_stack's swaps)
    assert ("grpc.lb_policy_name", "round_robin") not in channel_options("127.0.0.1:1")
    assert channel_options("dns:///coordinator:50063")[-1] == ("grpc.lb_policy_name", "round_robin")
    try:
        assert asyncio.run(run(6)) == [want] * 6
        # Both take requests. Not necessarily three each: round robin picks among the connections
        # ready at each call, and under a loaded machine the second may connect after the first
        # call or two (a fresh clone's make test saw 4 and 2).
        counts = [served(registry) for *_, registry in started]
        assert sum(counts) == 6 and min(counts) >= 1, counts
        coordinator, server, _, _ = started[0]
        service_loop.run(server.stop(0))
        assert asyncio.run(run(4)) == [want] * 4
        # the survivor answers all four, on top of its share of the first six (not always three)
        assert served(started[1][3]) == counts[1] + 4, counts
    finally:
        for coordinator, server, _, _ in started:
            service_loop.run(server.stop(0))
            service_loop.run(coordinator.close())


def test_health_probes_of_a_remote_backend_reuse_its_channel(coordinator_service):
    """/health is unauthenticated: a probe must not cost a channel (a resolution, a handshake,
    TLS files read again). Many probes in a row, and at once, open none beyond the backend's own,
    counted where every channel is made (services.common.security); and it still sees the
    coordinator go NOT_SERVING."""
    from services.common import security
    from services.common.server import set_serving

    def serving(on: bool):  # on the service's own loop
        return asyncio.to_thread(coordinator_service.loop.run,
                                 set_serving(coordinator_service.server, [SERVICE_NAME], on))

    async def run():
        before = security.channels_opened
        backend = RemoteBackend(coordinator_service.address)
        try:
            await backend.connect()
            answers = [await backend.ready() for _ in range(50)]
            answers += await asyncio.gather(*(backend.ready() for _ in range(50)))
            opened = security.channels_opened - before
            await serving(False)
            for _ in range(500):  # the cached answer expires within HEALTH_CACHE_S
                if not await backend.ready():
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the backend never saw NOT_SERVING")
            return answers, opened
        finally:
            await serving(True)
            await backend.close()

    answers, opened = asyncio.run(run())
    assert all(answers) and opened == 1, opened


def test_the_draft_cap_is_the_settings_and_within_the_targets_window():
    from services.common.settings import TargetSettings
    from services.coordinator.api import MAX_REQUEST_DRAFT_TOKENS

    assert CoordinatorSettings().max_draft_tokens == MAX_REQUEST_DRAFT_TOKENS <= TargetSettings().max_window_tokens
    GenerateRequest(prompt="a", spec=SpecParams("constant", MAX_REQUEST_DRAFT_TOKENS)).validate()
