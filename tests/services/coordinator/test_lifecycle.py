"""The coordinator's lifecycle over real in-process gRPC services (tiny models): it waits for a
target that is not up yet, its health (and a gateway's /health over it) follows the target's,
and a dead draft is skipped for a cool-down instead of costing every request its Info timeout."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import free_port
from services.common.metrics import new_registry
from services.common.server import channel
from services.common.settings import CoordinatorSettings, TargetSettings
from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import FinishEvent, GenerateRequest, TokenEvent
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.coordinator.main import start as start_coordinator
from services.coordinator.remote import RemoteBackend
from services.gateway import create_app
from services.target.main import start as start_target
from services.target.servicer import TargetServicer
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import LoopThread

REQUEST = GenerateRequest(prompt="Hello there, how are", sampling=SamplingParams(max_new_tokens=16),
                          spec=SpecParams("heuristic"))
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health_status(address: str, service: str = ""):
    """The status the server at address answers, or None when it does not answer."""
    async def check():
        async with channel(address) as ch:
            try:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                                  timeout=1)
            except Exception:  # noqa: BLE001 - not listening, or not answering
                return None
            return reply.status

    return asyncio.run(check())


def wait_for(predicate, timeout_s: float, what: str) -> float:
    """Seconds until predicate() held; fails after timeout_s."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what} within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_coordinator_waits_for_its_target_and_health_follows_it(service_loop, chat_pair):
    target_port, coord_port = free_port(), free_port()
    target_address, coord_address = f"127.0.0.1:{target_port}", f"127.0.0.1:{coord_port}"
    servicer = TargetServicer(chat_pair[0])
    settings = CoordinatorSettings(port=coord_port, target_address=target_address, draft_address="",
                                   startup_timeout_s=60)
    coordinator = service_loop.run(_new_coordinator(target_address))  # channels belong to their loop
    starting = asyncio.run_coroutine_threadsafe(start_coordinator(settings, coordinator), service_loop.loop)
    gateway_loop, gateway, target_server = LoopThread(), None, None
    try:
        # Listening, NOT_SERVING (liveness SERVING) while the target is not up: no crash loop.
        wait_for(lambda: health_status(coord_address) == NOT_SERVING, 10, "coordinator NOT_SERVING")
        assert health_status(coord_address, "liveness") == SERVING
        time.sleep(0.5)
        assert not starting.done()
        target_server, _ = service_loop.run(start_target(TargetSettings(port=target_port), servicer))
        server, _ = starting.result(30)
        wait_for(lambda: health_status(coord_address) == SERVING, 5, "coordinator SERVING once the target is")

        # a gateway over the coordinator service
        backend = gateway_loop.run(_remote(coord_address))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/health"
        gateway = uvicorn.Server(uvicorn.Config(create_app(backend, registry=new_registry()), log_level="warning",
                                                lifespan="off", timeout_graceful_shutdown=2))
        serving = asyncio.run_coroutine_threadsafe(gateway.serve(sockets=[sock]), gateway_loop.loop)
        wait_for(lambda: _get(url) == (200, {"status": "ok"}), 10, "gateway /health 200")
        ids = gateway_loop.run(_tokens(backend))
        assert len(ids) == 16

        # the target goes away: NOT_SERVING, 503, within about a second; in-process ready() too
        service_loop.run(target_server.stop(0))
        assert wait_for(lambda: health_status(coord_address) == NOT_SERVING, 3, "NOT_SERVING") < 2
        # the gateway's health answer is cached for a moment (a probe flood reuses one check)
        assert wait_for(lambda: _get(url) == (503, {"status": "unavailable"}), 3, "gateway /health 503") < 2
        assert service_loop.run(coordinator.ready()) is False
        assert health_status(coord_address, "liveness") == SERVING

        # ... and comes back on the same port
        target_server, _ = service_loop.run(start_target(TargetSettings(port=target_port), servicer))
        wait_for(lambda: health_status(coord_address) == SERVING, 8, "SERVING after the target's restart")
        wait_for(lambda: _get(url)[0] == 200, 5, "gateway /health 200 again")
        assert gateway_loop.run(_tokens(backend)) == ids
        gateway.should_exit = True
        serving.result(10)
        gateway_loop.run(backend.close())
        service_loop.run(server.stop(0))
    finally:
        if gateway is not None:
            gateway.should_exit = True
        starting.cancel()
        gateway_loop.stop()
        if target_server is not None:
            service_loop.run(target_server.stop(0))
        service_loop.run(coordinator.close())
        service_loop.loop.call_soon_threadsafe(servicer.close)


async def _new_coordinator(target_address: str) -> Coordinator:
    return Coordinator(CoordinatorConfig(target_address, None), AsyncMemoryStateStore())


async def _remote(address: str) -> RemoteBackend:
    backend = RemoteBackend(address)
    await backend.connect()
    return backend


def _get(url: str) -> tuple[int, dict] | None:
    try:
        reply = httpx.get(url, timeout=3)
    except httpx.TransportError:
        return None
    return reply.status_code, reply.json()


async def _tokens(backend) -> list[int]:
    ids = []
    async for ev in backend.generate(REQUEST):
        if isinstance(ev, TokenEvent):
            ids += ev.token_ids
    return ids


def test_a_dead_draft_is_skipped_for_a_cool_down(target_service):
    """A draft address that accepts connections but never answers: the first Info fails (at most
    its timeout), the requests after it fall back to the target at once without trying the
    draft, and after the cool-down one request probes the draft again."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # the kernel accepts; nobody speaks HTTP/2
        dead = f"127.0.0.1:{hole.getsockname()[1]}"

        async def run():
            cfg = CoordinatorConfig(target_service.address, dead, info_timeout_s=1.0, draft_cooldown_s=2.0)
            coord = Coordinator(cfg, AsyncMemoryStateStore())
            try:
                start = time.monotonic()
                await coord.connect()  # the draft's Info times out: not a start-up failure
                first = time.monotonic() - start
                out = []
                for _ in range(2):
                    start = time.monotonic()
                    stats = await _stats(coord)
                    out.append((time.monotonic() - start, stats))
                await asyncio.sleep(2.1)
                start = time.monotonic()
                probe = (time.monotonic() - start, await _stats(coord))
                return first, out, probe
            finally:
                await coord.close()

        first, out, probe = asyncio.run(run())
    assert first < 5  # at most one Info timeout
    for seconds, stats in out:
        assert stats["fallback"] and stats["fallback_kind"] == "unavailable"
        assert "draft service unavailable" in stats["fallback_reason"]  # skipped: not tried
        assert "not tried again yet" in stats["fallback_reason"]
        assert seconds < 0.9  # no Info timeout waited
    _, probe_stats = probe
    assert probe_stats["fallback"] and "draft" in probe_stats["fallback_reason"]
    assert "not tried again yet" not in probe_stats["fallback_reason"]  # the cool-down over, it was tried


async def _stats(coord) -> dict:
    async for ev in coord.generate(REQUEST):
        if isinstance(ev, FinishEvent):
            return ev.spec_stats
    pytest.fail("no FinishEvent")
