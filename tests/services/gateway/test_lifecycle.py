"""The gateway's drain (services.gateway.lifecycle) on a real uvicorn server over an in-process
Coordinator over the real target service (tiny model): once draining, /health answers 503
"draining", a new request is refused with 503 and Retry-After, the stream in flight completes,
and the server exits as soon as it has. The stream is held open at its last event by Held (the
real coordinator, whose FinishEvent waits for the test's go-ahead), so that it is surely in
flight while the gateway drains."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import uvicorn

from services.common.metrics import new_registry
from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import FinishEvent
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.gateway import create_app
from services.gateway.lifecycle import DrainingServer
from tests.services.conftest import LoopThread

CHAT = "/v1/chat/completions"
BODY = {"model": "specd", "messages": [{"role": "user", "content": "abcabc abc"}], "max_tokens": 64,
        "temperature": 0, "speculative": {"enabled": False}}


class Held:
    """A Backend: the coordinator's, with each FinishEvent held until `release` is set."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator, self.release = coordinator, asyncio.Event()
        self.model_card, self.ready = coordinator.model_card, coordinator.ready

    async def generate(self, request):
        async for event in self.coordinator.generate(request):
            if isinstance(event, FinishEvent):
                await self.release.wait()
            yield event


def test_drain_finishes_the_stream_in_flight_and_refuses_new_requests(target_service):
    loop = LoopThread()

    async def connect() -> Coordinator:
        coordinator = Coordinator(CoordinatorConfig(target_service.address, None), AsyncMemoryStateStore())
        await coordinator.connect()
        return coordinator

    coordinator = loop.run(connect())
    backend = loop.run(_held(coordinator))
    backend.release.set()
    app = create_app(backend, registry=new_registry())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = DrainingServer(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2),
                            app.state.gateway.admission, grace_s=60)
    serving = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the gateway did not come up"
            time.sleep(0.05)
        full = httpx.post(url + CHAT, json=BODY, timeout=30).json()["choices"][0]["message"]["content"]
        loop.run(_clear(backend))  # the next answer is held at its end

        with httpx.stream("POST", url + CHAT, json={**BODY, "stream": True}, timeout=30) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            payloads = [next(line for line in lines if line.startswith("data: "))]
            loop.loop.call_soon_threadsafe(server.drain)  # as SIGTERM does
            time.sleep(0.3)
            health = httpx.get(url + "/health", timeout=2)
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
            refused = httpx.post(url + CHAT, json=BODY, timeout=5)
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert "shutting down" in refused.json()["error"]["message"]
            time.sleep(0.3)
            assert not serving.done()  # still serving the stream in flight
            loop.loop.call_soon_threadsafe(backend.release.set)
            payloads += [line for line in lines if line.startswith("data: ")]
        assert payloads[-1] == "data: [DONE]"
        chunks = [json.loads(p.removeprefix("data: ")) for p in payloads[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == full
        serving.result(10)  # exits once the stream is done, long before the 60 s grace
    finally:
        server.force_exit = server.should_exit = True
        loop.run(coordinator.close())
        loop.stop()
        sock.close()


async def _held(coordinator: Coordinator) -> Held:
    return Held(coordinator)


async def _clear(backend: Held) -> None:
    backend.release.clear()
