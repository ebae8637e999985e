"""`specd serve coordinator`: the coordinator as its own gRPC service (specd.coordinator.v1).

It listens at once, answering NOT_SERVING while it waits (with backoff, up to
startup_timeout_s) for its target; from then on its health follows the target's (checked every
HEALTH_PERIOD_S): NOT_SERVING while the target is unreachable, SERVING again when it is back. A
missing draft does not make it NOT_SERVING: requests fall back to the target alone."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.metrics import RpcMetrics
from services.common.security import GrpcSecurity
from services.common.server import serve_until_signal, start_server, watch_health
from services.common.settings import CoordinatorSettings
from services.common.startup import retry_until_connected
from services.common.state import build_state_store
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.coordinator.servicer import SERVICE_NAME, CoordinatorServicer
from services.proto.specd.coordinator.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)

HEALTH_PERIOD_S = 0.5  # between checks of the target's health


def build_coordinator(s: CoordinatorSettings) -> Coordinator:
    security = GrpcSecurity.from_settings(s)
    security.check_dial(s.target_address, s.draft_address)
    cfg = CoordinatorConfig(s.target_address, s.draft_address or None, s.overlap, s.request_timeout_s,
                            s.draft_stall_s, security=security, max_draft_tokens=s.max_draft_tokens)
    return Coordinator(cfg, build_state_store(s.redis_url))


async def start(s: CoordinatorSettings, coordinator: Coordinator) -> tuple[grpc.aio.Server, int]:
    """Listen (NOT_SERVING), wait for the target, then keep health equal to the target's until
    the coordinator is closed; Unavailable past startup_timeout_s (the server is stopped)."""
    server, port = await start_server(SERVICE_NAME, coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
                                      CoordinatorServicer(coordinator, s.default_policy), s.host, s.port,
                                      RpcMetrics(coordinator.registry, "coordinator").observe,
                                      GrpcSecurity.from_settings(s), s.reflection, serving=False)
    try:
        await retry_until_connected(coordinator.connect, f"target service {s.target_address}", s.startup_timeout_s)
    except BaseException:
        await server.stop(0)
        raise
    watcher = asyncio.ensure_future(watch_health(server, [SERVICE_NAME], coordinator.ready, HEALTH_PERIOD_S))
    coordinator.on_close(watcher.cancel)
    log.info("coordinator listening on %s:%d (target %s, draft %s)", s.host, port, s.target_address,
             s.draft_address or "none")
    return server, port


async def serve(s: CoordinatorSettings) -> None:
    coordinator = build_coordinator(s)
    try:
        server, port = await start(s, coordinator)
        await serve_until_signal("coordinator", server, port, coordinator.registry, s.host, s.metrics_port,
                                 s.drain_grace_s)
    finally:
        await coordinator.close()
