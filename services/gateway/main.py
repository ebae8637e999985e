"""`specd serve gateway`: the OpenAI-compatible REST gateway (FastAPI under uvicorn).

It reaches a coordinator gRPC service when `coordinator_address` is set; otherwise it runs
the coordinator in-process over the draft and target services (one hop fewer).

It listens at once; /health answers 503 until the backend has connected, which is retried with
backoff (one log line per retry) for up to startup_timeout_s, after which the gateway exits
non-zero. SIGTERM drains it (services.gateway.lifecycle) for up to drain_grace_s.

Connections (uvicorn_config): at most limit_concurrency open ones (uvicorn answers 503 beyond),
idle keep-alive ones closed after keep_alive_timeout_s, and a request that has not all arrived
within request_read_timeout_s is cut off (uvicorn has no header or body read timeout of its own:
ReadTimeoutH11Protocol adds one, against slowloris)."""

from __future__ import annotations

import asyncio
import logging

from services.common.settings import GatewaySettings

log = logging.getLogger(__name__)


async def build_backend(s: GatewaySettings, registry=None, connect: bool = True):
    """The backend the routes call; an in-process coordinator puts its series on registry. Its
    gRPC links are secured by the gateway's security settings. connect=False: not connected yet."""
    from services.common.security import GrpcSecurity

    security = GrpcSecurity.from_settings(s)
    peers = [s.coordinator_address] if s.coordinator_address else [s.target_address, s.draft_address]
    security.check_dial(*peers)
    if s.coordinator_address:
        from services.coordinator.remote import RemoteBackend

        backend = RemoteBackend(s.coordinator_address, s.request_timeout_s, security)
    else:
        from services.common.state import build_state_store
        from services.coordinator.coordinator import Coordinator, CoordinatorConfig

        cfg = CoordinatorConfig(s.target_address, s.draft_address or None, s.overlap, s.request_timeout_s,
                                security=security)
        backend = Coordinator(cfg, build_state_store(s.redis_url), registry)
    if connect:
        await backend.connect()
    return backend


def read_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request (head and body) has not all
    arrived timeout_s after the connection opened or after its previous response: uvicorn
    itself times out only idle keep-alive connections, and a trickled head never ends."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from services.gateway.reader import TRANSPORT

    class ReadTimeoutH11Protocol(H11Protocol):
        _read_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()
            app = self.app

            async def with_transport(scope, receive, send):  # a stream watches its reader (reader.py)
                scope.setdefault("extensions", {})[TRANSPORT] = transport
                await app(scope, receive, send)

            self.app = with_transport

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._check()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()
            self._check()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(timeout_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _check(self) -> None:
            """The whole request is in: its read timer is done."""
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if not self.transport.is_closing():
                self.logger.info("closing a connection whose request did not arrive within %s s", timeout_s)
                self.transport.close()

    return ReadTimeoutH11Protocol


def uvicorn_config(app, s: GatewaySettings, **kwargs):
    """uvicorn's config for the gateway, with the connection limits of s."""
    import uvicorn

    from services.gateway.lifecycle import SHUTDOWN_TIMEOUT_S

    return uvicorn.Config(app, host=s.host, port=s.port, log_level=s.log_level, lifespan="off",
                          timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S,
                          http=read_timeout_protocol(s.request_read_timeout_s),
                          limit_concurrency=s.limit_concurrency or None, timeout_keep_alive=s.keep_alive_timeout_s,
                          **kwargs)


async def serve(s: GatewaySettings) -> None:
    from services.common.metrics import new_registry
    from services.common.startup import retry_until_connected
    from services.gateway import auth
    from services.gateway.app import create_app
    from services.gateway.lifecycle import DrainingServer

    # Auth required and no key: refuses to start. A key store (Redis) not up yet is waited for.
    found = []

    async def keys_ready() -> None:
        found.append(await auth.from_settings(s))

    await retry_until_connected(keys_ready, "the API key store", s.startup_timeout_s)
    keys, limiter = found[0]
    registry = new_registry()
    backend = await build_backend(s, registry, connect=False)
    app = create_app(backend, max_tokens_limit=s.max_tokens_limit, default_policy=s.default_policy, keys=keys,
                     limiter=limiter, registry=registry, max_concurrent_requests=s.max_concurrent_requests,
                     max_body_bytes=s.max_body_bytes, max_concurrent_parses=s.max_concurrent_parses,
                     stream_send_timeout_s=s.stream_send_timeout_s,
                     max_concurrent_per_key=s.max_concurrent_per_key, fair_share_reserve=s.fair_share_reserve)
    config = uvicorn_config(app, s)
    server = DrainingServer(config, app.state.gateway.admission, s.drain_grace_s)
    what = f"coordinator {s.coordinator_address}" if s.coordinator_address else f"target {s.target_address}"
    connecting = asyncio.ensure_future(retry_until_connected(backend.connect, what, s.startup_timeout_s))

    def connected(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("giving up: %s", task.exception())
            server.should_exit = True

    connecting.add_done_callback(connected)
    print(f"specd gateway listening on http://{s.host}:{s.port}", flush=True)
    try:
        await server.serve()
    finally:
        connecting.cancel()
        await backend.close()
        await app.state.gateway.auth.close()
    if connecting.done() and not connecting.cancelled() and connecting.exception() is not None:
        raise connecting.exception()
