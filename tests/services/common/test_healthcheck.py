"""The container health probe (services.common.healthcheck), in-process against a real grpc.aio
server with the standard health service and a real HTTP server, both on loopback."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading

import pytest
from grpc_health.v1 import health_pb2

from services.common.healthcheck import main
from services.common.server import make_server, mark_serving


def _closed_port() -> int:
    """A loopback port that nothing listens on (bound, read and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def grpc_service():
    """(loop runner, health servicer, address) of a real grpc.aio server in a background loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def start():
        server, health_servicer = make_server([])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await mark_serving(health_servicer, [])
        return server, health_servicer, port

    server, health_servicer, port = run(start())
    yield run, health_servicer, f"127.0.0.1:{port}"
    run(server.stop(None))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_grpc_serving_exits_0(grpc_service):
    _, _, address = grpc_service
    assert main(["grpc", address]) == 0


def test_grpc_not_serving_exits_1(grpc_service):
    run, health_servicer, address = grpc_service
    run(health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
    assert main(["grpc", address]) == 1


def test_liveness_stays_serving_while_readiness_is_not(grpc_service):
    """A coordinator whose target is down is not ready, but alive: a liveness probe must not
    restart it."""
    run, health_servicer, address = grpc_service
    run(mark_serving(health_servicer, [], serving=False))
    assert main(["grpc", address]) == 1
    assert main(["grpc", address, "--service", "liveness"]) == 0


def test_grpc_closed_port_exits_1():
    assert main(["grpc", f"127.0.0.1:{_closed_port()}"]) == 1


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        status = {"/ok": 200, "/down": 503}.get(self.path, 404)
        body = b"{}"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_base():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_http_200_exits_0(http_base):
    assert main(["http", f"{http_base}/ok"]) == 0


def test_http_503_exits_1(http_base):
    assert main(["http", f"{http_base}/down"]) == 1


def test_http_closed_port_exits_1():
    assert main(["http", f"http://127.0.0.1:{_closed_port()}/health"]) == 1


def test_usage_error_exits_2():
    with pytest.raises(SystemExit) as e:
        main(["tcp", "127.0.0.1:1"])
    assert e.value.code == 2
