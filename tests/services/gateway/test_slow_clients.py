"""Clients that hold the gateway's capacity without using it, against a real uvicorn: a stream
whose client stops reading is ended after the send timeout (its generation closed, its slot
freed); a large hostile body is parsed off the event loop, a bounded number at a time; a
connection whose request never arrives in full is closed (slowloris); connections beyond
limit_concurrency get 503. The backend is a stand-in that generates as long as it is read."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from services.common.settings import GatewaySettings
from services.coordinator.api import FinishEvent, ModelCard, TokenEvent
from services.gateway import create_app
from services.gateway.main import uvicorn_config

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
ENDLESS = 1 << 20  # max_tokens of a generation that outlasts any test


class Generating:
    """A backend generating 1 KB per token, max_tokens of them; counts the generations closed."""

    def __init__(self):
        self.closed = 0

    def model_card(self) -> ModelCard:
        return ModelCard("stand-in", 1 << 20, None)

    async def ready(self) -> bool:
        return True

    async def generate(self, request):
        try:
            n = request.sampling.max_new_tokens
            for _ in range(n):
                yield TokenEvent((1,), "x" * 1000)
                await asyncio.sleep(0)
            yield FinishEvent("length", 1, n)
        finally:
            self.closed += 1


def _wait(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class _Uvicorn:
    """A real uvicorn in a thread, configured as `specd serve gateway` configures it."""

    def __init__(self, app, settings: GatewaySettings):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, settings)
        config.log_level, config.timeout_graceful_shutdown = "warning", 2
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        assert _wait(lambda: self.server.started, 30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def run():
    servers: list[_Uvicorn] = []

    def start(app, **settings) -> _Uvicorn:
        servers.append(_Uvicorn(app, GatewaySettings(auth="open", **settings)))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _raw_request(port: int, body: bytes, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


STREAM = b'{"messages": [{"role": "user", "content": "Hi"}], "stream": true, "max_tokens": %d}' % ENDLESS


def _gateway(run, backend, max_concurrent: int = 4):
    """A gateway over backend whose streams end after 1 s with nothing taken: (server, admission)."""
    app = create_app(backend, max_tokens_limit=ENDLESS, max_concurrent_requests=max_concurrent,
                     stream_send_timeout_s=1.0)
    return run(app), app.state.gateway.admission


def test_a_stream_whose_client_stops_reading_is_ended(run):
    backend = Generating()
    server, admission = _gateway(run, backend)
    body = STREAM
    stalled = _raw_request(server.port, body, rcvbuf=4096)  # then reads nothing
    try:
        assert _wait(lambda: admission.in_flight == 1)
        # Meanwhile others are served.
        r = httpx.post(server.url + CHAT, json={"messages": HI, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "x" * 3000
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
        # The stalled stream is ended: its generation closed, its admission released.
        assert _wait(lambda: admission.in_flight == 0 and backend.closed == 2), (admission.in_flight, backend.closed)
    finally:
        stalled.close()


class Trickling(Generating):
    """A backend generating a few bytes per token, a token each 10 ms: an answer the
    connection's buffers take for hours without a send that waits."""

    async def generate(self, request):
        try:
            for _ in range(request.sampling.max_new_tokens):
                yield TokenEvent((1,), "x")
                await asyncio.sleep(0.01)
            yield FinishEvent("length", 1, request.sampling.max_new_tokens)
        finally:
            self.closed += 1


def test_a_stream_whose_unread_chunks_fit_in_the_buffers_is_ended_after_the_timeout(run):
    backend = Trickling()
    server, admission = _gateway(run, backend)
    body = STREAM
    stalled = _raw_request(server.port, body, rcvbuf=4096)  # then reads nothing
    reader = _raw_request(server.port, body)  # reads everything
    taken = []

    def read() -> None:
        try:
            while data := reader.recv(65536):
                taken.append(len(data))
        except OSError:  # closed at the end
            pass

    threading.Thread(target=read, daemon=True).start()
    try:
        assert _wait(lambda: admission.in_flight == 2)
        # The stalled one ends once its bytes wait 1 s, long before its buffers fill.
        assert _wait(lambda: backend.closed == 1, 20), (admission.in_flight, backend.closed)
        assert admission.in_flight == 1  # the one that reads is still streaming
        before = sum(taken)
        time.sleep(1.5)
        assert sum(taken) > before and backend.closed == 1
    finally:
        stalled.close()
        reader.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_every_choice_of_its_request(run, stream):
    backend = Trickling()
    server, admission = _gateway(run, backend, 8)
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "n": 3, "stream": %s, "max_tokens": %d}' % (
        b"true" if stream else b"false", ENDLESS)
    client = _raw_request(server.port, body)
    assert _wait(lambda: admission.in_flight == 3)  # one admission per choice
    client.close()  # gone: every choice's generation is closed, every admission released
    assert _wait(lambda: admission.in_flight == 0 and backend.closed == 3, 20), (admission.in_flight, backend.closed)


