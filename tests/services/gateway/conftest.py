"""A real gateway served by uvicorn on a free loopback port, in a background thread, over
a LocalBackend on the tiny pair (loaded from disk the way a service loads models, with its
char tokenizer: context 512); `serve` starts more (e.g. with API keys)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import uvicorn

from services.coordinator.local import LocalBackend
from services.gateway import create_app
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.runtime import load_model

MAX_TOKENS_LIMIT = 1000  # above the tiny model's context (512): both limits are reachable


class _Server:
    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/health", timeout=1)  # any answer: the server is up
                return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the gateway did not answer /health in 20 s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def serve_on_loop(app, loop) -> tuple[str, Callable[[], None]]:
    """(base URL, stop) of app served by uvicorn on `loop` (a tests.services.conftest.LoopThread):
    the loop its backend was built on, since grpc.aio channels belong to one loop."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    serving = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.get(url + "/health", timeout=1)  # any answer: the server is up
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline and not serving.done(), "the gateway did not come up in 20 s"
            time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        serving.result(10)
        sock.close()

    return url, stop


@pytest.fixture(scope="session")
def local_backend(tiny_dirs):
    target = load_model(str(tiny_dirs[0]), device="cpu", dtype="float32")
    draft = load_model(str(tiny_dirs[1]), device="cpu", dtype="float32")
    backend = LocalBackend(SpeculativeEngine(target, build_drafter("hf", target, draft)))
    yield backend
    asyncio.run(backend.close())


@pytest.fixture(scope="session")
def serve():
    """serve(app) -> base URL; every server stops at the end of the session."""
    servers: list[_Server] = []

    def start(app) -> str:
        servers.append(_Server(app))
        return servers[-1].start()

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def gateway_url(serve, local_backend):
    return serve(create_app(local_backend, max_tokens_limit=MAX_TOKENS_LIMIT))


@pytest.fixture
def http(gateway_url):
    with httpx.Client(base_url=gateway_url, timeout=30) as client:
        yield client
