"""Building a gRPC service process: the error interceptor, the standard health service
(grpcio-health-checking), server reflection (grpcio-reflection), message size limits and
channel options shared by clients."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.grpc_errors import ErrorInterceptor, Observe

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


def make_server(service_names: list[str], observe: Observe | None = None
                ) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A server with the interceptor, health (SERVING for "" and every name) and reflection;
    observe(method, code, seconds) is called as each call ends."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor(observe)], options=CHANNEL_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server)
    return server, health_servicer


async def start_server(service_name: str, add_servicer, servicer, host: str, port: int,
                       observe: Observe | None = None) -> tuple[grpc.aio.Server, int]:
    """Serve one servicer with health and reflection; returns the server and its bound port."""
    server, health_servicer = make_server([service_name], observe)
    add_servicer(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await mark_serving(health_servicer, [service_name])
    return server, bound


async def mark_serving(health_servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def serve_until_signal(name: str, server: grpc.aio.Server, port: int, registry, host: str,
                             metrics_port: int) -> None:
    """The tail of every gRPC process: export registry at /metrics on metrics_port, say where
    both listen, and serve until SIGINT or SIGTERM."""
    from services.common.metrics import serve_metrics

    _, bound = serve_metrics(registry, host, metrics_port)
    print(f"specd {name} listening on {host}:{port} (metrics: http://{host}:{bound}/metrics)", flush=True)
    await run_until_signal(server)


async def run_until_signal(server: grpc.aio.Server, grace_s: float = 5.0) -> None:
    """Serve until SIGINT or SIGTERM, then stop, letting calls in flight finish for grace_s."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace_s)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def check_health(address: str, timeout_s: float = 2.0) -> bool:
    """True when the service at address answers SERVING to the standard health check."""
    async with channel(address) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
