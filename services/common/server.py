"""Building a gRPC service process: the error interceptor, the standard health service
(grpcio-health-checking), server reflection when asked (grpcio-reflection), TLS and the token
(services.common.security), message size limits and channel options shared by clients.

Lifecycle (run_until_signal): on SIGTERM or SIGINT a service first answers NOT_SERVING to
health checks, refuses new calls (UNAVAILABLE) and lets the calls in flight, streams included,
finish for up to its drain grace (setting drain_grace_s) before it exits; a second signal stops
it at once. The health name LIVENESS stays SERVING from start to drain whatever the service's
readiness (a coordinator whose target is down), for liveness probes.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as grpc_reflection

from services.common.grpc_errors import ErrorInterceptor, Observe
from services.common.security import GrpcSecurity
from specd.errors import SpecdError

log = logging.getLogger(__name__)

LIVENESS = "liveness"  # health name that is SERVING while the process runs (until it drains)
DEFAULT_DRAIN_GRACE_S = 600.0
_HEALTH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # server -> its health servicer

MAX_MESSAGE_BYTES = 64 << 20  # a dense q is 4 bytes per vocab entry; tokenizers are MBs

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A restarted service is used again within seconds, not after gRPC's default 2-minute backoff.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 30000),
]
# Where an address names several processes, each call (a request's stream) goes to the next of
# them: a headless Kubernetes Service's pods ("dns:///coordinator:50063") or a list ("ipv4:
# 127.0.0.1:50063,127.0.0.1:50064"). gRPC's default sends every call to the first that answers, so
# replicas behind one name shared nothing (docs/deploy.md, "Several replicas behind one name").
# A plain host:port keeps the default: after its one server restarts, the next call connects at
# once, where round_robin fails calls until its reconnect backoff (up to 2 s) has run out.
SPREAD = ("grpc.lb_policy_name", "round_robin")
# Clients reconnect, and so resolve the name again, at least this often: a replica added later
# gets calls within minutes. Calls in flight finish on the old connection (no grace limit).
# A port another process holds is an error, not a port shared with it: with gRPC's default
# (SO_REUSEPORT) a second service started on a taken port came up too, and the kernel split the
# connections (and so the sessions) between the two.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.max_connection_age_ms", 300_000), ("grpc.so_reuseport", 0)]


class DrainingHealth(health.aio.HealthServicer):
    """grpcio-health-checking's servicer, whose Watch streams end once the server drains: they
    say NOT_SERVING and return, rather than hold the drain for its whole grace. Watch reads a
    view of the statuses kept through the servicer's public methods."""

    def __init__(self) -> None:
        super().__init__()
        self._view = {"": health_pb2.HealthCheckResponse.SERVING}
        self._changed = asyncio.Condition()
        self._drained = False

    async def set(self, service: str, status) -> None:
        await super().set(service, status)
        if not self._drained:
            async with self._changed:
                self._view[service] = status
                self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        async with self._changed:
            self._drained = True
            self._view = dict.fromkeys(self._view, health_pb2.HealthCheckResponse.NOT_SERVING)
            self._changed.notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:  # noqa: N802 - gRPC's name
        last = None
        while True:
            async with self._changed:
                while (status := self._view.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)) \
                        == last and not self._drained:
                    await self._changed.wait()
                drained = self._drained
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if drained:
                return


def make_server(service_names: list[str], observe: Observe | None = None,
                security: GrpcSecurity | None = None, reflection: bool = False
                ) -> tuple[grpc.aio.Server, DrainingHealth]:
    """A server with the interceptors (errors; the token check when security has a token), health
    (SERVING for "" and every name) and, when asked, reflection; observe(method, code,
    seconds) is called as each call ends, refused calls included."""
    interceptors = [ErrorInterceptor(observe), *(security or GrpcSecurity()).server_interceptors()]
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    health_servicer = DrainingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection:
        grpc_reflection.enable_server_reflection(
            [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             grpc_reflection.SERVICE_NAME], server)
    return server, health_servicer


