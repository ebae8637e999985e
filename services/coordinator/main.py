"""`specd serve coordinator`: the coordinator as its own gRPC service (specd.coordinator.v1)."""

from __future__ import annotations

import logging

import grpc

from services.common.metrics import RpcMetrics
from services.common.server import serve_until_signal, start_server
from services.common.settings import CoordinatorSettings
from services.common.state import build_state_store
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.coordinator.servicer import SERVICE_NAME, CoordinatorServicer
from services.proto.specd.coordinator.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)


def build_coordinator(s: CoordinatorSettings) -> Coordinator:
    cfg = CoordinatorConfig(s.target_address, s.draft_address or None, s.overlap, s.request_timeout_s,
                            s.draft_stall_s)
    return Coordinator(cfg, build_state_store(s.redis_url))


async def start(s: CoordinatorSettings, coordinator: Coordinator) -> tuple[grpc.aio.Server, int]:
    await coordinator.connect()
    server, port = await start_server(SERVICE_NAME, coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
                                      CoordinatorServicer(coordinator, s.default_policy), s.host, s.port,
                                      RpcMetrics(coordinator.registry, "coordinator").observe)
    log.info("coordinator listening on %s:%d (target %s, draft %s)", s.host, port, s.target_address,
             s.draft_address or "none")
    return server, port


async def serve(s: CoordinatorSettings) -> None:
    coordinator = build_coordinator(s)
    server, port = await start(s, coordinator)
    await serve_until_signal("coordinator", server, port, coordinator.registry, s.host, s.metrics_port)