def test_a_large_body_is_parsed_off_the_loop_a_bounded_number_at_a_time(run):
    app = create_app(Generating(), max_concurrent_parses=1)
    server = run(app)
    parser = app.state.gateway.parser
    # 4 MiB of empty content parts, a list of at most 1,024 in each of 1,000 messages: a
    # long parse (no list is over its cap until it is validated); the 400 must name the field.
    message = b'{"role": "user", "content": [' + b",".join([b"{}"] * 1024) + b"]}"
    hostile = b'{"messages": [' + b",".join([message] * 1000) + b"]}"
    assert len(hostile) <= 4 << 20
    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(
        httpx.post(server.url + CHAT, content=hostile, headers={"content-type": "application/json"}, timeout=120)))
    first.start()
    assert _wait(lambda: parser.busy == 1)
    health = httpx.get(server.url + "/health", timeout=60)
    second = httpx.post(server.url + CHAT, content=hostile, headers={"content-type": "application/json"},
                        timeout=60)
    during = parser.busy == 1
    first.join(120)
    assert during, "the parse ended before the other requests were answered: nothing shown"
    assert health.status_code == 200  # the loop answered while the parse ran
    assert second.status_code == 503 and second.headers["retry-after"]  # over the bound: refused at once
    error = answers[0].json()["error"]
    assert answers[0].status_code == 400 and error["param"] == "messages.0.content", error
    assert "text" in error["message"]
    # A list over every cap stops the parse where it passes it: 4 MiB of 140,000 messages.
    one = b'{"role":"user","content":"a"},'
    many = b'{"messages":[' + one * ((4 << 20) // len(one) - 10) + one[:-1] + b']}'
    r = httpx.post(server.url + CHAT, content=many, headers={"content-type": "application/json"}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages" and "at most 1024 items" in error["message"], error
    # A large valid body is parsed the same way and served.
    big = {"messages": [{"role": "user", "content": "y" * (200 << 10)}], "max_tokens": 2}
    r = httpx.post(server.url + CHAT, json=big, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "x" * 2000
    # ...and a large invalid one gets FastAPI's own answer.
    bad = {**big, "temperature": 7}
    r = httpx.post(server.url + CHAT, json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(server.url + CHAT, content=b"[" * (100 << 10), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400


def _closed(sock: socket.socket, timeout: float = 20.0) -> bool:
    """Whether the server closes sock (it sends nothing first) before timeout."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_request_that_never_arrives_in_full_is_closed(run):
    server = run(create_app(Generating()), request_read_timeout_s=1.0)
    partial_line = socket.create_connection(("127.0.0.1", server.port))
    partial_line.sendall(b"GET /hea")
    partial_head = socket.create_connection(("127.0.0.1", server.port))
    partial_head.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    partial_body = socket.create_connection(("127.0.0.1", server.port))
    partial_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"messages\"")
    for sock in (partial_line, partial_head, partial_body):
        assert _closed(sock)
        sock.close()
    # Complete requests are untouched, on a kept-alive connection too.
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert [c.get("/health").status_code for _ in range(3)] == [200, 200, 200]


def test_connections_beyond_limit_concurrency_get_503(run):
    server = run(create_app(Generating()), limit_concurrency=3)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    try:
        assert _wait(lambda: len(server.server.server_state.connections) == 3, 30)
        r = httpx.get(server.url + "/health", timeout=60)
        assert r.status_code == 503
    finally:
        for sock in idle:
            sock.close()
    assert _wait(lambda: len(server.server.server_state.connections) == 0, 30)
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
