"""services.common.server: a server closes each connection after SERVER_OPTIONS' max age (so
that clients of a dns: name resolve it again), yet a stream in flight goes on past it (a long
generation is not cut), and the next call on the same channel gets through on a new connection;
a second service on a port the first holds fails to start, naming it, instead of sharing it;
health's Watch streams (a handler that writes its own responses) through the error interceptor,
and a failing one of that kind ends in its error's status."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import services.common.server as server_module
from services.common.server import channel, make_server, set_serving, start_server
from specd.errors import InvalidRequest, SpecdError

AGE_S = 0.3


def _streaming(server: grpc.aio.Server) -> None:
    """/t.T/Stream: b"first", then after four ages b"after", as raw bytes."""
    async def stream(request, context):
        yield b"first"
        await asyncio.sleep(4 * AGE_S)  # past the age (and gRPC's jitter of it)
        yield b"after"

    async def unary(request, context):
        return b"ok"

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Unary": grpc.unary_unary_rpc_method_handler(unary)})])


def _run(age_ms: int | None, monkeypatch) -> tuple[list[bytes], bytes, list]:
    options = [o for o in server_module.SERVER_OPTIONS if o[0] != "grpc.max_connection_age_ms"]
    monkeypatch.setattr(server_module, "SERVER_OPTIONS",
                        options + ([("grpc.max_connection_age_ms", age_ms)] if age_ms else []))
    states = []

    async def main():
        server, _ = make_server([])
        _streaming(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_stream("/t.T/Stream")(b"")
                got = [m async for m in call]
                states.append(ch.get_state())  # READY while the first connection lasts
                reply = await ch.unary_unary("/t.T/Unary")(b"", timeout=5)
            return got, reply
        finally:
            await server.stop(0)

    got, reply = asyncio.run(main())
    return got, reply, states


def test_a_stream_outlives_its_connections_age_and_the_next_call_reconnects(monkeypatch):
    assert ("grpc.max_connection_age_ms", 300_000) in server_module.SERVER_OPTIONS  # what the services run
    got, reply, states = _run(int(AGE_S * 1e3), monkeypatch)
    assert got == [b"first", b"after"] and reply == b"ok"
    assert states != [grpc.ChannelConnectivity.READY]  # the aged connection was closed


def test_without_an_age_the_connection_stays(monkeypatch):
    """The control: without the option the channel is still on its first connection, so the
    state the test above reads shows the ageing."""
    got, reply, states = _run(None, monkeypatch)
    assert got == [b"first", b"after"] and reply == b"ok"
    assert states == [grpc.ChannelConnectivity.READY]


def test_a_service_on_a_port_another_holds_fails_to_start_and_the_first_serves_on():
    async def main():
        first, port = await start_server("t.T", lambda servicer, server: None, None, "127.0.0.1", 0)
        try:
            with pytest.raises(SpecdError, match=f"t.U: cannot listen on 127.0.0.1:{port}"):
                await start_server("t.U", lambda servicer, server: None, None, "127.0.0.1", port)
            async with channel(f"127.0.0.1:{port}") as ch:  # every connection still reaches the first
                for _ in range(4):
                    reply = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service="t.T"), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await first.stop(0)

    asyncio.run(main())


def test_health_watch_streams_each_change_and_the_call_is_observed():
    """Health.Watch writes its responses with context.write: it failed on every specd server
    ("'coroutine' object is not an async iterator") until the interceptor took that kind."""
    seen = []

    async def main():
        server, port = await start_server("t.T", lambda servicer, server: None, None, "127.0.0.1", 0,
                                          observe=lambda method, code, s: seen.append((method, code)))
        try:
            async with channel(f"127.0.0.1:{port}") as ch:
                call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="t.T"), timeout=10)
                first = await call.read()
                await set_serving(server, ["t.T"], False)
                second = await call.read()
                call.cancel()
            return first.status, second.status
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
    for _ in range(50):  # the server sees the cancellation a moment after the client
        if seen:
            break
        time.sleep(0.05)
    assert seen == [("/grpc.health.v1.Health/Watch", "CANCELLED")]


def test_a_writing_stream_that_fails_ends_in_its_errors_status():
    async def writes_then_fails(request, context):
        await context.write(b"one")
        raise InvalidRequest("max_tokens", "must be positive")

    async def main():
        server, _ = make_server([])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
            "Write": grpc.unary_stream_rpc_method_handler(writes_then_fails)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_stream("/t.T/Write")(b"", timeout=10)
                got = [await call.read()]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()
            return got, e.value
        finally:
            await server.stop(0)

    got, error = asyncio.run(main())
    assert got == [b"one"]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in error.details()


def test_a_drain_ends_health_watch_streams_instead_of_waiting_out_its_grace():
    """A Watch stream open when the server drains gets NOT_SERVING and its end (status OK), so
    server.stop(grace) returns at once; before, it waited the whole grace for that stream."""
    async def main():
        server, port = await start_server("t.T", lambda servicer, server: None, None, "127.0.0.1", 0)
        async with channel(f"127.0.0.1:{port}") as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="t.T"), timeout=60)
            assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
            await server_module._HEALTH[server].enter_graceful_shutdown()
            t0 = time.monotonic()
            stopping = asyncio.ensure_future(server.stop(30))
            statuses = []
            while (r := await call.read()) is not grpc.aio.EOF:
                statuses.append(r.status)
            await stopping
            return statuses, await call.code(), time.monotonic() - t0

    statuses, code, seconds = asyncio.run(main())
    assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING and code == grpc.StatusCode.OK
    assert seconds < 10  # not the grace of 30 s