async def start_server(service_name: str, add_servicer, servicer, host: str, port: int,
                       observe: Observe | None = None, security: GrpcSecurity | None = None,
                       reflection: bool = False, *, serving: bool = True) -> tuple[grpc.aio.Server, int]:
    """Serve one servicer with health (and reflection when asked) on host:port, with TLS and the
    token as security says (SecurityError when it would expose plaintext); returns the server
    and its bound port. serving=False: health answers NOT_SERVING until set_serving says otherwise."""
    security = security or GrpcSecurity()
    security.check_listen(host)
    server, health_servicer = make_server([service_name], observe, security, reflection)
    add_servicer(servicer, server)
    try:
        bound = security.add_port(server, f"{host}:{port}")
    except RuntimeError as e:  # grpc's "Failed to bind to address"
        raise SpecdError(f"{service_name}: cannot listen on {host}:{port} (in use by another process?)") from e
    await server.start()
    _HEALTH[server] = health_servicer
    await mark_serving(health_servicer, [service_name], serving)
    return server, bound


async def mark_serving(health_servicer: health.aio.HealthServicer, service_names: list[str],
                       serving: bool = True) -> None:
    """Health of "" and service_names: SERVING or NOT_SERVING; LIVENESS: SERVING. Ignored once
    the servicer drains (enter_graceful_shutdown)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)


async def set_serving(server: grpc.aio.Server, service_names: list[str], serving: bool) -> None:
    """mark_serving on the health servicer of a server made by start_server."""
    health_servicer = _HEALTH.get(server)
    if health_servicer is not None:
        await mark_serving(health_servicer, service_names, serving)


async def watch_health(server: grpc.aio.Server, service_names: list[str], probe, period_s: float = 0.5) -> None:
    """Keep the server's health equal to `await probe()` (True: SERVING), checked every period_s;
    runs until cancelled. A probe that raises counts as not serving."""
    last = None
    while True:
        try:
            ok = bool(await probe())
        except Exception:  # noqa: BLE001 - any failure of a dependency check means not ready
            ok = False
        if ok != last:
            if last is not None:
                log.warning("now %s", "SERVING" if ok else "NOT_SERVING (a dependency is unreachable)")
            await set_serving(server, service_names, ok)
            last = ok
        await asyncio.sleep(period_s)


async def serve_until_signal(name: str, server: grpc.aio.Server, port: int, registry, host: str,
                             metrics_port: int, grace_s: float = DEFAULT_DRAIN_GRACE_S) -> None:
    """The tail of every gRPC process: export registry at /metrics on metrics_port, say where
    both listen, and serve until SIGINT or SIGTERM (then drain for up to grace_s)."""
    from services.common.metrics import serve_metrics

    _, bound = serve_metrics(registry, host, metrics_port)
    print(f"specd {name} listening on {host}:{port} (metrics: http://{host}:{bound}/metrics)", flush=True)
    await run_until_signal(server, grace_s)


async def run_until_signal(server: grpc.aio.Server, grace_s: float = DEFAULT_DRAIN_GRACE_S) -> None:
    """Serve until SIGINT or SIGTERM, then drain: health NOT_SERVING, new calls refused
    (UNAVAILABLE), calls in flight finish for up to grace_s (it returns as soon as they have);
    a second signal cancels them and returns at once."""
    import signal

    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[int] = asyncio.Queue()
    handled = (signal.SIGINT, signal.SIGTERM)
    for sig in handled:
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    try:
        await signals.get()
        log.info("draining: NOT_SERVING, refusing new calls, waiting up to %g s for calls in flight "
                 "(a second signal stops at once)", grace_s)
        health_servicer = _HEALTH.get(server)
        if health_servicer is not None:
            await health_servicer.enter_graceful_shutdown()
        stopping = asyncio.ensure_future(server.stop(grace_s))
        second = asyncio.ensure_future(signals.get())
        await asyncio.wait({stopping, second}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():
            log.warning("second signal: cancelling the calls in flight")
            await server.stop(0)
            await stopping
        second.cancel()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


def channel_options(address: str) -> list[tuple[str, object]]:
    """CHANNEL_OPTIONS, with calls spread over the processes an address names where it names
    several (a dns: name, a list)."""
    return [*CHANNEL_OPTIONS, SPREAD] if address.startswith("dns:") or "," in address else CHANNEL_OPTIONS


def channel(address: str, security: GrpcSecurity | None = None) -> grpc.aio.Channel:
    """A channel to address, with TLS and the token as security says (plaintext by default)."""
    return (security or GrpcSecurity()).aio_channel(address, channel_options(address))


async def check_health(address: str, timeout_s: float = 2.0, security: GrpcSecurity | None = None,
                       service: str = "") -> bool:
    """True when the service at address answers SERVING to the standard health check for
    `service` ("": whether it can serve requests; LIVENESS: whether the process runs)."""
    async with channel(address, security) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
